"""Grid i-quants whose every weight is exactly a carried super-block type's, repacked into it at load and run on its
kernels (QLinear and QMoE alike), instead of widened to 8-bit blocks (llgraph/quant_grid.py):

- IQ3_XXS: w = d (2 ls + 1) g / 4, g in ±{4, 12, 20, 28, 36, 44, 52, 62} (every one even), is 1/2 of Q6_K's
  d sc (q - 32) with the file's d, sc = 2 ls + 1 for both 16-weight halves of its 32, q - 32 = g / 2: 6.56 bits a
  weight (3.06 stored; the blocked form's 9). The 1/2 is the tensor's `exponent` -1 (QuantFormat, ops.py's QLinear
  and QMoE), which every backend applies exactly (a kernel scales x by it): d / 2 itself is no float16 where d is an
  odd subnormal, which a 7B's small blocks hold.
- IQ3_S: w = d (2 ls + 1) v, v odd in [-15, 15] (a grid value 1..15 and a sign), is Q5_K's d sc q - dmin m with
  sc = m = 2 ls + 1 (at most 31, 6 bits hold it), dmin = 16 d, q = v + 16 in 1..31: 5.5 bits a weight (3.44 stored).
  16 d is a float16 for every d up to 4,094.

Each product is exact in float32 on both sides, so the repacked bytes dequantize (gguf's code, or a kernel's exact
path), times 2^exponent, to the file's weights bit for bit; a repacking checks that and refuses a block that does
not. A tensor holding a d that does not scale (`fits`: IQ3_S's 16 d past float16's range) is read as 8-bit blocks
instead.
"""

from __future__ import annotations

import numpy as np

from llgraph.quant_grid import _half, _nibbles, _scales

AS_SUPERBLOCKS = {"IQ3_XXS": "Q6_K", "IQ3_S": "Q5_K"}
EXPONENT = {"IQ3_XXS": -1, "IQ3_S": 0}  # the weights are 2^EXPONENT times the target's
_BLOCK_BYTES = {"IQ3_XXS": 98, "IQ3_S": 110}
_STEP = 1 << 16  # blocks repacked at a time (16M weights): a mixture's stacked experts hold billions


def target_format(kind: str):
    """The QuantFormat a tensor of grid type `kind` runs in: its AS_SUPERBLOCKS type's, with EXPONENT."""
    from dataclasses import replace

    from llgraph.quant import GGUF_FORMATS

    return replace(GGUF_FORMATS[AS_SUPERBLOCKS[kind]], exponent=EXPONENT[kind])


def fits(raw: np.ndarray, kind: str) -> bool:
    """Whether every block's float16 d in `raw` (a tensor's bytes of `kind`) gives the target type's scale exactly:
    IQ3_XXS's d always (its 1/2 is the exponent), IQ3_S's 16 d where not past float16's 65,504."""
    if kind == "IQ3_XXS":
        return True
    d = np.ascontiguousarray(np.asarray(raw).reshape(-1, _BLOCK_BYTES[kind])[:, 0:2]).view(np.float16)[:, 0]
    with np.errstate(over="ignore"):
        scaled = (d.astype(np.float32) * np.float32(16)).astype(np.float16)
    return bool(np.all(np.isfinite(scaled) & (scaled.astype(np.float32) == d.astype(np.float32) * np.float32(16))))


def why_not(kinds) -> str:
    """What keeps tensors of these AS_SUPERBLOCKS types from running as their target (`fits` said no)."""
    return "; ".join(f"{k} tensors holding a block whose scale {AS_SUPERBLOCKS[k]} cannot hold: 16 d is past "
                     "float16's range" for k in sorted(kinds))


def as_superblocks(raw: np.ndarray, kind: str) -> np.ndarray:
    """A tensor's blocks of `kind` -> the same weights, times 2^-EXPONENT[kind], as AS_SUPERBLOCKS[kind]
    super-blocks, checked against gguf's dequantization of both (ValueError where they differ: a damaged file, or a
    d that does not scale: `fits` first)."""
    blocks = np.asarray(raw).reshape(-1, _BLOCK_BYTES[kind])
    repack = _iq3xxs_as_q6k if kind == "IQ3_XXS" else _iq3s_as_q5k
    return np.concatenate([_checked(repack, blocks[i:i + _STEP], kind) for i in range(0, len(blocks), _STEP)])\
        .reshape(-1)


