"""One prefill path for every prompt (issue 48 item 1): a long embedding input and a long scored prompt are written
a chunk at a time between a running stream's decode steps, like any prompt, and give the same bits as written whole
(Runner.embed; the scheduler without chunks): no forward beside a running stream writes more than a chunk — on a
ragged backend the chunk and the stream's token are one forward (Engine.step)."""

import numpy as np
import pytest

from llgraph.runtime.backends.ort import ORTRunner
from llgraph.runtime.engine.scheduler import Scheduler

CHUNK = 32


class Recording:
    """Wraps a backend: the tokens of every call, in order (a decode step of the stream is a call of one token a
    row)."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, input_ids, position_ids, rows=None, keep=0):
        self.calls.append(input_ids.shape)
        return self.backend.forward(input_ids, position_ids, rows, keep)

    def hidden(self, input_ids, position_ids, rows=None):
        self.calls.append(input_ids.shape)
        return self.backend.hidden(input_ids, position_ids, rows)

    def forward_hidden(self, input_ids, position_ids, rows=None, keep=0):
        self.calls.append(input_ids.shape)
        return self.backend.forward_hidden(input_ids, position_ids, rows, keep)


@pytest.fixture(scope="module")
def runner(smollm2_export):
    return ORTRunner(smollm2_export("ort", quantized=True))


def _beside_a_stream(runner, submit_long):
    """A greedy stream decodes; once it runs, `submit_long(scheduler)` arrives -> (its handles, the calls made
    while it was written)."""
    recording = Recording(runner.backend)
    runner.backend = recording
    scheduler = Scheduler(runner, slots=4, prefill_chunk=CHUNK).start()
    try:
        stream = scheduler.submit("Once upon a time", 200, stop=(), eos_token_ids=())
        assert stream.events.get(timeout=60).kind == "token"
        recording.calls.clear()
        handles = submit_long(scheduler)
        for h in handles:
            h.result(timeout=120)
        calls = list(recording.calls)
        stream.cancel()
    finally:
        scheduler.stop()
        runner.backend = recording.backend
    return handles, calls


def test_a_long_embedding_is_written_in_chunks_and_equals_runner_embed(runner):
    texts = [[5 + i % 90 for i in range(200)], [7 + i % 80 for i in range(170)]]
    for pooling in ("last", "mean"):
        whole = runner.embed(texts, pooling=pooling)
        handles, calls = _beside_a_stream(runner, lambda s, p=pooling: [s.submit(t, 0, pooling=p) for t in texts])
        worst = max(float(np.abs(h.embedding - w).max()) for h, w in zip(handles, whole))
        print(f"{pooling} pooling in chunks of {CHUNK} beside a stream: {len(calls)} forwards, the largest "
              f"{max(rows * seq for rows, seq in calls)} tokens; max|diff| from Runner.embed = {worst:.3e}")
        # on a ragged backend the stream's decode token rides in the same forward as the chunk (Engine.step)
        largest = max(rows * seq for rows, seq in calls)
        assert largest == CHUNK + 1 if runner.backend.ragged else largest <= CHUNK
        assert worst == 0.0


def test_a_long_scored_prompt_is_written_in_chunks_and_scores_as_written_whole(runner):
    prompt = [3 + (7 * i) % 97 for i in range(150)]
    scheduler = Scheduler(runner, slots=2).start()  # no chunks: the prompt in one forward
    try:
        whole = scheduler.submit(prompt, 0, prompt_logprobs=True, logprobs=2)
        whole.result(timeout=120)
    finally:
        scheduler.stop()
    handles, calls = _beside_a_stream(runner, lambda s: [s.submit(prompt, 0, prompt_logprobs=True, logprobs=2),
                                                         s.submit(prompt, 3, prompt_logprobs=True)])
    print(f"a {len(prompt)}-token scored prompt in chunks of {CHUNK}: {len(calls)} forwards, the largest "
          f"{max(rows * seq for rows, seq in calls)} tokens")
    # on a ragged backend the stream's decode token rides in the same forward as the chunk (Engine.step)
    largest = max(rows * seq for rows, seq in calls)
    assert largest == CHUNK + 1 if runner.backend.ragged else largest <= CHUNK
    assert len(handles[0].prompt_logprobs) == len(prompt) - 1
    assert handles[0].prompt_logprobs == whole.prompt_logprobs  # every logprob and alternative, the same bits
    assert [(s.token, s.logprob) for s in handles[1].prompt_logprobs] == \
        [(s.token, s.logprob) for s in whole.prompt_logprobs]


class SlowClock(Recording):
    """A Recording whose every input token costs 10 ms on the scheduler's clock (a slow host or a large model, made
    deterministic): the clock moves only by the forwards' tokens."""

    def __init__(self, backend):
        super().__init__(backend)
        self.now = 0.0

    def __call__(self):
        return self.now

    def forward(self, input_ids, position_ids, rows=None, keep=0):
        self.now += 0.01 * input_ids.size
        return super().forward(input_ids, position_ids, rows, keep)


def test_a_step_is_chunked_by_time_on_a_slow_machine(runner):
    """Issue 64 item 7: at 10 ms a token a 128-token chunk held a running stream 1.3 s a step; the scheduler measures
    the pace and writes about STEP_SECONDS' worth beside a decoding row (0.5 s: 50 tokens, never under MIN_CHUNK)."""
    from llgraph.runtime.engine.scheduler import MIN_CHUNK, STEP_SECONDS

    slow = SlowClock(runner.backend)
    runner.backend = slow
    scheduler = Scheduler(runner, slots=4, prefill_chunk=128)
    scheduler._clock = slow
    scheduler.start()
    try:
        stream = scheduler.submit("Once upon a time", 200, stop=(), eos_token_ids=())
        assert stream.events.get(timeout=60).kind == "token"
        slow.calls.clear()
        scheduler.submit("The history of the world. " * 40, 1, stop=(), eos_token_ids=()).result(timeout=120)
        sizes = [int(np.prod(shape)) for shape in slow.calls]
        stream.cancel()
    finally:
        scheduler.stop()
        runner.backend = slow.backend
    print("tokens a forward while the prompt was written:", sizes)
    big = [s for s in sizes if s > 2]  # the forwards that wrote prompt tokens beside the stream's one
    assert big[0] <= 128 + 1 and max(big[1:]) <= int(STEP_SECONDS / 0.01) + 1 and min(big[1:-1]) >= MIN_CHUNK
    assert len(big) >= 4  # 128, then 50 a step
