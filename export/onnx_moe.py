"""The standard ONNX lowering of ops.py's MoE and QMoE (what the onnx and trt targets run, and the ort target's
float16 fallback): the router's softmax and TopK in float32, then each token's k experts gathered (few tokens) or
every expert on every token as batched MatMuls (many), the activation (gpt-oss's clamp and biases where the node
has them) and the weighted sum; the helpers the ort target's MoE lowerings (export/ort_moe.py) share: the node's
inputs, its tokens and logits, the shared expert, the experts' weights."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto

from llgraph.export.lower import Emitter
from llgraph.ir import Node
from llgraph.quant import dequantize_experts
from llgraph.weights import DTYPES


def _experts_t(w: np.ndarray) -> np.ndarray:
    """[experts, out, in] -> [experts, in, out]: each expert's matrix as MatMul takes it."""
    return np.ascontiguousarray(w.transpose(0, 2, 1))


def moe_inputs(node: Node) -> list:
    """x, router, gate, up, down, shared_gate, shared_up, shared_down, shared_router, router_bias, gate_bias, up_bias,
    down_bias (absent ones None)."""
    return (list(node.inputs) + [None] * 8)[:13]


def moe_tokens(em: Emitter, node: Node) -> tuple[str, str]:
    """(x as [tokens, hidden], the router's logits [tokens, experts] in float32, its bias added)."""
    x, router = node.inputs[:2]
    flat = em.node("Reshape", [x, em.const([-1, em.graph.values[x].shape[-1]], "int64")], hint=node.name)[0]
    logits = em.node("MatMul", [flat, em.weight(router, transpose=True)], hint=node.name)[0]
    router_bias = moe_inputs(node)[9]
    if router_bias is not None:
        logits = em.node("Add", [logits, em.weight(router_bias)], hint=node.name)[0]
    if em.dtype_of(x) != TensorProto.FLOAT:
        logits = em.node("Cast", [logits], hint=node.name, to=TensorProto.FLOAT)[0]
    return flat, logits


def moe_finish(em: Emitter, node: Node, flat: str, routed: str) -> None:
    """The routed experts' sum [tokens, hidden], plus Qwen2-MoE's shared expert (every token, times
    sigmoid(x @ shared_router^T)) where the node has one, in x's shape."""
    x, _, _, _, _, shared_gate, shared_up, shared_down, shared_router = moe_inputs(node)[:9]
    name = node.name
    if shared_gate is not None:
        def mm(a, w):
            return em.node("MatMul", [a, em.weight(w, transpose=True)], hint=name)[0]
        sg = mm(flat, shared_gate)
        act = em.node("Mul", [em.node("Mul", [sg, em.node("Sigmoid", [sg], hint=name)[0]], hint=name)[0],
                              mm(flat, shared_up)], hint=name)[0]
        gated = em.node("Mul", [em.node("Sigmoid", [mm(flat, shared_router)], hint=name)[0], mm(act, shared_down)],
                        hint=name)[0]
        routed = em.node("Add", [routed, gated], hint=name)[0]
    em.node("Reshape", [routed, em.node("Shape", [x], hint=name)[0]], node.outputs, hint=name)


def moe(em: Emitter, node: Node) -> None:
    """Standard ONNX: the router's softmax (float32) and TopK, then one of two ways, chosen per forward by an `If`
    on the token count N: where N * k <= experts (decode, small batches) each token's k experts are gathered and
    only they run — a token reads k experts' weights, as llama.cpp's mul_mat_id and ONNX Runtime's MoE op do —;
    else every expert runs on every token as batched MatMuls ([experts, tokens, ffn]), weighted by a dense [tokens,
    experts] matrix that is 0 but at the chosen (a prefill: every expert is read once, whatever N). Both exact (the
    ort target runs ONNX Runtime's MoE op instead: export/ort_moe.py; the trt target `gathered` below, without an
    If). TensorRT-RTX builds an onnx export's else-branch alone (export/trt_network.py's without_branches)."""
    name, dtype = node.name, em.dtype_of(node.inputs[0])
    flat, probs, top, chosen, weights = route(em, node)
    top_k, experts = node.attrs["top_k"], em.graph.values[node.arg(2)].shape[0]
    tokens = em.node("Shape", [flat], hint=name, start=0, end=1)[0]
    few = em.node("LessOrEqual", [em.node("Mul", [tokens, em.const([top_k], "int64")], hint=name)[0],
                                  em.const([experts], "int64")], hint=name)[0]
    few = em.node("Squeeze", [few, em.const([0], "int64")], hint=name)[0]  # If's condition: one element
    then = _branch(em, f"{name}/gathered", dtype, lambda: _gathered(em, node, flat, top, chosen, weights,
                                                                    expert_product))
    dense = _branch(em, f"{name}/dense", dtype, lambda: _dense(em, node, flat, probs, top, chosen, weights))
    routed = em.node("If", [few], hint=name, then_branch=then, else_branch=dense)[0]
    moe_finish(em, node, flat, routed)


