"""Structured output (runtime/engine/grammar.py): outputs under a JSON schema parse and validate (checked by
`jsonschema`, independent of the grammar engine) greedy and sampled, on the plain loop and the scheduler; greedy
output under a schema equals the unconstrained model's wherever that already complied; bad schemas are one line."""

import json

import pytest
from conftest import need

need("llguidance")
jsonschema = need("jsonschema")

from llgraph.errors import RequestError  # noqa: E402
from llgraph.runtime.engine.grammar import Grammar  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                                           "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Give me a JSON object describing a person with name, age and city."}]


@pytest.fixture(scope="module")
def runner(serve_export):
    from llgraph.runtime import ORTRunner

    return ORTRunner(serve_export, max_seq_len=256)


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_sampled_outputs_validate_for_20_seeds_in_a_batch(runner):
    grammar = Grammar.json_schema(PERSON)
    outs = runner.generate([ASK] * 20, 120, temperature=1.0, seed=0, grammar=grammar)  # row r: seed r
    bad = [(o.text, o.finish_reason) for o in outs if not _valid(o.text, PERSON)]
    print(f"{20 - len(bad)}/20 sampled documents valid; e.g. {outs[0].text!r}")
    assert not bad and all(o.finish_reason == "eos" for o in outs)
    assert len({o.text for o in outs}) > 10  # really sampled
    assert outs[7].text == runner.generate(ASK, 120, temperature=1.0, seed=7, grammar=grammar).text  # as alone
    # a batch of mixed-length prompts, each row under its own matcher, equal to each alone; a document cut by
    # max_new_tokens ends "length" (as in OpenAI's JSON mode: the cat's nests deeper than 120 tokens)
    asks = [ASK, [{"role": "user", "content": "Describe a cat as a JSON object."}],
            [{"role": "system", "content": "You answer in JSON."}, {"role": "user", "content": "List three fruits."}]]
    batch = runner.generate(asks, 120, grammar=Grammar.json_object())
    print([o.text for o in batch])
    assert [o.finish_reason for o in batch] == ["eos", "length", "eos"]
    assert all(isinstance(json.loads(o.text), dict) for o in batch[::2])
    assert [o.text for o in batch] == [runner.generate(a, 120, grammar=Grammar.json_object()).text for a in asks]


def test_greedy_under_a_schema_equals_the_unconstrained_model_where_it_complied(runner):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}}, "required": ["name", "age", "city"]}
    prompt = [{"role": "user", "content": 'Output {"name": ..., "age": ..., "city": ...} for Albert Einstein as '
                                          "raw JSON, nothing else."}]
    grammar = Grammar.json_schema(schema)
    free, constrained = runner.generate(prompt, 40), runner.generate(prompt, 40, grammar=grammar)
    matcher, complied = grammar.matcher(runner.tokenizer, runner.backend.vocab_size, runner.eos_token_ids), 0
    for token in free.token_ids:  # the unconstrained tokens the grammar would have allowed
        if not matcher.allowed(runner.backend.vocab_size)[token]:
            break
        matcher.advance(token)
        complied += 1
    print(f"the unconstrained model complied for {complied} tokens: {free.text!r}; constrained: {constrained.text!r}")
    # it complies through the three keys, then adds a fourth ("country"), which the schema, silent on others, does
    # not allow (grammar.strict): the constrained answer closes the object there
    assert complied >= 15 and constrained.token_ids[:complied] == free.token_ids[:complied]
    assert set(json.loads(constrained.text)) == {"name", "age", "city"}

    fenced = runner.generate(ASK, 60)  # the model opens with a markdown fence, which the grammar forbids
    assert fenced.text.startswith("```") and _valid(runner.generate(ASK, 60, grammar=Grammar.json_schema(PERSON))
                                                    .text, PERSON)


def test_the_scheduler_and_the_torch_backend_follow_the_grammar_too(runner):
    from llgraph.runtime import TorchRunner
    from llgraph.runtime.engine.sampling import Sampling
    from llgraph.runtime.engine.scheduler import Scheduler

    grammar = Grammar.json_schema(PERSON)
    solo = [runner.generate(ASK, 80, temperature=0.7, seed=s, grammar=grammar).text for s in range(4)]
    scheduler = Scheduler(runner, slots=4).start()
    try:
        handles = [scheduler.submit(ASK, 80, Sampling(temperature=0.7, seed=s), grammar=grammar) for s in range(4)]
        served = [h.result(timeout=120).text() for h in handles]
    finally:
        scheduler.stop()
    assert served == solo and all(_valid(t, PERSON) for t in served)
    torch_out = TorchRunner("smollm2", max_seq_len=256).generate(ASK, 80, grammar=grammar)
    assert _valid(torch_out.text, PERSON), torch_out.text


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "not valid"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "("}}},
     "not valid"),
    ({"type": "yaml"}, "not one of text, json_object, json_schema"),
])
def test_bad_schemas_are_one_line(response_format, message):
    with pytest.raises(RequestError, match=message) as e:
        Grammar.from_response_format(response_format)
    print(e.value)
    assert "\n" not in str(e.value)


def test_text_is_no_grammar():
    assert Grammar.from_response_format({"type": "text"}) is None and Grammar.from_response_format(None) is None


def test_a_schema_silent_on_other_keys_takes_none():
    """The schemas Pydantic and LangChain write leave additionalProperties out: read as false (xgrammar's and vLLM's
    default), after the listed keys the object can only close; a schema that allows others keeps them, and one
    without properties is any object."""
    from llgraph.runtime.engine.grammar import strict

    pydantic = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/B"}},
                "required": ["a"], "$defs": {"B": {"type": "object", "properties": {"c": {"type": "string"}}}}}
    tight = strict(pydantic)
    assert tight["additionalProperties"] is False and tight["$defs"]["B"]["additionalProperties"] is False
    assert "additionalProperties" not in pydantic  # a copy: the request's schema is left as sent
    assert strict({**pydantic, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in strict({"type": "object"})
    import llguidance
    from jsonschema import validate

    for schema, text, ok in ((pydantic, '{"a": 1, "b": {"c": "x"}}', True), (pydantic, '{"a": 1, "z": 2}', False),
                             (pydantic, '{"a": 1, "b": {"c": "x", "d": 1}}', False),
                             ({**pydantic, "additionalProperties": True}, '{"a": 1, "z": 2}', True)):
        if ok:  # an independent checker agrees the accepted documents are valid
            validate(json.loads(text), strict(schema))
        m = llguidance.LLMatcher(llguidance.LLTokenizer(_byte_tokenizer()), Grammar.json_schema(schema).spec,
                                 log_level=0)
        accepted = m.try_consume_tokens(list(text.encode())) == len(text.encode())
        assert accepted == ok, (schema, text)


def _byte_tokenizer():
    """A 256-token vocabulary of single bytes (and an EOS), for matching text byte by byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from llgraph.tokenizer import _byte_level_alphabet

    alphabet = {b: c for c, b in _byte_level_alphabet().items()}
    tk = Tokenizer(models.BPE({alphabet[b]: b for b in range(256)} | {"<eos>": 256}, []))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return tk.to_str()
