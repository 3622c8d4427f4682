"""The `ort` target's quantized Linears and tables on llgraph's own CPU kernels (plugins/cpu/, `--kernels
llgraph`): what of the IR around a QLinear the kernel computes in the node itself (SwiGLU, the residual Add, the
RMSNorm before it), and the llgraph::QLinear / QEmbedding nodes with the byte layouts they read (export/cpu_layout.py).
export/ort.py plans and emits the rest."""

from __future__ import annotations

import llgraph.export.onnx as std
from llgraph.export.cpu_layout import glu_groups, glu_groups_half, interleave16_5bit, interleave16_half, interleaver
from llgraph.export.lower import Emitter
from llgraph.ir import Node
from llgraph.plugins import cpu
from llgraph.weight_request import accuracy_level_of


def plan_qlinear_fusions(em: Emitter, node: Node, producer, consumers, only_read_by, fusions, order) -> None:
    """What llgraph's QLinear computes in the node itself, each a pattern of the IR around a QLinear whose
    output (or input) nothing else reads:
    - SwiGLU over a packed gate/up QLinear's Split: `swiglu`, the rows interleaved gate group, up group
      (`glu_groups`), silu(gate) * up written directly (two nodes and a [tokens, 2 * intermediate] round trip
      fewer per layer; bias-free only);
    - the residual Add after a QLinear (o_proj, down_proj): `residual`, added to its output;
    - the whole-row RMSNorm before a QLinear (the attention's and the MLP's input norms, the final one): `norm`,
      computed on x in float32 as the RMSNormalization it replaces."""
    def fuse(linear: Node, **what):
        fusions.setdefault(linear.name, {}).update(what)

    if node.op == "SwiGLU":
        split = producer.get(node.inputs[0])
        if split is None or split.op != "Split" or list(split.outputs) != list(node.inputs):
            return
        linear = producer.get(split.inputs[0])
        if (linear is not None and linear.op == "QLinear" and len(split.outputs) == 2
                and split.attrs["sizes"][0] * 2 == em.graph.values[split.inputs[0]].shape[-1]
                and std.qlinear_inputs(linear)[4] is None and only_read_by(split.inputs[0], {split.name})
                and all(only_read_by(o, {node.name}) for o in split.outputs)):
            em.absorbed.update((split.name, node.name))
            fuse(linear, swiglu=node.outputs[0])
    elif node.op == "Add":
        for mine, other in ((0, 1), (1, 0)):
            linear, before = producer.get(node.inputs[mine]), producer.get(node.inputs[other])
            if (linear is not None and linear.op == "QLinear" and only_read_by(node.inputs[mine], {node.name})
                    and (before is None or order[before.name] < order[linear.name])  # emitted before it
                    and "swiglu" not in fusions.get(linear.name, {})
                    and em.graph.values[node.inputs[other]].shape == em.graph.values[node.outputs[0]].shape):
                em.absorbed.add(node.name)
                fuse(linear, residual=(node.inputs[other], node.outputs[0]))
                return
    elif node.op == "RMSNorm" and node.attrs["group"] == em.graph.values[node.inputs[0]].shape[-1]:
        readers = consumers.get(node.outputs[0], [])
        if len(readers) == 1 and readers[0].op == "QLinear" and readers[0].inputs[0] == node.outputs[0]:
            em.absorbed.add(node.name)
            fuse(readers[0], norm=node)


def qlinear_llgraph(em: Emitter, node: Node, swiglu: str | None = None, residual: tuple[str, str] | None = None,
                    norm: Node | None = None) -> None:
    """llgraph::QLinear (plugins/cpu/llgraph_ort.cc): one node on the codes, scales and mins; the schema's inputs
    and attributes, and the export's accuracy level. The blocks are written in the kernel's interleaved layout
    (`interleave16`: 16 rows' bytes side by side, so one load feeds 16 output rows: its VNNI dots at level 4, its
    fp32 FMAs in exact mode); a tied embedding reads the same initializers (qembedding_llgraph). `swiglu`: the
    output of a SwiGLU over its two halves; `residual`: (the stream, the Add's output) it adds to its own; `norm`:
    the RMSNorm its x passes first (all computed in the node: plan_qlinear_fusions)."""
    x, codes, scales, mins, bias, bits, block, zp = std.qlinear_inputs(node)
    superblocks = em.shared.get("superblocks")
    if superblocks is None:  # the model's level (weight_request.py): a K-quant file's blocked tensors take it too,
        # and a mixture's whose experts alone are super-blocks (gpt-oss's MXFP4 GGUFs: Q8_0 elsewhere)
        superblocks = em.shared["superblocks"] = any(
            n.op == "QMoE" or (n.op == "QLinear" and n.attrs["format"] != "blocks") for n in em.graph.nodes)
    level = accuracy_level_of(em.options.get("accuracy_level"), superblocks)
    interleave, bits = _codes_layout(node)
    if swiglu:
        layout, per_block = {"compute": glu_groups(interleave)}, {"compute": glu_groups_half}
    else:
        layout, per_block = {"compute": interleave}, {"compute": interleave16_half}
    rows = em.graph.values[codes].shape[0] // (2 if swiglu else 1)
    attrs = {"interleave": 16, "rows": rows, **({"activation": 1} if swiglu else {})}
    inputs = [norm.inputs[0] if norm else x, em.weight(codes, **layout),
              em.weight(scales, **per_block) if scales else "", em.weight(mins, **per_block) if mins else "",
              em.weight(bias) if bias else "", residual[0] if residual else "",
              em.weight(norm.inputs[1]) if norm else ""]
    while inputs[-1] == "":
        inputs.pop()
    if norm:
        attrs["epsilon"] = float(norm.attrs["eps"])
    outputs = [swiglu] if swiglu else [residual[1]] if residual else node.outputs
    em.node("QLinear", inputs, outputs, domain=cpu.DOMAIN, hint=node.name, format=node.attrs["format"], bits=bits,
            block_size=block, zero_point=zp, code_bits=node.attrs["code_bits"], exponent=node.attrs["exponent"],
            accuracy_level=level, **attrs)


def _codes_layout(node: Node):
    """(the layout the kernels read a QLinear's or QEmbedding's codes in, the bits it writes them at): the
    format's interleaved layout; 5-bit codes held one a byte in the IR (GGUF's Q5_0/Q5_1) at their own bits, 5.5/6.0
    a weight as in the file, at every accuracy level. A tied table and its head decide alike, so the export holds
    their codes once."""
    a = node.attrs
    if a["format"] == "blocks" and a["bits"] == 8 and a.get("code_bits") == 5 and a["block_size"] == 32:
        return interleave16_5bit, 5
    return interleaver(a["format"]), a["bits"]


def qembedding_llgraph(em: Emitter, node: Node) -> None:
    """llgraph::QEmbedding (plugins/cpu/qembedding.inc) over the interleaved layout the (tied) lm head's QLinear
    reads, so the export holds the table once."""
    ids, codes, scales, mins = (list(node.inputs) + [None, None])[:4]
    layout, bits = _codes_layout(node)
    inputs = [ids, em.weight(codes, compute=layout)]
    inputs += [em.weight(scales, compute=interleave16_half)] if scales else []
    inputs += [em.weight(mins, compute=interleave16_half)] if mins else []
    rows = em.node("QEmbedding", inputs, hint=node.name, domain=cpu.DOMAIN, format=node.attrs["format"],
                   bits=bits, block_size=node.attrs["block_size"], zero_point=node.attrs["zero_point"],
                   rows=em.graph.values[codes].shape[0])[0]
    std.scaled_rows(em, node, rows)
