"""export/expert_schedule.py: the `trt` export's grouping of a routed step's pairs by expert (ONNX nodes, run by
ONNX Runtime) against the grouping written out by hand, pair by pair: every expert's pairs in pair order, in runs of
`rows` padded with P, each run labelled with its expert, and the bound's leftover runs empty: min(E, P) +
floor(P / rows) runs, so a decode step's k pairs make k runs."""

import numpy as np
import pytest
from conftest import expert_schedule


def by_hand(chosen: np.ndarray, experts: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    flat = chosen.reshape(-1)
    pairs = flat.size
    bound = min(experts, pairs) + pairs // rows
    order, blocks = [], []
    for e in range(experts):
        mine = [p for p in range(pairs) if flat[p] == e]
        for start in range(0, len(mine), rows):
            run = mine[start:start + rows]
            order += run + [pairs] * (rows - len(run))
            blocks.append(e)
    assert len(blocks) <= bound
    order += [pairs] * ((bound - len(blocks)) * rows)
    blocks += [experts] * (bound - len(blocks))
    return np.array(order), np.array(blocks)


@pytest.mark.parametrize("tokens, experts, top_k, rows, skew", [
    (1, 128, 8, 32, False),   # a decode step of Qwen3-30B-A3B's router
    (4, 6, 3, 4, False),
    (2, 4, 3, 4, False),      # tokens sharing experts: fewer runs than the bound
    (37, 6, 2, 4, False),     # several runs an expert, partial last runs
    (64, 8, 2, 32, True),     # most pairs on two experts, the others empty
    (512, 128, 8, 32, False),  # a 512-token prefill
])
def test_the_schedule_groups_every_pair_once_by_expert(tokens, experts, top_k, rows, skew):
    rng = np.random.default_rng(tokens)
    if skew:
        chosen = np.stack([rng.permutation([0, 1])[:top_k] if t % 8 else rng.choice(experts, top_k, replace=False)
                           for t in range(tokens)])
    else:
        chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    order, blocks = expert_schedule(chosen, experts, rows)
    want_order, want_blocks = by_hand(chosen, experts, rows)
    np.testing.assert_array_equal(blocks, want_blocks)
    np.testing.assert_array_equal(order, want_order)
    used = blocks < experts
    print(f"{tokens} tokens, {top_k} of {experts}: {used.sum()} runs of {rows} of the bound's {blocks.size}, "
          f"{(order < chosen.size).sum()} pairs placed")