def gathered(em: Emitter, node: Node, product: Callable) -> None:
    """The router, then each token's k experts through `product(em, x, weight, chosen, hint)` (an ExpertMatMul:
    the trt target's plugin node) for every token count, no If."""
    flat, _, top, chosen, weights = route(em, node)
    moe_finish(em, node, flat, _gathered(em, node, flat, top, chosen, weights, product))


def route(em: Emitter, node: Node) -> tuple[str, str, str, str, list[str]]:
    """(x as [tokens, hidden], the router's softmax over the experts, the chosen's weights [tokens, k] (renormalised
    where the node says), the chosen [tokens, k], the experts' gate, up and down as [E, in, out])."""
    name = node.name
    flat, logits = moe_tokens(em, node)
    probs = em.node("Softmax", [logits], hint=name, axis=-1)[0]
    top, chosen = em.node("TopK", [probs, em.const([node.attrs["top_k"]], "int64")], 2, hint=name, axis=-1,
                          largest=1, sorted=1)
    if node.attrs["normalize"]:
        top = em.node("Div", [top, em.node("ReduceSum", [top, em.const([-1], "int64")], hint=name,
                                            keepdims=1)[0]], hint=name)[0]
    return flat, probs, top, chosen, [expert_weights(em, node, i, _experts_t) for i in (2, 3, 4)]


def _branch(em: Emitter, name: str, dtype: int, build) -> onnx.GraphProto:
    """What `build()` emits, as an If branch: a graph of its nodes whose one output is the value build returns; it
    reads the enclosing graph's values and initializers by name (weights stay the model's, written once)."""
    outer, em.nodes = em.nodes, []
    try:
        out = build()
        nodes = em.nodes
    finally:
        em.nodes = outer
    return onnx.helper.make_graph(nodes, name.replace("/", "_"), [], [onnx.helper.make_tensor_value_info(out, dtype,
                                                                                                         None)])


def _gathered(em: Emitter, node: Node, flat: str, top: str, chosen: str, weights: list[str],
              product: Callable) -> str:
    """Each token's k experts run on it alone (ExpertMatMul, ops.py): [tokens, hidden]."""
    name, dtype = node.name, em.dtype_of(node.inputs[0])
    gate, up, down = weights
    gate_bias, up_bias, down_bias = moe_inputs(node)[10:]

    def biased(y, bias):  # + bias[chosen] : [N, k, out]
        if bias is None:
            return y
        return em.node("Add", [y, em.node("Gather", [em.weight(bias), chosen], hint=name, axis=0)[0]], hint=name)[0]
    row = em.node("Unsqueeze", [flat, em.const([1], "int64")], hint=name)[0]  # [N, 1, H]: one row for all k
    g = biased(product(em, row, gate, chosen, name), gate_bias)  # [N, k, F]
    u = biased(product(em, row, up, chosen, name), up_bias)
    y = biased(product(em, gated(em, node, g, u), down, chosen, name), down_bias)  # [N, k, H]
    w = top if dtype == TensorProto.FLOAT else em.node("Cast", [top], hint=name, to=dtype)[0]
    w = em.node("Unsqueeze", [w, em.const([2], "int64")], hint=name)[0]  # [N, k, 1]
    return em.node("ReduceSum", [em.node("Mul", [y, w], hint=name)[0], em.const([1], "int64")], hint=name,
                   keepdims=0)[0]


def expert_product(em: Emitter, x: str, weight: str, chosen: str, hint: str, out: str | None = None) -> str:
    """ExpertMatMul (ops.py) in standard ONNX: each pair's matrix gathered ([tokens, k, in, out]) and its row
    multiplied by it; x [tokens, 1 or k, in] -> [tokens, k, out]."""
    w = em.node("Gather", [weight, chosen], hint=hint, axis=0)[0]
    rows = em.node("Unsqueeze", [x, em.const([2], "int64")], hint=hint)[0]  # [N, 1 or k, 1, in]
    y = em.node("MatMul", [rows, w], hint=hint)[0]  # [N, k, 1, out]
    return em.node("Squeeze", [y, em.const([2], "int64")], [out] if out else 1, hint=hint)[0]


