"""Target `ort` (CPU default): the graph ONNX Runtime runs fastest. The `onnx` target's lowerings, plus a fusion
planned before emission:

- q/k/v projections (packed by the QKV pass: one MatMul + Split), their two Rotary nodes and GroupedAttention become
  one com.microsoft GroupQueryAttention: packed QKV input, rotary inside (cos/sin tables as initializers), and the
  static cache bound as both past and present (ORT's shared-buffer mode: no per-step cache copy). `seqlens_k` and
  `total_sequence_length` are derived in the graph from `position_ids`.
  Taken when RoPE is static (not dynamic NTK), covers the whole head, and head_dim % 16 == 0 (ORT CPU's rule);
  otherwise the Rotary nodes stay and GroupQueryAttention runs without its rotary. On llgraph's kernels (float32,
  packed QKV, rotary fused) the node is llgraph's own GroupedAttention instead, which reads position_ids itself.
RMSNorm stays the standard RMSNormalization. Fusing the residual Add into com.microsoft
SkipSimplifiedLayerNormalization was measured and rejected: on SmolLM2 it raised the prefill logits error against
the float64 executor from 5.5e-5 to 1.3e-4 (ORT 1.32 CPU), to save one pass over a hidden-size vector per norm.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from onnx import TensorProto

import llgraph.export.onnx as std
import llgraph.export.ort_moe as ort_moe
from llgraph.export.genai import write_genai_config
from llgraph.export.lower import FULL_WINDOWS, RING, Emitter, Target
from llgraph.export.ort_qlinear import plan_qlinear_fusions, qembedding_llgraph, qlinear_llgraph
from llgraph.ir import Graph, Node
from llgraph.passes import expose_hidden, keep_last_positions, ragged_slots
from llgraph.plugins import cpu
from llgraph.weight_request import DEFAULT_ACCURACY_LEVEL
from llgraph.weights import DTYPES

MS = "com.microsoft"


def plan(em: Emitter) -> None:
    g = em.graph
    producer, consumers = g.producer(), g.consumers()

    def only_read_by(value, allowed):
        return all(c.name in allowed for c in consumers.get(value, []))

    fusions: dict[str, dict] = {}  # a QLinear's name -> what qlinear_llgraph fuses into it
    order = {n.name: i for i, n in enumerate(g.nodes)}
    for node in g.nodes:
        if node.op == "GroupedAttention" and node.attrs["causal"]:
            _plan_attention(em, node, producer, only_read_by)
        if em.options.get("kernels") == "llgraph":
            plan_qlinear_fusions(em, node, producer, consumers, only_read_by, fusions, order)
    for name, fused in fusions.items():
        em.fused[name] = lambda em, n, fused=fused: qlinear_llgraph(em, n, **fused)
    for node in g.nodes:  # a RotaryCosSin whose every Rotary was fused away is not needed
        if node.op == "RotaryCosSin" and all(c.name in em.absorbed for c in consumers.get(node.outputs[0], [])):
            em.absorbed.add(node.name)


def _fused_rotary(graph: Graph, node: Node, producer, only_read_by) -> tuple[Node, Node] | None:
    """The two Rotary nodes before a GroupedAttention's q and k that llgraph's kernel (and GroupQueryAttention)
    compute inside, or None where they cannot be: other tables, a partial rotary, dynamic NTK, other readers."""
    q, k = node.arg(0), node.arg(1)
    qr, kr = producer.get(q), producer.get(k)
    d = graph.values[q].shape[-1] // node.attrs["num_heads"]
    if (qr is not None and kr is not None and qr.op == kr.op == "Rotary" and qr.inputs[1:] == kr.inputs[1:]
            and qr.attrs["interleaved"] == kr.attrs["interleaved"]
            and 2 * graph.values[qr.inputs[1]].shape[-1] == d and d % 16 == 0
            and producer[qr.inputs[1]].attrs["dynamic_factor"] == 0
            and only_read_by(q, {node.name}) and only_read_by(k, {node.name})):
        return qr, kr
    return None


def _own_attention(graph: Graph, node: Node, producer, only_read_by, options: dict) -> bool:
    """Whether the node runs as llgraph's GroupedAttention (float32, llgraph's kernels, its rotary fusable)."""
    return (options.get("kernels") == "llgraph" and graph.metadata["dtype"] == "float32"
            and _fused_rotary(graph, node, producer, only_read_by) is not None)


def ragged(graph: Graph, options: dict) -> Graph:
    """passes.ragged_slots where every GroupedAttention runs on llgraph's kernel, which reads the slots (ONNX
    Runtime's GroupQueryAttention cannot): a step then runs only the busy cache rows (runtime/engine/step.py)."""
    producer, consumers = graph.producer(), graph.consumers()

    def only_read_by(value, allowed):
        return all(c.name in allowed for c in consumers.get(value, []))

    nodes = [n for n in graph.nodes if n.op == "GroupedAttention"]
    if nodes and all(_own_attention(graph, n, producer, only_read_by, options) for n in nodes):
        return ragged_slots(graph)
    return graph


