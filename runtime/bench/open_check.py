"""What checking every byte of an export at open costs (export_folder.Checked): warm starts of the same export with
the check and without it, alternating, in one run; the hash's own speed and the read bandwidth beside them.

    python -m llgraph.runtime.bench.open_check MODEL [--runs 11] [--threads 2] [--cache-dir DIR]

MODEL is an export folder or what `llgraph generate` takes (its cache entry is used). A warm start is open_runner()
with the files in the page cache (a first open warms them), as a server restart or a second `llgraph generate` sees
it; "first answer" adds the first token of a 4-token prompt, which the check must precede (the first forward runs
beside it and waits for its verdict). Two checked opens: the memo of the last hash holding (a restart), and every
byte hashed (the memo removed: the first open after an export, a copy or a change).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock


def main(argv=None) -> None:
    from llgraph.export_folder import Manifest, file_xxh3
    from llgraph.runtime import open_runner
    from llgraph.runtime.backends.ort import _memo
    from llgraph.runtime.bench.speed import read_bandwidth

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--runs", type=int, default=11)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cache-dir", default=None)
    args = p.parse_args(argv)

    def start() -> tuple[float, float]:
        t = time.perf_counter()
        runner = open_runner(args.model, "ort", threads=args.threads, cache_dir=args.cache_dir)
        opened = time.perf_counter() - t
        runner.generate([1, 2, 3, 4], 1)
        return opened, time.perf_counter() - t

    class Unchecked:  # the open as it was: no background hash
        def __init__(self, folder, manifest):
            pass

        def result(self):
            return None

    warm = open_runner(args.model, "ort", threads=args.threads, cache_dir=args.cache_dir)  # exports once
    folder = warm.backend.folder
    record = Manifest.read(folder).xxh3
    if not record:
        raise SystemExit(f"{folder} was exported before the xxh3 record; export it again")
    size = sum((folder / n).stat().st_size for n in record)
    t = time.perf_counter()
    for name in record:
        file_xxh3(folder / name)
    hashed = time.perf_counter() - t
    checked, rehashed, plain = [], [], []
    for _ in range(args.runs):
        checked.append(start())  # the memo of the last open's hash holds: nothing is hashed
        _memo(folder).unlink(missing_ok=True)
        rehashed.append(start())  # as after an export, a copy or a change: every file hashed beside the load
        with mock.patch("llgraph.runtime.backends.ort.Checked", Unchecked):
            plain.append(start())
    print(f"{folder.name}: {size / 1e9:.2f} GB in {len(record)} files; xxh3 alone {hashed:.3f} s "
          f"({size / hashed / 1e9:.1f} GB/s); read bandwidth 1 thread {read_bandwidth(1):.1f} GB/s, "
          f"2 threads {read_bandwidth(2):.1f} GB/s")
    for k, what in enumerate(("warm open", "warm open + first answer")):
        off = statistics.median(u[k] for u in plain)
        for runs, how in ((checked, "checked (memo holds)"), (rehashed, "every byte hashed")):
            on = statistics.median(c[k] for c in runs)
            print(f"{what}, median of {args.runs}: {how} {on:.3f} s, unchecked {off:.3f} s: +{on - off:.3f} s "
                  f"({(on - off) / off:+.1%})")


if __name__ == "__main__":
    main()
