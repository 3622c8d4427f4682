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
the cost a user is told in one line (`widened_line`). IQ3_XXS, whose weights are exactly Q6_K's, runs as Q6_K
super-blocks instead (AS_SUPERBLOCKS, `superblocks_line`).
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


# Grid types whose every weight is exactly a carried super-block type's, and run as it: IQ3_XXS's
# w = d (2 ls + 1) g / 4, g in ±{4, 12, 20, 28, 36, 44, 52, 62} (every one even), is Q6_K's d' sc (q - 32) with
# d' = d / 2, sc = 2 ls + 1 for both 16-weight halves of its 32, q - 32 = g / 2: 6.56 bits a weight (3.06 stored;
# the blocked form's 9), on every kernel Q6_K has, experts too. d / 2 is a float16 for every d but an odd subnormal
# one: a tensor holding such a d is read as 8-bit blocks instead.
AS_SUPERBLOCKS = {"IQ3_XXS": "Q6_K"}


def halves_exactly(raw: np.ndarray) -> bool:
    """Whether every IQ3_XXS block's float16 d in `raw` (a tensor's bytes) is twice a float16: its exponent field is
    2..30, or its mantissa is even (subnormal, or the smallest normal exponent, where halving drops a bit)."""
    d = np.ascontiguousarray(np.asarray(raw).reshape(-1, 98)[:, 0:2]).view("<u2")[:, 0]
    exponent, mantissa = (d >> 10) & 31, d & 1023
    return bool(np.all((exponent != 31) & ((exponent >= 2) | (mantissa % 2 == 0))))


def iq3xxs_as_q6k(raw: np.ndarray) -> np.ndarray:
    """A tensor's IQ3_XXS blocks -> the same weights as Q6_K super-blocks (ggml's block_q6_K: ql[128], qh[64],
    scales[16], d), checked against gguf's dequantization of both (ValueError where they differ: a damaged file, or
    a d that does not halve: halves_exactly first)."""
    blocks = np.asarray(raw).reshape(-1, 98)
    step = 1 << 16  # blocks at a time (16M weights): a mixture's stacked experts hold billions
    return np.concatenate([_iq3xxs_as_q6k(blocks[i:i + step]) for i in range(0, len(blocks), step)]).reshape(-1)


def _iq3xxs_as_q6k(blocks: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    n = blocks.shape[0]
    w = dequantize(blocks, T.IQ3_XXS).reshape(n, 8, 32)
    scale = _scales(blocks[None], "IQ3_XXS")[0]  # [n, 8]: d (2 ls + 1) / 4
    g = np.rint(w / np.where(scale == 0, np.float32(1), scale)[..., None])
    q = (g / 2 + 32).astype(np.int32).reshape(n, 2, 4, 32)  # element 128 h + 32 t + l: half h, quarter t
    words = np.stack([blocks[:, 66 + 4 * i:70 + 4 * i] for i in range(8)], 1)
    sc = np.repeat(2 * (np.ascontiguousarray(words).view("<u4")[..., 0] >> 28) + 1, 2, axis=1).astype(np.uint8)
    d = (_half(blocks[:, 0:2]) / np.float32(2)).astype(np.float16)
    ql = np.concatenate(((q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)),
                        -1)  # [n, 2, 64]: ql[64 h + l (+ 32 for quarters 1, 3)], quarters 2, 3 in the high nibble
    qh = sum(((q[:, :, t] >> 4) & 3) << (2 * t) for t in range(4))  # [n, 2, 32]: quarter t's bits 4, 5 at 2t
    out = np.concatenate((ql.reshape(n, 128), qh.reshape(n, 64), sc, d.view(np.uint8).reshape(n, 2)), 1)
    out = out.astype(np.uint8)
    if not (np.abs(g) <= 62).all() or not np.array_equal(dequantize(out, T.Q6_K).reshape(n, 8, 32), w):
        raise ValueError("IQ3_XXS blocks that are not Q6_K's weights exactly (a damaged file?)")
    return out


def widened_line(kinds: dict[str, tuple[int, int]]) -> str:
    """One line: these types' tensors (type -> (bytes stored, weights)) run as 8-bit blocks, and the cost."""
    stored = sum(b for b, _ in kinds.values())
    wide = sum(n + 4 * n // GRID_TYPES[k] for k, (_, n) in kinds.items())
    return (f"llgraph: this GGUF's {'/'.join(sorted(kinds))} tensors ({stored / 1e9:.2f} GB) have no llgraph kernel; "
            f"they run read exactly as 8-bit blocks ({wide / 1e9:.2f} GB, {wide / stored:.1f}x the bytes a token)")


def superblocks_line(kinds: dict[str, tuple[int, int]]) -> str:
    """One line: these types' tensors (type -> (bytes stored, weights)) run as the super-blocks of AS_SUPERBLOCKS,
    and the cost."""
    from llgraph.ops import SUPERBLOCK_BYTES

    stored = sum(b for b, _ in kinds.values())
    wide = sum(n * SUPERBLOCK_BYTES[AS_SUPERBLOCKS[k]] // 256 for k, (_, n) in kinds.items())
    targets = "/".join(sorted({AS_SUPERBLOCKS[k] for k in kinds}))
    return (f"llgraph: this GGUF's {'/'.join(sorted(kinds))} tensors ({stored / 1e9:.2f} GB) have no llgraph kernel; "
            f"they run read exactly as {targets} super-blocks ({wide / 1e9:.2f} GB, {wide / stored:.1f}x the bytes a "
            "token)")
