"""`llgraph serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler
(runtime/engine/scheduler.py), for any runner. `pip install -e ".[serve]"`.

    llgraph serve smollm2 [--backend ort|torch|trt] [--slots 8] [--host 127.0.0.1] [--port 8000]
    llgraph serve smollm2 --ray --replicas 2          # the same app as a Ray Serve deployment

Endpoints: /v1/models, /v1/completions and /v1/chat/completions (batched prompts, n, echo, logprobs, tools; `stream:
true` answers as server-sent events in OpenAI's chunk format: completions.py), /v1/embeddings (embeddings.py),
/tokenize, /detokenize and
/tokenizer_info (vLLM's shapes), /health, /metrics (Prometheus). Errors are OpenAI's error object: 400 for a bad
request (a field that would change the output and is not supported included), 429 when every slot is busy and the
queue is full, 503 while shutting down.
SIGTERM (or Ctrl-C): admit nothing new, let running requests finish for --grace seconds, cancel the rest, exit 0.
This module is the app; runtime/serve/run.py runs it (uvicorn, or Ray Serve with --ray).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, PlainTextResponse, Response
    from starlette.exceptions import HTTPException
except ImportError as e:
    from llgraph.errors import MissingExtra

    raise MissingExtra("llgraph serve", "fastapi uvicorn prometheus-client llguidance jsonschema", "serve",
                       e) from None

from llgraph import __version__
from llgraph.runtime.engine import grammar
from llgraph.runtime.engine.scheduler import Metrics, Scheduler
from llgraph.runtime.engine.speculative import MAX_DRAFT
from llgraph.runtime.serve import messages, responses
from llgraph.runtime.serve.access import Guard
from llgraph.runtime.serve.ask import parse
from llgraph.runtime.serve.body import read_json, start_worker, stop_worker
from llgraph.runtime.serve.completions import answer
from llgraph.runtime.serve.embeddings import embeddings as embed
from llgraph.runtime.serve.request import ApiError, chat_prompt, flag
from llgraph.weight_request import Weights


@dataclass(kw_only=True)
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
    threads: int | None = None  # CPU threads of the runner (runtime.backends.RunOptions.threads)
    speculative: str = "off"  # requests' default: off, ngram or draft (runtime/engine/speculative.py); a request's
    # "speculative" overrides it
    draft_max: int = MAX_DRAFT  # requests' default most drafted tokens a step; "speculative.n_max" overrides it
    draft: str | None = None  # the draft model (a MODEL as for `model`), opened beside it: requests may ask "draft"
    api_key: str | None = None  # every route but /health wants it (access.py); None: open
    host: str = "127.0.0.1"  # the address listened on: bound to loopback, only loopback's Host names are answered
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides loopback's ("*": any)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call (CORS); none by default
    open_metrics: bool = False  # /metrics answers without the key (for a scraper without credentials)
    pooling: str = "last"  # /v1/embeddings' pooling of the last hidden states: "last" token or "mean"
    prefill_chunk: int = 128  # the prompt tokens a step writes beside the running rows' (0: whole); the CLI's help
    kv_cache: str | None = None  # the KV cache's format (llgraph/kv_cache.py); None: the backend's default
    any_model: bool = False  # a request naming any model is answered by this one (llama-server's behaviour)

    @property
    def served_names(self) -> list[str]:
        """The model ids clients may send: --name's comma-separated aliases (default: MODEL's file or folder name);
        the first is the one answers carry."""
        from pathlib import Path

        return [n.strip() for n in self.name.split(",") if n.strip()] if self.name else [Path(str(self.model)).name]

    @property
    def served_name(self) -> str:
        return self.served_names[0]


class PrometheusMetrics(Metrics):
    def __init__(self, scheduler_stats):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("llgraph_time_to_first_token_seconds", "submit to first token", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.generated = Counter("llgraph_generated_tokens", "tokens sampled", registry=r)
        self.drafted = Counter("llgraph_speculative_draft_tokens", "tokens drafted by speculating requests", registry=r)
        self.accepted = Counter("llgraph_speculative_accepted_tokens", "drafted tokens kept", registry=r)
        self.verified = Counter("llgraph_speculative_steps", "verify steps of speculating requests", registry=r)
        self.prefills = Counter("llgraph_prefills", "prompts prefilled", registry=r)
        self.prompt_tokens = Counter("llgraph_prompt_tokens", "prompt tokens of those prefills", registry=r)
        self.prefix_hits = Counter("llgraph_prefix_cache_hits", "prefills that reused a cached prefix", registry=r)
        self.prefix_tokens = Counter("llgraph_prefix_cache_tokens", "prompt tokens reused, not prefilled (saved)",
                                     registry=r)
        self.totals = {"drafted": 0, "accepted": 0, "steps": 0, "prefills": 0, "hits": 0}
        t = self.totals
        Gauge("llgraph_prefix_cache_hit_rate", "prefills that reused a cached prefix / prefills, since start",
              registry=r).set_function(lambda: t["hits"] / max(t["prefills"], 1))
        Gauge("llgraph_speculative_acceptance_rate", "accepted / drafted tokens, since start", registry=r
              ).set_function(lambda: t["accepted"] / max(t["drafted"], 1))
        Gauge("llgraph_speculative_tokens_per_step", "tokens a speculating request emits per verify step (1 would "
              "be plain decoding: the speedup in steps)", registry=r
              ).set_function(lambda: (t["accepted"] + t["steps"]) / max(t["steps"], 1))
        for key, doc in (("queue", "requests waiting for a slot"), ("active", "slots decoding"),
                         ("slots", "cache rows"), ("tokens_per_second", "tokens sampled per second, last 10 s"),
                         ("kv_cache_bytes", "the KV cache's bytes, every slot's row"),
                         ("kv_cache_bytes_in_use", "bytes of the KV cache the running requests' tokens hold")):
            name = {"queue": "llgraph_queue_depth", "active": "llgraph_active_slots"}.get(key, f"llgraph_{key}")
            Gauge(name, doc, registry=r).set_function(functools.partial(_stat, scheduler_stats, key))

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, n: int) -> None:
        self.generated.inc(n)

    def prefix(self, reused: int, prompt: int) -> None:
        self.prefills.inc()
        self.prompt_tokens.inc(prompt)
        if reused:
            self.prefix_hits.inc()
            self.prefix_tokens.inc(reused)
        self.totals["prefills"] += 1
        self.totals["hits"] += bool(reused)

    def speculated(self, drafted: int, accepted: int) -> None:
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        self.verified.inc()
        self.totals["drafted"] += drafted
        self.totals["accepted"] += accepted
        self.totals["steps"] += 1


# -- the app -----------------------------------------------------------------------------------------------------------


def _stat(stats, key: str) -> float:
    """One of the scheduler's figures, read when Prometheus scrapes."""
    return stats()[key]


