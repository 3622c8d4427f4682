"""TensorRT itself, on the CPU-only machines this project is tested on: TensorRT-RTX's ONNX parser and builder
(ahead-of-time, no GPU) parse and build `trt` exports (fp16, bf16, fp32, int4 blocks) and an `onnx` export (fp16) of
SmolLM2's shapes (4 of its layers).
What is asserted is what TensorRT reports: the layers its parser made, the network's I/O, the profiles it holds.
A change that breaks the parse or the build fails here. Running an engine needs a GPU (tests/backends/test_trt.py)."""

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from reference import tiny

from llgraph.builder import cache_pairs, new_cache
from llgraph.config import LlamaConfig
from llgraph.export.trt_build import EngineError, configure, io_dtypes, load_tensorrt, parse

# On Linux x86-64 TensorRT-RTX is a test dependency: its absence fails rather than skips
ON_CI_PLATFORM = platform.system() == "Linux" and platform.machine() == "x86_64"
pytestmark = pytest.mark.skipif(not ON_CI_PLATFORM, reason="TensorRT-RTX wheels exist for Linux x86-64 only")
MAX_SEQ = 256


@pytest.fixture(scope="module")
def rtx():
    return load_tensorrt("rtx")


def trt_dtype(rtx, dtype: str):
    t = rtx.module.DataType
    return {"int64": t.INT64, "float32": t.FLOAT, "float16": t.HALF, "bfloat16": t.BF16}[dtype]


def check_network(rtx, folder, cfg, dtype):
    """Per decoder layer: 2 rotary layers (q, k), one attention, a KV-cache update feeding each present output; the
    network's I/O names and dtypes are exactly those TRTBackend binds; the cache length is static."""
    parsed = parse(folder, MAX_SEQ, rtx)
    t, net = rtx.module, parsed.network
    producer, counts = {}, {}
    for i in range(net.num_layers):
        layer = net.get_layer(i)
        counts[layer.type] = counts.get(layer.type, 0) + 1
        for k in range(layer.num_outputs):
            producer[layer.get_output(k).name] = layer.type
    L = cfg.num_layers
    assert counts.get(t.LayerType.ROTARY_EMBEDDING) == 2 * L
    assert counts.get(t.LayerType.ATTENTION_INPUT) == counts.get(t.LayerType.ATTENTION_OUTPUT) == L
    assert counts.get(t.LayerType.KV_CACHE_UPDATE) == 2 * L
    for _, present in cache_pairs(cfg):
        assert producer[present] == t.LayerType.KV_CACHE_UPDATE, present
    io = {net.get_input(i).name: net.get_input(i) for i in range(net.num_inputs)}
    io |= {net.get_output(i).name: net.get_output(i) for i in range(net.num_outputs)}
    want = io_dtypes(cfg, dtype)
    assert set(io) == set(want)
    for name, tensor in io.items():
        assert tensor.dtype == trt_dtype(rtx, want[name]), (name, tensor.dtype)
    for past, present in cache_pairs(cfg):
        assert tuple(io[past].shape) == tuple(io[present].shape) == (-1, cfg.num_kv_heads, MAX_SEQ, cfg.head_dim)
    return counts


CASES = [("trt", "float16", False), ("trt", "bfloat16", False), ("trt", "float32", False), ("onnx", "float16", False),
         ("trt", "float16", True)]  # the last: int4 blocks in the layers, int8 in the (tied) head, as blocked DQ
