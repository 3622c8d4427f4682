"""`llgraph serve`'s /v1/completions and /v1/chat/completions: a request's prompts x n choices, each a scheduler
request, answered whole or streamed as server-sent events, with OpenAI's log-probabilities.

- Choice i*n + j answers prompt i with sample j (OpenAI's index order). Sample j of a seeded request is seeded
  seed + j, so each choice equals a solo request with that seed.
- Log-probabilities are the model's own: `logprobs.token_logprobs`, a float64 log-softmax of the logits before
  temperature, top-k, top-p or a penalty. An echoed prompt's therefore equal `Runner.score` on it; its first token
  has none (null).
- Completions' `logprobs: k` gives OpenAI's legacy shape: tokens, token_logprobs, top_logprobs (the k most likely
  and the chosen token) and text_offset (characters into prompt + completion, echoed or not). Chat's
  `logprobs: true, top_logprobs: k` gives `content[]` of token, logprob, bytes and top_logprobs.
- A token string is its text, or `bytes:\\xNN...` for a token that holds part of a character.
"""

from __future__ import annotations

import asyncio
import codecs
import json

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from llgraph.errors import RequestError
from llgraph.runtime.engine import harmony
from llgraph.runtime.engine.tools import Call, call_id
from llgraph.runtime.serve.ask import NO_TOOLS, Ask
from llgraph.runtime.serve.request import ApiError, prompt_ids, submitting, unless_gone

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "length", "cancelled": "stop"}
async def answer(request: Request, ask: Ask, runner, scheduler, meta: dict):
    context = runner.backend.max_seq_len
    if ask.grammar is not None:  # its first use builds llguidance's view of the vocabulary (~0.4 s): not on the loop
        try:  # and a grammar that admits no output is the request's error
            await asyncio.to_thread(ask.grammar.matcher, runner.tokenizer, runner.backend.vocab_size,
                                    runner.eos_token_ids)
        except RequestError as e:
            raise ApiError(400, str(e)) from None
    field = "messages" if ask.chat else "prompt"
    ids = await asyncio.to_thread(lambda: [prompt_ids(runner, p, context, field) for p in ask.prompts])
    handles: list = []
    with submitting(handles):
        for prompt in ids:
            if len(prompt) >= context and (ask.max_tokens is None or ask.max_tokens > 0):  # the prompt alone
                raise ApiError(400, f"this model's context is {context} tokens and the {field} take {len(prompt)}, "
                                    "leaving none to generate; shorten the prompt", param=field,
                               code="context_length_exceeded")
            max_tokens = context - len(prompt) if ask.max_tokens is None else ask.max_tokens
            room = len(prompt) + max_tokens if max_tokens else len(prompt) - 1  # scoring alone: the last is not input
            if room > context:
                raise ApiError(400, f"this model's context is {context} tokens; the prompt takes {len(prompt)} and "
                                    f"{ask.key} asks for {max_tokens} more; lower {ask.key} or shorten the prompt",
                               param=ask.key, code="context_length_exceeded")
            for sampling in ask.samplings:
                handles.append(scheduler.submit(
                    prompt, max_tokens, sampling, ask.stop, () if ask.ignore_eos else None,
                    loop=asyncio.get_running_loop(), logprobs=ask.logprobs,
                    prompt_logprobs=ask.echo and (ask.logprobs is not None or max_tokens == 0), grammar=ask.grammar,
                    speculative=ask.speculative, draft_max=ask.draft_max))
    choices = [Choice(k, h, ask, runner.tokenizer) for k, h in enumerate(handles)]
    events = _merged(handles)
    # the status waits for the first event: a request that never started (shut down while queued) is a 503
    first = await unless_gone(request, anext(events))
    if first is None:
        await events.aclose()
        return JSONResponse({}, status_code=499)
    if not ask.stream:
        async def rest():
            for k, event in [first, *[e async for e in events]]:
                choices[k].take(event)
        if await unless_gone(request, rest(), done=True) is None:  # a client that leaves frees its slots
            await events.aclose()
            return JSONResponse({}, status_code=499)
        return {**meta, "object": "chat.completion" if ask.chat else "text_completion",
                "choices": [c.whole() for c in choices], "usage": _usage(handles, ask.n)}
    return Chunks(_chunks(first, events, choices, handles, meta, ask))


