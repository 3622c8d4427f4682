"""A token's log-probability where it was predicted, and the most likely tokens there: what the step returns for a
row that asks (an emitted token's, a scored prompt's), from the model's own logits in float64.

    token_logprobs(logits, targets, top)  -> [TokenLogprob(token, logprob, top), ...]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class TokenLogprob:
    """A token's log-probability where it was predicted, and the `top` most likely tokens there [(id, logprob)]."""
    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: np.ndarray, targets: Sequence[int], top: int = 0) -> list[TokenLogprob]:
    """logits [K, V] (row k predicts targets[k]), the model's own (before any sampling parameter) -> each target's
    log-probability and the `top` most likely tokens, from the same float64 log-softmax as score.py's (so a
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
