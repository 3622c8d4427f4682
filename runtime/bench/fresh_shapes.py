"""The PyTorch executor at shapes it has not seen, as a server meets them: decode steps at positions new each step
(1 and N rows) and prompts of lengths not run before, each timed on its first run. `llgraph bench` warms up and
repeats the same shapes (llama-bench's definition), which hides any cost paid once per shape — a plan built per
shape, as cuDNN's attention builds one on a GPU, costs a served stream on every step.

    python -m llgraph.runtime.bench.fresh_shapes [CONFIG] [--device cuda] [--dtype bfloat16] [--layers 16]
                                                 [--steps 60] [--rows 1 4] [--lengths 300 517 1000]

CONFIG: a preset (`llama-3.2-1b`, ...) or config file; random weights, cut to `--layers`. The last length is run a
second time: its figure then is the warm one, for comparison.

Measured on a lent H200 (2026-11-30, torch 2.11+cu130, llama-3.2-1b, 16 layers, bf16; this measurement, from the
copy it was written in before it entered the repository, before and after llgraph/attention_torch.py's spelled-out
attention): decode at fresh positions 63-71 ms a step on SDPA (cuDNN)
against 16.5 / 17.4 ms (1 / 4 rows) spelled out; prompts of new lengths 300 / 517 / 1,000: 1,784 / 1,569 / 910 ms on
SDPA (loaded machine) against 495 (the first call's lazy initialisation) / 42 / 45 ms, and 22 ms for 1,000 again.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> None:
    import torch

    from llgraph.checkpoint import load_config
    from llgraph.runtime.backends.pytorch import TorchRunner
    from llgraph.runtime.engine.packed import Packed, step_logits

    p = argparse.ArgumentParser(prog="python -m llgraph.runtime.bench.fresh_shapes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default="llama-3.2-1b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--steps", type=int, default=60, help="decode steps timed for each row count")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--lengths", type=int, nargs="+", default=[300, 517, 1000], help="prompt lengths, in turn")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    cfg = dataclasses.replace(cfg, num_layers=min(args.layers, cfg.num_layers))
    longest = max(args.lengths) + len(args.rows) * (args.steps + 3) + 8
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(cfg.to_json())
        b = TorchRunner(None, config=Path(tmp) / "config.json", max_seq_len=longest, dtype=args.dtype,
                        device=args.device).backend
    b.allocate(max(args.rows), zeroed=True)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - start) * 1e3

    lengths = [*args.lengths, args.lengths[-1]]
    pre = [timed(lambda n=n: step_logits(b, np.arange(n) % cfg.vocab_size, 0)) for n in lengths]
    print(f"{args.config}, {cfg.num_layers} layers, {args.dtype} on {args.device}")
    print("prefill ms at new lengths " + ", ".join(f"{n}: {ms:.1f}" for n, ms in zip(lengths[:-1], pre)) +
          f"; {lengths[-1]} again: {pre[-1]:.1f}")
    position = max(args.lengths)
    for rows in args.rows:
        def steps(n: int, rows: int = rows) -> None:
            nonlocal position
            for _ in range(n):
                batch = Packed()
                for r in range(rows):
                    batch.add(r, [4], position, 1)
                batch.run(b)
                position += 1
        steps(3)
        print(f"decode, {rows} row{'s' if rows > 1 else ''}: {timed(lambda: steps(args.steps)) / args.steps:.2f} ms a "
              f"step at positions new each step")


if __name__ == "__main__":
    main()
