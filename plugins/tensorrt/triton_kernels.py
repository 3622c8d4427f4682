"""Triton kernels for the ops that become TensorRT plugins, and the one launch plan both ways of running them share.
No tensorrt import here: the kernels are testable alone, under TRITON_INTERPRET=1 on CPU tensors, and compile ahead
of time to PTX (plugins/tensorrt/aot.py).

Semantics are the op schemas' (llgraph/ops.py) as the PyTorch executor implements them; layouts are contiguous:
activations [batch, seq, features] with heads packed in the features, RoPE cos/sin [batch, seq, rotary_dim / 2]
float32, caches [batch, kv_heads, max_seq, head_dim].

Every kernel takes its arguments in the order a TensorRT AOT plugin launches it: input pointers, then int32 scalars,
then output pointers; per-model values (eps, scale, head counts) and block sizes are constexprs. `plan()` says, for
one op on given shapes, which kernel, grid, scalars and constexprs to use. Shapes are ints (JIT, tests) or TensorRT
shape expressions (`aot_impl`): the plan only multiplies, adds and floor-divides them, and asks `static()` for the
dims a block size depends on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, n_cols, y_ptr, EPS: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program: y = (x / sqrt(mean(x^2) + eps)) in float32, rounded to x's dtype, times w."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + EPS)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * n_cols + cols, (xf * inv).to(x.dtype) * w, mask=mask)


@triton.jit
def swiglu_kernel(g_ptr, u_ptr, n, y_ptr, BLOCK: tl.constexpr):
    """y = silu(g) * u elementwise; silu in float32, rounded to the input dtype, as torch does."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(y_ptr + offs, (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


