"""The engine's three types: what a request asks (`Params`, never changed once made), where its sequence is (`Row`, the
engine's state of it, written by the step only), and what a step gave it (`Output`, returned by the step: the tokens
it took, their log-probabilities, why it finished). The text a person reads is made from the outputs by whoever
consumes them (runtime/engine/decoding.py), not by the engine.

A row's `state` is set by the step as it moves: PROMPT (its prompt is being written, in pieces as the step's budget
allows) -> DECODING (its prompt is written and it took its first token; each step takes its next) -> DONE (its
`finish_reason` says why). A scored prompt or an embedding goes from PROMPT to DONE, nothing generated."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from llgraph.runtime.engine.logprobs import TokenLogprob
from llgraph.runtime.engine.sampling import Sampling
from llgraph.runtime.engine.speculative import MAX_DRAFT


class State(enum.Enum):
    PROMPT = "prompt"
    DECODING = "decoding"
    DONE = "done"


@dataclass(frozen=True)
class Params:
    """One request: its prompt `ids` and how it decodes. `eos`: the tokens that end it (finish_reason "eos", the
    token not part of the output); `max_new_tokens` 0: nothing generated — a scored prompt (`prompt_logprobs`) or an
    embedding (`pooling` "last" or "mean", unit length if `normalize`). `logprobs`: each emitted token's
    log-probability and this many alternatives; None: off. `speculative`: "off", "ngram" (prompt lookup) or "draft"
    (the engine's draft model), at most `draft_max` tokens a step."""
    ids: list[int]
    max_new_tokens: int = 64
    sampling: Sampling = Sampling()
    eos: frozenset[int] = frozenset()
    speculative: str = "off"
    draft_max: int = MAX_DRAFT
    logprobs: int | None = None
    prompt_logprobs: bool = False
    pooling: str | None = None
    normalize: bool = True

    @property
    def written(self) -> int:
        """The prompt positions its prefill writes: all, but the last of a prompt only scored (never input)."""
        return len(self.ids) - 1 if self.max_new_tokens == 0 and self.pooling is None else len(self.ids)


@dataclass(eq=False)  # compared by identity
class Row:
    """One sequence in its cache row `slot` (positions 0..`start`-1 of it already hold the prompt's first tokens:
    prefix reuse). After each step: `token`, the last token it took (the next step's input, at `position`), and
    `steps`, the tokens it has taken."""
    params: Params
    slot: int = 0
    start: int = 0
    matcher: object = None  # grammar.Matcher: the tokens this row may sample (structured output)
    created: float = field(default_factory=time.monotonic)
    state: State = State.PROMPT
    finish_reason: str | None = None  # "eos", "length"; a consumer's "stop"; "error"; the scheduler's own
    error: str | None = None
    exception: BaseException | None = None  # the bug behind `error`, where it was one (not llgraph's one-line kind)
    token: int = 0
    position: int = 0
    steps: int = 0
    seen: np.ndarray | None = None  # [1, V] the tokens already in the sequence (the repetition penalty's)
    counts: np.ndarray | None = None  # [1, V] float32 the output's token counts (frequency/presence penalties)
    generator: np.random.Generator | None = None
    drafter: object = None  # speculative.Drafter or ModelDrafter
    prompt_scores: list[TokenLogprob] | None = None  # a scored prompt's, chunk by chunk
    hidden: list[np.ndarray] | None = None  # an embedding row's hidden states [S, H] of the chunks written so far
    counted: bool = False  # its prefill's prefix-reuse figure reported (once, at its first chunk)
    cached: int = 0  # the prompt tokens a reused prefix held (the API's usage.prompt_tokens_details.cached_tokens)
    first_token_at: float | None = None

    @property
    def ids(self) -> list[int]:
        return self.params.ids

    @property
    def finished(self) -> bool:
        return self.state is State.DONE

    def finish(self, reason: str, error: str | None = None) -> None:
        self.state, self.finish_reason, self.error = State.DONE, reason, error


@dataclass
class Output:
    """What one step gave one row: the tokens it took (a speculating row's accepted drafts and one more; an EOS token
    last, if one ended it), with their log-probabilities where asked; `finish_reason` once it finished (`error` the
    message when that is "error"). A scored prompt's `prompt_scores` and an embedding's `embedding` come with its
    last output; `cached` is the prompt tokens a reused prefix held."""
    row: Row
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_scores: list[TokenLogprob] | None = None
    embedding: np.ndarray | None = None
    cached: int = 0
