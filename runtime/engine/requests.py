"""What a caller of the scheduler holds (scheduler.py): a submitted request's Handle and the Events it receives, the
row the scheduler keeps of it (_Request), and the scheduler's refusals (QueueFull, ShuttingDown)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from llgraph.errors import RequestError
from llgraph.runtime.engine.decoding import Decoding
from llgraph.runtime.engine.logprobs import TokenLogprob
from llgraph.runtime.engine.step import Row


class QueueFull(RequestError):
    """Every slot is busy and the queue is at its bound: try again later (HTTP 429)."""


class ShuttingDown(RequestError):
    """The scheduler is stopping and admits nothing new (HTTP 503)."""


@dataclass
class Event:
    kind: str  # "token" (one sampled), "done" (finished: see decoding.finish_reason) or "error" (it ended failed)
    text: str = ""  # the new text it completes (often "" inside a multi-byte character or a possible stop string)
    decoding: Decoding | None = None
    token: int | None = None
    logprob: TokenLogprob | None = None  # the token's, when the request asked for logprobs


@dataclass(eq=False)  # compared by identity (the queue removes a cancelled one)
class _Request(Row):
    """A submitted request: its row (the engine's) and what the scheduler keeps of it."""
    slot: int = -1  # its cache row, once admitted
    events: Any = None  # its consumer's queue: a queue.Queue, or an asyncio.Queue of `loop`
    loop: asyncio.AbstractEventLoop | None = None
    deadline: float | None = None
    id: int = 0
    cancelled: bool = False


def hand_over(items: list[tuple[_Request, Event]]) -> None:
    """Events to their consumers, in order: a thread's queue at once, an asyncio queue through one call into its
    loop for all of them (a step's events cross to the server's loop together, not one call a token). A closed loop
    drops them: nobody is left to tell."""
    loops: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event]]] = {}
    for r, event in items:
        if r.loop is None:
            r.events.put(event)
        else:
            loops.setdefault(r.loop, []).append((r.events, event))
    for loop, batch in loops.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the loop is closed
            pass


def _put_all(batch: list[tuple[asyncio.Queue, Event]]) -> None:
    for events, event in batch:
        events.put_nowait(event)


class Handle:
    """A submitted request: its events, and `cancel()`."""

    def __init__(self, scheduler, request: _Request, events):  # scheduler: the Scheduler that admitted it
        self._scheduler, self._request, self.events = scheduler, request, events
        self.prompt_tokens = len(request.ids)
        self.prompt_ids = request.ids

    @property
    def prompt_logprobs(self) -> list[TokenLogprob] | None:
        """Tokens 1.. of the prompt, each scored given those before it (submit(prompt_logprobs=True)); ready once
        the first event arrived."""
        return self._request.prompt_scores

    @property
    def cached(self) -> int:
        """The prompt tokens a reused prefix held (0 until the prompt is written)."""
        return self._request.cached

    @property
    def decoding(self) -> Decoding:
        return self._request.decoding

    @property
    def embedding(self):
        """An embedding request's vector (float32 [hidden]), once done."""
        return self._request.embedding

    def cancel(self) -> None:
        self._scheduler.cancel(self)

    def text(self, timeout: float | None = None):
        """Text pieces as they come (a queue consumer); raises RequestError if the backend failed."""
        while True:
            event = self.events.get(timeout=timeout)
            if event.kind == "error":
                raise RequestError(event.text)
            if event.text:
                yield event.text
            if event.kind == "done":
                return

    def result(self, timeout: float | None = None) -> Decoding:
        for _ in self.text(timeout):
            pass
        return self._request.decoding
