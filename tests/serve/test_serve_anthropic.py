"""Anthropic's Messages API through the anthropic SDK, unchanged (issue 64): whole and streamed answers equal the chat
completion's for the same greedy request (the SDK 2.x sends no temperature: greedy is asked in its extra body), a
forced tool answers with a tool_use block and stop_reason tool_use and the conversation goes on with its
tool_result, a stop sequence ends the answer as Anthropic says it, count_tokens counts what the answer's usage
counts, output_config's JSON schema shapes the answer, and errors come in Anthropic's shape, which its SDK raises as
its own exceptions."""

import json

import pytest
from conftest import need

anthropic = need("anthropic")
httpx = need("httpx")

from test_serve_openai import server  # noqa: E402,F401 (the fixture: one server for the OpenAI-convention tests)

GREEDY = {"temperature": 0}
ASK = dict(model="smol", system="Be brief.", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=12,
           extra_body=GREEDY)
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_whole_and_streamed_answers_equal_chat(server, client):  # noqa: F811
    chat = server.client.chat.completions.create(
        model="smol", messages=[{"role": "system", "content": "Be brief."}, ASK["messages"][0]], max_tokens=12,
        temperature=0)
    whole = client.messages.create(**ASK)
    text = "".join(b.text for b in whole.content if b.type == "text")
    print("messages:", repr(text), whole.stop_reason, whole.usage, "chat:", repr(chat.choices[0].message.content))
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert text == chat.choices[0].message.content
    assert whole.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    with client.messages.stream(**ASK) as stream:
        events = list(stream)
        final = stream.get_final_message()
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert streamed == text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    started = next(e for e in events if e.type == "message_start")  # the prompt's tokens from the start, as Claude's
    assert started.message.usage.input_tokens == whole.usage.input_tokens > 0
    counted = client.messages.count_tokens(model="smol", system="Be brief.", messages=ASK["messages"])
    shaped = client.messages.create(**{**ASK, "max_tokens": 40}, output_config={"format": {
        "type": "json_schema", "schema": {"type": "object", "properties": {"fruit": {"type": "string"}},
                                          "required": ["fruit"]}}})
    print("structured:", shaped.content[0].text)
    assert isinstance(json.loads(shaped.content[0].text)["fruit"], str)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_a_forced_tool_then_its_result(client):
    called = client.messages.create(model="smol", max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"},
                                    messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    uses = [b for b in called.content if b.type == "tool_use"]
    print(called.content, called.stop_reason)
    assert called.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    assert isinstance(uses[0].input, dict) and "city" in uses[0].input and uses[0].id.startswith("toolu_")
    follow = client.messages.create(model="smol", max_tokens=20, extra_body=GREEDY, tools=[WEATHER], messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather",
                                           "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}]}])
    print(follow.content)
    assert follow.content and follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    streamed = client.messages.create(model="smol", max_tokens=60, extra_body=GREEDY, tools=[WEATHER], stream=True,
                                      tool_choice={"type": "any"},
                                      messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    kinds = [event.type for event in streamed]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_start" in kinds, kinds


def test_a_stop_sequence_is_named(client):
    text = "".join(b.text for b in client.messages.create(**{**ASK, "max_tokens": 24}).content)
    word = text.split()[len(text.split()) // 2]
    cut = client.messages.create(**{**ASK, "max_tokens": 24}, stop_sequences=[word])
    print(repr(text), repr(word), cut.content, cut.stop_reason, cut.stop_sequence)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert "".join(b.text for b in cut.content) == text[:text.index(word)]


def test_errors_in_anthropic_shape(server, client):  # noqa: F811
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="smol", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-unknown", max_tokens=4, messages=ASK["messages"])
    plain = {k: v for k, v in ASK.items() if k != "extra_body"}
    r = httpx.post(f"{server.url}/v1/messages", json={**plain, "max_tokens": 4, "mcp_servers": [{"url": "x"}]})
    assert r.status_code == 400 and "mcp_servers" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}/v1/messages", json={**plain, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
