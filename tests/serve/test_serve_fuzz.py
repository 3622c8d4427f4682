"""No input is a 5xx (issue 52): every POST route, each field of its body replaced by each of a corpus of hostile
values (wrong types, huge and non-finite numbers, deep nesting, lone surrogates, empty and oversized containers), the
same inside messages, tools and response formats, and raw bodies that are not JSON at all (invalid UTF-8, an integer
past Python's 4,300 digits — a 500 before —, nesting past the recursion limit, NaN). Every answer is below 500 and, when
an error, in OpenAI's error shape."""

import asyncio
import json

from conftest import need

httpx = need("httpx")
need("fastapi")

from serving import Server  # noqa: E402

HOSTILE = [None, True, -1, 0, 2**63, 10**400, 1e308, -1e-320, "", "x" * 5000, "\ud800", "<|im_end|>", [], [None],
           [[[[[[[[]]]]]]]], {}, {"": {}}, {"type": None}, [{"type": "function"}], {"$ref": "#"}]
BASES = {
    "/v1/completions": {"model": "m", "prompt": "Hi", "max_tokens": 1},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/v1/embeddings": {"model": "m", "input": "Hi"},
    "/tokenize": {"model": "m", "prompt": "Hi"},
    "/detokenize": {"model": "m", "tokens": [1, 2]},
    "/v1/responses": {"model": "m", "input": "Hi", "max_output_tokens": 1},
    "/v1/messages": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
}
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "echo",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "response_format", "tools",
          "tool_choice",
          "parallel_tool_calls", "speculative", "input", "encoding_format", "dimensions", "tokens",
          "add_special_tokens", "best_of", "suffix", "user", "instructions", "max_output_tokens", "text", "grammar",
          "json_schema", "content", "with_pieces", "add_generation_prompt", "continue_final_message", "system",
          "stop_sequences", "thinking", "output_config", "metadata"]
NESTED = {  # (route, a body with a hole): the hole filled by each hostile value
    "message": ("/v1/chat/completions", lambda v: {"messages": [v]}),
    "role": ("/v1/chat/completions", lambda v: {"messages": [{"role": v, "content": "Hi"}]}),
    "content": ("/v1/chat/completions", lambda v: {"messages": [{"role": "user", "content": v}]}),
    "content part": ("/v1/chat/completions", lambda v: {"messages": [{"role": "user", "content": [v]}]}),
    "tool call": ("/v1/chat/completions", lambda v: {"messages": [{"role": "user", "content": "Hi"},
                                                                  {"role": "assistant", "tool_calls": [v]}]}),
    "function": ("/v1/chat/completions", lambda v: {"tools": [{"type": "function", "function": v}]}),
    "parameters": ("/v1/chat/completions", lambda v: {"tools": [{"type": "function",
                                                                 "function": {"name": "f", "parameters": v}}]}),
    "tool choice": ("/v1/chat/completions", lambda v: {"tools": [{"type": "function", "function": {"name": "f"}}],
                                                       "tool_choice": {"type": "function", "function": v}}),
    "json schema": ("/v1/chat/completions", lambda v: {"response_format": {"type": "json_schema", "json_schema": v}}),
    "schema": ("/v1/chat/completions", lambda v: {"response_format": {"type": "json_schema",
                                                                      "json_schema": {"name": "s", "schema": v}}}),
    "input item": ("/v1/embeddings", lambda v: {"input": [v]}),
    "prompt item": ("/v1/completions", lambda v: {"prompt": [v]}),
    "response item": ("/v1/responses", lambda v: {"input": [v]}),
    "response part": ("/v1/responses", lambda v: {"input": [{"role": "user", "content": [v]}]}),
    "response tool": ("/v1/responses", lambda v: {"tools": [v]}),
    "text format": ("/v1/responses", lambda v: {"text": {"format": v}}),
    "message block": ("/v1/messages", lambda v: {"messages": [{"role": "user", "content": [v]}]}),
    "assistant block": ("/v1/messages", lambda v: {"messages": [{"role": "user", "content": "Hi"},
                                                                {"role": "assistant", "content": [v]}]}),
    "tool result": ("/v1/messages", lambda v: {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": v}]}]}),
    "anthropic tool": ("/v1/messages", lambda v: {"tools": [v]}),
    "anthropic tool choice": ("/v1/messages", lambda v: {"tools": [{"name": "f", "input_schema": {}}],
                                                         "tool_choice": v}),
    "output format": ("/v1/messages", lambda v: {"output_config": {"format": v}}),
}
RAW = [b"", b"null", b"[]", b'"text"', b"\xff\xfe{}", b'{"prompt": "\xc3"}', b"{" + b'"a":' * 3 + b"1",
       b'{"max_tokens": ' + b"9" * 5000 + b"}", b'{"prompt": [' + b"1" * 4400 + b"]}", b"[" * 100_000,
       b'{"temperature": NaN}', b'{"temperature": Infinity}', b'{"top_p": 1e999}', b'{"a": "\\ud800"}']


def _cases():
    for route, base in BASES.items():
        for field in FIELDS:
            for value in HOSTILE:
                yield route, json.dumps({**base, field: value}).encode()
        for raw in RAW:
            yield route, raw
    for route, fill in NESTED.values():
        for value in HOSTILE:
            yield route, json.dumps({**BASES[route], **fill(value)}).encode()


def test_no_input_is_a_5xx(shallow_export):
    s = Server(str(shallow_export), "--name", "m", "--slots", "2", "--max-seq-len", "64", "--max-queue", "256")
    cases = list(_cases())
    bad: list = []

    async def run():
        limit = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
            async def one(route, data):
                async with limit:
                    try:
                        r = await client.post(route, content=data, headers={"content-type": "application/json"})
                    except httpx.TransportError as e:  # the server closed the connection: as bad as a 500
                        bad.append((route, data[:200], type(e).__name__, ""))
                        return 0
                    text = (await r.aread()).decode(errors="replace")
                    if r.status_code >= 500 or (r.status_code >= 400 and "error" not in json.loads(text)):
                        bad.append((route, data[:200], r.status_code, text[:300]))
                    return r.status_code
            return await asyncio.gather(*(one(route, data) for route, data in cases))

    try:
        statuses = asyncio.run(run())
        print(f"{len(cases)} hostile bodies: " + ", ".join(f"{c} x{statuses.count(c)}" for c in sorted(set(statuses))))
        for b in bad:
            print("BAD", b[0], b[1][:160], b[2], b[3][:200].replace("\n", " "))
        assert not bad, bad[:5]
        assert httpx.get(f"{s.url}/health").status_code == 200  # and the server still answers
    finally:
        assert s.stop() == 0, "".join(s.lines[-20:])
