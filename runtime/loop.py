"""The one decode loop every backend shares: prefill, then cached decode, then sampling.

A backend supplies two things: `allocate(batch, max_seq)` (its static KV cache, once per request) and
`forward(input_ids, position_ids) -> logits` (one step on its bound buffers). Everything else — validation, right
padding of a batch, stop conditions, sampling, streaming text — lives here once.

Batches are right-padded. That is correct with the position-indexed static cache: a pad token of row b writes
slot p >= len(b), and row b's decode token at position p overwrites slot p before any query of row b can see it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from llgraph.runtime.sampling import RequestError, Sampling, sample


class Backend:
    max_seq_len: int
    vocab_size: int

    def allocate(self, batch: int) -> None:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids: [B, S] int64 -> logits [B, S, V] (any float dtype, CPU)."""
        raise NotImplementedError


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "stop" (a stop string), or "length"


class Runner:
    def __init__(self, backend: Backend, tokenizer=None, eos_token_ids: Sequence[int] = ()):
        self.backend, self.tokenizer = backend, tokenizer
        self.eos_token_ids = set(eos_token_ids)

    # -- public API -------------------------------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int = 64, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] = (), eos_token_ids: Sequence[int] | None = None):
        """One prompt (a string or a list of token ids) -> a Generation; a list of prompts -> a list of them."""
        if len(prompts) == 0:
            raise RequestError("the prompt is empty; give at least one token")
        single = isinstance(prompts, str) or isinstance(prompts[0], numbers.Integral)  # numpy ints too
        batch = [prompts] if single else list(prompts)
        params = Sampling(temperature, top_k, top_p, repetition_penalty, seed)
        results = [Generation("", [], "length") for _ in batch]
        for row, token, reason in self._decode(batch, max_new_tokens, params, stop, eos_token_ids):
            if token is not None:
                results[row].token_ids.append(token)
            if reason:
                results[row].finish_reason = reason
        for r in results:
            r.text = _cut_at_stop(self._text(r.token_ids), stop)
        return results[0] if single else results

    def stream(self, prompt, max_new_tokens: int = 64, **kwargs) -> Iterator[str]:
        """New text pieces as they are decoded; pieces never split a multi-byte character, and they concatenate to
        generate()'s text. Stopping early (or a KeyboardInterrupt) leaves the runner usable."""
        stop = kwargs.pop("stop", ())
        eos = kwargs.pop("eos_token_ids", None)
        tokens, emitted = [], ""
        for _, token, reason in self._decode([prompt], max_new_tokens, Sampling(**kwargs), stop, eos):
            if token is not None:
                tokens.append(token)
            text = _cut_at_stop(self._text(tokens), stop)
            if not reason:
                if text.endswith("\ufffd"):
                    continue  # a multi-byte character is still incomplete
                text = text[:len(text) - _stop_prefix(text, stop)]  # may still become a stop string
            if len(text) > len(emitted):
                yield text[len(emitted):]
                emitted = text

    # -- scoring (runtime/score.py) ---------------------------------------------------------------------------------
    def score(self, context, continuation):
        """Log-probability of `continuation` after `context` (texts or token ids) -> score.Score."""
        return self.score_batch([(context, continuation)])[0]

    def score_batch(self, pairs, batch_size: int = 8):
        """[(context, continuation), ...] -> [score.Score, ...], one forward pass per batch. Texts are encoded
        as lm-evaluation-harness does: the whole string once, the continuation being what follows the context's
        own encoding (so a token spanning the boundary belongs to the continuation)."""
        from llgraph.runtime.score import score_pairs

        return score_pairs(self.backend, [self._split_pair(c, x) for c, x in pairs], batch_size)

    def perplexity(self, text, window: int | None = None, stride: int | None = None) -> tuple[float, float, int]:
        """(perplexity, summed negative log-likelihood, tokens scored) of a text or token ids, in rolling windows
        (runtime/score.py)."""
        import math

        from llgraph.runtime.score import rolling_logprob

        ids = self._encode(text)
        logprob, n = rolling_logprob(self.backend, ids, window, stride)
        return math.exp(-logprob / n), -logprob, n

    def _split_pair(self, context, continuation) -> tuple[list[int], list[int]]:
        if isinstance(context, str) != isinstance(continuation, str):
            raise RequestError("context and continuation must both be texts or both be token ids")
        if not isinstance(context, str):
            return self._encode(context), self._encode(continuation)
        spaces = len(context) - len(context.rstrip())  # as lm-eval: trailing spaces move to the continuation
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = self._encode(context + continuation), self._encode(context) if context else []
        if not ctx:
            raise RequestError("the context is empty; give at least one token of context")
        return ctx, whole[len(ctx):] if whole[:len(ctx)] == ctx else self._encode(continuation)

    # -- the loop ---------------------------------------------------------------------------------------------------
    def _decode(self, prompts, max_new_tokens, params: Sampling, stop, eos_token_ids):
        """Yields (row, new token or None, finish reason or None) as decoding goes."""
        ids = [self._encode(p) for p in prompts]
        eos = self.eos_token_ids if eos_token_ids is None else set(eos_token_ids)
        b = self.backend
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens ({max_new_tokens}) must be a positive integer")
        longest = max(len(p) for p in ids)
        if longest + max_new_tokens > b.max_seq_len:
            raise RequestError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the cache "
                               f"({b.max_seq_len} tokens); shorten the prompt, lower max_new_tokens, or raise "
                               "--max-seq-len")
        lengths = torch.tensor([len(p) for p in ids])
        tokens = torch.zeros(len(ids), longest, dtype=torch.int64)
        for row, p in enumerate(ids):
            tokens[row, :len(p)] = torch.tensor(p)
        seen = torch.zeros(len(ids), b.vocab_size, dtype=torch.bool)  # for the repetition penalty
        for row, p in enumerate(ids):
            seen[row, p] = True
        generator = params.generator()
        texts = [[] for _ in ids]
        done = [False] * len(ids)

        b.allocate(len(ids))
        positions = torch.arange(longest).expand(len(ids), longest)
        logits = b.forward(tokens, positions)
        last = logits[torch.arange(len(ids)), lengths - 1]  # each row's last real token
        pos = lengths.clone()  # the position each row's next token takes
        for step in range(max_new_tokens):
            nxt = sample(last, params, seen, generator)
            for row in range(len(ids)):
                if done[row]:
                    continue
                token = int(nxt[row])
                seen[row, token] = True
                reason = None
                if token in eos:
                    reason, token = "eos", None
                else:
                    texts[row].append(token)
                    text = self._text(texts[row]) if stop else ""
                    if any(s in text for s in stop):
                        reason = "stop"
                if reason is None and step == max_new_tokens - 1:
                    reason = "length"
                done[row] = reason is not None
                yield row, token, reason
            if all(done):
                return
            last = b.forward(nxt[:, None], pos[:, None])[:, -1]
            pos += 1

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this runner has no tokenizer; pass token ids or load a model with one")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.backend.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.backend.vocab_size - 1})")
        return ids

    def _text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""


def _cut_at_stop(text: str, stop: Sequence[str]) -> str:
    hits = [text.index(s) for s in stop if s in text]
    return text[:min(hits)] if hits else text


def _stop_prefix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that begins some stop string (held back while streaming)."""
    for k in range(min(len(text), max((len(s) for s in stop), default=0)), 0, -1):
        if any(s.startswith(text[-k:]) for s in stop):
            return k
    return 0