class Choice:
    """One choice's text and log-probabilities as its events come."""

    def __init__(self, index: int, handle, ask: Ask, tokenizer):
        self.index, self.handle, self.ask, self.tokenizer = index, handle, ask, tokenizer
        self.pieces: list[str] = []
        self.scored: list = []  # (token, TokenLogprob | None)
        self.started = False
        self.sent = 0  # with tools, streaming: the characters sent as content (what follows may be a call)
        self.offsets = None if ask.chat or ask.logprobs is None else Offsets()
        self.harmony = ask.chat and harmony.speaks(ask.template)  # gpt-oss: reasoning, content and calls by channel
        self.shown = ("", "")  # harmony, streaming: the reasoning and content sent so far

    def prompt_text(self) -> str:
        prompt = self.ask.prompts[self.index // self.ask.n]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt) if self.tokenizer else ""

    def take(self, event) -> tuple[str, list]:
        """An event -> the text and (token, logprob) entries it adds (the echoed prompt's, first)."""
        text, entries = "", []
        if not self.started:
            self.started = True
            if self.ask.echo:
                text = self.prompt_text()
                if self.ask.logprobs is not None:
                    scores = self.handle.prompt_logprobs or []
                    entries = [(self.handle.prompt_ids[0], None), *((s.token, s) for s in scores)]
            elif self.offsets is not None:
                self.offsets.skip(self.prompt_text())
        kept = not (event.kind == "done" and self.handle.decoding.finish_reason == "eos")  # EOS is not in the output
        if event.logprob is not None and event.token is not None and kept:
            entries.append((event.token, event.logprob))
        text += event.text
        self.pieces.append(text)
        self.scored += entries
        return text, entries

    def logprobs(self, entries: list):
        if self.ask.logprobs is None:
            return None
        if self.ask.chat:
            return {"content": [self._chat_entry(t, s) for t, s in entries]}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        assert self.offsets is not None  # kept for a completion that asked for logprobs
        for token, s in entries:
            out["text_offset"].append(self.offsets.take(self.tokenizer.token_bytes(token)))
            out["tokens"].append(self._string(token))
            out["token_logprobs"].append(None if s is None else s.logprob)
            top: dict[str, float] | None = None
            if s is not None:  # the k most likely and the chosen token, most likely first
                top = {}
                for t, lp in sorted([*s.top, (token, s.logprob)], key=lambda tl: -tl[1]):
                    top.setdefault(self._string(t), lp)
            out["top_logprobs"].append(top)
        return out

    def calls(self) -> tuple[str | None, list]:
        """The answer's content (unstripped) and its tool calls (runtime/engine/tools.py), once it is done."""
        text = "".join(self.pieces)
        if self.harmony:
            answer = harmony.parse(text)
            calls = [Call(name, args, call_id()) for name, args in answer.calls] if self.ask.tools is not NO_TOOLS \
                else []
            return answer.content, calls
        if self.ask.tools is NO_TOOLS:
            return text, []
        if self.ask.tools.forced and self.handle.decoding.finish_reason in ("length", "timeout"):  # a call cut short
            return self.ask.tools.cut(text, self.ask.template)
        return self.ask.tools.parse(text, self.ask.template)

    def release(self, done: bool) -> tuple[str, list]:
        """With tools, streaming: the content not sent yet that surely is no part of a call, and the calls once
        `done` (the content's prefix up to the first call is the text's)."""
        whole = "".join(self.pieces)
        calls: list = []
        if done:
            content, calls = self.calls()
            safe = content or "" if calls else whole
        else:
            safe = whole[:self.ask.tools.held(whole, self.ask.template)]
        text, self.sent = safe[self.sent:], max(self.sent, len(safe))
        return text, calls

    def unshown(self, done: bool) -> tuple[str, str]:
        """Harmony, streaming: the reasoning and content not sent yet (whole once `done`)."""
        text = "".join(self.pieces)
        if done:
            answer = harmony.parse(text)
            now = (answer.reasoning, answer.content)
        else:
            now = harmony.visible(text)
        new = tuple(n[len(s):] if n.startswith(s) else "" for n, s in zip(now, self.shown))
        self.shown = now
        return new[0], new[1]

    def reason(self, calls: list) -> str:
        reason = FINISH[self.handle.decoding.finish_reason]
        return "tool_calls" if calls and reason == "stop" else reason

    def whole(self) -> dict:
        logprobs = self.logprobs(self.scored)
        if self.ask.chat:
            text, calls = self.calls()
            content = (text or "").strip() or None if calls else text
            message: dict[str, object] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
            if self.harmony and (reasoning := harmony.parse("".join(self.pieces)).reasoning):
                message["reasoning_content"] = reasoning  # llama-server's and vLLM's field
            return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": self.reason(calls),
                    "stop_reason": self.handle.decoding.stop_string()}
        reason = FINISH[self.handle.decoding.finish_reason]
        text = "".join(self.pieces)
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                "stop_reason": self.handle.decoding.stop_string()}

    def _string(self, token: int) -> str:
        raw = self.tokenizer.token_bytes(token)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _chat_entry(self, token: int, s) -> dict:
        def one(t, lp):
            return {"token": self._string(t), "logprob": lp, "bytes": list(self.tokenizer.token_bytes(t))}
        return {**one(token, s.logprob), "top_logprobs": [one(t, lp) for t, lp in s.top]}


