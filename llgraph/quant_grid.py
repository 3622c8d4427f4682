"""GGUF block types without a llgraph kernel, read exactly into the blocked 8-bit form (llgraph/quant.py): the grid
i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, the ternary TQ1_0 and TQ2_0, and NVFP4 (MXFP4, gpt-oss's,
is carried at its own bits: a QLinear/QMoE format, plugins/cpu/superblocks.inc).

Each of them is, per block of B weights, one scale times small integers: ggml's grids and signs give
w = db * (±grid value), db = d (2 ls + 1) / 8 (IQ2), d (2 ls + 1) / 4 (IQ3_XXS), d (2 ls + 1) (IQ3_S); the IQ1 types
w = dl (grid + delta), grid in {-1, 0, 1} and delta ±1/8, so 8 w / dl is an integer; TQ: d · {-1, 0, 1}; NVFP4: an
E4M3 scale per 16 times MXFP4's values {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12} (doubled E2M1). Every such
product is exact in float32 (a half-float d times at most 10 more bits), so the values gguf's own dequantization
gives are integer codes times a float32 scale, bit for bit: this module takes the scales from the blocks' bytes,
divides, and checks that codes * scale gives back every weight exactly (a block that does not is refused). The codes
are held one a byte (zero_point 128): 8 bits a weight plus a float32 scale per block, against the file's 1.56-4.5 —
the cost a user is told in one line (`widened_line`). IQ3_XXS and IQ3_S, whose weights are exactly Q6_K's and
Q5_K's, run as those super-blocks instead (llgraph/grid_superblocks.py).
"""

from __future__ import annotations

import numpy as np

from llgraph.quant import QuantFormat, QuantTensor

# type -> weights a scale (a GGUF block's weights and bytes: gguf's GGML_QUANT_SIZES)
GRID_TYPES = {"IQ2_XXS": 32, "IQ2_XS": 16, "IQ2_S": 16, "IQ3_XXS": 32, "IQ3_S": 32, "IQ1_S": 32, "IQ1_M": 16,
              "TQ1_0": 256, "TQ2_0": 256, "NVFP4": 16}
GRID_FORMATS = {t: QuantFormat(8, b, 128, False) for t, b in GRID_TYPES.items()}


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """Bytes [..., n] -> [..., 2n]: each byte's low nibble, then its high."""
    return np.stack((b & 15, b >> 4), -1).reshape(*b.shape[:-1], -1)


def _scales(blocks: np.ndarray, kind: str) -> np.ndarray:
    """[rows, nblk, bytes] GGUF blocks -> [rows, nblk, weights / B] float32 scales, as ggml forms each one."""
    f32 = np.float32
    if kind in ("IQ2_XXS", "IQ3_XXS"):  # the top 4 bits of a 32-bit word per 32 weights (IQ3: after 64 B of grid)
        at = 2 if kind == "IQ2_XXS" else 66
        step = 8 if kind == "IQ2_XXS" else 4
        first = at + (4 if kind == "IQ2_XXS" else 0)
        words = np.stack([blocks[..., first + step * i:first + step * i + 4] for i in range(8)], -2)
        ls = np.ascontiguousarray(words).view("<u4")[..., 0] >> 28
        return _half(blocks[..., 0:2])[..., None] * ((2 * ls + 1).astype(f32) / f32(8 if kind == "IQ2_XXS" else 4))
    if kind in ("IQ2_XS", "IQ2_S"):  # 8 bytes of two 4-bit scales (per 16 weights)
        at = 66 if kind == "IQ2_XS" else 74
        ls = _nibbles(blocks[..., at:at + 8])
        return _half(blocks[..., 0:2])[..., None] * ((2 * ls + 1).astype(f32) / f32(8))
    if kind == "IQ3_S":  # 4 bytes of two 4-bit scales (per 32 weights)
        return _half(blocks[..., 0:2])[..., None] * (2 * _nibbles(blocks[..., 106:110]) + 1).astype(f32)
    if kind == "IQ1_S":  # bits 12-14 of 8 u16 per 32 weights: dl = d (2 ls + 1); codes 8 (grid + delta), scale dl / 8
        qh = np.ascontiguousarray(blocks[..., 34:50]).view("<u2")
        return _half(blocks[..., 0:2])[..., None] * ((2 * ((qh >> 12) & 7) + 1).astype(f32) / f32(8))
    if kind == "IQ1_M":  # d spread over the top nibbles of 4 u16 scale words; 3-bit scales per 16 weights
        sc = np.ascontiguousarray(blocks[..., 48:56]).view("<u2").astype(np.uint16)
        bits = (sc[..., 0] >> 12) | ((sc[..., 1] >> 8) & 0xF0) | ((sc[..., 2] >> 4) & 0xF00) | (sc[..., 3] & 0xF000)
        d = bits.astype(np.uint16).view(np.float16).astype(f32)
        ls = np.stack([(sc[..., i // 4] >> (3 * (i % 4))) & 7 for i in range(16)], -1)
        return d[..., None] * ((2 * ls + 1).astype(f32) / f32(8))
    if kind in ("TQ1_0", "TQ2_0"):
        at = 52 if kind == "TQ1_0" else 64
        return _half(blocks[..., at:at + 2])[..., None]
    if kind == "NVFP4":  # 4 unsigned E4M3 scales, one per 16 weights (gguf's own decoding of them)
        from gguf.quants import NVFP4

        return NVFP4.ue4m3_to_fp32(np.ascontiguousarray(blocks[..., 0:4])).astype(f32)
    raise KeyError(kind)


def widen_grid(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> QuantTensor:
    """A [rows, cols] tensor's GGUF blocks of `kind` -> the blocked 8-bit form, exactly (ValueError where a block's
    weights are not its scale times integer codes of at most 127: a damaged file)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    (per, size), block = GGML_QUANT_SIZES[GGMLQuantizationType[kind]], GRID_TYPES[kind]
    rows, cols = shape
    blocks = raw.reshape(rows, cols // per, size)
    w = dequantize(blocks.reshape(rows, -1), GGMLQuantizationType[kind]).reshape(rows, cols // block, block)
    scales = _scales(blocks, kind).reshape(rows, cols // block)
    safe = np.where(scales == 0, np.float32(1), scales)
    q = np.rint(w / safe[..., None])
    if not (np.abs(q) <= 127).all() or not np.array_equal(q.astype(np.float32) * scales[..., None], w):
        raise ValueError(f"{kind} blocks whose weights are not their scale times integer codes (a damaged file?)")
    return QuantTensor((q + 128).astype(np.uint8), scales, None, GRID_FORMATS[kind])


def widened_line(kinds: dict[str, tuple[int, int]], why: str = "") -> str:
    """One line: these types' tensors (type -> (bytes stored, weights)) run as 8-bit blocks, and the cost; `why`:
    what the line adds (the tensors of a type that otherwise runs as super-blocks: grid_superblocks.why_not)."""
    stored = sum(b for b, _ in kinds.values())
    wide = sum(n + 4 * n // GRID_TYPES[k] for k, (_, n) in kinds.items())
    return (f"llgraph: this GGUF's {'/'.join(sorted(kinds))} tensors ({stored / 1e9:.2f} GB) have no llgraph kernel; "
            f"they run read exactly as 8-bit blocks ({wide / 1e9:.2f} GB, {wide / stored:.1f}x the bytes a token)"
            + (f" ({why})" if why else ""))
