"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`), what OpenAI's newer SDKs and agents speak,
over the same engine step as chat completions: a request is translated to a chat completion (its `input` items to
messages, its `instructions` to a system message, its function tools to chat tools), answered by
completions.answer, and the answer translated back — whole (`output`: a message item with output_text, function_call
items) or streamed as the API's typed events (response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta, ..., response.function_call_arguments.delta/.done,
response.completed).

Taken: input (a string, or message items with input_text/output_text parts, function_call and
function_call_output items), instructions, previous_response_id, store, max_output_tokens, temperature, top_p,
top_logprobs with include ["message.output_text.logprobs"], tools (function tools), tool_choice,
parallel_tool_calls, text.format (json_schema, json_object), stream, metadata, user; fields that change nothing a
local model computes (service_tier, safety_identifier, prompt_cache_key, truncation "disabled"); and the chat
completion's own sampling fields, honoured as there (seed, stop, logit_bias, frequency_penalty, presence_penalty,
top_k, min_p, repetition_penalty, grammar). Any other field is a 400 naming it — `n`, `max_tokens`,
`response_format` and `logprobs` with the Responses API's own field to use.

`store` (true unless false) keeps a response, and the conversation that led to it, in a bounded in-memory Store:
`previous_response_id` continues it (its input and output before the new input; its instructions are not carried
over, as OpenAI's are not), `GET /v1/responses/{id}` returns it. The Store holds the last STORE_SIZE responses; an
older id is a 404 that says it was evicted, and nothing survives a restart.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict

from fastapi.responses import StreamingResponse

from llgraph.runtime.serve.completions import Chunks
from llgraph.runtime.serve.request import ApiError

STORE_SIZE = 1024  # responses kept for previous_response_id and retrieval
_OWN = {"model", "input", "instructions", "previous_response_id", "store", "max_output_tokens", "temperature", "top_p",
        "top_logprobs", "include", "tools", "tool_choice", "parallel_tool_calls", "text", "stream", "metadata", "user",
        "reasoning"}
_NEUTRAL = {"service_tier": None, "safety_identifier": None, "prompt_cache_key": None, "truncation": "disabled",
            "background": False, "conversation": None, "prompt": None, "max_tool_calls": None,
            "stream_options": None}
_CHAT = ("seed", "stop", "logit_bias", "frequency_penalty", "presence_penalty", "top_k", "min_p", "repetition_penalty",
         "grammar")  # chat completions' own fields, honoured as there
_INSTEAD = {"n": "one output a response", "max_tokens": "use max_output_tokens",
            "max_completion_tokens": "use max_output_tokens", "response_format": "use text.format",
            "logprobs": "use top_logprobs with include [\"message.output_text.logprobs\"]"}
LOGPROBS = "message.output_text.logprobs"


class Store:
    """The responses `store` keeps: each with the conversation that led to it (chat messages, no instructions) and
    its output as messages; the last `size`, the oldest evicted first."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._items[response["id"]] = (response, conversation + _as_messages(response["output"]))
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def _get(self, response_id: str, param: str | None):
        if not isinstance(response_id, str) or response_id not in self._items:
            raise ApiError(404, f"no stored response {str(response_id)[:80]!r}: this server keeps the last "
                                f"{self.size} responses stored in memory (an older one was evicted; none survives a "
                                "restart); send the conversation as input instead", param=param, code="not_found")
        return self._items[response_id]

    def response(self, response_id: str) -> dict:
        return self._get(response_id, None)[0]

    def conversation(self, response_id: str) -> list[dict]:
        return list(self._get(response_id, "previous_response_id")[1])


async def respond(body: dict, store: Store, answer_chat, name: str):
    """POST /v1/responses: the request answered by `answer_chat(chat_body)` (the chat route's answer: a dict, a
    StreamingResponse, or a Response passed on as it is), whole or as events; kept in `store` unless it says
    `store: false`."""
    if not isinstance(body.get("input"), (str, list)):
        raise ApiError(400, "'input' must be a string or a list of items", param="input")
    chat, conversation = chat_body(body, store)
    answered = await answer_chat(chat)
    response_id = f"resp_{uuid.uuid4().hex}"

    def keep(response: dict) -> None:
        if body.get("store") is not False:
            store.put(response, conversation)
    if isinstance(answered, Chunks):
        return StreamingResponse(events(answered.chunks, body, response_id, name, keep),
                                 media_type="text/event-stream")
    if not isinstance(answered, dict):
        return answered
    response = response_of(answered, body, response_id, name)
    keep(response)
    return response


def chat_body(body: dict, store: Store | None = None) -> tuple[dict, list[dict]]:
    """The Responses request as a chat completion request, and the conversation it continues with its new input
    (ApiError 400 naming a field it cannot take)."""
    for key in body:
        if key in _INSTEAD:
            raise ApiError(400, f"'{key}' is not a Responses API field; {_INSTEAD[key]}", param=key)
        if key not in _OWN and key not in _CHAT and key not in _NEUTRAL:
            raise ApiError(400, f"'{key}' is not supported by this server's Responses API; drop it", param=key)
        if key in _NEUTRAL and body[key] not in (None, _NEUTRAL[key], [], {}):
            raise ApiError(400, f"'{key}' ({str(body[key])[:40]}) is not supported by this server's Responses API; "
                                "drop it", param=key)
    conversation = []
    if body.get("previous_response_id") is not None:
        conversation = (store or Store(0)).conversation(body["previous_response_id"])
    given = body.get("input")
    if isinstance(given, str):
        conversation.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        conversation += [_message(item) for item in given]
    else:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", param="input")
    messages = list(conversation)
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise ApiError(400, "'instructions' must be a string", param="instructions")
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    chat = {"messages": messages, "stream": bool(body.get("stream")), "stream_options": {"include_usage": True}
            if body.get("stream") else None,
            **{k: body[k] for k in ("temperature", "top_p", "parallel_tool_calls", "model", *_CHAT) if k in body}}
    include = body.get("include") or []
    if not isinstance(include, list) or any(i != LOGPROBS for i in include):
        raise ApiError(400, f"'include' may hold only {LOGPROBS!r} here", param="include")
    if include or body.get("top_logprobs") is not None:
        chat["logprobs"], chat["top_logprobs"] = True, body.get("top_logprobs") or 0
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if reasoning is not None:  # effort reaches a template that reads it (gpt-oss's), as chat's reasoning_effort
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
            raise ApiError(400, "'reasoning' takes effort (low, medium, high) and summary", param="reasoning")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    for key, kind in (("tools", list), ("text", dict), ("metadata", dict)):
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise ApiError(400, f"'{key}' must be {'a list' if kind is list else 'an object'}", param=key)
    if body.get("tools"):
        chat["tools"] = [_tool(t) for t in body["tools"]]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in ("text", "json_schema", "json_object")):
        raise ApiError(400, "'text.format' must be {\"type\": \"text\"}, json_object or json_schema", param="text")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                                          "schema": fmt.get("schema")}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return chat, conversation


def _as_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a next turn reads: one assistant message, its text and its
    calls."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return []
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def _message(item) -> dict:
    if not isinstance(item, dict):
        raise ApiError(400, f"each 'input' item is an object, not {str(item)[:40]}", param="input")
    kind = item.get("type", "message")
    if kind == "function_call":
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}]}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "tool_call_id": item.get("call_id"),
                "content": output if isinstance(output, str) else json.dumps(output)}
    if kind != "message":
        raise ApiError(400, f"input items of type {kind!r} are not supported (message, function_call, "
                            "function_call_output)", param="input")
    content = item.get("content")
    if isinstance(content, list):
        texts: list = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in ("input_text",
                                                                                              "output_text", "text")]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "message content parts must be input_text or output_text (no images or files "
                                "here)", param="input")
        content = "".join(texts)
    return {"role": item.get("role"), "content": content}


def _tool(tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ApiError(400, f"only function tools are supported, not {str(tool)[:60]}", param="tools")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if k in tool}}


def response_of(chat: dict, body: dict, response_id: str, model: str) -> dict:
    """A whole chat completion (one choice) as a Responses object."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):  # gpt-oss's analysis channel (runtime/engine/harmony.py)
        output.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        output.append(_text_item(message["content"], logprobs=_logprobs(choice)))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call))
    return _finished(_response(response_id, model, body, "completed", output, _usage(chat["usage"])),
                     choice["finish_reason"])


