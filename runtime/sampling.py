"""Next-token selection: greedy, temperature, top-k, top-p, repetition penalty; seeded and reproducible.

No value a request may carry makes the sampler produce NaN or inf: a temperature below GREEDY_BELOW is greedy, the
largest logit is subtracted before dividing by the temperature (so every scaled logit is <= 0 and exp() cannot
overflow), and top-p always keeps the most likely token. Non-finite values are refused by Sampling itself."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from llgraph.errors import LlgraphError

# A temperature below this samples greedily (vLLM's rule): 1/T past 1e5 makes any two distinct logits' probabilities
# differ by more than float32 can hold, so it is argmax already, while 1e-40 or 5e-324 would overflow the division.
GREEDY_BELOW = 1e-5


class RequestError(LlgraphError):
    """A generate() request that cannot be served; one line naming the bad value."""


@dataclass(frozen=True)
class Sampling:
    """temperature 0 (or below GREEDY_BELOW, or top_k 1) is greedy. top_k 0 and top_p 1 disable those filters.
    repetition_penalty follows CTRL/HF: a logit of a token already in the sequence is divided by it when positive,
    multiplied when negative."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise RequestError(f"temperature ({self.temperature}) must be >= 0 and finite (0 is greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k ({self.top_k}) must be an integer >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p ({self.top_p}) must be in (0, 1]")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise RequestError(f"repetition_penalty ({self.repetition_penalty}) must be > 0 (1 disables it)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is None:
            g.seed()  # nondeterministic, from the OS
        else:
            g.manual_seed(self.seed)
        return g


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits: [B, V]; seen: [B, V] bool, the tokens already in each row's sequence."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """-inf outside the top_k largest and outside the smallest set whose probability reaches top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep a token while the mass before it is < top_p
        drop[..., 0] = False  # and always the most likely one (a top_p below float32's range rounds to 0)
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: Sampling, seen: torch.Tensor, generator: torch.Generator,
           allowed: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, V] float -> next tokens [B] int64. `allowed`: [B, V] bool, the only tokens a row may take (a
    grammar's mask: runtime/grammar.py), applied before anything else."""
    if params.greedy:  # numpy's argmax (the same first-maximum rule): 8 us on a 49k-vocab row here, torch's 80 us
        return torch.from_numpy(np.argmax(_processed(logits, params, seen, allowed).numpy(), axis=-1))
    return torch.multinomial(distribution(logits, params, seen, allowed), 1, generator=generator)[:, 0]


def distribution(logits: torch.Tensor, params: Sampling, seen: torch.Tensor,
                 allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The probabilities [B, V] a sampled (not greedy) row draws from: penalty, mask, temperature, top-k, top-p."""
    logits = _processed(logits, params, seen, allowed)
    # the top logit becomes 0 and every other one <= 0, whatever the temperature (a penalty's overflow to +inf is
    # clamped first, so inf - inf cannot make a NaN)
    logits = logits.clamp(max=torch.finfo(logits.dtype).max)
    logits = filter_logits((logits - logits.amax(-1, keepdim=True)) / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(-1)
    if not torch.isfinite(probs).all():
        raise RequestError("the model's logits are not finite (NaN); this request cannot be sampled")
    return probs


def _processed(logits: torch.Tensor, params: Sampling, seen: torch.Tensor, allowed: torch.Tensor | None):
    logits = apply_repetition_penalty(logits.float(), seen, params.repetition_penalty)
    if allowed is not None:
        if not allowed.any(-1).all():
            raise RequestError("the grammar allows no token here; the output cannot continue")
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits
