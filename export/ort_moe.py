"""The ort target's MoE: ONNX Runtime's own `com.microsoft::MoE` (its CPU kernel routes each token to its k experts
and reads only theirs), where the standard lowering (export/onnx_moe.py) computes every expert on every token; a
QMoE (experts in GGUF super-blocks) on llgraph's own kernels (--kernels llgraph: plugins/cpu/moe.inc) at the file's
bits, else on ONNX Runtime's op with its experts dequantized.

ONNX Runtime's CPU MoE takes the router's logits (it applies the softmax), fc1 as each expert's gate and up rows
interleaved ([experts, 2 * ffn, hidden]: its `swiglu_fusion` 1) and fc2 as [experts, hidden, ffn]; its SwiGLU is
gate * sigmoid(alpha * gate) * (up + beta), gate clamped to <= swiglu_limit and up to +-swiglu_limit first: MoE's
alpha, beta and limit (gpt-oss's 1.702, 1, 7; plain SwiGLU at 1, 0 and no clamp), with fc1's and fc2's biases. It
computes in float32: a float16 export keeps the standard lowering."""

from __future__ import annotations

import numpy as np

import llgraph.export.onnx_moe as std
from llgraph.export.cpu_layout import glu_groups, interleaver
from llgraph.export.lower import Emitter
from llgraph.ir import Node
from llgraph.plugins import cpu
from llgraph.quant import dequantize_experts
from llgraph.weight_request import accuracy_level_of

MS = "com.microsoft"


def _gate_up_interleaved(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[experts, ffn, hidden] twice -> [experts, 2 * ffn, hidden]: rows gate 0, up 0, gate 1, up 1, ..."""
    e, f, h = gate.shape
    return np.ascontiguousarray(np.stack([gate, up], axis=2).reshape(e, 2 * f, h))


def moe(em: Emitter, node: Node) -> None:
    x = node.inputs[0]
    if em.graph.values[x].dtype != "float32":
        return std.moe(em, node)
    flat, logits = std.moe_tokens(em, node)
    gate, up = node.inputs[2:4]
    fc1 = em.derived(f"{gate}.gate_up_interleaved", _gate_up_interleaved, gate, up) if node.op == "MoE" else \
        em.derived(f"{gate}.gate_up_interleaved", lambda g, u: _gate_up_interleaved(
            *(dequantize_experts(c, node.attrs["format"], exponent=node.attrs["exponent"]) for c in (g, u))), gate, up)
    down = std.expert_weights(em, node, 4)
    gate_bias, up_bias, down_bias = std.moe_inputs(node)[10:]
    fc1_bias = "" if gate_bias is None else em.derived(
        f"{gate_bias}.gate_up_interleaved", lambda g, u: np.ascontiguousarray(np.stack([g, u], axis=2).reshape(
            g.shape[0], -1)), gate_bias, up_bias)
    a = node.attrs
    routed = em.node("MoE", [flat, logits, fc1, fc1_bias, down, em.weight(down_bias) if down_bias else ""], domain=MS,
                     hint=node.name, k=a["top_k"], activation_type="swiglu", swiglu_fusion=1,
                     activation_alpha=float(a["alpha"]), activation_beta=float(a["beta"]),
                     swiglu_limit=float(a["limit"] or np.finfo(np.float32).max),
                     normalize_routing_weights=int(a["normalize"]))[0]
    std.moe_finish(em, node, flat, routed)


def qmoe(em: Emitter, node: Node) -> None:
    """llgraph::MoE on the experts as stored (plugins/cpu/moe.inc): gate and up in QLinear's swiglu layout, down
    interleaved, each expert's bytes side by side; the router's logits from a MatMul before it (its bias added);
    gpt-oss's expert biases and clamped activation as the kernel's optional inputs and attributes."""
    if em.options.get("kernels") != "llgraph" or em.graph.values[node.inputs[0]].dtype != "float32":
        return moe(em, node)
    a = node.attrs
    flat, logits = std.moe_tokens(em, node)
    gate, up, down = node.inputs[2:5]
    glu = glu_groups(interleaver(a["format"]))

    def gate_up(g: np.ndarray, u: np.ndarray) -> np.ndarray:
        return np.stack([glu(np.concatenate([g[e], u[e]])) for e in range(g.shape[0])])
    rows_of = interleaver(a["down_format"])

    def per_expert(d: np.ndarray) -> np.ndarray:
        return np.stack([rows_of(d[e]) for e in range(d.shape[0])])
    per_expert.__name__ = f"experts_{rows_of.__name__}"
    biases = [em.weight(b) if b else "" for b in std.moe_inputs(node)[10:]]  # gpt-oss's gate, up, down
    routed = em.node("MoE", [flat, logits, em.derived(f"{gate}.experts_{glu.__name__}", gate_up, gate, up),
                             em.weight(down, compute=per_expert), *(biases if any(biases) else [])],
                     domain=cpu.DOMAIN, hint=node.name,
                     k=a["top_k"], normalize=int(a["normalize"]), format=a["format"], down_format=a["down_format"],
                     exponent=a["exponent"], down_exponent=a["down_exponent"], rows=em.graph.values[gate].shape[1],
                     alpha=float(a["alpha"]), beta=float(a["beta"]),
                     limit=float(a["limit"]), accuracy_level=accuracy_level_of(em.options.get("accuracy_level"),
                                                                                True))[0]
    std.moe_finish(em, node, flat, routed)
