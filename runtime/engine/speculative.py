"""Speculative decoding: draft a few tokens cheaply, verify them all in one forward of k+1 positions per row. A
decode step reads every weight once whatever its length, so each accepted draft token is a token for (nearly) free.

Drafts come from prompt lookup ("ngram"): the tokens that followed the most recent earlier occurrence of the row's
last 3 (else 2) tokens, in its own prompt and output. The static cache makes verification simple: the
step writes positions p..p+k, and a rejected tail is overwritten by the next step before any query can see it.

`accept` walks the k+1 positions in order with the same sampler as plain decoding (penalty, grammar mask,
temperature, top-k, top-p), so:
- greedy: the sampler's token at each position; a draft token is kept while it equals it, the first that differs is
  replaced by it: the output equals plain greedy decoding token for token;
- sampled: the draft is a point mass q = δ(d), so the standard rule (Leviathan et al. 2023, Chen et al. 2023)
  keeps d with probability min(1, p(d)/q(d)) = p(d), and on rejection draws from the residual
  norm(max(0, p - q)) = p without d: each emitted token has exactly plain sampling's distribution.
After k accepted drafts the last position's distribution gives one more token. Draft length adapts per row: it
doubles (to MAX_DRAFT) while every draft is accepted, falls to one past what was accepted otherwise, and a row whose
drafts keep failing stops drafting for a while (its steps are plain one-token steps).
"""

from __future__ import annotations

import numpy as np

from llgraph.errors import RequestError
from llgraph.runtime.engine.backend import Backend
from llgraph.runtime.engine.packed import Packed
from llgraph.runtime.engine.sampling import Sampling, distribution, draw, sample

MODES = ("off", "ngram")  # or a draft model's runner
MAX_NGRAM = 3
MIN_NGRAM = 3  # shorter matches guess badly in open text (measured: bigrams kept 0 of 7 drafts in open chat)
MAX_DRAFT = 8
FIRST_DRAFT = 2
PAUSE = 8  # plain steps after three drafts in a row that gained nothing


def check_mode(mode):
    """"off", "ngram", or a draft model: a Runner (any backend) over a smaller model sharing the tokenizer."""
    if isinstance(mode, str) and mode in MODES or hasattr(mode, "backend") and hasattr(mode, "tokenizer"):
        return mode
    raise RequestError(f"speculative ({mode!r}) must be one of {', '.join(MODES)} or a draft model's runner")


def check_served_mode(mode, draft: bool) -> str:
    """A scheduler request's mode (a server request's "speculative"): "off", "ngram", or "draft" where the scheduler
    has a draft model (`draft`) of its own."""
    if mode == "draft" and not draft:
        raise RequestError("speculative 'draft' needs a draft model and this server has none (it starts with one by "
                           "--speculative draft=MODEL); ask for 'ngram' or 'off'")
    if mode not in (*MODES, "draft"):
        raise RequestError(f"speculative ({str(mode)[:40]!r}) must be one of {', '.join(MODES)}"
                           f"{', draft' if draft else ''}")
    return mode


def check_draft_max(draft_max) -> int:
    """The most tokens a row may draft in one step (llama.cpp's --draft-max, vLLM's num_speculative_tokens)."""
    if not isinstance(draft_max, int) or isinstance(draft_max, bool) or draft_max < 1:
        raise RequestError(f"draft_max ({draft_max!r}) must be an integer >= 1: the most tokens a step drafts")
    return draft_max


def check_draft(target, draft) -> None:
    """A draft model must share the target's vocabulary (the same ids mean the same tokens) and hold its cache."""
    vocab = (target.backend.vocab_size, draft.backend.vocab_size)
    same = vocab[0] == vocab[1] and (target.tokenizer is None) == (draft.tokenizer is None) and (
        target.tokenizer is None or target.tokenizer.tk.get_vocab(True) == draft.tokenizer.tk.get_vocab(True))
    if not same:
        raise RequestError(f"the draft model's vocabulary ({vocab[1]} tokens) is not the model's ({vocab[0]}); a "
                           "draft model must share the tokenizer")
    if draft.backend.max_seq_len < target.backend.max_seq_len:
        raise RequestError(f"the draft model's cache ({draft.backend.max_seq_len} tokens) is shorter than the "
                           f"model's ({target.backend.max_seq_len}); open it with the same --max-seq-len")


class Lookup:
    """One row's tokens (prompt and output) and, for each n-gram (n <= MAX_NGRAM), where its latest occurrence's
    continuation starts: propose() is a dictionary lookup, extend() is O(MAX_NGRAM) a token."""

    def __init__(self, tokens):
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            i = len(self.tokens)
            for n in range(MIN_NGRAM, min(MAX_NGRAM, i) + 1):  # the n-grams ending just before token i go on with it
                self._next[tuple(self.tokens[i - n:i])] = i
            self.tokens.append(int(t))

    def propose(self, k: int) -> list[int]:
        for n in range(min(MAX_NGRAM, len(self.tokens)), MIN_NGRAM - 1, -1):
            start = self._next.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start:start + k]
        return []


