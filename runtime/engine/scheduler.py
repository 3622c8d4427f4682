"""Continuous batching over any backend: a fixed number of cache rows ("slots"); requests queue, are prefilled into a
free slot between decode steps, decode together, and leave when done (EOS, a stop string, their length, cancelled
because the client left, or their timeout).

    scheduler = Scheduler(runner, slots=8).start()       # owns the runner's backend from now on
    handle = scheduler.submit("Hello", max_new_tokens=32, sampling=Sampling(temperature=0.7, seed=1))
    for piece in handle.text():                          # streamed text; handle.result() waits for the whole
        ...
    handle.cancel()                                      # the slot is free before the next step
    scheduler.stop(grace=10)                             # no new requests; the running ones get `grace` seconds

Why it is exact: the static cache is indexed by position, so each slot's row holds that request's keys and values
whatever the others do. A step is one engine step (Engine.step, runtime/engine/step.py): every running
request's next token and draft, and as many prompt tokens of the admitted requests as `prefill_chunk` (the step's
prompt-token budget) allows, on every backend — one packed forward where the backend's attention reads each token's
cache row (an export on llgraph's CPU kernels, the torch executor), where a free slot costs nothing; elsewhere the
same batch as padded forwards over contiguous rows (runtime/engine/contiguous.py), a free row between busy ones
taking a dummy token at the last position of its own row. Each request samples with its own parameters and
generator.

Prefix reuse: a row keeps the keys and values of the tokens its request wrote (prompt, then each step's input)
after the request leaves. A new request takes the free slot whose row holds the longest prefix of its prompt, or
copies the longest one another row holds (a finished request's, or a running one's prompt: positions a request
has written never change while it runs), and prefills only the rest: a shared system prompt, or a conversation's
earlier turns, is prefilled once. It takes no memory of its own: the prefixes are the slots' rows, each kept until
a request takes that row (a request with no match takes the lowest free row, so the higher rows keep theirs
longest). A scored prompt (prompt logprobs) or a mean-pooled embedding reuses no prefix (it needs every position's
output), but is written in chunks like any prompt. Kernels whose rows do not depend on the forward's shape
(tests/plugins/test_cpu_batch_invariance.py) make a reused prefix, a chunk and a neighbour change no bit of a row.
Speculative decoding (runtime/engine/speculative.py) verifies a speculating request's draft in the same step: drafts by
prompt lookup ("ngram"), or by the scheduler's draft model ("draft": `Scheduler(runner, draft=draft_runner)`),
whose cache has a row per slot, written from the request's first token on.
The thread that calls `start()` keeps the caller free: the decode loop runs on one background thread, and
`submit`/`cancel`/`finish` are thread-safe. Each step (Engine.step: schedule -> execute -> update) returns token ids
per row; they reach a consumer through a queue (or an asyncio loop's queue), a step's outputs handed over together
when it ends (one call into each event loop a step, not one a token), and the consumer's Handle makes the text
(runtime/engine/decoding.py: detokenizing and stop strings off the decode thread), telling the scheduler when a stop
string ended a request (`finish`), which frees its slot before the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from llgraph.errors import RequestError, described
from llgraph.runtime.engine.embed import check_pooling
from llgraph.runtime.engine.prefix import CachedRows
from llgraph.runtime.engine.requests import Handle, QueueFull, ShuttingDown, _Request, hand_over
from llgraph.runtime.engine.row import Output, Params, Row, State
from llgraph.runtime.engine.runner import Runner
from llgraph.runtime.engine.sampling import Sampling
from llgraph.runtime.engine.speculative import MAX_DRAFT, check_draft, check_draft_max, check_served_mode
from llgraph.runtime.engine.step import Engine, Metrics

MAX_LOGPROBS = 20  # alternatives per token (OpenAI's chat limit; vLLM's default)
STEP_SECONDS = 0.5  # while rows decode, a step that also writes prompt tokens takes about this long at most
MIN_CHUNK = 16  # the fewest prompt tokens a step writes, however slow the machine


class Scheduler:
    def __init__(self, runner: Runner, slots: int = 8, max_queue: int = 64, timeout: float | None = None,
                 metrics: Metrics | None = None, reuse_prefixes: bool = True, draft: Runner | None = None,
                 prefill_chunk: int = 0):
        """`draft`: a runner over a smaller model sharing the tokenizer, for requests that speculate with "draft";
        it gets a cache row per slot. `prefill_chunk`: the prompt tokens a step writes, beside the running requests'
        decode tokens, shared by the admitted prompts, oldest first; 0: every prompt whole."""
        if slots < 1 or max_queue < 0 or prefill_chunk < 0:
            raise RequestError(f"slots ({slots}) must be >= 1, max_queue ({max_queue}) and prefill_chunk "
                               f"({prefill_chunk}) >= 0")
        self.prefill_chunk = prefill_chunk
        self._pace: float | None = None  # seconds a token of a prompt-writing step took (a moving average)
        self._clock: Callable[[], float] = time.monotonic
        self.runner, self.backend, self.slots, self.max_queue = runner, runner.backend, slots, max_queue
        self.timeout = timeout
        self._queue: deque[_Request] = deque()
        self._active: dict[int, _Request] = {}  # slot -> request
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._stopping = False
        self._stop_deadline: float | None = None
        self._thread: threading.Thread | None = None
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last steps, for tokens/s
        self._rows = CachedRows(self.backend, slots, reuse_prefixes)  # prefix reuse: what each slot's row holds
        self._outbox: list[tuple[_Request, Output]] = []  # the step's outputs, handed over when it ends
        if draft is not None:
            check_draft(runner, draft)
        self.draft = draft
        self.engine = Engine(self.backend, metrics, draft.backend if draft is not None else None, cache=self._rows)

    @property
    def metrics(self) -> Metrics:
        """What the engine reports to (the server sets its Prometheus metrics here)."""
        return self.engine.metrics

    @metrics.setter
    def metrics(self, metrics: Metrics) -> None:
        self.engine.metrics = metrics

    # -- the caller's side ------------------------------------------------------------------------------------------
    def start(self) -> Scheduler:
        self.backend.allocate(self.slots)
        if self.draft is not None:
            self.draft.backend.allocate(self.slots)
        self._thread = threading.Thread(target=self._run, name="llgraph-scheduler", daemon=True)
        self._thread.start()
        return self

    def submit(self, prompt, max_new_tokens: int = 64, sampling: Sampling = Sampling(), stop=(),
               eos_token_ids=None, timeout: float | None = None, loop: asyncio.AbstractEventLoop | None = None,
               logprobs: int | None = None, prompt_logprobs: bool = False, grammar=None,
               speculative: str = "off", draft_max: int = MAX_DRAFT, pooling: str | None = None,
               normalize: bool = True) -> Handle:
        """Queues a request (a text or token ids). Raises RequestError for a bad one, QueueFull when the queue is
        at its bound, ShuttingDown once stop() was called. With `loop`, events go to an asyncio.Queue on it.
        `logprobs`: each token event carries its log-probability and that many alternatives (logprobs.TokenLogprob);
        `prompt_logprobs`: the prompt is scored too, and max_new_tokens may be 0 (score only). `grammar`: a
        runtime.engine.grammar.Grammar its output must follow. `speculative`: "ngram" drafts by prompt lookup and
        verifies the drafts in its decode steps (runtime/engine/speculative.py), "draft" drafts with the scheduler's
        draft model; at most `draft_max` tokens a step. `pooling` ("last" or "mean"): an embedding, nothing
        generated (its handle's `embedding` once done; runtime/engine/embed.py), unit length if `normalize`."""
        ids = self.runner.encode(prompt)
        check_served_mode(speculative, self.draft is not None)
        check_draft_max(draft_max)
        if logprobs is not None and not (isinstance(logprobs, int) and 0 <= logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs ({logprobs}) must be an integer in 0..{MAX_LOGPROBS}")
        if pooling is not None:
            check_pooling(pooling)
            max_new_tokens = 0
            self.runner.check_room(len(ids) - 1, 1)  # every prompt token is written, nothing after them
        elif prompt_logprobs and max_new_tokens == 0:
            self.runner.check_room(len(ids) - 1, 1)  # scoring alone: the last prompt token is never input
        else:
            self.runner.check_room(len(ids), max_new_tokens)
        eos = self.runner.eos_token_ids if eos_token_ids is None else set(eos_token_ids)
        matcher = grammar.matcher(self.runner.tokenizer, self.backend.vocab_size, eos) if grammar else None
        outputs: queue.Queue | asyncio.Queue = queue.Queue() if loop is None else asyncio.Queue()
        timeout = timeout if timeout is not None else self.timeout
        params = Params(ids, max_new_tokens, sampling, frozenset(eos), speculative, draft_max, logprobs,
                        prompt_logprobs, pooling, normalize)
        request = _Request(Row(params, slot=-1, matcher=matcher), outputs, loop,
                           None if timeout is None else time.monotonic() + timeout, next(self._ids))
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down; send the request to another replica")
            if len(self._queue) >= self.max_queue + self.slots - len(self._active):
                raise QueueFull(f"all {self.slots} slots are busy and {len(self._queue)} requests are queued; "
                                "retry later")
            self._queue.append(request)
            self._cond.notify()
        return Handle(self, request, stop)

    def cancel(self, handle: Handle) -> None:
        """The request ends: a queued one leaves the queue now (its place goes to the next client), a running one
        frees its slot before the next step."""
        self.finish(handle, "cancelled")

    def finish(self, handle: Handle, reason: str) -> None:
        """The consumer ends the request (`reason`: "cancelled", or "stop": its text reached a stop string): a queued
        one leaves the queue now, a running one frees its slot before the next step (the tokens the steps take
        until then are not part of the answer: runtime/engine/decoding.py)."""
        with self._cond:
            r = handle._request
            r.ended = r.ended or reason
            if r in self._queue:
                self._queue.remove(r)
                self._deliver(r, self.engine.finish(r.row, reason))
            self._cond.notify()

    def drain(self, grace: float = 0.0) -> None:
        """Admits nothing new (ShuttingDown); running and queued requests get `grace` seconds, then end with
        finish_reason "shutdown" and an error event (they did not finish)."""
        with self._cond:
            deadline = time.monotonic() + grace
            self._stop_deadline = deadline if self._stop_deadline is None else min(deadline, self._stop_deadline)
            self._stopping = True
            self._cond.notify()

    @property
    def draining(self) -> bool:
        return self._stopping

    def stop(self, grace: float = 0.0) -> None:
        """drain(grace), then wait for the decode thread to end."""
        self.drain(grace)
        if self._thread is not None:
            self._thread.join()

    def stats(self) -> dict:
        with self._cond:
            now = time.monotonic()
            self._trim_recent(now)
            span = now - self._recent[0][0] if len(self._recent) > 1 else 0.0
            rate = sum(n for _, n in list(self._recent)[1:]) / span if span > 0 else 0.0
            b = self.backend
            held = sum(b.kv_row_bytes(min(len(r.row.ids) + r.row.steps, b.max_seq_len)) for r in self._active.values())
            return {"queue": len(self._queue), "active": len(self._active), "slots": self.slots,
                    "tokens_per_second": rate, "kv_cache_bytes": b.kv_row_bytes(b.max_seq_len) * self.slots,
                    "kv_cache_bytes_in_use": held}

    def _trim_recent(self, now: float) -> None:
        """Keeps the last 10 s of steps (for tokens/s): trimmed as steps are added, so a server nobody scrapes
        does not grow a record of every step it ever ran."""
        while self._recent and self._recent[0][0] < now - 10:
            self._recent.popleft()

    # -- the decode thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._queue or self._active or self._stopping):
                    self._cond.wait()
                if self._stopping and (self._stop_deadline is None or time.monotonic() >= self._stop_deadline or
                                       not (self._queue or self._active)):
                    for stage, requests in (("started", list(self._queue)), ("finished", list(self._active.values()))):
                        message = f"the server shut down before this request {stage}"
                        for r, out in zip(requests, self.engine.fail([r.row for r in requests], message, "shutdown")):
                            self._deliver(r, out)
                    self._queue.clear()
                    self._active.clear()
                    self._hand_over()
                    return
                admit = []
                free = [s for s in range(self.slots) if s not in self._active]
                while self._queue and free:
                    r = self._queue.popleft()
                    if r.ended or (r.deadline is not None and time.monotonic() > r.deadline):
                        self._deliver(r, self.engine.finish(r.row, r.ended or "timeout"))
                        continue
                    slot = r.row.slot = self._rows.place(r.row.ids, free)
                    free.remove(slot)
                    self._active[slot] = r
                    admit.append(r)
            try:  # one engine step: decode tokens, drafts and prompt pieces (runtime/engine/packed.py)
                for r in admit:
                    self._admit(r)
                self._retire()  # what its consumer ended since the last step (a stop string) takes no step more
                self._advance()
                self._retire()
            except Exception as e:  # the batch's forward failed: no row can tell whose fault it was
                with self._cond:
                    requests = list(self._active.values())
                    for r, out in zip(requests, self.engine.fail([r.row for r in requests], described(e))):
                        self._deliver(r, out)
                    self._active.clear()
            self._hand_over()  # the step's events (and the admission's refusals), together

    def _admit(self, r: _Request) -> None:
        """Its slot's longest cached prefix of its prompt: the rest is written by the steps, as
        much of it a step as the token budget (`prefill_chunk`) leaves."""
        row, p = r.row, r.row.params
        row.start = self._rows.reuse(row.slot, p.ids[:p.written], allowed=not (p.prompt_logprobs or
                                                                               p.pooling == "mean"))

    def _budget(self) -> int:
        """The prompt tokens a step may write: prefill_chunk, or fewer where this machine's measured pace would make
        the step longer than STEP_SECONDS while other rows wait for their next token (a chunk by time, not only by
        tokens: on a slow host or a large model 128 tokens took 4-8 s a step)."""
        waiting = any(r.row.state is State.DECODING for r in self._active.values())
        if not self.prefill_chunk or self._pace is None or not waiting:
            return self.prefill_chunk
        return max(MIN_CHUNK, min(self.prefill_chunk, int(STEP_SECONDS / self._pace)))

    def _paced(self, tokens: int, written: int, seconds: float) -> None:
        """A step of `tokens` inputs, `written` of them prompt tokens, took `seconds`: the pace's moving average."""
        if written >= MIN_CHUNK:
            pace = seconds / tokens
            self._pace = pace if self._pace is None else 0.7 * self._pace + 0.3 * pace

    def _advance(self) -> None:
        """One engine step of every active request (Engine.step), its outputs to their consumers."""
        rows = {r.row: r for r in self._active.values()}
        decoding = sum(row.state is State.DECODING for row in rows)
        starts = {row: row.start for row in rows if row.state is State.PROMPT}
        begun = self._clock()
        outputs = self.engine.step(list(rows), self._budget())
        written = sum(row.start - start for row, start in starts.items())
        self._paced(written + decoding, written, self._clock() - begun)
        for out in outputs:
            self._deliver(rows[out.row], out)
        self._record_step()

    def _record_step(self) -> None:
        with self._cond:
            now = time.monotonic()
            self._recent.append((now, len(self._active)))
            self._trim_recent(now)

    def _retire(self) -> None:
        """Frees the slots of finished requests, and of those their consumer ended (a cancel, a stop string) or
        whose time ran out."""
        now = time.monotonic()
        with self._cond:
            for slot, r in list(self._active.items()):
                if not r.row.finished and (r.ended or (r.deadline is not None and now > r.deadline)):
                    self._deliver(r, self.engine.finish(r.row, r.ended or "timeout"))
                if r.row.finished:
                    del self._active[slot]

    def _deliver(self, r: _Request, out: Output) -> None:
        """An output for r's consumer: on the decode thread held until the step ends (_hand_over), from another
        thread (a cancel) handed over at once."""
        if threading.current_thread() is self._thread:
            self._outbox.append((r, out))
        else:
            hand_over([(r, out)])

    def _hand_over(self) -> None:
        """The step's outputs to their consumers, one call into each event loop (requests.hand_over)."""
        held, self._outbox = self._outbox, []
        hand_over(held)