def _usage(usage: dict | None) -> dict | None:
    """A chat completion's usage in the Responses API's words."""
    return None if usage is None else {
        "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
        "total_tokens": usage["total_tokens"],
        "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                                 "cache_write_tokens": 0},  # (the openai SDK's Response requires it)
        "output_tokens_details": {"reasoning_tokens": 0}}


def _response(response_id: str, model: str, body: dict, status: str, output: list, usage: dict | None) -> dict:
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": status,
            "model": model, "output": output, "usage": usage, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []),
            "metadata": body.get("metadata") or {}, "text": {"format": {"type": "text"}},
            "previous_response_id": body.get("previous_response_id"), "store": body.get("store") is not False,
            # the reasoning is returned as it was written (a reasoning item's reasoning_text), never summarized
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None}}


def _finished(response: dict, finish_reason: str | None) -> dict:
    """A response cut by max_output_tokens is "incomplete", as OpenAI says it."""
    if finish_reason == "length":
        response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    return response


def _text_item(text: str, status: str = "completed", item_id: str | None = None, logprobs=None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": status,
            "content": [part]}


def _reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or f"rs_{uuid.uuid4().hex}", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _logprobs(choice: dict) -> list | None:
    """A chat choice's (or chunk's) log-probabilities in the Responses API's shape, or None."""
    content = (choice.get("logprobs") or {}).get("content")
    return None if content is None else [
        {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
         "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]}
                          for t in e.get("top_logprobs", [])]} for e in content]


