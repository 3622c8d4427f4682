"""Triton kernels for the ops that become TensorRT plugins. No tensorrt import here: the kernels are testable alone,
under TRITON_INTERPRET=1 on CPU tensors, and compile ahead of time to PTX (plugins/aot.py).

Semantics are the op schemas' (llgraph/ops.py) as the PyTorch executor implements them; layouts are contiguous:
activations [tokens, features] with heads packed in the features, RoPE cos/sin [tokens, rotary_dim / 2] float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr):
    """One row per program: y = (x / sqrt(mean(x^2) + eps)) in float32, rounded to x's dtype, times w."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * n_cols + cols, (xf * inv).to(x.dtype) * w, mask=mask)


@triton.jit
def swiglu_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """y = silu(g) * u elementwise; silu in float32, rounded to the input dtype, as torch does."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(y_ptr + offs, (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


@triton.jit
def rotary_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, num_heads, head_dim, half, INTERLEAVED: tl.constexpr,
                  BLOCK: tl.constexpr):
    """One (token, head) per program. Rotates pairs (i, i + half) or (2i, 2i + 1) for i < half; dims past
    2 * half pass through."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = token * num_heads * head_dim + head * head_dim
    i = tl.arange(0, BLOCK)
    pair = i < half
    c = tl.load(cos_ptr + token * half + i, mask=pair, other=1.0)
    s = tl.load(sin_ptr + token * half + i, mask=pair, other=0.0)
    if INTERLEAVED:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + half
    x1 = tl.load(x_ptr + base + first, mask=pair, other=0.0)
    x2 = tl.load(x_ptr + base + second, mask=pair, other=0.0)
    c, s = c.to(x1.dtype), s.to(x1.dtype)  # the executor rotates in x's dtype, like HF
    tl.store(y_ptr + base + first, x1 * c - x2 * s, mask=pair)
    tl.store(y_ptr + base + second, x2 * c + x1 * s, mask=pair)
    rest = 2 * half + i
    keep = rest < head_dim
    tl.store(y_ptr + base + rest, tl.load(x_ptr + base + rest, mask=keep, other=0.0), mask=keep)


@triton.jit
def cache_write_kernel(new_ptr, pos_ptr, cache_ptr, seq, kv_heads, max_seq, head_dim, BLOCK_D: tl.constexpr):
    """One (batch row, token, kv head) per program: cache[b, h, positions[b, s], :] = new[b, s, h, :]."""
    b, s, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < head_dim
    pos = tl.load(pos_ptr + b * seq + s).to(tl.int64)
    row = tl.load(new_ptr + ((b * seq + s) * kv_heads + h) * head_dim + d, mask=mask)
    tl.store(cache_ptr + ((b * kv_heads + h) * max_seq + pos) * head_dim + d, row, mask=mask)


@triton.jit
def attention_kernel(q_ptr, pos_ptr, k_ptr, v_ptr, out_ptr, seq, num_heads, kv_heads, max_seq, head_dim, scale,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (batch row, token, query head) per program: causal attention over cache slots 0..positions[b, s] of kv
    head h // (num_heads / kv_heads), with an online softmax in float32 (prefill and decode alike)."""
    b, s, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    kvh = h // (num_heads // kv_heads)
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    pos = tl.load(pos_ptr + b * seq + s).to(tl.int64)
    q = tl.load(q_ptr + ((b * seq + s) * num_heads + h) * head_dim + d, mask=dmask, other=0.0).to(tl.float32)
    base = (b * kv_heads + kvh) * max_seq * head_dim
    m = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)  # running max
    total = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)  # running sum of exp
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, pos + 1, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n <= pos
        kv_offs = base + n[:, None] * head_dim + d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=nmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        scores = tl.where(nmask, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        correction = tl.exp(m - m_new)
        v = tl.load(v_ptr + kv_offs, mask=nmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        acc = acc * correction + tl.sum(p[:, None] * v, axis=0)
        total = total * correction + tl.sum(p, axis=0)
        m = m_new
    out = acc / total
    tl.store(out_ptr + ((b * seq + s) * num_heads + h) * head_dim + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


# -- launchers (the JIT path; the plugins' `impl` calls these) ------------------------------------------------------

def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(rows)
    rmsnorm_kernel[(rows.shape[0],)](rows, w.contiguous(), y, rows.shape[1], eps,
                                     BLOCK=triton.next_power_of_2(rows.shape[1]))
    return y.view_as(x)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty_like(g)
    block = 1024
    swiglu_kernel[(triton.cdiv(g.numel(), block),)](g, u, y, g.numel(), BLOCK=block)
    return y


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, interleaved: bool) -> torch.Tensor:
    """x: [..., num_heads * head_dim]; cos, sin: [..., rotary_dim / 2] over the same leading dims."""
    head_dim = x.shape[-1] // num_heads
    tokens = x.numel() // x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    half = cos.shape[-1]
    rotary_kernel[(tokens, num_heads)](xc, cos.float().contiguous(), sin.float().contiguous(), y, num_heads,
                                       head_dim, half, INTERLEAVED=interleaved,
                                       BLOCK=triton.next_power_of_2(max(half, head_dim - 2 * half, 1)))
    return y


def grouped_attention(q, k, v, positions, past_key, past_value, num_heads: int, num_kv_heads: int, scale: float):
    """GroupedAttention: q [B, S, Hq*D]; k, v [B, S, Hkv*D]; positions [B, S]; caches [B, Hkv, M, D], written in
    place at the positions. Returns out [B, S, Hq*D]."""
    b, s, _ = q.shape
    head_dim, max_seq = past_key.shape[-1], past_key.shape[2]
    pos = positions.contiguous()
    block_d = triton.next_power_of_2(head_dim)
    for new, cache in ((k, past_key), (v, past_value)):
        cache_write_kernel[(b, s, num_kv_heads)](new.contiguous(), pos, cache, s, num_kv_heads, max_seq, head_dim,
                                                 BLOCK_D=block_d)
    out = torch.empty_like(q)
    attention_kernel[(b, s, num_heads)](q.contiguous(), pos, past_key, past_value, out, s, num_heads, num_kv_heads,
                                        max_seq, head_dim, scale, BLOCK_N=32, BLOCK_D=block_d)
    return out