def _plan_attention(em: Emitter, node: Node, producer, only_read_by) -> None:
    q, k, v = (node.arg(i) for i in range(3))
    fused = _fused_rotary(em.graph, node, producer, only_read_by)
    if fused is not None:
        qr, kr = fused
        em.absorbed.update((qr.name, kr.name))
        q, k = qr.arg(0), kr.arg(0)
    split = producer.get(q)
    packed = (split is not None and split.op == "Split" and list(split.outputs) == [q, k, v]
              and all(only_read_by(o, {node.name} | em.absorbed) for o in split.outputs))
    if packed:
        em.absorbed.add(split.name)
    qkv = (split.arg(0), "", "") if packed else (q, k, v)
    rotary = (fused[0], producer[fused[0].arg(1)]) if fused is not None else None  # (a Rotary, its RotaryCosSin)
    if rotary is not None and _own_attention(em.graph, node, producer, only_read_by, em.options):
        fused_rotary = rotary
        # q, k and v in weights of two formats (Q4_K_M's Q6_K v on some layers) are three QLinears: their outputs,
        # a few thousand floats a token, are concatenated into the packed input the kernel reads
        em.fused[node.name] = lambda em, n: attention_llgraph(
            em, n, qkv[0] if packed else em.node("Concat", list(qkv), hint=n.name, axis=-1)[0], fused_rotary)
    else:
        em.fused[node.name] = lambda em, n: group_query_attention(em, n, qkv, rotary)


def _seqlens(em: Emitter, pos: str) -> tuple[str, str]:
    """(seqlens_k [B] int32 = last position per row, total_sequence_length int32 scalar = max position + 1)."""
    if pos not in em.shared:
        last = em.node("ReduceMax", [pos, em.const([1], "int64")], hint="seqlens", keepdims=0)[0]
        seqlens = em.node("Cast", [last], hint="seqlens", to=TensorProto.INT32)[0]
        total = em.node("Add", [em.node("ReduceMax", [seqlens], hint="seqlens", keepdims=0)[0],
                                em.const(1, "int32")], hint="seqlens")[0]
        em.shared[pos] = (seqlens, total)
    return em.shared[pos]


