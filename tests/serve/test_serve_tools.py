"""OpenAI tool calling on `llgraph serve`, driven by the official `openai` client: a required and a named call whose
arguments validate against the function's schema (`jsonschema`, independent of the grammar engine), the same call
streamed as OpenAI's deltas, a two-turn exchange (the call fed back with `content: null`, then the tool's result),
and one-line 400s for bad tool fields."""

import json

import pytest
from conftest import need

openai = need("openai")
need("fastapi")
need("llguidance")
jsonschema = need("jsonschema")

from serving import Server  # noqa: E402
from test_tools import TIME, WEATHER  # noqa: E402  (tests/engine: the same two functions)

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What's the weather like in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def server(serve_export):
    s = Server(str(serve_export), "--name", "m", "--slots", "2", "--max-seq-len", "512")
    yield s
    assert s.stop() == 0, "".join(s.lines)


def _valid(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in SCHEMAS
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_required_call_comes_whole_and_streamed_alike(server, choice):
    kwargs = dict(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False,
                  temperature=0, max_tokens=80)
    r = server.client.chat.completions.create(**kwargs)
    message, reason = r.choices[0].message, r.choices[0].finish_reason
    print(f"{choice}: {reason}, {message.tool_calls}")
    assert reason == "tool_calls" and message.content is None and len(message.tool_calls) == 1
    arguments = _valid(message.tool_calls[0])
    assert choice == "required" or message.tool_calls[0].function.name == "get_time"

    # streamed: the openai client's deltas put back together give the same call
    names, args, ids, content, reasons = {}, {}, {}, [], []
    for chunk in server.client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
        for tc in delta.tool_calls or []:
            ids[tc.index] = tc.id or ids.get(tc.index)
            names[tc.index] = names.get(tc.index, "") + (tc.function.name or "")
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    assert "".join(content) == "" and reasons[-1] == "tool_calls"
    assert names == {0: message.tool_calls[0].function.name} and json.loads(args[0]) == arguments
    assert ids[0].startswith("call_")


def test_a_two_turn_exchange_feeds_the_call_and_its_result_back(server):
    first = server.client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                                  parallel_tool_calls=False, temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius and sunny"}]
    second = server.client.chat.completions.create(model="m", messages=history, tools=[WEATHER], temperature=0,
                                                   max_tokens=40)
    answer = second.choices[0]
    print(f"turn 2 ({second.usage.prompt_tokens} prompt tokens, {answer.finish_reason}): {answer.message.content!r}")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call and its result are in the prompt
    if answer.finish_reason == "tool_calls":  # another call: the reason says so only with a parsed call behind it
        assert answer.message.tool_calls and all(isinstance(json.loads(c.function.arguments), dict)
                                                 for c in answer.message.tool_calls)
    else:  # an answer in words: text, and no call
        assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
        assert isinstance(answer.message.content, str) and answer.message.content
    # tool_choice "none" renders no tools: the same history answers as plain chat
    plain = server.client.chat.completions.create(model="m", messages=history, tools=[WEATHER], tool_choice="none",
                                                  temperature=0, max_tokens=20)
    assert plain.choices[0].message.tool_calls is None and plain.usage.prompt_tokens < second.usage.prompt_tokens


@pytest.mark.parametrize("extra, says", [
    ({"tool_choice": {"type": "function", "function": {"name": "launch"}}}, "must name one of the tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot go with"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "letters, digits"),
])
def test_bad_tool_fields_are_a_400_naming_them(server, extra, says):
    with pytest.raises(openai.BadRequestError, match=says):
        server.client.chat.completions.create(model="m", messages=ASK, max_tokens=4,
                                              **{"tools": [WEATHER], **extra})
    with pytest.raises(openai.BadRequestError, match="'tools'.*not supported"):  # completions call no tools
        server.client.completions.create(model="m", prompt="Hi", max_tokens=4, extra_body={"tools": [WEATHER]})


@pytest.mark.parametrize("ask", [ASK, [{"role": "user", "content": "Say hello, then look up the time in Tokyo."}]])
def test_auto_streams_the_same_content_and_calls_as_the_whole_answer(server, ask):
    kwargs = dict(model="m", messages=ask, tools=[WEATHER, TIME], temperature=0, max_tokens=60)
    whole = server.client.chat.completions.create(**kwargs).choices[0]
    content, calls, reasons = [], {}, []
    for chunk in server.client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
        for tc in delta.tool_calls or []:
            calls[tc.index] = (tc.function.name, tc.function.arguments)
    print(f"auto: {whole.finish_reason}, content {whole.message.content!r}, calls {whole.message.tool_calls}")
    assert reasons[-1] == whole.finish_reason
    assert "".join(content).strip() == (whole.message.content or "").strip()
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []] == \
        [calls[k] for k in sorted(calls)]
    for call in whole.message.tool_calls or []:
        assert call.function.name in SCHEMAS and isinstance(json.loads(call.function.arguments), dict)


def test_an_agent_library_calls_a_tool_and_answers(server):
    """The OpenAI Agents SDK over the server: its first turn must call the tool (tool_choice required, which the SDK
    resets after a call), the SDK runs the function, feeds the result back, and the model answers in text."""
    agents = need("agents")
    called = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return f"18 degrees celsius and sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = agents.OpenAIChatCompletionsModel(model="m", openai_client=client)
    agent = agents.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=40))
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "What's the weather like in Paris?", max_turns=4)
    print(f"agent: called get_weather{called}, answered {result.final_output!r}")
    assert called and isinstance(result.final_output, str) and result.final_output


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_end_with_parallel_calls_left_unset_as_clients_leave_them(server, choice):
    """Issue 48: a named choice is exactly one call (finish_reason tool_calls); with a small max_tokens that cuts a
    second call, the complete calls before it still come back as tool_calls (finish_reason length)."""
    r = server.client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                              temperature=0, max_tokens=100)
    message, reason = r.choices[0].message, r.choices[0].finish_reason
    print(f"{choice}: {reason}, {len(message.tool_calls or [])} calls, content {message.content!r}")
    assert message.tool_calls, message.content
    for call in message.tool_calls:
        _valid(call)
    if choice != "required":
        assert reason == "tool_calls" and len(message.tool_calls) == 1
    else:
        assert reason in ("tool_calls", "length") and message.content is None


@pytest.mark.parametrize("max_tokens", [12, 22, 26])
def test_a_forced_call_cut_by_max_tokens_is_a_call_not_markup(server, max_tokens):
    """OpenAI's shape for a call max_tokens cuts (issue 64: it came back as '<tool_call>\\n{"name": "get_' in content):
    tool_calls with the arguments produced so far, finish_reason length, no markup as content; streamed alike."""
    weather = {"type": "function", "function": {"name": "get_weather"}}
    done = server.client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=weather,
                                                 max_tokens=max_tokens, temperature=0)
    choice = done.choices[0]
    print(choice.message, choice.finish_reason)
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and "<tool_call>" not in call.function.arguments
    assert '{"city": "Paris", "unit": "celsius"}'.startswith(call.function.arguments.replace(" ", "")
                                                            .replace(",", ", ").replace(":", ": ")), call
    streamed = server.client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME],
                                                     tool_choice=weather, max_tokens=max_tokens, temperature=0,
                                                     stream=True)
    chunks = list(streamed)
    calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert [c.function.arguments for c in calls] == [call.function.arguments] and text == ""
    assert chunks[-1].choices[0].finish_reason == "length"
