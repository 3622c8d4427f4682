"""Triton kernels for the ops that become TensorRT plugins, and the one launch plan both ways of running them share.
No tensorrt import here: the kernels are testable alone, under TRITON_INTERPRET=1 on CPU tensors, and compile ahead
of time to PTX (plugins/tensorrt/aot.py).

Semantics are the op schemas' (llgraph/ops.py) as the PyTorch executor implements them; layouts are contiguous:
activations [batch, seq, features] with heads packed in the features, RoPE cos/sin [batch, seq, rotary_dim / 2]
float32, caches [rows, kv_heads, max_seq, head_dim] (GroupedAttention's slots name each token's row).

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

from llgraph.plugins.tensorrt import spec


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
def attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, kc_ptr, vc_ptr, slots_ptr, sinks_ptr, seq, max_seq, n_slots,
                     n_sinks, out_ptr,
                     kc_out_ptr, vc_out_ptr, NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     SCALE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """GroupedAttention in one launch, for prefill, decode and ragged batches. One (batch row, token, query head)
    per program; token i = b * seq + s lives in cache row slots[i] (n_slots > 0: ragged rows by slot id, any rows
    in any order, several rows' tokens in one batch row) or row b (n_slots == 0).

    The call writes each token's k/v into its row at its position, and query i at position p attends to its row's
    positions 0..p. One launch cannot order every write before every read, so a program reads no cache slot this
    call writes: the positions a row's tokens take in one call must be one contiguous range [first, ...] (a
    prompt chunk, a decode token and its drafts; TRTBackend checks it) — the row's new tokens come from k/v (found by
    scanning the call's tokens for the row's id, blocks with none skipped; the same scan finds `first`), then the
    positions below `first` from the cache. Writes touch only slots >= first, reads of the cache only slots < first:
    no race, and the caches may be updated in place (kc_out_ptr == kc_ptr, as TensorRT aliases them). With
    WINDOW > 0 the query sees only the positions > p - WINDOW; every block it attends holds at least one such key
    (a block of the call's tokens with none is skipped; an all -inf block would make the online softmax NaN)."""
    b, s, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    kvh = h // (NUM_HEADS // KV_HEADS)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    n = tl.arange(0, BLOCK_N)
    i = b * seq + s
    row = b
    lo, hi = b * seq, b * seq + seq  # the tokens that may share the row: its batch row's, or (ragged) every one
    if n_slots > 0:
        row = tl.load(slots_ptr + i).to(tl.int64)
        lo, hi = lo * 0, (tl.num_programs(0) * seq).to(tl.int64)
    p = tl.load(pos_ptr + i).to(tl.int64)
    oldest = p * 0
    if WINDOW > 0:
        oldest = tl.maximum(p - WINDOW + 1, 0)
    q = tl.load(q_ptr + (i * NUM_HEADS + h) * HEAD_DIM + d, mask=dmask, other=0.0).to(tl.float32)
    m = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    first = p  # the row's first position in this call, found by the same scan (the softmax takes keys in any order)
    for t0 in range(lo, hi, BLOCK_N):  # this call's tokens of the row, causally and within the window
        t = t0 + n
        mine = _same_row(slots_ptr, t, hi, seq, row, n_slots)
        at = tl.load(pos_ptr + t, mask=mine, other=0)
        first = tl.minimum(first, tl.min(tl.where(mine, at, p), axis=0))
        seen = mine & (at <= p) & (at >= oldest)
        if tl.max(seen.to(tl.int32), axis=0) > 0:
            offs = (t * KV_HEADS + kvh)[:, None] * HEAD_DIM + d[None, :]
            m, total, acc = _attend(q, k_ptr + offs, v_ptr + offs, seen, dmask, m, total, acc, SCALE, SOFTCAP)
    cache = (row * KV_HEADS + kvh) * max_seq * HEAD_DIM
    for n0 in range(oldest, first, BLOCK_N):  # the cached prefix below it
        offs = cache + (n0 + n)[:, None] * HEAD_DIM + d[None, :]
        m, total, acc = _attend(q, kc_ptr + offs, vc_ptr + offs, n0 + n < first, dmask, m, total, acc, SCALE,
                                SOFTCAP)
    if n_sinks > 0:  # gpt-oss: the head's sink logit joins the denominator, no value behind it
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m_new = tl.maximum(m, sink)
        acc = acc * tl.exp(m - m_new)
        total = total * tl.exp(m - m_new) + tl.exp(sink - m_new)
    tl.store(out_ptr + (i * NUM_HEADS + h) * HEAD_DIM + d, (acc / total).to(out_ptr.dtype.element_ty), mask=dmask)
    if h % (NUM_HEADS // KV_HEADS) == 0:
        new = (i * KV_HEADS + kvh) * HEAD_DIM + d
        slot = cache + p * HEAD_DIM + d
        tl.store(kc_out_ptr + slot, tl.load(k_ptr + new, mask=dmask), mask=dmask)
        tl.store(vc_out_ptr + slot, tl.load(v_ptr + new, mask=dmask), mask=dmask)


@triton.jit
def _same_row(slots_ptr, t, hi, seq, row, n_slots):
    """Which of tokens `t` (a block of flat indices, < hi) live in cache row `row`."""
    inside = t < hi
    ragged = (t * 0 + n_slots) > 0
    ids = tl.load(slots_ptr + t, mask=inside & ragged, other=-1)  # no read at all when not ragged
    return inside & (tl.where(ragged, ids, t // seq) == row)


@triton.jit
def expert_matmul_kernel(x_ptr, w_ptr, chosen_ptr, order_ptr, blocks_ptr, rows, top_k, pairs, experts,
                         in_features, out_features, y_ptr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """ExpertMatMul on pairs grouped by expert (export/expert_schedule.py): one run of BLOCK_M pairs of one expert
    (`order`, padded with `pairs`, no pair) and BLOCK_N of their outputs per program. The pairs' rows (x[t, slot], or
    x[t, 0] when x has one row a token) times the expert's [in, out] matrix, read in place once for all of them, as
    tl.dot tiles with float32 accumulation over the input features in order (IEEE products for float32 inputs, no
    TF32). A row's result does not depend on the rows beside it in its run; runs past the last (`blocks` = experts)
    do nothing. `chosen` is the op's input the schedule was made from; the kernel reads the schedule alone."""
    run = tl.program_id(0).to(tl.int64)
    expert = tl.load(blocks_ptr + run)
    if expert < experts:
        pair = tl.load(order_ptr + run * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pair < pairs
        token, slot = pair // top_k, pair % top_k
        x_rows = x_ptr + (token * rows + tl.where(rows > 1, slot, 0)) * in_features
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < out_features
        w = w_ptr + expert * in_features * out_features
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            kmask = k0 + kk < in_features
            xt = tl.load(x_rows[:, None] + (k0 + kk)[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            wt = tl.load(w + (k0 + kk)[:, None] * out_features + n[None, :], mask=kmask[:, None] & nmask[None, :],
                         other=0.0)
            acc = tl.dot(xt, wt, acc, input_precision="ieee")
        tl.store(y_ptr + pair[:, None] * out_features + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=valid[:, None] & nmask[None, :])


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
        (b, s, _), (_, _, max_seq, head_dim), (n_slots,) = shapes["q"], shapes["past_key"], shapes["slots"]
        (n_sinks,) = shapes.get("sinks", (0,))
        return Launch(attention_kernel, (b, s, attrs["num_heads"]), (s, max_seq, n_slots, n_sinks), dict(
            NUM_HEADS=attrs["num_heads"], KV_HEADS=attrs["num_kv_heads"], HEAD_DIM=static(head_dim),
            SCALE=float(attrs["scale"]), WINDOW=int(attrs.get("window", 0)),
            SOFTCAP=float(attrs.get("softcap", 0.0)), BLOCK_N=32, BLOCK_D=triton.next_power_of_2(static(head_dim))))
    if op == "ExpertMatMul":  # a program per run of EXPERT_ROWS pairs of one expert and 64 outputs
        (tokens, rows, in_features), (experts, _, out_features) = shapes["x"], shapes["weight"]
        (_, top_k), (runs,) = shapes["chosen"], shapes["blocks"]
        block_n = 64
        return Launch(expert_matmul_kernel, (runs, (out_features + block_n - 1) // block_n),
                      (rows, top_k, tokens * top_k, experts, in_features, out_features),
                      dict(BLOCK_M=spec.EXPERT_ROWS, BLOCK_K=32, BLOCK_N=block_n))
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


def expert_matmul(x: torch.Tensor, weight: torch.Tensor, chosen: torch.Tensor, order: torch.Tensor,
                  blocks: torch.Tensor) -> torch.Tensor:
    """x [tokens, 1 or k, in]; weight [experts, in, out]; chosen [tokens, k] int64; order, blocks: chosen's
    pairs grouped by expert (export/expert_schedule.py) -> [tokens, k, out]."""
    x = x.contiguous()
    y = torch.empty(chosen.shape[0], chosen.shape[1], weight.shape[2], dtype=x.dtype, device=x.device)
    launch("ExpertMatMul", {"x": x, "weight": weight.contiguous(), "chosen": chosen.contiguous(),
                            "order": order.contiguous(), "blocks": blocks.contiguous()}, [y], {})
    return y


def grouped_attention(q, k, v, positions, past_key, past_value, num_heads: int, num_kv_heads: int, scale: float,
                      window: int = 0, softcap: float = 0.0, slots: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None):
    """GroupedAttention: q [B, S, Hq*D]; k, v [B, S, Hkv*D]; positions [B, S]; caches [R, Hkv, M, D], written in
    place at the positions; `slots` [B*S] int64 each token's cache row (None: row b; R == B); `sinks` [Hq] float32
    a logit per head in the denominator (None: none). A row's positions in one call are one contiguous range.
    Returns out [B, S, Hq*D]."""
    q, out = q.contiguous(), torch.empty_like(q)
    slots = torch.zeros(0, dtype=torch.int64, device=q.device) if slots is None else slots.contiguous()
    sinks = torch.zeros(0, dtype=torch.float32, device=q.device) if sinks is None else sinks.float().contiguous()
    inputs = {"q": q, "k": k.contiguous(), "v": v.contiguous(), "positions": positions.contiguous(),
              "past_key": past_key, "past_value": past_value, "slots": slots, "sinks": sinks}
    launch("GroupedAttention", inputs, [out, past_key, past_value],
           {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "scale": scale, "causal": True, "window": window,
            "softcap": softcap})
    return out
