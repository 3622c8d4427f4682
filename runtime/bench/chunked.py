"""What chunked prefill buys the running streams: 7 greedy streams decode through the scheduler; once they are
going, a long prompt (`--prompt-tokens`, from the shipped passage) arrives. The figure is the largest gap between two
consecutive tokens of any running stream while that prompt is prefilled, with whole prefills (chunk 0) and with
`--chunks` (same runner, one process, the settings in turn `--repeats` times, the best of each), beside the time to
the long request's first token (or end). On a ragged backend (an export on llgraph's CPU kernels) each setting runs
twice: one packed forward a step (Engine.step: the streams' tokens and the chunk together) and, as a backend
without slot ids steps, a chunk's forward then a decode step. `--kinds`: what the long request is — a prompt to
answer, an embedding of 3 inputs of that length, or a prompt scored alone (prompt log-probabilities) — each written in
chunks alike.

    python -m llgraph.runtime.bench.chunked [--model smollm2] [--threads 2] [--prompt-tokens 2000] [--chunks 256]
                                            [--kinds prompt,embedding,scored]
"""

from __future__ import annotations

import threading
import time

from llgraph.bundled import PASSAGE

STREAMS = 7


KINDS = {"prompt": lambda s, ids: [s.submit(ids, 1)],
         "embedding": lambda s, ids: [s.submit(ids[k:] + ids[:k], 0, pooling="last") for k in range(3)],
         "scored": lambda s, ids: [s.submit(ids, 0, prompt_logprobs=True)]}


def _run(runner, chunk: int, long_prompt: list[int], new_tokens: int, kind: str = "prompt",
         packed: bool = False) -> tuple[float, float]:
    """-> (the largest inter-token gap of the streams while the long request is written, its time to its first
    event); `packed`: one forward a step (a ragged backend), else a separate forward per chunk and decode step."""
    from llgraph.runtime.engine.scheduler import Scheduler

    runner.backend.ragged = packed
    scheduler = Scheduler(runner, slots=STREAMS + 3, prefill_chunk=chunk).start()
    times: list[list[float]] = [[] for _ in range(STREAMS)]
    try:
        handles = [scheduler.submit([1 + s, 2 + s, 3 + s], new_tokens) for s in range(STREAMS)]

        def consume(s: int) -> None:
            while handles[s].events.get().kind == "token":
                times[s].append(time.perf_counter())

        threads = [threading.Thread(target=consume, args=(s,), daemon=True) for s in range(STREAMS)]
        for t in threads:
            t.start()
        while min(len(t) for t in times) < 8:  # every stream is decoding
            time.sleep(0.01)
        start = time.perf_counter()
        longs = KINDS[kind](scheduler, long_prompt)
        first = [h.events.get() for h in longs][-1]
        ttft, end = time.perf_counter() - start, time.perf_counter()
        for h in handles:
            h.cancel()
        for t in threads:
            t.join()
    finally:
        scheduler.stop()
    assert first.kind in ("token", "done"), first
    gaps = [b - a for stream in times for a, b in zip(stream, stream[1:]) if b >= start and a <= end]
    return max(gaps), ttft


def main(argv=None) -> int:
    from llgraph.runtime.bench.common import runner_from_args

    def extra(p):
        p.add_argument("--prompt-tokens", type=int, default=2000)
        p.add_argument("--chunks", type=int, nargs="+", default=[256])
        p.add_argument("--kinds", default="prompt", help="comma-separated: prompt, embedding, scored")

    args, runner = runner_from_args(__doc__.split("\n\n")[0], argv, max_seq_len=4096, extra=extra)
    passage = PASSAGE.read_text()
    ids = runner.encode(passage * (1 + args.prompt_tokens // len(runner.encode(passage))))[:args.prompt_tokens]
    new_tokens = 4000 - len(ids)
    packings = [True, False] if runner.backend.ragged else [False]
    settings = [(kind, c, p) for kind in args.kinds.split(",") for c in [0, *args.chunks] for p in packings]
    best = {s: (float("inf"), float("inf")) for s in settings}
    for _ in range(args.repeats):
        for kind, c, packed in settings:
            gap, ttft = _run(runner, c, ids, new_tokens, kind, packed)
            best[kind, c, packed] = (min(best[kind, c, packed][0], gap), min(best[kind, c, packed][1], ttft))
    runner.backend.ragged = packings[0]
    print(f"{args.model}: {STREAMS} streams decoding, a {len(ids)}-token request arrives (best of {args.repeats}, "
          f"{args.threads} threads)")
    print("| the long request | prefill chunk | step | largest inter-token gap of the streams | its first event |")
    print("|---|---|---|---|---|")
    for kind, c, packed in settings:
        what = {"embedding": f"3 x {len(ids)}-token embedding"}.get(kind, f"{len(ids)}-token {kind}")
        step = "one packed forward" if packed else "forward per chunk + decode"
        print(f"| {what} | {c or 'whole'} | {step} | {best[kind, c, packed][0] * 1000:.0f} ms | "
              f"{best[kind, c, packed][1]:.2f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
