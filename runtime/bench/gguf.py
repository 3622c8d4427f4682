"""Real-size test models: Llama-shaped GGUFs in llama.cpp's Q4_K_M layout with random codes, for speed benchmarks
(decode and prefill speed do not depend on the values), written with gguf's own writer, tensor by tensor.

    python -m llgraph.runtime.bench.gguf 1b OUT.gguf      # Llama-3.2-1B shapes (hidden 2048, 16 layers, ffn 8192)
    python -m llgraph.runtime.bench.gguf 8b OUT.gguf      # Llama-3.1-8B shapes (4096, 32 layers, ffn 14336)
    python -m llgraph.runtime.bench.gguf 1b OUT.gguf --vocab 128256   # Llama 3's vocabulary size
    python -m llgraph.runtime.bench.gguf gemma3-270m OUT.gguf          # Gemma 3 270M / 1B shapes (gemma3 arch)
    python -m llgraph.runtime.bench.gguf qwen2.5-0.5b OUT.gguf         # Qwen2.5-0.5B (q/k/v biases, tied)
    python -m llgraph.runtime.bench.gguf gemma2-small|olmo2-small|phi3-small OUT.gguf   # the other families'
                                                                       # switches at 1,024 hidden, 8 layers
    python -m llgraph.runtime.bench.gguf olmoe-1b-7b OUT.gguf          # mixtures of experts: OLMoE-1B-7B (64 experts
    python -m llgraph.runtime.bench.gguf qwen3-30b-a3b OUT.gguf --layers 12   # of 1,024, 8 a token), Qwen3-30B-A3B
                                                                       # (128 of 768, 8 a token; 48 layers, 17 GB)
    python -m llgraph.runtime.bench.gguf gpt-oss-20b OUT.gguf --layers 8     # gpt-oss-20b as its GGUFs store it
                                  # (MXFP4 experts, 32 of 2,880, 4 a token; Q8_0 elsewhere; 24 layers, 12 GB)

The layout: Q4_K for every Linear and the embedding (a mixture's experts too: ffn_gate_exps, ffn_up_exps; its
router ffn_gate_inp F32), Q6_K for `output` and for every other layer's `attn_v` and
`ffn_down` (llama.cpp's Q4_K_M gives those more bits), F32 norms; a tensor whose rows are not whole super-blocks
(Gemma 3's and Qwen2.5's hidden sizes) in llama.cpp's fallbacks, Q5_0 for Q4_K and Q8_0 for Q6_K. Super-blocks hold
uniform random codes and sub-block scales and mins, with float16 d and dmin chosen so the weights are about zero-
mean with std ~0.02 (a real model's). The tokenizer is SmolLM2's (from the bundled GGUF: BPE vocabulary, merges,
chat template), so llama.cpp, ik_llama.cpp and llgraph all load the same file; `--vocab` past its 49,152 tokens pads
it with reserved control tokens, as Llama 3's own are.

Measured (2026-11-27, this 2-core AVX-512 host, read probe 31-34 GB/s):

The families' GGUFs (`python -m llgraph.runtime.bench.gguf gemma3-270m|qwen2.5-0.5b OUT.gguf`: random weights in
llama.cpp's Q4_K_M layout; Gemma's and Qwen's hidden sizes are not whole super-blocks, so those rows take llama.cpp's
fallbacks, Q5_0 and Q8_0 — llgraph carries Q5_0's codes in 8 bits, so it reads more bytes a token), on a host whose
read probe gave 31-34 GB/s (slow memory hides kernel differences at 2 threads, so 1 thread is shown too), `llgraph
bench GGUF -p 128 -n 64 --repeats 2 --threads T --peer 'llama-bench=PATH'` (llama.cpp 0.3.36's vendored source,
built natively):

| model (bytes a token: llgraph / llama.cpp) | threads | llgraph pp / tg | llama.cpp pp / tg | ratio pp / tg |
|---|---|---|---|---|
| Gemma 3 270M shapes, Q4_K + Q5_0 + Q8_0 + Q6_K (0.287 / 0.247 GB) | 1 | 375 / 59.7 | 402 / 58.6 | 0.93 / 1.02 |
| | 2 | 689 / 93.2 | 735 / 86.9 | 0.94 / 1.07 |
| Gemma 3 270M shapes, Q8_0 for Q5_0 (0.287 / 0.270 GB) | 1 | 381 / 62.8 | 483 / 77.1 | 0.79 / 0.82 |
| | 2 | 688 / 97.8 | 895 / 92.7 | 0.77 / 1.06 |
| Qwen2.5-0.5B shapes, Q8_0 for Q5_0 (0.488 / 0.486 GB) | 1 | 120 / 34.4 | 158 / 44.8 | 0.76 / 0.77 |
| | 2 | 234 / 61.1 | 300 / 58.6 | 0.78 / 1.04 |

The Q8_0 rows run on the exact fp32 kernel (the blocked formats' default) where llama.cpp multiplies int8: the
kernels' pace on one thread is issue 50's work. Mean KL from the float64 reference over 254 positions
(`python -m llgraph.runtime.bench.kl GGUF --text README.md --ctx 256 --chunks 2 --llama-perplexity PATH`, the Q8_0
files): Gemma 3 270M llgraph 0.00002, llama.cpp 0.00010; Qwen2.5-0.5B 0.00003 and 0.00019 — both engines read the
files alike.

Whole models on these files, `llgraph bench FILE -p P -n N --repeats 2 --threads T --peer llama-bench=PATH` (and
`--peer 'llama-bench=IK_PATH -rtr 1'`, ik_llama.cpp, where named), one run each; tg / pp tok/s, llgraph's over the
peer's (2 cores of an AMD EPYC with AVX-512 VNNI; the read probe beside each):
- 1B shapes made Q3_K_M / Q2_K / IQ4_XS by `llama-quantize`, 1 thread, -p 512 -n 64 (probes 27.8 / 26.4 / 25.9 GB/s):
  tg 37.7 / 40.7 / 41.8, pp 80.1 / 70.7 / 107.1; over llama.cpp tg 1.46 / 1.37 / 1.94, pp 0.93 / 1.35 / 0.91; over
  ik_llama.cpp tg 1.08 / 1.01 / 1.11, pp 0.85 / 0.74 / 0.96.
  Since 2026-11-30 a prefill decodes each super-block once for all its rows (plugins/cpu/superblocks_panel.inc),
  the same files, -p 512 -n 32, llama.cpp and ik_llama.cpp `-rtr 1` (head 8337e4cd3) in the same run: Q3_K_M 1 / 2
  threads (probes 26.5 / 34.6 GB/s) pp 108.6 / 207.6, over llama.cpp 1.22 / 1.24, over ik_llama.cpp 1.13 / 1.14
  (tg 1.49 / 1.39 and 1.10 / 0.89); IQ4_XS (30.1 / 34.9 GB/s) pp 123.7 / 243.0, over llama.cpp 1.04 / 1.03, over
  ik_llama.cpp 1.09 / 1.10 (tg 2.00 / 1.43 and 1.10 / 1.00). The 1B Q4_K_M itself (33.7 / 57.6 GB/s): pp 112.6 /
  221.1, over llama.cpp 1.51 / 1.47, over ik_llama.cpp 1.13 / 1.10.
- 8B shapes made the same (3.52 / 2.74 / 3.94 GB a token), 1 thread, -p 128 -n 32 (25.0 / 24.0 / 30.0 GB/s): tg
  3.8 / 4.8 / 5.6, pp 9.9 / 10.3 / 17.6; over llama.cpp tg 1.30 / 1.27 / 1.84, pp 1.05 / 1.50 / 0.98; over
  ik_llama.cpp tg 0.96 / 0.94 / 0.87, pp 0.93 / 0.84 / 1.07. The 8B IQ4_XS with the prefill's Panel path
  (2026-11-30, 1 / 2 threads, -p 128 -n 32, probes 30.6 / 33.3 GB/s): pp 20.6 / 38.2, tg 6.4 / 10.0; over llama.cpp
  pp 1.14 / 1.09 (0.98 before), tg 2.00 / 1.75; over ik_llama.cpp pp 1.24 / 1.17, tg 0.98 / 0.84. The 8B Q3_K_M
  likewise (31.8 / 35.7 GB/s): pp 17.0 / 33.6, tg 5.9 / 8.7; over llama.cpp pp 1.33 / 1.34 (1.05 before), tg 1.42 /
  1.22; over ik_llama.cpp pp 1.23 / 1.24 (0.93), tg 1.14 / 0.97.
- 1B shapes made IQ3_S by `llama-quantize --allow-requantize` (97 IQ3_S tensors, run as Q5_K: 0.752 GB a token
  against the file's 0.503), 1 / 2 threads, -p 128 -n 64 (29.2 / 28.9 GB/s): tg 32.5 / 41.2, pp 97.8 / 178.7; over
  llama.cpp tg 3.59 / 2.48, pp 0.99 / 0.94 (ggml's IQ3_S dot product decodes its grid at 4.6-8.4 GB/s: the exact Q5_K
  repacking reads 1.5x the bytes and decodes 2.5-3.6x faster, so no kernel of IQ3_S's own bits is worth writing).
  Made IQ3_XXS (with an imatrix: 48 IQ3_XXS, 17 IQ3_S, 32 IQ2_S tensors; this random model's IQ3_XXS scales sit
  near float16's smallest normals, where d / 2 is no float16, so its IQ3_XXS tensors ran as 8-bit blocks: 1.138 GB
  a token against 0.443; a real SmolLM2's all run as Q6_K), 1 / 2 threads (32.1 / 35.7 GB/s): tg 20.7 / 40.7, pp
  90.8 / 171.5; over llama.cpp tg 1.96 / 2.08, pp 1.00 / 0.99. Since 2026-11-30 every IQ3_XXS tensor runs as Q6_K
  with the file's d and exponent -1 (llgraph/grid_superblocks.py): 0.893 GB a token (its IQ2_S tensors still as
  8-bit blocks), probes 29.1 / 35.6 GB/s: tg 30.8 / 51.9, pp 86.4 / 155.3; over llama.cpp tg 2.89 / 2.71, pp 0.94 /
  0.91 (Q6_K's level-4 GEMM at 128 rows is behind the 8-bit blocks' on this file; at the 8B down shape it is 1.04x
  ggml's own Q6_K at 512 rows, `runtime/bench/gemv.py`). With the prefill's Panel path, -p 512 (32.9 / 63.7 GB/s):
  pp 99.5 / 174.9, over llama.cpp 1.00 / 0.93, over ik_llama.cpp 1.81 / 1.64 (its IQ2_S tensors still run as
  8-bit blocks).
- Gemma 3 1B Q4_K_M shapes, 1 / 2 threads, -p 128 -n 64 (28.6 / 32.3 GB/s): tg 21.8 / 31.0, pp 123.4 / 235.3; over
  llama.cpp tg 1.10 / 1.06, pp 1.83 / 1.72.
- SmolLM2-135M-Instruct Q4_1 (bundled), 1 / 2 threads, -p 512 -n 128 (30.7 / 33.1 GB/s): tg 119.8 / 188.2, pp 296.8
  / 551.7; over llama.cpp tg 1.64 / 1.63, pp 1.73 / 1.74. Its Q4_K_M from F16 by `llama-quantize` (27.7 / 34.5
  GB/s): tg 114.6 / 170.5, pp 496.4 / 944.3; tg 1.28 / 1.38, pp 1.45 / 1.56.
- OLMoE-1B-7B shapes Q4_K_M (64 experts, 8 a token), 1 / 2 threads, -p 128 -n 32 (30.4 / 59.4 GB/s): tg 33.9 / 48.2,
  pp 80.2 / 127.9; over llama.cpp tg 1.21 / 1.26, pp 1.79 / 1.47.
- Qwen3-30B-A3B shapes, 12 of its 48 layers (`qwen3-30b-a3b --layers 12`), Q4_K_M (128 experts, 8 a token), with
  ik_llama.cpp `-rtr 1 -fmoe 1` (29.3 / 49.6 GB/s): tg 35.2 / 40.3, pp 112.1 / 199.2; over llama.cpp tg 1.20 /
  0.99, pp 1.64 / 1.58; over ik_llama.cpp tg 0.87 / 0.86, pp 0.85 / 0.82 (three more runs: tg 0.99-1.03, pp
  0.81-0.86 against ik_llama.cpp: this host's memory moves decode by 15% from run to run). Again 2026-11-30
  (ik_llama.cpp built from its head 8337e4cd3; -p 128 -n 32 --repeats 2; probes 32.8 / 34.7 GB/s): tg 37.5 / 44.1,
  pp 118.2 / 221.9; over llama.cpp tg 1.18 / 0.98, pp 1.67 / 1.64; over ik_llama.cpp tg 0.97 / 0.94, pp 0.91 / 0.88
  (at 2 threads all three decode at 29.8-31.4 GB/s, the memory's pace).
- gpt-oss-20b shapes, 8 of its 24 layers (`gpt-oss-20b --layers 8`: MXFP4 experts, 32 of 2,880, 4 a token; Q8_0
  elsewhere; 1.27 GB a token, half of it the 201,088-row head), ik_llama.cpp `-rtr 1 -fmoe 1` (25.4 / 34.6 GB/s): tg
  22.1 / 24.1, pp 89.8 / 165.7; over llama.cpp tg 1.47 / 0.91, pp 2.86 / 2.77; over ik_llama.cpp tg 2.36 / 1.48, pp
  1.63 / 1.55 (another 1-thread run: tg 19.7 against llama.cpp's 14.8, 1.33).
- The three mixtures again, later on 2026-11-30 (`llgraph bench FILE -p 128 -n 32 --repeats 3 --threads T --peer
  llama-bench=PATH --peer 'llama-bench=IK_PATH -rtr 1 -fmoe 1'`; ik_llama.cpp head 8337e4cd3 refuses the OLMoE
  file, "failed to load model", so its rows have llama.cpp alone), 1 / 2 threads, tg32 and pp128 tok/s, bytes a
  token llgraph / llama.cpp:
  Qwen3-30B-A3B 12 layers (0.676 / 0.671 GB; probes 33.9 / 35.8 GB/s): tg 40.0 / 46.9, pp 131.6 / 241.8; over
  llama.cpp tg 1.27 / 1.05, pp 1.86 / 1.79; over ik_llama.cpp tg 1.03 / 0.70, pp 0.98 / 0.97. gpt-oss-20b 8 layers
  (1.271 / 1.268 GB; 32.9 / 33.0 GB/s): tg 21.3 / 23.8, pp 91.2 / 165.8; over llama.cpp tg 1.38 / 0.94, pp 2.90 /
  2.69; over ik_llama.cpp (rebuilt since the row above) tg 1.02 / 0.75, pp 0.92 / 0.87. OLMoE-1B-7B (0.745 / 0.741
  GB; 32.4 / 27.0 GB/s): tg 31.8 / 38.0, pp 81.5 / 137.5; over llama.cpp tg 1.14 / 0.92, pp 1.84 / 1.57 (a run
  minutes before: tg 1.19 / 1.04, pp 1.84 / 1.60).
  The 2-thread decode ratios are this host's, not the kernels': its 2-thread read speed moves between two levels
  for minutes at a time (the same llgraph process decodes the Qwen3 file at 65 tok/s, or at 45-48, for all its
  steps), and ik_llama.cpp run alone moved alike (46.9, 48.5, 46.8 tok/s in a row, against 65-67 inside the
  benchmark above); with 6 repeats in turn, `--repeats 6 --threads 2 --peer 'llama-bench=IK_PATH -rtr 1 -fmoe 1'`,
  both caught the fast level: tg 64.6 against 65.5 (0.99), pp64 222.5 against 246.1 (0.90). One thread, where the
  memory is steady, shows the kernels: decode at or above ik_llama.cpp on all three.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

SHAPES = {  # hidden, layers, heads, kv heads, ffn
    "1b": (2048, 16, 32, 8, 8192),
    "8b": (4096, 32, 32, 8, 14336),
    "gemma3-270m": (640, 18, 4, 1, 2048),
    "gemma3-1b": (1152, 26, 4, 1, 6912),
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864),
    # the other families' block switches at a small size (not a released model's shapes; for KL against llama.cpp)
    "gemma2-small": (1024, 8, 8, 4, 4096),
    "olmo2-small": (1024, 8, 8, 8, 4096),
    "phi3-small": (1024, 8, 8, 8, 4096),
    # mixtures of experts: ffn is each expert's (MOE: experts, experts a token)
    "olmoe-1b-7b": (2048, 16, 16, 16, 1024),
    "qwen3-30b-a3b": (2048, 48, 32, 4, 768),
    "gpt-oss-20b": (2880, 24, 64, 8, 2880),
}
MOE = {"olmoe-1b-7b": (64, 8), "qwen3-30b-a3b": (128, 8), "gpt-oss-20b": (32, 4)}
# the architecture, head_dim and vocabulary of the shapes that are not Llama's
FAMILY = {"gemma3-270m": ("gemma3", 256, 262144), "gemma3-1b": ("gemma3", 256, 262144),
          "qwen2.5-0.5b": ("qwen2", 64, 151936), "gemma2-small": ("gemma2", 128, None),
          "olmo2-small": ("olmo2", 128, None), "phi3-small": ("phi3", 128, None),
          "olmoe-1b-7b": ("olmoe", 128, 50304), "qwen3-30b-a3b": ("qwen3moe", 128, 151936),
          "gpt-oss-20b": ("gpt-oss", 64, 201088)}
Q8_0 = (34, {0: 2.7e-4})  # 32 int8 codes after a float16 d
Q5_0 = (22, {0: 4.3e-3})  # a float16 d, 32 high bits, 16 bytes of low nibbles
# (bytes per 256-weight super-block, {byte offset of a float16 field: its value}); Q4_K/Q5_K: d, dmin; Q6_K: d
K_BLOCKS = {"Q4_K": (144, {0: 8e-5, 2: 6e-4}), "Q6_K": (210, {208: 1.6e-5})}
MXFP4 = (17, 2 ** -8)  # an E8M0 exponent byte (2^(e - 128): e = 120, weights up to 12 times it), 16 of nibbles
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.merges", "tokenizer.chat_template",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
                  "tokenizer.ggml.add_space_prefix")


def random_mxfp4(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 32 * 17] uint8: MXFP4 blocks of random nibbles after their E8M0 exponent."""
    raw = rng.integers(0, 256, size=(rows, cols // 32, MXFP4[0]), dtype=np.uint8)
    raw[..., 0] = 128 + int(np.log2(MXFP4[1]))
    return raw.reshape(rows, -1)


def random_k_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 256 * bytes] uint8: random K-quant super-blocks with the float16 fields of K_BLOCKS."""
    size, halves = K_BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for offset, value in halves.items():
        raw[..., offset:offset + 2] = np.full(raw.shape[:-1] + (1,), value, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def random_q8_0(rows: int, cols: int, rng: np.random.Generator, layout=Q8_0) -> np.ndarray:
    """[rows, cols / 32 * bytes] uint8: Q8_0 (or Q5_0) blocks of random codes after their float16 d."""
    size, halves = layout
    raw = rng.integers(0, 256, size=(rows, cols // 32, size), dtype=np.uint8)
    raw[..., 0:2] = np.full(raw.shape[:-1] + (1,), halves[0], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def tensors(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, arch: str = "llama",
            head_dim: int | None = None, experts: int = 0):
    """(gguf name, [rows, cols] or [experts, rows, cols], type) of every tensor, in llama.cpp's order: Gemma 3's
    QK-norms and post-sublayer norms (Gemma 2's post-sublayer norms), Qwen2's q/k/v biases, and those three with a
    tied head (no `output`); OLMo 2's whole-projection QK-norms and post-sublayer norms only; Phi-3's fused qkv and
    gate/up; a mixture's router and stacked experts (OLMoE's whole-projection QK-norms, Qwen3-MoE's per head)."""
    d = head_dim or hidden // heads
    q, kv = heads * d, kv_heads * d

    def k_quant(kind, cols):  # llama.cpp's fallback for rows that are not whole super-blocks
        return kind if cols % 256 == 0 else "Q5_0" if kind == "Q4_K" else "Q8_0"
    if arch == "gpt-oss":
        yield from _gpt_oss_tensors(hidden, layers, heads, kv_heads, ffn, vocab, d, experts)
        return
    tied = arch in ("qwen2", "gemma2", "gemma3")
    post = arch in ("gemma2", "gemma3", "olmo2")  # norms after each sublayer
    yield "token_embd.weight", (vocab, hidden), k_quant("Q6_K" if tied else "Q4_K", hidden)
    for i in range(layers):
        more = "Q6_K" if i % 2 == 0 else "Q4_K"
        if arch != "olmo2":
            yield f"blk.{i}.attn_norm.weight", (hidden,), "F32"
        if arch == "phi3":
            yield f"blk.{i}.attn_qkv.weight", (q + 2 * kv, hidden), k_quant("Q4_K", hidden)
        else:
            yield f"blk.{i}.attn_q.weight", (q, hidden), k_quant("Q4_K", hidden)
            yield f"blk.{i}.attn_k.weight", (kv, hidden), k_quant("Q4_K", hidden)
            yield f"blk.{i}.attn_v.weight", (kv, hidden), k_quant(more, hidden)
        if arch in ("olmo2", "olmoe"):
            yield f"blk.{i}.attn_q_norm.weight", (q,), "F32"
            yield f"blk.{i}.attn_k_norm.weight", (kv,), "F32"
        if arch == "qwen2":
            for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                yield f"blk.{i}.{name}.bias", (rows,), "F32"
        if arch in ("gemma3", "qwen3moe"):
            yield f"blk.{i}.attn_q_norm.weight", (d,), "F32"
            yield f"blk.{i}.attn_k_norm.weight", (d,), "F32"
        yield f"blk.{i}.attn_output.weight", (hidden, q), k_quant("Q4_K", q)
        if post:
            yield f"blk.{i}.post_attention_norm.weight", (hidden,), "F32"
        if arch != "olmo2":
            yield f"blk.{i}.ffn_norm.weight", (hidden,), "F32"
        if experts:
            yield f"blk.{i}.ffn_gate_inp.weight", (experts, hidden), "F32"
            yield f"blk.{i}.ffn_gate_exps.weight", (experts, ffn, hidden), k_quant("Q4_K", hidden)
            yield f"blk.{i}.ffn_up_exps.weight", (experts, ffn, hidden), k_quant("Q4_K", hidden)
            yield f"blk.{i}.ffn_down_exps.weight", (experts, hidden, ffn), k_quant(more, ffn)
        elif arch == "phi3":
            yield f"blk.{i}.ffn_up.weight", (2 * ffn, hidden), k_quant("Q4_K", hidden)
        else:
            yield f"blk.{i}.ffn_gate.weight", (ffn, hidden), k_quant("Q4_K", hidden)
            yield f"blk.{i}.ffn_up.weight", (ffn, hidden), k_quant("Q4_K", hidden)
        if not experts:
            yield f"blk.{i}.ffn_down.weight", (hidden, ffn), k_quant(more, ffn)
        if post:
            yield f"blk.{i}.post_ffw_norm.weight", (hidden,), "F32"
    yield "output_norm.weight", (hidden,), "F32"
    if not tied:
        yield "output.weight", (vocab, hidden), "Q6_K"


def _gpt_oss_tensors(hidden, layers, heads, kv_heads, ffn, vocab, d, experts):
    """gpt-oss as llama.cpp's MXFP4_MOE writes it: experts MXFP4 with F32 biases, attention (q/k/v/o with biases,
    sinks) and the embedding and head Q8_0, the router F32 with its bias, the pre-MLP norm `post_attention_norm`."""
    q, kv = heads * d, kv_heads * d
    yield "token_embd.weight", (vocab, hidden), "Q8_0"
    for i in range(layers):
        yield f"blk.{i}.attn_norm.weight", (hidden,), "F32"
        for name, rows, cols in (("attn_q", q, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, q)):
            yield f"blk.{i}.{name}.weight", (rows, cols), "Q8_0"
            yield f"blk.{i}.{name}.bias", (rows,), "F32"
        yield f"blk.{i}.attn_sinks.weight", (heads,), "F32"
        yield f"blk.{i}.post_attention_norm.weight", (hidden,), "F32"
        yield f"blk.{i}.ffn_gate_inp.weight", (experts, hidden), "F32"
        yield f"blk.{i}.ffn_gate_inp.bias", (experts,), "F32"
        for name, rows, cols in (("ffn_gate_exps", ffn, hidden), ("ffn_up_exps", ffn, hidden),
                                 ("ffn_down_exps", hidden, ffn)):
            yield f"blk.{i}.{name}.weight", (experts, rows, cols), "MXFP4"
            yield f"blk.{i}.{name}.bias", (experts, rows), "F32"
    yield "output_norm.weight", (hidden,), "F32"
    yield "output.weight", (vocab, hidden), "Q8_0"


def _bytes(shape, kind) -> int:
    if kind == "F32":
        return 4 * int(np.prod(shape))
    if kind == "MXFP4":
        return int(np.prod(shape)) // 32 * MXFP4[0]
    size, per = (Q8_0[0], 32) if kind == "Q8_0" else (Q5_0[0], 32) if kind == "Q5_0" else (K_BLOCKS[kind][0], 256)
    return int(np.prod(shape)) // per * size


def write(size: str, out: Path, vocab: int | None = None, seed: int = 0, layers: int | None = None) -> Path:
    import gguf
    from tqdm import tqdm

    from llgraph.bundled import bundled_model
    from llgraph.gguf_source import gguf_reader

    hidden, all_layers, heads, kv_heads, ffn = SHAPES[size]
    layers = layers or all_layers
    experts, used = MOE.get(size, (0, 0))
    arch, head_dim, family_vocab = FAMILY.get(size, ("llama", hidden // heads, None))
    vocab = vocab or family_vocab
    source = gguf_reader(bundled_model("smollm2"))
    tokens = [bytes(source.fields["tokenizer.ggml.tokens"].parts[i]).decode()
              for i in source.fields["tokenizer.ggml.tokens"].data]
    types = [int(t) for t in source.fields["tokenizer.ggml.token_type"].contents()]
    vocab = vocab or len(tokens)
    if vocab < len(tokens):
        raise SystemExit(f"--vocab ({vocab}) must be at least the tokenizer's {len(tokens)} tokens")
    tokens += [f"<|reserved_special_token_{i}|>" for i in range(vocab - len(tokens))]
    types += [gguf.TokenType.CONTROL] * (vocab - len(types))

    w = gguf.GGUFWriter(str(out), arch)
    # (llama.cpp sets Phi-3's special-token attributes by a model *name* holding "phi3", which looks up Phi-3's own
    # tokens; this file carries SmolLM2's vocabulary)
    w.add_name(f"llgraph-bench-{size.replace('phi3', 'phi')}")
    w.add_context_length(32768 if arch == "gemma3" else 8192)  # (Gemma 3 1B's own; its window bites at depth)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base({"gemma3": 1e6, "qwen2": 1e6, "gemma2": 1e4, "phi3": 1e4, "gpt-oss": 150000.0}.get(arch,
                                                                                                     500000.0))
    if arch == "gpt-oss":  # its window on every other layer, YaRN x32 from 4,096 positions
        w.add_sliding_window(128)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
    if arch == "gemma3":
        w.add_sliding_window(512)
    if arch == "gemma2":  # Gemma 2's window, attention and final softcaps
        w.add_sliding_window(4096)
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(used)
        w.add_expert_feed_forward_length(ffn)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE if arch == "gpt-oss" else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_token_list(tokens)
    w.add_token_types(types)
    for key in TOKENIZER_KEYS:
        field = source.fields.get(key)
        if field is not None:
            value = field.contents()
            w.add_key_value(key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
    plan = list(tensors(hidden, layers, heads, kv_heads, ffn, vocab, arch, head_dim, experts))
    for name, shape, kind in plan:
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), _bytes(shape, kind))
        else:
            nbytes = _bytes(shape, kind)
            w.add_tensor_info(name, (*shape[:-1], nbytes // int(np.prod(shape[:-1]))), np.dtype(np.uint8), nbytes,
                              raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    total = sum(_bytes(s, k) for _, s, k in plan)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}") as bar:
        for name, shape, kind in plan:
            rows, cols = int(np.prod(shape[:-1])), shape[-1]
            if name.endswith("ffn_gate_inp.weight"):  # a router: logits of about 1
                data = rng.standard_normal(shape, dtype=np.float32) * np.float32(hidden ** -0.5)
            elif kind == "F32":  # norms about 1 (Gemma stores 1 + w), biases and sinks small
                small = name.endswith(("bias", "sinks.weight"))
                data = (0.0 if small else 1.0) + 0.02 * rng.standard_normal(shape, dtype=np.float32)
            elif kind == "MXFP4":
                data = random_mxfp4(rows, cols, rng)
            elif kind in ("Q8_0", "Q5_0"):
                data = random_q8_0(rows, cols, rng, Q8_0 if kind == "Q8_0" else Q5_0)
            else:
                data = random_k_blocks(rows, cols, kind, rng)
            w.write_tensor_data(data)
            bar.update(data.nbytes)
    w.close()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("size", choices=sorted(SHAPES))
    p.add_argument("out", type=Path)
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: SmolLM2's 49,152)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the model's (a host whose memory "
                   "cannot hold them all)")
    args = p.parse_args(argv)
    partial = args.out.with_name(args.out.name + ".partial")
    write(args.size, partial, args.vocab, args.seed, args.layers)
    partial.replace(args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
