"""gpt-oss's harmony answers (runtime/engine/harmony.py): split by channel into reasoning, content and tool calls,
as llama-server and vLLM return them; a stream's pieces only grow; the marks are text on decode (as llama.cpp
renders them) and the turn ends at <|return|>/<|call|>, not at the <|end|> that closes the analysis."""

import pytest
from gguf_vocab import HARMONY_MARKS, harmony

from llgraph.gguf_config import end_of_generation
from llgraph.gguf_source import gguf_reader
from llgraph.runtime.engine import harmony as hm
from llgraph.tokenizer import Tokenizer

ANSWER = ("<|channel|>analysis<|message|>The user asks 2+2. Simple.<|end|><|start|>assistant<|channel|>final"
          "<|message|>2 + 2 = 4.")
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}")


def test_channels_split_into_reasoning_content_and_calls():
    a = hm.parse(ANSWER)
    assert (a.reasoning, a.content, a.calls) == ("The user asks 2+2. Simple.", "2 + 2 = 4.", [])
    c = hm.parse(CALL)
    assert (c.reasoning, c.content, c.calls) == ("Need the weather.", "", [("get_weather", '{"city": "Paris"}')])
    # the recipient in the header before the channel, as gpt-oss also writes it; a preamble to the user is content
    before = hm.parse("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.f"
                      "<|channel|>commentary json<|message|>{}")
    assert (before.content, before.calls) == ("Checking.", [("f", "{}")])
    assert hm.parse("plain words").content == "plain words"  # no marks: all content


@pytest.mark.parametrize("text", [ANSWER, CALL])
def test_a_stream_only_grows(text):
    """Every prefix (a half-written mark included) gives reasoning and content that extend the previous ones, and
    the last equals the whole answer's."""
    shown = ("", "")
    for end in range(len(text) + 1):
        now = hm.visible(text[:end])
        assert all(n.startswith(s) for n, s in zip(now, shown)), (text[:end], shown, now)
        assert "<|" not in now[0] + now[1], now
        shown = now
    whole = hm.parse(text)
    assert shown == (whole.reasoning, whole.content)


def test_harmony_marks_are_text_and_the_turn_ends_at_return(tmp_path):
    path = harmony(tmp_path / "h.gguf")
    tok = Tokenizer.load(path)
    ids = tok.encode(ANSWER, add_special_tokens=False)
    assert all(tok.token_id(m) in ids for m in ("<|channel|>", "<|message|>", "<|start|>", "<|end|>"))
    text = tok.decode(ids + [tok.token_id("<|return|>")])  # marks rendered, <|end|> too, as llama.cpp's detokenize
    assert text == ANSWER
    bare = hm.parse(ANSWER.replace("<|end|>", ""))  # a text without <|end|> (a template's) parses the same
    assert (bare.reasoning, bare.content) == (hm.parse(ANSWER).reasoning, hm.parse(ANSWER).content)
    stops = set(end_of_generation(gguf_reader(path)))
    assert {tok.token_id("<|return|>"), tok.token_id("<|call|>")} <= stops
    assert tok.token_id("<|end|>") not in stops, "the turn would end after its analysis"
    assert hm.speaks(tok.chat_template) and set(HARMONY_MARKS) >= {"<|channel|>"}


def _choices(tools=None, pieces=8):
    """The chat completion's Choice over the events of an answer arriving `pieces` characters at a time, and those
    events: what the serving side takes from the engine (runtime/serve/completions.py)."""
    from types import SimpleNamespace

    from gguf_vocab import HARMONY_TEMPLATE

    from llgraph.runtime.serve.completions import Choice

    def events(text):
        done = SimpleNamespace(finish_reason="eos", steps=1, stop_string=lambda: None)
        out = [SimpleNamespace(kind="token", text=text[i:i + pieces], token=1, logprob=None, decoding=done)
               for i in range(0, len(text), pieces)]
        return out + [SimpleNamespace(kind="done", text="", token=None, logprob=None, decoding=done)], done

    def choice(text):
        evs, done = events(text)
        ask = SimpleNamespace(chat=True, logprobs=None, echo=False, tools=tools, template=HARMONY_TEMPLATE, n=1,
                              usage=False, prompts=["x"])
        handle = SimpleNamespace(decoding=done, prompt_tokens=1, cached=0, cancel=lambda: None)
        return Choice(0, handle, ask, None), evs, handle, ask
    return choice


