"""A Qwen3-MoE GGUF whose experts are K-quant super-blocks (what a Q4_K_M file stores), written with gguf's own
writer: random valid blocks (reference.random_k_blocks), every other tensor float32. Layer 0: gate/up Q4_K, down
Q6_K; layer 1: gate/up Q5_K, down Q4_K — each format of QMoE in both of its places. Its float twin holds the same
experts dequantized by gguf's own `dequantize` (a reference that is not llgraph's code).

    python tests/kquant_moe.py OUT.gguf [--float OUT-F32.gguf]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference import random_k_blocks  # noqa: E402

HIDDEN, FFN, EXPERTS, TOP_K, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 256, 8, 2, 2, 4, 2, 64, 97
FORMATS = [("Q4_K", "Q6_K"), ("Q5_K", "Q4_K")]  # (gate and up, down) per layer


def write(path: Path, seed: int = 0, dequantized: bool = False, formats=FORMATS) -> Path:
    """The K-quant file (or, `dequantized`, its float32 twin) at `path`; `formats`: each layer's (gate and up, down)
    block types."""
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    arch = "qwen3moe"
    for key, value in (("block_count", LAYERS), ("context_length", 128), ("embedding_length", HIDDEN),
                       ("feed_forward_length", 512), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("expert_count", EXPERTS),
                       ("expert_used_count", TOP_K), ("attention.key_length", HEAD_DIM),
                       ("attention.value_length", HEAD_DIM), ("expert_feed_forward_length", FFN)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)

    def dense(name, *shape, scale=None):
        scale = scale if scale is not None else shape[-1] ** -0.5
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))
    dense("token_embd.weight", VOCAB, HIDDEN, scale=1.0)
    dense("output.weight", VOCAB, HIDDEN)
    dense("output_norm.weight", HIDDEN, scale=0.1)
    for i, (gate_kind, down_kind) in enumerate(formats):
        p = f"blk.{i}"
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"{p}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for norm in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(f"{p}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HEAD_DIM)).astype(np.float32))
        dense(f"{p}.attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        dense(f"{p}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        dense(f"{p}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        dense(f"{p}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        dense(f"{p}.ffn_gate_inp.weight", EXPERTS, HIDDEN, scale=1.0)
        for name, kind, rows, cols in (("gate", gate_kind, FFN, HIDDEN), ("up", gate_kind, FFN, HIDDEN),
                                       ("down", down_kind, HIDDEN, FFN)):
            qtype = gguf.GGMLQuantizationType[kind]
            blocks = random_k_blocks((EXPERTS * rows, cols), qtype, seed + 10 * i).reshape(EXPERTS, rows, -1)
            if dequantized:
                w.add_tensor(f"{p}.ffn_{name}_exps.weight", dequantize(blocks, qtype).astype(np.float32))
            else:
                w.add_tensor(f"{p}.ffn_{name}_exps.weight", blocks, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    write(Path(sys.argv[1]))
    if "--float" in sys.argv:
        write(Path(sys.argv[sys.argv.index("--float") + 1]), dequantized=True)
