"""Blocked integer weights: the one format every quantized Linear uses, GGUF blocks mapped onto it exactly, and
round-to-nearest quantization of float weights.

A weight [out, in] is cut along `in` into blocks of `block_size`; each block has a scale and optionally a min:

    w[o, b*B + j] = scales[o, b] * (q[o, b, j] - zero_point) + mins[o, b]        (mins absent: + 0)

`q` are `bits`-bit unsigned codes, stored packed as ONNX Runtime's MatMulNBits takes them: uint8
[out, in/B, B*bits/8], two 4-bit codes per byte with the lower-index code in the low nibble. `zero_point` is one
integer for the whole tensor (8 for 4-bit symmetric, 128 for 8-bit). GGUF's blocks map onto this without rounding:

    Q4_0  w = d*(q - 8)        bits 4, B 32, zero_point 8,   scales d
    Q4_1  w = d*q + m          bits 4, B 32, zero_point 0,   scales d, mins m
    Q8_0  w = d*q (q signed)   bits 8, B 32, zero_point 128, scales d   (codes stored as q + 128)

K-quants (and IQ4_XS) are carried as GGUF stores them: `format` "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K" or "IQ4_XS",
the codes input holding each row's super-blocks of 256 weights byte for byte ([out, in/256, 84 | 110 | 144 | 176 | 210 |
136]: 2.625, 3.4375, 4.5, 5.5, 6.5625 and 4.25 bits a weight) and no scales or mins inputs; ggml's definitions
(`dequantize_superblocks`):

    Q4_K    d, dmin (f16), 8 six-bit scales sc and mins m, 128 B of nibbles: w = d*sc*q - dmin*m  (sub-blocks of 32)
    Q5_K    as Q4_K, a fifth bit per code from 32 bytes of high bits:      w = d*sc*q - dmin*m  (q in 0..31)
    Q6_K    128 B of low nibbles, 64 of high bit pairs, 16 int8 scales, d: w = d*sc*(q - 32)    (sub-blocks of 16)
    IQ4_XS  d, 8 six-bit scales ls (2 high bits each in a u16, the low 4 in 4 bytes), 128 B of nibbles indexing the
            16 values IQ4_VALUES:                                          w = d*(ls - 32)*kv[q] (sub-blocks of 32)
    Q3_K    32 B of high bits, 64 of 2-bit pairs, 16 six-bit scales in 12 B, d: w = d*(sc - 32)*(q - 4)
                                                                          (q in 0..7, sub-blocks of 16)
    Q2_K    16 B of 4-bit scales sc and mins m, 64 of 2-bit pairs, d, dmin: w = d*sc*q - dmin*m (sub-blocks of 16)

A runtime without a super-block kernel reads them widened to the blocked form (`QuantFormat.widened`,
`QuantTensor.widened`), exactly: the products d*sc and dmin*m are exact in float32 (11 x 6 or 8 bits), so each
sub-block is a block (Q4_K: bits 4, B 32, zero_point 0, scales d*sc, mins -dmin*m; Q5_K the same in 8-bit codes;
Q6_K: bits 8, B 16, zero_point 32; IQ4_XS: bits 8, B 32, zero_point 128, codes kv + 128; Q3_K: bits 8, B 16,
zero_point 4; Q2_K: bits 4, B 16, zero_point 0, mins -dmin*m) — at 6, 10, 10, 9, 10 and 8 bits a weight in float32.

IQ4_NL (IQ4_XS's fallback where a row is not whole super-blocks) is the same lookup per block of 32 with an f16 d,
carried the same way as 18-byte blocks of 32 weights (4.5 bits a weight; widened: bits 8, B 32, zero_point 128).
MXFP4 (gpt-oss's experts) is blocks of 32 too: an E8M0 scale byte and 16 bytes of E2M1 nibbles (MXFP4_VALUES,
doubled), 4.25 bits a weight. Carried byte for byte, an export is its GGUF's size: a 1B Q4_K_M's 723.9 MB of weights
for a 725.4 MB file, SmolLM2 IQ4_XS's 89.53 MB for the file's 89.53 MB of tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llgraph.op_shapes import SUPERBLOCK_BYTES, superblock_weights  # GGUF's bytes per super-block, by format


@dataclass(frozen=True)
class QuantFormat:
    bits: int
    block_size: int
    zero_point: int
    has_mins: bool
    code_bits: int = 0  # bits the codes use (0: all `bits`); Q5_K and Q6_K hold 5- and 6-bit codes in 8
    format: str = "blocks"  # "blocks" (codes, scales, mins) or a GGUF super-block format (SUPERBLOCK_BYTES)
    # the weights are 2^exponent times what the super-blocks say: IQ3_XXS carried as Q6_K keeps its own d, -1
    # (llgraph/grid_superblocks.py); 0 for everything else
    exponent: int = 0

    def __post_init__(self):
        if self.code_bits == 0:
            object.__setattr__(self, "code_bits", self.bits)
        if self.exponent and (self.format == "blocks" or not -8 <= self.exponent <= 8):
            raise ValueError(f"exponent ({self.exponent}) is for super-blocks only, within -8..8")
        if self.format != "blocks":
            if self.format not in SUPERBLOCK_BYTES or self.block_size != superblock_weights(self.format) or \
                    self.has_mins:
                raise ValueError(f"super-block format {self.format}: block {superblock_weights(self.format)}, no "
                                 "separate mins")
            return
        if self.bits not in (4, 8):
            raise ValueError(f"bits ({self.bits}) must be 4 or 8")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block-size ({self.block_size}) must be a power of 2 >= 16")

    @property
    def superblocks(self) -> bool:
        """Whether the codes are GGUF super-blocks as stored (no scales or mins inputs)."""
        return self.format != "blocks"

    @property
    def attrs(self) -> dict:
        """The QLinear attributes of this format."""
        return {"format": self.format, "bits": self.bits, "block_size": self.block_size,
                "zero_point": self.zero_point, "code_bits": self.code_bits, "exponent": self.exponent}

    def codes_shape(self, out: int, n_in: int) -> tuple[int, int, int]:
        """The codes' shape for an [out, n_in] weight."""
        if self.superblocks:
            return out, n_in // self.block_size, SUPERBLOCK_BYTES[self.format]
        return out, n_in // self.block_size, self.block_size * self.bits // 8

    @property
    def widened(self) -> QuantFormat:
        """The blocked format a super-block format widens to (itself for the blocked form)."""
        return WIDENED.get(self.format, self)


