"""The one engine step. A `Row` is one sequence in its cache row (its slot): its prompt, how it samples, what it has
emitted, its drafter. `Engine.advance(rows, budget)` is the step, on every backend and for every entry point
(Runner's generate/stream/chat/embed/score, the Scheduler): one packed batch (runtime/engine/packed.py) of the
decoding rows' last tokens with their drafts and pieces of the prompts being written, then each row takes what its
logits give it — its next tokens, keeping the drafts the sampler agrees with (runtime/engine/speculative.py), a
prompt's first token, a scored prompt's log-probabilities, an embedding's pooled hidden states. A backend without
ragged rows runs the same batch as padded forwards (runtime/engine/contiguous.py). Speculation is data in the step,
not a loop: a row without a drafter drafts nothing, and a step of rows without drafts is a plain decode step.

Errors: a row's own work — its prefill, drafting, sampling, grammar, the events it emits — runs under one guard; if it
raises, that row alone ends (finish_reason "error", `row.error` the message, the engine's `on_error(row)` called) and
the others go on. Only a failure of the batch's forward itself concerns every row, and reaches the caller.
"""

from __future__ import annotations

import enum
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from llgraph.errors import LlgraphError, described
from llgraph.runtime.engine import speculative
from llgraph.runtime.engine.backend import Backend
from llgraph.runtime.engine.decoding import Decoding
from llgraph.runtime.engine.embed import pool
from llgraph.runtime.engine.logprobs import TokenLogprob, token_logprobs
from llgraph.runtime.engine.packed import Packed
from llgraph.runtime.engine.prefix import MIN_REUSE, shared_prefix
from llgraph.runtime.engine.sampling import Sampling
from llgraph.runtime.engine.speculative import MAX_DRAFT, Drafter, ModelDrafter


class Metrics:
    """What the engine reports as it goes (the server's subclass feeds Prometheus; Runner's counts drafts)."""

    def first_token(self, seconds: float) -> None:
        """A row's first token, `seconds` after it was created (submitted)."""

    def tokens(self, n: int) -> None:
        """`n` tokens emitted."""

    def speculated(self, drafted: int, accepted: int) -> None:
        """One verify step of a speculating row: its draft's length and how many of them were kept."""

    def prefix(self, reused: int, prompt: int) -> None:
        """One prefill: of its `prompt` tokens, `reused` were in the cache already (prefix reuse)."""


class State(enum.Enum):
    """Where a row is. PROMPT: its prompt is being written (in pieces, as the step's budget allows); DECODING: its
    prompt is written and it took its first token, each step takes its next; DONE: its finish_reason says why (a
    scored prompt or an embedding goes from PROMPT to DONE, nothing generated)."""
    PROMPT = "prompt"
    DECODING = "decoding"
    DONE = "done"


@dataclass(eq=False)  # compared by identity
class Row:
    """One sequence: its prompt `ids`, its cache row `slot` (positions 0..`start`-1 of it already hold the prompt's
    first tokens: prefix reuse), its sampling, its decoding state, and after each step the last token it took
    (`token`, the next step's input, at `position`)."""
    ids: list[int]
    decoding: Decoding
    sampling: Sampling = Sampling()
    slot: int = 0
    start: int = 0
    matcher: object = None  # grammar.Matcher: the tokens this row may sample (structured output)
    speculative: str = "off"  # "off", "ngram" (prompt lookup) or "draft" (the engine's draft model)
    draft_max: int = MAX_DRAFT
    logprobs: int | None = None  # each emitted token's log-probability and this many alternatives; None: off
    prompt_logprobs: bool = False  # the prompt's own, into prompt_scores (a row of max_new_tokens 0 only scores)
    pooling: str | None = None  # an embedding row ("last" or "mean"; max_new_tokens 0): into `embedding`
    normalize: bool = True  # an embedding's: to unit length
    emit: Callable[[Row, int, TokenLogprob | None], None] | None = None  # called with each emitted token
    created: float = field(default_factory=time.monotonic)
    # state, set by the engine
    token: int = 0
    position: int = 0
    seen: np.ndarray | None = None  # [1, V] the tokens already in the sequence (the repetition penalty's)
    counts: np.ndarray | None = None  # [1, V] float32 the output's token counts (frequency/presence penalties)
    generator: np.random.Generator | None = None
    drafter: Drafter | ModelDrafter | None = None
    prompt_scores: list[TokenLogprob] | None = None
    embedding: np.ndarray | None = None  # [hidden] float32, an embedding row's (runtime/engine/embed.py)
    hidden: list[np.ndarray] | None = None  # an embedding row's hidden states [S, H] of the chunks written so far
    counted: bool = False  # its prefill's prefix-reuse figure reported (once, at its first chunk)
    cached: int = 0  # the prompt tokens a reused prefix held (the API's usage.prompt_tokens_details.cached_tokens)
    first_token_at: float | None = None
    taken: list[int] = field(default_factory=list)  # the tokens its last step emitted
    error: str | None = None

    @property
    def state(self) -> State:
        """Read off the row's own fields (its decoding's finish_reason, its sampler state set at its first token),
        so it cannot disagree with them."""
        if self.finished:
            return State.DONE
        return State.PROMPT if self.seen is None else State.DECODING

    @property
    def finished(self) -> bool:
        return self.decoding.finish_reason is not None

    @property
    def only_written(self) -> bool:
        """A row that generates nothing: a scored prompt or an embedding (max_new_tokens 0)."""
        return self.decoding.max_new_tokens == 0

    @property
    def written(self) -> int:
        """The prompt positions its prefill writes: all, but the last of a prompt only scored (never input)."""
        return len(self.ids) - 1 if self.decoding.max_new_tokens == 0 and self.pooling is None else len(self.ids)