def test_a_chat_answer_comes_back_by_channel():
    """Whole: reasoning_content and content; with tools, the commentary call as tool_calls (finish tool_calls)."""
    from llgraph.runtime.engine.tools import ToolSpec

    c, evs, _, _ = _choices()(ANSWER.replace("<|end|>", ""))
    for e in evs:
        c.take(e)
    message = c.whole()["message"]
    assert (message["reasoning_content"], message["content"]) == ("The user asks 2+2. Simple.", "2 + 2 = 4.")
    spec = ToolSpec.of([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
    c, evs, _, _ = _choices(spec)(CALL.replace("<|end|>", ""))
    for e in evs:
        c.take(e)
    whole = c.whole()
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in whole["message"]["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("pieces", [1, 5, 64])
def test_a_streamed_chat_answer_sends_each_channel_s_deltas(pieces):
    """The SSE stream, pieces of any size: reasoning_content deltas then content deltas, each channel's whole text
    once, no mark in either."""
    import asyncio
    import json

    from llgraph.runtime.serve.completions import Chunks, _chunks

    c, evs, handle, ask = _choices(pieces=pieces)(ANSWER.replace("<|end|>", ""))
    ask.stream = True

    async def rest():
        for e in evs[1:]:
            yield 0, e

    async def run():
        sent = Chunks(_chunks((0, evs[0]), rest(), [c], [handle], {"id": "x"}, ask))  # as the wire carries it
        return [chunk async for chunk in sent.body_iterator]
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for chunk in asyncio.run(run())
              for line in chunk.splitlines() if line.startswith("data: {")]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == ("The user asks 2+2. Simple.", "2 + 2 = 4.")


def test_a_required_tool_choice_is_refused_in_one_line(tmp_path):
    """Constrained calls are not built for harmony yet: a 400 naming tool_choice, not a grammar of another format."""
    from gguf_vocab import with_weights

    from llgraph.runtime import open_runner
    from llgraph.runtime.serve.ask import parse
    from llgraph.runtime.serve.request import ApiError

    runner = open_runner(str(with_weights(tmp_path / "m.gguf", harmony(tmp_path / "v.gguf"))), "torch",
                         max_seq_len=64)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"}
    with pytest.raises(ApiError, match="harmony") as e:
        parse(body, True, runner, 4, 16)
    assert e.value.param == "tool_choice"
    assert parse({**body, "tool_choice": "auto"}, True, runner, 4, 16).tools.choice == "auto"


def test_llgraph_chat_shows_and_keeps_the_final_channel():
    """The CLI's conversation on a harmony model: the reply streamed is the final channel's text, and the turn kept
    for the next prompt is that answer (as the template expects an assistant's earlier turn)."""
    from types import SimpleNamespace

    from gguf_vocab import HARMONY_TEMPLATE

    from llgraph.runtime.engine.chat import Conversation

    text = ANSWER.replace("<|end|>", "")
    runner = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=HARMONY_TEMPLATE),
                             backend=SimpleNamespace(max_seq_len=4096), encode=lambda messages: [0],
                             stream=lambda messages, n, **kw: iter(text[i:i + 3] for i in range(0, len(text), 3)))
    chat = Conversation(runner)
    assert "".join(chat.say("2+2?")) == "2 + 2 = 4."
    assert chat.turns[-1] == {"role": "assistant", "content": "2 + 2 = 4."}


def test_anthropic_s_api_gets_the_reasoning_as_a_thinking_block():
    """The Messages API (runtime/serve/messages.py) over a harmony answer: a thinking block before the text, whole
    (valid as the anthropic SDK's Message) and streamed (thinking_delta, then text_delta, each block opened and
    closed once, every event valid as the SDK's RawMessageStreamEvent)."""
    import asyncio
    import json

    import anthropic
    from pydantic import TypeAdapter

    from llgraph.runtime.serve.messages import events, message_of

    chat = {"choices": [{"index": 0, "finish_reason": "stop", "stop_reason": None,
                         "message": {"role": "assistant", "content": "2 + 2 = 4.",
                                     "reasoning_content": "The user asks 2+2. Simple."}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 9}}
    whole = anthropic.types.Message.model_validate(message_of(chat, "msg_1", "m"))
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in whole.content] == [
        ("thinking", "The user asks 2+2. Simple."), ("text", "2 + 2 = 4.")]

    deltas = [{"reasoning_content": "The user asks "}, {"reasoning_content": "2+2. Simple."}, {"content": "2 + 2"},
              {"content": " = 4."}]

    async def chunks():
        for d in deltas:
            yield {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}
        yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": None}],
               "usage": {"prompt_tokens": 5, "completion_tokens": 9}}

    async def run():
        return [e async for e in events(chunks(), "msg_1", "m")]
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    blocks, open_ = [], set()
    for sse in asyncio.run(run()):
        event = adapter.validate_python(json.loads(sse.split("data: ", 1)[1]))
        if event.type == "content_block_start":
            assert event.index == len(blocks) and not open_
            blocks.append([event.content_block.type, ""])
            open_.add(event.index)
        elif event.type == "content_block_delta":
            assert event.index in open_
            blocks[event.index][1] += getattr(event.delta, "thinking", None) or getattr(event.delta, "text", "")
        elif event.type == "content_block_stop":
            open_.remove(event.index)
    assert blocks == [["thinking", "The user asks 2+2. Simple."], ["text", "2 + 2 = 4."]] and not open_


