"""llgraph/quant.py's dequantization in torch, for the executor (llgraph/executor.py) on its tensors' device: the
blocked form's codes and scales, and GGUF's super-blocks (and IQ4_NL/MXFP4 blocks of 32) as ggml's dequantize_row_*
define them — each computed in float32, then cast."""

from __future__ import annotations

import torch

from llgraph.quant import IQ4_VALUES, MXFP4_VALUES


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int, zero_point: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """llgraph/quant.py's blocked codes -> float weight [out, in] in torch, on the codes' device: scales * (q -
    zero_point) + mins per block, computed in float32 then cast to `dtype` (scales' dtype)."""
    q = codes if bits == 8 else torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2)
    w = (q.to(torch.float32) - zero_point) * scales.to(torch.float32)[..., None]
    if mins is not None:
        w = w + mins.to(torch.float32)[..., None]
    return w.flatten(1).to(dtype or scales.dtype)


def dequantize_superblocks(raw: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32,
                           exponent: int = 0) -> torch.Tensor:
    """GGUF K-quant super-blocks [out, in/256, bytes] (uint8) -> float weight [out, in], as ggml's dequantize_row_*
    defines them (llgraph/quant.py's numpy twin), computed in float32, times 2^exponent (QuantFormat's), then cast to
    `dtype`."""
    w = _superblocks(raw, kind)
    return (w if exponent == 0 else w * 2.0 ** exponent).to(dtype)


def _superblocks(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """dequantize_superblocks in float32."""
    out, n = raw.shape[:2]
    b = raw.to(torch.int32)

    def half(lo):  # a little-endian float16 field
        return (b[..., lo] | (b[..., lo + 1] << 8)).to(torch.int16).view(torch.float16).float()

    if kind == "Q2_K":  # scales[16] (sc | m << 4) qs[64] d dmin (llgraph/quant.py's _from_k_blocks)
        qs = b[..., 16:80].reshape(out, n, 2, 1, 32)
        q = ((qs >> (2 * torch.arange(4, device=raw.device)[:, None])) & 3).reshape(out, n * 16, 16).float()
        sc, m = (b[..., 0:16] & 15).float(), (b[..., 0:16] >> 4).float()
        w = q * (half(80)[..., None] * sc).reshape(out, -1, 1) - (half(82)[..., None] * m).reshape(out, -1, 1)
        return w.reshape(out, -1)
    if kind == "Q3_K":  # hmask[32] qs[64] scales[12] d (llgraph/quant.py's _from_k_blocks)
        dev = raw.device
        hm, qs = b[..., 0:32], b[..., 32:96].reshape(out, n, 2, 1, 32)
        t = torch.arange(4, device=dev)[:, None]
        high = (hm[:, :, None, None, :] >> (4 * torch.arange(2, device=dev)[:, None, None] + t)) & 1
        q = ((qs >> (2 * t)) & 3) | (high << 2)
        i, sb = torch.arange(16, device=dev), b[..., 96:108]
        sc = ((sb[..., i % 8] >> (4 * (i // 8))) & 15) | (((sb[..., 8 + i % 4] >> (2 * (i // 4))) & 3) << 4)
        w = (q.reshape(out, n * 16, 16).float() - 4) * (half(108)[..., None] * (sc - 32).float()).reshape(out, -1, 1)
        return w.reshape(out, -1)
    if kind in ("IQ4_NL", "MXFP4"):  # d qs[16]: element l low nibble, 16 + l high (MXFP4: e, d = 2^(e - 128))
        qs, table = (b[..., 2:18], IQ4_VALUES) if kind == "IQ4_NL" else (b[..., 1:17], MXFP4_VALUES)
        kv = torch.tensor(table, dtype=torch.float32, device=raw.device)[torch.cat([qs & 15, qs >> 4], -1)]
        d = half(0) if kind == "IQ4_NL" else torch.ldexp(torch.ones((), device=raw.device), b[..., 0].float() - 128)
        return (kv * d[..., None]).reshape(out, -1)
    if kind == "IQ4_XS":  # d scales_h(u16) scales_l[4] qs[128]: sub-block j's 16 bytes, element l low, 16 + l high
        ls = ((b[..., 4:8, None] >> torch.tensor([0, 4], device=raw.device)) & 15).reshape(out, n, 8)
        ls = ls | (((b[..., 2:3] | (b[..., 3:4] << 8)) >> (2 * torch.arange(8, device=raw.device)) & 3) << 4)
        qs = b[..., 8:136].reshape(out, n, 8, 16)
        kv = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=raw.device)[torch.cat([qs & 15, qs >> 4], -1)]
        return (kv * (half(0)[..., None] * (ls - 32).float())[..., None]).reshape(out, -1)
    if kind == "Q6_K":  # ql[128] qh[64] scales[16] d
        ql, qh = b[..., 0:128].reshape(out, n, 2, 64), b[..., 128:192].reshape(out, n, 2, 32)
        q = torch.stack([(ql[..., :32] & 15) | ((qh & 3) << 4), (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
                         (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)],
                        dim=3).reshape(out, n * 16, 16)
        sc = raw[..., 192:208].view(torch.int8).float()
        w = (q.float() - 32) * (half(208)[..., None] * sc).reshape(out, n * 16, 1)
        return w.reshape(out, -1)
    d, dmin, s = half(0), half(2), b[..., 4:16]  # Q4_K / Q5_K: d dmin scales[12] (qh[32]) qs[128]
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., -128:].reshape(out, n, 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=3).reshape(out, n, 8, 32)  # chunk c: sub-blocks 2c (low), 2c+1 (high)
    if kind == "Q5_K":  # bit j of qh[l] is the fifth bit of sub-block j's element l
        qh = b[..., 16:48]
        q = q + (((qh[:, :, None, :] >> torch.arange(8, device=raw.device)[:, None]) & 1) << 4)
    w = q.float() * (d[..., None] * sc)[..., None] - (dmin[..., None] * m)[..., None]
    return w.reshape(out, -1)
