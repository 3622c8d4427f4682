"""What a step of several texts saves Runner.embed: `--texts` sentences of the bundled passage embedded in one call
(EMBED_ROWS texts a step, runtime/engine/runner.py) against the same texts one call each (a step each, as before
the one engine), in one process, interleaved; the embeddings of both must agree.

    python -m llgraph.runtime.bench.embed [--model smollm2] [--texts 64] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from llgraph.bundled import PASSAGE


def main(argv=None) -> None:
    from llgraph.runtime.backends import open_runner
    from llgraph.runtime.bench.speed import read_bandwidth

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    runner = open_runner(args.model, "ort", max_seq_len=256, threads=args.threads)
    words = PASSAGE.read_text().split()
    texts = [" ".join(words[i % len(words):][:8 + i % 24]) for i in range(args.texts)]
    tokens = sum(len(runner.encode(t)) for t in texts)
    runner.embed(texts[:2])  # warm
    batched, alone = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        together = runner.embed(texts)
        batched.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        each = np.stack([runner.embed(t) for t in texts])
        alone.append(time.perf_counter() - t0)
    diff = float(np.abs(together - each).max())
    b, a = statistics.median(batched), statistics.median(alone)
    print(f"{args.model}: {args.texts} texts ({tokens} tokens), {args.threads} threads, ragged rows: "
          f"{runner.backend.ragged}; read probe {read_bandwidth(1):.1f} GB/s (1 thread), "
          f"{read_bandwidth(2):.1f} GB/s (2 threads)")
    print(f"  one call, {min(args.texts, 8)} texts a step: {b:.3f} s ({tokens / b:.0f} tok/s)")
    print(f"  a call a text:                {a:.3f} s ({tokens / a:.0f} tok/s)")
    print(f"  {a / b:.2f}x; max |difference| of the embeddings {diff:.1e}")


if __name__ == "__main__":
    main()
