"""The PyTorch executor: the numeric reference. Runs an IR graph node by node with plain torch ops, on CPU or CUDA,
in the graph's dtype, and records any intermediate value by name on request.

The KV cache follows the static-cache contract: the tensors fed as `past_key_values.*` are written in place at the
given positions and returned as `present.*` (the same storage; no copy of the cache per step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from llgraph.attention_torch import attend, cache_span, kept, row_groups, step_masks, to_cache
from llgraph.dequant_torch import dequantize, dequantize_superblocks
from llgraph.ir import Graph, Node
from llgraph.weights import DTYPES, WeightSource, iter_params

TORCH_DTYPES = {name: getattr(torch, name) for name in (*DTYPES, "int8")}  # int8: a KV cache format
TORCH_IMPLS: dict[str, Callable[..., tuple[torch.Tensor, ...]]] = {}


def torch_impl(op: str):
    def register(fn):
        TORCH_IMPLS[op] = fn
        return fn
    return register


class TorchExecutor:
    def __init__(self, graph: Graph, source: WeightSource, device: str | torch.device = "cpu",
                 progress: bool = False):
        missing = sorted({n.op for n in graph.nodes} - set(TORCH_IMPLS))
        if missing:
            raise NotImplementedError(f"the torch executor has no implementation for {missing}")
        self.graph, self.device = graph, torch.device(device)
        self.params = {name: as_torch(a).to(self.device) for name, a in iter_params(graph, source, progress)}
        self._last_use = {}
        for i, node in enumerate(graph.nodes):
            for name in node.inputs:
                self._last_use[name] = i
        self._outputs = [v.name for v in graph.outputs]

    @torch.inference_mode()
    def run(self, feeds: Mapping[str, torch.Tensor], record: Iterable[str] | bool = ()) -> dict[str, torch.Tensor]:
        """Graph outputs (and the values named in `record`, or every value if record is True) by name. Feeds on
        another device (ids and positions made on the CPU) are moved to the executor's; the caches, already there,
        stay the very storage the step writes in place."""
        missing = [v.name for v in self.graph.inputs if v.name not in feeds]
        if missing:
            raise ValueError(f"missing graph inputs {missing}")
        keep = set(self._outputs) | (set(self.graph.values) if record is True else set(record or ()))
        env: dict[str, torch.Tensor] = dict(self.params)
        env.update({name: as_torch(t).to(self.device) for name, t in feeds.items()})
        for i, node in enumerate(self.graph.nodes):
            outs = TORCH_IMPLS[node.op](node, *(env[n] if n is not None else None for n in node.inputs))
            env.update(zip(node.outputs, outs))
            for name in node.inputs:  # free what no later node reads (and nobody asked for)
                if name is not None and self._last_use.get(name) == i and name not in keep and name not in self.params:
                    env.pop(name, None)
        return {name: env[name] for name in keep if name in env}


def as_torch(a) -> torch.Tensor:
    """A numpy array (the weights' and the runtime's tensor library; ml_dtypes' bfloat16 included) as a CPU tensor
    sharing its memory where it can; a tensor as it is."""
    if isinstance(a, torch.Tensor):
        return a
    a = np.asarray(a)
    if a.dtype == DTYPES["bfloat16"]:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def ids_tensor(a, device="cpu") -> torch.Tensor:
    """[B, S] token ids or positions (a numpy array, any strides: the loop passes broadcast views) as a fresh
    row-major int64 tensor on `device`. Row-major by request: numpy's default copy (order "K") and torch.tensor both
    keep a transposed or broadcast source's column-major strides, which a bound TensorRT address would misread."""
    return torch.from_numpy(np.array(a, np.int64, order="C")).to(device)


# -- one implementation per op (schemas in llgraph/ops.py) -------------------------------------------------------

@torch_impl("Embedding")
def _embedding(node: Node, ids, table):
    out = F.embedding(ids, table)
    scale = node.attrs["scale"]
    return (out if scale == 1.0 else out * torch.tensor(scale, dtype=out.dtype),)


@torch_impl("RMSNorm")
def _rmsnorm(node: Node, x, weight):
    xf = x.to(torch.promote_types(x.dtype, torch.float32)).unflatten(-1, (-1, node.attrs["group"]))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + node.attrs["eps"])
    return ((weight * xf.to(x.dtype)).flatten(-2),)


@torch_impl("Linear")
def _linear(node: Node, x, weight, bias=None):
    return (F.linear(x, weight, bias),)


def _weight(node: Node, codes, scales, mins, dtype=None) -> torch.Tensor:
    """A QLinear's or QEmbedding's float weight, by its format."""
    a = node.attrs
    if a["format"] != "blocks":
        return dequantize_superblocks(codes, a["format"], dtype or torch.float32, a["exponent"])
    return dequantize(codes, scales, mins, a["bits"], a["zero_point"], dtype)


