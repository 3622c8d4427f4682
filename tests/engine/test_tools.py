"""Tool calling's formats (runtime/engine/tools.py): tools rendered as transformers renders them (its own
`render_jinja_template`, on a Hermes-style and a Llama-3.1-style template written here), the fallback for a template
that knows no tools, calls parsed from both wire formats, and the grammar of a required call producing arguments that
`jsonschema` (independent of the grammar engine) accepts, on the real SmolLM2."""

import json

import pytest
from conftest import need

from llgraph.errors import RequestError
from llgraph.runtime.engine.tools import FALLBACK, ToolSpec, _parse_llama3, chat_inputs, renders_tools, style

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
    "additionalProperties": False}}}

# A ChatML template that renders tools the way Hermes 2 Pro / Qwen 2.5 do (written for this test)
HERMES = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}{%- for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}<|im_start|>{{ m.role }}
{% if m.content %}{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# Llama 3.1's shape: tools in the first user turn, answers as JSON after <|python_tag|> (written for this test)
LLAMA3 = """{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{% if loop.first and tools %}Given the following functions, respond with a JSON for a function call.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}{% if m.tool_calls %}<|python_tag|>{{ {"name": m.tool_calls[0].function.name,
"parameters": m.tool_calls[0].function.arguments} | tojson }}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


class _Tokenizer:
    """The renderer llgraph's tokenizer uses, on a template of the test's."""

    def __init__(self, template):
        from llgraph.tokenizer import Tokenizer

        self.template = template
        self.tk = Tokenizer(None, template, bos_token="<s>", eos_token="</s>")

    def render(self, messages, tools):
        return self.tk.apply_chat_template(messages, tools=tools)


@pytest.mark.parametrize("template", [HERMES, LLAMA3], ids=["hermes", "llama3"])
def test_tools_render_as_transformers_renders_them(template):
    transformers = need("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    spec = ToolSpec.of([WEATHER, TIME])
    messages, tools = chat_inputs(template, CONVERSATION, spec)
    ours = _Tokenizer(template).render(messages, tools)
    # transformers, given the conversation with the calls' arguments as objects (its documented form)
    theirs_messages = [dict(m) for m in CONVERSATION]
    theirs_messages[2] = {**theirs_messages[2], "content": "", "tool_calls": [{**theirs_messages[2]["tool_calls"][0],
                          "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}
    rendered, _ = render_jinja_template([theirs_messages], tools=[WEATHER, TIME], chat_template=template,
                                        add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    print(f"transformers {transformers.__version__}: {len(ours)} characters each, equal: {ours == rendered[0]}")
    assert ours == rendered[0]
    assert "get_time" in ours and "18 C, sunny" in ours and renders_tools(template)


def test_a_template_without_tools_gets_the_fallback_in_its_system_message():
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert not renders_tools(template)
    messages, tools = chat_inputs(template, CONVERSATION, ToolSpec.of([WEATHER]))
    assert tools is None
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\n")
    assert FALLBACK.split("<tools>")[0] in messages[0]["content"] and '"get_weather"' in messages[0]["content"]
    call = json.loads(messages[2]["content"].split("<tool_call>\n")[1].split("\n</tool_call>")[0])
    assert call == {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    assert messages[3] == {"role": "tool", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    # not ChatML: the result comes back as a user turn, which every template takes
    messages, _ = chat_inputs("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}", CONVERSATION,
                              ToolSpec.of([WEATHER]))
    assert messages[3]["role"] == "user"


def test_calls_parse_from_both_formats():
    spec = ToolSpec.of([WEATHER, TIME])
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls = spec.parse(text, HERMES)
    assert content == "Let me check.\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2
    assert style(LLAMA3) == "llama3" and style(HERMES) == "hermes"
    content, calls = spec.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                                '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}', LLAMA3)
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    # text that is no valid call of a known function stays content, whole
    for bad in ['<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
                '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', "Just text."]:
        assert spec.parse(bad, HERMES) == (bad, [])
    assert ToolSpec.of([WEATHER, TIME], parallel_tool_calls=False).parse(text, HERMES)[1][0].name == "get_weather"
    assert len(ToolSpec.of([WEATHER, TIME], parallel_tool_calls=False).parse(text, HERMES)[1]) == 1


def test_streaming_holds_back_only_what_may_be_a_call():
    spec = ToolSpec.of([WEATHER])
    assert spec.held("Sure, one moment", HERMES) == len("Sure, one moment")
    assert spec.held("Sure <tool", HERMES) == len("Sure ")
    assert spec.held("Sure <tool_call>\n{", HERMES) == len("Sure ")
    assert spec.held("Paris is <b>", HERMES) == len("Paris is <b>")
    assert spec.held(' {"name"', LLAMA3) == 0 and spec.held("Hello", LLAMA3) == 5
    assert ToolSpec.of([WEATHER], "required").held("anything", HERMES) == 0


@pytest.mark.parametrize("fields, says", [
    ({"tools": {"type": "function"}}, "must be a list"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "letters, digits"),
    ({"tools": [WEATHER, WEATHER]}, "twice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "'tool_choice' must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "get_weather"),
    ({"tool_choice": "required"}, "no 'tools'"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "schema"),
])
def test_bad_tool_fields_are_one_line_naming_the_field(fields, says):
    need("llguidance")
    with pytest.raises(RequestError, match=says):
        ToolSpec.of(fields.get("tools"), fields.get("tool_choice"), fields.get("parallel_tool_calls"))
    assert ToolSpec.of([WEATHER], "none") is None and ToolSpec.of(None) is None


@pytest.fixture(scope="module")
def runner(serve_export):
    from llgraph.runtime import ORTRunner

    return ORTRunner(serve_export, max_seq_len=512)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_required_call_is_valid_by_construction_on_smollm2(runner, choice):
    jsonschema = need("jsonschema")
    need("llguidance")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    ask = [{"role": "user", "content": "What's the weather like in Paris, in celsius?"}]
    template = runner.tokenizer.chat_template
    one = ToolSpec.of([WEATHER, TIME], choice, parallel_tool_calls=False)
    prompt = runner.render_chat(ask, tools=one)
    assert "<tools>" in prompt  # SmolLM2's template knows no tools: the fallback
    for seed in range(4):  # sampled: whatever the model prefers, the grammar leaves only valid calls
        out = runner.generate(prompt, 96, temperature=1.0, seed=seed, grammar=one.grammar(template, runner.tokenizer))
        content, calls = one.parse(out.text, template)
        print(f"seed {seed}: {out.text!r}")
        assert out.finish_reason == "eos" and content is None and len(calls) == 1, out.text  # one call, then EOS
        assert choice == "required" or calls[0].name == "get_time"
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
    # parallel calls allowed: every call block the model writes is one of the functions with valid arguments
    many = ToolSpec.of([WEATHER, TIME], choice)
    out = runner.generate(prompt, 120, temperature=1.0, seed=0, grammar=many.grammar(template, runner.tokenizer))
    blocks = [b.split("</tool_call>")[0] for b in out.text.split("<tool_call>")[1:] if "</tool_call>" in b]
    print(f"parallel: {len(blocks)} complete calls, {out.finish_reason}")
    assert blocks and out.text.startswith("<tool_call>")
    for block in blocks:
        call = json.loads(block)
        assert set(call) == {"name", "arguments"} and (choice == "required" or call["name"] == "get_time")
        jsonschema.validate(call["arguments"], schemas[call["name"]])


PYDANTIC = {"type": "object", "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}},
                                                 "required": ["name"]}},
            "properties": {"city": {"$ref": "#/$defs/City"}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}
ODD = {"type": "object", "properties": {"a": {"not": {"type": "string"}},
                                        "b": {"type": "array", "uniqueItems": True, "contains": {"type": "integer"}}},
       "if": {"required": ["a"]}, "then": {"required": ["b"]}, "dependentRequired": {"a": ["b"]}}


def test_schemas_with_defs_work_in_every_mode_and_any_valid_schema_under_auto(runner):
    """Pydantic's $defs/$ref resolve under required and a named choice (the pointers re-rooted where the call
    grammar puts the schema), and the forced call's arguments validate; under auto, a schema with keywords no grammar
    engine constrains (not, if/then, uniqueItems, contains, dependentRequired) is accepted."""
    jsonschema = need("jsonschema")
    need("llguidance")
    city = {"type": "function", "function": {"name": "weather", "parameters": PYDANTIC}}
    template = runner.tokenizer.chat_template
    for choice in ("auto", "required", {"type": "function", "function": {"name": "weather"}}):
        spec = ToolSpec.of([city], choice)
        if spec.forced:
            prompt = runner.render_chat([{"role": "user", "content": "Weather in Paris?"}], tools=spec)
            out = runner.generate(prompt, 80, grammar=spec.grammar(template, runner.tokenizer))
            _, calls = spec.parse(out.text, template)
            print(f"{choice}: {out.text!r}")
            assert calls and out.finish_reason == "eos" and (choice == "required" or len(calls) == 1)
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), PYDANTIC)
    assert ToolSpec.of([{"type": "function", "function": {"name": "odd", "parameters": ODD}}]).choice == "auto"


def test_a_named_choice_is_one_call_and_a_cut_call_keeps_the_complete_ones():
    named = ToolSpec.of([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.parallel and not named.many  # parallel_tool_calls left unset, as clients leave it: still one call
    assert ToolSpec.of([WEATHER, TIME], "required").many
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    cut = one + '\n<tool_call>\n{"name": "get_weather", "argum'
    spec = ToolSpec.of([WEATHER, TIME])
    content, calls = spec.parse(cut, "")
    paris = {"city": "Paris", "unit": "celsius"}
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", paris)]
    twice = one + "\n" + one + "\n" + one.replace("Paris", "Lyon")  # the same call again, then another
    assert [json.loads(c.arguments)["city"] for c in spec.parse(twice, "")[1]] == ["Paris", "Lyon"]
    llama = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; {"name": "get_ti'
    assert [name for name, _, _ in _parse_llama3(llama)] == ["get_weather"]
