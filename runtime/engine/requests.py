"""What a caller of the scheduler holds (scheduler.py): a submitted request's Handle, whose events are made on the
caller's side from the engine's outputs (the text by runtime/engine/decoding.py, in the reader's thread or event loop,
not on the decode thread); what the scheduler keeps of a request (_Request: its engine row and where its outputs go);
and the scheduler's refusals (QueueFull, ShuttingDown)."""

from __future__ import annotations

import asyncio
import queue
from collections import deque
from dataclasses import dataclass
from typing import Any

from llgraph.errors import RequestError
from llgraph.runtime.engine.decoding import Decoding, Event
from llgraph.runtime.engine.logprobs import TokenLogprob
from llgraph.runtime.engine.row import Output, Row


class QueueFull(RequestError):
    """Every slot is busy and the queue is at its bound: try again later (HTTP 429)."""


class ShuttingDown(RequestError):
    """The scheduler is stopping and admits nothing new (HTTP 503)."""


@dataclass(eq=False)  # compared by identity (the queue removes a cancelled one)
class _Request:
    """A submitted request as the scheduler keeps it: its engine row, where its outputs go (a queue.Queue, or an
    asyncio.Queue of `loop`), its deadline, and the reason its consumer ended it (a cancel, a stop string)."""
    row: Row
    outputs: Any = None
    loop: asyncio.AbstractEventLoop | None = None
    deadline: float | None = None
    id: int = 0
    ended: str | None = None  # "cancelled" or "stop", set by the consumer's thread; the decode thread acts on it


def hand_over(items: list[tuple[_Request, Output]]) -> None:
    """Outputs to their consumers, in order: a thread's queue at once, an asyncio queue through one call into its
    loop for all of them (a step's outputs cross to the server's loop together, not one call a row). A closed loop
    drops them: nobody is left to tell."""
    loops: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Output]]] = {}
    for r, out in items:
        if r.loop is None:
            r.outputs.put(out)
        else:
            loops.setdefault(r.loop, []).append((r.outputs, out))
    for loop, batch in loops.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the loop is closed
            pass


def _put_all(batch: list[tuple[asyncio.Queue, Output]]) -> None:
    for outputs, out in batch:
        outputs.put_nowait(out)


class Handle:
    """A submitted request: its events (`events.get()`: a token at a time, made here from the engine's outputs) and
    `cancel()`. `decoding` holds its output as the events have made it so far."""

    def __init__(self, scheduler, request: _Request, stop=()):  # scheduler: the Scheduler that admitted it
        self._scheduler, self._request = scheduler, request
        self.decoding = Decoding(scheduler.runner.text_of, stop)
        self.prompt_ids = request.row.ids
        self.prompt_tokens = len(self.prompt_ids)
        self.prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's scores (prompt_logprobs=True), with
        self.embedding = None  # an embedding request's vector (float32 [hidden]), with its last event
        self.cached = 0  # the prompt tokens a reused prefix held (once the prompt is written)
        self.events: Events | AsyncEvents = AsyncEvents(self) if request.loop is not None else Events(self)

    def cancel(self) -> None:
        self._scheduler.cancel(self)

    def _take(self, out: Output) -> list[Event]:
        """An output of the engine -> its events (decoding.py); a stop string found here ends the row."""
        self.cached = out.cached
        if out.prompt_scores is not None:
            self.prompt_logprobs = out.prompt_scores
        if out.embedding is not None:
            self.embedding = out.embedding
        events = self.decoding.take(out)
        if self.decoding.finish_reason == "stop" and out.finish_reason is None:
            self._scheduler.finish(self, "stop")
        return events

    def text(self, timeout: float | None = None):
        """Text pieces as they come (a thread's reader: submit() without a loop); raises RequestError if the
        backend failed."""
        events = self.events
        assert isinstance(events, Events), "an event loop's request is read with `await handle.events.get()`"
        while True:
            event = events.get(timeout=timeout)
            if event.kind == "error":
                raise RequestError(event.text)
            if event.text:
                yield event.text
            if event.kind == "done":
                return

    def result(self, timeout: float | None = None) -> Decoding:
        for _ in self.text(timeout):
            pass
        return self.decoding


class Events:
    """A thread's reader of a request's events: get(timeout) -> the next Event (queue.Empty after `timeout`)."""

    def __init__(self, handle: Handle):
        self._handle, self._pending = handle, deque[Event]()
        self._outputs: queue.Queue = handle._request.outputs

    def get(self, timeout: float | None = None) -> Event:
        while not self._pending:
            self._pending.extend(self._handle._take(self._outputs.get(timeout=timeout)))
        return self._pending.popleft()


class AsyncEvents:
    """An event loop's reader of a request's events: `await get()` -> the next Event."""

    def __init__(self, handle: Handle):
        self._handle, self._pending = handle, deque[Event]()
        self._outputs: asyncio.Queue = handle._request.outputs

    async def get(self) -> Event:
        while not self._pending:
            self._pending.extend(self._handle._take(await self._outputs.get()))
        return self._pending.popleft()
