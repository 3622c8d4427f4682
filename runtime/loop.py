"""The one decode loop every backend shares: prefill, then cached decode, then sampling.

A backend supplies two things: `allocate(batch)` (its static KV cache, once per request) and
`forward(input_ids, position_ids, rows=None, keep=0) -> logits` (one step on its bound buffers, or on a range of
their rows; with `keep`, at least the last `keep` positions' logits). Everything else — validation, right padding
of a batch, stop conditions, sampling, streaming text — lives here once.

Batches are right-padded. That is correct with the position-indexed static cache: a pad token of row b writes
slot p >= len(b), and row b's decode token at position p overwrites slot p before any query of row b can see it.
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from llgraph.builder import DEFAULT_MAX_SEQ
from llgraph.errors import LlgraphError
from llgraph.runtime.grammar import row_masks
from llgraph.runtime.prefix import MIN_REUSE, shared_prefix
from llgraph.runtime.sampling import RequestError, Sampling, sample
from llgraph.runtime.speculative import MAX_DRAFT, check_draft, check_draft_max, check_mode
from llgraph.runtime.speculative import decode as speculative_decode


def cache_length(requested: int | None, limit: int, what: str) -> int:
    """The KV-cache length for a runner: `requested` (default min(2048, limit)), refused when out of 2..limit."""
    if requested is None:
        return min(DEFAULT_MAX_SEQ, limit)
    if not isinstance(requested, int) or requested < 2:
        raise LlgraphError(f"--max-seq-len ({requested}) must be at least 2 tokens")
    if requested > limit:
        raise LlgraphError(f"--max-seq-len ({requested}) exceeds {what} ({limit} positions); lower it, or "
                           f"re-export with `llgraph export --max-seq-len {requested}`")
    return requested


class Backend:
    max_seq_len: int
    vocab_size: int
    # whether one forward may run several rows of more than one token after a cached prefix (speculative
    # verification); ONNX Runtime's GroupQueryAttention takes only one such row (runtime/ort.py sets False)
    multi_token_rows: bool = True

    def allocate(self, batch: int) -> None:
        raise NotImplementedError

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: slice | None = None,
                keep: int = 0) -> np.ndarray:
        """input_ids, position_ids: [B, S] int64 numpy arrays -> logits [B, K, V] (a float numpy array: float32,
        float16 or ml_dtypes' bfloat16) of the last K positions:
        K = S when `keep` is 0, else min(keep, S) or more (an engine whose graph has no logits_to_keep input gives
        all S). `rows`: run on that contiguous range of the allocated cache's rows only (B == its length; the
        scheduler prefills one slot while the others keep their caches); None: all of them."""
        raise NotImplementedError

    def copy_prefix(self, src: int, dst: int, length: int) -> bool:
        """Copies cache positions 0..length-1 of row `src` into row `dst` (the scheduler's prefix reuse); False where
        this backend cannot."""
        return False


ROLES = ("system", "developer", "user", "assistant", "tool")  # a conversation's roles (OpenAI's)


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "stop" (a stop string), or "length"


class Runner:
    # a batch whose prompts share a prefix prefills it once, in row 0, and copies it to the other rows
    reuse_prefixes = True

    def __init__(self, backend: Backend, tokenizer=None, eos_token_ids: Sequence[int] = ()):
        self.backend, self.tokenizer = backend, tokenizer
        self.eos_token_ids = set(eos_token_ids)

    # -- public API -------------------------------------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int = 64, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int | None = None,
                 stop: Sequence[str] = (), eos_token_ids: Sequence[int] | None = None, grammar=None,
                 speculative: str = "off", draft_max: int = MAX_DRAFT):
        """One prompt (a string, a list of token ids, or a conversation: a list of {"role", "content"} messages,
        rendered with the model's chat template) -> a Generation; a list of prompts -> a list of them.
        `grammar`: a runtime.grammar.Grammar (e.g. Grammar.json_schema(schema)) every output must follow.
        `speculative`: "ngram" drafts tokens by prompt lookup and verifies them in one step (runtime/speculative.py):
        the same greedy output, the same sampling distribution, fewer steps where the output repeats its context;
        `draft_max` bounds the tokens drafted a step (the length adapts below it)."""
        if len(prompts) == 0:
            raise RequestError("the prompt is empty; give at least one token")
        single = isinstance(prompts, str) or isinstance(prompts[0], (numbers.Integral, dict))  # numpy ints too
        batch = [prompts] if single else list(prompts)
        params = Sampling(temperature, top_k, top_p, repetition_penalty, seed)
        seqs = []
        for seqs in self._decode(batch, max_new_tokens, params, stop, eos_token_ids, grammar,
                                 self._speculation(speculative), draft_max=check_draft_max(draft_max)):
            pass
        results = [Generation(s.text(), s.tokens, s.finish_reason) for s in seqs]
        return results[0] if single else results

    def chat(self, messages: list[dict], max_new_tokens: int = 64, **kwargs) -> Generation:
        """The assistant's reply to a conversation ([{"role": "system" | "user" | "assistant", "content": ...}]),
        through the model's chat template: generate() on the rendered prompt. stream() takes a conversation too."""
        if not messages or not isinstance(messages[0], dict):
            raise RequestError('chat takes a list of messages: [{"role": "user", "content": "Hi"}, ...]')
        return self.generate(messages, max_new_tokens, **kwargs)

    def render_chat(self, messages: list[dict]) -> str:
        """A conversation as the model's chat template writes it, ready for the assistant's turn (the one place a
        conversation is checked and rendered: generate, stream, chat and the server's chat completions)."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise RequestError("this model has no chat template; give it a plain prompt instead of messages")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise RequestError(f"each message is {{'role': str, 'content': str}}; got {str(m)[:60]}")
            if m["role"] not in ROLES:
                raise RequestError(f"message role {m['role']!r} is not one of {', '.join(ROLES)}")
        return self.tokenizer.apply_chat_template(list(messages))

    def stream(self, prompt, max_new_tokens: int = 64, **kwargs) -> Iterator[str]:
        """New text pieces as they are decoded; pieces never split a multi-byte character, and they concatenate to
        generate()'s text. Stopping early (or a KeyboardInterrupt) leaves the runner usable. `stats` (a dict) is
        filled once the stream ends: prompt_tokens, prefill_s (to the first token), new_tokens, decode_s."""
        stop = kwargs.pop("stop", ())
        eos = kwargs.pop("eos_token_ids", None)
        stats = kwargs.pop("stats", None)  # a dict to fill: prompt_tokens, prefill_s, new_tokens, decode_s
        grammar = kwargs.pop("grammar", None)
        speculative = self._speculation(kwargs.pop("speculative", "off"))
        draft_max = check_draft_max(kwargs.pop("draft_max", MAX_DRAFT))
        start = first = time.perf_counter()
        seq, counts = None, {}
        for (seq,) in self._decode([prompt], max_new_tokens, Sampling(**kwargs), stop, eos, grammar, speculative,
                                   counts, draft_max):
            if seq.steps <= 1:
                first = time.perf_counter()  # prefill done and its token sampled
            piece = seq.new_text()
            if piece:
                yield piece
        if stats is not None and seq is not None:
            stats.update(prompt_tokens=len(self.encode(prompt)), prefill_s=first - start,
                         new_tokens=seq.steps, decode_s=time.perf_counter() - first, **counts)

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

        ids = self.encode(text)
        logprob, n = rolling_logprob(self.backend, ids, window, stride)
        return math.exp(-logprob / n), -logprob, n

    def _split_pair(self, context, continuation) -> tuple[list[int], list[int]]:
        if isinstance(context, str) != isinstance(continuation, str):
            raise RequestError("context and continuation must both be texts or both be token ids")
        if not isinstance(context, str):
            return self.encode(context), self.encode(continuation)
        spaces = len(context) - len(context.rstrip())  # as lm-eval: trailing spaces move to the continuation
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = self.encode(context + continuation), self.encode(context) if context else []
        if not ctx:
            raise RequestError("the context is empty; give at least one token of context")
        return ctx, whole[len(ctx):] if whole[:len(ctx)] == ctx else self.encode(continuation)

    # -- the loop ---------------------------------------------------------------------------------------------------
    def _speculation(self, mode):
        mode = check_mode(mode)
        if not isinstance(mode, str):
            check_draft(self, mode)
        return mode

    def _decode(self, prompts, max_new_tokens, params: Sampling, stop, eos_token_ids, grammar=None,
                speculative="off", counts=None, draft_max: int = MAX_DRAFT):
        """Yields the batch's Decodings after each step, as decoding goes. `counts` gains speculation's drafted and
        accepted tokens."""
        counts = {} if counts is None else counts
        ids = [self.encode(p) for p in prompts]
        eos = self.eos_token_ids if eos_token_ids is None else set(eos_token_ids)
        b = self.backend
        self.check_room(max(len(p) for p in ids), max_new_tokens)
        lengths = np.array([len(p) for p in ids])
        seen = np.zeros((len(ids), b.vocab_size), np.bool_)  # for the repetition penalty
        for row, p in enumerate(ids):
            seen[row, p] = True
        generator = params.generator()
        seqs = [Decoding(self.text_of, max_new_tokens, stop, eos) for _ in ids]
        matchers = [grammar.matcher(self.tokenizer, b.vocab_size, eos) if grammar else None for _ in ids]

        b.allocate(len(ids))
        last = self._prefill(ids)
        pos = lengths.copy()  # the position each row's next token takes
        while True:
            live = [m if s.finish_reason is None else None for m, s in zip(matchers, seqs)]
            nxt = sample(last, params, seen, generator, row_masks(live, b.vocab_size))
            for row, seq in enumerate(seqs):
                if seq.finish_reason is None:
                    seen[row, int(nxt[row])] = True
                    if matchers[row] is not None:
                        matchers[row].advance(int(nxt[row]))
                    seq.push(int(nxt[row]))
            yield seqs
            if all(s.finish_reason for s in seqs):
                return
            if speculative != "off":
                yield from speculative_decode(b, seqs, ids, nxt, pos, params, seen, generator, matchers, counts,
                                              speculative, draft_max)
                return
            last = b.forward(nxt[:, None], pos[:, None], keep=1)[:, -1]
            pos += 1

    def _prefill(self, ids: list[list[int]]) -> np.ndarray:
        """Writes the prompts into the allocated rows -> each row's last-token logits [B, V]. A prefix every prompt
        shares (MIN_REUSE tokens or more, short of the shortest prompt's last token) is computed once, in row 0,
        and copied to the other rows (Backend.copy_prefix; probed with an empty copy), then the tails follow."""
        b = self.backend
        shared = shared_prefix(ids) if self.reuse_prefixes and len(ids) > 1 else 0
        if shared < MIN_REUSE or not b.copy_prefix(0, 0, 0):
            return _last_logits(b, ids, 0, None)
        b.forward(np.array([ids[0][:shared]], np.int64), np.arange(shared)[None], rows=slice(0, 1), keep=1)
        for row in range(1, len(ids)):
            b.copy_prefix(0, row, shared)
        tails = [p[shared:] for p in ids]
        if b.multi_token_rows:
            return _last_logits(b, tails, shared, None)
        # ONNX Runtime's GroupQueryAttention: one row of several tokens after a cached prefix per forward
        return np.concatenate([_last_logits(b, [t], shared, slice(r, r + 1)) for r, t in enumerate(tails)])

    def check_room(self, prompt_tokens: int, max_new_tokens) -> None:
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens ({max_new_tokens}) must be a positive integer")
        if prompt_tokens + max_new_tokens > self.backend.max_seq_len:
            raise RequestError(f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                               f"cache ({self.backend.max_seq_len} tokens); shorten the prompt, lower "
                               "max_new_tokens, or raise --max-seq-len")

    def encode(self, prompt) -> list[int]:
        if not isinstance(prompt, str) and len(prompt) and isinstance(prompt[0], dict):  # a conversation
            prompt = self.render_chat(prompt)
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

    def text_of(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""


def _last_logits(backend: Backend, rows: list[list[int]], start: int, span: slice | None) -> np.ndarray:
    """One right-padded forward of `rows` (row r's tokens at positions start..) on the allocated rows (`span`: a
    range of them) -> each row's last-token logits [B, V]. Only the positions from the shortest row's last token on
    are asked for (one row of the head for a single prompt)."""
    lengths = np.array([len(r) for r in rows])
    longest = int(lengths.max())
    tokens = np.zeros((len(rows), longest), np.int64)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    positions = np.broadcast_to(np.arange(start, start + longest), tokens.shape)
    logits = backend.forward(tokens, positions, rows=span, keep=longest - int(lengths.min()) + 1)
    return logits[np.arange(len(rows)), lengths - 1 - (longest - logits.shape[1])]


class Decoding:
    """One request's decoding state, shared by Runner's batch loop and the scheduler: its tokens, the finish rule
    (an EOS token, a stop string, max_new_tokens) and the text a stream may show so far."""

    def __init__(self, text_of, max_new_tokens: int, stop=(), eos=()):
        self.text_of, self.max_new_tokens, self.stop, self.eos = text_of, max_new_tokens, tuple(stop), set(eos)
        self.tokens: list[int] = []
        self.steps = 0
        self.finish_reason: str | None = None  # "eos", "stop" or "length"
        self._shown = ""
        self._decoded = (0, "")  # (tokens decoded, their text): each step decodes once, not once per caller

    def push(self, token: int) -> str | None:
        """A sampled token -> the finish reason, once finished (an EOS token is not kept)."""
        self.steps += 1
        if token in self.eos:
            self.finish_reason = "eos"
        else:
            self.tokens.append(token)
            if self.stop and any(s in self._full_text() for s in self.stop):
                self.finish_reason = "stop"
        if self.finish_reason is None and self.steps == self.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason

    def _full_text(self) -> str:
        if self._decoded[0] != len(self.tokens):
            self._decoded = (len(self.tokens), self.text_of(self.tokens))
        return self._decoded[1]

    def text(self) -> str:
        return _cut_at_stop(self._full_text(), self.stop)

    def new_text(self) -> str:
        """The text since the last call. Until finished it holds back an incomplete multi-byte character and an end
        that may still become a stop string, so the pieces concatenate to text()."""
        text = self.text()
        if self.finish_reason is None:
            if text.endswith("\ufffd"):
                return ""
            text = text[:len(text) - _stop_prefix(text, self.stop)]
        if len(text) <= len(self._shown):
            return ""
        piece, self._shown = text[len(self._shown):], text
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
