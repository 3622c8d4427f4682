"""Log-likelihood scoring on any backend: what evaluation needs (multiple choice, perplexity), from one forward pass
per batch over the static cache, with no decoding.

    score_pairs(backend, [(context_ids, continuation_ids), ...])  -> [Score(logprob, greedy, tokens), ...]
    rolling_logprob(backend, ids, window, stride)                 -> (summed log-probability, tokens scored)
    token_logprobs(logits, targets, top)                          -> [TokenLogprob(token, logprob, top), ...]

A pair is scored as one right-padded row `context + continuation`, less its last token (only ever predicted), at
positions 0..n-2: the logits at position t give the distribution of token t+1, so the continuation's log-probability
is the sum over its tokens of log_softmax(logits[t - 1])[token t]. `greedy` says whether every continuation token
is the argmax there (lm-eval's `is_greedy`). Log-softmax is taken in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from llgraph.errors import RequestError
from llgraph.runtime.engine.backend import Backend


@dataclass
class Score:
    logprob: float
    greedy: bool
    tokens: int


@dataclass
class TokenLogprob:
    """A token's log-probability where it was predicted, and the `top` most likely tokens there [(id, logprob)]."""
    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: np.ndarray, targets: Sequence[int], top: int = 0) -> list[TokenLogprob]:
    """logits [K, V] (row k predicts targets[k]), the model's own (before any sampling parameter) -> each target's
    log-probability and the `top` most likely tokens, from the same float64 log-softmax as score_pairs (so a
    served prompt's log-probabilities equal Runner.score's on it)."""
    logp = log_softmax(logits)
    chosen = logp[np.arange(len(targets)), list(targets)].tolist()
    if top:
        ids = np.argpartition(-logp, top - 1, axis=-1)[:, :top]  # the top `top`, then ordered by logprob
        ids = np.take_along_axis(ids, np.argsort(-np.take_along_axis(logp, ids, -1), axis=-1, kind="stable"), -1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), np.take_along_axis(logp, ids, -1).tolist())]
    else:
        tops = [[] for _ in chosen]
    return [TokenLogprob(int(t), lp, tp) for t, lp, tp in zip(targets, chosen, tops)]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[..., V] -> float64 log-probabilities."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def check_pair(backend: Backend, context: Sequence[int], continuation: Sequence[int]) -> None:
    """A pair the backend's cache can score, or a RequestError saying why not."""
    if not context or not continuation:
        raise RequestError("a scored pair needs at least one context and one continuation token")
    if len(context) + len(continuation) - 1 > backend.max_seq_len:
        raise RequestError(f"context + continuation ({len(context) + len(continuation)} tokens) exceed the model's "
                           f"cache ({backend.max_seq_len} tokens, plus the last token, which is never input); "
                           "shorten it or raise --max-seq-len")


def score_pairs(backend: Backend, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                batch_size: int = 8) -> list[Score]:
    out = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        for c, x in chunk:
            check_pair(backend, c, x)
        rows = [(list(c) + list(x))[:-1] for c, x in chunk]  # the last token is predicted, never input
        longest = max(len(r) for r in rows)
        tokens = np.zeros((len(rows), longest), np.int64)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r
        backend.allocate(len(rows))
        logits = backend.forward(tokens, np.broadcast_to(np.arange(longest), (len(rows), longest)))
        for i, (c, x) in enumerate(chunk):
            span = log_softmax(logits[i, len(c) - 1:len(c) + len(x) - 1])  # predicts x's tokens
            target = np.array(list(x))
            out.append(Score(float(span[np.arange(len(x)), target].sum()),
                             bool((span.argmax(-1) == target).all()), len(x)))
    return out


def rolling_logprob(backend: Backend, ids: Sequence[int], window: int | None = None, stride: int | None = None,
                    scorer=None) -> tuple[float, int]:
    """Sum of log p(token t | the tokens before it in its window) over tokens 1..n-1, each scored exactly once.
    Windows of at most `window` tokens start every `stride` tokens (default: the window); each scores the tokens
    the previous one did not reach, with the rest of the window as context (at least one token). `scorer`: how a
    pair is scored (default score_pairs; the runner's is runtime/engine/scoring.py's, through the step)."""
    scorer = scorer or score_pairs
    window = window or backend.max_seq_len
    stride = stride or window
    if not 2 <= window <= backend.max_seq_len:
        raise RequestError(f"--context ({window}) must be in 2..{backend.max_seq_len} (the model's cache)")
    if not 1 <= stride <= window:
        raise RequestError(f"--stride ({stride}) must be in 1..{window} (the context)")
    if len(ids) < 2:
        raise RequestError("the text is too short to score: it needs at least two tokens")
    total, scored, begin = 0.0, 1, 0  # token 0 has no context: it is never scored
    while scored < len(ids):
        begin = min(begin, scored - 1)
        end = min(begin + window, len(ids))
        total += scorer(backend, [(ids[begin:scored], ids[scored:end])], 1)[0].logprob
        scored, begin = end, begin + stride
    return total, len(ids) - 1
