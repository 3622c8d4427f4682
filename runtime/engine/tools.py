"""Tool calling (OpenAI's `tools`): the functions rendered into the prompt, the model's calls parsed out of its text,
and, for a `required` or named choice, a grammar that makes the call valid by construction (the function's name, and
arguments that validate against its parameter schema).

    spec = ToolSpec.of(tools, tool_choice="auto")       # None: no tools, or tool_choice "none"
    prompt = runner.render_chat(messages, tools=spec)   # the template's own tool format, or FALLBACK's
    content, calls = spec.parse(text, runner.tokenizer.chat_template)

Two wire formats, read off the model's chat template:
- "hermes" (Hermes 2 Pro, Qwen 2/2.5/3, and every template that does not render tools): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, text around them is the message's content.
- "llama3" (Llama 3.1/3.2's JSON tool calling): the answer is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by ";".
A template that renders `tools` itself receives them as transformers' `apply_chat_template(tools=...)` passes them
(OpenAI's objects), and the assistant's earlier calls with their arguments as objects. A template that knows no tools
(SmolLM2's concatenates `content`) gets FALLBACK as its system message, the assistant's earlier calls written back
as Hermes text, and the tool results as `<tool_response>` blocks (in a "tool" turn for ChatML templates, else a
"user" turn, which every template takes). `tool_choice: "none"` renders no tools at all.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass

from llgraph.errors import RequestError
from llgraph.runtime.engine.grammar import Grammar, strict

FALLBACK = ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
            "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
            "about what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
            "For each function call return a JSON object with the function name and arguments within "
            "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}}\n</tool_call>")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for a function's name


def call_id() -> str:
    """A new call's id, as OpenAI writes them."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Call:
    """One function call the model made: `arguments` is its JSON text (OpenAI's `function.arguments`)."""
    name: str
    arguments: str
    id: str

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools (OpenAI's `{"type": "function", "function": {name, description, parameters}}` objects),
    `choice` ("auto", "required", or the one function's name that must be called) and whether several calls may
    come at once (`parallel`)."""
    tools: tuple[dict, ...]
    choice: str = "auto"
    parallel: bool = True

    @classmethod
    def of(cls, tools, tool_choice=None, parallel_tool_calls=None) -> ToolSpec | None:
        """Checks OpenAI's three fields (a RequestError naming the bad one); None where no tool may be called."""
        if tools is None or tools == []:
            if tool_choice not in (None, "none", "auto"):
                raise RequestError("'tool_choice' names a tool, but the request has no 'tools'")
            return None
        if not isinstance(tools, list):
            raise RequestError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}")
        names = []
        for tool in tools:
            fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
                raise RequestError("each of 'tools' must be {\"type\": \"function\", \"function\": {\"name\": ...}} "
                                   "with a name of letters, digits, _ . - (at most 64)")
            if not isinstance(fn.get("parameters", {}), dict):
                raise RequestError(f"'tools': the parameters of {fn['name']!r} must be a JSON schema object")
            names.append(fn["name"])
        if len(set(names)) != len(names):
            raise RequestError("'tools' names a function twice")
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise RequestError("'parallel_tool_calls' must be true or false")
        parallel = parallel_tool_calls is not False
        choice = "auto" if tool_choice is None else tool_choice
        if choice == "none":
            return None
        if isinstance(choice, dict):
            fn = choice.get("function") if choice.get("type") == "function" else None
            choice = fn.get("name") if isinstance(fn, dict) else None
            if choice is None or choice not in names:
                raise RequestError(f"'tool_choice' must name one of the tools ({', '.join(names)})")
        elif choice not in ("auto", "required"):
            raise RequestError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        spec = cls(tuple(tools), choice, parallel)
        if spec.forced:  # a bad schema is named before anything runs (the grammar engine's word)
            spec.grammar("", None)
        else:  # nothing is constrained under auto: any valid JSON schema, whatever a grammar engine supports
            for fn in spec.functions:
                _check_schema(fn)
        return spec

    @property
    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools]

    @property
    def forced(self) -> bool:
        """Whether the answer must be tool calls (and so is constrained by grammar())."""
        return self.choice != "auto"

    @property
    def many(self) -> bool:
        """Whether several calls may come at once: parallel calls, unless one function is named (exactly one call,
        as OpenAI's, vLLM's and llama-server's named choice)."""
        return self.parallel and self.choice in ("auto", "required")

    # -- constrained calls --------------------------------------------------------------------------------------

    def grammar(self, template: str, tokenizer) -> Grammar | None:
        """For `required` or a named choice: the output is one call (several if `parallel`) of the allowed
        functions, each argument object valid against the function's parameters. None for `auto`."""
        if not self.forced:
            return None
        fns = [fn for fn in self.functions if self.choice in ("required", fn["name"])]
        key = "parameters" if style(template) == "llama3" else "arguments"
        schema = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": fn["name"]},
            key: _rerooted(strict(fn.get("parameters") or {"type": "object"}), f"/anyOf/{i}/properties/{key}")},
            "required": ["name", key], "additionalProperties": False} for i, fn in enumerate(fns)]}
        call = f"%json {json.dumps(schema)}"
        if style(template) == "llama3":
            rule = f'call: {call}\nstart: call ("; " call)*' if self.many else f"start: {call}"
        else:
            open_, close = _literal(OPEN, tokenizer), _literal(CLOSE, tokenizer)
            rule = f'call: {open_} "\\n" {call} "\\n" {close}\nstart: call ("\\n" call)*' if self.many \
                else f'start: {open_} "\\n" {call} "\\n" {close}'
        return Grammar.lark(rule)

    # -- the answer ---------------------------------------------------------------------------------------------

    def parse(self, text: str, template: str) -> tuple[str | None, list[Call]]:
        """The answer's content (the text around the calls, None where there is none but white space) and its calls
        of known functions, in order. Text that does not parse as a call stays content, as the model wrote it."""
        names = {fn["name"] for fn in self.functions}
        found = _parse_llama3(text) if style(template) == "llama3" else _parse_hermes(text)
        if found is None or not all(name in names for name, _, _ in found) or not found:
            return text, []
        calls, seen = [], set()
        for name, args, _ in found:  # a call repeated word for word (a small model looping) is one call
            text_args = json.dumps(args, ensure_ascii=False)
            if (name, text_args) not in seen:
                seen.add((name, text_args))
                calls.append(Call(name, text_args, call_id()))
        if not self.many:
            calls = calls[:1]
        rest = "".join(piece for _, _, piece in found)
        return rest if rest.strip() else None, calls

    def cut(self, text: str, template: str) -> tuple[str | None, list[Call]]:
        """A forced answer max_tokens cut short (finish "length"): its calls as far as written, OpenAI's shape for a
        cut call — the complete ones whole, the last with the arguments text produced so far ("" if none yet) — and
        no markup left as content. A call whose function cannot be told yet (its name cut, several allowed) is left
        out."""
        text = text[:len(text) - next((k for k in range(len(CLOSE), 0, -1) if text.endswith(CLOSE[:k])), 0)]
        content, calls = self.parse(text, template)
        body = _partial_call(text)
        if body is None:
            return content, calls
        names = [fn["name"] for fn in self.functions if self.choice in ("required", fn["name"])]
        named = re.match(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"', body)
        name = json.loads(f'"{named[1]}"') if named else names[0] if len(names) == 1 else None
        if name is None or name not in names or (calls and not self.many):
            return (content if calls else None), calls
        args = re.search(r'"(?:arguments|parameters)"\s*:\s*', body)
        partial = body[args.end():] if args else ""
        partial = partial[:len(partial) - next((k for k in range(len(CLOSE), 0, -1) if partial.endswith(CLOSE[:k])),
                                               0)].rstrip()
        return (content if calls else None), [*calls, Call(name, partial, call_id())]

    def held(self, text: str, template: str) -> int:
        """How much of a streamed answer's start (`text` so far) may go out as content now: the characters before
        anything that is, or may grow into, a call. Everything, once the answer is plainly not a call."""
        if self.forced:
            return 0
        if style(template) == "llama3":
            stripped = text.lstrip()
            if not stripped:
                return 0
            return 0 if stripped[0] == "{" or PYTHON_TAG.startswith(stripped[:len(PYTHON_TAG)]) else len(text)
        at = text.find(OPEN)
        if at >= 0:
            return at
        for k in range(min(len(OPEN) - 1, len(text)), 0, -1):  # a tail that may be the tag's start
            if OPEN.startswith(text[-k:]):
                return len(text) - k
        return len(text)


def chat_inputs(template: str, messages: list[dict], spec: ToolSpec | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template: its own tool format where it renders `tools`, else FALLBACK's (and,
    without tools, earlier calls and results still written as Hermes text)."""
    if renders_tools(template):
        return [_native_message(m) for m in messages], list(spec.tools) if spec else None
    return fallback_messages(messages, template, spec.functions if spec else None), None


@functools.lru_cache(maxsize=16)
def renders_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (so it writes the functions itself); parsed once."""
    from jinja2 import Environment, meta

    try:
        return "tools" in meta.find_undeclared_variables(Environment(extensions=["jinja2.ext.loopcontrols"])
                                                         .parse(template))
    except Exception:
        return False


def style(template: str) -> str:
    """'llama3' for Llama 3.1's JSON tool calling, else 'hermes' (FALLBACK's, and Qwen's and Hermes' own)."""
    return "llama3" if renders_tools(template) and PYTHON_TAG in template else "hermes"


def fallback_messages(messages: list[dict], template: str, functions: list[dict] | None) -> list[dict]:
    """The conversation for a template that knows no tools: FALLBACK leading the system message (where there are
    `functions`), calls as Hermes text in the assistant's turns, results as <tool_response> blocks."""
    system = FALLBACK.format(tools="\n".join(json.dumps({"type": "function", "function": fn}, ensure_ascii=False)
                                             for fn in functions)) if functions else ""
    result_role = "tool" if "<|im_start|>" in template else "user"
    out: list[dict] = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("role") in ("system", "developer") and not out:
            system = "\n\n".join(part for part in (content, system) if part)
            continue
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [f"{OPEN}\n{json.dumps(_call_object(c), ensure_ascii=False)}\n{CLOSE}" for c in m["tool_calls"]]
            content = "\n".join([content, *calls] if content else calls)
            out.append({"role": "assistant", "content": content})
        elif m.get("role") == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == result_role and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block  # parallel calls' results in one turn
            else:
                out.append({"role": result_role, "content": block, "tool_results": True})
        else:
            out.append({"role": m.get("role"), "content": content})
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    return [{"role": "system", "content": system}, *out] if system else out


def _native_message(m: dict) -> dict:
    """A message for a template that renders tools: content None as "", each call's arguments as an object (as
    transformers' templates read them; OpenAI sends a JSON string)."""
    out = {**m, "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": _call_object(c)} for c in m["tool_calls"]]
    return out


