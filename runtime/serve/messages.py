"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), what the anthropic SDK and the
agents and coding tools built on it speak, over the same engine step as chat completions: a request is translated to
a chat completion (`system` to a system message, content blocks to messages, `tool_use`/`tool_result` blocks to tool
calls and tool messages, `tools`' input_schema to function parameters), answered by completions.answer, and the
answer translated back — whole (a `message` of text and tool_use blocks with Anthropic's stop_reason) or streamed as
the API's events (message_start, content_block_start/delta/stop, message_delta, message_stop). Errors take
Anthropic's shape, `{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`.

Taken: model, max_tokens, messages (text, tool_use and tool_result blocks; a string content), system (a string or
text blocks), stop_sequences, temperature, top_p, top_k (which the anthropic SDK 2.x no longer sends: the server's
defaults, `GET /props`, apply unless a client passes them in its extra body), tools (custom tools), tool_choice
(auto, any, tool, none; disable_parallel_tool_use), output_config.format (a JSON schema the answer follows; its
effort is taken and has no effect here), stream, thinking (accepted; this server writes no thinking blocks), and
the fields that change nothing a local model computes: metadata, service_tier, speed, cache_control (the prefix
cache reuses what it can by itself), inference_geo, diagnostics, user_profile_id, workspace_id. Images,
documents, server tools, MCP servers and containers are a 400 naming them, as is any other field.
"""

from __future__ import annotations

import asyncio
import json
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from llgraph.runtime.serve.ask import parse
from llgraph.runtime.serve.completions import Chunks
from llgraph.runtime.serve.request import ApiError, prompt_ids

_TAKEN = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools",
          "tool_choice", "stream", "thinking", "output_config",
          "metadata", "service_tier", "speed", "cache_control", "inference_geo", "diagnostics", "user_profile_id",
          "workspace_id"}
STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


async def respond(read, answer_chat, name: str):
    """POST /v1/messages: the body `await read()` gives (read and checked as every route's), answered by
    `answer_chat(chat_body)` (the chat route's answer), whole or as events; an error in Anthropic's shape."""
    try:
        answered = await answer_chat(chat_body(await read()))
    except ApiError as e:  # in Anthropic's shape, which its SDK reads
        return JSONResponse(error_body(e), status_code=e.status)
    message_id = f"msg_{uuid.uuid4().hex}"
    if isinstance(answered, Chunks):
        return StreamingResponse(events(answered.chunks, message_id, name), media_type="text/event-stream")
    return message_of(answered, message_id, name) if isinstance(answered, dict) else answered


async def count_tokens(read, runner, slots: int, capacity: int):
    """POST /v1/messages/count_tokens: the prompt's tokens as the chat template renders it, tools included."""
    try:
        chat = chat_body(await read(), counting=True)
        ask = await asyncio.to_thread(parse, chat, True, runner, slots, capacity)  # the template off the loop
        ids = await asyncio.to_thread(prompt_ids, runner, ask.prompts[0], 1 << 62, "messages")
    except ApiError as e:
        return JSONResponse(error_body(e), status_code=e.status)
    return {"input_tokens": len(ids)}


def error_body(e: ApiError) -> dict:
    """An ApiError in Anthropic's shape."""
    return {"type": "error", "error": {"type": ERROR_TYPE.get(e.status, "api_error"), "message": str(e)}}


def chat_body(body: dict, counting: bool = False) -> dict:
    """The Messages request as a chat completion request (ApiError 400 naming a field it cannot take). `counting`:
    for count_tokens, which takes no max_tokens."""
    unknown = sorted(set(body) - _TAKEN)
    if unknown:
        raise ApiError(400, f"'{unknown[0]}' is not supported by this server's Messages API; drop it",
                       param=unknown[0])
    if not counting and body.get("max_tokens") is not None and (
            not isinstance(body["max_tokens"], int) or isinstance(body["max_tokens"], bool) or body["max_tokens"] < 1):
        raise ApiError(400, "'max_tokens' must be a positive integer", param="max_tokens")
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content}", param="messages")
    messages = [{"role": "system", "content": _system(body["system"])}] if body.get("system") else []
    for message in given:
        messages += _messages(message)
    chat = {"messages": messages, "stream": bool(body.get("stream")),
            **{k: body[k] for k in ("temperature", "top_p", "top_k", "model") if body.get(k) is not None}}
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}  # message_start's tokens
    if not counting and body.get("max_tokens") is not None:
        chat["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences") is not None:
        stops = body["stop_sequences"]
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ApiError(400, "'stop_sequences' must be a list of non-empty strings", param="stop_sequences")
        chat["stop"] = stops
    if body.get("tools") is not None:
        if not isinstance(body["tools"], list):
            raise ApiError(400, "'tools' must be a list", param="tools")
        chat["tools"] = [_tool(t) for t in body["tools"]]
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    config = body.get("output_config")
    if config is not None:
        fmt = config.get("format") if isinstance(config, dict) else "?"
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and
                                    isinstance(fmt.get("schema"), dict)):
            raise ApiError(400, "'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                           param="output_config")
        if fmt is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                              "schema": fmt["schema"]}}
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled",
                                                                                             "adaptive")):
        raise ApiError(400, "'thinking' must be {\"type\": \"enabled\" | \"disabled\"}", param="thinking")
    return chat


