"""Decode GEMV per block type, where the machine cannot hide the kernels: one QLinear node of llgraph's CPU kernels
on an out x in matrix (default 4096 x 14336, an 8B's down projection) of each GGUF type, one token a call, as the
weights' GB/s; beside it ggml's own figure on the same shape from `test-backend-ops perf -o MUL_MAT` (built from
llama.cpp's source with -DLLAMA_BUILD_TESTS=ON; it runs on half the cores, so compare with --threads 1 on a 2-core
host; it does not repack weights as llama.cpp's model loader may) when `--ggml` names that binary; the host's read
bandwidth on 1 and 2 threads printed with them.

    python -m llgraph.runtime.bench.gemv [--threads 1] [--types Q4_K,Q5_K,Q6_K,Q8_0,Q5_0,Q4_0] [--level auto]
                                         (types also Q2_K, Q3_K, IQ4_XS, IQ4_NL, Q5_1, IQ3_XXS, IQ3_S)
                                         [--ggml /path/to/test-backend-ops] [--tokens 1] [--library A.so B.so]

`--tokens M`: M tokens a call (a serving step's decode rows; GB/s then counts the weights once a call, so it rises
with M while the kernel reuses each weight load); `--library`: time these builds of the kernels side by side,
alternating (an A/B of a kernel change in one run; default: the current build).

The weights are random valid blocks (the bytes a GGUF would hold: codes, and half-float scales inside each block);
the node is the one the ort export writes (interleaved 16 rows, the format's default accuracy level unless --level).
IQ3_XXS and IQ3_S run as the Q6_K (exponent -1) and Q5_K super-blocks whose weights they are
(llgraph/grid_superblocks.py), their GB/s counted in the IQ3 file's bytes, as ggml's own IQ3 kernels' are.

Measured (2 cores of an AMD EPYC with AVX-512 VNNI, one thread, 4096 x 14336, 1 token; GB/s of weights read,
llgraph / ggml's own GEMV = ratio; `--threads 1 --ggml test-backend-ops`, read probe 32.5 GB/s): Q4_K 30.7 / 12.8 =
2.40, Q5_K 25.1 / 12.1 = 2.07, Q6_K 26.2 / 13.3 = 1.96, Q8_0 16.4 / 12.4 = 1.32, Q5_0 12.0 / 8.9 = 1.35, Q4_0 14.8 /
8.4 = 1.77. The low-bit and non-linear types, another day (`--types Q2_K,Q3_K,IQ4_XS,IQ4_NL,Q4_K,Q6_K`, probes
30.6 / 33.0 GB/s): Q2_K 13.7 / 7.8 = 1.75, Q3_K 17.2 / 9.1 = 1.90, IQ4_XS 19.9 / 10.0 = 1.99, IQ4_NL 19.6 / 7.3 =
2.66, Q4_K 20.9 / 13.2 = 1.59, Q6_K 20.7 / 14.3 = 1.45. The IQ3 types (2026-11-30, `--types
IQ3_XXS,IQ3_S,Q6_K,Q5_K,Q4_K`, probes 31.8 / 34.8 GB/s; IQ3 GB/s in the IQ3 file's bytes): IQ3_XXS 10.4 / 4.0 = 2.64,
IQ3_S 15.1 / 4.0 = 3.82 (ggml's IQ3 kernels are bound by their grid lookups, not memory), Q6_K 1.83, Q5_K 2.44,
Q4_K 1.83; at `--tokens 8` IQ3_XXS 3.77, IQ3_S 2.63, Q6_K 3.51, Q5_K 1.57; at `--tokens 512` (a prefill's GEMM:
test-backend-ops has n = 1..5, 8, 512 at this shape) 0.97, 0.97, 1.04, 0.82. Since a prefill decodes each
super-block once for all its rows (plugins/cpu/superblocks_panel.inc; `--types Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_XS,
IQ3_XXS,IQ3_S`, probes 32.5 / 35.1 GB/s), at 512 tokens: Q2_K 0.69, Q3_K 1.05 (0.82 before), Q4_K 0.96, Q5_K 0.92
(0.80), Q6_K 1.21 (1.02), IQ4_XS 1.16 (1.09), IQ3_XXS 1.13 (0.97), IQ3_S 1.13 (0.97); at 8 tokens 1.82, 2.97, 2.27,
1.65, 3.23, 2.70, 3.48, 2.97. (Q2_K's GEMM trails ggml's at 512 rows; whole files of Q2_K blocks prefill 1.35-1.50x
llama.cpp, `runtime/bench/gguf.py`.)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time

import numpy as np

K_LAYOUT = {"Q4_K": (144, {0: 1e-3, 2: 7.5e-3}, 4), "Q5_K": (176, {0: 5e-4, 2: 7.75e-3}, 5),
            "Q6_K": (210, {208: 2e-4}, 6), "IQ4_XS": (136, {0: 2e-4}, 4),
            "Q3_K": (110, {108: 6e-3}, 3),
            "Q2_K": (84, {80: 1.5e-2, 82: 2.25e-2}, 2),
            "IQ4_NL": (18, {0: 3.5e-3}, 4)}  # bytes a (super-)block, its half-float d/dmin, code bits
GRID = {"IQ3_XXS": (98, 2.5e-4), "IQ3_S": (110, 2.5e-4)}  # bytes a super-block, its half-float d
# bits, block, zero point, GGUF bytes a block (Q5_0/Q5_1: at their own bits, export/cpu_layout.py fifth_bits)
BLOCKS = {"Q8_0": (8, 32, 128, 34), "Q4_0": (4, 32, 8, 18), "Q5_0": (5, 32, 16, 22), "Q5_1": (5, 32, 0, 24)}


def node(kind: str, rows: int, cols: int, level: int | None, threads: int, rng, library: str | None = None):
    """An ONNX Runtime session of one QLinear of `kind` on llgraph's kernels (`library`: that build of them), and
    the GGUF bytes its weights are."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from llgraph.export.cpu_layout import interleave16_5bit, interleave16_half, interleaver
    from llgraph.plugins import cpu
    from llgraph.quant import CENTRE, superblock_format

    exponent, file_bytes = 0, 0
    if kind in K_LAYOUT or kind in GRID:
        grid = kind if kind in GRID else None
        if grid is not None:  # IQ3 blocks run as the super-blocks whose weights they are
            from llgraph.grid_superblocks import AS_SUPERBLOCKS, EXPONENT

            kind, exponent = AS_SUPERBLOCKS[grid], EXPONENT[grid]
        size, halves, bits = K_LAYOUT[kind]
        per = superblock_format(kind).block_size  # weights a block: 256 (IQ4_NL: 32)
        if grid is None:
            raw = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
            for offset, value in halves.items():
                raw[..., offset:offset + 2] = np.full(raw.shape[:-1] + (1,), value, np.float16).view(np.uint8)
        else:
            raw, file_bytes = grid_blocks(grid, rows, cols, rng)
        given = {"codes": interleaver(kind)(raw)}
        attrs = dict(format=kind, bits=bits, block_size=per, zero_point=CENTRE[kind], exponent=exponent,
                     accuracy_level=4 if level is None else level)
        nbytes = file_bytes or raw.nbytes  # an IQ3's: the file's bytes
    else:
        bits, block, zero, gguf_bytes = BLOCKS[kind]
        q = rng.integers(0, 2 ** bits, size=(rows, cols // block, block)).astype(np.uint8)
        codes = q[..., 0::2] | (q[..., 1::2] << 4) if bits == 4 else q
        scales = (rng.standard_normal((rows, cols // block)) * 0.01).astype(np.float32)
        given = {"codes": interleave16_5bit(q) if bits == 5 else interleaver("blocks")(codes),
                 "scales": interleave16_half(scales)}
        if kind == "Q5_1":
            given["mins"] = interleave16_half(scales)
        attrs = dict(bits=bits, block_size=block, zero_point=zero, accuracy_level=0 if level is None else level,
                     **({"code_bits": 5} if bits == 5 else {}))
        nbytes = rows * cols // block * gguf_bytes
    inits = [numpy_helper.from_array(v, k) for k, v in given.items()]
    qlinear = helper.make_node("QLinear", ["x", *given], ["y"], domain="llgraph", interleave=16, rows=rows, **attrs)
    graph = helper.make_graph([qlinear], "gemv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, cols])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("llgraph", 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.register_custom_ops_library(library or str(cpu.library()))
    return ort.InferenceSession(model.SerializeToString(), opts), nbytes


def grid_blocks(kind: str, rows: int, cols: int, rng) -> tuple[np.ndarray, int]:
    """Random IQ3_XXS/IQ3_S blocks (every byte pattern is valid but d's) repacked exactly into their
    AS_SUPERBLOCKS type: (its super-blocks [rows, cols / 256, bytes], the IQ3 blocks' bytes)."""
    from llgraph.grid_superblocks import as_superblocks

    size, d = GRID[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    blocks[..., 0:2] = np.full(blocks.shape[:-1] + (1,), d, np.float16).view(np.uint8)
    return as_superblocks(blocks, kind).reshape(rows, cols // 256, -1), blocks.nbytes


def llgraph_gbps(kind: str, rows: int, cols: int, level: int | None, threads: int, seconds: float = 2.0,
                 tokens: int = 1, library: str | None = None) -> float:
    session, nbytes = node(kind, rows, cols, level, threads, np.random.default_rng(0), library)
    x = {"x": np.random.default_rng(1).standard_normal((tokens, cols)).astype(np.float32)}
    for _ in range(3):
        session.run(None, x)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        session.run(None, x)
        runs += 1
    return nbytes * runs / (time.perf_counter() - start) / 1e9


BYTES_PER_WEIGHT = {"Q4_K": 144 / 256, "Q5_K": 176 / 256, "Q6_K": 210 / 256, "Q8_0": 34 / 32, "Q4_0": 18 / 32,
                    "Q5_0": 22 / 32, "Q5_1": 24 / 32, "IQ4_XS": 136 / 256, "Q3_K": 110 / 256,
                    "Q2_K": 84 / 256, "IQ4_NL": 18 / 32, "IQ3_XXS": 98 / 256, "IQ3_S": 110 / 256}


def ggml_gbps(binary: str, types: list[str], rows: int, cols: int, tokens: int = 1) -> dict[str, float]:
    """ggml's own MUL_MAT of `tokens` tokens (test-backend-ops perf, CPU backend: it runs on half the cores) -> the
    weights' GB/s by type (counted once a call, as llgraph's), from the microseconds a run it prints."""
    wanted = "|".join(t.lower().replace("_k", "_K") for t in types)
    r = subprocess.run([binary, "perf", "-o", "MUL_MAT", "-b", "CPU", "-p",
                        f"type_a=({wanted}),type_b=f32,m={rows},n={tokens},k={cols},"], capture_output=True, text=True,
                       timeout=1800)
    found: dict[str, float] = {}
    for line in r.stdout.splitlines():
        m = re.search(r"type_a=(\w+),type_b=f32,.*?([\d.]+) us/run", line)
        if m:
            kind = m[1].upper()
            found[kind] = rows * cols * BYTES_PER_WEIGHT[kind] / float(m[2]) / 1e3
    return found


def main(argv=None) -> None:
    from llgraph.runtime.bench.speed import read_bandwidth

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0,Q5_0,Q4_0")
    p.add_argument("--rows", type=int, default=4096, help="outputs (default 4096: an 8B's down projection)")
    p.add_argument("--cols", type=int, default=14336, help="inputs (default 14336)")
    p.add_argument("--level", type=int, default=None, help="accuracy level (default: the format's own)")
    p.add_argument("--ggml", help="llama.cpp's test-backend-ops binary, for ggml's figures beside")
    p.add_argument("--tokens", type=int, default=1, help="tokens a call (default 1)")
    p.add_argument("--library", nargs="+", help="builds of llgraph's kernels to time side by side")
    args = p.parse_args(argv)
    print(f"read bandwidth: 1 thread {read_bandwidth(1):.1f} GB/s, 2 threads {read_bandwidth(2):.1f} GB/s; "
          f"{args.rows} x {args.cols}, {args.tokens} token(s) a call, {args.threads} thread(s)")
    types = args.types.split(",")
    if args.library:  # an A/B of builds: each type's figure per build, alternating, the best of three
        print("| type | " + " | ".join(f"{lib} GB/s" for lib in args.library) + " |")
        print("|---|" + "---|" * len(args.library))
        for kind in types:
            best = [0.0] * len(args.library)
            for _ in range(3):
                for i, lib in enumerate(args.library):
                    best[i] = max(best[i], llgraph_gbps(kind, args.rows, args.cols, args.level, args.threads, 1.0,
                                                        args.tokens, lib))
            print(f"| {kind} | " + " | ".join(f"{b:.3g}" for b in best) + " |", flush=True)
        return
    theirs = ggml_gbps(args.ggml, types, args.rows, args.cols, args.tokens) if args.ggml else {}
    print("| type | llgraph GB/s | ggml GB/s | llgraph x ggml |")
    print("|---|---|---|---|")
    for kind in types:
        ours = llgraph_gbps(kind, args.rows, args.cols, args.level, args.threads, tokens=args.tokens)
        peer = theirs.get(kind)
        print(f"| {kind} | {ours:.3g} | {'-' if peer is None else f'{peer:.3g}'} | "
              f"{'-' if peer is None else f'{ours / peer:.2f}'} |", flush=True)


if __name__ == "__main__":
    main()
