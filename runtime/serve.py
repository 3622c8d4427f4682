"""`llgraph serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler (runtime/scheduler.py),
for any runner. `pip install -e ".[serve]"`.

    llgraph serve smollm2 [--backend ort|torch|trt] [--slots 8] [--host 127.0.0.1] [--port 8000]
    llgraph serve smollm2 --ray --replicas 2          # the same app as a Ray Serve deployment

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (the model's chat template; `stream: true` answers as
server-sent events in OpenAI's chunk format), /health, /metrics (Prometheus). Errors are OpenAI's error object:
400 for a bad request, 429 when every slot is busy and the queue is full, 503 while shutting down.
SIGTERM (or Ctrl-C): admit nothing new, let running requests finish for --grace seconds, cancel the rest, exit 0.
This module is the app; runtime/serve_run.py runs it (uvicorn, or Ray Serve with --ray).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError as e:
    from llgraph.errors import MissingExtra

    raise MissingExtra("llgraph serve", "fastapi uvicorn prometheus-client", "serve", e) from None

from llgraph.runtime.sampling import RequestError, Sampling
from llgraph.runtime.scheduler import Metrics, QueueFull, Scheduler, ShuttingDown
from llgraph.runtime.serve_request import (
    ApiError,
    chat_prompt,
    flag,
    include_usage,
    number,
    prompt_ids,
    prompt_of,
    read_json,
    stop_strings,
)
from llgraph.weight_request import Weights

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "length", "cancelled": "stop"}


@dataclass
class ServeOptions:
    """Everything a server (or each Ray replica) needs to load its runner and scheduler."""
    model: str
    backend: str = "ort"
    name: str | None = None
    slots: int = 8
    max_queue: int = 64
    max_seq_len: int | None = None
    timeout: float | None = None
    cache_dir: str | None = None
    tensorrt: str = "auto"
    weights: Weights = Weights()
    max_request_bytes: int = 8 << 20  # a larger body is a 413 before it is read
    threads: int | None = None  # CPU threads of the runner (registry.RunOptions.threads)

    @property
    def served_name(self) -> str:
        from pathlib import Path

        return self.name or Path(str(self.model)).name


class PrometheusMetrics(Metrics):
    def __init__(self, scheduler_stats):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("llgraph_time_to_first_token_seconds", "submit to first token", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.generated = Counter("llgraph_generated_tokens", "tokens sampled", registry=r)
        for key, doc in (("queue", "requests waiting for a slot"), ("active", "slots decoding"),
                         ("slots", "cache rows"), ("tokens_per_second", "tokens sampled per second, last 10 s")):
            name = {"queue": "llgraph_queue_depth", "active": "llgraph_active_slots"}.get(key, f"llgraph_{key}")
            Gauge(name, doc, registry=r).set_function(lambda key=key: scheduler_stats()[key])

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, n: int) -> None:
        self.generated.inc(n)


# -- the app -----------------------------------------------------------------------------------------------------------

def load_runner(options: ServeOptions):
    from llgraph.runtime.registry import open_runner

    return open_runner(options.model, options.backend, options.max_seq_len, options.cache_dir, options.tensorrt,
                       options.weights, options.threads)


def create_app(options: ServeOptions, runner=None) -> FastAPI:
    """The ASGI app. Without `runner`, the runner and scheduler load at startup (lifespan), so a Ray replica loads
    its own; `serve` loads it first, so a bad model is one line before anything listens."""
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        scheduler = Scheduler(runner or load_runner(options), options.slots, options.max_queue, options.timeout)
        scheduler.metrics = state["metrics"] = PrometheusMetrics(scheduler.stats)
        state.update(runner=scheduler.runner, scheduler=scheduler.start(), created=int(time.time()))
        app.state.scheduler = scheduler
        yield
        scheduler.stop(0)

    app = FastAPI(title="llgraph", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(HTTPException)  # 404 (no such path), 405 (wrong method): OpenAI's shape too
    async def http_error(request, e: HTTPException):
        return ApiError(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                        else "server_error").response()

    @app.get("/health")
    async def health():
        if state["scheduler"].draining:
            raise ApiError(503, "shutting down", "server_error", code="shutting_down")
        return {"status": "ok", "pid": os.getpid(), **state["scheduler"].stats()}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(state["metrics"].registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": options.served_name, "object": "model",
                                            "created": state["created"], "owned_by": "llgraph"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    async def _serve(request: Request, chat: bool):
        body = await read_json(request, options.max_request_bytes)
        if body.get("model", options.served_name) != options.served_name:  # none named: the one served (as vLLM)
            raise ApiError(400, f"model '{str(body.get('model'))[:100]}' is not served here; this server serves "
                                f"'{options.served_name}' (GET /v1/models)", param="model", code="model_not_found")
        if number(body, "n", 1, 1, 1, integer=True) != 1:
            raise ApiError(400, "n must be 1", param="n")
        runner, scheduler = state["runner"], state["scheduler"]
        prompt = chat_prompt(body, runner) if chat else prompt_of(body, runner.tokenizer)
        context = runner.backend.max_seq_len
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = number(body, key, None if chat else 16, 1, 1 << 30, integer=True)
        sampling_args = dict(temperature=number(body, "temperature", 1.0, 0, 2),
                             top_p=number(body, "top_p", 1.0, 0, 1),
                             seed=number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True))
        try:
            sampling = Sampling(**sampling_args)
        except RequestError as e:
            raise ApiError(400, str(e)) from None
        ids = await asyncio.to_thread(prompt_ids, runner, prompt, context, key)
        prompt_tokens = len(ids)
        try:
            if max_tokens is None:  # chat without a limit: the rest of the context
                max_tokens = max(1, context - prompt_tokens)
            if prompt_tokens + max_tokens > context:
                raise ApiError(400, f"this model's context is {context} tokens; the prompt takes {prompt_tokens} "
                                    f"and {key} asks for {max_tokens} more; lower {key} or shorten the prompt",
                               param=key, code="context_length_exceeded")
            ignore_eos = flag(body, "ignore_eos")  # vLLM's extension: benchmarks run to max_tokens
            stream, usage = flag(body, "stream"), include_usage(body)
            handle = scheduler.submit(ids, max_tokens, sampling, stop_strings(body), () if ignore_eos else None,
                                      loop=asyncio.get_running_loop())
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full") from None
        except ShuttingDown as e:
            raise ApiError(503, str(e), "server_error", code="shutting_down") from None
        except RequestError as e:
            raise ApiError(400, str(e)) from None
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": options.served_name}
        if not stream:
            return await _whole(request, handle, meta, chat)
        # the status waits for the first event: a request that never started (shut down while queued) is a 503
        first = await _unless_gone(request, handle.events.get())
        if first is None:
            handle.cancel()
            return JSONResponse({}, status_code=499)
        if first.kind == "error":
            raise _failure(handle, first)
        return StreamingResponse(_sse(_events(handle, first), handle, meta, chat, usage),
                                 media_type="text/event-stream")

    return app


def _usage(handle) -> dict:
    done = handle.decoding.steps
    return {"prompt_tokens": handle.prompt_tokens, "completion_tokens": done,
            "total_tokens": handle.prompt_tokens + done}


def _failure(handle, event) -> ApiError:
    """An error event as the API says it: 503 when the server shut down first, else 500 (the model failed)."""
    if handle.decoding.finish_reason == "shutdown":
        return ApiError(503, event.text, "server_error", code="shutting_down")
    return ApiError(500, f"the model failed: {event.text}", "server_error")


async def _events(handle, first=None):
    """The handle's events (from `first`, if already taken) until done; cancels the request if the consumer goes
    away (client disconnect)."""
    try:
        event = first or await handle.events.get()
        while True:
            if event.kind == "error":
                raise _failure(handle, event)
            yield event
            if event.kind == "done":
                return
            event = await handle.events.get()
    finally:
        handle.cancel()  # a no-op once finished; frees the slot (or the queue place) of an abandoned request


async def _unless_gone(request: Request, awaitable):
    """Awaits it while the client is there (checked every 0.5 s); None, and it is cancelled, once the client left."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            return None


async def _whole(request: Request, handle, meta: dict, chat: bool):
    async def collect():
        return [event.text async for event in _events(handle)]

    text = await _unless_gone(request, collect())  # a client that leaves frees its slot or queue place
    if text is None:
        handle.cancel()
        return JSONResponse({}, status_code=499)
    reason = FINISH[handle.decoding.finish_reason]
    choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(text)}, "logprobs": None,
               "finish_reason": reason} if chat else
              {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": reason})
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
            "usage": _usage(handle)}


async def _sse(events, handle, meta: dict, chat: bool, include_usage: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, reason: str | None, first: bool = False) -> str:
        if chat:
            delta = ({"role": "assistant", "content": ""} if first else
                     {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        body = {**meta, "object": kind, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    if chat:
        yield chunk(None, None, first=True)
    try:
        async for event in events:
            if event.text:
                yield chunk(event.text, None)
            if event.kind == "done":
                yield chunk(None, FINISH[handle.decoding.finish_reason])
    except ApiError as e:
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': e.kind, 'code': e.code}})}\n\n"
    if include_usage:
        yield f"data: {json.dumps({**meta, 'object': kind, 'choices': [], 'usage': _usage(handle)})}\n\n"
    yield "data: [DONE]\n\n"
