"""Target `trt`: ONNX for TensorRT with llgraph plugins, that ONNX Runtime runs too.

RMSNorm, Rotary, GroupedAttention, SwiGLU and ExpertMatMul become plugin nodes (ExpertMatMul three a MoE layer, at every
step: `moe` below, no If): `op_type` is the plugin name, the attributes are exactly the plugin's fields
(plugins/tensorrt/spec.py, read from the op schemas) plus `plugin_namespace="llgraph"` and `plugin_version`. Each such
op type also has a model-local ONNX function (domain `llgraph`) whose body is its reference decomposition in standard
opset-24 ops, written against the node's attributes (`ref_attr_name`), never against one node's values. ONNX Runtime
runs the bodies; TensorRT's parser (10.15+) gives a node that carries `plugin_namespace` to the registered plugin first.
The remaining ops (Embedding, Linear, Split, RotaryCosSin, Add) are the `onnx` target's lowerings.

Ragged rows by slot id (passes.ragged_slots): every GroupedAttention takes the graph input `slot_ids`, each token's
cache row, so a step runs only the busy rows (runtime/backends/trt.py); its ONNX initializer is empty (an ONNX
Runtime caller that does not feed it gets row b) and a plugin build makes it an engine input (trt_build.parse). A
build on TensorRT's native layers (no plugins) gets the contiguous-rows body in its place. GroupedAttention's
present_key/present_value are the plugin's in-place cache update (aliased to past_key/value in TensorRT); a row's
positions in one call must be one contiguous range (the plugin kernel's and the native body's rule).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from onnx import AttributeProto, FunctionProto, TensorProto, helper

import llgraph.export.expert_schedule as expert_schedule
import llgraph.export.onnx as std
import llgraph.export.onnx_moe as onnx_moe
from llgraph.export.lower import Emitter, Target
from llgraph.ir import Node
from llgraph.passes import ragged_slots
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


def _with_sinks(f: _Body, q: str, keys: str, values: str, mask: str) -> tuple[str, str, str]:
    """gpt-oss's sinks (the `sinks` input, [num_heads]) as one more key: a zero key and value after every row's
    [N, KV, L, D], its score made the head's sink logit by an additive mask (masked slots -inf) -> (keys, values,
    float mask [N, H, S, L + 1]). export/onnx.py's with_sinks, in a function body."""
    row = f("Concat", f("Shape", keys, start=0, end=2), f.ints(1), f("Shape", keys, start=3, end=4), axis=0)
    zero_row = f("CastLike", f("ConstantOfShape", row), keys)
    keys, values = (f("Concat", t, zero_row, axis=2) for t in (keys, values))
    additive = f("Where", mask, f("CastLike", f("Constant", value_float=0.0), q),
                 f("CastLike", f("Constant", value_float=float("-inf")), q))
    sink = f("Reshape", f("CastLike", "sinks", q), f.ints(1, -1, 1, 1))
    additive = f("Add", additive, f("Mul", sink, f("CastLike", f("Constant", value_float=0.0), q)))  # [N, H, S, L]
    column = f("Expand", sink, f("Concat", f("Shape", additive, start=0, end=3), f.ints(1), axis=0))
    return keys, values, f("Concat", additive, column, axis=3)


def _rows_attention(f: _Body, sinks: bool = False) -> None:
    """Contiguous rows (token (b, s) in cache row b, no `slots`; what a native build runs, trt_build.parse): query
    (b, s) sees cache slots 0..positions[b, s], the last `window` of them with a window."""
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
    if sinks:
        keys, values, mask = _with_sinks(f, q, keys, values, mask)
    f.heads_last(f("Attention", q, keys, values, mask, refs={"scale": ("scale", FLOAT), "softcap": ("softcap", FLOAT)}),
                 "out")