class Offsets:
    """Characters of text before each token, from the tokens' bytes (a character split over tokens counts once,
    at the token that completes it)."""

    def __init__(self):
        self.chars, self._utf8 = 0, codecs.getincrementaldecoder("utf-8")("replace")

    def skip(self, text: str) -> None:
        self.chars += len(text)

    def take(self, raw: bytes) -> int:
        at = self.chars
        self.chars += len(self._utf8.decode(raw))
        return at


def _usage(handles, n: int) -> dict:
    prompt = sum(h.prompt_tokens for h in handles[::n])  # a prompt counts once, however many samples it has
    done = sum(h.decoding.steps for h in handles)
    cached = sum(h.cached for h in handles[::n])  # the prompt tokens a reused prefix held (prefix.py)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached}}


def failure(handle, event) -> ApiError:
    """An error event as the API says it: 503 when the server shut down first, else 500 (the model failed)."""
    if handle.decoding.finish_reason == "shutdown":
        return ApiError(503, event.text, "server_error", code="shutting_down")
    return ApiError(500, f"the model failed: {event.text}", "server_error")


async def _merged(handles):
    """(choice index, event) from every handle as they come, until all are done; an error event raises its
    ApiError. Leaving early (the client went away) cancels every request."""
    waits = {asyncio.ensure_future(h.events.get()): k for k, h in enumerate(handles)}
    try:
        while waits:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda task: waits[task]):
                k = waits.pop(task)
                event = task.result()
                if event.kind == "error":
                    raise failure(handles[k], event)
                yield k, event
                if event.kind != "done":
                    waits[asyncio.ensure_future(handles[k].events.get())] = k
    finally:
        for task in waits:
            task.cancel()
        for h in handles:
            h.cancel()  # a no-op once finished; frees the slot (or the queue place) of an abandoned request


class Chunks(StreamingResponse):
    """A streamed completion: its chunks as dicts (`chunks`: what the Responses and Messages APIs translate into
    their own events, never re-read from text), sent as server-sent events where it is the answer itself."""

    def __init__(self, chunks):
        self.chunks = chunks
        super().__init__(_sse(chunks), media_type="text/event-stream")


async def _sse(chunks):
    async for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


async def _chunks(first, events, choices: list[Choice], handles, meta: dict, ask: Ask):
    """The chunks of a streamed completion (an error, once one happens, as {"error": ...})."""
    kind = "chat.completion.chunk" if ask.chat else "text_completion"

    def chunk(k: int, text: str | None, reason: str | None, entries=None, opening: bool = False,
              stop: str | None = None, reasoning: str | None = None) -> dict:
        logprobs = choices[k].logprobs(entries) if entries else None
        if ask.chat:
            delta = ({"role": "assistant", "content": ""} if opening else {} if text is None else {"content": text})
            if reasoning:
                delta = {"reasoning_content": reasoning}
            choice = {"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": k, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        if reason is not None:
            choice["stop_reason"] = stop  # vLLM's: the stop string that ended it, else null
        body = {**meta, "object": kind, "choices": [choice]}
        if ask.usage:
            body["usage"] = _usage(handles, ask.n) if ask.every_usage else None
        return body

    def tool_calls(k: int, calls: list) -> dict:
        delta = {"tool_calls": [call.openai(i) for i, call in enumerate(calls)]}
        body = {**meta, "object": kind, "choices": [{"index": k, "delta": delta, "logprobs": None,
                                                     "finish_reason": None}]}
        if ask.usage:
            body["usage"] = _usage(handles, ask.n) if ask.every_usage else None
        return body

    if ask.chat:
        for c in choices:
            yield chunk(c.index, None, None, opening=True)
    try:
        pending = first
        while pending is not None:
            k, event = pending
            text, entries = choices[k].take(event)
            calls = []
            if choices[k].harmony:  # gpt-oss: reasoning and content by channel as they grow, calls at the end
                reasoning, text = choices[k].unshown(event.kind == "done")
                if reasoning:
                    yield chunk(k, None, None, reasoning=reasoning)
                if event.kind == "done":
                    calls = choices[k].calls()[1]
            elif ask.tools is not NO_TOOLS:  # what is, or may grow into, a tool call is held back until the end
                text, calls = choices[k].release(event.kind == "done")
            if text or entries:
                yield chunk(k, text, None, entries)
            if calls:
                yield tool_calls(k, calls)
            if event.kind == "done":
                yield chunk(k, None, choices[k].reason(calls), stop=choices[k].handle.decoding.stop_string())
            pending = await anext(events, None)
    except ApiError as e:
        yield {"error": {"message": str(e), "type": e.kind, "code": e.code}}
    finally:
        await events.aclose()
    if ask.usage:
        yield {**meta, "object": kind, "choices": [], "usage": _usage(handles, ask.n)}
