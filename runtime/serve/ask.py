"""`llgraph serve`'s completion and chat requests parsed: every field checked (request.py's checks, ApiError naming
the field), the prompts rendered (the chat template, its tools), sampling per choice, the grammar and the speculation
asked for — an Ask, which completions.answer serves and the Responses and Messages APIs reach through chat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llgraph.errors import RequestError
from llgraph.runtime.engine import harmony
from llgraph.runtime.engine.sampling import Sampling
from llgraph.runtime.engine.scheduler import MAX_LOGPROBS
from llgraph.runtime.engine.speculative import MAX_DRAFT, check_served_mode
from llgraph.runtime.serve.request import (
    ApiError,
    chat_prompt,
    every_usage,
    flag,
    grammar_of,
    include_usage,
    logit_bias,
    number,
    prompts_of,
    refuse_unsupported,
    stop_strings,
    tools_of,
)

if TYPE_CHECKING:
    from llgraph.runtime.engine.grammar import Grammar
    from llgraph.runtime.engine.tools import ToolSpec

NO_TOOLS = None  # Ask.tools of a request that may call no tool


@dataclass
class Ask:
    """One request's fields, checked."""
    chat: bool
    prompts: list  # each a string or token ids (chat: the rendered conversation)
    n: int
    max_tokens: int | None  # None: chat's default, the rest of the context
    key: str  # the field max_tokens came from
    samplings: list[Sampling]  # sample j's
    stop: tuple[str, ...]
    ignore_eos: bool
    logprobs: int | None  # alternatives per token; None: no log-probabilities
    grammar: Grammar | None  # response_format's
    speculative: str  # "off", "ngram" or "draft" (llgraph's field; the server's --speculative by default)
    draft_max: int  # the most tokens drafted a step ("speculative.n_max", llama.cpp's field; --draft-max by default)
    echo: bool
    stream: bool
    usage: bool
    tools: ToolSpec | None = NO_TOOLS  # functions the chat answer may call
    template: str = ""  # the chat template (which tool-call format the answer uses)
    every_usage: bool = False  # a streamed answer's every chunk carries its usage so far (vLLM's stream option)


def parse(body: dict, chat: bool, runner, slots: int, capacity: int, speculative: str = "off",
          draft_max: int = MAX_DRAFT, draft: bool = False) -> Ask:
    """The request's fields, each checked (ApiError naming it). `capacity`: the choices one request may ask for;
    `speculative`, `draft_max`: the server's defaults; `draft`: whether it has a draft model."""
    n = number(body, "n", 1, 1, 1 << 30, integer=True)
    if n > slots:
        raise ApiError(400, f"'n' ({n}) exceeds this server's {slots} slots (each choice decodes in a slot of its "
                            "own); lower n or start the server with more --slots", param="n")
    refuse_unsupported(body, n, chat)
    tools = tools_of(body) if chat else NO_TOOLS
    if chat:
        if body.get("echo") is not None:
            raise ApiError(400, "'echo' is a /v1/completions field; chat completions do not echo", param="echo")
        prompts = [chat_prompt(body, runner, tools)]
        logprobs = None
        if flag(body, "logprobs"):
            logprobs = number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
        elif body.get("top_logprobs") is not None:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        echo = False
    else:
        prompts = prompts_of(body, runner.tokenizer)
        logprobs = number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
        echo = flag(body, "echo")
    if len(prompts) * n > capacity:
        raise ApiError(400, f"{len(prompts)} prompts x n={n} make {len(prompts) * n} choices; this server takes at "
                            f"most {capacity} at once (its slots and queue); send fewer", param="prompt")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(key) == 0 and not echo and not isinstance(body.get(key), bool):
        raise ApiError(400, f"'{key}' is 0: nothing would be generated; ask for at least 1 (0 with 'echo': true "
                            "scores the prompt alone)", param=key)
    max_tokens = number(body, key, None if chat else 16, 0 if echo else 1, 1 << 30, integer=True)
    seed = number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
    # a field the request leaves unset takes the model's recommended value, else llama-server's (serve/__init__.py)
    default = runner.sampling_defaults.values
    top_k = number(body, "top_k", default["top_k"], -1, 1 << 30, integer=True)  # vLLM's; -1 (or 0) disables it
    try:
        samplings = [Sampling(temperature=number(body, "temperature", default["temperature"], 0, 2),
                              top_k=max(top_k, 0), top_p=number(body, "top_p", default["top_p"], 0, 1),
                              min_p=number(body, "min_p", default["min_p"], 0, 1),
                              repetition_penalty=number(body, "repetition_penalty", default["repetition_penalty"],
                                                        0, 1e6),
                              seed=None if seed is None else seed + j,
                              frequency_penalty=number(body, "frequency_penalty", 0.0, -2, 2),
                              presence_penalty=number(body, "presence_penalty", 0.0, -2, 2),
                              logit_bias=logit_bias(body, runner.backend.vocab_size))
                     for j in range(n)]
    except RequestError as e:
        raise ApiError(400, str(e)) from None
    grammar = grammar_of(body)
    template = runner.tokenizer.chat_template if chat and runner.tokenizer else ""
    if tools is not NO_TOOLS and tools.forced:
        if harmony.speaks(template):
            raise ApiError(400, "a required or named 'tool_choice' is not built for gpt-oss's harmony format yet; "
                                "use \"auto\" (its calls are parsed from the answer)", param="tool_choice")
        if grammar is not None:
            raise ApiError(400, "a 'response_format' cannot go with a required or named 'tool_choice': the answer "
                                "is the tool call", param="response_format")
        try:
            grammar = tools.grammar(template, runner.tokenizer)
        except RequestError as e:
            raise ApiError(400, str(e), param="tools") from None
    ignore_eos = flag(body, "ignore_eos")
    if grammar is not None and ignore_eos:
        raise ApiError(400, "'ignore_eos' cannot go with a response_format: a document ends with EOS",
                       param="ignore_eos")
    speculative = body.get("speculative", speculative)
    try:
        check_served_mode(speculative, draft)
    except RequestError as e:
        raise ApiError(400, str(e), param="speculative") from None
    draft_max = number(body, "speculative.n_max", draft_max, 1, 1 << 10, integer=True)
    return Ask(chat, prompts, n, max_tokens, key, samplings, stop_strings(body), ignore_eos, logprobs, grammar,
               speculative, draft_max, echo, flag(body, "stream"), include_usage(body), tools, template,
               every_usage(body))
