"""One packed forward (a ragged backend's, passes.ragged_slots): the tokens of every row a step advances — decode
tokens with their drafts, prompt pieces — in one batch row with no padding, each token at its own position in its
own cache row. The order inside a forward is free (every key and value is written before any query reads), so the
tokens whose logits are needed go last and the head runs on those positions only (`keep`).

    batch = Packed()
    mine = batch.add(slot, tokens, first_position, kept=1)   # -> where its kept logits will be
    logits = batch.run(backend)                                # [K, V]: logits[mine]
"""

from __future__ import annotations

import numpy as np

from llgraph.runtime.engine.backend import Backend


class Packed:
    def __init__(self):
        self._body: list[tuple[int, int, int]] = []  # (token, position, cache row): no logits wanted
        self._tail: list[tuple[int, int, int]] = []  # the same, logits wanted, in the order they are returned
        self.placed: list[tuple[int, int]] = []  # each add's (first body index, count)

    def __len__(self) -> int:
        return len(self._body) + len(self._tail)

    def add(self, slot: int, tokens: list[int], start: int, kept: int) -> slice:
        """`tokens` at positions start.. of cache row `slot`, the logits of the last `kept` of them wanted -> where
        they will be among run()'s logits."""
        cut = len(tokens) - kept
        self.placed.append((len(self._body), cut))  # where its tokens without logits are (hidden states)
        self._body += [(t, start + i, slot) for i, t in enumerate(tokens[:cut])]
        first = len(self._tail)
        self._tail += [(t, start + cut + i, slot) for i, t in enumerate(tokens[cut:])]
        return slice(first, first + kept)

    def run(self, backend: Backend, hidden: bool = False) -> np.ndarray:
        """The forward -> the wanted logits [K, V], in the order they were added; with `hidden` (the backend can:
        Backend.forward_hidden), also the hidden states of every add's tokens without logits (`self.hidden(i)`)."""
        tokens, positions, slots = (np.array([column], np.int64) for column in zip(*self._body, *self._tail))
        kept = len(self._tail)
        if hidden:
            logits, self._hidden = backend.forward_hidden(tokens, positions, rows=slots, keep=max(kept, 1))
        else:
            logits = backend.forward(tokens, positions, rows=slots, keep=max(kept, 1))
        return logits[0, logits.shape[1] - kept:] if kept else logits[0, :0]

    def hidden(self, i: int) -> np.ndarray:
        """The hidden states [n, H] of add number `i`'s tokens without logits (run with hidden=True)."""
        first, count = self.placed[i]
        return self._hidden[0, first:first + count]