def ids_json(ids: list[int], step: int = 50_000) -> str:
    """A JSON array of ints, built a slice at a time so other threads (the event loop) run in between."""
    return "[" + ",".join(",".join(map(str, ids[i:i + step])) for i in range(0, len(ids), step)) + "]"


def load_runners(options: ServeOptions) -> tuple:
    """(the runner, its draft model's runner or None); a draft of another vocabulary is one line (RequestError)."""
    from llgraph.runtime.backends import open_draft, open_runner, share_threads_with_a_draft
    from llgraph.runtime.serve.plan import plan

    if options.draft is not None:
        share_threads_with_a_draft(options.backend, options.threads)
    runner = open_runner(options.model, options.backend, max_seq_len=options.max_seq_len,
                         cache_dir=options.cache_dir, tensorrt=options.tensorrt, weights=options.weights,
                         threads=options.threads, kv_cache=options.kv_cache)
    draft = None if options.draft is None else open_draft(options.draft, runner, options.backend,
                                                          cache_dir=options.cache_dir, tensorrt=options.tensorrt,
                                                          threads=options.threads)
    for r in (runner, draft):
        if r is not None:
            r.backend.ready()  # damaged weights are one line before the server listens
    plan([r.backend for r in (runner, draft) if r is not None], options.slots, options.max_seq_len)
    return runner, draft


