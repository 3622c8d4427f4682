"""A packed step (runtime/engine/packed.py) on a backend without ragged rows: its forward runs one contiguous range of
cache rows, batch row b on cache row first + b, right-padded. The step's adds are laid out as few such forwards as
the backend allows:

- the decode rows (a token, and a draft of at most MAX_DRAFT) in one forward over the range of their slots, padded to
  the longest draft; a free slot in the range takes a dummy token at its row's last position, which no prompt or
  reusable prefix reaches;
- prompt pieces in consecutive slots in one forward, padded to the longest (Runner's batch of prompts);
- where the backend cannot run several rows of more than one token after a cached prefix (`multi_token_rows`
  False: ONNX Runtime's GroupQueryAttention), each such row in a forward of its own;
- an embedding's piece in a forward of its own, its hidden states from Backend.hidden (or forward_hidden).

Right padding is exact with the position-indexed static cache: a pad token of row b writes a position past b's
tokens, which b's next token overwrites before any query of b can see it (positions are clamped to the cache's last).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llgraph.runtime.engine.backend import Backend


@dataclass(frozen=True)
class Add:
    """One piece of a step's batch (Packed.add): `tokens` at positions start.. of cache row `slot`; the logits of
    the last `kept` of them wanted, and with `hidden` the hidden states of the others (an embedding's)."""
    slot: int
    tokens: list[int]
    start: int
    kept: int
    hidden: bool = False


DECODE_WIDTH = 9  # a decode row's tokens at most: its last token and a draft of MAX_DRAFT (speculative.py)


def run_contiguous(backend: Backend, adds: list[Add]) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    """Each add's kept logits [kept, V] and, for an embedding's, its hidden states [n, H]."""
    logits: list[np.ndarray] = [np.zeros((0, backend.vocab_size), np.float32)] * len(adds)
    hidden: list[np.ndarray | None] = [None] * len(adds)
    for group in _groups(backend, adds):
        if adds[group[0]].hidden:
            hidden[group[0]] = hidden_of(backend, adds[group[0]])
            continue
        for i, out in zip(group, _forward(backend, [adds[i] for i in group])):
            logits[i] = out
    return logits, hidden


def _groups(backend: Backend, adds: list[Add]) -> list[list[int]]:
    """The adds' indices, one list a forward."""
    def alone(a) -> bool:  # without multi_token_rows, only single decode tokens share a forward after a prefix
        return a.hidden or (not backend.multi_token_rows and a.start > 0 and not (len(a.tokens) == a.kept == 1))

    groups = [[i] for i, a in enumerate(adds) if alone(a)]
    rest = [i for i, a in enumerate(adds) if not alone(a)]
    decode = [i for i in rest if len(adds[i].tokens) <= DECODE_WIDTH and adds[i].kept == len(adds[i].tokens)
              and (backend.multi_token_rows or len(adds[i].tokens) == 1)]
    if decode:
        groups.append(decode)
    run: list[int] = []  # prompt pieces in consecutive slots
    for i in sorted((i for i in rest if i not in decode), key=lambda i: adds[i].slot):
        if run and adds[i].slot != adds[run[-1]].slot + 1:
            groups.append(run)
            run = []
        run.append(i)
    if run:
        groups.append(run)
    return groups


def _forward(backend: Backend, adds: list[Add]) -> list[np.ndarray]:
    """One right-padded forward over the slots from the lowest add's to the highest's -> each add's kept logits."""
    first = min(a.slot for a in adds)
    by_slot = {a.slot - first: a for a in adds}
    width = max(len(a.tokens) for a in adds)
    span = max(by_slot) + 1
    clamp = backend.max_seq_len - 1
    tokens = np.zeros((span, width), np.int64)
    positions = np.full((span, width), clamp, np.int64)  # a free slot's dummy tokens at its row's last position
    for b, a in by_slot.items():
        tokens[b, :len(a.tokens)] = a.tokens
        positions[b] = np.minimum(a.start + np.arange(width), clamp)
    # the logits from the earliest wanted position of any row on
    keep = max((width - (len(a.tokens) - a.kept) for a in adds if a.kept), default=1)
    out = backend.forward(tokens, positions, rows=slice(first, first + span), keep=keep)
    shift = out.shape[1] - width  # out[:, j + shift] is position j of the batch row
    return [out[a.slot - first, len(a.tokens) - a.kept + shift:len(a.tokens) + shift] for a in adds]


def hidden_of(backend: Backend, a: Add) -> np.ndarray:
    """An add's hidden states [n, H] from a forward of its own (Backend.hidden)."""
    ids, positions = np.array([a.tokens], np.int64), np.arange(a.start, a.start + len(a.tokens))[None]
    return backend.hidden(ids, positions, rows=slice(a.slot, a.slot + 1))[0]