def group_query_attention(em: Emitter, node: Node, qkv, rotary: tuple[Node, Node] | None) -> None:
    std.refuse_slots(node, "ONNX Runtime's GroupQueryAttention")
    q, k, v, pos, past_k, past_v = (node.arg(i) for i in range(6))
    a = node.attrs
    seqlens, total = _seqlens(em, pos)
    inputs = [*qkv, past_k, past_v, seqlens, total]
    attrs: dict[str, int | float] = {}
    if rotary is not None:
        rot, cos_sin = rotary
        inputs += [em.weight(cos_sin.inputs[1], compute=_table(em, cos_sin, "cos_cache", np.cos)),
                   em.weight(cos_sin.inputs[1], compute=_table(em, cos_sin, "sin_cache", np.sin))]
        attrs = {"do_rotary": 1, "rotary_interleaved": int(rot.attrs["interleaved"])}
    if a["window"]:  # GroupQueryAttention's window counts the query's own key, as transformers' does (tested); it
        # writes at positions 0.. of its own: every layer holds every position (no ring)
        attrs["local_window_size"] = a["window"]
        em.shared[FULL_WINDOWS] = FULL_WINDOWS
    if a["softcap"]:
        attrs["softcap"] = float(a["softcap"])
    if len(node.inputs) > 7 and node.inputs[7] is not None:  # gpt-oss's sinks: GroupQueryAttention's head_sink
        inputs = [*inputs, *[""] * (11 - len(inputs)), em.weight(node.inputs[7])]
    em.node("GroupQueryAttention", inputs, node.outputs, domain=MS, hint=node.name, num_heads=a["num_heads"],
            kv_num_heads=a["num_kv_heads"], scale=float(a["scale"]), **attrs)


def attention_llgraph(em: Emitter, node: Node, qkv: str, rotary: tuple[Node, Node]) -> None:
    """llgraph::GroupedAttention (plugins/cpu/attention.inc): the schema's attributes, on the packed QKV with the
    rotary inside (its tables as GroupQueryAttention's), reading position_ids itself. In place of ONNX Runtime's
    GroupQueryAttention, whose CPU kernel runs q.k and p.v in SSE loops: paired on SmolLM2 int4 level 4, 2 threads
    on one pool, a one-token step took 0.97x the time at position 30, 0.93x at 100 and 0.87x at 300."""
    _, _, _, pos, past_k, past_v = node.inputs[:6]
    slots = std.slots_input(em, node)
    a = node.attrs
    rot, cos_sin = rotary
    inputs = [qkv, past_k, past_v, pos,
              em.weight(cos_sin.inputs[1], compute=_table(em, cos_sin, "cos_cache", np.cos)),
              em.weight(cos_sin.inputs[1], compute=_table(em, cos_sin, "sin_cache", np.sin))]
    sinks = node.inputs[7] if len(node.inputs) > 7 else None
    if slots is not None or sinks is not None:
        inputs.append(slots or "")
    if sinks is not None:
        inputs.append(em.weight(sinks))
    if a["window"]:  # the kernel takes a windowed layer's ring (slot p mod its length)
        em.shared[RING] = RING
    em.node("GroupedAttention", inputs, node.outputs, domain=cpu.DOMAIN, hint=node.name, num_heads=a["num_heads"],
            num_kv_heads=a["num_kv_heads"], scale=float(a["scale"]), window=a["window"],
            softcap=float(a["softcap"]), rotary_interleaved=int(rot.attrs["interleaved"]))


def qlinear_nbits(em: Emitter, node: Node) -> None:
    """com.microsoft MatMulNBits on the codes as they are (its packing is llgraph's). A format with mins (Q4_1, the
    K-quants' Q4_K/Q5_K, asymmetric RTN) runs as scale * (q - 2^(bits-1)) with the mins and the shifted zero
    point added back exactly as (block sums of x) @ offset^T: MatMulNBits takes float zero points too, but ONNX
    Runtime's CPU kernel then leaves its fast path (20x slower, measured); and centred codes keep level 4's int8
    activations from weighing the blocks' mean (SmolLM2 Q4_1 at level 4, mean KL vs exact: 0.016 with codes
    0..15, 0.0033 centred). Without mins, a zero point other than 2^(bits-1) is MatMulNBits' uint8 input."""
    x, codes, scales, mins, bias, bits, block, zp = std.qlinear_inputs(node)
    level = em.options.get("accuracy_level", DEFAULT_ACCURACY_LEVEL)
    out, blocks, _ = em.graph.values[codes].shape
    if bits == 8 and level < 4:
        y = _split_bytes(em, node, level)
        if mins is not None:
            y = em.node("Add", [y, std.offset_term(em, node, zp)], hint=node.name)[0]
    else:
        half = 1 << (bits - 1)
        inputs = [x, em.weight(codes), em.weight(scales, compute=_flat)]
        if zp != half and mins is None:
            inputs.append(_zero_points_input(em, f"{codes}.zero_points", codes, bits, zp))
        y = em.node("MatMulNBits", inputs, hint=node.name, domain=MS, K=blocks * block, N=out, bits=bits,
                    block_size=block, accuracy_level=level)[0]
        if mins is not None:
            y = em.node("Add", [y, std.offset_term(em, node, half)], hint=node.name)[0]
    em.node("Identity" if bias is None else "Add", [y] + ([em.weight(bias)] if bias else []), node.outputs,
            hint=node.name)


