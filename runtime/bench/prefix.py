"""What prefix reuse saves: time to first token of 8 chat requests sharing a ~400-token system prompt, through the
scheduler, with and without reuse (same runner, one process); and the same 8 as one Runner.generate batch, whose
shared prefix is computed once (time to the batch's first tokens, with and without).

    python -m llgraph.runtime.bench.prefix [--model smollm2] [--threads 2] [--repeats 5]

Request 1 comes alone; requests 2-8 then come one after another (each alone: its time to first token is its own
prefill) and, in a second round, all at once (each also waits for the prefills before its own). Each figure is
the best of --repeats rounds.
"""

from __future__ import annotations

import time

from llgraph.bundled import PASSAGE

QUESTIONS = ["Who is the story about?", "Where does it take place?", "What year is it?", "Summarize the mood.",
             "Name one contrast in the passage.", "What is compared to the spring of hope?", "Who reigned in England?",
             "Give the passage a title."]


def _ttfts(runner, system: str, reuse: bool, together: bool) -> list[float]:
    from llgraph.runtime.engine.scheduler import Metrics, Scheduler

    class Times(Metrics):
        def __init__(self):
            self.seconds = []

        def first_token(self, seconds: float) -> None:
            self.seconds.append(seconds)

    times = Times()
    scheduler = Scheduler(runner, slots=8, metrics=times, reuse_prefixes=reuse).start()
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in QUESTIONS]
    try:
        scheduler.submit(chats[0], 8).result(timeout=300)
        if together:
            for h in [scheduler.submit(c, 8) for c in chats[1:]]:
                h.result(timeout=300)
        else:
            for c in chats[1:]:
                scheduler.submit(c, 8).result(timeout=300)
    finally:
        scheduler.stop()
    return times.seconds


def main(argv=None) -> None:
    from llgraph.runtime.bench.common import runner_from_args

    args, runner = runner_from_args(__doc__, argv)
    text = PASSAGE.read_text()
    words, n = (text.split() * 4), 100  # the 160-word passage, repeated
    while True:  # the passage's first words, as many as make a ~400-token system prompt
        system = "Answer questions about this passage in one sentence.\n\n" + " ".join(words[:n])
        tokens = len(runner.encode(runner.render_chat([{"role": "system", "content": system}])))
        if tokens >= 400:
            break
        n += 20
    _ttfts(runner, system, False, False)  # warm-up
    print(f"\n{args.model} on ort, {args.threads} threads; 8 chat requests sharing a {tokens}-token system prompt; "
          f"time to first token, best of {args.repeats}")
    print(f"{'prefix reuse':<14}{'requests 2-8':<16}{'request 1':>11}{'2-8 mean':>10}{'2-8 max':>9}{'mean / 1':>10}")
    for together in (False, True):
        for reuse in (False, True):
            runs = [_ttfts(runner, system, reuse, together) for _ in range(args.repeats)]
            best = [min(r[i] for r in runs) for i in range(len(QUESTIONS))]
            rest = best[1:]
            mean = sum(rest) / len(rest)
            print(f"{'on' if reuse else 'off':<14}{'all at once' if together else 'one by one':<16}"
                  f"{best[0]:>10.3f}s{mean:>9.3f}s{max(rest):>8.3f}s{mean / best[0]:>10.2f}")
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in QUESTIONS]
    print("\nRunner.generate of the 8 as one batch, time to its first tokens (prefill), best of "
          f"{args.repeats}")
    seconds: dict[bool, float] = {}
    for reuse in (False, True):
        runner.reuse_prefixes = reuse
        times: list[float] = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            runner.generate(chats, 1)
            times.append(time.perf_counter() - start)
        seconds[reuse] = min(times)
        print(f"prefix reuse {'on' if reuse else 'off':<4}{seconds[reuse]:>8.3f}s")
    print(f"on / off: {seconds[True] / seconds[False]:.2f}")


if __name__ == "__main__":
    main()
