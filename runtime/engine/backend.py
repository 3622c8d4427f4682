"""What the engine needs of a backend: `allocate(batch)` (its static KV cache) and `forward(input_ids, position_ids,
rows=None, keep=0) -> logits` (one step on its bound buffers, or on some of their rows), and optionally
`copy_prefix`. Each backend (runtime/backends/) implements it; everything else lives in the engine once.

Rows: a `ragged` backend (its graph's attention reads each token's cache row, passes.ragged_slots) runs any cache
rows in any order, several rows' tokens packed into one batch row (`rows` [B, S], each token's row); the others run
one contiguous range of rows (`span_of`), and an engine step over rows with holes between them runs the holes too.

Batches are right-padded. That is correct with the position-indexed static cache: a pad token of row b writes
slot p >= len(b), and row b's decode token at position p overwrites slot p before any query of row b can see it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llgraph.builder import DEFAULT_MAX_SEQ
from llgraph.errors import LlgraphError
from llgraph.kv_cache import ring_length, ring_step, row_bytes

if TYPE_CHECKING:
    from llgraph.config import LlamaConfig
    from llgraph.kv_cache import KvFormat


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


Rows = slice | Sequence[int] | np.ndarray | None  # forward's `rows`: see Backend.forward


def token_rows(rows: Rows, shape: tuple[int, int]) -> np.ndarray | None:
    """`rows` as each token's cache row, flat [B * S] int64 (a ragged graph's slot_ids); None: row b for batch row b."""
    if rows is None:
        return None
    if isinstance(rows, slice):
        rows = np.arange(rows.start or 0, rows.stop)
    rows = np.asarray(rows, np.int64)
    return np.ascontiguousarray(np.broadcast_to(rows.reshape(shape[0], -1), shape)).reshape(-1)


def in_pieces(run, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows, keep: int, step: int):
    """One forward as executions of at most `step` positions along S, in order (each row's tokens stay in order,
    and a row writes no more than `step` positions an execution: a ring's bound, Backend.pieces).
    run(input_ids, position_ids, rows, keep) -> (logits [B, K, V], hidden [B, s, H] or None) of a piece; -> the
    forward's: the logits `keep` asks for (all S when 0) and every position's hidden states (or None)."""
    batch, seq = input_ids.shape
    if seq <= step:
        return run(input_ids, position_ids, rows, keep)
    flat = token_rows(rows, input_ids.shape)
    per_token = None if flat is None else flat.reshape(batch, seq)
    first = seq - (min(keep, seq) if keep > 0 else seq)  # the first position whose logits leave
    logits, hidden = [], []
    for a in range(0, seq, step):
        b = min(seq, a + step)
        need = b - max(a, first)
        got, states = run(input_ids[:, a:b], position_ids[:, a:b], None if per_token is None else per_token[:, a:b],
                          (need if keep > 0 else 0) if need > 0 else 1)
        if need > 0:
            logits.append(got[:, got.shape[1] - need:])
        if states is not None:
            hidden.append(states)
    return np.concatenate(logits, axis=1), np.concatenate(hidden, axis=1) if hidden else None


def span_of(rows: Rows, batch: int) -> slice | None:
    """`rows` as the one contiguous range a backend without ragged rows runs (a slice of the allocated rows), or a
    LlgraphError: those rows are not one range of whole batch rows."""
    if rows is None or isinstance(rows, slice):
        return rows
    ids = np.asarray(rows, np.int64).reshape(batch, -1)
    first = ids[:, :1]
    if (ids == first).all() and (batch == 0 or (np.diff(first[:, 0]) == 1).all()):
        start = int(first[0, 0]) if batch else 0
        return slice(start, start + batch)
    raise LlgraphError("this backend runs one contiguous range of cache rows a forward (its graph has no slot_ids: "
                       "re-export with --kernels llgraph --dtype fp32 for ragged rows)")


class Backend(ABC):
    """Every attribute the engine, the server, the evaluation and the benchmarks read of a backend is declared here
    (none is looked up by getattr); a backend implements allocate and forward, and overrides the rest where it
    can do more."""
    max_seq_len: int
    vocab_size: int
    config: LlamaConfig | None = None  # the model's (None: a stand-in of the tests)
    dtype: str = "float32"  # its weights' and activations' floats
    kv: KvFormat | None = None  # its KV cache's format (None: its dtype's floats)
    folder: Path | None = None  # the export folder it runs (None: a model held in memory, the torch executor's)
    max_batch: int | None = None  # the rows its engine was built for (a TensorRT engine's); None: any
    kv_plan: str = ""  # how the server planned its cache length (runtime/serve/plan.py), said at startup
    # whether one forward may run several rows of more than one token after a cached prefix (speculative
    # verification); ONNX Runtime's GroupQueryAttention takes only one such row (an OrtBackend without slot ids)
    multi_token_rows: bool = True
    # whether forward's `rows` may be any cache rows per token (passes.ragged_slots): a step runs only busy rows
    ragged: bool = False
    # whether forward_hidden returns the hidden states beside the logits (an embedding packed in a step)
    hidden_in_forward: bool = False
    # the longest cache this backend could hold (before allocate: max_seq_len may be planned up to it); None: its
    # cache length is fixed (a TensorRT engine's)
    context_limit: int | None = None
    # whether its graph's attention takes a windowed layer's cache as a ring (llgraph/kv_cache.py ring_length)
    takes_ring: bool = False
    # the slots of a windowed layer's cache where it is a ring (set by allocate, plan_ring); 0: every layer holds
    # max_seq_len positions
    ring: int = 0
    _reach: np.ndarray | None = None  # a ring's cache rows: the highest position each wrote since it wrote position 0
    # diff's (runtime/eval/diff.py): with `record` set, each forward also keeps every value its graph exposes, by IR
    # name, as float32 numpy arrays in `recorded` (the executor: all; an export: its node outputs; an engine: the
    # logits and the present caches) — the same forward that serves, no second execution path
    record: bool = False
    recorded: dict[str, np.ndarray] = {}

    def ready(self) -> None:  # noqa: B027 (a hook: most backends are ready once built)
        """Returns once the backend may answer; raises (one line) when it must not: an OrtBackend's weights found
        damaged by the check that runs while it loads (export_folder.Checked). allocate() calls it."""

    @abstractmethod
    def allocate(self, batch: int, zeroed: bool = False) -> None:
        """The static KV cache for `batch` rows; kept as it is for the same batch (stale positions are masked)
        unless `zeroed`."""
        raise NotImplementedError

    @abstractmethod
    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows = None,
                keep: int = 0) -> np.ndarray:
        """input_ids, position_ids: [B, S] int64 numpy arrays -> logits [B, K, V] (a float numpy array: float32,
        float16 or ml_dtypes' bfloat16) of the last K positions:
        K = S when `keep` is 0, else min(keep, S) or more (an engine whose graph has no logits_to_keep input gives
        all S). `rows`: the cache rows to run on, the others keeping their caches — a slice of them (B == its
        length), or each batch row's ([B]) or each token's ([B, S]) cache row (a backend that is not `ragged` takes
        only one contiguous range of whole rows, span_of); None: all of them, row b for batch row b."""
        raise NotImplementedError

    def hidden(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows = None) -> np.ndarray:
        """Like forward (the cache rows written alike), but -> the last hidden states [B, S, H] float32 of every
        position (the final norm's output, passes.expose_hidden): what embeddings pool."""
        from llgraph.errors import RequestError

        raise RequestError("this backend's graph has no hidden_states output, so it cannot embed; use --backend ort "
                           "(an export of llgraph 0.8 or later) or torch")

    def forward_hidden(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows = None,
                       keep: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
        """forward's logits and, of the same forward, the last hidden states [B, S, H] float32 of every position
        (an embedding row packed beside the others, runtime/engine/packed.py); None where this backend cannot
        return both (an embedding then takes a forward of its own)."""
        return None

    def planned_ring(self, max_seq_len: int) -> int:
        """The ring a windowed layer's cache takes for a cache of `max_seq_len` positions: where the graph takes one
        and it is shorter; never on a diff side (its caches are compared by shape)."""
        cfg = self.config
        window = cfg.sliding_window if cfg is not None and self.takes_ring and not self.record else 0
        return ring_length(window or 0, max_seq_len)

    def plan_ring(self) -> None:
        """Sets `ring` for an allocation (and forgets what the rows wrote)."""
        self.ring, self._reach = self.planned_ring(self.max_seq_len), None

    def pieces(self, seq: int) -> int:
        """The most positions along S one execution writes (a ring's step; else all `seq`)."""
        if not self.ring or self.config is None or not self.config.sliding_window:
            return seq
        return ring_step(self.ring, self.config.sliding_window)

    def track(self, rows: Rows, position_ids: np.ndarray, batch_rows: int) -> None:
        """Notes the positions a forward writes into each cache row (a ring's: keeps_prefix reads them)."""
        if not self.ring:
            return
        if self._reach is None or len(self._reach) != batch_rows:
            self._reach = np.full(batch_rows, -1, np.int64)
        pos = np.asarray(position_ids, np.int64).reshape(-1)
        flat = token_rows(rows, position_ids.shape)
        if flat is None:
            flat = np.repeat(np.arange(position_ids.shape[0], dtype=np.int64), position_ids.shape[1])
        for row in np.unique(flat).tolist():
            mine = pos[flat == row]
            self._reach[row] = mine.max() if mine.min() == 0 else max(int(self._reach[row]), int(mine.max()))

    def keeps_prefix(self, row: int, length: int) -> bool:
        """Whether cache row `row` still holds the keys a continuation from position `length` reads of positions
        0..length-1: always with full caches; a ring's window behind `length` is gone once the row wrote a position
        `ring` past its oldest (llama.cpp drops every reuse past the window unless --swa-full; here a reuse holds
        while the window it needs is intact)."""
        if not self.ring or length == 0 or self._reach is None or row >= len(self._reach):
            return True
        assert self.config is not None and self.config.sliding_window
        return int(self._reach[row]) < max(0, length - self.config.sliding_window + 1) + self.ring

    def kv_format(self):
        """The cache's format (llgraph/kv_cache.py): the backend's `kv`, else its dtype's floats."""
        from llgraph.kv_cache import of_dtype

        return self.kv or of_dtype(self.dtype)

    def kv_bytes_per_token(self) -> int:
        """The cache's bytes for one position of one row (keys and values of every layer; 0 where unknown)."""
        cfg = self.config
        if cfg is None:
            return 0
        return self.kv_format().bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)

    def kv_row_bytes(self, tokens: int) -> int:
        """The cache's bytes for one row of a `tokens`-position cache: a windowed layer's ring (planned_ring) holds
        its slots only."""
        cfg = self.config
        if cfg is None:
            return 0
        return row_bytes(cfg, self.kv_format(), tokens, self.planned_ring(tokens))

    def caches(self) -> list:
        """The KV cache buffers, [rows, kv_heads, max_seq, row] each (numpy arrays or torch tensors, indexed alike);
        empty before allocate() or where the backend keeps none it can copy within."""
        return []

    def ordered(self) -> AbstractContextManager:
        """A context in which a copy between cache rows is ordered with the forwards (TensorRT: its stream)."""
        return nullcontext()

    def copy_prefix(self, src: int, dst: int, length: int) -> bool:
        """Copies cache positions 0..length-1 of row `src` into row `dst` (the scheduler's prefix reuse); False where
        this backend cannot (no caches())."""
        caches = self.caches()
        with self.ordered():
            for t in caches:  # (a ring of fewer slots than `length`: all of them)
                t[dst, :, :length] = t[src, :, :length]
        if self._reach is not None and caches:  # dst holds what src held, as far back as src does
            self._reach[dst] = self._reach[src]
        return bool(caches)

    def recorder(self) -> Callable[[], Callable[[dict], dict]]:
        """A diff side (runtime/eval/diff.py): each call a fresh stepper, whose first step allocates a zeroed cache
        for its batch; a step runs forward on {"input_ids", "position_ids"} and returns every value it recorded."""
        self.record = True

        def stepper() -> Callable[[dict], dict]:
            fresh = [True]

            def step(s: dict) -> dict:
                if fresh[0]:
                    self.allocate(s["input_ids"].shape[0], zeroed=True)
                    fresh[0] = False
                self.forward(s["input_ids"], s["position_ids"])
                return self.recorded
            return step
        return stepper
