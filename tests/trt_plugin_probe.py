"""Which creator does TensorRT's ONNX parser hand each llgraph plugin node to, with which fields?

    python tests/trt_plugin_probe.py EXPORT_FOLDER MAX_SEQ      # prints one JSON line per plugin node
    python tests/trt_plugin_probe.py EXPORT_FOLDER MAX_SEQ --none   # llgraph's parse(plugins="none") instead

Run in a subprocess by tests/export/test_trt_build.py. A creator is registered with TensorRT-RTX's plugin registry for
every llgraph plugin op; it records the node's name and fields and declines to build a plugin (a Python plugin object
aborts TensorRT-RTX's process), which stops the parse at that node. The next parse strips `plugin_namespace` from the
nodes already seen, so the parser imports their function bodies and reaches the next plugin node; the last parse,
with every node seen, succeeds through the bodies alone.
"""

import json
import sys

import onnx

from llgraph.export.trt_build import load_tensorrt
from llgraph.export.trt_network import every_node
from llgraph.plugins.tensorrt import spec

trt = load_tensorrt("rtx").module
folder, max_seq = sys.argv[1], int(sys.argv[2])
seen: list[dict] = []


class Recorder(trt.IPluginCreatorV3One):
    def __init__(self, op):
        trt.IPluginCreatorV3One.__init__(self)
        self.name, self.plugin_namespace, self.plugin_version = op, spec.NAMESPACE, spec.VERSION
        self.field_names = trt.PluginFieldCollection([trt.PluginField(n) for n in spec.fields(op)])

    def create_plugin(self, name, fields, phase):
        seen.append({"op": self.name, "node": name, "fields": {
            f.name: [str(f.type).rsplit(".", 1)[-1], float(f.data.reshape(-1)[0])] for f in fields}})
        return None


registry = trt.get_plugin_registry()
creators = [Recorder(op) for op in spec.PLUGIN_OPS]  # kept alive for the registry
for c in creators:
    assert registry.register_creator(c, spec.NAMESPACE), c.name
if sys.argv[3:] == ["--none"]:
    from llgraph.export.trt_build import TensorRT, parse

    parsed = parse(folder, max_seq, TensorRT(trt, "rtx"), plugins="none")
    print(f"llgraph's parse with --plugins none: {len(seen)} nodes reached a creator; "
          f"{parsed.network.num_layers} layers", file=sys.stderr)
    sys.exit(0 if not seen else 1)
model = onnx.load(f"{folder}/model.onnx", load_external_data=False)
for v in (*model.graph.input, *model.graph.output):
    for d in v.type.tensor_type.shape.dim:
        if d.dim_param == "max_seq":
            d.dim_value = max_seq

plugin_nodes = [n for n in every_node(model.graph) if n.op_type in spec.PLUGIN_OPS]
logger = trt.Logger(trt.Logger.INTERNAL_ERROR)
for attempt in range(len(plugin_nodes) + 1):
    done = {s["node"] for s in seen}
    for node in plugin_nodes:
        if node.name in done:
            kept = [a for a in node.attribute if a.name != "plugin_namespace"]
            del node.attribute[:]
            node.attribute.extend(kept)
    network = trt.Builder(logger).create_network(0)
    parser = trt.OnnxParser(network, logger)
    ok = parser.parse(model.SerializeToString(), f"{folder}/model.onnx")
    if ok:
        break
    assert len(seen) == attempt + 1, f"parse {attempt} failed without reaching a creator: {parser.get_error(0)}"
print(f"parses: {attempt + 1}; the last, with every plugin node seen, parsed through the function bodies: {ok}",
      file=sys.stderr)
assert ok and len(seen) == len(plugin_nodes)
for s in seen:
    print(json.dumps(s))
