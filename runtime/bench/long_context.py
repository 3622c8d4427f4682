"""Whether a long context fits, and what it costs: one stream's cache filled to `--context` positions (every page of it
written), then decode steps at that depth; the peak resident memory of the process beside the weights and the cache.

    python -m llgraph.runtime.bench.long_context MODEL [--context 32768] [--kv-cache int8] [--steps 16]
                                                 [--chunk 2048] [--threads 2]

The context is random token ids written `--chunk` tokens a forward (the chunked prefill a server does), then
`--steps` one-token steps read all of it. MODEL is what `llgraph generate` takes; its export must cover the context
(`llgraph export --max-seq-len`).
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m llgraph.runtime.bench.long_context", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--kv-cache", default="int8")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--threads", type=int)
    args = p.parse_args(argv)
    from llgraph.runtime.backends import open_runner
    from llgraph.runtime.bench.speed import onnx_bytes_per_token

    t0 = time.perf_counter()
    runner = open_runner(args.model, "ort", max_seq_len=args.context, threads=args.threads, kv_cache=args.kv_cache)
    b = runner.backend
    b.allocate(1)
    print(f"{args.model}: opened in {time.perf_counter() - t0:.1f} s; KV cache {b.kv_format().name}, "
          f"{b.kv_bytes_per_token():,} bytes a token, {b.kv_bytes_per_token() * args.context / 1e9:.2f} GB at "
          f"{args.context} positions", flush=True)
    rng = np.random.default_rng(0)
    fill = args.context - args.steps
    ids = rng.integers(0, b.vocab_size, (1, args.context), dtype=np.int64)
    t0 = time.perf_counter()
    for start in range(0, fill, args.chunk):
        end = min(fill, start + args.chunk)
        b.forward(ids[:, start:end], np.arange(start, end, dtype=np.int64)[None], keep=1)
        print(f"  {end} / {fill} positions written ({end / (time.perf_counter() - t0):.1f} tok/s)", flush=True)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in range(fill, args.context):
        b.forward(ids[:, t:t + 1], np.array([[t]], np.int64), keep=1)
    decode = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights = onnx_bytes_per_token(b.folder) if hasattr(b, "folder") else 0
    print(f"prefill of {fill} tokens: {fill / prefill:.1f} tok/s ({prefill:.0f} s); decode at depth {fill}: "
          f"{args.steps / decode:.2f} tok/s; peak RSS {peak / 1e9:.2f} GB (weights read a token "
          f"{weights / 1e9:.2f} GB, "
          f"KV cache {b.kv_bytes_per_token() * args.context / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
