"""One sequence's decoding state: its tokens, the finish rule (an EOS token, a stop string, max_new_tokens) and the
text a stream may show so far, never splitting a multi-byte character or a possible stop string.

The text grows incrementally, as vLLM's and TGI's detokenizers do: each token decodes a short window of the tokens
since the last whole character (`text_of(tokens[prefix:])` against `text_of(tokens[prefix:read])`, both starting at
the same token, so a tokenizer's handling of a leading space cancels out), and a stop string is looked for in the
text's tail only. A step costs the same at token 8,000 as at token 8 (re-decoding the whole output each step cost
0.8 ms a token at 8,000 tokens, on the thread that drives the engine). The finished text is decoded whole, once."""

from __future__ import annotations

from collections.abc import Sequence


class Decoding:
    """One request's decoding state, shared by Runner's batch loop and the scheduler: its tokens, the finish rule
    (an EOS token, a stop string, max_new_tokens) and the text a stream may show so far."""

    def __init__(self, text_of, max_new_tokens: int, stop=(), eos=()):
        self.text_of, self.max_new_tokens, self.stop, self.eos = text_of, max_new_tokens, tuple(stop), set(eos)
        self.tokens: list[int] = []
        self.steps = 0
        # "eos", "stop", "length"; the scheduler's "timeout", "cancelled", "error", "shutdown"
        self.finish_reason: str | None = None
        self._shown = 0  # characters of the text new_text() has given
        self._text = ""  # the text of tokens[:read] (whole characters)
        self._prefix = self._read = 0  # the window: tokens[prefix:read] decode to the end of _text
        self._final: str | None = None  # the finished text, decoded whole once
        self._longest_stop = max((len(s) for s in self.stop), default=0)

    def push(self, token: int) -> str | None:
        """A sampled token -> the finish reason, once finished (an EOS token is not kept)."""
        self.steps += 1
        if token in self.eos:
            self.finish_reason = "eos"
        else:
            self.tokens.append(token)
            grown = self._advance()
            tail = self._text[-(self._longest_stop + grown):] if grown else ""
            if self.stop and tail and any(s in tail for s in self.stop):
                self.finish_reason = "stop"
        if self.finish_reason is None and self.steps == self.max_new_tokens:
            self.finish_reason = "length"
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
