"""OpenAI's Responses API (`POST /v1/responses`), what OpenAI's newer SDKs and agents speak, over the same engine
step as chat completions: a request is translated to a chat completion (its `input` items to messages, its
`instructions` to a system message, its function tools to chat tools), answered by completions.answer, and the answer
translated back — whole (`output`: a message item with output_text, function_call items) or streamed as the API's
typed events (response.created, response.output_item.added, response.output_text.delta, ..., response.completed).

Taken: input (a string, or message items with input_text/output_text parts, function_call and
function_call_output items), instructions, max_output_tokens, temperature, top_p, tools (function tools),
tool_choice, parallel_tool_calls, text.format (json_schema, json_object), stream, metadata, user, store (nothing is
stored: `previous_response_id` is refused). Any other field that would change the output is a 400 naming it.
"""

from __future__ import annotations

import json
import time
import uuid

from llgraph.runtime.serve.request import ApiError

_REFUSED = ("previous_response_id", "conversation", "background", "reasoning", "include", "prompt", "truncation",
            "max_tool_calls", "top_logprobs")


def chat_body(body: dict) -> dict:
    """The Responses request as a chat completion request (ApiError 400 naming a field it cannot take)."""
    for key in _REFUSED:
        if body.get(key) not in (None, False, "disabled", []):
            raise ApiError(400, f"'{key}' is not supported by this server's Responses API; drop it", param=key)
    messages = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise ApiError(400, "'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": body["instructions"]})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for item in given:
            messages.append(_message(item))
    else:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", param="input")
    chat = {"messages": messages, "stream": bool(body.get("stream")), "stream_options": {"include_usage": True}
            if body.get("stream") else None,
            **{k: body[k] for k in ("temperature", "top_p", "parallel_tool_calls", "model") if k in body}}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
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
    return chat


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
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in ("input_text",
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
    message = chat["choices"][0]["message"]
    output = []
    if message.get("content"):
        output.append(_text_item(message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call))
    return _response(response_id, model, body, "completed", output, _usage(chat["usage"]))


def _usage(usage: dict | None) -> dict | None:
    """A chat completion's usage in the Responses API's words."""
    return None if usage is None else {
        "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
        "total_tokens": usage["total_tokens"],
        "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
        "output_tokens_details": {"reasoning_tokens": 0}}


def _response(response_id: str, model: str, body: dict, status: str, output: list, usage: dict | None) -> dict:
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": status,
            "model": model, "output": output, "usage": usage, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []),
            "metadata": body.get("metadata") or {}, "text": {"format": {"type": "text"}}}


def _text_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: dict) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


async def events(chunks, body: dict, response_id: str, model: str):
    """A streamed chat completion's SSE chunks -> the Responses API's typed events (SSE)."""
    number = 0

    def event(kind: str, **fields) -> str:
        nonlocal number
        number += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number, **fields})}\n\n"

    yield event("response.created", response=_response(response_id, model, body, "in_progress", [], None))
    calls: list[dict] = []
    item_id, text, usage, opened = f"msg_{uuid.uuid4().hex}", "", None, False
    async for raw in chunks:
        for line in (raw.decode() if isinstance(raw, bytes) else raw).splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                yield event("error", message=chunk["error"]["message"], code=chunk["error"].get("code"))
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    if not opened:
                        opened = True
                        yield event("response.output_item.added", output_index=0,
                                    item=_text_item("", "in_progress", item_id) | {"content": []})
                        yield event("response.content_part.added", item_id=item_id, output_index=0,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    text += delta["content"]
                    yield event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                                delta=delta["content"], logprobs=[])
                calls += delta.get("tool_calls") or []
    output = []
    if opened:
        yield event("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text,
                    logprobs=[])
        yield event("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                    part={"type": "output_text", "text": text, "annotations": []})
        output.append(_text_item(text, item_id=item_id))
        yield event("response.output_item.done", output_index=0, item=output[-1])
    for call in calls:
        item = _call_item(call)
        yield event("response.output_item.added", output_index=len(output), item=item | {"status": "in_progress"})
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=len(output),
                    arguments=item["arguments"])
        output.append(item)
        yield event("response.output_item.done", output_index=len(output) - 1, item=item)
    yield event("response.completed", response=_response(response_id, model, body, "completed", output,
                                                          _usage(usage)))
