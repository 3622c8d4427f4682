"""Ragged rows (passes.ragged_slots, runtime/engine/backend.py): on a backend whose attention reads each token's
cache row, prompts in any slots are prefilled in one packed forward and a decode step runs only the busy rows —
with the same logits as each row run alone in a cache of its own."""

import numpy as np
import pytest
from conftest import max_diff

from llgraph.runtime.engine.backend import Backend
from llgraph.runtime.engine.packed import Packed
from llgraph.runtime.engine.row import Params, Row
from llgraph.runtime.engine.runner import Runner
from llgraph.runtime.engine.scheduler import Scheduler
from llgraph.runtime.engine.step import Engine

PROMPTS = [[5, 9, 2, 41, 7], [3, 88], [17, 4, 4, 60, 23, 11, 9, 31]]
SLOTS = [3, 0, 2]  # of four: slot 1 stays free, and slot 0 leaves after its prefill


def _solo(runner, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """The prompt's last logits, then each of `tokens` decoded after it, in a one-row cache."""
    b = runner.backend
    b.allocate(1, zeroed=True)
    out = [b.forward(np.array([prompt]), np.arange(len(prompt))[None], keep=1)[0, -1]]
    for i, t in enumerate(tokens):
        out.append(b.forward(np.array([[t]]), np.array([[len(prompt) + i]]), keep=1)[0, -1])
    return out


@pytest.mark.parametrize("backend", ["ort-llgraph", "torch"])
def test_packed_prefill_and_steps_with_holes_equal_each_row_alone(tiny_runners, backend, report):
    runner = tiny_runners[2][backend]
    b = runner.backend
    follow = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
    want = [_solo(runner, p, f) for p, f in zip(PROMPTS, follow)]
    b.allocate(4, zeroed=True)
    rows = [Row(Params(p, 4), slot=s) for p, s in zip(PROMPTS, SLOTS)]
    batch = Packed()
    for r in rows:
        batch.add(r.slot, r.ids, 0, kept=1)
    got = [[x[-1]] for x in batch.run(b)]  # one forward, no padding
    busy = [0, 2]  # slots 3 and 2: a hole at 0 and 1 below them
    for i in range(3):
        batch = Packed()
        for r in busy:
            batch.add(SLOTS[r], [follow[r][i]], len(PROMPTS[r]) + i, kept=1)
        for r, x in zip(busy, batch.run(b)):
            got[r].append(x[-1])
    diff = max(max_diff(g, w) for r in busy for g, w in zip(got[r], want[r]))
    diff = max(diff, max_diff(got[1][0], want[1][0]))
    report(f"{backend}: packed prefill in slots {SLOTS} and steps over slots 3, 2 vs each row alone", diff, 1e-4)


class Recording(Backend):
    """A backend that records the batch shape and rows of each forward."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.max_seq_len, self.vocab_size, self.ragged = inner.max_seq_len, inner.vocab_size, inner.ragged
        self.multi_token_rows = inner.multi_token_rows

    def allocate(self, batch):
        self.inner.allocate(batch)

    def caches(self):
        return self.inner.caches()

    def forward(self, input_ids, position_ids, rows=None, keep=0):
        self.calls.append((input_ids.shape, rows if rows is None or isinstance(rows, slice) else
                           np.asarray(rows).tolist()))
        return self.inner.forward(input_ids, position_ids, rows, keep)


@pytest.mark.parametrize("backend", ["ort-llgraph", "torch", "ort"])
def test_a_step_runs_only_the_busy_rows_on_a_ragged_backend(tiny_runners, backend):
    """Rows in slots 3 and 1 of four: a ragged backend's prefill is one forward of both prompts and its decode step a
    forward of their two tokens; a backend without slot ids (ort on ONNX Runtime's own attention) writes each prompt
    in a forward of its own (slots 1 and 3 are not one range) and decodes slots 1..3 (runtime/engine/contiguous.py)."""
    inner = tiny_runners[2][backend].backend
    b = Recording(inner)
    b.allocate(4)
    engine = Engine(b)
    rows = [Row(Params(PROMPTS[0], 3), slot=3), Row(Params(PROMPTS[1], 3), slot=1)]
    engine.step(rows)
    prefills, b.calls = b.calls, []
    engine.step(rows)
    assert [r.error for r in rows] == [None, None]
    (shape, ran), = b.calls
    if inner.ragged:
        assert len(prefills) == 1 and prefills[0][0] == (1, len(PROMPTS[0]) + len(PROMPTS[1]))
        # the two busy rows' tokens, packed into one batch row
        assert shape == (1, 2) and sorted(np.ravel(ran).tolist()) == [1, 3]
    else:
        assert sorted(call[1] for call in prefills) == [slice(1, 2), slice(3, 4)]
        assert shape == (3, 1) and ran == slice(1, 4)


@pytest.mark.parametrize("backend", ["ort-llgraph", "torch"])
def test_requests_admitted_together_into_scattered_slots_keep_their_solo_tokens(tiny_runners, backend):
    """Seven requests through four slots, admitted several at a time (one packed prefill each admission) into
    slots that prefix reuse and departures scatter: each equals generate() alone."""
    runner = tiny_runners[2][backend]
    prompts = [PROMPTS[i % 3] + [i + 1] * (i % 4) for i in range(7)]
    lengths = [3 + (5 * i) % 9 for i in range(7)]
    solo = [runner.generate(p, n).token_ids for p, n in zip(prompts, lengths)]
    scheduler = Scheduler(Runner(runner.backend), slots=4)
    handles = [scheduler.submit(p, n) for p, n in zip(prompts, lengths)]  # queued before the loop starts
    scheduler.start()
    try:
        got = [h.result(timeout=60).tokens for h in handles]
    finally:
        scheduler.stop()
    assert got == solo


def test_a_draft_model_drafts_every_row_in_one_forward_a_position(tiny_runners):
    """Three rows speculating with a ragged draft model (the torch executor drafting for the ort runner): each of
    its forwards runs every row still drafting (speculative.draft_together), and the output is plain greedy."""
    target, inner = tiny_runners[2]["ort-llgraph"], tiny_runners[2]["torch"]
    recording = Recording(inner.backend)
    draft = Runner(recording)
    plain = [g.token_ids for g in target.generate(PROMPTS, 16)]
    assert [g.token_ids for g in target.generate(PROMPTS, 16, speculative=draft)] == plain
    rows_a_call = [shape[0] if ran is None else len(set(np.asarray(ran).reshape(-1).tolist()))
                   for shape, ran in recording.calls]
    print(f"draft model forwards: {len(recording.calls)}, rows in each: {rows_a_call}")
    assert max(rows_a_call) == len(PROMPTS)  # the rows' drafts, and their catching up, in one forward
    assert len(recording.calls) <= 16 * 4  # not a forward per row and drafted position


def test_a_long_packed_prefill_on_the_executor_reads_the_device_once_a_step(tmp_path, report):
    """Prompts of more tokens together than the executor gathers (executor.GATHERED_TOKENS) attend cache row by
    cache row. Which tokens are whose, and each row's span, are read off the device once a step — as many reads
    with 4 layers as with 1 (on a GPU each read waits for every queued kernel) — and each row's logits equal its
    own prefill alone."""
    import collections

    from reference import tiny, write_hf_checkpoint
    from torch.utils._python_dispatch import TorchDispatchMode

    from llgraph.checkpoint import random_weights
    from llgraph.executor import GATHERED_TOKENS
    from llgraph.runtime import TorchRunner

    class Reads(TorchDispatchMode):
        """Counts the ops that copy a value off a tensor's device to Python."""
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero", "_unique2", "unique_consecutive"):
                self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    prompts = [list(range(3 + i, 40 + 2 * i)) for i in range(3)]  # 37 + 39 + 41 tokens, in slots 2, 0, 1
    assert sum(map(len, prompts)) > GATHERED_TOKENS
    reads = {}
    for layers in (1, 4):
        cfg = tiny(num_layers=layers)
        b = TorchRunner(write_hf_checkpoint(tmp_path / str(layers), cfg, random_weights(cfg, seed=2, std=0.25)),
                        max_seq_len=64).backend
        alone = []
        for p in prompts:
            b.allocate(1, zeroed=True)
            alone.append(b.forward(np.array([p]), np.arange(len(p))[None], keep=1)[0, -1])
        b.allocate(3, zeroed=True)
        batch = Packed()
        for slot, p in zip([2, 0, 1], prompts):
            batch.add(slot, p, 0, kept=1)
        with Reads() as counted:
            got = [x[-1] for x in batch.run(b)]
        reads[layers] = dict(counted.ops)
        report(f"{layers} layers: packed prefill of {sum(map(len, prompts))} tokens in 3 rows vs each alone",
               max(max_diff(g, w) for g, w in zip(got, alone)), 1e-5)
    assert reads[1] == reads[4], reads
