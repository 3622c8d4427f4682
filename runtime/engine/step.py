"""The one engine step, on every backend and for every entry point (Runner's generate/stream/chat/embed/score, the
Scheduler), in three calls — vLLM's schedule -> execute -> update:

    plan = engine.schedule(rows, budget)     # which rows, which tokens at which positions of which cache rows
    logits = engine.execute(plan)            # one forward of the packed batch (runtime/engine/packed.py)
    outputs = engine.update(plan, logits)    # each row takes what its logits give it -> [row.Output, ...]
    outputs = engine.step(rows, budget)      # the three in turn

A plan is the decoding rows' last tokens with their drafts (runtime/engine/speculative.py) and pieces of the prompts
being written, as many prompt tokens as the budget allows. `update` moves each row's state (runtime/engine/row.py):
its next tokens, keeping the drafts the sampler agrees with, a prompt's first token, a scored prompt's
log-probabilities, an embedding's pooled hidden states; it keeps what each cache row holds (prefix.CachedRows, where
the engine has one) and returns what the step gave each row — token ids, never text (runtime/engine/decoding.py makes
the text, on the consumer's side). A backend without ragged rows runs the same batch as padded forwards
(runtime/engine/contiguous.py). Speculation is data in the plan, not a loop: a row without a drafter drafts nothing.

Errors: a row's own work — its prefill, drafting, sampling, grammar — runs under one guard; if it raises, that row
alone ends (finish_reason "error", its output carrying the message; a bug's traceback on stderr) and the others go on.
Only a failure of the batch's forward itself concerns every row: it reaches the caller, which ends them (`fail`).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from llgraph.errors import LlgraphError, described
from llgraph.runtime.engine import speculative
from llgraph.runtime.engine.backend import Backend
from llgraph.runtime.engine.embed import pool
from llgraph.runtime.engine.logprobs import token_logprobs
from llgraph.runtime.engine.packed import Packed
from llgraph.runtime.engine.prefix import MIN_REUSE, CachedRows, shared_prefix
from llgraph.runtime.engine.row import Output, Row, State
from llgraph.runtime.engine.speculative import ModelDrafter


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


@dataclass
class Work:
    """One row's part of a plan: its add in the batch (`index`); a decoding row's `draft` (its input is its last
    token), or a prompt piece's `end` (it writes prompt positions row.start..end-1)."""
    row: Row
    index: int
    draft: list[int] | None = None
    end: int = 0


@dataclass
class Plan:
    """A step's batch (runtime/engine/packed.py) and each row's part in it; `done`: rows the scheduling itself
    finished (a scored prompt of one token: nothing predicts it)."""
    batch: Packed = field(default_factory=Packed)
    work: list[Work] = field(default_factory=list)
    done: list[Output] = field(default_factory=list)


