"""llgraph's TensorRT plugins (`llgraph build --plugins aot|jit`):

- spec.py: a plugin's inputs and fields, read from the op schema (the `trt` export and the registrations share it);
- triton_kernels.py: the Triton kernels and the one launch plan both ways of running them use;
- aot.py: Triton -> PTX for a compute capability, fitted to TensorRT's AOT launch;
- qdp.py: the `tensorrt.plugin` registrations (register, JIT impl, aot_impl, autotune).

Nothing here imports tensorrt at module load; torch and triton are imported only by the kernel modules.
"""
