"""Target `trt`: ONNX for TensorRT with llgraph plugins, that ONNX Runtime runs too.

RMSNorm, Rotary, GroupedAttention and SwiGLU become plugin nodes: `op_type` is the plugin name, the attributes are
exactly the plugin's fields (plugins/tensorrt/spec.py, read from the op schemas) plus `plugin_namespace="llgraph"` and
`plugin_version`. Each such op type also has a model-local ONNX function (domain `llgraph`) whose body is its
reference decomposition in standard opset-24 ops, written against the node's attributes (`ref_attr_name`), never
against one node's values. ONNX Runtime runs the bodies; TensorRT's parser (10.15+) gives a node that carries
`plugin_namespace` to the registered plugin first. The remaining ops (Embedding, Linear, Split, RotaryCosSin, Add)
are the `onnx` target's lowerings.

GroupedAttention's present_key/present_value are the plugin's in-place cache update (aliased to past_key/value in
TensorRT); the body writes them with TensorScatter at each row's first position, so — as for the `onnx` target and
the plugin kernel — the positions of a row must be contiguous.
"""

from __future__ import annotations

import numpy as np
from onnx import AttributeProto, FunctionProto, TensorProto, helper

import llgraph.export.onnx as std
from llgraph.export.lower import Emitter, Target
from llgraph.ir import Node
from llgraph.plugins.tensorrt import spec

INT, FLOAT = AttributeProto.INT, AttributeProto.FLOAT


class _Body:
    """Builds one function body: nodes with fresh local names, constants, and references to the node's attributes."""

    def __init__(self):
        self.nodes, self._count = [], 0

    def __call__(self, op: str, *inputs: str, out: str | None = None, refs: dict | None = None, **attrs) -> str:
        self._count += 1
        output = out or f"{op.lower()}{self._count}"
        node = helper.make_node(op, list(inputs), [output], **attrs)
        for name, (ref, kind) in (refs or {}).items():
            node.attribute.append(helper.make_attribute_ref(name, kind, ref_attr_name=ref))
        self.nodes.append(node)
        return output

    def ints(self, *values: int) -> str:
        return self("Constant", value=helper.make_tensor("v", TensorProto.INT64, [len(values)], list(values)))

    def scalar(self, value: int) -> str:
        return self("Constant", value_int=value)

    def attr(self, name: str) -> str:
        """The node's int attribute `name` as an int64 scalar."""
        return self("Constant", refs={"value_int": (name, INT)})

    def heads_first(self, x: str, heads: str) -> str:
        """[B, S, H*D] -> [B, H, S, D] with H a scalar value."""
        shape = self("Concat", self.ints(0, 0), self("Unsqueeze", heads, self.ints(0)), self.ints(-1), axis=0)
        return self("Transpose", self("Reshape", x, shape), perm=[0, 2, 1, 3])

    def heads_last(self, y: str, out: str) -> str:
        """[B, H, S, D] -> [B, S, H*D]"""
        return self("Reshape", self("Transpose", y, perm=[0, 2, 1, 3]), self.ints(0, 0, -1), out=out)


def _rmsnorm(f: _Body) -> None:
    """Over groups of `group` features: [B, S, N] -> [B, S, N/group, group] -> normalize -> [B, S, N]."""
    shape = f("Concat", f.ints(0, 0, -1), f("Unsqueeze", f.attr("group"), f.ints(0)), axis=0)
    y = f("RMSNormalization", f("Reshape", "x", shape), "weight", axis=-1, stash_type=1,
          refs={"epsilon": ("eps", FLOAT)})
    f("Reshape", y, f("Shape", "x"), out="out")


def _swiglu(f: _Body) -> None:
    f("Mul", f("Mul", "gate", f("Sigmoid", "gate")), "up", out="out")


def _rotary(f: _Body) -> None:
    """Rotate the first 2 * cos.shape[-1] dims of each head (read from the shape: partial rotary needs no field)."""
    x = f.heads_first("x", f.attr("num_heads"))
    rot = f("Mul", f("Shape", "cos", start=-1), f.ints(2))
    rotated = f("RotaryEmbedding", f("Slice", x, f.ints(0), rot, f.ints(3)), f("CastLike", "cos", "x"),
                f("CastLike", "sin", "x"), refs={"interleaved": ("interleaved", INT)})
    rest = f("Slice", x, rot, f.ints(np.iinfo(np.int64).max), f.ints(3))
    f.heads_last(f("Concat", rotated, rest, axis=3), "out")


def _grouped_attention(f: _Body) -> None:
    """Causal: query (b, s) sees cache slots 0..positions[b, s], the last `window` of them with a window
    (non-causal nodes are refused at export)."""
    q = f.heads_first("q", f.attr("num_heads"))
    kv_heads = f.attr("num_kv_heads")
    first = f("Gather", "positions", f.scalar(0), axis=1)
    for new, past, present in (("k", "past_key", "present_key"), ("v", "past_value", "present_value")):
        f("TensorScatter", past, f.heads_first(new, kv_heads), first, out=present, axis=2)
    length = f("Reshape", f("Add", f("ReduceMax", "positions", keepdims=1), f.ints(1)), f.ints(1))
    slots = f("Range", f.scalar(0), f("Squeeze", length), f.scalar(1))
    limit = f("Unsqueeze", "positions", f.ints(1, 3))
    window = f.attr("window")  # 0: no window, as if it were longer than any position
    window = f("Where", f("Equal", window, f.scalar(0)), f.scalar(1 << 62), window)
    mask = f("And", f("LessOrEqual", slots, limit), f("Greater", slots, f("Sub", limit, window)))
    keys, values = (f("Slice", c, f.ints(0), length, f.ints(2)) for c in ("present_key", "present_value"))
    f.heads_last(f("Attention", q, keys, values, mask, refs={"scale": ("scale", FLOAT), "softcap": ("softcap", FLOAT)}),
                 "out")


BODIES = {"RMSNorm": _rmsnorm, "SwiGLU": _swiglu, "Rotary": _rotary, "GroupedAttention": _grouped_attention}


def function(op: str) -> FunctionProto:
    """The model-local function for plugin op `op`: inputs, outputs and attributes are the plugin's."""
    body = _Body()
    BODIES[op](body)
    return helper.make_function(spec.NAMESPACE, op, list(spec.inputs(op)), list(spec.outputs(op)), body.nodes,
                                [helper.make_opsetid("", std.OPSET)], attributes=list(spec.fields(op)),
                                doc_string=f"reference decomposition of plugin {spec.plugin_id(op)}")


def plugin_node(em: Emitter, node: Node) -> None:
    if node.op == "GroupedAttention" and not node.attrs["causal"]:
        raise NotImplementedError("non-causal GroupedAttention has no plugin or ONNX lowering yet")
    if node.op == "GroupedAttention":
        std.refuse_slots(node, "the TensorRT plugin")
    if node.op not in em.functions:
        em.functions[node.op] = function(node.op)
    inputs = [em.weight(name) if name in em.graph.params else name for name in node.inputs]
    em.node(node.op, inputs, node.outputs, domain=spec.NAMESPACE, hint=node.name,
            **spec.onnx_attrs(node.op, node.attrs))


LOWERINGS = {**std.LOWERINGS, **{op: plugin_node for op in spec.PLUGIN_OPS}}

TARGET = Target("trt", LOWERINGS, {"": std.OPSET, spec.NAMESPACE: 1})
