"""Runner: a model's generate, stream, chat and scoring, for every backend: each request a batch of rows driven
through the one engine step (runtime/engine/step.py): prefill, then steps until every row has finished.

    runner.generate("Once upon a time", max_new_tokens=32)   # -> Generation(text, token_ids, finish_reason)
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from llgraph.errors import RequestError
from llgraph.generation_config import recommended
from llgraph.runtime.engine.backend import Backend
from llgraph.runtime.engine.decoding import Decoding
from llgraph.runtime.engine.row import Output, Params, Row
from llgraph.runtime.engine.sampling import Sampling
from llgraph.runtime.engine.speculative import MAX_DRAFT, check_draft, check_draft_max, check_mode
from llgraph.runtime.engine.step import Engine, Metrics
from llgraph.runtime.engine.tools import chat_inputs

EMBED_ROWS = 8  # texts Runner.embed writes in one step (each in a cache row of its own)
ROLES = ("system", "developer", "user", "assistant", "tool")  # a conversation's roles (OpenAI's)


class Perplexity(NamedTuple):
    """Runner.perplexity's answer."""
    perplexity: float
    nll: float  # summed negative log-likelihood, nats
    tokens: int  # tokens scored


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "stop" (a stop string), "length", or "error" (a batch's row that failed: `error`)
    error: str | None = None


class Runner:
    # a batch whose prompts share a prefix prefills it once, in row 0, and copies it to the other rows
    reuse_prefixes = True

    def __init__(self, backend: Backend, tokenizer=None, eos_token_ids: Sequence[int] = (), model=None):
        """`model`: the folder or GGUF the runner was opened from, whose recommended sampling (its
        generation_config.json or GGUF keys) `sampling_defaults` holds; the server fills unset fields from it."""
        self.backend, self.tokenizer = backend, tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.sampling_defaults = recommended(model)

    # -- public API -------------------------------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int = 64, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] = (), eos_token_ids: Sequence[int] | None = None, grammar=None,
                 speculative: str = "off", draft_max: int = MAX_DRAFT, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0, logit_bias: dict[int, float] | None = None, min_p: float = 0.0):
        """One prompt (a string, a list of token ids, or a conversation: a list of {"role", "content"} messages,
        rendered with the model's chat template) -> a Generation; a list of prompts -> a list of them.
        `grammar`: a runtime.engine.grammar.Grammar (e.g. Grammar.json_schema(schema)) every output must follow.
        `speculative`: "ngram" drafts tokens by prompt lookup and verifies them in one step
        (runtime/engine/speculative.py), or a draft model's runner drafts them: the same greedy output, the same
        sampling distribution, fewer steps where the output repeats its context; `draft_max` bounds the tokens
        drafted a step (the length adapts below it). `frequency_penalty`, `presence_penalty`, `logit_bias` ({token
        id: bias}), `min_p`: as runtime/engine/sampling.Sampling defines them. In a batch, row r samples with seed
        + r (each row equals that prompt alone with that seed), and a row whose own work fails ends alone with
        finish_reason "error" (a single prompt's failure raises RequestError)."""
        if len(prompts) == 0:
            raise RequestError("the prompt is empty; give at least one token")
        single = isinstance(prompts, str) or isinstance(prompts[0], (numbers.Integral, dict))  # numpy ints too
        batch = [prompts] if single else list(prompts)
        params = Sampling(temperature, top_k, top_p, repetition_penalty, seed, frequency_penalty, presence_penalty,
                          tuple((logit_bias or {}).items()), min_p)
        texts: list[_Text] = []
        for texts, _ in self._decode(batch, max_new_tokens, params, stop, eos_token_ids, grammar,  # noqa: B007
                                     self._speculation(speculative), draft_max=check_draft_max(draft_max)):
            pass  # the texts after the last step
        errors = [t.error for t in texts]
        if single and errors[0]:
            raise texts[0].failure()
        results = [Generation(t.text(), t.tokens, t.finish_reason or "error", e) for t, e in zip(texts, errors)]
        return results[0] if single else results

    def chat(self, messages: list[dict], max_new_tokens: int = 64, **kwargs) -> Generation:
        """The assistant's reply to a conversation ([{"role": "system" | "user" | "assistant", "content": ...}]),
        through the model's chat template: generate() on the rendered prompt. stream() takes a conversation too."""
        if not messages or not isinstance(messages[0], dict):
            raise RequestError('chat takes a list of messages: [{"role": "user", "content": "Hi"}, ...]')
        return self.generate(messages, max_new_tokens, **kwargs)

    def render_chat(self, messages: list[dict], tools=None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, reasoning_effort: str | None = None) -> str:
        """A conversation as the model's chat template writes it, ready for the assistant's turn (the one place a
        conversation is checked and rendered: generate, stream, chat and the server's chat completions). `tools`: a
        tools.ToolSpec, the functions the model may call (rendered by the template, or in runtime/engine/tools.py's
        fallback format); an assistant turn may carry OpenAI's `tool_calls` (its content then may be None), and a
        "tool" turn a call's result. `add_generation_prompt` False leaves the assistant's header out;
        `continue_final_message` (vLLM's) ends the text inside the last (assistant) message, for the model to
        continue it. `reasoning_effort` ("low", "medium", "high"): for a template that reads it (gpt-oss's system
        line "Reasoning: ..."), else a RequestError (it would change nothing)."""
        if reasoning_effort is not None:
            template = self.tokenizer.chat_template if self.tokenizer else None
            if reasoning_effort not in ("low", "medium", "high"):
                raise RequestError(f"reasoning_effort must be low, medium or high, not {str(reasoning_effort)[:20]!r}")
            if not template or "reasoning_effort" not in template:
                raise RequestError("reasoning_effort is read by a chat template that has it (gpt-oss's); this "
                                   "model's does not: drop it")
        if continue_final_message and add_generation_prompt:
            raise RequestError("continue_final_message continues the last message: set add_generation_prompt false")
        if continue_final_message and not (messages and isinstance(messages[-1], dict)
                                           and messages[-1].get("role") == "assistant"):
            raise RequestError("continue_final_message needs the last message to be the assistant's")
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise RequestError("this model has no chat template; give it a plain prompt instead of messages")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and (isinstance(m.get("content"), str) or
                                                                              m.get("content") is None and
                                                                              m.get("role") == "assistant")):
                raise RequestError(f"each message is {{'role': str, 'content': str}}; got {str(m)[:60]}")
            if m["role"] not in ROLES:
                raise RequestError(f"message role {m['role']!r} is not one of {', '.join(ROLES)}")
        template = self.tokenizer.chat_template
        messages, tool_list = chat_inputs(template, list(messages), tools)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tools=tool_list, **({} if reasoning_effort is None else
                                                                      {"reasoning_effort": reasoning_effort}))
        if continue_final_message:  # cut what the template closes the last message with
            last = messages[-1].get("content") or ""
            at = text.rfind(last) if last else -1
            if at < 0:
                raise RequestError("the chat template rewrote the last message; it cannot be continued")
            text = text[:at + len(last)]
        return text

    def stream(self, prompt, max_new_tokens: int = 64, **kwargs) -> Iterator[str]:
        """New text pieces as they are decoded; pieces never split a multi-byte character, and they concatenate to
        generate()'s text. Stopping early (or a KeyboardInterrupt) leaves the runner usable. `stats` (a dict) is
        filled once the stream ends: prompt_tokens, prefill_s (to the first token), new_tokens, decode_s."""
        stop = kwargs.pop("stop", ())
        eos = kwargs.pop("eos_token_ids", None)
        stats = kwargs.pop("stats", None)  # a dict to fill: prompt_tokens, prefill_s, new_tokens, decode_s
        grammar = kwargs.pop("grammar", None)
        speculative = self._speculation(kwargs.pop("speculative", "off"))
        draft_max = check_draft_max(kwargs.pop("draft_max", MAX_DRAFT))
        start = first = time.perf_counter()
        text, counts, events = None, _Counts(), []
        kwargs["logit_bias"] = tuple((kwargs.get("logit_bias") or {}).items())
        for (text,), events in self._decode([prompt], max_new_tokens, Sampling(**kwargs), stop, eos, grammar,
                                            speculative, counts, draft_max):
            if text.error:
                raise text.failure()
            if text.steps <= 1:
                first = time.perf_counter()  # prefill done and its token sampled
            for event in events:
                if event.text:
                    yield event.text
        if stats is not None and text is not None:
            stats.update(prompt_tokens=len(text.prompt), prefill_s=first - start, new_tokens=text.steps,
                         decode_s=time.perf_counter() - first, **counts.as_dict())

    # -- scoring (runtime/engine/score.py) ----------------------------------------------------------------------------
    def score(self, context, continuation):
        """Log-probability of `continuation` after `context` (texts or token ids) -> score.Score."""
        return self.score_batch([(context, continuation)])[0]

    def score_batch(self, pairs, batch_size: int = 8):
        """[(context, continuation), ...] -> [score.Score, ...], one forward pass per batch. Texts are encoded
        as lm-evaluation-harness does: the whole string once, the continuation being what follows the context's
        own encoding (so a token spanning the boundary belongs to the continuation)."""
        from llgraph.runtime.engine.score import score

        return score(self.backend, [self._split_pair(c, x) for c, x in pairs], batch_size)

    def embed(self, texts, pooling: str = "last", normalize: bool = True) -> np.ndarray:
        """Embeddings of a text, token ids, or a list of either -> float32 [N, hidden] (one text: [hidden]): the
        last hidden states pooled ("last" token or "mean"), unit length unless `normalize` is False
        (runtime/engine/embed.py). Up to EMBED_ROWS texts a step, each on a cache row of its own; nothing is
        sampled."""
        from llgraph.runtime.engine.embed import check_pooling

        check_pooling(pooling)
        single = isinstance(texts, str) or (len(texts) > 0 and isinstance(texts[0], numbers.Integral))
        ids = [self.encode(t) for t in ([texts] if single else texts)]
        if not ids:
            raise RequestError("embed takes a text, token ids, or a non-empty list of either")
        for p in ids:
            if len(p) > self.backend.max_seq_len:
                raise RequestError(f"a text of {len(p)} tokens exceeds the cache ({self.backend.max_seq_len} "
                                   "tokens); shorten it or raise --max-seq-len")
        rows = [Row(Params(p, 0, pooling=pooling, normalize=normalize), slot=i % EMBED_ROWS)
                for i, p in enumerate(ids)]
        engine, vectors = Engine(self.backend), {}
        self.backend.allocate(min(len(rows), EMBED_ROWS))
        for first in range(0, len(rows), EMBED_ROWS):  # a batch of texts a step, each in its own cache row
            for out in engine.step(rows[first:first + EMBED_ROWS]):
                if out.error:
                    raise RequestError(out.error)
                vectors[out.row] = out.embedding
        out = np.stack([vectors[r] for r in rows])
        return out[0] if single else out

    def perplexity(self, text, window: int | None = None, stride: int | None = None) -> Perplexity:
        """Perplexity(perplexity, nll, tokens): the perplexity, summed negative log-likelihood and tokens scored of a
        text or token ids, in rolling windows (runtime/engine/score.py); a named tuple, so it unpacks as before."""
        import math

        from llgraph.runtime.engine.score import rolling_logprob

        ids = self.encode(text)
        logprob, n = rolling_logprob(self.backend, ids, window, stride)
        return Perplexity(math.exp(-logprob / n), -logprob, n)

    def _split_pair(self, context, continuation) -> tuple[list[int], list[int]]:
        if isinstance(context, str) != isinstance(continuation, str):
            raise RequestError("context and continuation must both be texts or both be token ids")
        if not isinstance(context, str):
            return self.encode(context), self.encode(continuation)
        spaces = len(context) - len(context.rstrip())  # as lm-eval: trailing spaces move to the continuation
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = self.encode(context + continuation), self.encode(context) if context else []
        if not ctx:  # as lm-eval: the continuation is predicted from the beginning-of-text token (else end-of-text)
            return [self._start_token()], self.encode(continuation)
        return ctx, whole[len(ctx):] if whole[:len(ctx)] == ctx else self.encode(continuation)

    def _start_token(self) -> int:
        tok = self.tokenizer
        for name in ("bos_token", "eos_token"):
            found = tok.token_id(getattr(tok, name)) if tok is not None and getattr(tok, name, None) else None
            if found is not None:
                return found
        if self.eos_token_ids:
            return min(self.eos_token_ids)
        raise RequestError("the context is empty and this model names no beginning- or end-of-text token to start "
                           "from; give at least one token of context")

    # -- the loop ---------------------------------------------------------------------------------------------------
    def _speculation(self, mode):
        mode = check_mode(mode)
        if not isinstance(mode, str):
            check_draft(self, mode)
        return mode

    def _decode(self, prompts, max_new_tokens, params: Sampling, stop, eos_token_ids, grammar=None,
                speculative="off", metrics: Metrics | None = None, draft_max: int = MAX_DRAFT):
        """Yields each prompt's output so far (a Decoding, made here from the engine's outputs: this loop is their
        consumer) and the step's events, after the prefill and after each engine step, until every row has finished.
        `speculative`: "off", "ngram" or a draft model's runner (its cache gets a row per prompt)."""
        ids = [self.encode(p) for p in prompts]
        eos = frozenset(self.eos_token_ids if eos_token_ids is None else eos_token_ids)
        b = self.backend
        self.check_room(max(len(p) for p in ids), max_new_tokens)
        mode, draft = (speculative, None) if isinstance(speculative, str) else ("draft", speculative.backend)
        rows = [Row(Params(p, max_new_tokens, params if params.seed is None or r == 0 else
                           dataclasses.replace(params, seed=params.seed + r), eos, mode, draft_max), slot=r)
                for r, p in enumerate(ids)]
        texts = {r: _Text(self.text_of, stop, r.ids) for r in rows}
        engine = Engine(b, metrics, draft, log_bugs=len(rows) > 1)  # one prompt's bug is raised, not logged
        for r in rows:  # a row's grammar: its own failure (a bad schema is refused before this)
            r.matcher = engine._own(r, grammar.matcher, self.tokenizer, b.vocab_size, set(eos)) if grammar else None
            if r.error:
                texts[r].take(Output(r, finish_reason="error", error=r.error))
        b.allocate(len(ids))
        if draft is not None:
            draft.allocate(len(ids))
        if self.reuse_prefixes:
            engine.share_prefix([r for r in rows if not r.finished])
        while True:
            events = []
            for out in engine.step(rows):  # the first: every prompt whole, each row's first token
                events += texts[out.row].take(out)
                if texts[out.row].finish_reason == "stop":  # its text reached a stop string
                    engine.finish(out.row, "stop")
            yield list(texts.values()), events
            if all(t.finish_reason for t in texts.values()):
                return

    def check_room(self, prompt_tokens: int, max_new_tokens) -> None:
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens ({max_new_tokens}) must be a positive integer")
        if prompt_tokens + max_new_tokens > self.backend.max_seq_len:
            raise RequestError(f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                               f"cache ({self.backend.max_seq_len} tokens); shorten the prompt, lower "
                               "max_new_tokens, or raise --max-seq-len")

    def encode(self, prompt) -> list[int]:
        if not isinstance(prompt, str) and len(prompt) and isinstance(prompt[0], dict):  # a conversation
            prompt = self.render_chat(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this runner has no tokenizer; pass token ids or load a model with one")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.backend.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.backend.vocab_size - 1})")
        return ids

    def text_of(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""


class _Text(Decoding):
    """A Runner row's output: its Decoding, with its prompt and the error that ended it (if one did)."""

    def __init__(self, text_of, stop, prompt: list[int]):
        super().__init__(text_of, stop)
        self.prompt, self.error, self.exception = prompt, None, None

    def take(self, out: Output):
        if out.error is not None and self.error is None:
            self.error, self.exception = out.error, out.row.exception
        return super().take(out)

    def failure(self) -> BaseException:
        """What a single prompt's failure raises: a bug as itself (its traceback kept: errors.py's rule), else the
        one-line RequestError."""
        return self.exception if self.exception is not None else RequestError(self.error or "the request failed")


class _Counts(Metrics):
    """A stream's speculation figures (its `stats`): tokens drafted and kept."""

    def __init__(self):
        self.drafted = self.accepted = 0
        self.speculating = False

    def speculated(self, drafted: int, accepted: int) -> None:
        self.speculating = True
        self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted

    def as_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted} if self.speculating else {}
