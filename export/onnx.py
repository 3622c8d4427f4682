"""Target `onnx`: standard ONNX ops only (opset 24), so any compliant runtime can run the model.

RMSNormalization, RotaryEmbedding and Attention (opset 23); the static KV cache is updated with TensorScatter
(opset 24), which writes each row's new keys at its first position, so positions within a row must be contiguous
(the runtime's prefill and decode feed them so).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from llgraph.export.lower import RING, Emitter, Target
from llgraph.export.onnx_moe import expert_matmul, moe
from llgraph.ir import Node

OPSET = 24


def linear(em: Emitter, node: Node) -> None:
    """x @ W^T as MatMul with W stored transposed ([in, out]), the layout runtimes prepack for GEMV."""
    x, w, b = (list(node.inputs) + [None])[:3]
    out = node.outputs[0]
    matmul_out = em.fresh(f"{out}/matmul") if b else out
    em.node("MatMul", [x, em.weight(w, transpose=True)], [matmul_out], hint=out)
    if b:
        em.node("Add", [matmul_out, em.weight(b)], [out], hint=out)


def qlinear_inputs(node: Node):
    """x, codes, scales, mins, bias (absent ones None) and the format attributes of a QLinear."""
    x, codes, scales, mins, bias = (list(node.inputs) + [None] * 5)[:5]
    return x, codes, scales, mins, bias, node.attrs["bits"], node.attrs["block_size"], node.attrs["zero_point"]


def offset_term(em: Emitter, node: Node, shift: int) -> str:
    """What a QLinear's blocks hold beyond scale * (q - shift): offset[o, b] = mins[o, b] + scales[o, b] * (shift -
    zero_point), as (block sums of x) @ offset^T, the term of x @ W^T a per-block offset of W contributes."""
    x, codes, scales, mins, _, _, block, zp = qlinear_inputs(node)
    _, blocks, _ = em.graph.values[codes].shape

    def offset(s, *m):
        f32 = np.float32
        return ((m[0].astype(f32) if m else f32(0)) + s.astype(f32) * f32(shift - zp)).astype(s.dtype).T
    table = em.derived(f"{scales}.offset{shift}.T", offset, scales, *([mins] if mins else []))
    grouped = em.node("Reshape", [x, em.const([0, 0, blocks, block], "int64")], hint=node.name)[0]
    sums = em.node("ReduceSum", [grouped, em.const([-1], "int64")], hint=node.name, keepdims=0)[0]
    return em.node("MatMul", [sums, table], hint=node.name)[0]


def qlinear(em: Emitter, node: Node) -> None:
    """Standard ONNX: DequantizeLinear with block_size (opset 21+) on signed codes (q - shift, zero point 0:
    TensorRT's weight-only int4/int8 pattern) -> Transpose -> MatMul. The shift is the format's own zero point
    when q - zero_point fits the signed type (Q4_0, Q8_0, GGUF's 5- and 6-bit K-quant codes), else 2^(bits-1).
    What the shift and the mins move out of the blocks, offset[o, b] = mins[o, b] + scales[o, b] * (shift -
    zero_point), comes back exactly as (block sums of x) @ offset^T."""
    x, codes, scales, mins, bias, bits, block, zp = qlinear_inputs(node)
    out, blocks, _ = em.graph.values[codes].shape
    half = 1 << (bits - 1)
    fits = bits == 8 and zp <= half and (1 << node.attrs.get("code_bits", bits)) - 1 - zp < half
    shift = zp if fits else half
    signed = em.derived(f"{codes}.signed", lambda c: _signed_codes(c, bits, shift), codes,
                        onnx_type=TensorProto.INT4 if bits == 4 else TensorProto.INT8, dims=(out, blocks * block))
    w = em.node("DequantizeLinear", [signed, em.weight(scales)], hint=node.name, axis=1, block_size=block)[0]
    y = em.node("MatMul", [x, em.node("Transpose", [w], hint=node.name, perm=[1, 0])[0]], hint=node.name)[0]
    if mins is not None or zp != shift:
        y = em.node("Add", [y, offset_term(em, node, shift)], hint=node.name)[0]
    em.node("Identity" if bias is None else "Add", [y] + ([em.weight(bias)] if bias else []), node.outputs,
            hint=node.name)


def _signed_codes(c: np.ndarray, bits: int, shift: int) -> np.ndarray:
    """Packed unsigned codes -> the bytes of q - shift as two's-complement int4 (shift 8) or int8."""
    if bits == 4:
        return c ^ 0x88
    return ((c.astype(np.int16) - shift) & 0xFF).astype(np.uint8)


def embedding(em: Emitter, node: Node) -> None:
    """A table tied to the lm head is stored once, transposed for its MatMul; the Gather reads it through a
    Transpose of a constant, which runtimes fold at load time."""
    ids, table = node.inputs
    tied = any(n.op == "Linear" and n.inputs[1] == table for n in em.graph.nodes)
    data = em.node("Transpose", [em.weight(table, transpose=True)], hint=node.name)[0] if tied else em.weight(table)
    scaled_rows(em, node, em.node("Gather", [data, ids], hint=node.name, axis=0)[0])


def qembedding(em: Emitter, node: Node) -> None:
    """Standard ONNX has no blocked gather: the table is dequantized at export (exactly, as the executor does) and
    gathered in float."""
    ids = node.inputs[0]
    scaled_rows(em, node, em.node("Gather", [dequantized(em, node), ids], hint=node.name, axis=0)[0])


def dequantized(em: Emitter, node: Node) -> str:
    """A QLinear's or QEmbedding's blocks [out, in] dequantized at export, exactly as the executor does."""
    codes, scales, mins = (list(node.inputs) + [None] * 4)[1:4]

    def table(c, s, *m):
        from llgraph.quant import dequantize

        return dequantize(c, s, m[0] if m else None, node.attrs["bits"], node.attrs["zero_point"])
    return em.derived(f"{codes}.dequantized", table, codes, scales, *([mins] if mins else []))


def scaled_rows(em: Emitter, node: Node, rows: str) -> None:
    """An embedding's output: its gathered rows times the node's `scale` (Gemma's sqrt(hidden)), in their dtype; a
    QEmbedding's rows as its super-blocks say times 2^exponent too (exact: a power of two)."""
    scale = node.attrs["scale"] * 2.0 ** node.attrs.get("exponent", 0)
    if scale == 1.0:
        em.node("Identity", [rows], node.outputs, hint=node.name)
        return
    dtype = em.graph.values[node.outputs[0]].dtype
    em.node("Mul", [rows, em.const(scale, "float16" if dtype == "float16" else "float32")], node.outputs,
            hint=node.name)


def rmsnorm(em: Emitter, node: Node) -> None:
    x, w = node.inputs
    group = node.attrs["group"]
    if group == em.graph.values[x].shape[-1]:
        em.node("RMSNormalization", [x, em.weight(w)], node.outputs, hint=node.name, axis=-1,
                epsilon=float(node.attrs["eps"]), stash_type=1)
        return
    grouped = em.node("Reshape", [x, em.const([0, 0, -1, group], "int64")], hint=node.name)[0]
    y = em.node("RMSNormalization", [grouped, em.weight(w)], hint=node.name, axis=-1,
                epsilon=float(node.attrs["eps"]), stash_type=1)[0]
    em.node("Reshape", [y, em.const([0, 0, -1], "int64")], node.outputs, hint=node.name)


def split(em: Emitter, node: Node) -> None:
    em.node("Split", [node.inputs[0], em.const(list(node.attrs["sizes"]), "int64")], node.outputs,
            hint=node.name, axis=-1)


def keep_last(em: Emitter, node: Node) -> None:
    """Slice(x, starts=-keep, axis 1): -0 starts at 0, so keep 0 (or more than seq) is every position. A graph input
    `keep` gets the initializer 0 of the same name: a caller that does not feed it (onnxruntime-genai) gets all."""
    x, keep = node.inputs
    if any(v.name == keep for v in em.graph.inputs) and keep not in em.shared:
        em.initializers.append(onnx.numpy_helper.from_array(np.array(0, np.int64), keep))
        em.shared[keep] = keep
    start = em.node("Neg", [em.node("Reshape", [keep, em.const([1], "int64")], hint=node.name)[0]], hint=node.name)[0]
    em.node("Slice", [x, start, em.const([2**63 - 1], "int64"), em.const([1], "int64")], node.outputs,
            hint=node.name)


def rotary_cos_sin(em: Emitter, node: Node) -> None:
    pos, inv = node.inputs
    a, hint = node.attrs, node.name
    inv_freq = em.weight(inv)
    if a["dynamic_factor"] > 0:  # inv_freq * r^(-2i/(d-2)), r = max(factor*L/orig - (factor-1), 1), L = max(pos)+1
        d = 2 * em.graph.values[inv].shape[0]
        length = em.node("Cast", [em.node("ReduceMax", [pos], hint=hint, keepdims=0)[0]], hint=hint,
                         to=TensorProto.FLOAT)[0]
        length = em.node("Add", [length, em.const(1.0, "float32")], hint=hint)[0]
        f, orig = float(a["dynamic_factor"]), float(a["original_max_position"])
        r = em.node("Sub", [em.node("Mul", [length, em.const(f / orig, "float32")], hint=hint)[0],
                            em.const(f - 1, "float32")], hint=hint)[0]
        r = em.node("Max", [r, em.const(1.0, "float32")], hint=hint)[0]
        exponent = em.const([-i / (d - 2) for i in range(0, d, 2)], "float32")
        inv_freq = em.node("Mul", [inv_freq, em.node("Pow", [r, exponent], hint=hint)[0]], hint=hint)[0]
    posf = em.node("Cast", [em.node("Unsqueeze", [pos, em.const([-1], "int64")], hint=hint)[0]], hint=hint,
                   to=TensorProto.FLOAT)[0]
    angles = em.node("Mul", [posf, inv_freq], hint=hint)[0]
    for fn, out in (("Cos", node.outputs[0]), ("Sin", node.outputs[1])):
        y = em.node(fn, [angles], hint=hint)[0]
        em.node("Mul", [y, em.const(float(a["scaling"]), "float32")], [out], hint=hint)


def rotary(em: Emitter, node: Node) -> None:
    x, cos, sin = node.inputs
    dtype = em.dtype_of(x)
    if dtype != TensorProto.FLOAT:
        cos, sin = (em.node("Cast", [t], hint=node.name, to=dtype)[0] for t in (cos, sin))
    em.node("RotaryEmbedding", [x, cos, sin], node.outputs, hint=node.name, num_heads=node.attrs["num_heads"],
            interleaved=int(node.attrs["interleaved"]),
            rotary_embedding_dim=2 * em.graph.values[node.inputs[1]].shape[-1])


def _heads_first(em: Emitter, x: str, heads: int, hint: str) -> str:
    """[B, S, H*D] -> [B, H, S, D]"""
    d = em.graph.values[x].shape[-1] // heads
    y = em.node("Reshape", [x, em.const([0, 0, heads, d], "int64")], hint=hint)[0]
    return em.node("Transpose", [y], hint=hint, perm=[0, 2, 1, 3])[0]


def attention_mask(em: Emitter, pos: str, hint: str) -> tuple[str, str]:
    """(length L = max(pos) + 1 as a 1-element int64 tensor, bool mask [B, 1, S, L]: slot j <= pos[b, s])."""
    length = em.node("Add", [em.node("ReduceMax", [pos], hint=hint, keepdims=1)[0],
                             em.const([1], "int64")], hint=hint)[0]
    length = em.node("Reshape", [length, em.const([1], "int64")], hint=hint)[0]
    slots = em.node("Range", [em.const(0, "int64"), em.node("Squeeze", [length], hint=hint)[0],
                              em.const(1, "int64")], hint=hint)[0]
    limit = em.node("Unsqueeze", [pos, em.const([1, 3], "int64")], hint=hint)[0]  # [B, 1, S, 1]
    return length, em.node("LessOrEqual", [slots, limit], hint=hint)[0]


def ring_mask(em: Emitter, pos: str, cache: str, hint: str, window: int) -> tuple[str, str]:
    """A windowed layer's (length L = min(max(pos) + 1, T) as a 1-element int64 tensor, bool mask [B, 1, S, L]) over
    a cache of T slots that may be a ring: slot j holds position p = q - ((q - j) mod T) for query q = pos[b, s] (j
    itself where T > q), visible where p >= 0 and p > q - window."""
    ring = em.node("Shape", [cache], hint=hint, start=2, end=3)[0]
    top = em.node("Add", [em.node("ReduceMax", [pos], hint=hint, keepdims=1)[0], em.const([1], "int64")],
                  hint=hint)[0]
    length = em.node("Min", [em.node("Reshape", [top, em.const([1], "int64")], hint=hint)[0], ring], hint=hint)[0]
    slots = em.node("Range", [em.const(0, "int64"), em.node("Squeeze", [length], hint=hint)[0],
                              em.const(1, "int64")], hint=hint)[0]
    query = em.node("Unsqueeze", [pos, em.const([1, 3], "int64")], hint=hint)[0]  # [B, 1, S, 1]
    back = em.node("Mod", [em.node("Sub", [query, slots], hint=hint)[0], ring], hint=hint, fmod=0)[0]  # >= 0
    held = em.node("Sub", [query, back], hint=hint)[0]
    mask = em.node("GreaterOrEqual", [held, em.const(0, "int64")], hint=hint)[0]
    oldest = em.node("Sub", [query, em.const(window, "int64")], hint=hint)[0]
    mask = em.node("And", [mask, em.node("Greater", [held, oldest], hint=hint)[0]], hint=hint)[0]
    return length, mask


def slots_input(em: Emitter, node: Node) -> str | None:
    """A GroupedAttention's `slots` (the graph input passes.ragged_slots adds), given an empty ONNX initializer once
    per graph, so that a caller that does not feed it (onnxruntime-genai, an ONNX Runtime session) gets row b; None
    where the node has none."""
    slots = node.inputs[6] if len(node.inputs) > 6 else None
    if slots is not None and slots not in em.shared:
        em.initializers.append(numpy_helper.from_array(np.zeros(0, np.int64), slots))
        em.shared[slots] = slots
    return slots


NO_SINKS = "attention.no_sinks"  # the empty `sinks` a plugin node of a model without them takes


def no_sinks(em: Emitter) -> str:
    """An empty float32 initializer, once per graph: the `sinks` of a plugin GroupedAttention (export/trt.py, whose
    plugin takes every schema input) in a model without them."""
    if NO_SINKS not in em.shared:
        em.initializers.append(numpy_helper.from_array(np.zeros(0, np.float32), NO_SINKS))
        em.shared[NO_SINKS] = NO_SINKS
    return NO_SINKS


def refuse_slots(node: Node, lowering: str) -> None:
    """A GroupedAttention with `slots` (passes.ragged_slots) only where the lowering reads them."""
    if len(node.inputs) > 6 and node.inputs[6] is not None:
        raise NotImplementedError(f"{node.name}: {lowering} has no ragged rows (GroupedAttention's slots); export "
                                  "without passes.ragged_slots, or with --kernels llgraph --dtype fp32")


def grouped_attention(em: Emitter, node: Node) -> None:
    refuse_slots(node, "ONNX's Attention")
    q, k, v, pos, past_k, past_v = (node.arg(i) for i in range(6))
    out, present_k, present_v = node.outputs
    a, hint = node.attrs, node.name
    if not a["causal"]:
        raise NotImplementedError("non-causal GroupedAttention has no ONNX lowering yet")
    first = em.node("Gather", [pos, em.const(0, "int64")], hint=hint, axis=1)[0]  # each row's first position
    ring = {"mode": "circular"} if a["window"] else {}  # a windowed layer's cache may be a ring: slot p mod T
    for new, past, present in ((k, past_k, present_k), (v, past_v, present_v)):
        em.node("TensorScatter", [past, _heads_first(em, new, a["num_kv_heads"], hint), first], [present],
                hint=hint, axis=2, **ring)
    if a["window"]:
        em.shared[RING] = RING
        length, mask = ring_mask(em, pos, present_k, hint, a["window"])
    else:
        length, mask = attention_mask(em, pos, hint)
    zero, two = em.const([0], "int64"), em.const([2], "int64")
    keys, values = (em.node("Slice", [c, zero, length, two], hint=hint)[0] for c in (present_k, present_v))
    extra = {"softcap": float(a["softcap"])} if a["softcap"] else {}
    sinks = node.inputs[7] if len(node.inputs) > 7 else None
    if sinks is not None:
        keys, values, mask = with_sinks(em, node, keys, values, mask, em.weight(sinks))
    y = em.node("Attention", [_heads_first(em, q, a["num_heads"], hint), keys, values, mask], hint=hint,
                scale=float(a["scale"]), **extra)[0]
    y = em.node("Transpose", [y], hint=hint, perm=[0, 2, 1, 3])[0]
    em.node("Reshape", [y, em.const([0, 0, -1], "int64")], [out], hint=hint)


def with_sinks(em: Emitter, node: Node, keys: str, values: str, mask: str, sinks: str) -> tuple[str, str, str]:
    """Attention sinks (gpt-oss) as one more key: a zero key and value after every row's, whose score an additive
    mask makes the head's sink logit (the masked slots' -inf): the softmax's denominator gains exp(sink), the
    output nothing. -> (keys, values, float mask [B, H, S, L + 1])."""
    hint, dtype = node.name, em.dtype_of(node.inputs[0])
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)

    def dims(t, lo, hi):
        return em.node("Shape", [t], hint=hint, start=lo, end=hi)[0]
    row = em.node("Concat", [dims(keys, 0, 2), em.const([1], "int64"), dims(keys, 3, 4)], hint=hint, axis=0)[0]
    zero_row = em.node("ConstantOfShape", [row], hint=hint,
                       value=numpy_helper.from_array(np.zeros(1, np_dtype)))[0]  # [B, KV, 1, D]
    keys, values = (em.node("Concat", [t, zero_row], hint=hint, axis=2)[0] for t in (keys, values))
    additive = em.node("Where", [mask, em.const(0, np_dtype), em.const(-np.inf, np_dtype)], hint=hint)[0]
    heads = node.attrs["num_heads"]
    additive = em.node("Add", [additive, em.const(np.zeros((1, heads, 1, 1)), np_dtype)], hint=hint)[0]
    sink = em.node("Reshape", [em.node("Cast", [sinks], hint=hint, to=dtype)[0],
                               em.const([1, heads, 1, 1], "int64")], hint=hint)[0]
    column = em.node("Expand", [sink, em.node("Concat", [dims(additive, 0, 3), em.const([1], "int64")], hint=hint,
                                              axis=0)[0]], hint=hint)[0]  # [B, H, S, 1]
    return keys, values, em.node("Concat", [additive, column], hint=hint, axis=3)[0]


def geglu(em: Emitter, node: Node) -> None:
    gate, up = node.inputs
    gelu = em.node("Gelu", [gate], hint=node.name, approximate="tanh")[0]
    em.node("Mul", [gelu, up], node.outputs, hint=node.name)


def softcap(em: Emitter, node: Node) -> None:
    (x,) = node.inputs
    dtype = "float16" if em.graph.values[x].dtype == "float16" else "float32"
    cap = em.const(node.attrs["cap"], dtype)
    capped = em.node("Tanh", [em.node("Div", [x, cap], hint=node.name)[0]], hint=node.name)[0]
    em.node("Mul", [capped, cap], node.outputs, hint=node.name)


def swiglu(em: Emitter, node: Node) -> None:
    gate, up = node.inputs
    silu = em.node("Mul", [gate, em.node("Sigmoid", [gate], hint=node.name)[0]], hint=node.name)[0]
    em.node("Mul", [silu, up], node.outputs, hint=node.name)


def add(em: Emitter, node: Node) -> None:
    em.node("Add", list(node.inputs), node.outputs, hint=node.name)


LOWERINGS = {"Embedding": embedding, "QEmbedding": qembedding, "RMSNorm": rmsnorm, "Linear": linear,
             "QLinear": qlinear, "Split": split, "RotaryCosSin": rotary_cos_sin, "Rotary": rotary,
             "GroupedAttention": grouped_attention, "SwiGLU": swiglu, "GeGLU": geglu, "SoftCap": softcap, "Add": add,
             "KeepLast": keep_last, "MoE": moe, "QMoE": moe, "ExpertMatMul": expert_matmul}

TARGET = Target("onnx", LOWERINGS, {"": OPSET})