def create_app(options: ServeOptions, runners: tuple | None = None) -> FastAPI:
    """The ASGI app. Without `runners` (load_runners'), they and the scheduler load at startup (lifespan), so a
    Ray replica loads its own; `serve` loads them first, so a bad model is one line before anything listens."""
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app):
        runner, draft = runners or load_runners(options)
        scheduler = Scheduler(runner, options.slots, options.max_queue, options.timeout, draft=draft,
                              prefill_chunk=options.prefill_chunk)
        scheduler.metrics = state["metrics"] = PrometheusMetrics(scheduler.stats)
        state.update(runner=scheduler.runner, scheduler=scheduler.start(), created=int(time.time()))
        app.state.scheduler = scheduler
        await asyncio.to_thread(start_worker)  # large bodies are decoded there (serve/body.py)
        await asyncio.to_thread(grammar.warm, runner.tokenizer, runner.backend.vocab_size, runner.eos_token_ids)
        yield
        scheduler.stop(0)
        stop_worker()

    app = FastAPI(title="llgraph", lifespan=lifespan)
    # Host and key of every request, before any route reads a byte (access.py); CORS outermost, only when asked
    app.add_middleware(Guard, key=options.api_key, bound=options.host, allowed_hosts=options.allowed_hosts,
                       cors_origins=options.cors_origins, open_metrics=options.open_metrics)
    if options.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(options.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Api-Key"], max_age=600)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(HTTPException)  # 404 (no such path), 405 (wrong method): OpenAI's shape too
    async def http_error(request, e: HTTPException):
        return ApiError(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                        else "server_error").response()

    @app.get("/", include_in_schema=False)  # a chat page to try the model (chat.html: one file, works offline)
    async def page():
        from pathlib import Path

        return HTMLResponse((Path(__file__).parent / "chat.html").read_text(encoding="utf-8"))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and curl -I's probe
    async def health():
        if state["scheduler"].draining:
            raise ApiError(503, "shutting down", "server_error", code="shutting_down")
        return {"status": "ok", "pid": os.getpid(), **state["scheduler"].stats()}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(state["metrics"].registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/props")  # llama-server's route: what a request that names no sampling field is sampled with
    async def props():
        defaults = state["runner"].sampling_defaults
        return {"model": options.served_name, "default_generation_settings": {"params": defaults.values},
                "sampling_sources": defaults.source}

    def _model(name: str) -> dict:
        return {"id": name, "object": "model", "created": state["created"], "owned_by": "llgraph"}

    # each OpenAI route also without /v1 (clients given a base URL without it), kept out of the API docs
    def route(method: str, path: str):
        def register(handler):
            getattr(app, method)(path)(handler)
            getattr(app, method)(path.removeprefix("/v1"), include_in_schema=False)(handler)
            return handler
        return register

    @route("get", "/v1/models")
    async def models():
        return {"object": "list", "data": [_model(name) for name in options.served_names]}

    @route("get", "/v1/models/{model_id:path}")  # the openai client's models.retrieve; ids may hold '/'
    async def model(model_id: str):
        _check_model({"model": model_id})
        return _model(model_id)

    @route("post", "/v1/completions")
    async def completions(request: Request):
        return await _serve(request, chat=False)

    @route("post", "/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, chat=True)

    stored = responses.Store()  # what previous_response_id continues and GET /v1/responses/{id} returns

    async def _checked(request: Request) -> dict:
        body = await read_json(request, options.max_request_bytes, state["runner"].backend.max_seq_len)
        _check_model(body)
        return body

    @route("post", "/v1/responses")  # OpenAI's Responses API, through the same answer (serve/responses.py)
    async def responses_api(request: Request):
        return await responses.respond(await _checked(request), stored, lambda chat: _serve(request, True, chat),
                                       options.served_name)

    @route("get", "/v1/responses/{response_id}")  # the openai client's responses.retrieve
    async def response_api(response_id: str):
        return stored.response(response_id)

    @route("post", "/v1/messages")  # Anthropic's Messages API, through the same answer (serve/messages.py)
    async def messages_api(request: Request):
        return await messages.respond(lambda: _checked(request), lambda chat: _serve(request, True, chat),
                                      options.served_name)

    @route("post", "/v1/messages/count_tokens")  # the prompt's tokens as the chat template renders it
    async def count_tokens(request: Request):
        return await messages.count_tokens(lambda: _checked(request), state["runner"], options.slots,
                                           options.slots + options.max_queue)

    # what OpenAI's system_fingerprint says: the backend configuration that answered (a seeded answer repeats while
    # it stays the same)
    fingerprint = f"llgraph-{__version__}-{options.backend}"

    async def _serve(request: Request, chat: bool, body: dict | None = None):
        runner, scheduler = state["runner"], state["scheduler"]
        if body is None:
            body = await read_json(request, options.max_request_bytes, runner.backend.max_seq_len)
            _check_model(body)
        # the chat template, the tools and the grammar are rendered and compiled off the event loop
        ask = await asyncio.to_thread(parse, body, chat, runner, options.slots, options.slots + options.max_queue,
                                      options.speculative, options.draft_max, draft=scheduler.draft is not None)
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": options.served_name, "system_fingerprint": fingerprint}
        return await answer(request, ask, runner, scheduler, meta)

    @route("post", "/v1/embeddings")
    async def embeddings(request: Request):
        body = await read_json(request, options.max_request_bytes)
        _check_model(body)
        return await embed(request, body, state["runner"], state["scheduler"], options.pooling, options.served_name,
                           options.slots + options.max_queue)

    # the tokenizer endpoints in vLLM's shapes (`prompt` or `messages`, `add_special_tokens`: lm-evaluation-harness's
    # tokenizer_backend=remote) and llama.cpp's (`content`, `add_special`, `with_pieces`: its tools')
    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request, options.max_request_bytes)
        _check_model(body)
        runner = state["runner"]
        field = "content" if "content" in body else "prompt"
        if runner.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", param=field)
        if "messages" in body:
            text = await asyncio.to_thread(chat_prompt, body, runner)  # a template renders off the event loop
            special = flag(body, "add_special_tokens", False)
        else:
            text = body.get(field)
            special = flag(body, "add_special", False) if field == "content" else flag(body, "add_special_tokens", True)
            if not isinstance(text, str):
                raise ApiError(400, f"'{field}' must be a string (or send 'messages')", param=field)
        tokens = await asyncio.to_thread(runner.tokenizer.encode, text, special)
        if field == "content" and flag(body, "with_pieces", False):  # llama.cpp's: each id with its text
            pieces = await asyncio.to_thread(lambda: [{"id": t, "piece": runner.tokenizer.decode([t])}
                                                      for t in tokens])
            return {"tokens": pieces}
        head = json.dumps({"count": len(tokens), "max_model_len": runner.backend.max_seq_len, "token_strs": None})
        # the ids written off the loop, a slice at a time: FastAPI's encoder walks them in Python on the event loop
        # and json.dumps holds the GIL for the whole list (a 7 MB text held /health for 1.9 s)
        ids = await asyncio.to_thread(ids_json, tokens)
        return Response(f'{head[:-1]}, "tokens": {ids}}}', media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_json(request, options.max_request_bytes)
        _check_model(body)
        runner, tokens = state["runner"], body.get("tokens")

        def decoded() -> str:  # off the event loop: millions of ids take a while to check and decode
            if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
                raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
            if runner.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer", param="tokens")
            bad = [t for t in tokens if not 0 <= t < runner.backend.vocab_size]
            if bad:
                raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary "
                                    f"(0..{runner.backend.vocab_size - 1})", param="tokens")
            text = runner.tokenizer.decode(tokens)
            return json.dumps({"prompt": text, "content": text})  # vLLM's key and llama.cpp's
        return Response(await asyncio.to_thread(decoded), media_type="application/json")

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tokenizer = state["runner"].tokenizer
        if tokenizer is None:
            raise ApiError(404, "this model has no tokenizer")
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token or None,
                "eos_token": tokenizer.eos_token or None, "pad_token": None,
                "chat_template": tokenizer.chat_template, "model_max_length": state["runner"].backend.max_seq_len}

    def _check_model(body: dict) -> None:
        """`model` absent or null: the one served (as vLLM); one of --name's aliases; any with --any-model; else
        OpenAI's 404."""
        name = body.get("model")
        if name is not None and name not in options.served_names and not (options.any_model and isinstance(name, str)):
            raise ApiError(404, f"the model '{str(name)[:100]}' does not exist here; this server serves "
                                f"{', '.join(repr(n) for n in options.served_names)} (GET /v1/models; llgraph serve "
                                "--name takes aliases: --name a,b; --any-model answers any name)", param="model",
                               code="model_not_found")

    return app