def test_the_responses_api_gets_the_reasoning_as_a_reasoning_item():
    """The Responses API (runtime/serve/responses.py) over a harmony answer: a reasoning item (reasoning_text) before
    the message, whole (valid as the openai SDK's Response) and streamed (reasoning_text deltas at output 0, the
    text's at output 1, every event valid as the SDK's ResponseStreamEvent, the completed response the same)."""
    import asyncio
    import json

    import openai.types.responses as R
    from pydantic import TypeAdapter

    from llgraph.runtime.serve.responses import events, response_of

    usage = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
    chat = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "2 + 2 = 4.", "reasoning_content": "The user asks 2+2. Simple."}}],
        "usage": usage}
    whole = R.Response.model_validate(response_of(chat, {}, "resp_1", "m"))
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "The user asks 2+2. Simple." and whole.output_text == "2 + 2 = 4."

    deltas = [{"reasoning_content": "The user asks "}, {"reasoning_content": "2+2. Simple."}, {"content": "2 + 2"},
              {"content": " = 4."}]

    async def chunks():
        for d in deltas:
            yield {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}
        yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}

    async def run():
        return [e async for e in events(chunks(), {}, "resp_1", "m")]
    adapter = TypeAdapter(R.ResponseStreamEvent)
    got: dict[int, str] = {}
    for sse in asyncio.run(run()):
        event = adapter.validate_python(json.loads(sse.split("data: ", 1)[1]))
        if event.type in ("response.reasoning_text.delta", "response.output_text.delta"):
            got[event.output_index] = got.get(event.output_index, "") + event.delta
        if event.type == "response.completed":
            done = event.response
    assert got == {0: "The user asks 2+2. Simple.", 1: "2 + 2 = 4."}
    assert [i.type for i in done.output] == ["reasoning", "message"] and done.output_text == "2 + 2 = 4."


def test_reasoning_effort_reaches_a_template_that_reads_it(tmp_path):
    """OpenAI's `reasoning_effort` is gpt-oss's system line (its template's `reasoning_effort`): rendered where the
    template reads it, a 400 naming the field where it does not (it would change nothing) or for a bad value."""
    from gguf_vocab import HARMONY_TEMPLATE, with_weights

    from llgraph.runtime import open_runner
    from llgraph.runtime.serve.request import ApiError, chat_prompt

    runner = open_runner(str(with_weights(tmp_path / "m.gguf", harmony(tmp_path / "v.gguf"))), "torch",
                         max_seq_len=64)
    body = {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"}
    with pytest.raises(ApiError, match="reasoning_effort") as e:
        chat_prompt(body, runner)
    assert e.value.param == "reasoning_effort"
    runner.tokenizer.chat_template = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}"
                                      "<|end|>" + HARMONY_TEMPLATE)
    assert "Reasoning: high<|end|>" in chat_prompt(body, runner)
    assert "Reasoning: medium<|end|>" in chat_prompt({**body, "reasoning_effort": None}, runner)
    with pytest.raises(ApiError, match="low, medium or high"):
        chat_prompt({**body, "reasoning_effort": "max"}, runner)


def test_the_responses_api_s_reasoning_effort_is_chat_s_reasoning_effort():
    """`reasoning.effort` reaches the chat request as reasoning_effort (a chat template that reads it, gpt-oss's,
    gets it; elsewhere it is chat's 400), `summary` is accepted (the reasoning comes whole as reasoning_text, never
    summarized), any other key a 400 naming 'reasoning'; the response says the effort, valid as the SDK's."""
    import openai.types.responses as R

    from llgraph.runtime.serve.request import ApiError
    from llgraph.runtime.serve.responses import chat_body, response_of

    chat, _ = chat_body({"input": "hi", "reasoning": {"effort": "low", "summary": "auto"}})
    assert chat["reasoning_effort"] == "low"
    assert "reasoning_effort" not in chat_body({"input": "hi", "reasoning": {"summary": "auto"}})[0]
    with pytest.raises(ApiError, match="reasoning") as e:
        chat_body({"input": "hi", "reasoning": {"budget_tokens": 300}})
    assert e.value.param == "reasoning" and e.value.status == 400
    answered = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "4"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
    whole = R.Response.model_validate(response_of(answered, {"reasoning": {"effort": "low"}}, "resp_1", "m"))
    assert whole.reasoning.effort == "low" and whole.reasoning.summary is None