def _split_bytes(em: Emitter, node: Node, level: int) -> str:
    """8-bit blocks at exact fp32 compute, where ONNX Runtime's CPU has no fast 8-bit kernel (40x slower than
    4-bit, measured), as two 4-bit MatMulNBits on the codes' nibbles (`_nibble_tables`), added. 1.25 bytes a weight
    where the float table they replace took 4 (SmolLM2's Q8_0 lm head: 113 MB -> 35 MB)."""
    x, codes, scales, _, _, _, block, zp = std.qlinear_inputs(node)
    out, blocks, _ = em.graph.values[codes].shape
    attrs = {"domain": MS, "K": blocks * block, "N": out, "bits": 4, "block_size": block, "accuracy_level": level}
    halves = []
    for half, half_codes, half_scales, z in _nibble_tables(em, codes, scales, zp, _flat):
        inputs = [x, half_codes, half_scales]
        if z != 8:
            inputs.append(_zero_points_input(em, f"{codes}.{half}.zero_points", codes, 4, z))
        halves.append(em.node("MatMulNBits", inputs, hint=node.name, **attrs)[0])
    return em.node("Add", halves, hint=node.name)[0]


def _nibble_tables(em: Emitter, codes: str, scales: str, zp: int, layout):
    """The two 4-bit tables exact compute splits an 8-bit table into, read alike by the lm head's MatMulNBits and
    a tied embedding's GatherBlockQuantized: with c = 16 hi + lo and z = 16 zh + zl, scale * (c - z) =
    16 * scale * (hi - zh) + scale * (lo - zl), each term exact in float. -> (half, codes, scales laid out by
    `layout`, zero point) for the high and the low nibbles."""
    def times16(s):
        return layout(s * 16)
    times16.__name__ = f"x16{layout.__name__}"
    return [("high", em.derived(f"{codes}.high", _nibbles(4), codes), em.weight(scales, compute=times16), zp >> 4),
            ("low", em.derived(f"{codes}.low", _nibbles(0), codes), em.weight(scales, compute=layout), zp & 15)]


