"""`llgraph serve`'s request parsing: the body read within its size limit, each field checked, the prompt
tokenized. Every bad input is an ApiError: a 4xx in OpenAI's error shape naming the field."""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager

from fastapi.responses import JSONResponse

from llgraph.errors import RequestError


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# -- fields ---------------------------------------------------------------------------------------------------

def number(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ApiError(400, f"'{key}' must be {'an integer' if integer else 'a number'}, not {value!r}", param=key)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{key}' ({value}) must be in [{lo}, {hi}]", param=key)
    return value


def flag(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be true or false, not {value!r}", param=key)
    return value


def include_usage(body: dict) -> bool:
    """stream_options.include_usage (OpenAI): stream_options is an object or null."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(400, f"'stream_options' must be an object, not {options!r}", param="stream_options")
    return flag(options, "include_usage")


def every_usage(body: dict) -> bool:
    """stream_options.continuous_usage_stats (vLLM's): with include_usage, every chunk carries the usage so far (its
    first, the prompt's tokens: what Anthropic's message_start states)."""
    return include_usage(body) and flag(body["stream_options"], "continuous_usage_stats")


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    return tuple(stop)


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in value)


def prompts_of(body: dict, tokenizer) -> list:
    """completions' `prompt`: a string, a list of strings, a list of token ids or a list of token-id lists -> the
    prompts, each a string or token ids (OpenAI's and vLLM's forms)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt) or
                                                  all(_token_ids(p) for p in prompt)):
        prompts = prompt
    else:
        prompts = []
    if not prompts or any(p == "" for p in prompts):
        raise ApiError(400, "'prompt' must be a non-empty string, a list of token ids, or a list of either",
                       param="prompt")
    if tokenizer is None and isinstance(prompts[0], str):
        raise ApiError(400, "this model has no tokenizer; send 'prompt' as token ids", param="prompt")
    return prompts


# A request field this server cannot honour, and the values of it that change nothing: any other value is a 400
# naming the field (a field that would change the output is never silently ignored).
_NEUTRAL = {
    "suffix": (None, ""), "min_tokens": (None, 0), "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "prompt_logprobs": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "reasoning_effort": (None,), "verbosity": (None, "medium"), "web_search_options": (None,),
}
# OpenAI's request fields that change no output (bookkeeping for OpenAI's platform): taken, and without effect here
NO_EFFECT = ("model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")


def logit_bias(body: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: {token id (a JSON key, so a string): bias in [-100, 100]} -> (id, bias) pairs."""
    given = body.get("logit_bias")
    if given is None:
        return ()
    if not isinstance(given, dict) or len(given) > 1024:
        raise ApiError(400, "'logit_bias' must be an object of at most 1024 token ids to biases in [-100, 100]",
                       param="logit_bias")
    pairs = []
    for key, bias in given.items():
        # ASCII digits only: str.isdigit() takes '²' and '٣', which int() refuses or reads as another number
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12 else -1
        if not 0 <= token < vocab or isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -100 <= bias <= 100:
            raise ApiError(400, f"'logit_bias' maps token ids in 0..{vocab - 1} to biases in [-100, 100]; not "
                                f"{str(key)[:20]!r}: {str(bias)[:20]}", param="logit_bias")
        pairs.append((token, float(bias)))
    return tuple(pairs)


def refuse_unsupported(body: dict, n: int, chat: bool = False) -> None:
    for key, neutral in _NEUTRAL.items():
        if chat and key in ("tools", "tool_choice", "reasoning_effort"):
            continue  # chat completions call tools (tools_of) and give gpt-oss's template its effort (chat_prompt)
        if key in body and body[key] not in neutral:
            raise ApiError(400, f"'{key}' ({str(body[key])[:60]}) is not supported by this server; drop it",
                           param=key)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise ApiError(400, f"'best_of' ({best_of!r}) is not supported apart from best_of == n; drop it",
                       param="best_of")


def tools_of(body: dict):
    """tools, tool_choice, parallel_tool_calls -> a runtime.engine.tools.ToolSpec (None: no tool may be called)."""
    from llgraph.runtime.engine.tools import ToolSpec

    try:
        return ToolSpec.of(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    except RequestError as e:
        param = next((k for k in ("tool_choice", "parallel_tool_calls") if k in str(e)), "tools")
        raise ApiError(400, str(e), param=param) from None


def grammar_of(body: dict):
    """The output's constraint -> a Grammar (runtime/engine/grammar.py; None: plain text): OpenAI's
    `response_format`, or llama.cpp's `grammar` (GBNF) or top-level `json_schema`; one of them at most. A bad one is a
    400 naming it."""
    from llgraph.errors import LlgraphError
    from llgraph.runtime.engine.grammar import Grammar

    plain = {"type": "text"}
    given = [k for k in ("response_format", "grammar", "json_schema") if body.get(k) not in (None, plain)]
    if len(given) > 1:
        raise ApiError(400, f"give one of {', '.join(repr(k) for k in given)}: each constrains the whole output",
                       param=given[1])
    key = given[0] if given else "response_format"
    try:
        if key == "grammar":
            if not isinstance(body["grammar"], str):
                raise ApiError(400, "'grammar' must be a GBNF grammar (a string)", param="grammar")
            return Grammar.gbnf(body["grammar"])
        if key == "json_schema":
            if not isinstance(body["json_schema"], (dict, bool)):
                raise ApiError(400, "'json_schema' must be a JSON schema object", param="json_schema")
            return Grammar.json_schema(json.dumps(body["json_schema"]))
        return Grammar.from_response_format(body.get("response_format"))
    except LlgraphError as e:
        raise ApiError(400, f"'{key}': {e}", param=key) from None


def _content(content) -> str | None:
    """A message's content: a string, or a list of text parts (OpenAI's content parts); None if neither."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"content part of type {kind!r} is not supported; this model reads text parts "
                                "({\"type\": \"text\", \"text\": ...})", param="messages")
        if not isinstance(part.get("text"), str):
            raise ApiError(400, "a text content part needs a string 'text'", param="messages")
        texts.append(part["text"])
    return "".join(texts)


