"""What structured output costs: decode tokens/s under a JSON schema vs unconstrained, same runner, same prompt,
interleaved runs in one process, and where the constrained step's extra time goes.

    python -m llgraph.runtime.bench.grammar [--model smollm2] [--threads 2] [--new-tokens 256] [--repeats 5]

The schema asks for a list of 8 people, so a constrained document runs about as long as the unconstrained one
(or is cut at --new-tokens).
Decode tok/s = (tokens - 1) / the time after the first token; each mode's best run counts.
"""

from __future__ import annotations

import time

SCHEMA = {"type": "object", "properties": {"people": {
    "type": "array", "minItems": 8, "maxItems": 8, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"},
                                         "city": {"type": "string", "maxLength": 30}},
        "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me a JSON object listing eight people, each with name, age and city."}]


def _timed(cls, name: str, spent: dict):
    original = getattr(cls, name)

    def wrapper(self, *args):
        start = time.perf_counter()
        try:
            return original(self, *args)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
    setattr(cls, name, wrapper)


def main(argv=None) -> None:
    from llgraph.runtime.bench.common import runner_from_args
    from llgraph.runtime.engine.grammar import Grammar, Matcher

    args, runner = runner_from_args(__doc__, argv, new_tokens=256, max_seq_len=512)
    grammar = Grammar.json_schema(SCHEMA)
    spent: dict[str, float] = {}
    for name in ("allowed", "advance"):
        _timed(Matcher, name, spent)

    def run(constrained: bool):
        stats: dict = {}
        kwargs = {"grammar": grammar} if constrained else {"eos_token_ids": []}  # both run their full length
        text = "".join(runner.stream(ASK, args.new_tokens, stats=stats, **kwargs))
        return text, stats["new_tokens"], (stats["new_tokens"] - 1) / stats["decode_s"]

    run(True), run(False)  # warm-up: llguidance's vocabulary, ORT's first runs
    spent.clear()
    best = {"unconstrained": 0.0, "JSON schema": 0.0}
    tokens = {"unconstrained": 0, "JSON schema": 0}
    for _ in range(args.repeats):
        for name in best:
            _, n, rate = run(name == "JSON schema")
            best[name], tokens[name] = max(best[name], rate), tokens[name] + n
    print(f"\n{args.model} on ort, {args.threads} threads, best of {args.repeats}")
    print(f"{'mode':<16}{'decode tok/s':>14}{'x unconstrained':>18}")
    for name, rate in best.items():
        print(f"{name:<16}{rate:>14.1f}{rate / best['unconstrained']:>18.2f}")
    per_token = {k: 1e6 * v / tokens["JSON schema"] for k, v in spent.items()}
    step = 1e6 / best["unconstrained"]
    print(f"per constrained token: mask (llguidance + unpacking to a bool row) {per_token['allowed']:.0f} us, "
          f"advance {per_token['advance']:.0f} us; an unconstrained step is {step:.0f} us")


if __name__ == "__main__":
    main()