def _grouped_attention(f: _Body, sinks: bool = False) -> None:
    """Ragged rows by slot id: token i = b * S + s in cache row slots[i] (an empty `slots`: row b). Every token's
    k, v scattered into its row at its position first (ScatterND), then each token attends alone, as a batch of one
    query, to its own row's slots 0..positions[b, s] (the last `window` of them), gathered from the updated cache.
    The reference for any order of rows and positions; it holds tokens x max(positions) keys at once (the plugin
    kernel reads the cache in place)."""
    shape = f("Shape", "q")
    batch_seq = f("Slice", shape, f.ints(0), f.ints(2))
    tokens = f("ReduceProd", batch_seq, keepdims=1)
    kv_heads = f("Unsqueeze", f.attr("num_kv_heads"), f.ints(0))
    batch = f("Squeeze", f("Slice", shape, f.ints(0), f.ints(1)))
    row_b = f("Reshape", f("Expand", f("Unsqueeze", f("Range", f.scalar(0), batch, f.scalar(1)), f.ints(1)),
                           batch_seq), f.ints(-1))
    rows = f("Slice", f("Concat", "slots", row_b, axis=0), f.ints(0), tokens)  # slots, or row b when empty
    positions = f("Reshape", "positions", f.ints(-1))
    per_head = f("Concat", tokens, kv_heads, f.ints(1), axis=0)  # [T, KV, 1]
    heads = f("Reshape", f("Range", f.scalar(0), f.attr("num_kv_heads"), f.scalar(1)), f.ints(1, -1, 1))
    index = f("Concat", *(f("Expand", t, per_head) for t in (f("Unsqueeze", rows, f.ints(1, 2)), heads,
                                                           f("Unsqueeze", positions, f.ints(1, 2)))), axis=2)
    for new, past, present in (("k", "past_key", "present_key"), ("v", "past_value", "present_value")):
        f("ScatterND", past, index, f("Reshape", new, f("Concat", tokens, kv_heads, f.ints(-1), axis=0)), out=present)
    length = f("Reshape", f("Add", f("ReduceMax", positions, keepdims=1), f.ints(1)), f.ints(1))
    slots = f("Range", f.scalar(0), f("Squeeze", length), f.scalar(1))
    limit = f("Reshape", positions, f.ints(-1, 1, 1, 1))  # [T, 1, 1, 1]
    window = f.attr("window")  # 0: no window, as if it were longer than any position
    window = f("Where", f("Equal", window, f.scalar(0)), f.scalar(1 << 62), window)
    mask = f("And", f("LessOrEqual", slots, limit), f("Greater", slots, f("Sub", limit, window)))
    keys, values = (f("Gather", f("Slice", c, f.ints(0), length, f.ints(2)), rows, axis=0)
                    for c in ("present_key", "present_value"))
    heads = f("Unsqueeze", f.attr("num_heads"), f.ints(0))
    q = f("Reshape", "q", f("Concat", f.ints(0, 0), heads, f.ints(-1), axis=0))  # [B, S, H, D]: D known to a parser
    q = f("Reshape", q, f("Concat", tokens, heads, f.ints(1), f("Shape", q, start=3), axis=0))  # [T, H, 1, D]
    if sinks:
        keys, values, mask = _with_sinks(f, q, keys, values, mask)
    y = f("Attention", q, keys, values, mask, refs={"scale": ("scale", FLOAT), "softcap": ("softcap", FLOAT)})
    f("Reshape", y, f("Concat", batch_seq, f.ints(-1), axis=0), out="out")


def _expert_matmul(f: _Body) -> None:
    """Each expert some pair chose (U of them, in expert order) against every token: the U matrices gathered
    ([U, in, out]; a decode step's k, not every expert), each token's row for that expert gathered ([U, tokens, in]),
    one batched MatMul, and each pair's result taken from its (expert, token) cell. For a prefill U is every expert
    and the work that of running every expert on every token, as the standard lowering's dense way, with a copy of
    the experts and of each token's row per expert beside it (not [pairs, in, out], as gathering a matrix per pair
    would). Reads chosen alone: the grouping (order, blocks) is the kernel's."""
    chosen, k = f("Reshape", "chosen", f.ints(-1)), f("Shape", "chosen", start=1)
    tokens, width, out = f("Shape", "chosen", start=0, end=1), f("Shape", "x", start=2), f("Shape", "weight", start=2)
    experts = f("Range", f.scalar(0), f("Squeeze", f("Shape", "weight", start=0, end=1)), f.scalar(1))  # [E]
    hits = f("Cast", f("Equal", f("Unsqueeze", chosen, f.ints(1)), experts), to=TensorProto.INT64)  # [P, E]
    used = f("Min", f("ReduceSum", hits, f.ints(0), keepdims=0), f.ints(1))  # [E]: 1 where some pair chose it
    pos = f("CumSum", used, f.scalar(0), exclusive=1)  # [E]: its index among the used
    count = f("Min", f("Shape", "weight", start=0, end=1), f("Mul", tokens, k))  # [1]: U = min(E, pairs)
    slots = f("Unsqueeze", f("Range", f.scalar(0), f("Squeeze", count), f.scalar(1)), f.ints(1))  # [U, 1]
    listed = f("Cast", f("And", f("Equal", slots, pos), f("Cast", used, to=TensorProto.BOOL)), to=TensorProto.INT64)
    listed = f("ReduceSum", f("Mul", listed, experts), f.ints(1), keepdims=0)  # [U]: the used experts (then 0s)
    w = f("Gather", "weight", listed, axis=0)  # [U, in, out]
    match = f("Cast", f("Equal", f("Unsqueeze", "chosen", f.ints(2)), listed), to=TensorProto.FLOAT)  # [T, k, U]
    slot = f("ArgMax", match, axis=1, keepdims=0)  # [T, U]: the token's slot that chose the expert (any if none)
    rows = f("Shape", "x", start=1, end=2)  # 1 (a row a token) or k (a row a pair)
    token = f("Unsqueeze", f("Range", f.scalar(0), f("Squeeze", tokens), f.scalar(1)), f.ints(1))  # [T, 1]
    row = f("Add", f("Mul", token, rows), f("Sub", slot, f("Mul", f("Div", slot, rows), rows)))  # t*rows + slot%rows
    x = f("Gather", f("Reshape", "x", f("Concat", f.ints(-1), width, axis=0)), f("Transpose", row, perm=[1, 0]),
          axis=0)  # [U, T, in]
    y = f("Reshape", f("MatMul", x, w), f("Concat", f.ints(-1), out, axis=0))  # [U * T, out]
    cell = f("Add", f("Mul", f("Gather", pos, "chosen", axis=0), tokens), token)  # [T, k]: u * T + t
    f("Gather", y, cell, axis=0, out="out")  # [T, k, out]


