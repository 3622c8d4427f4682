"""The executor's attention over the KV cache (llgraph/executor.py's GroupedAttention): the cache's formats, the
mask of a step's queries over a row's slots (rings and windows), and the attention itself.

On the CPU plain attention is torch's SDPA. Everything else (a GPU, Gemma 2's soft cap, gpt-oss's sinks) spells the
scores out, each group of query heads against its one KV head (no repeated K/V): on CUDA SDPA with a mask and GQA
runs cuDNN's attention, which builds a plan for each new shape, and a decode step's key span is new every step (on
an H200, 16 layers of Llama-3.2-1B: 63-71 ms a decode step at fresh positions against 15.7 spelled out, and 1.5 s for
a prompt of a length not seen before against 21 ms)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCORES_BUDGET = 1 << 28  # bytes of float32 scores at once: a long prompt's queries go through in chunks
SDPA_DEVICES = {"cpu"}  # where plain attention is torch's SDPA


def attend(a, q, positions, past_key, past_value, length: int, masks: dict | None = None, tag=None):
    """q [B, S, Hq*D] of cache rows past_key/value [B, ...] at `positions` [B, S] -> [B, S, Hq*D] over positions
    0..length-1 of each row, masked causally (or by the row's last position) and by the window. A cache shorter
    than `length` is a ring (a windowed layer's): position p in slot p mod its length. `masks`: the step's masks by
    (tag, length, ring, window, causal), built by the first layer that needs one and read by the others."""
    b, s, _ = q.shape
    hq = a["num_heads"]
    d = q.shape[-1] // hq
    ring = past_key.shape[2]  # (a ring's slots: length caps at them)
    length = min(length, ring)
    key = (tag, length, ring, a["window"], a["causal"])
    mask = None if masks is None else masks.get(key)
    if mask is None:
        mask = _mask(positions, length, ring, a["window"], a["causal"])
        if masks is not None:
            masks[key] = mask
    qh = q.view(b, s, hq, d).transpose(1, 2)
    keys, values = (from_cache(t[:, :, :length], q.dtype) for t in (past_key, past_value))
    if q.device.type not in SDPA_DEVICES or a["softcap"] or a.get("sinks") is not None:
        out = spelled_out(a, qh, keys, values, mask)
    else:
        out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask[:, None], scale=a["scale"],
                                             enable_gqa=hq != keys.shape[1])
    return out.transpose(1, 2).reshape(b, s, hq * d)


def _mask(positions, length: int, ring: int, window: int, causal: bool) -> torch.Tensor:
    """[B, S, L]: key slot j visible to query (b, s)."""
    b, s = positions.shape
    slots = torch.arange(length, device=positions.device)
    limit = positions if causal else positions.max(dim=1, keepdim=True).values.expand(b, s)
    held = slots[None, None, :]  # [B, S, L]: the position slot j holds for query (b, s)
    if length == ring:  # every slot in use: the latest position at or before the query's limit in slot j
        held = limit[:, :, None] - torch.remainder(limit[:, :, None] - held, ring)
    mask = (held <= limit[:, :, None]) & (held >= 0)
    if window:  # and within the last `window` positions of the query's own
        mask &= held > positions[:, :, None] - window
    return mask


def spelled_out(a, qh, keys, values, mask) -> torch.Tensor:
    """Attention as matrix products: qh [B, Hq, S, D], keys/values [B, Hkv, L, D], mask [B, S, L] -> [B, Hq, S, D].
    Query heads h*g..h*g+g-1 read KV head h (as repeat_interleave would pair them), as one product per KV head; in
    float32 throughout (as SDPA's kernels accumulate: half-precision scores would double a bf16 model's error against
    float64), the soft cap (Gemma 2) on the scores, the sink's logit in the denominator (gpt-oss). Queries in chunks
    whose scores fit SCORES_BUDGET."""
    b, hq, s, d = qh.shape
    hkv, length = keys.shape[1], keys.shape[2]
    g, sinks = hq // hkv, a.get("sinks")
    keys, values = keys.float(), values.float()
    out = torch.empty_like(qh)
    chunk = max(1, SCORES_BUDGET // (4 * b * hq * max(length, 1)))
    for i in range(0, s, chunk):
        n = min(chunk, s - i)
        scores = (qh[:, :, i:i + n].float().reshape(b, hkv, g * n, d) @ keys.transpose(-1, -2)) * a["scale"]
        if a["softcap"]:  # Gemma 2
            scores = a["softcap"] * torch.tanh(scores / a["softcap"])
        scores = scores.view(b, hkv, g, n, length).masked_fill(~mask[:, None, None, i:i + n], float("-inf"))
        if sinks is not None:  # one more logit a head in the softmax, its probability dropped
            column = sinks.float().view(1, hkv, g, 1, 1).expand(b, hkv, g, n, 1)
            probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[:, :, i:i + n] = (probs.view(b, hkv, g * n, length) @ values).view(b, hq, n, d)
    return out


def to_cache(x, dtype):
    """Rows [..., D] in the cache format of `dtype` (llgraph/kv_cache.py): its floats, or int8 codes + scale."""
    if dtype != torch.int8:
        return x.to(dtype)
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(x / torch.where(scale > 0, scale, 1)), 0).to(torch.int8)
    return torch.cat((codes, scale.view(torch.int8)), dim=-1)


def from_cache(rows, dtype):
    """Cache rows in their format -> [..., D] in `dtype`."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    return (rows[..., :-4].float() * rows[..., -4:].contiguous().view(torch.float32)).to(dtype)


def kept(t: torch.Tensor, name: str, make):
    """`make()`, made once and kept on tensor `t` (attribute `_llgraph_<name>`): what a step derives from its feeds
    is derived by the first layer that needs it and read by the others, and lives as long as the step's tensors."""
    attr = f"_llgraph_{name}"
    value = getattr(t, attr, None)
    if value is None:
        value = make()
        setattr(t, attr, value)
    return value


def cache_span(positions: torch.Tensor) -> int:
    """The cache slots a step's attention reads: max(positions) + 1. Read off the device once per step, not once per
    layer (every layer gets the same positions tensor): on a GPU each read waits for the queued kernels."""
    return kept(positions, "span", lambda: int(positions.max()) + 1)


def step_masks(positions: torch.Tensor) -> dict:
    """The step's masks by kind (window, ring), kept on its positions tensor: every layer of a kind attends under
    the same mask."""
    return kept(positions, "masks", dict)


def row_groups(slots: torch.Tensor, positions: torch.Tensor) -> list[tuple[int, torch.Tensor, int]]:
    """A ragged step's tokens by cache row: (row, the tokens' indices on the device, max position + 1), in order of
    first appearance. Read off the device once per step (one copy of slots and positions), kept on `slots` like
    cache_span's span, and not once per layer: on a GPU each read waits for the queued kernels."""
    def make() -> list[tuple[int, torch.Tensor, int]]:
        rows, pos = torch.stack((slots.reshape(-1), positions.reshape(-1))).cpu()
        groups = []
        for row in dict.fromkeys(rows.tolist()):
            mine = (rows == row).nonzero()[:, 0]
            groups.append((row, mine.to(slots.device), int(pos[mine].max()) + 1))
        return groups
    return kept(slots, "groups", make)