@torch_impl("QLinear")
def _qlinear(node: Node, x, codes, scales=None, mins=None, bias=None):
    """The reference: dequantize the blocks (in float32) and run the float Linear."""
    return (F.linear(x, _weight(node, codes, scales, mins, x.dtype), bias),)


@torch_impl("QEmbedding")
def _qembedding(node: Node, ids, codes, scales=None, mins=None):
    """The rows asked for, dequantized as QLinear's reference does (== the whole table dequantized, then gathered)."""
    a, flat = node.attrs, ids.reshape(-1)
    rows = _weight(node, codes[flat], None if scales is None else scales[flat], None if mins is None else mins[flat])
    out = rows.reshape(*ids.shape, rows.shape[-1])
    return (out if a["scale"] == 1.0 else out * torch.tensor(a["scale"], dtype=out.dtype),)


@torch_impl("Split")
def _split(node: Node, x):
    return tuple(torch.split(x, list(node.attrs["sizes"]), dim=-1))


@torch_impl("KeepLast")
def _keep_last(node: Node, x, keep):
    k = int(keep)
    return (x[:, -k:] if 0 < k < x.shape[1] else x,)


@torch_impl("RotaryCosSin")
def _rotary_cos_sin(node: Node, positions, inv_freq):
    # positions: [B, S], inv_freq: [R/2] -> cos, sin: [B, S, R/2] float32
    a = node.attrs
    if a["dynamic_factor"] > 0:
        length = int(positions.max()) + 1
        orig = a["original_max_position"]
        if length > orig:  # dynamic NTK: base * r^(d/(d-2)) == inv_freq * r^(-2i/(d-2))
            r = a["dynamic_factor"] * length / orig - (a["dynamic_factor"] - 1)
            d = 2 * inv_freq.shape[0]
            two_i = torch.arange(0, d, 2, dtype=torch.float64, device=inv_freq.device)
            inv_freq = (inv_freq.double() * r ** (-two_i / (d - 2))).float()
    angles = positions.float()[..., None] * inv_freq
    return angles.cos() * a["scaling"], angles.sin() * a["scaling"]