class DraftLength:
    """How many tokens a row drafts next, from how its last drafts fared."""

    def __init__(self, limit: int = MAX_DRAFT):
        self.limit = limit  # checked where a request gives it (check_draft_max)
        self.k, self.misses, self.paused = min(FIRST_DRAFT, limit), 0, 0

    def next(self) -> int:
        if self.paused:
            self.paused -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self.k = min(2 * self.k, self.limit) if accepted == drafted else min(max(accepted + 1, 1), self.limit)
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= 3:
            self.misses, self.paused, self.k = 0, PAUSE, 1


def accept(logits: np.ndarray, draft: list[int], params: Sampling, seen: np.ndarray,
           generator: np.random.Generator, matcher=None, counts: np.ndarray | None = None) -> list[int]:
    """logits [len(draft) + 1, V]: position i predicts the token after draft[:i] -> the tokens to emit: the accepted
    drafts, then the sampler's own token (a correction, or one more after all were accepted). `seen` ([1, V], the
    repetition penalty's), `counts` ([1, V], the output's, for the frequency and presence penalties) and `matcher`
    (a grammar's) advance with each emitted token."""
    out: list[int] = []
    vocab = logits.shape[-1]
    for i in range(len(draft) + 1):
        allowed = None if matcher is None else matcher.allowed(vocab)[None]
        d = draft[i] if i < len(draft) else None
        row = logits[i:i + 1]
        if params.greedy or d is None:  # the plain sampler itself: a step without a draft is a plain step
            token = int(sample(row, params, seen, generator, allowed, counts)[0])
        else:
            probs = distribution(row, params, seen, allowed, counts)[0]
            if generator.random() < float(probs[d]):
                token = d
            else:  # the residual: p without the rejected draft token (p(d) < 1 here)
                probs[d] = 0
                token = draw(probs, generator)
        out.append(token)
        seen[0, token] = True
        if counts is not None:
            counts[0, token] += 1
        if matcher is not None:
            matcher.advance(token)
        if token != d:
            return out
    return out


class Drafter:
    """One request's drafting: its tokens' lookup and its adaptive draft length."""

    def __init__(self, tokens, draft_max: int = MAX_DRAFT):
        self.lookup, self.length = Lookup(tokens), DraftLength(draft_max)

    def draft(self, room: int) -> list[int]:
        """Up to `room` tokens (what the request's length and the cache leave)."""
        k = min(self.length.next(), room)
        return self.lookup.propose(k) if k > 0 else []

    def took(self, draft: list[int], emitted: list[int]) -> None:
        self.length.update(len(draft), len(emitted) - 1)
        self.lookup.extend(emitted)


class ModelDrafter:
    """One row's drafting by a draft model: its greedy tokens (a deterministic draft, so the same acceptance rule
    keeps the distribution), from its own cache row, which holds the row's tokens up to `valid`. `next` is its greedy
    token after all of them, None until the tokens it lacks are written (lazily: draft_together writes every row's
    in one forward)."""

    def __init__(self, backend: Backend, row: int, tokens: list[int], draft_max: int = MAX_DRAFT):
        self.backend, self.row, self.tokens, self.valid = backend, row, list(tokens), 0
        self.length = DraftLength(draft_max)
        self.next: int | None = None

    def draft(self, room: int) -> list[int]:
        """Up to `room` tokens: draft_together of this row alone."""
        return draft_together([self], [room])[0]

    def took(self, draft: list[int], emitted: list[int]) -> None:
        self.length.update(len(draft), len(emitted) - 1)
        if self.next is not None:  # it drafted from a written row: the accepted drafts it wrote are valid too
            kept = min(len(emitted) - 1, max(len(draft) - 1, 0))
            self.valid = len(self.tokens) + kept
        self.tokens += emitted
        self.next = None  # written by the next draft (or draft_together), with the other rows'


def draft_together(drafters: list[ModelDrafter], rooms: list[int]) -> list[list[int]]:
    """Each row's draft (up to its room) from one draft model, its forwards batched across the rows: one packed
    step writes what every row's cache row lacks, then one step per drafted position runs every row still drafting
    (runtime/engine/packed.py, on any backend). A row's draft does not depend on the others'."""
    backend = drafters[0].backend
    stale = [d for d in drafters if d.next is None]
    if stale:
        batch = Packed()
        for d in stale:
            batch.add(d.row, d.tokens[d.valid:], d.valid, kept=1)
        for d, logits in zip(stale, batch.run(backend)):
            d.next, d.valid = int(logits[-1].argmax()), len(d.tokens)
    ks = [min(d.length.next(), room) for d, room in zip(drafters, rooms)]
    drafts: list[list[int]] = []
    for d, k in zip(drafters, ks):
        assert d.next is not None  # every stale row was written above
        drafts.append([d.next] if k > 0 else [])
    for i in range(1, max(ks, default=0)):  # drafted token i - 1 of each row still drafting, at its position
        batch = Packed()
        active = [j for j, k in enumerate(ks) if k > i]
        for j in active:
            batch.add(drafters[j].row, [drafts[j][-1]], len(drafters[j].tokens) + i - 1, kept=1)
        for j, logits in zip(active, batch.run(backend)):
            drafts[j].append(int(logits[-1].argmax()))
    return drafts


