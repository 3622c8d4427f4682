"""`llgraph eval`: does an engine still answer like the reference? Multiple-choice accuracy and perplexity from
log-likelihoods (runtime/engine/score.py), on any backend, optionally side by side with a second backend.

    llgraph eval MODEL --task mc --data items.jsonl   # lines {"context"|"question": str, "choices": [str], "answer": i}
    llgraph eval MODEL --task perplexity --data text.txt [--context N] [--stride N]

Multiple choice, as lm-evaluation-harness scores it: each choice is the continuation of the context; `acc` takes
the choice of highest log-likelihood, `acc_norm` the highest log-likelihood per character of the choice's text.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from llgraph.errors import LlgraphError


class DataError(LlgraphError):
    """A malformed evaluation file; the message names the file and line."""


@dataclass
class MCItem:
    context: str
    choices: list[str]
    answer: int
    line: int


@dataclass
class MCResult:
    logprobs: list[list[float]] = field(default_factory=list)  # per item, per choice
    acc: float = 0.0
    acc_norm: float = 0.0


def load_mc(path: str | Path) -> list[MCItem]:
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg}); each line is one item") from None
        if not isinstance(d, dict):
            raise DataError(f"{where}: an item is a JSON object with context, choices and answer")
        context = d.get("context", d.get("question"))
        choices, answer = d.get("choices"), d.get("answer")
        if not isinstance(context, str):  # empty is allowed: the choices are scored from the start token (lm-eval)
            raise DataError(f"{where}: 'context' (or 'question') must be a string")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise DataError(f"{where}: 'choices' must be a list of at least two non-empty strings")
        if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
            raise DataError(f"{where}: 'answer' ({answer!r}) must be an index into choices (0..{len(choices) - 1})")
        items.append(MCItem(context, choices, answer, n))
    if not items:
        raise DataError(f"{path}: no items; write one JSON object per line")
    return items


def load_text(path: str | Path) -> str:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    if not text.strip():
        raise DataError(f"{path}: the text is empty")
    return text


def evaluate_mc(runner, items: list[MCItem], batch_size: int = 8, progress: bool = False) -> MCResult:
    from tqdm import tqdm

    # lm-eval's target_delimiter: one space between the context and each choice
    pairs = [(item.context, c if c.startswith(" ") else " " + c) for item in items for c in item.choices]
    scores = []
    for start in tqdm(range(0, len(pairs), batch_size), desc="scoring", unit="batch", disable=not progress):
        scores += runner.score_batch(pairs[start:start + batch_size], batch_size)
    result, k = MCResult(), 0
    for item in items:
        lp = [s.logprob for s in scores[k:k + len(item.choices)]]
        result.logprobs.append(lp)
        norm = [v / len(c) for v, c in zip(lp, item.choices)]  # lm-eval's acc_norm: per character of the choice
        result.acc += lp.index(max(lp)) == item.answer
        result.acc_norm += norm.index(max(norm)) == item.answer
        k += len(item.choices)
    result.acc /= len(items)
    result.acc_norm /= len(items)
    return result


def evaluate_perplexity(runner, text: str, window: int | None = None, stride: int | None = None) -> dict:
    ppl, nll, tokens = runner.perplexity(text, window, stride)
    return {"perplexity": ppl, "nll": nll, "tokens": tokens, "bits_per_token": nll / tokens / math.log(2)}


def format_results(task: str, results: dict, data) -> str:
    """The table `llgraph eval` prints: one row per backend, and with two backends the per-item differences."""
    names = list(results)
    if task == "perplexity":
        lines = [f"{'backend':<10}{'tokens':>8}{'perplexity':>14}{'bits/token':>12}"]
        lines += [f"{b:<10}{r['tokens']:>8}{r['perplexity']:>14.4f}{r['bits_per_token']:>12.4f}"
                  for b, r in results.items()]
        if len(names) == 2:
            a, b = (results[n]["perplexity"] for n in names)
            lines.append(f"relative difference in perplexity: {abs(a - b) / a:.2e}")
        return "\n".join(lines)
    lines = [f"{'backend':<10}{'items':>7}{'acc':>8}{'acc_norm':>10}"]
    lines += [f"{b:<10}{len(data):>7}{r.acc:>8.4f}{r.acc_norm:>10.4f}" for b, r in results.items()]
    if len(names) == 2:
        a, b = (results[n].logprobs for n in names)
        diffs = [max(abs(x - y) for x, y in zip(ra, rb)) for ra, rb in zip(a, b)]
        lines.append(f"\nper item: max |log-likelihood difference| over its choices ({names[0]} vs {names[1]})")
        lines += [f"  line {item.line:>5}: {d:.2e}" for item, d in zip(data, diffs)]
        lines.append(f"largest: {max(diffs):.2e}")
    return "\n".join(lines)


def as_json(task: str, results: dict) -> dict:
    if task == "perplexity":
        return results
    return {b: {"acc": r.acc, "acc_norm": r.acc_norm, "logprobs": r.logprobs} for b, r in results.items()}
