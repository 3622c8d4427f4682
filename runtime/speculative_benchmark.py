"""What speculative decoding gains: decode tokens/s with prompt lookup ("ngram") vs plain, on a context-repeating
task (quoting a passage of A Tale of Two Cities) and an open chat prompt, same runner, runs interleaved in one
process, greedy (so both modes produce the same tokens: checked).

    python -m llgraph.runtime.speculative_benchmark [--model smollm2] [--threads 2] [--new-tokens 128] [--repeats 5]

Decode tok/s = (tokens - 1) / the time after the first token; each row's best run counts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

PASSAGE = Path(__file__).resolve().parents[1] / "tests" / "data" / "tale-of-two-cities.txt"
TASKS = {
    "quote a passage": "Repeat this passage exactly, word for word:\n\n{passage}",
    "open chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def main(argv=None) -> None:
    from llgraph.runtime.registry import open_runner

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    runner = open_runner(args.model, "ort", 1024, threads=args.threads)
    passage = PASSAGE.read_text()[:1200] if PASSAGE.exists() else "It was the best of times. " * 40
    prompts = {task: [{"role": "user", "content": text.format(passage=passage)}] for task, text in TASKS.items()}

    def run(task: str, mode: str):
        stats: dict = {}
        text = "".join(runner.stream(prompts[task], args.new_tokens, speculative=mode, stats=stats))
        return text, (stats["new_tokens"] - 1) / stats["decode_s"], stats

    for task in prompts:  # warm-up
        run(task, "off")
    best, texts, drafts = {}, {}, {}
    for _ in range(args.repeats):
        for task in prompts:
            for mode in ("off", "ngram"):
                text, rate, stats = run(task, mode)
                best[task, mode] = max(best.get((task, mode), 0.0), rate)
                texts.setdefault((task, mode), text)
                drafts[task, mode] = (stats.get("accepted", 0), stats.get("drafted", 0))
    print(f"\n{args.model} on ort, {args.threads} threads, {args.new_tokens} new tokens, greedy, best of "
          f"{args.repeats}")
    print(f"{'task':<18}{'mode':<8}{'decode tok/s':>14}{'x plain':>10}  accepted/drafted  same tokens")
    for (task, mode), rate in best.items():
        accepted, drafted = drafts[task, mode]
        print(f"{task:<18}{mode:<8}{rate:>14.1f}{rate / best[task, 'off']:>10.2f}  "
              f"{f'{accepted}/{drafted}' if mode != 'off' else '-':>16}  {texts[task, mode] == texts[task, 'off']}")


if __name__ == "__main__":
    main()