def _zero_points_input(em: Emitter, name: str, codes: str, bits: int, z: int) -> str:
    """MatMulNBits' uint8 zero points, `z` for every block of `codes` (4-bit: two blocks a byte)."""
    out, blocks, _ = em.graph.values[codes].shape
    per_row, byte = (blocks if bits == 8 else (blocks + 1) // 2), _zero_point_byte(bits, z)
    return em.derived(name, lambda c: np.full((out * per_row,), byte, np.uint8), codes)


def _zero_point_byte(bits: int, z: int) -> int:
    """A uint8 zero-point byte holding `z` for each code it covers: one 8-bit code or two 4-bit ones."""
    return z if bits == 8 else z | (z << 4)


def _nibbles(shift: int):
    """8-bit codes [out, blocks, B] -> the 4-bit codes [out, blocks, B/2] of their high (shift 4) or low nibbles."""
    def nibbles(c):
        v = (c >> shift) & 15
        return v[..., 0::2] | (v[..., 1::2] << 4)
    return nibbles


def qembedding_gather(em: Emitter, node: Node) -> None:
    """On llgraph's kernels, their QEmbedding over the interleaved layout the (tied) lm head's QLinear reads. Else
    com.microsoft GatherBlockQuantized on the codes the (tied) lm head's MatMulNBits reads. Either way the export
    holds the table once. GatherBlockQuantized reads the codes as they are, or at exact compute the 8-bit codes' two
    nibble tables (`_split_bytes`), gathered and added. Mins (which GatherBlockQuantized has no input for) are
    gathered and added, as the executor adds them."""
    if em.options.get("kernels") == "llgraph":
        qembedding_llgraph(em, node)
        return
    ids, codes, scales, mins = (list(node.inputs) + [None, None])[:4]
    bits, zp = node.attrs["bits"], node.attrs["zero_point"]
    split = em.options.get("accuracy_level", DEFAULT_ACCURACY_LEVEL) < 4
    if bits == 8 and split:  # the head's MatMulNBits reads the two nibble tables: gather from them too
        halves = [_gather(em, node, c, s, 4, z) for _, c, s, z in _nibble_tables(em, node.arg(1), node.arg(2), zp,
                                                                                    _per_block)]
        rows = em.node("Add", halves, hint=node.name)[0]
    else:
        rows = _gather(em, node, em.weight(codes), em.weight(scales, compute=_per_block), bits, zp)
    if mins is not None:
        row_mins = em.node("Gather", [em.weight(mins), ids], hint=node.name, axis=0)[0]
        rows = em.node("Add", [rows, em.node("Unsqueeze", [row_mins, em.const([-1], "int64")], hint=node.name)[0]],
                       hint=node.name)[0]
    std.scaled_rows(em, node, em.node("Reshape", [rows, em.const([0, 0, -1], "int64")], hint=node.name)[0])


def _gather(em: Emitter, node: Node, codes: str, scales: str, bits: int, zp: int) -> str:
    """GatherBlockQuantized of the ids' rows of `codes` (initializer names) -> [B, S, blocks, block]."""
    ids, scales_param = node.inputs[0], node.inputs[2]
    inputs = [codes, ids, scales]
    if zp != 1 << (bits - 1):  # uint8 [rows, blocks, 1]: one code (4-bit: the byte's two nibbles) per block
        byte = _zero_point_byte(bits, zp)
        inputs.append(em.derived(f"{scales_param}.gather_zero_points{byte}",
                                 lambda t: np.full((*t.shape, 1), byte, np.uint8), scales_param))
    return em.node("GatherBlockQuantized", inputs, hint=node.name, domain=MS, bits=bits,
                   block_size=node.attrs["block_size"], gather_axis=0, quantize_axis=2)[0]


def _per_block(t):
    return t[..., None]


def _flat(t):
    return t.reshape(-1)


def _table(em: Emitter, cos_sin: Node, name: str, fn):
    """RoPE table [max_positions, rotary_dim/2] in the model's dtype, from the inv_freq constant."""
    dtype = DTYPES[em.graph.metadata["dtype"]]

    def table(inv_freq):
        angles = np.arange(em.max_positions, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None]
        return (fn(angles) * np.float32(cos_sin.attrs["scaling"])).astype(dtype)
    table.__name__ = name
    return table


def qlinear(em: Emitter, node: Node) -> None:
    """llgraph's own CPU kernel where the export asks for it (--kernels llgraph), else MatMulNBits."""
    (qlinear_llgraph if em.options.get("kernels") == "llgraph" else qlinear_nbits)(em, node)


def extras(folder: Path, manifest) -> None:
    """genai_config.json, and with llgraph's kernels their library, copied in so the folder runs anywhere."""
    library = None
    if manifest.options.get("kernels") == "llgraph":
        library = cpu.LIBRARY
        shutil.copy(cpu.library(progress=False), folder / library)
    write_genai_config(folder, manifest, library)


TARGET = Target("ort", {**std.LOWERINGS, "QLinear": qlinear, "QEmbedding": qembedding_gather, "MoE": ort_moe.moe,
                          "QMoE": ort_moe.qmoe},
                {"": std.OPSET, MS: 1, cpu.DOMAIN: 1}, plan=plan, extras=extras, bf16=False, accuracy_level=True,
                kernels=True, passes=(expose_hidden, keep_last_positions), options_pass=ragged)
