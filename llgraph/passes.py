"""Graph rewrites: pure functions Graph -> Graph, verified before and after.

Both packing passes are one mechanism, `pack_linears`: Linears that read the same input become one Linear whose
weight concatenates theirs (a packed Param, still lazy), followed by a Split that restores the original value names
so every IR value stays traceable. The groups are found from the graph's structure, never from weight names.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from llgraph.ir import Graph, Node, Param, Value, infer, verify

if TYPE_CHECKING:
    from llgraph.quant import QuantFormat

Pass = Callable[[Graph], Graph]


def run_passes(graph: Graph, passes: Sequence[Pass]) -> Graph:
    verify(graph)
    for p in passes:
        graph = verify(p(graph))
    return graph


def pack_qkv(graph: Graph, format_of=None) -> Graph:
    """One [q; k; v] projection per attention: the Linears feeding each GroupedAttention's q, k, v (through Rotary)."""
    producer = graph.producer()

    def linear_behind(name):
        node = producer.get(name) if name is not None else None
        if node is not None and node.op == "Rotary":
            node = producer.get(node.arg(0))
        return node if node is not None and node.op == "Linear" else None

    groups = [[linear_behind(n) for n in node.inputs[:3]] for node in graph.nodes if node.op == "GroupedAttention"]
    return pack_linears(graph, groups, "qkv", format_of)


def pack_gate_up(graph: Graph, format_of=None) -> Graph:
    """One [gate; up] projection per MLP: the two Linears feeding each SwiGLU."""
    producer = graph.producer()
    groups = [[producer.get(n) for n in node.inputs if n is not None] for node in graph.nodes if node.op == "SwiGLU"]
    return pack_linears(graph, [[n if n is not None and n.op == "Linear" else None for n in g] for g in groups],
                        "gate_up", format_of)


def pack_linears(graph: Graph, groups: Sequence[Sequence[Node | None]], label: str, format_of=None) -> Graph:
    """Replace each group of Linears sharing one input (and all with or all without bias) by Linear + Split. With
    `format_of` (a source's quant_format), only groups whose weights are stored in one format: Q4_K_M keeps q and
    k in Q4_K and v in Q6_K on some layers, and a packed weight must be one QLinear, in one format."""
    replace: dict[int, list[Node]] = {}  # id of the group's first node -> the nodes that stand in its place
    drop: set[int] = set()
    params = dict(graph.params)
    values = dict(graph.values)
    for maybe in groups:
        group = [n for n in maybe if n is not None]
        if len(group) < 2 or len(group) != len(maybe) or len({n.inputs[0] for n in group}) != 1:
            continue
        has_bias = [len(n.inputs) > 2 and n.inputs[2] is not None for n in group]
        if len(set(has_bias)) != 1:
            continue
        if format_of is not None and len({format_of(p.name) for n in group for p in graph.params[n.arg(1)].parts
                                          }) != 1:
            continue
        x = group[0].arg(0)
        slots = (1, 2) if has_bias[0] else (1,)
        packed_inputs = [x]
        for slot in slots:
            members = [graph.params[n.arg(slot)] for n in group]
            name = _packed_name([m.name for m in members], label)
            shape = (sum(int(m.value.shape[0]) for m in members),) + members[0].value.shape[1:]
            value = Value(name, members[0].value.dtype, shape)
            params[name] = Param(value, tuple(part for m in members for part in m.parts))
            values[name] = value
            for m in members:
                params.pop(m.name)
                values.pop(m.name)
            packed_inputs.append(name)
        outputs = [n.outputs[0] for n in group]
        packed_out = _packed_name(outputs, label)
        linear = Node("Linear", tuple(packed_inputs), (packed_out,))
        split = Node("Split", (packed_out,), tuple(outputs),
                     {"sizes": tuple(values[o].shape[-1] for o in outputs)})
        (values[packed_out],) = infer(linear, values)
        replace[id(group[0])] = [linear, split]
        drop.update(id(n) for n in group[1:])
    if not replace:
        return graph
    nodes = []
    for node in graph.nodes:
        if id(node) in replace:
            nodes += replace[id(node)]
        elif id(node) not in drop:
            nodes.append(node)
    return verify(Graph(graph.inputs, graph.outputs, params, tuple(nodes), values, graph.metadata))


def _packed_name(names: list[str], label: str) -> str:
    """'model.layers.0.self_attn.q_proj.weight', ...k_proj..., ...v_proj... -> 'model.layers.0.self_attn.qkv.weight'"""
    parts = [n.split(".") for n in names]
    prefix = os.path.commonprefix(parts)
    suffix = os.path.commonprefix([p[len(prefix):][::-1] for p in parts])[::-1]
    return ".".join([*prefix, label, *suffix])