BODIES = {"RMSNorm": _rmsnorm, "SwiGLU": _swiglu, "Rotary": _rotary, "GroupedAttention": _grouped_attention,
          "ExpertMatMul": _expert_matmul}


def function(op: str, rows: bool = False, sinks: bool = False) -> FunctionProto:
    """The model-local function for plugin op `op`: inputs, outputs and attributes are the plugin's. `rows`:
    GroupedAttention's on contiguous rows, without the `slots` input (what trt_build.parse puts in its place for a
    build on TensorRT's native layers, whose attention and KV-cache update take no slot ids). `sinks`: its body
    reads the `sinks` input (a model's attention has them in every layer or in none; without, the input is an
    empty tensor the body ignores)."""
    body = _Body()
    inputs = list(spec.inputs(op))
    if rows and op == "GroupedAttention":
        _rows_attention(body, sinks)
        inputs.remove("slots")
    elif op == "GroupedAttention":
        _grouped_attention(body, sinks)
    else:
        BODIES[op](body)
    return helper.make_function(spec.NAMESPACE, op, inputs, list(spec.outputs(op)), body.nodes,
                                [helper.make_opsetid("", std.OPSET)], attributes=list(spec.fields(op)),
                                doc_string=f"reference decomposition of plugin {spec.plugin_id(op)}")


def plugin_node(em: Emitter, node: Node) -> None:
    if node.op == "GroupedAttention" and not node.attrs["causal"]:
        raise NotImplementedError("non-causal GroupedAttention has no plugin or ONNX lowering yet")
    inputs = [em.weight(name) if name in em.graph.params else name for name in node.inputs]
    if node.op == "ExpertMatMul" and len(inputs) == 3:  # the pairs grouped by expert, as its kernel takes them
        experts = em.graph.values[node.inputs[1]].shape[0]
        inputs += expert_schedule.schedule(em, inputs[2], experts, spec.EXPERT_ROWS, node.name)
    sinks = False
    if node.op == "GroupedAttention":
        std.slots_input(em, node)
        inputs = inputs if len(inputs) > 7 else [*inputs, std.no_sinks(em)]  # every plugin input, always
        sinks = inputs[7] != std.NO_SINKS
    plugin(em, node.op, inputs, node.outputs, node.attrs, node.name, sinks=sinks)


def plugin(em: Emitter, op: str, inputs: list, outputs, attrs: Mapping, hint: str, sinks: bool = False) -> list[str]:
    """A plugin node of `op` (its model-local function added once) -> its output names."""
    if op not in em.functions:
        em.functions[op] = function(op, sinks=sinks)
    return em.node(op, inputs, outputs, domain=spec.NAMESPACE, hint=hint, **spec.onnx_attrs(op, attrs))


def moe(em: Emitter, node: Node) -> None:
    """MoE and QMoE without an If: the router, the pairs grouped by expert once (export/expert_schedule.py), then
    each token's k experts through three ExpertMatMul plugin nodes (gate, up, down), whatever the token count. With
    llgraph's plugins each chosen expert's matrices are read once for all the rows that chose it; a native build
    (TensorRT-RTX, `--plugins none`) runs the plugin's function body, one batched MatMul over the experts some pair
    chose: a decode step reads its k experts, not every one, and a prefill runs every expert on every token."""
    experts, schedules = em.graph.values[node.arg(2)].shape[0], {}

    def product(em: Emitter, x: str, weight: str, chosen: str, hint: str) -> str:
        if chosen not in schedules:  # once for the gate, up and down products
            schedules[chosen] = expert_schedule.schedule(em, chosen, experts, spec.EXPERT_ROWS, hint)
        return plugin(em, "ExpertMatMul", [x, weight, chosen, *schedules[chosen]], 1, {}, hint)[0]
    onnx_moe.gathered(em, node, product)


LOWERINGS = {**std.LOWERINGS, **{op: plugin_node for op in spec.PLUGIN_OPS}, "MoE": moe, "QMoE": moe}

TARGET = Target("trt", LOWERINGS, {"": std.OPSET, spec.NAMESPACE: 1}, passes=(ragged_slots,))
