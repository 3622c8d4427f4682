"""The text a consumer of the engine's outputs makes: one sequence's tokens as they come (runtime/engine/row.py's
Output), its text so far — never splitting a multi-byte character or a possible stop string — and the stop strings,
which end it where the engine's own rules (an EOS token, max_new_tokens) did not. The engine returns token ids only;
this runs wherever the outputs are read (the server's event loop, a queue's reader, Runner's loop), not on the thread
that drives the engine, which learns of a stop string from its consumer (Scheduler.finish, Engine.finish) and may
have taken a token or two beyond it by then: they are not part of the answer.

The text grows incrementally, as vLLM's and TGI's detokenizers do: each token decodes a short window of the tokens
since the last whole character (`text_of(tokens[prefix:])` against `text_of(tokens[prefix:read])`, both starting at
the same token, so a tokenizer's handling of a leading space cancels out), and a stop string is looked for in the
text's tail only. A token costs the same at token 8,000 as at token 8 (re-decoding the whole output each step cost
0.8 ms a token at 8,000 tokens). The finished text is decoded whole, once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llgraph.runtime.engine.logprobs import TokenLogprob
from llgraph.runtime.engine.row import Output


@dataclass
class Event:
    """What a consumer reads of its request, a token at a time."""
    kind: str  # "token" (one taken), "done" (finished: see the Decoding's finish_reason) or "error" (it failed)
    text: str = ""  # the new text it completes (often "" inside a multi-byte character or a possible stop string)
    token: int | None = None
    logprob: TokenLogprob | None = None  # the token's, when the request asked for logprobs


class Decoding:
    """One request's output as its consumer sees it: its tokens, its text so far, and why it finished: the engine's
    reason ("eos", "length"; the scheduler's "timeout", "cancelled", "error", "shutdown") or a stop string's "stop"."""

    def __init__(self, text_of, stop=()):
        self.text_of, self.stop = text_of, tuple(stop)
        self.tokens: list[int] = []
        self.steps = 0  # the tokens taken (an EOS token too: usage counts it)
        self.finish_reason: str | None = None
        self._shown = 0  # characters of the text new_text() has given
        self._text = ""  # the text of tokens[:read] (whole characters)
        self._prefix = self._read = 0  # the window: tokens[prefix:read] decode to the end of _text
        self._final: str | None = None  # the finished text, decoded whole once
        self._longest_stop = max((len(s) for s in self.stop), default=0)

    def take(self, out: Output) -> list[Event]:
        """A step's output for this sequence -> its events, a token each (the last one "done" once finished); none
        once finished (the tokens an engine took past a stop string before it heard of it)."""
        if self.finish_reason is not None:
            return []
        if out.error is not None:
            self.finish_reason = out.finish_reason or "error"
            return [Event("error", out.error)]
        events = []
        for i, token in enumerate(out.tokens):
            self.push(token, out.finish_reason if i == len(out.tokens) - 1 else None)
            logprob = out.logprobs[i] if out.logprobs else None
            events.append(Event("token" if self.finish_reason is None else "done", self.new_text(), token, logprob))
            if self.finish_reason is not None:
                return events
        if out.finish_reason is not None:  # finished with no token this step (scored, embedded, cancelled, ...)
            self.finish_reason = out.finish_reason
            events.append(Event("done", self.new_text()))
        return events

    def push(self, token: int, finish_reason: str | None = None) -> str | None:
        """A taken token, the engine's `finish_reason` if it was the last -> the finish reason, once finished (an EOS
        token is not kept; a stop string in the text finishes it "stop")."""
        self.steps += 1
        if finish_reason == "eos":
            self.finish_reason = "eos"
            return self.finish_reason
        self.tokens.append(token)
        grown = self._advance()
        tail = self._text[-(self._longest_stop + grown):] if grown else ""
        if self.stop and tail and any(s in tail for s in self.stop):
            self.finish_reason = "stop"
        elif finish_reason is not None:
            self.finish_reason = finish_reason
        return self.finish_reason

    def _advance(self) -> int:
        """Decodes the window with the new token -> how many characters the text grew (0 while a character is
        still incomplete)."""
        before = self.text_of(self.tokens[self._prefix:self._read])
        after = self.text_of(self.tokens[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return 0
        piece = after[len(before):]
        self._text += piece
        self._prefix, self._read = self._read, len(self.tokens)
        return len(piece)

    def text(self) -> str:
        """The text so far (finished: the whole output decoded at once), cut before a stop string."""
        if self.finish_reason is None:
            return self._text
        if self._final is None:
            self._final = _cut_at_stop(self.text_of(self.tokens), self.stop)
        return self._final

    def stop_string(self) -> str | None:
        """The stop string that ended the output (the earliest in its text), or None (an EOS, a length, ...)."""
        if self.finish_reason != "stop":
            return None
        text = self.text_of(self.tokens)
        return min(((text.index(s), s) for s in self.stop if s in text), default=(0, None))[1]

    def new_text(self) -> str:
        """The text since the last call. Until finished it holds back an incomplete multi-byte character and an end
        that may still become a stop string, so the pieces concatenate to text()."""
        text = self.text()
        end = len(text)
        if self.finish_reason is None:
            end -= _stop_prefix(text[-self._longest_stop:] if self._longest_stop else "", self.stop)
        if end <= self._shown:
            return ""
        piece, self._shown = text[self._shown:end], end
        return piece


def _cut_at_stop(text: str, stop: Sequence[str]) -> str:
    hits = [text.index(s) for s in stop if s in text]
    return text[:min(hits)] if hits else text


def _stop_prefix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that begins some stop string (held back while streaming)."""
    for k in range(min(len(text), max((len(s) for s in stop), default=0)), 0, -1):
        if any(s.startswith(text[-k:]) for s in stop):
            return k
    return 0
