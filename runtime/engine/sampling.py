"""Next-token selection: greedy, temperature, top-k, top-p, min-p, repetition penalty; seeded and reproducible.

No value a request may carry makes the sampler produce NaN or inf: a temperature below GREEDY_BELOW is greedy, the
largest logit is subtracted before dividing by the temperature (so every scaled logit is <= 0 and exp() cannot
overflow), and top-p always keeps the most likely token. Non-finite values are refused by Sampling itself."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from llgraph.errors import RequestError

# A temperature below this samples greedily (vLLM's rule): 1/T past 1e5 makes any two distinct logits' probabilities
# differ by more than float32 can hold, so it is argmax already, while 1e-40 or 5e-324 would overflow the division.
GREEDY_BELOW = 1e-5
SEED_SPAN = 1 << 64  # seeds are taken modulo this (numpy's generators take seeds >= 0)


@dataclass(frozen=True)
class Sampling:
    """temperature 0 (or below GREEDY_BELOW, or top_k 1) is greedy. top_k 0 and top_p 1 disable those filters.
    repetition_penalty follows CTRL/HF: a logit of a token already in the sequence is divided by it when positive,
    multiplied when negative. frequency_penalty and presence_penalty follow OpenAI: a token's logit less
    frequency_penalty x the times the output holds it, less presence_penalty if it holds it at all (the output's
    tokens, as vLLM counts them). logit_bias: (token id, bias) pairs added to the logits; a bias of -100 bans the
    token. min_p keeps the tokens whose probability is at least min_p times the most likely one's (0 disables it).
    In that order, before a grammar's mask, temperature, top-k, top-p and min-p (vLLM's order: the filters see the
    tempered distribution): on every path, greedy, sampled, speculative (drafts are accepted against the filtered
    distribution) and grammar-constrained."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise RequestError(f"temperature ({self.temperature}) must be >= 0 and finite (0 is greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k ({self.top_k}) must be an integer >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p ({self.top_p}) must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p ({self.min_p}) must be in [0, 1] (0 disables it)")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise RequestError(f"repetition_penalty ({self.repetition_penalty}) must be > 0 (1 disables it)")
        if self.seed is not None and (not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool)):
            raise RequestError(f"seed ({self.seed!r}) must be an integer (any, negative too) or None")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(f"{name} ({getattr(self, name)}) must be in [-2, 2] (0 disables it)")
        for token, bias in self.logit_bias:
            if not (isinstance(token, int) and token >= 0 and -100 <= bias <= 100):
                raise RequestError(f"logit_bias maps token ids (>= 0) to biases in [-100, 100]; not {token}: {bias}")

    @property
    def counts_output(self) -> bool:
        """Whether sampling needs the output's token counts (frequency or presence penalty)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def generator(self) -> np.random.Generator:
        """numpy's PCG64, seeded by `seed` modulo 2**64 (None: fresh entropy from the OS). Every integer is a seed:
        OpenAI's `seed` is a signed 64-bit integer, numpy takes only non-negative ones, so -5 seeds as 2**64 - 5."""
        return np.random.default_rng(None if self.seed is None else int(self.seed) % SEED_SPAN)


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """logits: [B, V]; seen: [B, V] bool, the tokens already in each row's sequence."""
    if penalty == 1.0:
        return logits
    with np.errstate(divide="ignore", over="ignore"):  # a tiny penalty overflows to inf, clamped by distribution()
        penalized = np.where(logits > 0, logits / np.float32(penalty), logits * np.float32(penalty))
    return np.where(seen, penalized, logits)


