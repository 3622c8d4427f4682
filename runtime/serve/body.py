"""Request bodies, decoded off the event loop: the event loop only moves bytes. A body is read no further than the
server's limit (413 past it), then decoded and bounded (request.check_sizes: tools, messages) in a thread — or, from
BIG bytes on, in a worker process: JSON decoding is one C call that holds the GIL, so a 5 MB body decoded in a
thread still stalled /health and every stream for a quarter of a second. A body that fails its bounds is refused
where it was decoded and never travels back."""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from fastapi import Request

from llgraph.runtime.serve.request import ApiError, check_json, check_sizes, decoded

BIG = 1 << 20  # bytes: a body this large is decoded in the worker process
_WORKER: list[ProcessPoolExecutor] = []


def start_worker() -> None:
    """The decoding process, started (spawned: no copy of the model) before the first large body needs it."""
    if not _WORKER:
        _WORKER.append(ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")))
        _WORKER[0].submit(int).result()


def stop_worker() -> None:
    while _WORKER:
        _WORKER.pop().shutdown(cancel_futures=True)


async def read_json(request: Request, limit: int, context: int | None = None) -> dict:
    """The body as a JSON object, read no further than `limit` bytes (413 past it: a huge body costs neither
    memory nor anyone else's time); with `context` (the model's, in tokens), held to request.check_sizes."""
    check_json(request.headers.get("content-type"), request.headers.get("origin"))
    too_big = ApiError(413, f"the request body is larger than this server's limit of {limit} bytes "
                            "(llgraph serve --max-request-bytes)", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    data = b"".join(chunks)
    if len(data) < BIG or not _WORKER:
        return await asyncio.to_thread(_bounded, data, context)
    answer = await asyncio.wrap_future(_WORKER[0].submit(_bounded_elsewhere, data, context))
    if isinstance(answer, tuple):  # the refusal, as the worker said it
        raise ApiError(*answer)
    return answer


def _bounded(data: bytes, context: int | None) -> dict:
    body = decoded(data)
    if context is not None:
        check_sizes(body, context)
    return body


def _bounded_elsewhere(data: bytes, context: int | None):
    """_bounded in the worker process -> the body, or its refusal as ApiError's arguments (picklable)."""
    try:
        return _bounded(data, context)
    except ApiError as e:
        return e.status, str(e), e.kind, e.param, e.code



