"""Prefix reuse in the scheduler: requests sharing a prompt prefix (a system prompt, a conversation's earlier
turns) prefill only their new tail — from their own slot's row or a row copied from another slot — and still get
exactly their solo answers, on ONNX Runtime and torch."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from llgraph.runtime.engine.sampling import Sampling
from llgraph.runtime.engine.scheduler import Metrics, Scheduler

SYSTEM = ("You are a meticulous assistant for a library. Answer in one short sentence. The library opens at nine, "
          "closes at six, lends up to five books for three weeks, and has a reading room on the second floor. ") * 3
QUESTIONS = ["When does the library open?", "How many books can I borrow?", "Where is the reading room?",
             "When does it close?", "How long is a loan?", "Is there a reading room?", "Can I borrow six books?",
             "What time do you open?"]


class Counting(Metrics):
    def __init__(self):
        self.prefills = []  # (reused, prompt tokens)

    def prefix(self, reused: int, prompt: int) -> None:
        self.prefills.append((reused, prompt))


def _chat(q):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]


@pytest.fixture(scope="module")
def ort_runner(serve_export):
    from llgraph.runtime import ORTRunner

    return ORTRunner(serve_export, max_seq_len=256)


def test_requests_sharing_a_system_prompt_reuse_it_and_equal_their_solo_answers(ort_runner):
    runner = ort_runner
    solo = [runner.generate(_chat(q), 16).text for q in QUESTIONS]
    system_tokens = len(runner.encode(runner.render_chat(_chat("x")))) - 8
    metrics = Counting()
    scheduler = Scheduler(runner, slots=4, metrics=metrics).start()
    try:
        first = scheduler.submit(_chat(QUESTIONS[0]), 16).result(timeout=120).text()
        # a follow-up turn of that conversation: its whole earlier exchange is cached in its row
        follow = [*_chat(QUESTIONS[0]), {"role": "assistant", "content": first},
                  {"role": "user", "content": "And on Sundays?"}]
        again = scheduler.submit(follow, 16).result(timeout=120).text()
        with ThreadPoolExecutor(7) as pool:  # the other 7 at once, through 4 slots: copied from the first's row
            rest = list(pool.map(lambda q: scheduler.submit(_chat(q), 16).result(timeout=120).text(), QUESTIONS[1:]))
    finally:
        scheduler.stop()
    assert [first, *rest] == solo
    assert again == runner.generate(follow, 16).text
    print("prefills (reused, prompt):", metrics.prefills)
    assert metrics.prefills[0][0] == 0
    reused, prompt = metrics.prefills[1]
    assert reused >= len(runner.encode(runner.render_chat(_chat(QUESTIONS[0])))) and prompt - reused < 30
    assert all(reused >= system_tokens for reused, _ in metrics.prefills[2:])


def test_prefix_reuse_on_torch_copies_rows_and_stays_exact(tiny_runners):
    runner = tiny_runners[2]["torch"]
    shared = list(range(3, 40))
    prompts = [shared + [50 + i, 60 + i] for i in range(6)]
    solo = [runner.generate(p, 12).token_ids for p in prompts]
    metrics = Counting()
    scheduler = Scheduler(runner, slots=3, metrics=metrics).start()
    try:
        scheduler.submit(prompts[0], 12).result(timeout=60)
        handles = [scheduler.submit(p, 12, Sampling()) for p in prompts[1:]]
        served = [h.result(timeout=60).tokens for h in handles]
    finally:
        scheduler.stop()
    assert served == solo[1:]
    assert all(reused == len(shared) for reused, _ in metrics.prefills[1:]), metrics.prefills


def test_without_reuse_every_prompt_is_prefilled_whole(ort_runner):
    metrics = Counting()
    scheduler = Scheduler(ort_runner, slots=2, metrics=metrics, reuse_prefixes=False).start()
    try:
        for q in QUESTIONS[:3]:
            scheduler.submit(_chat(q), 4).result(timeout=60)
    finally:
        scheduler.stop()
    assert [reused for reused, _ in metrics.prefills] == [0, 0, 0]


def test_a_generate_batch_sharing_a_prompt_prefix_computes_it_once(ort_runner, tiny_runners, monkeypatch):
    """Runner.generate on a batch whose prompts share a system prompt prefills it in row 0 only, copies it to the
    other rows and prefills their tails: the same tokens as each prompt alone (greedy), and as the batch without
    reuse (seeded sampling), on ONNX Runtime (tails one row at a time) and on torch (one padded forward)."""
    prompts = [_chat(q) for q in QUESTIONS[:4]]
    solo = [ort_runner.generate(p, 12).token_ids for p in prompts]
    calls = []
    forward = ort_runner.backend.forward

    def counted(ids, positions, rows=None, keep=0):
        calls.append(ids.shape)
        return forward(ids, positions, rows, keep)
    monkeypatch.setattr(ort_runner.backend, "forward", counted)
    assert [g.token_ids for g in ort_runner.generate(prompts, 12)] == solo
    prefilled = sum(rows * seq for rows, seq in calls if seq > 1)
    whole = sum(len(ort_runner.encode(p)) for p in prompts)
    print(f"batch of 4 sharing a system prompt: {prefilled} tokens prefilled of {whole}")
    assert prefilled < whole / 2
    sampled = dict(temperature=0.8, top_p=0.9, seed=4)
    reused = [g.token_ids for g in ort_runner.generate(prompts, 12, **sampled)]
    monkeypatch.setattr(ort_runner, "reuse_prefixes", False)
    assert [g.token_ids for g in ort_runner.generate(prompts, 12, **sampled)] == reused
    torch_runner, shared = tiny_runners[2]["torch"], list(range(1, 20))
    tiny = [shared + [30, 31], shared + [40], shared + [50, 51, 52, 53]]
    assert [g.token_ids for g in torch_runner.generate(tiny, 10)] == \
        [torch_runner.generate(p, 10).token_ids for p in tiny]
