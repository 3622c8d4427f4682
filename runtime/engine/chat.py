"""A multi-turn conversation over a Runner: the history kept within the cache, each reply streamed.

    chat = Conversation(runner, system="Be brief.", max_new_tokens=256)
    for piece in chat.say("Hi"): print(piece, end="")
    chat.reset()                      # forget the turns, keep the system message
"""

from __future__ import annotations

from collections.abc import Iterator

from llgraph.errors import RequestError
from llgraph.runtime.engine import harmony
from llgraph.runtime.engine.runner import Runner


class Conversation:
    def __init__(self, runner: Runner, system: str | None = None, max_new_tokens: int = 256, **sampling):
        if runner.tokenizer is None or not runner.tokenizer.chat_template:
            raise RequestError("chat needs a model with a tokenizer and a chat template")
        self.runner, self.max_new_tokens, self.sampling = runner, max_new_tokens, sampling
        self.system = system
        self.turns: list[dict] = []
        self.dropped = 0  # turns forgotten so far to keep the conversation within the cache

    def reset(self, system: str | None = None, keep_system: bool = True) -> None:
        self.system = self.system if keep_system else system
        self.turns, self.dropped = [], 0

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def say(self, text: str) -> Iterator[str]:
        """The reply to `text`, piece by piece; the oldest turns are dropped (user and reply together) while the
        conversation and max_new_tokens would not fit the cache."""
        self.turns.append({"role": "user", "content": text})
        room = self.runner.backend.max_seq_len - self.max_new_tokens
        while len(self.runner.encode(self.messages())) > room:
            if len(self.turns) <= 1:
                self.turns.pop()
                raise RequestError(f"this message does not fit the cache ({self.runner.backend.max_seq_len} tokens "
                                   f"with {self.max_new_tokens} new ones); shorten it or raise --max-seq-len")
            del self.turns[:2]
            self.dropped += 1
        reply, shown = [], ""
        channels = harmony.speaks(self.runner.tokenizer.chat_template)  # gpt-oss: the final channel is the reply
        for piece in self.runner.stream(self.messages(), self.max_new_tokens, **self.sampling):
            reply.append(piece)
            if not channels:
                yield piece
                continue
            content = harmony.visible("".join(reply))[1]
            if content.startswith(shown) and len(content) > len(shown):
                yield content[len(shown):]
                shown = content
        text = "".join(reply)
        if channels and (rest := harmony.parse(text).content)[len(shown):]:
            yield rest[len(shown):]
        self.turns.append({"role": "assistant", "content": harmony.parse(text).content if channels else text})