LAYERS = 4  # SmolLM2's shapes, its 30 layers cut to 4: every layer is built alike, and a build takes 1/6 the time


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An HF-style checkpoint of SmolLM2's config with LAYERS layers (random weights: TensorRT parses and builds
    the same network whatever the values)."""
    import dataclasses

    from reference import write_hf_checkpoint

    from llgraph.bundled import bundled_model
    from llgraph.checkpoint import load_config, random_weights

    smollm2 = load_config(bundled_model("smollm2"))  # an HF checkpoint: its RoPE pairs half-split
    cfg = dataclasses.replace(smollm2, num_layers=LAYERS, rope=dataclasses.replace(smollm2.rope, layout="half"))
    return write_hf_checkpoint(tmp_path_factory.mktemp("smollm2-4"), cfg, random_weights(cfg, seed=3))


@pytest.fixture(scope="module")
def built(checkpoint, tmp_path_factory):
    """Every case's engine, built by `llgraph build --tensorrt rtx` two at a time (a TensorRT-RTX build runs on one
    core): case -> (export folder, engine path, `llgraph build`'s result)."""
    from concurrent.futures import ThreadPoolExecutor

    from llgraph.export import export_model
    from llgraph.weight_request import Weights

    jobs = {}
    for case in CASES:
        weights = Weights(case[1], quantize="int4", lm_head="int8") if case[2] else Weights(case[1])
        folder = export_model(checkpoint, checkpoint=checkpoint, out=tmp_path_factory.mktemp("export") / case[0],
                              target=case[0], weights=weights, max_seq_len=MAX_SEQ)
        engine = tmp_path_factory.mktemp("engine") / "model.engine"
        jobs[case] = (folder, engine, ["build", str(folder), "-o", str(engine), "--tensorrt", "rtx",
                                       "--max-seq-len", str(MAX_SEQ), "--max-batch", "4"])
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(jobs, pool.map(lambda job: llgraph(*job[2]), jobs.values())))
    return {case: (folder, engine, results[case]) for case, (folder, engine, _) in jobs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("target, dtype, quantized", CASES)
def test_tensorrt_parses_and_builds_smollm2(target, dtype, quantized, rtx, built):
    folder, engine, result = built[(target, dtype, quantized)]
    cfg = LlamaConfig(**json.loads((folder / "manifest.json").read_text())["config"])
    counts = check_network(rtx, folder, cfg, dtype)
    if quantized:  # one weight-only dequantization per QLinear: 4 per layer + the lm head
        assert counts.get(rtx.module.LayerType.DEQUANTIZE) == 4 * cfg.num_layers + 1
    assert result.returncode == 0, result.stderr[-3000:]
    meta = json.loads((folder / "engine.json").read_text())
    kind = f"{target} {dtype}{' int4' if quantized else ''}"
    print(f"SmolLM2 shapes, {LAYERS} layers, {kind}: {rtx.name} built a {engine.stat().st_size / 2**20:.1f} MiB "
          f"engine in {meta['build_seconds']:.1f} s on the CPU ({sum(counts.values())} layers)")
    assert engine.stat().st_size == meta["engine_bytes"] and meta["flavor"] == "rtx" and meta["plugins"] == "none"
    # the profiles TensorRT holds == the shapes TRTBackend binds: caches from new_cache at batch 1 and max batch,
    # ids [batch, 1..max_seq_len] in prefill and [batch, 1] in decode
    prefill, decode = meta["profile_shapes"]
    for shapes in (prefill, decode):
        for batch, end in ((1, 0), (meta["max_batch"], 2)):
            for name, tensor in new_cache(cfg, batch, meta["max_seq_len"], lambda shape: shape).items():
                assert tuple(shapes[name][end]) == tuple(tensor)
    assert prefill["input_ids"][0] == [1, 1] and prefill["input_ids"][2] == [4, MAX_SEQ]
    assert decode["input_ids"] == [[1, 1], [1, 1], [4, 1]] and decode["position_ids"] == decode["input_ids"]


def llgraph(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llgraph", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_build_on_a_cpu_only_machine(tmp_path):
    """`llgraph export --target trt && llgraph build` with only TensorRT-RTX: exit 0, an engine and its record."""
    out = tmp_path / "tiny-trt"
    assert llgraph("export", "--config", "tiny", "--target", "trt", "--dtype", "fp32", "-o", str(out)).returncode == 0
    r = llgraph("build", str(out), "--tensorrt", "rtx", "--max-seq-len", "64")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "rtx" in r.stdout and "not Hopper" in r.stdout
    assert {"model.engine", "engine.json"} <= {p.name for p in out.iterdir()}
    assert not [p for p in out.iterdir() if ".partial" in p.name]


@pytest.mark.parametrize("args, message", [
    (["--max-seq-len", "4096"], "must be in 2..128 (the export's RoPE range)"),
    (["--plugins", "aot"], "cannot run llgraph's plugins"),
    (["--max-batch", "0"], "--max-batch (0) must be in 1..1024"),
])
def test_bad_build_requests_leave_nothing(args, message, tmp_path):
    from llgraph.export import export_model

    folder = export_model("tiny", out=tmp_path / "trt", target="trt", max_seq_len=128)
    before = sorted(p.name for p in folder.iterdir())
    r = llgraph("build", str(folder), "--tensorrt", "rtx", *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert sorted(p.name for p in folder.iterdir()) == before
    ort = export_model("tiny", out=tmp_path / "ort", target="ort")
    r = llgraph("build", str(ort), "--tensorrt", "rtx")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--target trt" in r.stderr
    assert not (ort / "model.engine").exists()
    r = llgraph("build", str(tmp_path / "missing"))
    assert r.returncode == 2 and "not an llgraph export folder" in r.stderr


def test_missing_tensorrt_names_both_installs(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_tensorrt(name, *a, **k):
        if name.startswith("tensorrt"):
            raise ImportError(f"No module named '{name}'")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_tensorrt)
    monkeypatch.setattr("importlib.import_module", lambda name: no_tensorrt(name))
    with pytest.raises(EngineError.__bases__[0], match="neither TensorRT nor TensorRT-RTX is installed") as e:
        load_tensorrt("auto")
    assert "pip install tensorrt " in str(e.value) and "tensorrt-rtx-cu12-libs" in str(e.value)


def test_parser_hands_every_plugin_node_to_its_creator(tmp_path):
    """With a creator registered for each llgraph plugin op, TensorRT-RTX's parser gives every plugin node to it
    with exactly its schema fields (names, values, types). Run in a subprocess (tests/trt_plugin_probe.py)."""
    from llgraph.export import export_model
    from llgraph.passes import model_graph
    from llgraph.plugins.tensorrt import spec

    cfg_name = "tiny"
    folder = export_model(cfg_name, out=tmp_path / "trt", target="trt", max_seq_len=64)
    probe = Path(__file__).resolve().parents[1] / "trt_plugin_probe.py"
    r = subprocess.run([sys.executable, str(probe), str(folder), "64"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    seen = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    from llgraph.checkpoint import load_config
    graph = model_graph(load_config(cfg_name))
    want = [n for n in graph.nodes if n.op in spec.PLUGIN_OPS]
    assert len(seen) == len(want) > 0
    kinds = {float: "FLOAT32", int: "INT32", bool: "INT32"}
    for node, got in zip(want, seen):
        assert got["op"] == node.op and got["node"].rsplit("/", 1)[0] == node.name, (node.name, got)
        assert list(got["fields"]) == list(spec.fields(node.op)), (node.name, got)
        for name, kind in spec.fields(node.op).items():
            ftype, value = got["fields"][name]
            assert ftype == kinds[kind], (node.name, name, ftype)
            exact = float(node.attrs[name]) if kind is not float else pytest.approx(node.attrs[name], rel=1e-7)
            assert value == exact, (node.name, name, value)  # floats travel as float32
    print(f"{len(seen)} plugin nodes reached their creators with their schema fields: "
          f"{sorted({s['op'] for s in seen})}")


def test_parser_hands_a_mixtures_expert_products_to_their_creator(tmp_path):
    """A MoE's ExpertMatMul plugin nodes, three a layer after the grouping of the pairs by expert (export/trt.py's
    moe): TensorRT-RTX's parser imports the grouping's nodes, reaches each plugin node and hands it to the creator
    with the grouping as its inputs."""
    from llgraph.checkpoint import random_weights
    from llgraph.export import get_target
    from llgraph.export.lower import export
    from llgraph.passes import model_graph

    cfg = tiny(moe={"num_experts": 6, "top_k": 2, "intermediate_size": 48})
    folder = export(model_graph(cfg), random_weights(cfg), get_target("trt"), tmp_path / "trt", max_positions=64)
    probe = Path(__file__).resolve().parents[1] / "trt_plugin_probe.py"
    r = subprocess.run([sys.executable, str(probe), str(folder), "64"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    seen = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    ops = [s["op"] for s in seen]
    layers = cfg.num_layers
    assert {op: ops.count(op) for op in set(ops)} == {"RMSNorm": 2 * layers + 1, "Rotary": 2 * layers,
                                                      "GroupedAttention": layers, "ExpertMatMul": 3 * layers}
    assert all(s["fields"] == {} for s in seen if s["op"] == "ExpertMatMul")


def test_plugin_builds_turn_on_aliased_plugin_io(rtx):
    """TensorRT honours GroupedAttention's present->past alias only with PreviewFeature ALIASED_PLUGIN_IO_10_03 on;
    a plugin build turns it on, a native build leaves TensorRT's default. Checked on TensorRT-RTX's real config."""
    t = rtx.module
    feature = t.PreviewFeature.ALIASED_PLUGIN_IO_10_03
    builder = t.Builder(t.Logger(t.Logger.ERROR))
    default = builder.create_builder_config().get_preview_feature(feature)
    for plugins in ("aot", "jit"):
        assert configure(builder.create_builder_config(), rtx, "float16", plugins).get_preview_feature(feature)
    assert configure(builder.create_builder_config(), rtx, "float16", "none").get_preview_feature(feature) == default


def test_a_native_build_ignores_registered_plugin_creators(tmp_path):
    """`--plugins none` in a process that registered creators for llgraph's ops: the parser imports every node's
    function body and hands none to a creator (tests/trt_plugin_probe.py --none, with TensorRT-RTX)."""
    from llgraph.export import export_model

    folder = export_model("tiny", out=tmp_path / "trt", target="trt", max_seq_len=64)
    probe = Path(__file__).resolve().parents[1] / "trt_plugin_probe.py"
    r = subprocess.run([sys.executable, str(probe), str(folder), "64", "--none"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "llgraph's parse with --plugins none: 0 nodes reached a creator" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("family", ["gemma2-nocap", "qwen3", "olmo2", "mistral-window", "gemma2", "qwen3_moe"])
def test_tensorrt_builds_the_families(family, tmp_path):
    """TensorRT-RTX parses and builds each family's variant IR: windows in the attention body, GeGLU, SoftCap,
    grouped (per-head) RMSNorm, sandwich and post norms, scaled embeddings, routed experts (TopK, ScatterElements,
    batched MatMuls). Attention soft-capping is what
    TensorRT's own attention layer lacks: that build is refused in one line, naming the plugin path."""
    from test_families import hf_checkpoint

    from llgraph.export import export_model

    if family == "gemma2-nocap":  # all of Gemma 2 that TensorRT's own layers express
        hf_checkpoint("gemma2", tmp_path / "hf", attn_logit_softcapping=None)
    else:
        hf_checkpoint(family, tmp_path / "hf")
    folder = export_model(tmp_path / "hf", checkpoint=tmp_path / "hf", out=tmp_path / "trt", target="trt",
                          max_seq_len=64)
    r = llgraph("build", str(folder), "--tensorrt", "rtx", "--max-seq-len", "64", "--max-batch", "2")
    if family == "gemma2":
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "soft-caps its attention logits" in r.stderr
        assert not (folder / "model.engine").exists()
        return
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((folder / "engine.json").read_text())
    print(f"{family}: {meta['flavor']} built a {meta['engine_bytes'] / 2**10:.0f} KiB engine in "
          f"{meta['build_seconds']:.1f} s")


def test_tensorrt_builds_the_grouping_of_pairs_by_expert(rtx):
    """export/expert_schedule.py's nodes (int64 one-hot, CumSum, GatherElements, ScatterElements, Range; no TopK,
    no size from values) are TensorRT layers: TensorRT-RTX parses and builds them alone for 1 to 512 tokens of
    Qwen3-30B-A3B's router (8 of 128 experts) — what a `trt` export's mixture runs before its ExpertMatMuls."""
    from llgraph.export.expert_schedule import model
    from llgraph.export.trt_build import trt_logger

    t = rtx.module
    logger = trt_logger(rtx)
    builder = t.Builder(logger)
    network = builder.create_network(0)
    parser = t.OnnxParser(network, logger)
    assert parser.parse(model(128, 32).SerializeToString()), parser.get_error(0)
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("chosen", (1, 8), (64, 8), (512, 8))
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    assert engine is not None and engine.nbytes > 0
    kinds = sorted({str(network.get_layer(i).type).split(".")[-1] for i in range(network.num_layers)})
    print(f"{network.num_layers} layers ({', '.join(kinds)}), engine {engine.nbytes / 2**10:.0f} KiB")


def test_a_trt_export_runs_the_pairs_grouped_by_expert_at_every_step(tmp_path):
    """A `trt` export's mixture has no If (export/trt.py's moe): each layer's three ExpertMatMul nodes read one
    grouping of the pairs by expert, and ONNX Runtime running it (the plugins' function bodies: batched MatMuls over
    the runs) gives a 9-token prefill and decode steps the logits of the `onnx` export, whose If runs every expert for
    that prefill and gathers each pair's matrix for a step. A build of either kind keeps it as it is."""
    import numpy as np
    import onnx
    import torch
    from reference import OrtStepper
    from test_families import hf_checkpoint

    from llgraph.checkpoint import load_config
    from llgraph.export import export_model
    from llgraph.export.trt_network import for_build

    hf_checkpoint("qwen3_moe", tmp_path / "hf")
    cfg = load_config(tmp_path / "hf")
    folders = {target: export_model(tmp_path / "hf", checkpoint=tmp_path / "hf", out=tmp_path / target,
                                    target=target, max_seq_len=64) for target in ("trt", "onnx")}
    model = onnx.load(str(folders["trt"] / "model.onnx"), load_external_data=False)
    assert not any(n.op_type == "If" for n in model.graph.node)
    products = [n for n in model.graph.node if n.op_type == "ExpertMatMul"]
    assert len(products) == 3 * cfg.num_layers and len({tuple(n.input[3:]) for n in products}) == cfg.num_layers
    for plugins, flavor in (("aot", "tensorrt"), ("none", "rtx")):
        built = onnx.load(str(folders["trt"] / "model.onnx"), load_external_data=False)
        for_build(built, 64, plugins, flavor)
        assert sum(n.op_type == "ExpertMatMul" for n in built.graph.node) == len(products)
    steppers = [OrtStepper(folders[t], cfg, batch=1, max_seq=64) for t in ("trt", "onnx")]
    for ids in (np.arange(9).reshape(1, 9) % cfg.vocab_size, np.array([[3]]), np.array([[7]])):  # 9 * k > experts
        a, b = (s.step(torch.tensor(ids))["logits"] for s in steppers)
        print(f"{ids.shape[1]} tokens: max|diff| {float((a - b).abs().max()):.2e} (tol 1e-5)")
        assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())