@torch_impl("Rotary")
def _rotary(node: Node, x, cos, sin):
    # x: [B, S, N*D]; cos, sin: [B, S, R/2]; rotates the first R dims of each head
    b, s, nd = x.shape
    n = node.attrs["num_heads"]
    xh = x.view(b, s, n, nd // n)
    half = cos.shape[-1]
    c, si = _as(cos, x.dtype)[:, :, None, :], _as(sin, x.dtype)[:, :, None, :]
    if node.attrs["interleaved"]:
        x1, x2 = xh[..., 0:2 * half:2], xh[..., 1:2 * half:2]
        rot = torch.stack((x1 * c - x2 * si, x2 * c + x1 * si), dim=-1).flatten(-2)
    else:
        x1, x2 = xh[..., :half], xh[..., half:2 * half]
        rot = torch.cat((x1 * c - x2 * si, x2 * c + x1 * si), dim=-1)
    return (torch.cat((rot, xh[..., 2 * half:]), dim=-1).view(b, s, nd),)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`, converted once and kept on `t`: a step's RoPE table is made once and read by every layer's q
    and k (on a GPU each conversion is a kernel launch, and an eager decode step is bound by them)."""
    return t if t.dtype == dtype else kept(t, f"as_{dtype}".replace(".", "_"), lambda: t.to(dtype))


GATHERED_TOKENS = 64  # a ragged step of at most this many tokens gathers each token's keys: no loop, no device read


@torch_impl("GroupedAttention")
def _grouped_attention(node: Node, q, k, v, positions, past_key, past_value, slots=None, sinks=None):
    # q: [B, S, Hq*D]; k, v: [B, S, Hkv*D]; positions: [B, S]; caches: [rows, Hkv, M, D], written in place; slots:
    # [B*S] each token's cache row (absent or empty: row b); sinks: [Hq] a logit per head in the denominator
    a = dict(node.attrs, sinks=sinks)
    b, s, _ = q.shape
    hkv, d = a["num_kv_heads"], q.shape[-1] // a["num_heads"]
    ragged = slots is not None and slots.numel() > 0
    rows = slots.view(b, s) if ragged else torch.arange(b, device=q.device)[:, None]
    span, masks = cache_span(positions), step_masks(positions)
    at = positions if span <= past_key.shape[2] else positions % past_key.shape[2]  # a ring
    for cache, x in ((past_key, k), (past_value, v)):  # cache[row, :, slot of positions[b, s]] = x[b, s], its format
        cache.transpose(1, 2)[rows, at] = to_cache(x.view(b, s, hkv, d), cache.dtype)
    if not ragged:
        return attend(a, q, positions, past_key[:b], past_value[:b], span, masks), past_key, past_value
    flat_rows = rows.reshape(-1)
    if a["causal"] and b * s <= GATHERED_TOKENS:  # a decode step's few tokens: each a batch row, its row's keys
        keys, values = (c[flat_rows, :, :span] for c in (past_key, past_value))  # (a ring: all its slots)
        out = attend(a, q.reshape(b * s, 1, -1), positions.reshape(-1, 1), keys, values, span, masks, "tokens")
        return out.view(b, s, -1), past_key, past_value
    out = torch.empty_like(q)
    flat_q, flat_pos = q.reshape(b * s, -1), positions.reshape(-1)
    for row, mine, row_span in row_groups(slots, positions):  # a prompt's many tokens: each cache row's as a batch row
        out.view(b * s, -1)[mine] = attend(a, flat_q[mine][None], flat_pos[mine][None], past_key[row:row + 1],
                                           past_value[row:row + 1], row_span, masks, row)[0]
    return out, past_key, past_value


@torch_impl("SwiGLU")
def _swiglu(node: Node, gate, up):
    return (F.silu(gate) * up,)


@torch_impl("MoE")
def _moe(node: Node, x, router, gate, up, down, *rest):
    """Each token through its top_k experts only (ops.py's MoE): tokens grouped by expert, as ggml's mul_mat_id."""
    return (_routed(node, x, router, lambda e: (gate[e], up[e], down[e]), *rest),)


@torch_impl("QMoE")
def _qmoe(node: Node, x, router, gate, up, down, *rest):
    """MoE's reference with each chosen expert's super-blocks dequantized (in float32) as it is needed."""
    a = node.attrs

    def expert(e):
        return tuple(dequantize_superblocks(c[e], kind, x.dtype, exponent) for c, kind, exponent in (
            (gate, a["format"], a["exponent"]), (up, a["format"], a["exponent"]),
            (down, a["down_format"], a["down_exponent"])))
    return (_routed(node, x, router, expert, *rest),)


@torch_impl("ExpertMatMul")
def _expert_matmul(node: Node, x, weight, chosen, order=None, blocks=None):
    """Every (token, slot) pair's row times its expert's matrix, one batched product over the gathered matrices
    (order and blocks only say how a kernel groups the pairs: the result is chosen's)."""
    tokens, k = chosen.shape
    rows = x.expand(tokens, k, x.shape[-1]).reshape(tokens * k, 1, -1)
    return (torch.bmm(rows, weight[chosen.reshape(-1)]).reshape(tokens, k, -1),)


def _routed(node: Node, x, router, expert, shared_gate=None, shared_up=None, shared_down=None, shared_router=None,
            router_bias=None, gate_bias=None, up_bias=None, down_bias=None):
    """The routed experts' weighted sum, expert(e) giving expert e's (gate, up, down), plus a shared expert; the
    biases where given (gpt-oss)."""
    a = node.attrs
    flat = x.reshape(-1, x.shape[-1])  # [N, H]
    logits = flat @ router.T
    probs = torch.softmax((logits if router_bias is None else logits + router_bias).float(), dim=-1)  # [N, E]
    weights, chosen = torch.topk(probs, node.attrs["top_k"], dim=-1)  # [N, k]: ties to the lower expert
    if node.attrs["normalize"]:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    for e in torch.unique(chosen).tolist():
        token, slot = torch.nonzero(chosen == e, as_tuple=True)
        rows, (gate, up, down) = flat[token], expert(e)
        g, u = rows @ gate.T, rows @ up.T
        g = g if gate_bias is None else g + gate_bias[e]
        u = u if up_bias is None else u + up_bias[e]
        if a["limit"]:  # gpt-oss's clamp
            g, u = g.clamp(max=a["limit"]), u.clamp(-a["limit"], a["limit"])
        y = (g * torch.sigmoid(a["alpha"] * g) * (u + a["beta"])) @ down.T
        if down_bias is not None:
            y = y + down_bias[e]
        out.index_add_(0, token, (y * weights[token, slot, None].to(y.dtype)).to(out.dtype))
    if shared_gate is not None:  # Qwen2-MoE's shared expert, every token, weighted by its own sigmoid gate
        shared = (F.silu(flat @ shared_gate.T) * (flat @ shared_up.T)) @ shared_down.T
        out = out + torch.sigmoid(flat @ shared_router.T) * shared
    return out.reshape(x.shape)


@torch_impl("GeGLU")
def _geglu(node: Node, gate, up):
    return (F.gelu(gate, approximate="tanh") * up,)


@torch_impl("SoftCap")
def _softcap(node: Node, x):
    return (node.attrs["cap"] * torch.tanh(x / node.attrs["cap"]),)


@torch_impl("Add")
def _add(node: Node, a, b):
    return (a + b,)
