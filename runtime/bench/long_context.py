"""Whether a long context fits, and what it costs: one stream's cache filled to `--context` positions (every page of it
written), then decode steps at that depth; the peak resident memory of the process beside the weights and the cache.

    python -m llgraph.runtime.bench.long_context MODEL [--context 32768] [--kv-cache int8] [--steps 16]
                                                 [--chunk 2048] [--threads 2] [--synthetic]

The context is random token ids written `--chunk` tokens a forward (the chunked prefill a server does), then
`--steps` one-token steps read all of it. `--synthetic` writes the cache's bytes directly instead (rows of random
normal keys and values in the cache's format, every position): the same memory and the same decode at depth without
the prefill, which at 32k on an 8B takes about an hour on 2 cores (its attention alone is ~280 TFLOP). MODEL is what
`llgraph generate` takes; its export must cover the context (`llgraph export --max-seq-len`).

Windowed layers hold their window only (llgraph/kv_cache.py). Measured on Gemma 3 1B's shapes (4 bits, f16 cache,
`python -m llgraph.runtime.bench.gguf gemma3-1b G.gguf`, window 512): at 8,192 / 32,768 positions llgraph's KV cache
is 54 / 150 MiB (208 / 832 with every layer full), llama.cpp's the same (its `llama_kv_cache` log: 32 + 22 SWA,
128 + 22 SWA); decode tg16 at that depth, 2 threads, llgraph / llama.cpp 28.1 / 23.5 (1.19x) and 26.6 / 19.4 (1.37x)
(`llgraph bench G.gguf -p 0 -n 16 -d 8192 --threads 2 --repeats 1 --peer llama-bench=PATH`, and `-d 32751`; read
probe 31-34 GB/s; memory from `python -m llgraph.runtime.bench.long_context G.gguf --context 32768 --kv-cache f16
--synthetic`). The global layers' attention grows with the depth: llgraph's CPU kernel reads a kv head's keys once
for all the query heads it serves (Gemma 3 groups four), in blocks of 256 positions whose partial softmaxes merge in
order, a decode's blocks on every thread — before, each head read them again (0.84x llama.cpp at 32k).
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np


def synthetic_fill(backend, positions: int) -> None:
    """Every cache array's first `positions` slots (a windowed layer's ring: all of its slots): rows of random normal
    values in the cache's format (an OrtBackend's arrays), a block of rows at a time."""
    from llgraph.kv_cache import quantize_int8

    rng = np.random.default_rng(0)
    d = backend.config.head_dim
    for array in backend._arrays.values():
        for start in range(0, min(positions, array.shape[2]), 1024):
            end = min(positions, array.shape[2], start + 1024)
            rows = rng.standard_normal((*array.shape[:2], end - start, d), dtype=np.float32)
            array[:, :, start:end] = quantize_int8(rows) if array.dtype == np.int8 else rows.astype(array.dtype)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m llgraph.runtime.bench.long_context", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--kv-cache", default="int8")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--threads", type=int)
    p.add_argument("--synthetic", action="store_true", help="write the cache's bytes instead of prefilling")
    args = p.parse_args(argv)
    from llgraph.runtime.backends import open_runner
    from llgraph.runtime.bench.speed import onnx_bytes_per_token
    from llgraph.runtime.engine.packed import step_logits

    t0 = time.perf_counter()
    runner = open_runner(args.model, "ort", max_seq_len=args.context, threads=args.threads, kv_cache=args.kv_cache)
    b = runner.backend
    b.allocate(1)
    held = b.kv_row_bytes(args.context)
    rings = (f" (the windowed layers' rings of {b.ring} slots; {b.kv_bytes_per_token() * args.context / 1e9:.2f} GB "
             "if every layer held every position)") if b.ring else ""
    print(f"{args.model}: opened in {time.perf_counter() - t0:.1f} s; KV cache {b.kv_format().name}, "
          f"{b.kv_bytes_per_token():,} bytes a token, {held / 1e9:.3f} GB at {args.context} positions{rings}",
          flush=True)
    rng = np.random.default_rng(0)
    fill = args.context - args.steps
    ids = rng.integers(0, b.vocab_size, (1, args.context), dtype=np.int64)
    t0 = time.perf_counter()
    if args.synthetic:
        synthetic_fill(b, fill)
        print(f"  {fill} positions of every layer's cache written directly ({time.perf_counter() - t0:.0f} s)")
        fill_ids = range(0)
    else:
        fill_ids = range(0, fill, args.chunk)
    for start in fill_ids:
        end = min(fill, start + args.chunk)
        step_logits(b, ids[:, start:end], start)
        print(f"  {end} / {fill} positions written ({end / (time.perf_counter() - t0):.1f} tok/s)", flush=True)
    prefill = time.perf_counter() - t0
    written = "written directly" if args.synthetic else f"prefilled at {fill / prefill:.1f} tok/s ({prefill:.0f} s)"
    t0 = time.perf_counter()
    for t in range(fill, args.context):
        step_logits(b, ids[:, t:t + 1], t)
    decode = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights = onnx_bytes_per_token(b.folder) if b.folder is not None else 0
    print(f"context of {fill} tokens {written}; decode at depth {fill}: "
          f"{args.steps / decode:.2f} tok/s; peak RSS {peak / 1e9:.2f} GB (weights read a token "
          f"{weights / 1e9:.2f} GB, "
          f"KV cache {held / 1e9:.3f} GB)")


if __name__ == "__main__":
    main()