class Engine:
    def __init__(self, backend: Backend, metrics: Metrics | None = None, draft_backend: Backend | None = None,
                 cache: CachedRows | None = None, log_bugs: bool = True):
        """`draft_backend`: a draft model's backend (rows that speculate "draft" draft with it, each from the cache
        row of its own slot); `cache`: what each cache row holds, kept by `update` (the scheduler's prefix reuse);
        `log_bugs` False: a bug in a row's work is not printed here (its caller raises it: Runner's one prompt)."""
        self.backend, self.metrics, self.draft_backend = backend, metrics or Metrics(), draft_backend
        self.cache, self.log_bugs = cache, log_bugs

    # -- the step ------------------------------------------------------------------------------------------------
    def step(self, rows: list[Row], budget: int = 0) -> list[Output]:
        plan = self.schedule(rows, budget)
        return self.update(plan, self.execute(plan))

    def schedule(self, rows: list[Row], budget: int = 0) -> Plan:
        """The step's plan: every decoding row's last token and its draft, then prompt pieces of the rows still being
        written, oldest first, as many prompt tokens as `budget` allows (0: every prompt whole). Finished rows are
        left out."""
        plan = Plan()
        decoding = [r for r in rows if r.state is State.DECODING]
        drafted = self._drafts(decoding)
        for r in decoding:
            draft = drafted.get(r.slot, [])
            plan.work.append(Work(r, plan.batch.add(r.slot, [r.token, *draft], r.position, kept=1 + len(draft)),
                                  draft))
        left = budget or None
        for r in rows:
            if r.state is not State.PROMPT or (left is not None and left <= 0):
                continue
            written = r.params.written
            if written == 0:  # a scored prompt of one token: nothing predicts it
                r.prompt_scores = []
                r.finish("length")
                plan.done.append(Output(r, finish_reason="length", prompt_scores=[]))
                continue
            end = written if left is None else min(written, r.start + left)
            left = None if left is None else left - (end - r.start)
            if not r.counted:
                r.counted, r.cached = True, r.start
                self.metrics.prefix(r.start, written)
            piece = r.ids[r.start:end]
            if r.params.pooling is not None:  # an embedding: its hidden states, nothing sampled
                index = plan.batch.add(r.slot, piece, r.start, kept=0, hidden=True)
            else:
                index = plan.batch.add(r.slot, piece, r.start, end - r.start if r.params.prompt_logprobs else
                                       int(end == written))
            plan.work.append(Work(r, index, end=end))
        return plan

    def execute(self, plan: Plan) -> list[np.ndarray]:
        """The plan's forward: each add's wanted logits (none for an empty plan)."""
        return plan.batch.run(self.backend) if plan.work else []

    def update(self, plan: Plan, logits: list[np.ndarray]) -> list[Output]:
        """Each row of the plan takes what its logits give it -> the outputs of the rows that took a token, finished
        or failed; what each cache row holds moves with them."""
        outputs = list(plan.done)
        for w in plan.work:
            r, held = w.row, self.cache.held[w.row.slot] if self.cache is not None else None
            if w.draft is not None:
                token, position = r.token, r.position
                out = self._own(r, self._take, r, logits[w.index], w.draft)
                if held is not None and out is not None:  # the inputs written: its last token and the drafts kept
                    held += [token, *w.draft[:r.position - position - 1]]
            elif r.params.pooling is not None:
                out = self._own(r, self._embedded, r, w.end, plan.batch.hidden(w.index))
            else:
                out = self._own(r, self._wrote, r, w.end, logits[w.index])
            if r.error is not None:
                outputs.append(self._failed(r))
            elif out is not None:
                if held is not None and w.draft is None:
                    held[:] = r.ids[:r.start]
                if out.tokens or out.finish_reason:
                    outputs.append(out)
        return outputs

    def finish(self, r: Row, reason: str) -> Output:
        """A row ended from outside the step (its consumer saw a stop string; cancelled; out of time) -> its output."""
        if not r.finished:
            r.finish(reason)
        return Output(r, finish_reason=r.finish_reason, cached=r.cached)

    def fail(self, rows: list[Row], message: str, reason: str = "error") -> list[Output]:
        """Rows ended by an error no row owns (the batch's forward failed; the server shut down) -> their outputs."""
        for r in rows:
            r.finish(reason, message)
        return [self._failed(r) for r in rows]

    def _failed(self, r: Row) -> Output:
        """A row that ended in an error: its cache row holds nothing reusable any more."""
        if self.cache is not None and 0 <= r.slot < len(self.cache.held):  # (a queued request has no slot yet)
            self.cache.forget(r.slot)
        return Output(r, finish_reason=r.finish_reason, error=r.error or "the request failed", cached=r.cached)

    def share_prefix(self, rows: list[Row]) -> None:
        """The prefix every row's prompt shares (none written yet), computed once in the first row and copied to the
        others, each row's `start` moved past it; nothing where it is short or the backend cannot copy (Runner's
        batch of prompts: the scheduler reuses prefixes by slot, runtime/engine/prefix.py)."""
        b, ids = self.backend, [r.ids for r in rows]
        if len(rows) < 2 or any(r.start or r.params.prompt_logprobs or r.params.pooling for r in rows):
            return
        shared = shared_prefix(ids)
        if shared >= MIN_REUSE and b.caches():  # copy_prefix can copy
            batch = Packed()
            batch.add(rows[0].slot, ids[0][:shared], 0, kept=0)
            batch.run(b)
            for r in rows:
                b.copy_prefix(rows[0].slot, r.slot, shared)
                r.start = shared

    # -- each row's own work -----------------------------------------------------------------------------------------
    def _drafts(self, rows: list[Row]) -> dict[int, list[int]]:
        """Each speculating row's draft by its slot (up to what its length and the cache leave): prompt lookup row by
        row; the draft model's rows together (speculative.draft_together: its forwards batched across the rows), or
        row by row after a failure. Drafting is an optimisation, never the answer: a row whose drafting fails is
        logged (a bug's traceback, else its line) and decodes plainly from then on — the same tokens (greedy) or the
        same distribution (sampled) as if it had never speculated."""
        rooms, models = {}, []
        for r in rows:
            if r.drafter is not None:
                rooms[r.slot] = min(r.params.max_new_tokens - r.steps - 1, self.backend.max_seq_len - 1 - r.position)
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

    def _begin(self, r: Row, logits: np.ndarray) -> Output:
        """A prefilled row's state, then its first token from the prompt's last logits [1, V]."""
        r.seen = np.zeros((1, self.backend.vocab_size), np.bool_)
        r.seen[0, r.ids] = True
        p = r.params
        r.counts = np.zeros((1, self.backend.vocab_size), np.float32) if p.sampling.counts_output else None
        r.generator, r.position = p.sampling.generator(), len(r.ids) - 1  # the last prompt token's; _take moves it
        if p.speculative == "ngram":
            r.drafter = speculative.Drafter(r.ids, p.draft_max)
        elif p.speculative == "draft":  # the draft model's cache row of this slot, written from position 0
            r.drafter = ModelDrafter(self.draft_backend, r.slot, r.ids, p.draft_max)
        r.state = State.DECODING
        return self._take(r, logits)

    def _embedded(self, r: Row, end: int, hidden: np.ndarray) -> Output:
        """An embedding's piece r.start..end-1 written, `hidden` its hidden states: kept ("mean" pools them all,
        "last" the last piece's last); at the prompt's end, pooled."""
        r.hidden = [*(r.hidden or []), hidden] if r.params.pooling == "mean" else [hidden]
        r.start = end
        if end < r.params.written:
            return Output(r)
        embedding = pool(np.concatenate(r.hidden), r.params.pooling, r.params.normalize)
        r.hidden = None
        r.finish("length")
        return Output(r, finish_reason="length", embedding=embedding, cached=r.cached)

    def _wrote(self, r: Row, end: int, logits: np.ndarray) -> Output:
        """A prompt piece r.start..end-1 written, `logits` those it kept: a scored prompt's scores; the prompt's
        end: what the row is for (its first token, or done when only scored)."""
        p = r.params
        if p.prompt_logprobs:  # position t predicts token t + 1
            scored = min(end, len(r.ids) - 1) - r.start
            r.prompt_scores = (r.prompt_scores or []) + token_logprobs(
                logits[:scored], r.ids[r.start + 1:r.start + 1 + scored], p.logprobs or 0)
        r.start = end
        if end < p.written:
            return Output(r)
        if p.max_new_tokens == 0:  # scored alone
            r.finish("length")
            return Output(r, finish_reason="length", prompt_scores=r.prompt_scores, cached=r.cached)
        out = self._begin(r, logits[-1:])
        out.prompt_scores = r.prompt_scores
        return out

    def _take(self, r: Row, logits: np.ndarray, draft: Sequence[int] = ()) -> Output:
        """logits [len(draft) + 1, V] of the row's last token and its draft -> its output: the tokens it takes (the
        accepted drafts and one more, up to an EOS token or its length); its position moves past them."""
        tokens = speculative.accept(logits, list(draft), r.params.sampling, r.seen, r.generator,
                                       r.matcher, r.counts)
        if r.drafter is not None:
            r.drafter.took(list(draft), tokens)
            self.metrics.speculated(len(draft), len(tokens) - 1)
        r.token, r.position = tokens[-1], r.position + len(tokens)
        if r.first_token_at is None:
            r.first_token_at = time.monotonic()
            self.metrics.first_token(r.first_token_at - r.created)
        out = Output(r, cached=r.cached, logprobs=None if r.params.logprobs is None else [])
        for i, token in enumerate(tokens):
            r.steps += 1
            out.tokens.append(token)
            if out.logprobs is not None:
                out.logprobs.append(token_logprobs(logits[i:i + 1], [token], r.params.logprobs or 0)[0])
            if token in r.params.eos:
                r.finish("eos")
            elif r.steps == r.params.max_new_tokens:
                r.finish("length")
            if r.finished:
                break
        self.metrics.tokens(len(out.tokens))
        out.finish_reason = r.finish_reason
        return out

    def _own(self, r: Row, work, *args):
        """`work(*args)`, a piece of row `r`'s own work -> its result; if it raises, `r` alone ends with the error
        and None is returned: the other rows go on. An error that is not llgraph's one-line kind is a bug: its
        traceback goes to stderr as well (errors.py's rule), not only its line into the row's answer."""
        try:
            return work(*args)
        except Exception as e:
            if not isinstance(e, LlgraphError):
                r.exception = e
                if self.log_bugs:
                    traceback.print_exception(e, file=sys.stderr)
            r.finish("error", described(e))
            return None


def _log(e: Exception, what: str) -> None:
    """An error the engine recovers from, on stderr: a bug's traceback (errors.py's rule), else its one line."""
    if isinstance(e, LlgraphError):
        print(f"llgraph: {what}: {described(e)}", file=sys.stderr)
    else:
        print(f"llgraph: {what}:", file=sys.stderr)
        traceback.print_exception(e, file=sys.stderr)