@dataclass
class QuantTensor:
    """A weight [out, in] in blocked form (see the module docstring)."""
    codes: np.ndarray  # uint8 [out, in/B, B*bits/8]; super-blocks: [out, in/256, SUPERBLOCK_BYTES]
    scales: np.ndarray | None  # float [out, in/B]; super-blocks: None (they hold their own)
    mins: np.ndarray | None  # float [out, in/B]
    fmt: QuantFormat

    def __post_init__(self):  # dense row-major arrays, whatever view made them
        self.codes = np.ascontiguousarray(self.codes)
        self.scales = None if self.scales is None else np.ascontiguousarray(self.scales)
        self.mins = None if self.mins is None else np.ascontiguousarray(self.mins)

    def component(self, name: str) -> np.ndarray | None:
        return {"codes": self.codes, "scales": self.scales, "mins": self.mins}[name]

    def widened(self) -> QuantTensor:
        """Super-blocks in the blocked form, exactly (the module docstring); the blocked form as it is."""
        if not self.fmt.superblocks:
            return self
        q, scales, mins = _from_k_blocks(self.codes, self.fmt.format)
        wide, times = self.fmt.widened, np.float32(2.0 ** self.fmt.exponent)  # exact: a power of two
        return QuantTensor(pack(q, wide.bits), scales.astype(np.float32) * times,
                           None if mins is None else mins.astype(np.float32) * times, wide)

    def dequantized(self, dtype: np.dtype | None = None) -> np.ndarray:
        """The float weight [out, in] (float32, then `dtype`)."""
        if self.fmt.superblocks:
            return dequantize_superblocks(self.codes, self.fmt.format, dtype, self.fmt.exponent)
        assert self.scales is not None  # a blocked format's scales
        return dequantize(self.codes, self.scales, self.mins, self.fmt.bits, self.fmt.zero_point, dtype)


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # ggml's kvalues_mxfp4 (E2M1, doubled)
# the code a super-block format's zero sits at (as _from_k_blocks gives the codes: w = scale (q - centre) + min)
CENTRE = {"Q4_K": 0, "Q5_K": 0, "Q6_K": 32, "IQ4_XS": 128, "Q3_K": 4, "Q2_K": 0, "IQ4_NL": 128, "MXFP4": 128}


