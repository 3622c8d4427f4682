"""The Responses API in full (issue 64), through the openai client: `previous_response_id` continues a stored
conversation exactly (the prompt equals the chat completion of the whole conversation), `responses.retrieve`
returns a stored response, the bounded store evicts the oldest and says so, the stream has every documented event
for text and function calls, the chat completion's sampling fields are honoured (seed, stop), log-probabilities come
with `include`, a cut answer is `incomplete`, and a field the API does not take is a 400 naming it (with the field
to use instead)."""

import pytest
from conftest import need

openai = need("openai")
httpx = need("httpx")
need("fastapi")

from test_serve_openai import server  # noqa: E402,F401 (the fixture: one server for the OpenAI-convention tests)

GREEDY = dict(model="smol", temperature=0)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_previous_response_id_continues_the_stored_conversation(server):  # noqa: F811
    first = server.client.responses.create(input="My name is Ada. Say hello to me.", max_output_tokens=10,
                                           instructions="Be brief.", **GREEDY)
    second = server.client.responses.create(previous_response_id=first.id, input="What is my name?",
                                            max_output_tokens=10, instructions="Be brief.", **GREEDY)
    chat = server.client.chat.completions.create(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "My name is Ada. Say hello to me."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}],
        max_tokens=10, **GREEDY)
    print(repr(first.output_text), repr(second.output_text), repr(chat.choices[0].message.content))
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    assert server.client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve("resp_none")
    unstored = server.client.responses.create(input="Hi", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        server.client.responses.create(previous_response_id=unstored.id, input="Again", max_output_tokens=2)


def test_the_store_is_bounded_and_says_so():
    from llgraph.runtime.serve.request import ApiError
    from llgraph.runtime.serve.responses import Store

    store = Store(2)
    for i in range(3):
        store.put({"id": f"r{i}", "output": []}, [{"role": "user", "content": str(i)}])
    assert store.conversation("r2") == [{"role": "user", "content": "2"}]
    with pytest.raises(ApiError, match="keeps the last 2 responses") as e:
        store.conversation("r0")
    assert e.value.status == 404 and e.value.param == "previous_response_id"


def test_every_documented_event_streams(server):  # noqa: F811
    text = [e.type for e in server.client.responses.create(input="Name a fruit.", max_output_tokens=8, stream=True,
                                                           **GREEDY)]
    print(text)
    for kind in ("response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done"):
        assert kind in text, kind
    assert text[0] == "response.created" and text[-1] in ("response.completed", "response.incomplete")
    called = list(server.client.responses.create(input="What is the weather in Paris?", tools=[WEATHER],
                                                 tool_choice={"type": "function", "name": "get_weather"},
                                                 max_output_tokens=40, stream=True, **GREEDY))
    kinds = [e.type for e in called]
    print(kinds)
    at = kinds.index("response.function_call_arguments.delta")
    assert kinds[at + 1] == "response.function_call_arguments.done" and kinds[-1] == "response.completed"
    assert called[at].delta == called[at + 1].arguments and "city" in called[at].delta


def test_sampling_fields_are_honoured_and_others_refused(server):  # noqa: F811
    seeded = [server.client.responses.create(input="Tell me a story.", max_output_tokens=12, temperature=1.0,
                                             extra_body={"seed": 7}).output_text for _ in range(2)]
    assert seeded[0] == seeded[1], seeded
    whole = server.client.responses.create(input="Name three fruits.", max_output_tokens=24, **GREEDY).output_text
    word = whole.split()[1]
    cut = server.client.responses.create(input="Name three fruits.", max_output_tokens=24, extra_body={"stop": [word]},
                                         **GREEDY)
    print(repr(whole), repr(word), repr(cut.output_text))
    assert cut.output_text == whole[:whole.index(word)]
    short = server.client.responses.create(input="Tell me a story.", max_output_tokens=2, **GREEDY)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    scored = server.client.responses.create(input="Name a fruit.", max_output_tokens=4, top_logprobs=2,
                                            include=["message.output_text.logprobs"], **GREEDY)
    entries = scored.output[0].content[0].logprobs
    assert len(entries) >= 1 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    for field, value, hint in (("n", 2, "one output"), ("max_tokens", 5, "max_output_tokens"),
                               ("response_format", {"type": "json_object"}, "text.format"), ("bogus", 1, "drop it")):
        r = httpx.post(f"{server.url}/v1/responses", json={"input": "Hi", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field and hint in r.json()["error"]["message"]
