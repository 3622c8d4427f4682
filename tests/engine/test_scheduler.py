"""The continuous-batching scheduler in-process, on the tiny model: requests joining and leaving a running batch
keep their solo tokens — greedy and seeded sampling, each with its own parameters — and cancel, timeout, a bounded
queue and draining behave as the server relies on."""

import time

import numpy as np
import pytest
import torch

from llgraph.errors import RequestError
from llgraph.runtime.engine import speculative
from llgraph.runtime.engine.backend import Backend
from llgraph.runtime.engine.runner import Runner
from llgraph.runtime.engine.sampling import Sampling
from llgraph.runtime.engine.scheduler import QueueFull, Scheduler, ShuttingDown
from llgraph.runtime.engine.step import Metrics


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, 97, (2 + (5 * i) % 13,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("backend", ["ort", "ort-llgraph", "torch"])
def test_requests_joining_a_running_batch_keep_their_solo_tokens(backend, tiny_runners):
    """10 requests through 3 slots, every other one sampled (temperature, top-p, its own seed): each equals
    generate() of that request alone."""
    runner = tiny_runners[2][backend]
    prompts = _prompts(10)
    sampling = [Sampling() if i % 2 == 0 else Sampling(temperature=0.9, top_p=0.9, seed=100 + i) for i in range(10)]
    lengths = [6 + (3 * i) % 11 for i in range(10)]
    solo = [runner.generate(p, n, temperature=s.temperature, top_p=s.top_p, seed=s.seed).token_ids
            for p, n, s in zip(prompts, lengths, sampling)]
    scheduler = Scheduler(runner, slots=3).start()
    try:
        handles = [scheduler.submit(p, n, s) for p, n, s in zip(prompts, lengths, sampling)]
        got = [h.result(timeout=60).tokens for h in handles]
    finally:
        scheduler.stop()
    assert got == solo
    assert all(h.decoding.finish_reason == "length" for h in handles)


class Slow(Backend):
    """The tiny model at 10 ms a step, so a request is still running when the test cancels it."""

    def __init__(self, inner):
        self.inner, self.max_seq_len, self.vocab_size = inner, inner.max_seq_len, inner.vocab_size

    def allocate(self, batch):
        self.inner.allocate(batch)

    def forward(self, input_ids, position_ids, rows=None, keep=0):
        time.sleep(0.01)
        return self.inner.forward(input_ids, position_ids, rows, keep)


def test_cancel_and_timeout_end_a_request_and_free_its_slot(tiny_runners):
    runner = Runner(Slow(tiny_runners[2]["ort"].backend))
    scheduler = Scheduler(runner, slots=1).start()
    try:
        long = scheduler.submit([1, 2, 3], 55)
        long.events.get(timeout=30)  # its first token: it is decoding
        long.cancel()
        assert long.result(timeout=30).finish_reason == "cancelled" and len(long.decoding.tokens) < 55
        after = scheduler.submit([4, 5], 5).result(timeout=30)  # the slot was freed
        assert after.finish_reason == "length" and len(after.tokens) == 5
        late = scheduler.submit([1, 2, 3], 55, timeout=0.0)
        assert late.result(timeout=30).finish_reason == "timeout"
    finally:
        scheduler.stop()


def test_the_queue_is_bounded_and_draining_refuses_new_requests(tiny_runners):
    scheduler = Scheduler(tiny_runners[2]["ort"], slots=1, max_queue=1)  # not started: nothing is admitted
    scheduler.submit([1], 4)
    scheduler.submit([2], 4)  # one for the free slot, one queued
    with pytest.raises(QueueFull, match="all 1 slots are busy and 2 requests are queued"):
        scheduler.submit([3], 4)
    scheduler.drain()
    with pytest.raises(ShuttingDown):
        scheduler.submit([4], 4)


def test_stop_with_grace_finishes_running_requests(tiny_runners):
    scheduler = Scheduler(tiny_runners[2]["ort"], slots=2).start()
    handles = [scheduler.submit([1, 2], 20), scheduler.submit([3], 20)]
    time.sleep(0.05)
    scheduler.stop(grace=30)  # returns once both finished on their own
    assert [h.result().finish_reason for h in handles] == ["length", "length"]  # the events were all handed over
    assert all(len(h.decoding.tokens) == 20 for h in handles)


def test_the_tokens_per_second_record_stays_bounded_without_scrapes(tiny_runners, monkeypatch):
    """The record behind tokens/s keeps 10 s of steps, trimmed as steps are added: before, only /health and
    /metrics trimmed it, so a server nobody scraped kept a tuple for every step it ever ran. Here each step is 1 s
    apart on a fake clock, and nothing reads stats() while 40 steps run."""
    import itertools

    import llgraph.runtime.engine.scheduler as module

    clock = itertools.count()  # next() on it is atomic: the test thread and the decode thread both read the clock
    monkeypatch.setattr(module.time, "monotonic", lambda: float(next(clock)))
    scheduler = Scheduler(tiny_runners[2]["ort"], slots=1).start()
    try:
        scheduler.submit([1, 2, 3], 40).result(timeout=60)
        kept = len(scheduler._recent)
    finally:
        scheduler.stop()
    print(f"steps kept after 40 one-second steps: {kept}")
    assert kept <= 12


class Exploding:
    """A stand-in for one request's own machinery (its sampling seed, grammar or drafter) that raises at its
    `after`-th use: an error in that request's work, whatever its cause."""

    def __init__(self, after: int):
        self.after, self.uses = after, 0

    def tick(self):
        self.uses += 1
        if self.uses > self.after:
            raise ValueError("boom")


class FailingSampling(Sampling):
    def generator(self):  # fails in the request's prefill
        raise ValueError("Seed must be between 0 and 2**128 - 1")


class FailingGrammar:
    """A grammar whose matcher allows every token, then raises at its third token."""

    def matcher(self, tokenizer, vocab_size, eos):
        boom = Exploding(2)

        class M:
            def allowed(self, vocab):
                boom.tick()
                return np.ones(vocab, np.bool_)

            def advance(self, token):
                pass
        return M()


def test_one_requests_error_fails_that_request_only(tiny_runners, monkeypatch, capfd):
    """Issue 38, item 1: a request whose own work raises — in its prefill (its sampler's generator) or at its third
    token (its grammar) — ends alone with finish_reason "error" and an error event; the requests decoding beside it
    keep their solo tokens, and a later request on its row too. Issue 65, item 6: a request whose drafting fails
    is logged (the bug's traceback) and decodes on without speculation, to its solo tokens."""
    runner = tiny_runners[2]["ort"]
    prompts = _prompts(4)
    solo = [runner.generate(p, 20).token_ids for p in prompts]
    speculating = runner.generate(prompts[3] * 3, 20).token_ids
    scheduler = Scheduler(runner, slots=4).start()
    try:
        good = [scheduler.submit(p, 20) for p in prompts[:2]]
        boom = Exploding(1)

        class FailingDrafter(speculative.Drafter):  # the only speculating request's drafter fails at its second draft
            def draft(self, room):
                boom.tick()
                return super().draft(room)
        monkeypatch.setattr(speculative, "Drafter", FailingDrafter)
        bad = [scheduler.submit(prompts[2], 20, FailingSampling(temperature=0.5, seed=1)),
               scheduler.submit(prompts[2], 20, grammar=FailingGrammar())]
        drafting = scheduler.submit(prompts[3] * 3, 20, speculative="ngram")
        for h in bad:
            with pytest.raises(RequestError, match="ValueError"):
                h.result(timeout=60)
            assert h.decoding.finish_reason == "error"
        assert drafting.result(timeout=60).tokens == speculating and boom.uses == 2
        assert "its drafting failed; it decodes without speculation" in capfd.readouterr().err
        assert [h.result(timeout=60).tokens for h in good] == solo[:2]
        later = [scheduler.submit(p, 20) for p in prompts]  # the failed requests' rows serve again
        assert [h.result(timeout=60).tokens for h in later] == solo
    finally:
        scheduler.stop()


@pytest.mark.parametrize("seed", [-5, -(1 << 63), (1 << 63) - 1, 1 << 70])
def test_every_integer_is_a_seed(seed, tiny_runners):
    """Issue 38, item 1: a negative seed (OpenAI's is a signed 64-bit integer) raised inside numpy's generator, in
    the scheduler's step. Every integer seeds now, modulo 2**64: the same seed, the same tokens."""
    runner = tiny_runners[2]["ort"]
    one = runner.generate([5, 6, 7], 12, temperature=1.0, seed=seed).token_ids
    assert runner.generate([5, 6, 7], 12, temperature=1.0, seed=seed).token_ids == one
    assert runner.generate([5, 6, 7], 12, temperature=1.0, seed=seed + (1 << 64)).token_ids == one
    with pytest.raises(RequestError, match="seed"):
        Sampling(temperature=1.0, seed=1.5)


@pytest.mark.parametrize("backend", ["ort", "ort-llgraph", "torch"])
def test_long_prompts_written_in_chunks_keep_every_requests_tokens(backend, tiny_runners):
    """prefill_chunk 5: prompts of up to 40 tokens are written 5 at a time between the others' decode steps; every
    request, chunked or not, equals its solo generate(), and a later request reusing a chunked prompt's prefix too."""
    runner = tiny_runners[2][backend]
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (40, 3, 23, 4, 31, 12, 35)]
    prompts.append(prompts[-1][:30] + [7, 8])  # shares 30 tokens with a prompt written in chunks just before
    sampling = [Sampling() if i % 2 == 0 else Sampling(temperature=0.9, seed=7 + i) for i in range(len(prompts))]
    solo = [runner.generate(p, 8, temperature=s.temperature, seed=s.seed).token_ids for p, s in zip(prompts, sampling)]
    reused = []

    class Count(Metrics):
        def prefix(self, r, prompt):
            reused.append((r, prompt))

    scheduler = Scheduler(runner, slots=3, prefill_chunk=5)
    scheduler.metrics = Count()
    scheduler.start()
    try:
        first = [scheduler.submit(p, 8, s) for p, s in zip(prompts[:-2], sampling)]
        got = [h.result(timeout=60).tokens for h in first]
        got += [scheduler.submit(p, 8, s).result(timeout=60).tokens for p, s in zip(prompts[-2:], sampling[-2:])]
        scored = scheduler.submit(prompts[0], 3, prompt_logprobs=True)  # a scored prompt is never written in chunks
        scored.result(timeout=60)
    finally:
        scheduler.stop()
    assert got == solo
    ids = prompts[0]
    want = [x.logprob for x in runner.score_batch([(ids[:k], [ids[k]]) for k in range(1, len(ids))])]
    assert len(scored.prompt_logprobs) == len(ids) - 1
    assert max(abs(x.logprob - w) for x, w in zip(scored.prompt_logprobs, want)) < 1e-4
    # counted once each; the prefix reused; the scored prompt written whole (no reuse)
    assert len(reused) == len(prompts) + 1 and reused[-3][0] < 30 <= reused[-2][0] and reused[-1][0] == 0
