"""Embeddings: a text's last hidden states (the final norm's output at every position, passes.expose_hidden)
pooled into one vector, normalised to unit length by default, as sentence-transformers and OpenAI's
`/v1/embeddings` give them.

    runner.embed(["a cat", "a dog"])                    # -> float32 [2, hidden], last-token pooling, unit length
    runner.embed("a cat", pooling="mean", normalize=False)

Pooling: "last" (the last token's state: decoder embedding models such as Qwen3-Embedding, e5-mistral, GTE-Qwen) or
"mean" (the average over the text's tokens). An embedding is a row of the engine like a scored prompt: the prompt
written into its cache row whole, nothing sampled (runtime/engine/step.py), so the server's scheduler runs it
between decode steps on any free slot.
"""

from __future__ import annotations

import numpy as np

from llgraph.errors import RequestError

POOLINGS = ("last", "mean")


def check_pooling(pooling) -> str:
    if pooling not in POOLINGS:
        raise RequestError(f"pooling ({pooling!r}) must be one of {', '.join(POOLINGS)}")
    return pooling


def pool(hidden: np.ndarray, pooling: str, normalize: bool = True) -> np.ndarray:
    """hidden [S, H] of one text -> its embedding [H] float32."""
    v = hidden[-1] if pooling == "last" else hidden.mean(axis=0, dtype=np.float64)
    v = np.asarray(v, np.float64)
    if normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v.astype(np.float32)
