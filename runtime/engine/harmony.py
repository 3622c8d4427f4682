"""gpt-oss's answers in OpenAI's harmony format, split as llama-server and vLLM split them: the `analysis` channel is
the reasoning (`reasoning_content`), the `final` channel (and a `commentary` message to no one) the content, and a
`commentary` message to `functions.NAME` a tool call whose arguments are the message's body.

    <|channel|>analysis<|message|>The user asks ...<|end|><|start|>assistant<|channel|>final<|message|>4
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

The answer's text holds these marks because the tokenizer renders them (llgraph/gguf_tokenizer.py's HARMONY_TEXT,
as llama.cpp does, <|end|> too; a text without <|end|> parses the same, a message running to the next <|start|>);
the turn ends at <|return|> or <|call|>, which are end-of-generation tokens and not in the text.
A template speaks harmony when it writes <|channel|> (`speaks`). The server carries the reasoning as each API does:
`reasoning_content` (chat completions), a thinking block (Anthropic's Messages API), a reasoning item (the Responses
API); `llgraph chat` shows the final channel. A required or named `tool_choice` is not built for harmony yet: a 400
says so (runtime/serve/ask.py).

    answer = parse(text)                     # Answer(reasoning, content, calls)
    reasoning, content = visible(text)       # streaming: what may be sent now (no half-written mark)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

CHANNEL, MESSAGE, START, END, CONSTRAIN = "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>"
MARKS = (CHANNEL, MESSAGE, START, END, CONSTRAIN, "<|return|>", "<|call|>")
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")


def speaks(template: str | None) -> bool:
    """Whether a chat template renders harmony (gpt-oss's): its answers are then parsed here."""
    return template is not None and CHANNEL in template and "<|message|>" in template


@dataclass
class Answer:
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (function name, arguments' JSON text)


def parse(text: str) -> Answer:
    """The answer's messages by channel. Text before any mark (a model that wrote plainly) is content; a message
    whose header is not finished yet (no <|message|>) adds nothing."""
    answer = Answer()
    if CHANNEL not in text and MESSAGE not in text:
        answer.content = text
        return answer
    for i, message in enumerate(text.split(START)):
        header, sep, body = message.partition(MESSAGE)
        if not sep:
            if i == 0 and CHANNEL not in header:  # plain text before the first message
                answer.content += header
            continue
        body = body.split(END, 1)[0]
        channel = header.split(CHANNEL, 1)[1].split(CONSTRAIN, 1)[0].split()[0] if CHANNEL in header and \
            header.split(CHANNEL, 1)[1].split() else ""
        recipient = _RECIPIENT.search(header)
        if recipient and recipient[1].startswith("functions."):
            answer.calls.append((recipient[1][len("functions."):], body.strip()))
        elif channel == "analysis":
            answer.reasoning += body
        elif recipient is None:  # final, and commentary to the user (a preamble)
            answer.content += body
    return answer


def visible(text: str) -> tuple[str, str]:
    """(reasoning, content) of a text still being written: a trailing piece that may be the start of a mark is held
    back, so both only grow as the text does (a stream sends their new suffixes)."""
    cut = text.rfind("<")
    if cut >= 0 and any(m.startswith(text[cut:]) and m != text[cut:] for m in MARKS):
        text = text[:cut]
    answer = parse(text)
    return answer.reasoning, answer.content
