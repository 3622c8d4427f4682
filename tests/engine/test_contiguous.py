"""A packed step on a backend without ragged rows (runtime/engine/contiguous.py): every add gets the logits of its own
tokens at its own positions in its own cache row, whatever padding and grouping the layout chose; where the backend
cannot run several rows of several tokens after a cached prefix (GroupQueryAttention), no forward asks it to."""

import numpy as np
import pytest

from llgraph.runtime.engine.backend import Backend
from llgraph.runtime.engine.packed import Packed


class Coded(Backend):
    """A forward whose logits at each position code what ran there: (token, position, cache row)."""
    max_seq_len, vocab_size = 64, 3

    def __init__(self, multi_token_rows: bool):
        self.multi_token_rows, self.calls = multi_token_rows, []

    def allocate(self, batch, zeroed=False):
        pass

    def forward(self, input_ids, position_ids, rows=None, keep=0):
        batch, seq = input_ids.shape
        self.calls.append((input_ids.shape, position_ids.copy()))
        first = 0 if rows is None else rows.start
        out = np.stack([input_ids, position_ids, np.broadcast_to(first + np.arange(batch)[:, None], (batch, seq))],
                       -1).astype(np.float32)
        return out[:, seq - (min(keep, seq) if keep else seq):]


# (slot, tokens, start, kept): decode rows with holes between them, a draft, whole prompts in consecutive slots,
# a prompt's middle piece, and a one-token piece after a prefix that wants no logits
ADDS = [(0, [11], 10, 1), (2, [12], 12, 1), (3, [13, 14, 15], 20, 3), (5, [1, 2, 3, 4, 5, 6], 0, 1),
        (6, [7, 8, 9], 4, 0), (7, [21, 22], 0, 1), (4, [30], 7, 0), (1, [40, 41, 42, 43], 0, 4)]


@pytest.mark.parametrize("multi_token_rows", [True, False])
def test_each_add_gets_its_own_logits_and_no_forward_breaks_the_backends_rule(multi_token_rows):
    backend = Coded(multi_token_rows)
    batch = Packed()
    for slot, tokens, start, kept in ADDS:
        batch.add(slot, tokens, start, kept)
    got = batch.run(backend)
    for (slot, tokens, start, kept), logits in zip(ADDS, got):
        positions = range(start + len(tokens) - kept, start + len(tokens))
        want = [[t, p, slot] for t, p in zip(tokens[len(tokens) - kept:], positions)]
        assert logits.tolist() == want, (slot, logits.tolist(), want)
    print(f"multi_token_rows={multi_token_rows}: {len(backend.calls)} forwards, shapes "
          f"{[shape for shape, _ in backend.calls]}")
    if not multi_token_rows:  # GroupQueryAttention: several rows of several tokens only from position 0
        for (rows, seq), positions in backend.calls:
            assert seq == 1 or rows == 1 or (positions[:, 0] == 0).all(), positions
    else:  # the decode rows, the draft among them, share one forward over slots 0..3 (padded to the draft's 3, or to
        # slot 1's four scored tokens, which join them)
        assert [shape[0] for shape, p in backend.calls if p[0, 0] == 10] == [4]