def _call_object(call: dict) -> dict:
    """{"name", "arguments": object} of an OpenAI tool call (arguments a JSON string, or already an object)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError("each of an assistant message's 'tool_calls' is {\"id\", \"type\": \"function\", "
                           "\"function\": {\"name\", \"arguments\"}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError:
            raise RequestError(f"the arguments of tool call {fn['name']!r} are not valid JSON") from None
    return {"name": fn["name"], "arguments": args}


def _literal(tag: str, tokenizer) -> str:
    """A tag in llguidance's lark: the special token's id where the vocabulary has one (Qwen's <tool_call>), else
    the text."""
    token = tokenizer.token_id(tag) if tokenizer is not None else None
    return f"<[{token}]>" if token is not None else json.dumps(tag)


def _partial_call(text: str) -> str | None:
    """The JSON of a call the text ends inside ({"name": ... cut short), or None when the last call is whole."""
    starts = [m.start() for m in re.finditer(r'\{\s*"name"', text)]
    if not starts:
        return None
    body = text[starts[-1]:]
    try:
        json.JSONDecoder().raw_decode(body)
        return None
    except json.JSONDecodeError:
        return body


def _parse_hermes(text: str):
    """[(name, arguments, the content text before it)], the text after the last call added to the last one's; None
    when a <tool_call> block holds no valid call (the whole text is then content)."""
    found: list[tuple] = []
    at = 0
    while (start := text.find(OPEN, at)) >= 0:
        end = text.find(CLOSE, start)
        body = text[start + len(OPEN): end if end >= 0 else len(text)]
        call = _call_json(body.strip(), "arguments")
        if call is None and end < 0 and found:  # the last call cut short (max_tokens, a stop string): the
            at = len(text)                       # complete ones before it stand
            break
        if call is None:
            return None
        found.append((*call, text[at:start]))
        at = end + len(CLOSE) if end >= 0 else len(text)
    if found:
        tail = text[at:]
        cut = next((k for k in range(len(OPEN) - 1, 0, -1) if tail.endswith(OPEN[:k])), 0)  # a tag cut by length
        name, args, before = found[-1]
        found[-1] = (name, args, before + tail[:len(tail) - cut])
    return found


def _parse_llama3(text: str):
    body = text.strip()
    body = body[len(PYTHON_TAG):].lstrip() if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return None
    found: list[tuple] = []
    decoder, at = json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return found or None  # the last call cut short: the complete ones before it stand
        call = _call_json(obj, "parameters")
        if call is None:
            return None
        found.append((*call, ""))
        at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
    return found


def _check_schema(fn: dict) -> None:
    """A function's parameters are a valid JSON schema (jsonschema's meta-schema check, where it is installed)."""
    try:
        from jsonschema import exceptions, validators
    except ImportError:
        return
    schema = fn.get("parameters") or {}
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as e:
        raise RequestError(f"'tools': the parameters of {fn['name']!r} are not a valid JSON schema: "
                           f"{' '.join(e.message.split())[:150]}") from None


def _rerooted(schema, prefix: str):
    """A function's parameters schema with its local `$ref` pointers ("#/$defs/City") moved under `prefix`, where
    the call grammar places the schema (so Pydantic's $defs still resolve)."""
    if isinstance(schema, dict):
        return {k: "#" + prefix + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else _rerooted(v, prefix) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rerooted(v, prefix) for v in schema]
    return schema


def _call_json(body, key: str):
    """(name, arguments) from a call's JSON (text or parsed) with `key` or "arguments" holding an object."""
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except json.JSONDecodeError:
            return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    args = body.get(key, body.get("arguments", body.get("parameters", {})))
    return (body["name"], args) if isinstance(args, dict) else None