def superblock_format(kind: str) -> QuantFormat:
    """A GGUF super-block format carried as stored: bits/code_bits are its codes' widths, zero_point its centre."""
    bits = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "IQ4_XS": 4, "Q3_K": 3, "Q2_K": 2, "IQ4_NL": 4, "MXFP4": 4}[kind]
    return QuantFormat(bits, superblock_weights(kind), CENTRE[kind], False, bits, kind)


WIDENED = {"Q4_K": QuantFormat(4, 32, 0, True), "Q5_K": QuantFormat(8, 32, 0, True, 5),
           "Q6_K": QuantFormat(8, 16, 32, False, 6), "IQ4_XS": QuantFormat(8, 32, 128, False),
           "Q3_K": QuantFormat(8, 16, 4, False, 3), "Q2_K": QuantFormat(4, 16, 0, True, 2),
           "IQ4_NL": QuantFormat(8, 32, 128, False), "MXFP4": QuantFormat(8, 32, 128, False)}
# Q5_0/Q5_1 (llama.cpp's fallback where a row is not whole super-blocks: Gemma 3's, Qwen2.5's, SmolLM2's hidden
# sizes) hold their 5-bit codes one a byte here; the ort export on llgraph's kernels writes them back at 5 bits
# (export/cpu_layout.py fifth_bits: 5.5/6.0 bits a weight, as the file), read at every accuracy level
GGUF_FORMATS = {"Q4_0": QuantFormat(4, 32, 8, False), "Q4_1": QuantFormat(4, 32, 0, True),
                "Q5_0": QuantFormat(8, 32, 16, False, code_bits=5), "Q5_1": QuantFormat(8, 32, 0, True, code_bits=5),
                "Q8_0": QuantFormat(8, 32, 128, False), **{k: superblock_format(k) for k in SUPERBLOCK_BYTES}}


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [..., B] -> packed uint8 [..., B*bits/8] (4-bit: element 2i in the low nibble)."""
    q = q.astype(np.uint8)
    return q if bits == 8 else (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def unpack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Packed uint8 [..., B*bits/8] -> codes [..., B] as uint8."""
    if bits == 8:
        return codes
    low, high = codes & 0x0F, codes >> 4
    return np.stack((low, high), axis=-1).reshape(*codes.shape[:-1], -1)


def dequantize(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, bits: int, zero_point: int,
               dtype: np.dtype | None = None) -> np.ndarray:
    """Blocked codes -> float weight [out, in], computed in float32 then cast to `dtype` (scales' dtype)."""
    q = unpack(codes, bits).astype(np.float32) - np.float32(zero_point)  # [out, nb, B]
    w = q * scales.astype(np.float32)[..., None]
    if mins is not None:
        w = w + mins.astype(np.float32)[..., None]
    return w.reshape(w.shape[0], -1).astype(dtype or scales.dtype, copy=False)


def dequantize_superblocks(raw: np.ndarray, kind: str, dtype: np.dtype | None = None, exponent: int = 0) -> np.ndarray:
    """GGUF K-quant super-blocks [out, in/256, bytes] -> float weight [out, in] (float32, times 2^exponent, then
    `dtype`)."""
    q, scales, mins = _from_k_blocks(raw, kind)
    w = q.astype(np.float32) - np.float32(CENTRE[kind])
    w = w * scales.astype(np.float32)[..., None]
    if mins is not None:
        w = w + mins.astype(np.float32)[..., None]
    if exponent:
        w = w * np.float32(2.0 ** exponent)
    return w.reshape(raw.shape[0], -1).astype(dtype or np.float32, copy=False)


def dequantize_experts(codes: np.ndarray, kind: str, dtype: np.dtype | None = None, exponent: int = 0) -> np.ndarray:
    """Stacked experts' super-blocks [experts, out, in/256, bytes] -> float [experts, out, in] (ops.py's QMoE)."""
    e, out = codes.shape[:2]
    return dequantize_superblocks(codes.reshape(e * out, *codes.shape[2:]), kind, dtype, exponent).reshape(e, out, -1)


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    s = s.astype(np.uint16)
    low = (s[..., 0:4] & 63, s[..., 4:8] & 63)
    high = ((s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4), (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4))
    return np.concatenate((low[0], high[0]), -1), np.concatenate((low[1], high[1]), -1)