def filter_logits(logits: np.ndarray, top_k: int, top_p: float, min_p: float = 0.0) -> np.ndarray:
    """-inf outside the top_k largest, outside the smallest set whose probability reaches top_p, and below min_p
    times the largest probability (logits: [B, V], tempered)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = -np.partition(-logits, top_k - 1, axis=-1)[..., top_k - 1:top_k]
        logits = np.where(logits < kth, -np.inf, logits).astype(logits.dtype)
    if top_p < 1.0:
        probs = _softmax(logits)
        keep = np.zeros(logits.shape, np.bool_)
        rows = keep.reshape(-1, logits.shape[-1])  # a view: rows of the mask
        for row, p in enumerate(probs.reshape(-1, probs.shape[-1])):
            rows[row, _nucleus(p, top_p)] = True
        logits = np.where(keep, logits, -np.inf).astype(logits.dtype)
    if min_p > 0:  # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed
        floor = logits.max(-1, keepdims=True) + np.float32(math.log(min_p))
        logits = np.where(logits >= floor, logits, -np.inf).astype(logits.dtype)
    return logits


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The indices top_p keeps of one row: in descending probability (ties by index), each token while the mass
    before it is < top_p, and always the first (a top_p below float32's range rounds to 0). Sorted among the few
    most likely candidates only (a full sort of a 49k vocabulary took 5 ms a token): the answer is the full sort's
    once the kept tokens all outweigh every token left out of the candidates, else the candidates grow."""
    n, k = probs.shape[-1], 256
    while True:
        candidates = np.arange(n) if k >= n else np.argpartition(-probs, k - 1)[:k]
        order = candidates[np.lexsort((candidates, -probs[candidates]))]
        ranked = probs[order]
        drop = np.cumsum(ranked, dtype=np.float64) - ranked >= top_p
        drop[0] = False
        kept = order[~drop]
        if k >= n or (drop.any() and probs[kept[-1]] > ranked[-1]):
            return kept
        k *= 8


def sample(logits: np.ndarray, params: Sampling, seen: np.ndarray, generator: np.random.Generator,
           allowed: np.ndarray | None = None, counts: np.ndarray | None = None) -> np.ndarray:
    """logits: [B, V] float -> next tokens [B] int64. `allowed`: [B, V] bool, the only tokens a row may take (a
    grammar's mask: runtime/engine/grammar.py). `counts`: [B, V], how often each token is in the output so far (the
    frequency and presence penalties'; None: none yet)."""
    if params.greedy:
        return np.argmax(_processed(logits, params, seen, allowed, counts), axis=-1)
    return np.array([draw(p, generator) for p in distribution(logits, params, seen, allowed, counts)], np.int64)


def draw(probs: np.ndarray, generator: np.random.Generator) -> int:
    """One index drawn with probabilities `probs` [V] (summing to about 1; a zero-probability index is never drawn):
    the first whose cumulative sum passes a uniform draw scaled to the total."""
    cdf = np.cumsum(probs, dtype=np.float64)
    i = int(np.searchsorted(cdf, generator.random() * cdf[-1], side="right"))
    return int(np.flatnonzero(probs)[-1]) if i >= len(probs) else i  # only a draw of exactly the total lands past


def distribution(logits: np.ndarray, params: Sampling, seen: np.ndarray,
                 allowed: np.ndarray | None = None, counts: np.ndarray | None = None) -> np.ndarray:
    """The probabilities [B, V] a sampled (not greedy) row draws from: penalties, bias, mask, temperature, top-k,
    top-p."""
    logits = _processed(logits, params, seen, allowed, counts)
    # the top logit becomes 0 and every other one <= 0, whatever the temperature (a penalty's overflow to +inf is
    # clamped first, so inf - inf cannot make a NaN)
    logits = np.minimum(logits, np.finfo(logits.dtype).max)
    with np.errstate(over="ignore"):  # a logit far below the top may become -inf: probability 0, as it should
        scaled = (logits - logits.max(-1, keepdims=True)) / np.float32(params.temperature)
    probs = _softmax(filter_logits(scaled, params.top_k, params.top_p, params.min_p))
    if not np.isfinite(probs).all():
        raise RequestError("the model's logits are not finite (NaN); this request cannot be sampled")
    return probs


def _softmax(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):  # a NaN row stays NaN, for the caller to refuse
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)


def _processed(logits: np.ndarray, params: Sampling, seen: np.ndarray, allowed: np.ndarray | None,
               counts: np.ndarray | None = None):
    logits = apply_repetition_penalty(np.asarray(logits, np.float32), seen, params.repetition_penalty)
    if counts is not None and params.counts_output:
        logits = logits - (np.float32(params.frequency_penalty) * counts
                           + np.float32(params.presence_penalty) * (counts > 0)).astype(np.float32)
    if params.logit_bias:
        logits = np.array(logits, np.float32)  # a copy: the caller's logits stay as they were
        vocab = logits.shape[-1]
        for token, bias in params.logit_bias:
            if token < vocab:
                logits[:, token] = -np.inf if bias <= -100 else logits[:, token] + np.float32(bias)
    if allowed is not None:
        if not allowed.any(-1).all():
            raise RequestError("the grammar allows no token here; the output cannot continue")
        logits = np.where(allowed, logits, -np.inf).astype(np.float32)
    return logits
