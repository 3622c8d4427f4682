"""Structured output: a JSON schema (or any JSON object) enforced by constrained decoding, as a token mask in the
shared sampling step, so the plain loop, the scheduler and every backend have it, greedy and sampled.

    runner.generate(prompt, 64, grammar=Grammar.json_schema({"type": "object", ...}))
    Grammar.from_response_format({"type": "json_schema", "json_schema": {"schema": {...}}})   # OpenAI's field

The grammar engine is llguidance (Microsoft's, on PyPI, no dependencies; `pip install llguidance`). Chosen by
measurement over xgrammar on SmolLM2's 49k vocabulary and a nested schema, 2 cores: llguidance's mask took 58 us a
token on average, xgrammar's 8 us; both are ~1% or less of a 6 ms CPU decode step, and xgrammar needs torch,
transformers and triton where llguidance needs nothing (the CPU path is meant to install lean).

A row's matcher sees every token the row samples; the mask allows what keeps the output a prefix of a valid
document, and the model's EOS tokens once the document is complete (only them once nothing else can follow).
Whitespace between JSON tokens is allowed, at most 16 characters at a time, so a sampled row cannot spend its
tokens on blank space.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from llgraph.errors import LlgraphError, RequestError

_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,16}"}


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def strict(schema):
    """`schema` with `"additionalProperties": false` in every object schema that lists properties and says nothing
    of others (xgrammar's and vLLM's default reading: the schemas Pydantic and LangChain write leave it out, and a
    model given the freedom keeps adding keys). A copy; a schema that says otherwise keeps what it says."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict(v) for k, v in out[key].items()}
    for key in (*_SUBSCHEMA_LISTS, *_SUBSCHEMAS):
        if key in out:
            out[key] = strict(out[key])
    if "properties" in out and not any(k in out for k in ("additionalProperties", "patternProperties",
                                                           "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise LlgraphError("structured output needs llguidance: pip install llguidance") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A compiled-on-demand grammar (llguidance's JSON form). Build one with json_schema(), json_object() or
    from_response_format(); a bad schema is a RequestError naming the problem."""
    spec: str

    @classmethod
    def json_schema(cls, schema: dict | str) -> Grammar:
        """A schema's grammar, strict where the schema is silent (`strict`): an object with properties takes no
        others unless it says `additionalProperties`."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise RequestError(f"the JSON schema is not valid JSON: {e}") from None
        text = json.dumps(strict(schema))
        return cls._built(lambda ll: ll.LLMatcher.grammar_from_json_schema(text, defaults=_OPTIONS),
                          "the JSON schema is not valid", " (or not supported)")

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """A grammar in llguidance's Lark dialect (`%json {schema}` embeds a JSON schema; `<[id]>` is a token)."""
        return cls._built(lambda ll: ll.LLMatcher.grammar_from_lark(text), "the grammar is not valid")

    @classmethod
    def gbnf(cls, text: str) -> Grammar:
        """A grammar in llama.cpp's GBNF (its `grammar` field, grammars/*.gbnf), read by llguidance."""
        return cls._built(lambda ll: ll.grammar_from("gbnf", text), "the GBNF grammar is not valid")

    @classmethod
    def _built(cls, make, bad: str, unsupported: str = "") -> Grammar:
        """llguidance's grammar made by `make(llguidance)` and validated; either failure a RequestError `bad: why`."""
        ll = _llguidance()
        try:
            spec = make(ll)
        except (ValueError, TypeError, RuntimeError) as e:
            raise RequestError(f"{bad}: {str(e).splitlines()[0][:200]}") from None
        error = ll.LLMatcher.validate_grammar(spec)
        if error:
            raise RequestError(f"{bad}{unsupported}: {' '.join(error.split())[:200]}")
        return cls(spec)

    @classmethod
    def json_object(cls) -> Grammar:
        return cls.json_schema({"type": "object"})

    @classmethod
    def from_response_format(cls, response_format) -> Grammar | None:
        """OpenAI's `response_format`: {"type": "text"} (None: unconstrained), {"type": "json_object"}, or
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
        if response_format is None:
            return None
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":  # llama.cpp's extension: a "schema" beside it constrains the object
            schema = response_format.get("schema")
            if schema is not None and not isinstance(schema, (dict, bool)):
                raise RequestError("response_format json_object's \"schema\" must be a JSON schema object")
            return cls.json_object() if schema is None else cls.json_schema(json.dumps(schema))
        if kind == "json_schema":
            inner = response_format.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise RequestError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                   "{...}}}")
            return cls.json_schema(json.dumps(schema))
        raise RequestError(f"response_format type {kind!r} is not one of text, json_object, json_schema")

    def matcher(self, tokenizer, vocab_size: int, eos: set[int]) -> Matcher:
        return Matcher(self, _ll_tokenizer(tokenizer, vocab_size, tuple(sorted(eos))))


_TOKENIZERS: dict = {}  # (id(tokenizer), vocab, eos) -> (tokenizer, LLTokenizer): building one takes ~0.4 s


def warm(tokenizer, vocab_size: int, eos) -> None:
    """Builds llguidance's view of the vocabulary now, where it is installed and the model has a tokenizer and an
    EOS: the build holds the GIL ~0.2 s, which a server's first structured-output request would otherwise cost its
    event loop (/health waited 0.21 s); `llgraph serve` calls it before it listens."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return
    if tokenizer is not None and eos:
        Grammar.json_object().matcher(tokenizer, vocab_size, set(eos))  # the view, and a matcher's first build


def _ll_tokenizer(tokenizer, vocab_size: int, eos: tuple[int, ...]):
    if tokenizer is None:
        raise RequestError("structured output needs the model's tokenizer; this runner has none")
    if not eos:
        raise RequestError("structured output needs the model's EOS token to end a document; this one has none")
    key = (id(tokenizer), vocab_size, eos)
    if key not in _TOKENIZERS or _TOKENIZERS[key][0] is not tokenizer:
        ll = _llguidance()
        _TOKENIZERS[key] = (tokenizer, ll.LLTokenizer(tokenizer.tk.to_str(), n_vocab=vocab_size, eos_token=list(eos)))
    return _TOKENIZERS[key][1]


class Matcher:
    """One row's grammar state: allowed() before it samples, advance(token) after."""

    def __init__(self, grammar: Grammar, ll_tokenizer):
        ll = _llguidance()
        self._m = ll.LLMatcher(ll_tokenizer, grammar.spec, log_level=0)
        self._words = (ll_tokenizer.vocab_size + 31) // 32
        self._bits = np.zeros(self._words, np.int32)
        self._check()
        # the first mask, computed now: a grammar that admits no document (a schema whose only branch refers to
        # itself, `{"$ref": "#"}`) is the request's error when it is submitted, not the model's at its first token
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._m.is_error():
            raise RequestError(f"the grammar admits no output (e.g. a schema that only refers to itself): "
                               f"{self._m.get_error().splitlines()[0][:120]}")
        self._probe(eos=set(getattr(ll_tokenizer, "eos_tokens", ()) or ()))

    def _probe(self, eos: set[int], steps: int = 2) -> None:
        """The grammar's first tokens taken on a copy, so a grammar past the engine's limits (more than 2,000
        alternatives in a rule, a repeat of tens of thousands) is the request's error when it is submitted — a 400 —
        rather than a failure at its first token."""
        probe, bits = self._m.deep_copy(), np.array(self._bits)
        for _ in range(steps):
            tokens = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
            allowed = [int(t) for t in tokens[:64] if int(t) not in eos]
            if not allowed:
                return
            probe.consume_token(allowed[0])
            if not probe.is_error():
                probe.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            if probe.is_error():
                raise RequestError("the grammar is beyond the grammar engine's limits (at most 2,000 alternatives "
                                   "in a rule; no repeat of tens of thousands): "
                                   f"{probe.get_error().splitlines()[0][:160]}")

    def allowed(self, vocab_size: int) -> np.ndarray:
        """[vocab_size] bool: the tokens that keep the output valid."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:vocab_size]
        return bits.view(np.bool_)  # unpackbits gives 0/1 bytes: a bool view, no copy

    def advance(self, token: int) -> None:
        self._m.consume_token(token)
        self._check()

    def _check(self) -> None:
        if self._m.is_error():
            raise RequestError(f"structured output failed: {self._m.get_error()[:200]}")


def row_masks(matchers: list, vocab_size: int) -> np.ndarray | None:
    """[B, V] bool for a batch's rows (a row without a matcher allows everything); None when no row has one."""
    if not any(matchers):
        return None
    return np.stack([m.allowed(vocab_size) if m is not None else np.ones(vocab_size, np.bool_) for m in matchers])