def quantize_linears(format_of: Callable[[str], QuantFormat | None]) -> Pass:
    """Linear -> QLinear and Embedding -> QEmbedding where every checkpoint tensor of the weight has the same
    blocked format (`format_of(name)` -> llgraph.quant.QuantFormat or None). The weight param becomes three lazy
    params — codes, scales and (for formats with them) mins — over the same checkpoint tensors; a table tied to the
    lm head is one set, read by both. Runs after packing, so a packed [q; k; v] is quantized when its parts agree."""
    def quantize(graph: Graph) -> Graph:
        params, values, nodes = dict(graph.params), dict(graph.values), []
        readers = {name: len(nodes_) for name, nodes_ in graph.consumers().items()}
        for node in graph.nodes:
            w = graph.params.get(node.arg(1)) if node.op in ("Linear", "Embedding") else None
            fmt = _one_format(w, format_of) if w is not None else None
            if w is None or fmt is None:
                nodes.append(node)
                continue
            out, n_in = (int(d) for d in w.value.shape)
            pieces: dict[str, tuple[str, tuple[int, ...]]] = {"codes": ("uint8", fmt.codes_shape(out, n_in))}
            if not fmt.superblocks:  # super-blocks hold their own scales and mins
                pieces["scales"] = (w.value.dtype, (out, n_in // fmt.block_size))
            if fmt.has_mins:
                pieces["mins"] = pieces["scales"]
            readers[w.name] -= 1
            if readers[w.name] == 0:
                del params[w.name], values[w.name]
            for piece, (dtype, shape) in pieces.items():
                v = Value(f"{w.name}.{piece}", dtype, shape)
                params[v.name], values[v.name] = Param(v, w.parts, component=piece), v
            blocked = [f"{w.name}.{piece}" if piece in pieces else None for piece in ("codes", "scales", "mins")]
            bias = node.inputs[2] if node.op == "Linear" and len(node.inputs) > 2 else None
            inputs = [node.inputs[0], *blocked] + ([bias] if bias else [])
            while inputs[-1] is None:  # trailing absent inputs are left out
                inputs.pop()
            if node.op == "Embedding":
                attrs = {**fmt.attrs, "scale": node.attrs["scale"]}
                nodes.append(Node("QEmbedding", tuple(inputs), node.outputs, attrs))
            else:
                nodes.append(Node("QLinear", tuple(inputs), node.outputs, fmt.attrs))
        return verify(Graph(graph.inputs, graph.outputs, params, tuple(nodes), values, graph.metadata))
    quantize.__name__ = "quantize_linears"
    return quantize


def _one_format(w: Param, format_of: Callable[[str], QuantFormat | None]) -> QuantFormat | None:
    """The one blocked format every checkpoint tensor of `w` is stored in, or None (float, mixed, or no tensor)."""
    formats = {format_of(p.name) for p in w.parts}
    return formats.pop() if len(formats) == 1 else None


def quantize_experts(format_of: Callable[[str], QuantFormat | None]) -> Pass:
    """MoE -> QMoE where its routed experts are stored as GGUF super-blocks (`format_of`), gate and up in one
    format: each expert param becomes its codes, a lazy param over the same checkpoint tensor. Others stay MoE, read
    in float."""
    def quantize(graph: Graph) -> Graph:
        params, values, nodes = dict(graph.params), dict(graph.values), []
        for node in graph.nodes:
            experts = [graph.params[node.arg(i)] for i in range(2, 5)] if node.op == "MoE" else []
            formats = [f for f in (_one_format(w, format_of) for w in experts) if f is not None and f.superblocks]
            if len(formats) != 3 or formats[0] != formats[1]:
                nodes.append(node)
                continue
            codes = []
            for w, fmt in zip(experts, formats):
                e, out, n_in = (int(d) for d in w.value.shape)
                v = Value(f"{w.name}.codes", "uint8", (e, *fmt.codes_shape(out, n_in)))
                params[v.name], values[v.name] = Param(v, w.parts, component="codes"), v
                del params[w.name], values[w.name]
                codes.append(v.name)
            gate_fmt, down_fmt = formats[0], formats[2]
            attrs = {**node.attrs, "format": gate_fmt.format, "down_format": down_fmt.format,
                     "exponent": gate_fmt.exponent, "down_exponent": down_fmt.exponent}
            nodes.append(Node("QMoE", (*node.inputs[:2], *codes, *node.inputs[5:]), node.outputs, attrs))
        return verify(Graph(graph.inputs, graph.outputs, params, tuple(nodes), values, graph.metadata))
    quantize.__name__ = "quantize_experts"
    return quantize


def _final_norm(graph: Graph) -> Node | None:
    """The RMSNorm behind the logits' head (found from the structure), or None."""
    producer = graph.producer()
    node = producer.get(graph.outputs[0].name)
    while node is not None and node.op in ("SoftCap", "Linear", "QLinear"):
        node = producer.get(node.arg(0))
    return node if node is not None and node.op == "RMSNorm" else None


KEEP_INPUT = "logits_to_keep"  # the graph input keep_last_positions adds: logits for the last N positions, 0 = all


def keep_last_positions(graph: Graph) -> Graph:
    """The lm head on the positions a step samples from only: a KeepLast(x, logits_to_keep) before the final norm
    (found from the structure: the norm behind the logits' head). A prefill then computes one row of logits, not
    one per prompt token (SmolLM2's 49152-wide head is a fifth of a short prompt's work); a scorer asks for all."""
    node = _final_norm(graph)
    if node is None or any(v.name == KEEP_INPUT for v in graph.inputs):
        return graph
    x = node.inputs[0]
    keep_input = Value(KEEP_INPUT, "int64", ())
    values = {**graph.values, KEEP_INPUT: keep_input}
    keep = Node("KeepLast", (x, KEEP_INPUT), (f"{x}.kept",))
    nodes = []
    for n in graph.nodes:
        if n is node:
            nodes.append(keep)
            n = Node(n.op, (keep.outputs[0], *n.inputs[1:]), n.outputs, n.attrs)
        nodes.append(n)
    after = False
    for n in nodes:  # the kept values' shapes, from the KeepLast on
        after = after or n is keep
        if after:
            values.update((v.name, v) for v in infer(n, values))
    outputs = tuple(values[v.name] for v in graph.outputs)
    return verify(Graph((*graph.inputs, keep_input), outputs, graph.params, tuple(nodes), values, graph.metadata))


SLOTS_INPUT = "slot_ids"  # the graph input ragged_slots adds: each token's cache row [B*S] int64 (empty: row b)


def ragged_slots(graph: Graph) -> Graph:
    """Every GroupedAttention told each token's cache row (its `slots` input, from the graph input `slot_ids`): a
    step then runs only the busy rows of the cache, in any order, several rows' tokens packed into one batch row
    (llgraph/ops.py). A caller that does not feed it (onnxruntime-genai: the ONNX initializer is empty) gets row b."""
    if any(v.name == SLOTS_INPUT for v in graph.inputs):
        return graph
    slots = Value(SLOTS_INPUT, "int64", ("tokens",))
    nodes = tuple(Node(n.op, (*n.inputs[:6], SLOTS_INPUT, *n.inputs[7:]), n.outputs, n.attrs)
                  if n.op == "GroupedAttention" else n for n in graph.nodes)  # (sinks stay after the slots)
    caches = {name for n in nodes if n.op == "GroupedAttention" for name in n.inputs[4:6]}
    inputs = tuple(Value(v.name, v.dtype, ("cache_rows", *v.shape[1:])) if v.name in caches else v
                   for v in graph.inputs)  # the caches' row counts are no longer the batch's
    values = {**graph.values, SLOTS_INPUT: slots, **{v.name: v for v in inputs}}
    for n in nodes:
        values.update((v.name, v) for v in infer(n, values))
    outputs = tuple(values[v.name] for v in graph.outputs)
    return verify(Graph((*inputs, slots), outputs, graph.params, nodes, values, graph.metadata))


HIDDEN = "hidden_states"  # the output expose_hidden adds: the final norm's output at every position [B, S, H]


def expose_hidden(graph: Graph) -> Graph:
    """The model's last hidden states as a graph output (embeddings: llgraph/runtime/engine/embed.py): the final
    RMSNorm over every position, as transformers' `last_hidden_state` (a second norm node reading the residual
    stream before any KeepLast, so the head still runs on the kept positions only; its cost is one norm a token)."""
    node = _final_norm(graph)
    if node is None or any(v.name == HIDDEN for v in graph.outputs):
        return graph
    x = node.arg(0)
    kept = graph.producer().get(x)
    if kept is not None and kept.op == "KeepLast":  # the stream before keep_last_positions cut it
        x = kept.arg(0)
    norm = Node("RMSNorm", (x, *node.inputs[1:]), (HIDDEN,), node.attrs)
    values = {**graph.values}
    values.update((v.name, v) for v in infer(norm, values))
    at = graph.nodes.index(node)
    nodes = (*graph.nodes[:at], norm, *graph.nodes[at:])
    outputs = (*graph.outputs, values[HIDDEN])
    return verify(Graph(graph.inputs, outputs, graph.params, nodes, values, graph.metadata))


DEFAULT_PASSES: tuple[Pass, ...] = (pack_qkv, pack_gate_up)


def model_graph(cfg, dtype: str = "float32", quant: Callable[[str], QuantFormat | None] | None = None,
                kv: str | None = None) -> Graph:
    """The graph every backend runs: the builder's graph for `cfg` (its cache in format `kv`, llgraph/kv_cache.py)
    after DEFAULT_PASSES, and with `quant` (a source's `quant_format`) its quantized Linears as QLinear and its
    experts stored in super-blocks as QMoE."""
    from llgraph.builder import build_graph

    if quant is None:
        return run_passes(build_graph(cfg, dtype, kv), DEFAULT_PASSES)
    packing = tuple(_with_formats(p, quant) for p in DEFAULT_PASSES)  # packed weights keep one format
    return run_passes(build_graph(cfg, dtype, kv), packing + (quantize_linears(quant), quantize_experts(quant)))


def _with_formats(pack: Callable, format_of) -> Pass:
    def run(graph: Graph) -> Graph:
        return pack(graph, format_of)
    run.__name__ = pack.__name__
    return run
