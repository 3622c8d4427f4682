"""llgraph's own kernels, one room per engine that runs them:

- `cpu/`: ONNX Runtime custom ops in C++ (domain "llgraph": QLinear on the stored blocks or super-blocks, QEmbedding,
  GroupedAttention), built once per machine; chosen by `--kernels llgraph` (the CPU default where it builds).
- `tensorrt/`: TensorRT plugins (QDP) for RMSNorm, Rotary, GroupedAttention and SwiGLU, with their Triton kernels
  and ahead-of-time PTX; chosen by `llgraph build --plugins aot|jit`.

Both read their ops from the schemas in llgraph/ops.py. This floor imports the core (llgraph/) and nothing above it.
"""