def _call_item(call: dict) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


async def events(chunks, body: dict, response_id: str, model: str, done=None):
    """A streamed chat completion's chunks (dicts) -> the Responses API's typed events (SSE); `done(response)` is called
    with the completed response (the Store's put)."""
    number = 0

    def event(kind: str, **fields) -> str:
        nonlocal number
        number += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number, **fields})}\n\n"

    started = _response(response_id, model, body, "in_progress", [], None)
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    calls: list[dict] = []
    item_id, text, usage, opened, logprobs, finish = f"msg_{uuid.uuid4().hex}", "", None, False, None, None
    output: list[dict] = []
    reasoning_id = f"rs_{uuid.uuid4().hex}"
    reasoning: str | None = None  # gpt-oss's analysis, an item before the message

    def close_reasoning():
        yield event("response.reasoning_text.done", item_id=reasoning_id, output_index=0, content_index=0,
                    text=reasoning)
        output.append(_reasoning_item(reasoning or "", item_id=reasoning_id))
        yield event("response.output_item.done", output_index=0, item=output[-1])
    async for chunk in chunks:
        if "error" in chunk:
            yield event("error", message=chunk["error"]["message"], code=chunk["error"].get("code"))
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content") and not opened:
                if reasoning is None:
                    reasoning = ""
                    yield event("response.output_item.added", output_index=0,
                                item=_reasoning_item("", "in_progress", reasoning_id) | {"content": []})
                reasoning += delta["reasoning_content"]
                yield event("response.reasoning_text.delta", item_id=reasoning_id, output_index=0, content_index=0,
                            delta=delta["reasoning_content"])
            if delta.get("content"):
                if not opened:
                    opened = True
                    if reasoning is not None:
                        for e in close_reasoning():
                            yield e
                    yield event("response.output_item.added", output_index=len(output),
                                item=_text_item("", "in_progress", item_id) | {"content": []})
                    yield event("response.content_part.added", item_id=item_id, output_index=len(output),
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                text += delta["content"]
                entries = _logprobs(choice)
                if entries is not None:
                    logprobs = (logprobs or []) + entries
                yield event("response.output_text.delta", item_id=item_id, output_index=len(output),
                            content_index=0, delta=delta["content"], logprobs=entries or [])
            calls += delta.get("tool_calls") or []
            finish = choice.get("finish_reason") or finish
    if reasoning is not None and not opened:  # an answer that never left its analysis
        for e in close_reasoning():
            yield e
    if opened:
        at = len(output)
        yield event("response.output_text.done", item_id=item_id, output_index=at, content_index=0, text=text,
                    logprobs=logprobs or [])
        output.append(_text_item(text, item_id=item_id, logprobs=logprobs))
        yield event("response.content_part.done", item_id=item_id, output_index=at, content_index=0,
                    part=output[-1]["content"][0])
        yield event("response.output_item.done", output_index=at, item=output[-1])
    for call in calls:
        item = _call_item(call)
        yield event("response.output_item.added", output_index=len(output),
                    item=item | {"status": "in_progress", "arguments": ""})
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=len(output),
                    delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=len(output),
                    arguments=item["arguments"])
        output.append(item)
        yield event("response.output_item.done", output_index=len(output) - 1, item=item)
    completed = _finished(_response(response_id, model, body, "completed", output, _usage(usage)), finish)
    if done is not None:
        done(completed)
    yield event("response.incomplete" if completed["status"] == "incomplete" else "response.completed",
                response=completed)