def chat_prompt(body: dict, runner, tools=None) -> str:
    """The messages (content as a string or OpenAI's text parts; an assistant's `tool_calls`, a tool's result)
    rendered by the runner's chat template, with `tools` (a ToolSpec) the model may call."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content}", param="messages")
    clean = [{"role": m.get("role"), "content": _content(m.get("content")),
              **{k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None}}
             if isinstance(m, dict) else m for m in messages]
    generation, cont = flag(body, "add_generation_prompt", True), flag(body, "continue_final_message", False)
    try:
        return runner.render_chat(clean, tools=tools, add_generation_prompt=generation, continue_final_message=cont,
                                  reasoning_effort=body.get("reasoning_effort"))
    except RequestError as e:
        raise ApiError(400, str(e), param="reasoning_effort" if "reasoning_effort" in str(e) else "messages") from None
    except Exception as e:
        raise ApiError(400, f"the chat template failed on these messages: {e}", param="messages") from None


@contextmanager
def submitting(handles: list):
    """A request's submissions to the scheduler (their handles appended to `handles`): if anything fails, every one
    submitted is cancelled, and the scheduler's refusal is answered — the queue full a 429, shutting down a 503, a
    bad request a 400."""
    from llgraph.runtime.engine.requests import QueueFull, ShuttingDown

    try:
        yield
    except BaseException as e:
        for h in handles:
            h.cancel()
        if isinstance(e, QueueFull):
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full") from None
        if isinstance(e, ShuttingDown):
            raise ApiError(503, str(e), "server_error", code="shutting_down") from None
        if isinstance(e, RequestError):
            raise ApiError(400, str(e)) from None
        raise


def check_json(content_type: str | None, origin: str | None = None) -> None:
    """A body from a web page (an `Origin` header: the server's own or a --cors-origins one, access.Guard refused the
    rest) must declare itself JSON, else a 415; one without (curl -d, SDKs) is read as JSON whatever it declares."""
    if origin is not None and (content_type or "").split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, f"the request body must be application/json, not {content_type or 'untyped'}",
                       code="unsupported_media_type")


def _constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:40]} is beyond a double")
    return value


def decoded(data: bytes) -> dict:
    """The body as a JSON object; anything else a 400 — invalid UTF-8 or JSON, nesting past Python's recursion
    limit, an integer of more digits than Python converts (4,300), NaN/Infinity (not JSON) or a float beyond a
    double."""
    try:
        body = json.loads(data, parse_constant=_constant, parse_float=_finite)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        why = "" if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)) else f" ({str(e)[:80]})"
        raise ApiError(400, f"the body is not valid JSON (or nests too deeply){why}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:  # JSON may escape a lone UTF-16 surrogate ("\ud800"), which no tokenizer (and no UTF-8 reply) can hold
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ApiError(400, "the body holds a lone UTF-16 surrogate escape (e.g. \\ud800 without its pair); "
                            "send valid Unicode") from None
    return body


MAX_TOOLS = 128  # OpenAI's own limit on a request's functions


def check_sizes(body: dict, context: int) -> None:
    """Cheap bounds, before anything is rendered or tokenized: at most MAX_TOOLS tools, and no more messages or
    tool calls than the context has tokens (each renders to at least one token, so more can never fit)."""
    tools, messages = body.get("tools"), body.get("messages")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise ApiError(400, f"'tools' lists {len(tools)} functions; at most {MAX_TOOLS} are taken (OpenAI's limit)",
                       param="tools")
    if isinstance(messages, list):
        calls = sum(len(m["tool_calls"]) for m in messages if isinstance(m, dict) and
                    isinstance(m.get("tool_calls"), list))
        if len(messages) > context or calls > context:
            what = f"{len(messages)} messages" if len(messages) > context else f"{calls} tool calls"
            raise ApiError(400, f"'messages' hold {what}, more than this model's context of {context} tokens can "
                                "ever fit; send fewer", param="messages", code="context_length_exceeded")


def prompt_ids(runner, prompt, context: int, field: str) -> list[int]:
    """Token ids of a prompt (text or ids), refusing at once one that cannot fit the context whatever it
    tokenizes to: a text of more than context x the longest token's characters is never tokenized. Runs off the
    event loop (tokenizing a long text takes a while)."""
    if isinstance(prompt, str) and len(prompt) > context * runner.tokenizer.max_token_chars or \
            not isinstance(prompt, str) and len(prompt) > context:
        unit = "characters" if isinstance(prompt, str) else "token ids"
        raise ApiError(400, f"the prompt ({len(prompt)} {unit}) cannot fit this model's context of {context} "
                            "tokens; shorten the prompt", param=field, code="context_length_exceeded")
    try:
        return runner.encode(prompt)
    except RequestError as e:
        raise ApiError(400, str(e).replace("'prompt'", f"'{field}'"), param=field) from None


async def unless_gone(request, awaitable, done: bool = False):
    """Awaits it while the client is there (checked every 0.5 s); None once the client left, the awaitable then
    cancelled and its end awaited (so whatever it was iterating is no longer running when the caller closes it).
    `done`: the awaitable returns None itself, so success is True."""
    task = asyncio.ensure_future(awaitable)
    while True:
        finished, _ = await asyncio.wait({task}, timeout=0.5)
        if finished:
            result = task.result()
            return True if done else result
        if await request.is_disconnected():
            task.cancel()
            await asyncio.wait({task})
            return None