@triton.jit
def rotary_kernel(x_ptr, cos_ptr, sin_ptr, num_heads, head_dim, half, y_ptr, INTERLEAVED: tl.constexpr,
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
def _attend(q, k_ptrs, v_ptrs, mask, dmask, m, total, acc, SCALE: tl.constexpr, SOFTCAP: tl.constexpr):
    """One block of keys/values into a running (max, sum of exp, weighted sum) — the online softmax, in float32.
    SOFTCAP > 0: the scaled scores become SOFTCAP * tanh(scores / SOFTCAP) before the mask."""
    k = tl.load(k_ptrs, mask=mask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    scores = tl.sum(k * q[None, :], axis=1) * SCALE
    if SOFTCAP > 0:  # tanh from exp, stable for any magnitude: sign(t) * (1 - e^-2|t|) / (1 + e^-2|t|)
        t = scores / SOFTCAP
        e = tl.exp(-2.0 * tl.abs(t))
        scores = SOFTCAP * tl.where(t < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
    scores = tl.where(mask, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=0))
    p = tl.exp(scores - m_new)
    correction = tl.exp(m - m_new)
    v = tl.load(v_ptrs, mask=mask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    return m_new, total * correction + tl.sum(p, axis=0), acc * correction + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, kc_ptr, vc_ptr, seq, max_seq, out_ptr, kc_out_ptr, vc_out_ptr,
                     NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE: tl.constexpr,
                     WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """GroupedAttention in one launch, for prefill and decode. One (batch row, token, query head) per program.

    Row b's positions are contiguous from start = positions[b, 0]: query (b, s) attends to the cached slots
    0..start-1 (read from the cache) and to the row's new tokens 0..s (read from k/v), with an online softmax in
    float32. The first query head of each group then writes the group's new k/v row into the cache at slot
    positions[b, s]. The writes touch only slots >= start and the reads of the cache only slots < start, so the
    programs never race, and the caches may be updated in place (kc_out_ptr == kc_ptr, as TensorRT aliases them).
    With WINDOW > 0 the query sees only the positions p > its own - WINDOW: both loops start at the first such
    key, so no block is wholly masked (an all -inf block would make the online softmax NaN)."""
    b, s, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    kvh = h // (NUM_HEADS // KV_HEADS)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    n = tl.arange(0, BLOCK_N)
    start = tl.load(pos_ptr + b * seq).to(tl.int64)
    q = tl.load(q_ptr + ((b * seq + s) * NUM_HEADS + h) * HEAD_DIM + d, mask=dmask, other=0.0).to(tl.float32)
    m = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    cache = (b * KV_HEADS + kvh) * max_seq * HEAD_DIM
    first_slot, first_new = 0, 0
    if WINDOW > 0:
        first_slot = tl.maximum(start + s - WINDOW + 1, 0)
        first_new = tl.maximum(s - WINDOW + 1, 0)
    for n0 in range(first_slot, start, BLOCK_N):  # the cached prefix
        offs = cache + (n0 + n)[:, None] * HEAD_DIM + d[None, :]
        m, total, acc = _attend(q, kc_ptr + offs, vc_ptr + offs, n0 + n < start, dmask, m, total, acc, SCALE,
                                SOFTCAP)
    new = (b * seq * KV_HEADS + kvh) * HEAD_DIM
    for t0 in range(first_new, s + 1, BLOCK_N):  # this call's tokens, causally
        offs = new + (t0 + n)[:, None] * (KV_HEADS * HEAD_DIM) + d[None, :]
        m, total, acc = _attend(q, k_ptr + offs, v_ptr + offs, t0 + n <= s, dmask, m, total, acc, SCALE,
                                SOFTCAP)
    tl.store(out_ptr + ((b * seq + s) * NUM_HEADS + h) * HEAD_DIM + d, (acc / total).to(out_ptr.dtype.element_ty),
             mask=dmask)
    if h % (NUM_HEADS // KV_HEADS) == 0:
        row = ((b * seq + s) * KV_HEADS + kvh) * HEAD_DIM + d
        slot = cache + tl.load(pos_ptr + b * seq + s).to(tl.int64) * HEAD_DIM + d
        tl.store(kc_out_ptr + slot, tl.load(k_ptr + row, mask=dmask), mask=dmask)
        tl.store(vc_out_ptr + slot, tl.load(v_ptr + row, mask=dmask), mask=dmask)


# -- the launch plan (shared by the JIT launchers below and the plugins' aot_impl) ---------------------------------

@dataclass
class Launch:
    kernel: triton.JITFunction
    grid: tuple  # ints or shape expressions
    scalars: tuple  # the int32 arguments between the input and output pointers
    constexprs: dict


def static(dim) -> int:
    """A dim that must be known when the kernel is compiled (a feature size): an int, or a TensorRT shape
    expression's constant value."""
    return dim if isinstance(dim, int) else dim.constant_value()


def plan(op: str, shapes: dict, attrs: dict) -> Launch:
    """The launch for plugin op `op` on input shapes {input name: (dims...)} with the node's attributes."""
    if op == "RMSNorm":  # one program per group of `group` features
        b, s, n = shapes["x"]
        group = attrs["group"]
        return Launch(rmsnorm_kernel, (b * s * (static(n) // group),), (group,),
                      dict(EPS=float(attrs["eps"]), BLOCK=triton.next_power_of_2(group)))
    if op == "SwiGLU":
        b, s, n = shapes["gate"]
        block = 1024
        return Launch(swiglu_kernel, ((b * s * n + block - 1) // block,), (b * s * n,), dict(BLOCK=block))
    if op == "Rotary":
        (b, s, hidden), heads, half = shapes["x"], attrs["num_heads"], shapes["cos"][-1]
        head_dim = static(hidden) // heads
        block = triton.next_power_of_2(max(static(half), head_dim - 2 * static(half), 1))
        return Launch(rotary_kernel, (b * s, heads), (heads, head_dim, half),
                      dict(INTERLEAVED=bool(attrs["interleaved"]), BLOCK=block))
    if op == "GroupedAttention":
        (b, s, _), (_, _, max_seq, head_dim) = shapes["q"], shapes["past_key"]
        return Launch(attention_kernel, (b, s, attrs["num_heads"]), (s, max_seq), dict(
            NUM_HEADS=attrs["num_heads"], KV_HEADS=attrs["num_kv_heads"], HEAD_DIM=static(head_dim),
            SCALE=float(attrs["scale"]), WINDOW=int(attrs.get("window", 0)),
            SOFTCAP=float(attrs.get("softcap", 0.0)), BLOCK_N=32, BLOCK_D=triton.next_power_of_2(static(head_dim))))
    raise KeyError(f"no kernel for op {op}")


def launch(op: str, inputs: dict[str, torch.Tensor], outputs: list[torch.Tensor], attrs: dict) -> None:
    """Run `op`'s kernel on contiguous tensors, writing `outputs` (the JIT path; the plugins' `impl` calls this)."""
    p = plan(op, {name: tuple(t.shape) for name, t in inputs.items()}, attrs)
    p.kernel[p.grid](*inputs.values(), *p.scalars, *outputs, **p.constexprs)


# -- op-level helpers (tests, TorchBackend-style callers) ----------------------------------------------------------

def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x, y = x.contiguous(), torch.empty_like(x)
    launch("RMSNorm", {"x": x, "weight": w.contiguous()}, [y], {"eps": eps, "group": w.shape[-1]})
    return y


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, y = gate.contiguous(), torch.empty_like(gate)
    launch("SwiGLU", {"gate": gate, "up": up.contiguous()}, [y], {})
    return y


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, interleaved: bool) -> torch.Tensor:
    """x: [B, S, num_heads * head_dim]; cos, sin: [B, S, rotary_dim / 2]."""
    x, y = x.contiguous(), torch.empty_like(x)
    launch("Rotary", {"x": x, "cos": cos.float().contiguous(), "sin": sin.float().contiguous()}, [y],
           {"num_heads": num_heads, "interleaved": interleaved})
    return y


def grouped_attention(q, k, v, positions, past_key, past_value, num_heads: int, num_kv_heads: int, scale: float,
                      window: int = 0, softcap: float = 0.0):
    """GroupedAttention: q [B, S, Hq*D]; k, v [B, S, Hkv*D]; positions [B, S] (contiguous per row); caches
    [B, Hkv, M, D], written in place at the positions. Returns out [B, S, Hq*D]."""
    q, out = q.contiguous(), torch.empty_like(q)
    inputs = {"q": q, "k": k.contiguous(), "v": v.contiguous(), "positions": positions.contiguous(),
              "past_key": past_key, "past_value": past_value}
    launch("GroupedAttention", inputs, [out, past_key, past_value],
           {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "scale": scale, "causal": True, "window": window,
            "softcap": softcap})
    return out
