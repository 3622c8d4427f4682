"""Log-likelihood scoring on any backend: what evaluation needs (multiple choice, perplexity), through the engine's
step with no decoding.

    score(backend, [(context_ids, continuation_ids), ...])  -> [Score(logprob, greedy, tokens), ...]
    rolling_logprob(backend, ids, window, stride)           -> (summed log-probability, tokens scored)

A pair is scored as one row `context + continuation`, less its last token (only ever predicted), at positions
0..n-2: the logits at position t give the distribution of token t+1, so the continuation's log-probability is the
sum over its tokens of log_softmax(logits[t - 1])[token t]. `greedy` says whether every continuation token is the
argmax there (lm-eval's `is_greedy`). Log-probabilities are runtime/engine/logprobs.py's (float64).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llgraph.errors import RequestError
from llgraph.runtime.engine.backend import Backend
from llgraph.runtime.engine.row import Params, Row
from llgraph.runtime.engine.step import Engine

LOGITS_BYTES = 1 << 29  # the float32 logits a step of perplexity windows may keep (each window keeps all of its)


@dataclass
class Score:
    logprob: float
    greedy: bool
    tokens: int


def check_pair(backend: Backend, context: Sequence[int], continuation: Sequence[int]) -> None:
    """A pair the backend's cache can score, or a RequestError saying why not."""
    if not context or not continuation:
        raise RequestError("a scored pair needs at least one context and one continuation token")
    if len(context) + len(continuation) - 1 > backend.max_seq_len:
        raise RequestError(f"context + continuation ({len(context) + len(continuation)} tokens) exceed the model's "
                           f"cache ({backend.max_seq_len} tokens, plus the last token, which is never input); "
                           "shorten it or raise --max-seq-len")


def score(backend: Backend, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 8) -> list[Score]:
    """Each pair's Score, through the engine's step on any backend: a pair is a row like any other — a prompt whose
    log-probabilities are kept (Params.prompt_logprobs) — and `batch_size` pairs are one step, on the cache rows the
    backend holds (rows are rewritten from position 0)."""
    out: list[Score] = []
    engine = Engine(backend)
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        for c, x in chunk:
            check_pair(backend, c, x)
        backend.allocate(batch_size)  # kept as it is when the size is the same
        rows = [Row(Params([*c, *x], 0, logprobs=1, prompt_logprobs=True), slot=i) for i, (c, x) in enumerate(chunk)]
        outputs = {out.row: out for out in engine.step(rows)}
        for r, (_, x) in zip(rows, chunk):
            scored = outputs[r]
            if scored.error is not None:
                raise RequestError(scored.error)
            assert scored.prompt_scores is not None  # a scored prompt's last output carries its scores
            mine = scored.prompt_scores[-len(x):]  # token t's log-probability where it was predicted
            out.append(Score(sum(s.logprob for s in mine), all(s.logprob >= s.top[0][1] for s in mine), len(x)))
    return out


def rolling_logprob(backend: Backend, ids: Sequence[int], window: int | None = None,
                    stride: int | None = None) -> tuple[float, int]:
    """Sum of log p(token t | the tokens before it in its window) over tokens 1..n-1, each scored exactly once.
    Windows of at most `window` tokens start every `stride` tokens (default: the window); each scores the tokens
    the previous one did not reach, with the rest of the window as context (at least one token). The windows are
    independent: as many as LOGITS_BYTES of logits hold (at most 8) are scored in one step (score)."""
    window = window or backend.max_seq_len
    stride = stride or window
    if not 2 <= window <= backend.max_seq_len:
        raise RequestError(f"--context ({window}) must be in 2..{backend.max_seq_len} (the model's cache)")
    if not 1 <= stride <= window:
        raise RequestError(f"--stride ({stride}) must be in 1..{window} (the context)")
    if len(ids) < 2:
        raise RequestError("the text is too short to score: it needs at least two tokens")
    pairs, scored, begin = [], 1, 0  # token 0 has no context: it is never scored
    while scored < len(ids):
        begin = min(begin, scored - 1)
        end = min(begin + window, len(ids))
        pairs.append((ids[begin:scored], ids[scored:end]))
        scored, begin = end, begin + stride
    batch = max(1, min(8, LOGITS_BYTES // (4 * window * backend.vocab_size)))
    return sum(s.logprob for s in score(backend, pairs, batch)), len(ids) - 1
