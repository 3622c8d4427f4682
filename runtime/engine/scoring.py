"""Scoring through the engine's step: on a ragged backend (runtime/engine/backend.py) each scored pair is a row like
any other — a prompt whose log-probabilities are kept (Row.prompt_logprobs) — and a batch of pairs is one packed
forward (Engine.advance), on the cache the runner already holds. A backend without slot ids scores a batch as one
right-padded forward (score.score_pairs).

    score(backend, [(context_ids, continuation_ids), ...], batch_size)  -> [Score(logprob, greedy, tokens), ...]
"""

from __future__ import annotations

from typing import Sequence

from llgraph.errors import RequestError
from llgraph.runtime.engine.backend import Backend
from llgraph.runtime.engine.decoding import Decoding
from llgraph.runtime.engine.score import Score, check_pair, score_pairs
from llgraph.runtime.engine.step import Engine, Row


def score(backend: Backend, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 8) -> list[Score]:
    if not backend.ragged:
        return score_pairs(backend, pairs, batch_size)
    out: list[Score] = []
    engine = Engine(backend)
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        for c, x in chunk:
            check_pair(backend, c, x)
        backend.allocate(batch_size)  # kept as it is when the size is the same: rows are rewritten from 0
        rows = [Row([*c, *x], Decoding(lambda ids: "", 0), slot=i, prompt_logprobs=True, logprobs=1)
                for i, (c, x) in enumerate(chunk)]
        engine.advance(rows)
        for r, (_, x) in zip(rows, chunk):
            if r.error is not None:
                raise RequestError(r.error)
            mine = r.prompt_scores[-len(x):]  # token t's log-probability where it was predicted
            out.append(Score(sum(s.logprob for s in mine), all(s.logprob >= s.top[0][1] for s in mine), len(x)))
    return out
