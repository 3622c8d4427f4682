"""The ort target's MoE: ONNX Runtime's own `com.microsoft::MoE` (its CPU kernel routes each token to its k experts
and reads only theirs), where the standard lowering (export/onnx.py's moe) computes every expert on every token.

ONNX Runtime's CPU MoE takes the router's logits (it applies the softmax), fc1 as each expert's gate and up rows
interleaved ([experts, 2 * ffn, hidden]: its `swiglu_fusion` 1) and fc2 as [experts, hidden, ffn]; its SwiGLU is
gate * sigmoid(alpha * gate) * (up + beta), plain SwiGLU at alpha 1, beta 0 and no clamp. It computes in float32:
a float16 export keeps the standard lowering."""

from __future__ import annotations

import numpy as np

import llgraph.export.onnx as std
from llgraph.export.lower import Emitter
from llgraph.ir import Node

MS = "com.microsoft"


def _gate_up_interleaved(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[experts, ffn, hidden] twice -> [experts, 2 * ffn, hidden]: rows gate 0, up 0, gate 1, up 1, ..."""
    e, f, h = gate.shape
    return np.ascontiguousarray(np.stack([gate, up], axis=2).reshape(e, 2 * f, h))


def moe(em: Emitter, node: Node) -> None:
    x, _, gate, up, down = std.moe_inputs(node)[:5]
    if em.graph.values[x].dtype != "float32":
        return std.moe(em, node)
    flat, logits = std.moe_tokens(em, node)
    fc1 = em.derived(f"{gate}.gate_up_interleaved", _gate_up_interleaved, gate, up)
    routed = em.node("MoE", [flat, logits, fc1, "", em.weight(down), ""], domain=MS, hint=node.name,
                     k=node.attrs["top_k"], activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0,
                     activation_beta=0.0, swiglu_limit=float(np.finfo(np.float32).max),
                     normalize_routing_weights=int(node.attrs["normalize"]))[0]
    std.moe_finish(em, node, flat, routed)
