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
