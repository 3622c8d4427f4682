"""The byte layouts llgraph's CPU kernels read (plugins/cpu/): each a function from a weight's stored array to the
array the export writes, applied by the Emitter as a weight's `compute` (its name ends the initializer's).
Only reordering, padding and lossless narrowing: the same numbers, placed so one SIMD load feeds 16 output rows."""

from __future__ import annotations

import numpy as np


def glu_groups(interleave=None):
    """-> a layout: a packed [gate; up] tensor (rows first) interleaved by `interleave` (default interleave16) with
    its row groups alternating: 16 gate rows, the same 16 rows of up, ... (each half padded to whole groups), so one
    group pair makes 16 outputs."""
    interleave = interleave or interleave16

    def grouped(t: np.ndarray) -> np.ndarray:
        gate, up = (pad16(h).reshape(-1, 16, *h.shape[1:]) for h in np.split(t, 2))
        return interleave(np.stack([gate, up], 1).reshape(-1, *t.shape[1:]))
    grouped.__name__ = f"glu_{interleave.__name__}"
    return grouped


def pad16(t: np.ndarray) -> np.ndarray:
    """Rows padded with zeros to a multiple of 16."""
    return np.concatenate([t, np.zeros((-t.shape[0] % 16, *t.shape[1:]), t.dtype)])


def glu_groups_half(t: np.ndarray) -> np.ndarray:
    return halved(glu_groups()(t))


def halved(t: np.ndarray) -> np.ndarray:
    half = t.astype(np.float16)
    return half if np.array_equal(half.astype(t.dtype), t) else t


def interleave16_half(t: np.ndarray) -> np.ndarray:
    """Scales or mins interleaved, as half floats where that is lossless (a GGUF's are half floats widened): a
    block's bytes drop from 24 to 20 (Q4_1), and the kernels widen them back exactly."""
    return halved(interleave16(t))


# Each piece of a row's GGUF super-block as (byte offset, bytes, unit), in the order plugins/cpu/superblocks.inc
# reads a group's: d, dmin, the packed 6-bit scales and mins, (Q5_K's high bits), the nibbles; Q6_K: d, its int8
# scales, then per half n, quarter-half hh and 4 elements kk the low nibbles of streams 0/2 and 1/3 and their high
# bit pairs, side by side (the kernel's three loads of a step adjacent: one stream through memory, 16% faster on one
# thread than three runs 256 bytes apart). Interleaved `unit` bytes of each of 16 rows at a time.
SUPERBLOCK_FIELDS = {
    "Q4_K": ((0, 2, 2), (2, 2, 2), (4, 12, 4), (16, 128, 4)),
    "Q5_K": ((0, 2, 2), (2, 2, 2), (4, 12, 4), (16, 32, 4), (48, 128, 4)),
    "Q6_K": ((208, 2, 2), (192, 16, 1),
             *((off + 4 * kk, 4, 4) for n in (0, 1) for hh in (0, 1) for kk in range(4)
               for off in (64 * n + 16 * hh, 64 * n + 32 + 16 * hh, 128 + 32 * n + 16 * hh))),
    "IQ4_XS": ((0, 2, 2), (2, 2, 2), (4, 4, 4), (8, 128, 4)),  # d, scales_h, scales_l, the nibbles as stored
    # Q3_K: d, scales, then per step k of 4 bytes its hmask, half 0's qs and half 1's qs side by side (one stream)
    "Q3_K": ((108, 2, 2), (96, 12, 4), *((off + 4 * k, 4, 4) for k in range(8) for off in (0, 32, 64))),
    "Q2_K": ((80, 2, 2), (82, 2, 2), (0, 16, 4), (16, 64, 4)),  # d, dmin, scales and mins, qs
    "IQ4_NL": ((0, 2, 2), (2, 16, 4)),  # d, the nibbles (a block of 32)
    "MXFP4": ((0, 1, 1), (1, 16, 4)),  # its E8M0 exponent, the nibbles (a block of 32)
}


def interleaver(fmt: str):
    """The interleaved layout of a format's codes: interleave16 for the blocked form, else its super-blocks'."""
    if fmt == "blocks":
        return interleave16

    def interleave_superblocks(t: np.ndarray) -> np.ndarray:
        """Super-blocks [N, nsb, bytes] -> [ceil(N/16), nsb, 16 * bytes]: per group of 16 rows and super-block, each
        field of the 16 rows side by side, `unit` bytes at a time (SUPERBLOCK_FIELDS); the same bytes, reordered."""
        t = pad16(t)
        groups, nsb = t.shape[0] // 16, t.shape[1]
        t = t.reshape(groups, 16, nsb, -1)
        fields = [t[..., off:off + n].reshape(groups, 16, nsb, n // unit, unit).transpose(0, 2, 3, 1, 4)
                  .reshape(groups, nsb, 16 * n) for off, n, unit in SUPERBLOCK_FIELDS[fmt]]
        return np.concatenate(fields, axis=-1)
    interleave_superblocks.__name__ = f"interleave16_{fmt}"
    return interleave_superblocks


def interleave16(t: np.ndarray) -> np.ndarray:
    """Codes [N, nb, bytes] -> [ceil(N/16), nb, 16 * bytes] (each block's bytes 4 at a time, row by row of 16);
    scales or mins [N, nb] -> [ceil(N/16), nb, 16]. Rows past N are zeros (the kernel writes only N)."""
    t = pad16(t)
    groups = t.shape[0] // 16
    if t.ndim == 3:
        return t.reshape(groups, 16, t.shape[1], -1, 4).transpose(0, 2, 3, 1, 4).reshape(groups, t.shape[1], -1)
    return np.ascontiguousarray(t.reshape(groups, 16, -1).transpose(0, 2, 1))


def fifth_bits(t: np.ndarray) -> np.ndarray:
    """5-bit codes held one a byte (GGUF's Q5_0/Q5_1: [N, nb, 32], values 0..31) at their own bits: per block the low
    4 bits as the 4-bit layout packs them (byte i: weight 2i in its low nibble, 2i + 1 in its high), then the fifth
    bits as one little-endian 32-bit word (bit j: weight j) -> [N, nb, 20], the 22 bytes of a GGUF block less its
    scale; the kernels read it interleaved (interleave16_5bit)."""
    low = (t[..., 0::2] & 15) | ((t[..., 1::2] & 15) << 4)
    high = ((t.astype(np.uint32) >> 4) & 1) << np.arange(t.shape[-1], dtype=np.uint32)
    word = np.bitwise_or.reduce(high, axis=-1).astype("<u4")
    return np.concatenate([low.astype(np.uint8), word[..., None].view(np.uint8)], axis=-1)


def interleave16_5bit(t: np.ndarray) -> np.ndarray:
    """5-bit codes (fifth_bits) interleaved 16 rows at a time: a block's four chunks of low nibbles, then its chunk of
    fifth-bit words, each 4 bytes of each of 16 rows (plugins/cpu/qlinear_blocks.inc's InterleavedCode)."""
    return interleave16(fifth_bits(t))

