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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class QuantFormat:
    bits: int
    block_size: int
    zero_point: int
    has_mins: bool

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"bits ({self.bits}) must be 4 or 8")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block-size ({self.block_size}) must be a power of 2 >= 16")

    @property
    def attrs(self) -> dict:
        """The QLinear attributes of this format."""
        return {"bits": self.bits, "block_size": self.block_size, "zero_point": self.zero_point}


@dataclass
class QuantTensor:
    """A weight [out, in] in blocked form (see the module docstring)."""
    codes: torch.Tensor  # uint8 [out, in/B, B*bits/8]
    scales: torch.Tensor  # float [out, in/B]
    mins: torch.Tensor | None  # float [out, in/B]
    fmt: QuantFormat

    def component(self, name: str) -> torch.Tensor:
        return {"codes": self.codes, "scales": self.scales, "mins": self.mins}[name]


GGUF_FORMATS = {"Q4_0": QuantFormat(4, 32, 8, False), "Q4_1": QuantFormat(4, 32, 0, True),
                "Q8_0": QuantFormat(8, 32, 128, False)}


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes [..., B] -> packed uint8 [..., B*bits/8] (4-bit: element 2i in the low nibble)."""
    q = q.astype(np.uint8)
    return q if bits == 8 else (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed uint8 [..., B*bits/8] -> codes [..., B] as uint8."""
    if bits == 8:
        return codes
    low, high = codes & 0x0F, codes >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int, zero_point: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Blocked codes -> float weight [out, in], computed in float32 then cast to `dtype` (scales' dtype)."""
    q = unpack(codes, bits).to(torch.float32) - zero_point  # [out, nb, B]
    w = q * scales.to(torch.float32)[..., None]
    if mins is not None:
        w = w + mins.to(torch.float32)[..., None]
    return w.flatten(1).to(dtype or scales.dtype)


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantTensor:
    """GGUF Q4_0/Q4_1/Q8_0 block bytes of a [out, in] tensor -> QuantTensor, without rounding anything."""
    fmt = GGUF_FORMATS[type_name]
    out, n_in = shape
    nb = n_in // 32
    blocks = raw.reshape(out, nb, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if type_name == "Q8_0":
        q = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        mins = None
    else:
        qs = blocks[..., 4:20] if type_name == "Q4_1" else blocks[..., 2:18]
        q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # GGUF: element j low nibble, j + 16 high nibble
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0] if type_name == "Q4_1" else None
        if mins is not None:  # d == 0: every weight of the block is m whatever q says; make q agree
            q = np.where((d == 0)[..., None], 0, q)
    def to_torch(a):
        return torch.from_numpy(np.ascontiguousarray(a))
    return QuantTensor(to_torch(pack(q, fmt.bits)), to_torch(d.astype(np.float32)),
                       None if mins is None else to_torch(mins.astype(np.float32)), fmt)


def quantize_rtn(w: torch.Tensor, bits: int, block_size: int, symmetric: bool) -> QuantTensor:
    """Round-to-nearest: per block, symmetric (scale = max|w| / (2^(bits-1) - 1), zero point 2^(bits-1)) or
    asymmetric (scale = (max - min) / (2^bits - 1), min kept as the block's min)."""
    out, n_in = w.shape
    if n_in % block_size:
        raise ValueError(f"block size {block_size} does not divide the input features ({n_in})")
    x = w.to(torch.float32).reshape(out, n_in // block_size, block_size)
    levels = (1 << bits) - 1
    if symmetric:
        zp = 1 << (bits - 1)
        scale = x.abs().amax(-1) / (zp - 1)
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.clamp(torch.round(x / safe[..., None]) + zp, 0, levels)
        mins, fmt = None, QuantFormat(bits, block_size, zp, False)
    else:
        lo, hi = x.amin(-1), x.amax(-1)
        scale = (hi - lo) / levels
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.clamp(torch.round((x - lo[..., None]) / safe[..., None]), 0, levels)
        mins, fmt = lo, QuantFormat(bits, block_size, 0, True)
    codes = torch.from_numpy(pack(q.to(torch.uint8).numpy(), bits))
    return QuantTensor(codes, scale, mins, fmt)
