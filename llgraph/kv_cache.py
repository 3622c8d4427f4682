"""The KV cache's formats: how the static cache [batch, kv_heads, max_seq, row] holds one position's key (or value)
of one kv head. GroupedAttention's schema (llgraph/ops.py) names them by the cache tensor's dtype; every backend that
runs them computes the attention itself in float32.

    float32  row = the D floats                                                      4 D bytes a head
    float16  row = the D values as IEEE halves (rounded to nearest, ties to even)    2 D bytes
    int8     row = D int8 codes c, then the row's scale s as a float32 (4 bytes,     D + 4 bytes
             little-endian): x ~ s * c with s = max|x| / 127 and c = round(x / s), ties to even (the row's
             absolute maximum is exact; a row of zeros has s = 0, c = 0) — llama.cpp's q8_0 cache with one scale
             per head of a position instead of one per 32 values

A windowed layer (Gemma 2/3's local layers, Mistral's, gpt-oss's) needs only its last `window` positions: where the
export's attention takes it (Manifest.window_ring), its cache is a ring of `ring_length` slots holding position p in
slot p mod ring (llgraph/ops.py GroupedAttention), and a forward writes at most `ring_step` positions of a row
(longer ones run in pieces, runtime/engine/backend.py). A 32k-token Gemma 3 context then holds about a sixth of the
keys and values it would in full (five local layers in six). Rings run on the torch executor, llgraph's CPU kernels
and the `onnx` target (ONNX's circular TensorScatter); ONNX Runtime's GroupQueryAttention (an `ort` export on
standard kernels) and TensorRT engines keep every position. A cached prefix is reused while the window behind it is
intact in its row (Backend.keeps_prefix; llama.cpp drops every reuse past the window unless --swa-full).

The format is a run-time choice (`--kv-cache`), not an export's: the weights do not change with it. An export's ONNX
graph declares a float32 cache; `retype` gives its cache inputs and outputs another format's type when a runner
opens it (only llgraph's own GroupedAttention reads them, and it takes each format by the tensor's type).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llgraph.errors import LlgraphError

SCALE_BYTES = 4  # int8: the row's float32 scale, after its codes


@dataclass(frozen=True)
class KvFormat:
    name: str
    dtype: str  # the cache tensor's dtype (an IR dtype)
    extra: int  # elements after the D values of a row (int8: the scale's 4 bytes)
    value_bytes: int

    def row(self, head_dim: int) -> int:
        return head_dim + self.extra

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Keys and values of one position of one row, every layer."""
        return 2 * num_layers * num_kv_heads * self.row(head_dim) * self.value_bytes


FORMATS = {f.name: f for f in (KvFormat("float32", "float32", 0, 4), KvFormat("float16", "float16", 0, 2),
                               KvFormat("int8", "int8", SCALE_BYTES, 1))}
ALIASES = {"f32": "float32", "fp32": "float32", "f16": "float16", "fp16": "float16", "q8": "int8", "q8_0": "int8"}
# The default on llgraph's CPU kernels: the cheapest format that keeps the default engine within llama.cpp's own
# accuracy (mean KL from the float64 reference of the same weights). Measured from the float32 cache over 2,048
# tokens of prose (runtime/bench/kv_cache.py): float16 1.3e-6 (SmolLM2) and 6.2e-4 (1B Q4_K_M shape), int8 1.2e-3
# and 3.2e-3 — int8 is 2-4x closer than llama.cpp's own q8_0 cache is to its f16 one (0.0046, 0.0074), but on the 1B
# it would carry the default past llama.cpp's total (0.00070 + 0.0032 > 0.0026), so int8 is asked for (--kv-cache
# int8: long contexts, many slots) and float16 is the default.
CPU_DEFAULT = "float16"


RING_STEP = 512  # the most positions of one row a forward writes beside a ring (llama.cpp's n_ubatch); a ring holds
# window + RING_STEP - 1 slots, rounded up to RING_ALIGN
RING_ALIGN = 64


def ring_length(window: int, max_seq_len: int) -> int:
    """The slots of a windowed layer's ring for a cache of `max_seq_len` positions: window + RING_STEP - 1 (rounded
    up to RING_ALIGN), or 0 where that is no shorter than max_seq_len (or there is no window): the layer then holds
    every position."""
    if not window:
        return 0
    ring = -(-(window + RING_STEP - 1) // RING_ALIGN) * RING_ALIGN
    return ring if ring < max_seq_len else 0


def row_bytes(cfg, fmt: KvFormat, tokens: int, ring: int = 0) -> int:
    """One row's cache bytes for a `tokens`-position cache in format `fmt`: a windowed layer's ring (`ring` slots,
    0: none) holds no more than its slots."""
    layer = fmt.bytes_per_token(1, cfg.num_kv_heads, cfg.head_dim)
    return layer * sum(min(tokens, ring) if ring and cfg.layer_window(i) else tokens for i in range(cfg.num_layers))


def ring_step(ring: int, window: int) -> int:
    """The most positions of one row a forward may write into a ring of `ring` slots for a `window`: the oldest key
    its first query reads must not be overwritten by its last token."""
    return ring - window + 1


def kv_format(name: str | None) -> KvFormat:
    """A format by name or alias (f32, f16, int8); a one-line error naming the choices."""
    key = ALIASES.get(str(name).lower(), str(name).lower())
    if key not in FORMATS:
        raise LlgraphError(f"unknown KV cache format '{name}'; use f32, f16 or int8")
    return FORMATS[key]


def of_dtype(dtype: str) -> KvFormat:
    """The format a cache tensor of this dtype holds (any float dtype holds its own floats)."""
    return FORMATS.get(dtype) or KvFormat(dtype, dtype, 0, 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize)


def quantize_int8(x: np.ndarray) -> np.ndarray:
    """float rows [..., D] -> int8 rows [..., D + 4] (codes, then the float32 scale's bytes) as the format defines."""
    x = np.asarray(x, np.float32)
    scale = (np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        codes = np.where(scale > 0, np.rint(x / np.where(scale > 0, scale, 1)), 0).astype(np.int8)
    return np.concatenate([codes, scale.view(np.int8).reshape(*x.shape[:-1], SCALE_BYTES)], axis=-1)


def dequantize_int8(rows: np.ndarray) -> np.ndarray:
    """int8 rows [..., D + 4] -> float64 [..., D]: s * c."""
    rows = np.ascontiguousarray(rows, np.int8)
    scale = rows[..., -SCALE_BYTES:].copy().view(np.float32).astype(np.float64)
    return rows[..., :-SCALE_BYTES].astype(np.float64) * scale


def retype(model, fmt: KvFormat, past_present: list[tuple[str, str]], head_dim: int) -> None:
    """An ONNX ModelProto's cache inputs and outputs (the `past_present` pairs) declared in format `fmt`, in place:
    the element type and the row's length."""
    from onnx import helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(fmt.dtype))
    names = {n for pair in past_present for n in pair}
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        if value.name in names:
            value.type.tensor_type.elem_type = elem
            dims = value.type.tensor_type.shape.dim
            if len(dims) == 4:
                dims[3].ClearField("dim_param")
                dims[3].dim_value = fmt.row(head_dim)