def _from_k_blocks(blocks: np.ndarray, type_name: str):
    """[out, n/256, bytes] K-quant super-blocks -> codes [out, n/B, B], scales and mins [out, n/B] (or None)."""
    out, nsb = blocks.shape[:2]
    if type_name == "IQ4_NL":  # d, 16 bytes of nibbles (element j low, j + 16 high) indexing IQ4_VALUES
        q = _iq4_codes(np.concatenate((blocks[..., 2:18] & 15, blocks[..., 2:18] >> 4), -1))
        return q, _f16(blocks[..., 0:2]), None
    if type_name == "MXFP4":  # e (E8M0), 16 bytes of nibbles as IQ4_NL's indexing MXFP4_VALUES; scale 2^(e - 128)
        q = (np.array(MXFP4_VALUES, np.int16) + 128).astype(np.uint8)[
            np.concatenate((blocks[..., 1:17] & 15, blocks[..., 1:17] >> 4), -1)]
        return q, e8m0_half(blocks[..., 0]), None
    if type_name == "IQ4_XS":  # d scales_h (u16) scales_l[4] qs[128]: sub-block j: 16 bytes, element l low, 16+l high
        high = (blocks[..., 2].astype(np.uint16) | (blocks[..., 3].astype(np.uint16) << 8))[..., None]
        ls = np.stack((blocks[..., 4:8] & 15, blocks[..., 4:8] >> 4), -1).reshape(out, nsb, 8)
        ls = ls | (((high >> (2 * np.arange(8, dtype=np.uint16))) & 3) << 4).astype(np.uint8)
        qs = blocks[..., 8:136].reshape(out, nsb, 8, 16)
        q = _iq4_codes(np.concatenate((qs & 15, qs >> 4), -1))
        return q.reshape(out, nsb * 8, 32), (_f16(blocks[..., 0:2])[..., None] * (ls.astype(np.float32) - 32)) \
            .reshape(out, nsb * 8), None
    if type_name == "Q2_K":  # scales[16] (sc | m << 4) qs[64] d dmin: element 128n + 32t + l, bits 2t of qs[32n + l]
        qs = blocks[..., 16:80].reshape(out, nsb, 2, 1, 32)
        q = (qs >> (2 * np.arange(4, dtype=np.uint8)[:, None])) & 3  # [out, nsb, n, t, l]
        d, dmin = _f16(blocks[..., 80:82])[..., None], _f16(blocks[..., 82:84])[..., None]
        scales, mins = d * (blocks[..., 0:16] & 15), -(dmin * (blocks[..., 0:16] >> 4))
        return q.reshape(out, nsb * 16, 16), scales.reshape(out, nsb * 16), mins.reshape(out, nsb * 16)
    if type_name == "Q3_K":  # hmask[32] qs[64] scales[12] d: element 128n + 32t + l, bits 2t of qs[32n + l] and
        # bit 4n + t of hmask[l]; scale i: nibble i // 8 of byte i % 8, bits 2 (i // 4) of byte 8 + i % 4 above
        hm, qs = blocks[..., 0:32], blocks[..., 32:96].reshape(out, nsb, 2, 1, 32)
        t = np.arange(4, dtype=np.uint8)[:, None]
        high = (hm[:, :, None, None, :] >> (4 * np.arange(2, dtype=np.uint8)[:, None, None] + t)) & 1
        q = ((qs >> (2 * t)) & 3) | (high << 2)  # [out, nsb, n, t, l]
        i = np.arange(16)
        sb = blocks[..., 96:108]
        sc = ((sb[..., i % 8] >> (4 * (i // 8))) & 15) | (((sb[..., 8 + i % 4] >> (2 * (i // 4))) & 3) << 4)
        scales = _f16(blocks[..., 108:110])[..., None] * (sc.astype(np.float32) - 32)
        return q.reshape(out, nsb * 16, 16), scales.reshape(out, nsb * 16), None
    if type_name == "Q6_K":  # ql[128] qh[64] scales[16] (int8) d
        ql, qh = blocks[..., 0:128].reshape(out, nsb, 2, 64), blocks[..., 128:192].reshape(out, nsb, 2, 32)
        sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(blocks[..., 208:210])
        parts = [(ql[..., :32] & 0xF) | ((qh & 3) << 4), (ql[..., 32:] & 0xF) | (((qh >> 2) & 3) << 4),
                 (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
        q = np.stack(parts, axis=3).reshape(out, nsb * 16, 16)  # 128-halves of 4 x 32, in element order
        return q, (d[..., None] * sc).reshape(out, nsb * 16), None
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = _k_scales_mins(blocks[..., 4:16])
    if type_name == "Q4_K":  # d dmin scales[12] qs[128]: chunk c's 32 bytes give sub-block 2c (low), 2c+1 (high)
        qs = blocks[..., 16:144].reshape(out, nsb, 4, 32)
        q = np.stack((qs & 0xF, qs >> 4), axis=3)
    else:  # Q5_K: d dmin scales[12] qh[32] qs[128]; qh bit j of byte l is the fifth bit of sub-block j, element l
        qh, qs = blocks[..., 16:48], blocks[..., 48:176].reshape(out, nsb, 4, 32)
        bit = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [out, nsb, 8, 32]
        q = np.stack((qs & 0xF, qs >> 4), axis=3) + (bit.reshape(out, nsb, 4, 2, 32) << 4)
    scales = (d[..., None] * sc).reshape(out, nsb * 8)
    mins = -(dmin[..., None] * m).reshape(out, nsb * 8)
    return q.reshape(out, nsb * 8, 32), scales, mins


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 exponent bytes as ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128) in float32 (subnormal below 2), exact."""
    return np.ldexp(np.float32(1), e.astype(np.int32) - 128).astype(np.float32)


def _iq4_codes(nibbles: np.ndarray) -> np.ndarray:
    """IQ4 nibbles -> the 8-bit codes kv + 128 of their values."""
    return (np.array(IQ4_VALUES, np.int16) + 128).astype(np.uint8)[nibbles]


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> QuantTensor:
    """GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL/Q2_K..Q6_K/IQ4_XS block bytes of a [out, in] tensor -> QuantTensor,
    without rounding (super-blocks as they are; they may be stacked experts, [experts, out, in])."""
    fmt = GGUF_FORMATS[type_name]
    if fmt.superblocks:  # as stored, byte for byte
        return QuantTensor(raw.reshape(*shape[:-1], *fmt.codes_shape(1, shape[-1])[1:]), None, None, fmt)
    out, n_in = shape
    nb = n_in // 32
    blocks = raw.reshape(out, nb, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if type_name == "Q8_0":
        q = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        mins = None
    elif type_name in ("Q5_0", "Q5_1"):  # d, (m), 32 high bits, 16 bytes of low nibbles: element j, j + 16
        at = 4 if type_name == "Q5_1" else 2
        qh = blocks[..., at:at + 4].copy().view("<u4")[..., 0]
        qs = blocks[..., at + 4:at + 20]
        high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1) | high
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0] if type_name == "Q5_1" else None
        if mins is not None:
            q = np.where((d == 0)[..., None], 0, q)
    else:
        qs = blocks[..., 4:20] if type_name == "Q4_1" else blocks[..., 2:18]
        q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # GGUF: element j low nibble, j + 16 high nibble
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0] if type_name == "Q4_1" else None
        if mins is not None:  # d == 0: every weight of the block is m whatever q says; make q agree
            q = np.where((d == 0)[..., None], 0, q)
    return QuantTensor(pack(q, fmt.bits), d.astype(np.float32), None if mins is None else mins.astype(np.float32), fmt)


def quantize_rtn(w: np.ndarray, bits: int, block_size: int, symmetric: bool) -> QuantTensor:
    """Round-to-nearest: per block, symmetric (scale = max|w| / (2^(bits-1) - 1), zero point 2^(bits-1)) or
    asymmetric (scale = (max - min) / (2^bits - 1), min kept as the block's min)."""
    out, n_in = w.shape
    if n_in % block_size:
        raise ValueError(f"block size {block_size} does not divide the input features ({n_in})")
    x = w.astype(np.float32).reshape(out, n_in // block_size, block_size)
    levels = (1 << bits) - 1
    if symmetric:
        zp = 1 << (bits - 1)
        scale = np.abs(x).max(-1) / np.float32(zp - 1)
        safe = np.where(scale == 0, np.float32(1), scale)
        q = np.clip(np.round(x / safe[..., None]) + zp, 0, levels)
        mins, fmt = None, QuantFormat(bits, block_size, zp, False)
    else:
        lo, hi = x.min(-1), x.max(-1)
        scale = (hi - lo) / np.float32(levels)
        safe = np.where(scale == 0, np.float32(1), scale)
        q = np.clip(np.round((x - lo[..., None]) / safe[..., None]), 0, levels)
        mins, fmt = lo, QuantFormat(bits, block_size, 0, True)
    return QuantTensor(pack(q.astype(np.uint8), bits), scale, mins, fmt)
