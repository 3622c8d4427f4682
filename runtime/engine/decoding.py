"""One sequence's decoding state: its tokens, the finish rule (an EOS token, a stop string, max_new_tokens) and the
text a stream may show so far, never splitting a multi-byte character or a possible stop string."""

from __future__ import annotations

from typing import Sequence


class Decoding:
    """One request's decoding state, shared by Runner's batch loop and the scheduler: its tokens, the finish rule
    (an EOS token, a stop string, max_new_tokens) and the text a stream may show so far."""

    def __init__(self, text_of, max_new_tokens: int, stop=(), eos=()):
        self.text_of, self.max_new_tokens, self.stop, self.eos = text_of, max_new_tokens, tuple(stop), set(eos)
        self.tokens: list[int] = []
        self.steps = 0
        self.finish_reason: str | None = None  # "eos", "stop" or "length"
        self._shown = ""
        self._decoded = (0, "")  # (tokens decoded, their text): each step decodes once, not once per caller

    def push(self, token: int) -> str | None:
        """A sampled token -> the finish reason, once finished (an EOS token is not kept)."""
        self.steps += 1
        if token in self.eos:
            self.finish_reason = "eos"
        else:
            self.tokens.append(token)
            if self.stop and any(s in self._full_text() for s in self.stop):
                self.finish_reason = "stop"
        if self.finish_reason is None and self.steps == self.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason

    def _full_text(self) -> str:
        if self._decoded[0] != len(self.tokens):
            self._decoded = (len(self.tokens), self.text_of(self.tokens))
        return self._decoded[1]

    def text(self) -> str:
        return _cut_at_stop(self._full_text(), self.stop)

    def new_text(self) -> str:
        """The text since the last call. Until finished it holds back an incomplete multi-byte character and an end
        that may still become a stop string, so the pieces concatenate to text()."""
        text = self.text()
        if self.finish_reason is None:
            if text.endswith("\ufffd"):
                return ""
            text = text[:len(text) - _stop_prefix(text, self.stop)]
        if len(text) <= len(self._shown):
            return ""
        piece, self._shown = text[len(self._shown):], text
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