def _system(system) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text" and
                                        isinstance(b.get("text"), str) for b in system):
        return "\n\n".join(b["text"] for b in system)
    raise ApiError(400, "'system' must be a string or a list of text blocks", param="system")


def _messages(message) -> list[dict]:
    """One Messages-API message -> chat messages: a user's tool_result blocks become tool messages (before its
    text), an assistant's tool_use blocks its tool calls."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise ApiError(400, "each message is {\"role\": \"user\" | \"assistant\", \"content\": ...}",
                       param="messages")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, "a message's 'content' must be a string or a list of content blocks", param="messages")
    texts, calls, results = [], [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _result_text(block.get("content"))})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier turn's reasoning: not part of the prompt, as Anthropic's own API drops it
        else:
            raise ApiError(400, f"content blocks of type {kind!r} are not supported in a {role} message (text"
                                f"{', tool_use' if role == 'assistant' else ', tool_result'}; no images or "
                                "documents here)", param="messages")
    out = results
    if calls:
        out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
    elif texts or not results:
        out.append({"role": role, "content": "".join(texts)})
    return out


def _result_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise ApiError(400, "a tool_result's content must be a string or text blocks", param="messages")


def _tool(tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str):
        raise ApiError(400, f"only custom tools ({{name, description, input_schema}}) are supported, not "
                            f"{str(tool)[:60]}", param="tools")
    schema = tool.get("input_schema", {"type": "object"})
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                             "parameters": schema}}


def _tool_choice(choice) -> dict:
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ApiError(400, "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
                       param="tool_choice")
    kind = choice["type"]
    out: dict = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind) or
                 {"type": "function", "function": {"name": choice.get("name")}}}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def message_of(chat: dict, message_id: str, model: str) -> dict:
    """A whole chat completion (one choice) as a Messages-API message."""
    choice = chat["choices"][0]
    content = []
    if choice["message"].get("reasoning_content"):  # gpt-oss's analysis channel (runtime/engine/harmony.py)
        content.append({"type": "thinking", "thinking": choice["message"]["reasoning_content"], "signature": ""})
    if choice["message"].get("content"):
        content.append({"type": "text", "text": choice["message"]["content"]})
    content += [_tool_use(call) for call in choice["message"].get("tool_calls") or []]
    reason, stop = _stop(choice)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": stop, "usage": _usage(chat["usage"])}


def _stop(choice: dict) -> tuple[str, str | None]:
    stop = choice.get("stop_reason")
    if stop is not None:
        return "stop_sequence", stop
    return STOP_REASON.get(choice["finish_reason"], "end_turn"), None


def _tool_use(call: dict) -> dict:
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "tool_use", "id": f"toolu_{call['id'].removeprefix('call_')}", "name": call["function"]["name"],
            "input": arguments}


def _usage(usage: dict | None) -> dict:
    usage = usage or {"prompt_tokens": 0, "completion_tokens": 0}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


async def events(chunks, message_id: str, model: str):
    """A streamed chat completion's chunks (dicts) -> the Messages API's events (SSE)."""
    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    index, text_open, thinking_open, finished, usage = 0, False, False, None, None
    calls: list[dict] = []
    started = False
    async for chunk in chunks:
        if "error" in chunk:
            yield event("error", error={"type": "api_error", "message": chunk["error"]["message"]})
            return
        usage = chunk.get("usage") or usage
        if not started:  # the first chunk's usage holds the prompt's tokens (continuous_usage_stats)
            started = True
            yield event("message_start", message={
                "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": _usage(usage)})
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):  # a thinking block first (harmony's analysis), as Claude's
                if not thinking_open:
                    thinking_open = True
                    yield event("content_block_start", index=index,
                                content_block={"type": "thinking", "thinking": "", "signature": ""})
                yield event("content_block_delta", index=index,
                            delta={"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                if thinking_open:
                    thinking_open = False
                    yield event("content_block_stop", index=index)
                    index += 1
                if not text_open:
                    text_open = True
                    yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                yield event("content_block_delta", index=index,
                            delta={"type": "text_delta", "text": delta["content"]})
            calls += delta.get("tool_calls") or []
            if choice.get("finish_reason") is not None:
                finished = choice
    if not started:  # no chunk came (never in practice: a chat stream opens with the assistant's role)
        yield event("message_start", message={
            "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": _usage(None)})
    if text_open or thinking_open:
        yield event("content_block_stop", index=index)
        index += 1
    for call in calls:
        block = _tool_use(call)
        yield event("content_block_start", index=index, content_block={**block, "input": {}})
        yield event("content_block_delta", index=index,
                    delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        yield event("content_block_stop", index=index)
        index += 1
    reason, stop = _stop(finished) if finished else ("end_turn", None)
    done = _usage(usage)
    yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": stop},
                usage={"output_tokens": done["output_tokens"], "input_tokens": done["input_tokens"],
                       "cache_read_input_tokens": done["cache_read_input_tokens"]})
    yield event("message_stop")