def _checked(repack, blocks: np.ndarray, kind: str) -> np.ndarray:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    w = dequantize(blocks, T[kind]).reshape(len(blocks), 8, 32)
    scale = _scales(blocks[None], kind)[0]  # [n, 8]: one per 32 weights
    v = np.rint(w / np.where(scale == 0, np.float32(1), scale)[..., None])
    out = repack(blocks, v.astype(np.int32)).astype(np.uint8)
    target = AS_SUPERBLOCKS[kind]
    if not np.array_equal(dequantize(out, T[target]).reshape(w.shape) * np.float32(2.0 ** EXPONENT[kind]), w):
        raise ValueError(f"{kind} blocks that are not {target}'s weights exactly (a damaged file?)")
    return out


def _iq3xxs_as_q6k(blocks: np.ndarray, g: np.ndarray) -> np.ndarray:
    """ggml's block_q6_K: ql[128], qh[64], scales[16] (int8), d."""
    n = len(blocks)
    if not (np.abs(g) <= 62).all():
        raise ValueError("IQ3_XXS blocks that are not Q6_K's weights exactly (a damaged file?)")
    q = (g // 2 + 32).reshape(n, 2, 4, 32)  # element 128 h + 32 t + l: half h, quarter t
    words = np.stack([blocks[:, 66 + 4 * i:70 + 4 * i] for i in range(8)], 1)
    sc = np.repeat(2 * (np.ascontiguousarray(words).view("<u4")[..., 0] >> 28) + 1, 2, axis=1).astype(np.uint8)
    d = blocks[:, 0:2].copy().view(np.float16)  # the file's d: the 1/2 is the exponent
    ql = np.concatenate(((q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)),
                        -1)  # [n, 2, 64]: ql[64 h + l (+ 32 for quarters 1, 3)], quarters 2, 3 in the high nibble
    qh = np.sum([((q[:, :, t] >> 4) & 3) << (2 * t) for t in range(4)], 0)  # [n, 2, 32]: quarter t's bits 4, 5 at 2t
    return np.concatenate((ql.reshape(n, 128), qh.reshape(n, 64), sc, d.view(np.uint8).reshape(n, 2)), 1)


def _iq3s_as_q5k(blocks: np.ndarray, v: np.ndarray) -> np.ndarray:
    """ggml's block_q5_K: d, dmin, scales[12] (8 six-bit scales and mins, get_scale_min_k4's packing), qh[32],
    qs[128]; sub-block j's weight l is (qs[32 (j / 2) + l] >> 4 (j odd)) & 15, plus 16 if bit j of qh[l]."""
    n = len(blocks)
    if not ((np.abs(v) <= 15) & (v % 2 == 1)).all():
        raise ValueError("IQ3_S blocks that are not Q5_K's weights exactly (a damaged file?)")
    q = v + 16  # [n, 8, 32] in 1..31
    sc = (2 * _nibbles(blocks[:, 106:110]) + 1).astype(np.int32)  # [n, 8]; the mins are the same numbers
    packed = np.zeros((n, 12), np.int32)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 15) | ((sc[:, 4:8] & 15) << 4)
    d = _half(blocks[:, 0:2])
    halves = np.stack((d, d * np.float32(16)), 1).astype(np.float16).view(np.uint8).reshape(n, 4)
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(n, 128)
    qh = np.sum([((q[:, j] >> 4) & 1) << j for j in range(8)], 0)  # [n, 32]
    return np.concatenate((halves, packed, qh, qs), 1)


def superblocks_line(kinds: dict[str, tuple[int, int]]) -> str:
    """One line: these types' tensors (type -> (bytes stored, weights)) run as the super-blocks of AS_SUPERBLOCKS,
    and the cost."""
    from llgraph.op_shapes import SUPERBLOCK_BYTES

    stored = sum(b for b, _ in kinds.values())
    wide = sum(n * SUPERBLOCK_BYTES[AS_SUPERBLOCKS[k]] // 256 for k, (_, n) in kinds.items())
    targets = "/".join(sorted({AS_SUPERBLOCKS[k] for k in kinds}))
    return (f"llgraph: this GGUF's {'/'.join(sorted(kinds))} tensors ({stored / 1e9:.2f} GB) have no llgraph kernel; "
            f"they run read exactly as {targets} super-blocks ({wide / 1e9:.2f} GB, {wide / stored:.1f}x the bytes a "
            "token)")