class Engine:
    def __init__(self, backend: Backend, metrics: Metrics | None = None, draft_backend: Backend | None = None,
                 on_error: Callable[[Row], None] = lambda row: None):
        """`draft_backend`: a draft model's backend (rows that speculate "draft" draft with it, each from the cache
        row of its own slot); `on_error(row)`: told when a row ends in an error (the scheduler forgets its cached
        prefix)."""
        self.backend, self.metrics, self.draft_backend = backend, metrics or Metrics(), draft_backend
        self.on_error = on_error

    # -- the step ------------------------------------------------------------------------------------------------
    def _count_prefix(self, r: Row, prompt: int) -> None:
        if not r.counted:
            r.counted, r.cached = True, r.start
            self.metrics.prefix(r.start, prompt)

    def share_prefix(self, rows: list[Row]) -> None:
        """The prefix every row's prompt shares (none written yet), computed once in the first row and copied to the
        others, each row's `start` moved past it; nothing where it is short or the backend cannot copy (Runner's
        batch of prompts: the scheduler reuses prefixes by slot, runtime/engine/prefix.py)."""
        b, ids = self.backend, [r.ids for r in rows]
        if len(rows) < 2 or any(r.start or r.prompt_logprobs or r.pooling for r in rows):
            return
        shared = shared_prefix(ids)
        if shared >= MIN_REUSE and b.caches():  # copy_prefix can copy
            batch = Packed()
            batch.add(rows[0].slot, ids[0][:shared], 0, kept=0)
            batch.run(b)
            for r in rows:
                b.copy_prefix(rows[0].slot, r.slot, shared)
                r.start = shared

    def _begin(self, r: Row, logits: np.ndarray) -> None:
        """A prefilled row's state, then its first token from the prompt's last logits [1, V]."""
        r.seen = np.zeros((1, self.backend.vocab_size), np.bool_)
        r.seen[0, r.ids] = True
        r.counts = np.zeros((1, self.backend.vocab_size), np.float32) if r.sampling.counts_output else None
        r.generator, r.position = r.sampling.generator(), len(r.ids) - 1  # the last prompt token's; _take moves it
        if r.speculative == "ngram":
            r.drafter = speculative.Drafter(r.ids, r.draft_max)
        elif r.speculative == "draft":  # the draft model's cache row of this slot, written from position 0
            r.drafter = speculative.ModelDrafter(self.draft_backend, r.slot, r.ids, r.draft_max)
        self._take(r, logits)

    def advance(self, rows: list[Row], budget: int = 0) -> None:
        """The engine's step, on every backend (runtime/engine/packed.py): every decoding row's last token and its
        draft, then prompt pieces of the rows still being written, oldest first, as many prompt tokens as `budget`
        allows (0: every prompt whole) — a scored prompt's keep their log-probabilities, an embedding's its hidden
        states, a prompt that ends takes its first token. Rows that are finished are left out; a scored prompt of
        one token needs no forward."""
        batch = Packed()
        work: list[tuple[Row, list[int] | int, int]] = []  # (row, its draft or its piece's end, its add)
        decoding = [r for r in rows if r.state is State.DECODING]
        drafted = self._drafts(decoding)
        for r in decoding:
            if not r.finished:  # its drafting may have failed
                draft = drafted.get(r.slot, [])
                work.append((r, draft, batch.add(r.slot, [r.token, *draft], r.position, kept=1 + len(draft))))
        left = budget or None
        for r in rows:
            if r.state is not State.PROMPT or (left is not None and left <= 0):
                continue
            if r.written == 0:  # a scored prompt of one token: nothing predicts it
                r.prompt_scores = []
                r.decoding.finish_reason = "length"
                continue
            end = r.written if left is None else min(r.written, r.start + left)
            left = None if left is None else left - (end - r.start)
            self._count_prefix(r, r.written)
            piece = r.ids[r.start:end]
            if r.pooling is not None:  # an embedding: its hidden states, nothing sampled
                work.append((r, end, batch.add(r.slot, piece, r.start, kept=0, hidden=True)))
            else:
                kept = end - r.start if r.prompt_logprobs else int(end == r.written)
                work.append((r, end, batch.add(r.slot, piece, r.start, kept)))
        if not work:
            return
        logits = batch.run(self.backend)
        for r, what, i in work:
            if isinstance(what, list):  # a decoding row: its draft
                self._own(r, self._take, r, logits[i], what)
            elif r.pooling is not None:
                self._own(r, self._embedded, r, what, batch.hidden(i))
            else:
                self._own(r, self._wrote, r, what, logits[i])

    def _drafts(self, rows: list[Row]) -> dict[int, list[int]]:
        """Each speculating row's draft by its slot (up to what its length and the cache leave): prompt lookup row by
        row; the draft model's rows together (speculative.draft_together: its forwards batched across the rows), or
        row by row after a failure. Drafting is an optimisation, never the answer: a row whose drafting fails is
        logged (a bug's traceback, else its line) and decodes plainly from then on — the same tokens (greedy) or the
        same distribution (sampled) as if it had never speculated."""
        rooms, models = {}, []
        for r in rows:
            if r.drafter is not None:
                d = r.decoding
                rooms[r.slot] = min(d.max_new_tokens - d.steps - 1, self.backend.max_seq_len - 1 - r.position)
                if isinstance(r.drafter, ModelDrafter):
                    models.append(r)
        out = {}
        if len(models) > 1:
            try:
                drafts = speculative.draft_together([r.drafter for r in models], [rooms[r.slot] for r in models])
                out = {r.slot: d for r, d in zip(models, drafts)}
            except Exception as e:  # each row drafts alone below: only the row at fault stops speculating
                _log(e, "drafting together failed; each row drafts alone")
        for r in rows:
            if r.drafter is not None and r.slot not in out:
                try:
                    out[r.slot] = r.drafter.draft(rooms[r.slot])
                except Exception as e:
                    _log(e, f"request in slot {r.slot}: its drafting failed; it decodes without speculation")
                    r.drafter, out[r.slot] = None, []
        return out

    def _embedded(self, r: Row, end: int, hidden: np.ndarray) -> None:
        """An embedding's piece r.start..end-1 written, `hidden` its hidden states: kept ("mean" pools them all,
        "last" the last piece's last); at the prompt's end, pooled."""
        r.hidden = [*(r.hidden or []), hidden] if r.pooling == "mean" else [hidden]
        r.start = end
        if end == r.written:
            r.embedding = pool(np.concatenate(r.hidden), r.pooling, r.normalize)
            r.hidden = None
            r.decoding.finish_reason = "length"

    def _wrote(self, r: Row, end: int, logits: np.ndarray) -> None:
        """A prompt piece r.start..end-1 written, `logits` those it kept: a scored prompt's scores; the prompt's
        end: what the row is for (its first token, or done when only scored)."""
        if r.prompt_logprobs:  # position t predicts token t + 1
            scored = min(end, len(r.ids) - 1) - r.start
            r.prompt_scores = (r.prompt_scores or []) + token_logprobs(
                logits[:scored], r.ids[r.start + 1:r.start + 1 + scored], r.logprobs or 0)
        r.start = end
        if end == r.written:
            if r.only_written:  # scored alone
                r.decoding.finish_reason = "length"
            else:
                self._begin(r, logits[-1:])

    def _take(self, r: Row, logits: np.ndarray, draft: Sequence[int] = ()) -> list[int]:
        """logits [len(draft) + 1, V] of the row's last token and its draft -> the tokens it emits (the accepted
        drafts and one more), each pushed to its decoding and emitted; its position moves past them."""
        tokens = r.taken = speculative.accept(logits, list(draft), r.sampling, r.seen, r.generator, r.matcher,
                                              r.counts)
        if r.drafter is not None:
            r.drafter.took(list(draft), tokens)
            self.metrics.speculated(len(draft), len(tokens) - 1)
        r.token, r.position = tokens[-1], r.position + len(tokens)
        if r.first_token_at is None:
            r.first_token_at = time.monotonic()
            self.metrics.first_token(r.first_token_at - r.created)
        for i, token in enumerate(tokens):
            scored = None if r.logprobs is None else token_logprobs(logits[i:i + 1], [token], r.logprobs)[0]
            self.metrics.tokens(1)
            r.decoding.push(token)
            if r.emit is not None:
                r.emit(r, token, scored)
            if r.finished:
                break
        return tokens

    def _own(self, r: Row, work, *args):
        """`work(*args)`, a piece of row `r`'s own work -> its result; if it raises, `r` alone ends with the error
        and None is returned: the other rows go on. An error that is not llgraph's one-line kind is a bug: its
        traceback goes to stderr as well (errors.py's rule), not only its line into the row's answer."""
        try:
            return work(*args)
        except Exception as e:
            if not isinstance(e, LlgraphError):
                traceback.print_exception(e, file=sys.stderr)
            r.error = described(e)
            r.decoding.finish_reason = "error"
            self.on_error(r)
            return None


def _log(e: Exception, what: str) -> None:
    """An error the engine recovers from, on stderr: a bug's traceback (errors.py's rule), else its one line."""
    if isinstance(e, LlgraphError):
        print(f"llgraph: {what}: {described(e)}", file=sys.stderr)
    else:
        print(f"llgraph: {what}:", file=sys.stderr)
        traceback.print_exception(e, file=sys.stderr)
