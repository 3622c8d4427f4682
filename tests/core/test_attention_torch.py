"""The executor's attention (llgraph/attention_torch.py): the spelled-out path a GPU runs (no cuDNN plan per shape)
held to torch's SDPA on the CPU, alone and through a whole model's ragged steps; and the mask built once a step."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import max_diff

from llgraph import attention_torch
from llgraph.attention_torch import spelled_out


@pytest.mark.parametrize("budget", [1 << 28, 4 * 2 * 8 * 50 * 3])  # one chunk of queries; chunks of 3 queries
def test_spelled_out_equals_sdpa(monkeypatch, report, budget):
    """Grouped query heads (8 on 2 KV heads) under a random mask, float32, against SDPA with enable_gqa."""
    monkeypatch.setattr(attention_torch, "SCORES_BUDGET", budget)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g) for shape in ((2, 8, 11, 16), (2, 2, 50, 16), (2, 2, 50, 16)))
    mask = torch.rand((2, 11, 50), generator=g) > 0.4
    mask[..., 0] = True  # every query sees a key
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=0.3, enable_gqa=True)
    got = spelled_out({"scale": 0.3, "softcap": 0.0}, q, k, v, mask)
    report(f"spelled-out attention vs SDPA, scores budget {budget} B", max_diff(got, want), 1e-5)


def _ragged_logits(runner) -> list[np.ndarray]:
    """Three rows' packed prefill then two packed decode steps: every row's last logits of each step."""
    from llgraph.runtime.engine.packed import Packed

    b = runner.backend
    b.allocate(3, zeroed=True)
    prompts = [[5, 9, 2, 41, 7, 3, 3, 8, 1, 4, 2, 6], [3, 88], [17, 4, 4, 60, 23, 11, 9, 31, 2]]
    out, ends = [], [len(p) for p in prompts]
    batch = Packed()
    for slot, p in zip([2, 0, 1], prompts):
        batch.add(slot, p, 0, kept=1)
    out += [x[-1] for x in batch.run(b)]
    for token in (13, 29):
        batch = Packed()
        for i, slot in enumerate([2, 0, 1]):
            batch.add(slot, [token + i], ends[i], kept=1)
            ends[i] += 1
        out += [x[-1] for x in batch.run(b)]
    return out


def test_the_executor_spelled_out_equals_its_sdpa(tmp_path, monkeypatch, report):
    """A model with windowed and full layers (a ring cache), ragged prefill and decode: the spelled-out path (as on
    a GPU) against the same model on SDPA."""
    from reference import tiny, write_hf_checkpoint

    from llgraph.checkpoint import random_weights
    from llgraph.runtime import TorchRunner

    cfg = tiny(num_layers=2, sliding_window=4, sliding_layers=(0,))
    folder = write_hf_checkpoint(tmp_path, cfg, random_weights(cfg, seed=3, std=0.25))
    want = _ragged_logits(TorchRunner(folder, max_seq_len=32))
    monkeypatch.setattr(attention_torch, "SDPA_DEVICES", set())
    got = _ragged_logits(TorchRunner(folder, max_seq_len=32))
    report("executor spelled out vs SDPA: ragged prefill + 2 decode steps, 3 rows, a windowed layer",
           max(max_diff(g, w) for g, w in zip(got, want)), 1e-5)


def test_a_step_builds_its_mask_once(tmp_path):
    """A decode step's mask (its rings and windows) is built by the first layer and read by the others: the ops
    that make it run as often with 4 layers as with 1."""
    from reference import tiny, write_hf_checkpoint

    from llgraph.checkpoint import random_weights
    from llgraph.runtime import TorchRunner
    from llgraph.runtime.bench.torch_ops import counted
    from llgraph.runtime.engine.packed import step_logits

    made = {}
    for layers in (1, 4):
        cfg = tiny(num_layers=layers)
        b = TorchRunner(write_hf_checkpoint(tmp_path / str(layers), cfg, random_weights(cfg, seed=2)),
                        max_seq_len=32).backend
        b.allocate(1, zeroed=True)
        step_logits(b, [1, 2, 3, 4], 0)
        ops = counted(lambda b=b: step_logits(b, [5], 4))
        made[layers] = {op: ops[op] for op in ("arange", "remainder", "le", "ge")}
    print(made)
    assert made[1] == made[4] and made[1]["remainder"] >= 1, made