def expert_matmul(em: Emitter, node: Node) -> None:
    """The IR's ExpertMatMul node, in standard ONNX."""
    x, weight, chosen = (node.arg(i) for i in range(3))
    expert_product(em, x, em.weight(weight) if weight in em.graph.params else weight, chosen, node.name,
                   node.outputs[0])


def _dense(em: Emitter, node: Node, flat: str, probs: str, top: str, chosen: str, weights: list[str]) -> str:
    """Every expert on every token, weighted by the dense [tokens, experts] matrix of the chosen: [tokens, hidden]."""
    name, dtype = node.name, em.dtype_of(node.inputs[0])
    zeros = em.node("ConstantOfShape", [em.node("Shape", [probs], hint=name)[0]], hint=name)[0]  # float32 0s
    dense = em.node("ScatterElements", [zeros, chosen, top], hint=name, axis=1)[0]  # [N, E]: 0 but the chosen
    if dtype != TensorProto.FLOAT:
        dense = em.node("Cast", [dense], hint=name, to=dtype)[0]
    gate, up, down = weights
    gate_bias, up_bias, down_bias = moe_inputs(node)[10:]

    def biased(y, bias):  # + bias[e] on every token's row: [E, N, out] + [E, 1, out]
        if bias is None:
            return y
        return em.node("Add", [y, em.weight(bias, compute=_per_expert_row)], hint=name)[0]
    g = biased(em.node("MatMul", [flat, gate], hint=name)[0], gate_bias)  # [E, N, F]
    u = biased(em.node("MatMul", [flat, up], hint=name)[0], up_bias)
    y = biased(em.node("MatMul", [gated(em, node, g, u), down], hint=name)[0], down_bias)  # [E, N, H]
    w = em.node("Unsqueeze", [em.node("Transpose", [dense], hint=name, perm=[1, 0])[0],
                              em.const([2], "int64")], hint=name)[0]  # [E, N, 1]
    return em.node("ReduceSum", [em.node("Mul", [y, w], hint=name)[0], em.const([0], "int64")], hint=name,
                   keepdims=0)[0]


def _per_expert_row(b: np.ndarray) -> np.ndarray:
    """[experts, out] -> [experts, 1, out]: an expert's bias broadcast over its tokens."""
    return np.ascontiguousarray(b[:, None, :])


def gated(em: Emitter, node: Node, g: str, u: str) -> str:
    """MoE's activation (ops.py): g * sigmoid(alpha * g) * (u + beta), g clamped to <= limit and u to +-limit
    first where limit > 0 (gpt-oss); silu(g) * u at alpha 1, beta 0, limit 0."""
    a, name = node.attrs, node.name
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(em.dtype_of(node.inputs[0]))
    if a["limit"]:
        g = em.node("Min", [g, em.const(a["limit"], np_dtype)], hint=name)[0]
        u = em.node("Clip", [u, em.const(-a["limit"], np_dtype), em.const(a["limit"], np_dtype)], hint=name)[0]
    scaled = g if a["alpha"] == 1 else em.node("Mul", [g, em.const(a["alpha"], np_dtype)], hint=name)[0]
    if a["beta"]:
        u = em.node("Add", [u, em.const(a["beta"], np_dtype)], hint=name)[0]
    glu = em.node("Mul", [g, em.node("Sigmoid", [scaled], hint=name)[0]], hint=name)[0]
    return em.node("Mul", [glu, u], hint=name)[0]


def expert_weights(em: Emitter, node: Node, index: int, compute=None) -> str:
    """A MoE's float experts (input `index`: gate, up or down), or a QMoE's dequantized in x's float type as ggml
    defines its super-blocks, through `compute` ([experts, out, in] -> the layout a lowering reads; None: as they
    are)."""
    param = node.inputs[index]
    if node.op == "MoE":
        return em.weight(param, compute=compute)
    kind = node.attrs["down_format" if index == 4 else "format"]
    exponent = node.attrs["down_exponent" if index == 4 else "exponent"]
    dtype = DTYPES[em.graph.values[node.inputs[0]].dtype]

    def dequantized(codes):
        w = dequantize_experts(codes, kind, dtype, exponent)
        return w if compute is None else compute(w)
    return em.derived(f"{param}.dequantized{'.' + compute.__name__ if compute else ''}", dequantized, param)
