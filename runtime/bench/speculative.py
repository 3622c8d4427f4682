"""What speculative decoding gains: decode tokens/s with prompt lookup ("ngram") vs plain, on a context-repeating
task (quoting a passage of A Tale of Two Cities) and an open chat prompt, same runner, runs interleaved in one
process, greedy (so both modes produce the same tokens: checked).

    python -m llgraph.runtime.bench.speculative [--model smollm2] [--threads 2] [--new-tokens 128] [--repeats 5]
    python -m llgraph.runtime.bench.speculative --draft   # the float32 model, its 4-bit self drafting for it

Decode tok/s = (tokens - 1) / the time after the first token; each row's best run counts. Then the cost of one
step of S positions (what verifying S - 1 drafted tokens costs), after a 300-token prefix.
"""

from __future__ import annotations

from llgraph.bundled import PASSAGE

TASKS = {
    "quote a passage": "Repeat this passage exactly, word for word:\n\n{passage}",
    "open chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def main(argv=None) -> None:
    from llgraph.runtime.bench.common import runner_from_args

    args, runner = runner_from_args(__doc__, argv, new_tokens=128, extra=lambda p: p.add_argument(
        "--draft", action="store_true", help="time the float32 model with its 4-bit self as the draft model too"))
    modes = {"off": "off", "ngram": "ngram"}
    if args.draft:  # the float32 model as the target, this 4-bit one drafting for it
        from llgraph.runtime.backends import open_runner
        from llgraph.weight_request import Weights

        modes["draft"] = runner
        runner = open_runner(args.model, "ort", max_seq_len=1024, threads=args.threads,
                             weights=Weights(dequantize=True))
    passage = PASSAGE.read_text()[:1200]
    prompts = {task: [{"role": "user", "content": text.format(passage=passage)}] for task, text in TASKS.items()}

    def run(task: str, mode: str):
        stats: dict = {}
        text = "".join(runner.stream(prompts[task], args.new_tokens, speculative=modes[mode], stats=stats))
        return text, (stats["new_tokens"] - 1) / stats["decode_s"], stats

    for task in prompts:  # warm-up
        run(task, "off")
    best: dict[tuple[str, str], float] = {}
    texts: dict[tuple[str, str], str] = {}
    drafts: dict = {}
    for _ in range(args.repeats):
        for task in prompts:
            for mode in modes:
                text, rate, stats = run(task, mode)
                best[task, mode] = max(best.get((task, mode), 0.0), rate)
                texts.setdefault((task, mode), text)
                drafts[task, mode] = (stats.get("accepted", 0), stats.get("drafted", 0))
    target = f"{args.model} float32 (the 4-bit one drafting)" if args.draft else args.model
    print(f"\n{target} on ort, {args.threads} threads, {args.new_tokens} new tokens, greedy, best of {args.repeats}")
    print(f"{'task':<18}{'mode':<8}{'decode tok/s':>14}{'x plain':>10}  accepted/drafted  same tokens")
    for (task, mode), rate in best.items():
        accepted, drafted = drafts[task, mode]
        print(f"{task:<18}{mode:<8}{rate:>14.1f}{rate / best[task, 'off']:>10.2f}  "
              f"{f'{accepted}/{drafted}' if mode != 'off' else '-':>16}  {texts[task, mode] == texts[task, 'off']}")


    print("what a verify step costs: one step of S positions after a 300-token prefix, mean of 20:")
    print("  " + ", ".join(f"S={n}: {1e3 * t:.1f} ms" for n, t in step_costs(runner.backend).items()))


def step_costs(backend, sizes=(1, 2, 3, 5, 9), prefix: int = 300) -> dict[int, float]:
    import time

    import numpy as np

    from llgraph.runtime.engine.packed import step_logits

    backend.allocate(1)
    step_logits(backend, np.arange(prefix) % 1000 + 5)
    costs = {}
    for n in sizes:
        ids = np.arange(n) + 7
        for _ in range(3):
            step_logits(backend, ids, prefix, kept=n)
        start = time.perf_counter()
        for _ in range(20):
            step_logits(backend, ids, prefix, kept=n)
        costs[n] = (time.perf_counter() - start) / 20
    return costs


if __name__ == "__main__":
    main()
