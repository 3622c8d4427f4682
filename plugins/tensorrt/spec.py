"""What a TensorRT plugin is, read from the op schemas (llgraph/ops.py): one definition serves the `trt` export
(node attributes) and the QDP registrations (plugins/tensorrt/qdp.py), so the two cannot drift apart.

A plugin is named after its op (`llgraph::RMSNorm`); its inputs are the op's inputs and its fields are exactly the
op's attributes, in schema order, with the schema's Python types. ONNX has no bool attribute, so a bool field travels
as an INT attribute (0/1) and TensorRT's QDP creator turns it back into a bool.
"""

from __future__ import annotations

from llgraph.ops import SCHEMAS

NAMESPACE = "llgraph"
VERSION = "1"
PLUGIN_OPS = ("RMSNorm", "Rotary", "GroupedAttention", "SwiGLU", "ExpertMatMul")
# pairs of one expert an ExpertMatMul program multiplies (its kernel's BLOCK_M; the `trt` export's schedule pads each
# expert's pairs to a multiple of it, export/expert_schedule.py)
EXPERT_ROWS = 32


def plugin_id(op: str) -> str:
    return f"{NAMESPACE}::{op}"


def fields(op: str) -> dict[str, type]:
    """The plugin's fields: attribute name -> Python type (int, float or bool), in schema order."""
    return {a.name: a.type for a in SCHEMAS[op].attrs}


def inputs(op: str) -> tuple[str, ...]:
    """Every schema input, optional ones too: GroupedAttention's `slots` (ragged rows by slot id) is always passed,
    an empty tensor meaning row b."""
    return tuple(name.rstrip("?") for name in SCHEMAS[op].inputs)


def outputs(op: str) -> tuple[str, ...]:
    return SCHEMAS[op].outputs


def onnx_attrs(op: str, attrs: dict) -> dict:
    """A node's attribute values as the plugin node carries them: the fields (bools as 0/1) plus the parser's
    plugin_namespace and plugin_version."""
    values = {name: (int(attrs[name]) if kind is bool else kind(attrs[name])) for name, kind in fields(op).items()}
    return {**values, "plugin_namespace": NAMESPACE, "plugin_version": VERSION}
