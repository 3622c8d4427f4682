"""The TensorRT plugins, checked without TensorRT: the `trt` export's plugin nodes carry exactly the fields the
plugins register (names and types), and the registrations pass TensorRT's own QDP validators."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from reference import tiny

from llgraph.checkpoint import random_weights
from llgraph.export import get_target
from llgraph.export.lower import export
from llgraph.export.trt_network import every_node
from llgraph.passes import model_graph
from llgraph.plugins.tensorrt import spec

ONNX_TYPES = {"int": onnx.AttributeProto.INT, "bool": onnx.AttributeProto.INT, "float": onnx.AttributeProto.FLOAT}

REGISTER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import trt_standin
trtp = trt_standin.load()
import tensorrt as trt
from tensorrt.plugin._lib import QDP_REGISTRY
from llgraph.plugins.tensorrt.qdp import register_plugins
register_plugins(trtp)
out = {}
for pid, d in QDP_REGISTRY.items():
    descs = [trtp.TensorDesc(trtp.ShapeExprs(3, _is_dummy=True), trt.float16) for _ in d.input_tensor_names]
    attrs = {"eps": 1e-5, "group": 32, "num_heads": 4, "num_kv_heads": 2, "scale": 0.125, "causal": True,
             "window": 0, "softcap": 0.0, "interleaved": False}
    attrs = {k: attrs[k] for k in d.input_attrs}
    outputs = d.register_func(*descs, **attrs)
    combos = d.autotune_func(*descs, *attrs.values(), outputs)
    out[pid] = {"inputs": d.input_tensor_names, "fields": {k: t.__name__ for k, t in d.input_attrs.items()},
                "outputs": len(outputs), "has_impl": d.impl_func is not None, "has_aot": d.aot_impl_func is not None,
                "aliased": [descs.index(o.get_aliased()) if o.get_aliased() is not None else -1 for o in outputs],
                "types": combos[0].io_types}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def registered():
    if importlib.util.find_spec("tensorrt_bindings") is None:
        pytest.skip("tensorrt-cu13-bindings (TensorRT's QDP Python sources) is not installed: pip install '.[test]'")
    r = subprocess.run([sys.executable, "-c", REGISTER, str(Path(__file__).resolve().parents[1])], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_registrations_pass_tensorrt_validators(registered):
    """register/impl/aot_impl/autotune were accepted by TensorRT's validators for every plugin op; outputs and
    aliasing are as the op schema says (GroupedAttention updates the caches in place)."""
    assert sorted(registered) == sorted(spec.plugin_id(op) for op in spec.PLUGIN_OPS)
    for op in spec.PLUGIN_OPS:
        r = registered[spec.plugin_id(op)]
        assert r["has_impl"] and r["has_aot"], op
        assert r["outputs"] == len(spec.outputs(op))
        assert len(r["types"]) == len(r["inputs"]) + r["outputs"]
    attention = registered["llgraph::GroupedAttention"]
    assert attention["aliased"] == [-1, 4, 5]  # present_key -> past_key, present_value -> past_value
    assert attention["types"][3] == "INT64" and registered["llgraph::Rotary"]["types"][1:3] == ["FP32", "FP32"]


MOE = {"num_experts": 6, "top_k": 2, "intermediate_size": 48}


@pytest.mark.parametrize("cfg", [tiny(), tiny(num_kv_heads=1, rope={"layout": "interleaved", "rotary_dim": 8}),
                                 tiny(moe=MOE), tiny(moe=dict(MOE, bias=True, alpha=1.702, beta=1.0, limit=7.0))])
def test_plugin_nodes_carry_exactly_the_registered_fields(cfg, registered, tmp_path):
    """Every plugin node (a MoE's three ExpertMatMul a layer among them) has exactly its plugin's
    inputs, outputs and fields; each op used has its function, with the plugin's signature."""
    folder = export(model_graph(cfg), random_weights(cfg), get_target("trt"), tmp_path / "trt", max_positions=64)
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    plugin_nodes = [n for n in every_node(model.graph) if n.domain == spec.NAMESPACE]
    counts = {op: sum(n.op_type == op for n in plugin_nodes) for op in spec.PLUGIN_OPS}
    layers = cfg.num_layers
    mlp = {"SwiGLU": 0, "ExpertMatMul": 3 * layers} if cfg.moe else {"SwiGLU": layers, "ExpertMatMul": 0}
    assert counts == {"RMSNorm": 2 * layers + 1, "Rotary": 2 * layers, "GroupedAttention": layers, **mlp}
    for node in plugin_nodes:
        r = registered[spec.plugin_id(node.op_type)]
        attrs = {a.name: a for a in node.attribute}
        assert attrs.pop("plugin_namespace").s == b"llgraph" and attrs.pop("plugin_version").s == b"1"
        assert sorted(attrs) == sorted(r["fields"]), node.name  # fields travel by name (onnx sorts attributes)
        assert {k: a.type for k, a in attrs.items()} == {k: ONNX_TYPES[t] for k, t in r["fields"].items()}, node.name
        assert len(node.input) == len(r["inputs"]) and len(node.output) == r["outputs"], node.name
    functions = {f.name: f for f in model.functions}
    assert sorted(functions) == sorted(op for op, n in counts.items() if n)
    for op, f in functions.items():
        assert f.domain == spec.NAMESPACE and list(f.attribute) == list(registered[spec.plugin_id(op)]["fields"])
        assert list(f.input) == registered[spec.plugin_id(op)]["inputs"]
