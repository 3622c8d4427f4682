"""One engine step's forward: the tokens of every row the step advances — decode tokens with their drafts, prompt
pieces, embeddings — each at its own positions in its own cache row. Every backend runs it:

- a ragged backend (its attention reads each token's cache row, passes.ragged_slots) in one forward, one batch row
  with no padding. The order inside a forward is free (every key and value is written before any query reads), so
  the tokens whose logits are needed go last and the head runs on those positions only (`keep`);
- any other backend through runtime/engine/contiguous.py, which lays the same adds out as right-padded forwards
  over contiguous ranges of cache rows, split where the backend says it must be.

    batch = Packed()
    mine = batch.add(slot, tokens, first_position, kept=1)   # -> its index
    logits = batch.run(backend)                               # logits[mine]: [kept, V]
    step_logits(backend, tokens, start, slot, kept)           # one row's step alone (benchmarks, evaluation)
"""

from __future__ import annotations

import numpy as np

from llgraph.runtime.engine.backend import Backend
from llgraph.runtime.engine.contiguous import Add, hidden_of, run_contiguous


class Packed:
    def __init__(self):
        self.adds: list[Add] = []
        self._hidden: list[np.ndarray | None] = []

    def __len__(self) -> int:
        return sum(len(a.tokens) for a in self.adds)

    def add(self, slot: int, tokens: list[int], start: int, kept: int, hidden: bool = False) -> int:
        """`tokens` at positions start.. of cache row `slot`, the logits of the last `kept` of them wanted (with
        `hidden`, kept is 0 and the hidden states of all are) -> its index among run()'s results."""
        self.adds.append(Add(slot, list(tokens), start, kept, hidden))
        return len(self.adds) - 1

    def run(self, backend: Backend) -> list[np.ndarray]:
        """The step's forward(s) -> each add's wanted logits [kept, V], in the order they were added; an add with
        `hidden` has its hidden states in `self.hidden(i)`."""
        self._hidden = [None] * len(self.adds)
        if not backend.ragged:
            logits, self._hidden = run_contiguous(backend, self.adds)
            return logits
        together = [i for i, a in enumerate(self.adds) if not a.hidden or backend.hidden_in_forward]
        out: list[np.ndarray] = [np.zeros((0, backend.vocab_size), np.float32)] * len(self.adds)
        for i, a in enumerate(self.adds):  # a backend that cannot return hidden states beside the logits
            if i not in together:
                self._hidden[i] = hidden_of(backend, a)
        if together:
            self._packed(backend, together, out)
        return out

    def _packed(self, backend: Backend, which: list[int], out: list[np.ndarray]) -> None:
        body: list[tuple[int, int, int]] = []  # (token, position, slot) of tokens without logits wanted
        tail: list[tuple[int, int, int]] = []  # the same, logits wanted, in add order
        places = []
        for i in which:
            a = self.adds[i]
            cut = len(a.tokens) - a.kept
            places.append((len(body), cut, len(tail)))
            body += [(t, a.start + j, a.slot) for j, t in enumerate(a.tokens[:cut])]
            tail += [(t, a.start + cut + j, a.slot) for j, t in enumerate(a.tokens[cut:])]
        tokens, positions, slots = (np.array([column], np.int64) for column in zip(*body, *tail))
        kept = max(len(tail), 1)
        if any(self.adds[i].hidden for i in which):
            logits, hidden = backend.forward_hidden(tokens, positions, rows=slots, keep=kept)
        else:
            logits, hidden = backend.forward(tokens, positions, rows=slots, keep=kept), None
        logits = logits[0, logits.shape[1] - len(tail):] if tail else logits[0, :0]
        for i, (first, count, at) in zip(which, places):
            out[i] = logits[at:at + self.adds[i].kept]
            if self.adds[i].hidden:
                self._hidden[i] = hidden[0, first:first + count]

    def hidden(self, i: int) -> np.ndarray:
        """The hidden states [n, H] float32 of add number `i`'s tokens (added with hidden=True; after run)."""
        found = self._hidden[i]
        assert found is not None, "hidden states are kept only for an add made with hidden=True"
        return found


def step_logits(backend: Backend, tokens, start: int = 0, slot: int = 0, kept: int = 1) -> np.ndarray:
    """One row's `tokens` (a list or an int array) at positions start.. of cache row `slot`, as a step of its own
    -> the logits of its last `kept` tokens [kept, V] (kept=len(tokens): every position's)."""
    batch = Packed()
    batch.add(slot, [int(t) for t in np.ravel(tokens)], start, kept)
    return batch.run(backend)[0]
