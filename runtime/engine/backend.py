"""What the engine needs of a backend: `allocate(batch)` (its static KV cache) and `forward(input_ids, position_ids,
rows=None, keep=0) -> logits` (one step on its bound buffers, or on a range of their rows), and optionally
`copy_prefix`. Each backend (runtime/backends/) implements it; everything else lives in the engine once.

Batches are right-padded. That is correct with the position-indexed static cache: a pad token of row b writes
slot p >= len(b), and row b's decode token at position p overwrites slot p before any query of row b can see it.
"""

from __future__ import annotations

import numpy as np

from llgraph.builder import DEFAULT_MAX_SEQ
from llgraph.errors import LlgraphError


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
    # the longest cache this backend could hold (before allocate: max_seq_len may be planned up to it); None: its
    # cache length is fixed (a TensorRT engine's)
    context_limit: int | None = None

    def ready(self) -> None:
        """Returns once the backend may answer; raises (one line) when it must not: an OrtBackend's weights found
        damaged by the check that runs while it loads (export_folder.Checked). allocate() calls it."""

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

    def hidden(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: slice | None = None) -> np.ndarray:
        """Like forward (the cache rows written alike), but -> the last hidden states [B, S, H] float32 of every
        position (the final norm's output, passes.expose_hidden): what embeddings pool."""
        from llgraph.runtime.engine.sampling import RequestError

        raise RequestError("this backend's graph has no hidden_states output, so it cannot embed; use --backend ort "
                           "(an export of llgraph 0.8 or later) or torch")

    def kv_format(self):
        """The cache's format (llgraph/kv_cache.py): the backend's `kv`, else its dtype's floats."""
        from llgraph.kv_cache import of_dtype

        return getattr(self, "kv", None) or of_dtype(str(getattr(self, "dtype", "float32")))

    def kv_bytes_per_token(self) -> int:
        """The cache's bytes for one position of one row (keys and values of every layer; 0 where unknown)."""
        cfg = getattr(self, "config", None)
        if cfg is None:
            return 0
        return self.kv_format().bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)

    def copy_prefix(self, src: int, dst: int, length: int) -> bool:
        """Copies cache positions 0..length-1 of row `src` into row `dst` (the scheduler's prefix reuse); False where
        this backend cannot."""
        return False
