"""A `trt` (or `onnx`) export's ONNX as a TensorRT build parses it (export/trt_build.py's `parse`): the cache length
pinned to the build's, plugin nodes kept for their creators or turned into their function bodies, the ragged rows
as the build runs them, and — for TensorRT-RTX — each `If` inlined as its else-branch. The export folder itself is
never written: the model is changed in memory.
"""

from __future__ import annotations

from llgraph.builder import MAX_SEQ
from llgraph.passes import SLOTS_INPUT


def for_build(model, max_seq_len: int, plugins: str, flavor: str) -> None:
    """`model` (an onnx.ModelProto, loaded without its weights) made what a build with `plugins` ("aot", "jit" or
    "none") on TensorRT `flavor` ("tensorrt" or "rtx") parses."""
    for value in (*model.graph.input, *model.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == MAX_SEQ:
                dim.dim_value = max_seq_len  # clears dim_param (a oneof)
    if plugins == "none":  # the parser gives a node with plugin_namespace to a registered creator first; without
        for node in every_node(model.graph):  # it, the node's function body is imported (TensorRT's native layers)
            kept = [a for a in node.attribute if a.name != "plugin_namespace"]
            if len(kept) != len(node.attribute):
                del node.attribute[:]
                node.attribute.extend(kept)
    _ragged_for(model, plugins)
    if flavor == "rtx":
        without_branches(model)


def every_node(graph):
    """A graph's nodes and, depth first, those of its If branches (a MoE's ExpertMatMul plugin nodes)."""
    from onnx import AttributeProto

    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == AttributeProto.GRAPH:
                yield from every_node(a.g)


def without_branches(model) -> None:
    """Each `If` of the graph replaced by its else-branch, inlined (an `onnx` export's routed mixture: its way for
    many tokens, which runs every expert, export/onnx_moe.py). For TensorRT-RTX, whose 1.7.1 builder dies (SIGSEGV,
    "Determining refit engines") on any ONNX `If` in these networks, even one whose branches are an Identity and a
    Neg of one activation; TensorRT itself takes the If (IIfConditional). (An ONNX Loop over the chosen experts dies
    the same way at the same step in a whole model, though the MoE's Loop cut out of it alone builds: tried
    2026-11-30.) A `trt` export has no If: its mixtures run ExpertMatMul at every step (export/trt.py's moe), on
    llgraph's plugin or as the plugin's function body, which TensorRT-RTX builds: a decode step reads its k experts."""
    from onnx import helper

    nodes = []
    for node in model.graph.node:
        branch = next((a.g for a in node.attribute if a.name == "else_branch"), None) if node.op_type == "If" else None
        if branch is None:
            nodes.append(node)
            continue
        nodes.extend(branch.node)
        nodes.append(helper.make_node("Identity", [branch.output[0].name], [node.output[0]], name=f"{node.name}/else"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _ragged_for(model, plugins: str) -> None:
    """A `trt` export's ragged rows (slot_ids, export/trt.py) as this build runs them: with llgraph's plugins an
    engine input (its empty ONNX initializer dropped: the parser would fold it as a constant); on TensorRT's native
    layers, whose attention and KV-cache update take no slot ids, gone — the input, the nodes' last input, and
    GroupedAttention's body on contiguous rows in place of the ragged one."""
    graph = model.graph
    if not any(i.name == SLOTS_INPUT for i in graph.input):
        return
    kept = [t for t in graph.initializer if t.name != SLOTS_INPUT]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    if plugins != "none":
        return
    from llgraph.export.trt import function

    kept_inputs = [i for i in graph.input if i.name != SLOTS_INPUT]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    from llgraph.export.onnx import NO_SINKS

    sinks = False
    for node in graph.node:
        if SLOTS_INPUT in node.input:
            sinks |= len(node.input) > 7 and node.input[7] != NO_SINKS
            node.input.remove(SLOTS_INPUT)
    for i, f in enumerate(model.functions):
        if f.name == "GroupedAttention":
            model.functions[i].CopyFrom(function("GroupedAttention", rows=True, sinks=sinks))
