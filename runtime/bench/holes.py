"""What a free slot below a busy one costs a decode step: one active row alone (slot 0), the same row in the last
slot with every slot below it free, and two active rows — on a ragged backend (the step runs the busy rows only,
passes.ragged_slots) and, on the same export in the same run, as a backend without slot ids runs it (the slots from
the lowest busy one to the highest, a free one between them attending its whole row: runtime/engine/contiguous.py).

    python -m llgraph.runtime.bench.holes [--model smollm2] [--slots 8] [--max-seq-len 8192] [--position 512]
                                          [--steps 40] [--threads 2] [--repeats 3]

Each row decodes after a `--position`-token prompt; ms per step is the median over `--repeats` runs of `--steps`
steps. Only the export's own kernels decide `ragged` (an ort export on llgraph's CPU kernels has it).

Measured (SmolLM2, 8 slots of 8,192, defaults; probes 25.5 / 26.9 GB/s): one row in slot 7, 6.74 ms a step (1.01x
one row in slot 0); rows in slots 0 and 7, 9.02 ms (1.35x); as contiguous rows (the range of busy slots) 6.85 ms
(1.07x) and 91.4 ms (14.2x: the six free rows between attend their whole rows).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def step_ms(runner, slots: list[int], position: int, steps: int, ragged: bool) -> float:
    """ms per engine step of rows decoding in `slots` after `position` prompt tokens."""
    from llgraph.runtime.engine.row import Params, Row
    from llgraph.runtime.engine.step import Engine

    backend = runner.backend
    backend.ragged = ragged
    rng = np.random.default_rng(0)
    rows = [Row(Params(rng.integers(100, 1000, position).tolist(), steps + 2), slot=s) for s in slots]
    engine = Engine(backend)
    for r in rows:
        engine.step([r])
    start = time.perf_counter()
    for _ in range(steps):
        engine.step(rows)
    elapsed = time.perf_counter() - start
    if any(r.error for r in rows):
        raise SystemExit(f"a row failed: {[r.error for r in rows if r.error][0]}")
    return 1000 * elapsed / steps


def main(argv=None) -> None:
    from llgraph.runtime.backends import open_runner
    from llgraph.runtime.bench.speed import read_bandwidth

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=8192)
    p.add_argument("--position", type=int, default=512)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    runner = open_runner(args.model, "ort", max_seq_len=args.max_seq_len, threads=args.threads)
    ragged = runner.backend.ragged
    runner.backend.allocate(args.slots)
    last = args.slots - 1
    cases = [("one row, slot 0", [0]), (f"one row, slot {last} ({last} free below)", [last]),
             (f"two rows, slots 0 and {last}", [0, last])]
    modes = [("ragged", True), ("contiguous", False)] if ragged else [("contiguous", False)]
    print(f"{args.model}: {args.slots} slots of {args.max_seq_len} positions, rows at position {args.position}, "
          f"{args.threads} threads; read probe {read_bandwidth(1):.1f} GB/s (1 thread), "
          f"{read_bandwidth(2):.1f} GB/s (2 threads)")
    if not ragged:
        print("this export has no slot ids (not on llgraph's CPU kernels): contiguous rows only")
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):  # interleaved, so a busy moment of the machine touches every case alike
        for mode, flag in modes:
            for name, slots in cases:
                times.setdefault((mode, name), []).append(step_ms(runner, slots, args.position, args.steps, flag))
    print(f"{'rows':<34} " + " ".join(f"{mode + ' ms/step':>18}" for mode, _ in modes))
    for name, _ in cases:
        cells = []
        for mode, _ in modes:
            ms, alone = statistics.median(times[(mode, name)]), statistics.median(times[(mode, cases[0][0])])
            cells.append(f"{ms:8.2f} ({ms / alone:4.2f}x)")
        print(f"{name:<34} " + " ".join(f"{c:>18}" for c in cells))
    runner.backend.ragged = ragged


if __name__ == "__main__":
    main()
