"""ONNX export: both targets pass onnx.checker (full) and shape inference, carry metadata and traceable names, and
ONNX Runtime CPU matches the PyTorch executor at prefill and 8 decode steps (fp32, max |diff| <= 1e-4)."""

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import max_diff
from reference import OrtStepper, Stepper, tiny

from llgraph.checkpoint import random_weights
from llgraph.errors import ExportError
from llgraph.export import TARGETS, export_model
from llgraph.export.lower import export
from llgraph.outdir import OutputError
from llgraph.passes import model_graph
from llgraph.weight_request import Weights

TOL = 1e-4
CONFIGS = {
    "gqa": tiny(),
    "mqa-tied": tiny(num_kv_heads=1, tie_word_embeddings=True),
    "mha-bias": tiny(num_kv_heads=4, attention_bias=True, mlp_bias=True),
    "head_dim!=hidden/heads": tiny(head_dim=32),
    "interleaved": tiny(rope={"layout": "interleaved"}),
    "yarn": tiny(rope={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "llama3": tiny(rope={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32}),
    "dynamic": tiny(max_position_embeddings=12, rope={"type": "dynamic", "factor": 2.0}),
    "partial-rotary": tiny(rope={"rotary_dim": 8}),
    "parallel-block": tiny(parallel_block=True),  # wiring only: every backend runs it with no op of its own
}


def export_tiny(cfg, target, path, seed=3):
    source = random_weights(cfg, seed=seed, std=0.25)
    graph = model_graph(cfg)
    return export(graph, source, _target(target), path / target, max_positions=128), source


def _target(name):
    from llgraph.export import get_target
    return get_target(name)


def compare_steps(cfg, ours, theirs, report, what, batch=2, prompt_len=7, steps=8, tol=None):
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len))
    worst_logits = worst_cache = 0.0
    for _ in range(steps + 1):
        a, b = ours.step(ids), theirs.step(ids)
        worst_logits = max(worst_logits, max_diff(a["logits"], b["logits"]))
        for i in range(cfg.num_layers):
            for kv in ("key", "value"):
                worst_cache = max(worst_cache, max_diff(a[f"present.{i}.{kv}"], b[f"present.{i}.{kv}"]))
        ids = a["logits"][:, -1:].argmax(-1)
    report(f"{what} logits", worst_logits, tol or TOL)
    report(f"{what} present caches", worst_cache, tol or TOL)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_onnxruntime_matches_executor(name, target, tmp_path, report):
    cfg = CONFIGS[name]
    folder, source = export_tiny(cfg, target, tmp_path)
    compare_steps(cfg, Stepper(cfg, source, batch=2), OrtStepper(folder, cfg, batch=2), report, f"{target}/{name}")


@pytest.mark.parametrize("target", TARGETS)
def test_checker_shape_inference_and_metadata(target, tmp_path):
    cfg = tiny()
    folder, _ = export_tiny(cfg, target, tmp_path)
    path = str(folder / "model.onnx")
    onnx.checker.check_model(path, full_check=True)
    onnx.shape_inference.infer_shapes_path(path, str(tmp_path / "inferred.onnx"), strict_mode=True)
    model = onnx.load(path, load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["target"] == target and meta["dtype"] == "float32" and json.loads(meta["config"])["name"] == cfg.name
    names = [i.name for i in model.graph.input]
    assert names[:4] == ["input_ids", "position_ids", "past_key_values.0.key", "past_key_values.0.value"]
    assert [o.name for o in model.graph.output][:3] == ["logits", "present.0.key", "present.0.value"]
    dims = [d.dim_param or d.dim_value for d in model.graph.input[2].type.tensor_type.shape.dim]
    rows = "cache_rows" if target == "trt" else "batch"  # trt: ragged rows by slot id, any number of cache rows
    assert dims == [rows, cfg.num_kv_heads, "max_seq", cfg.head_dim]
    values = {o for n in model.graph.node for o in n.output}
    assert {"layers.0.attn_norm", "layers.1.mlp_out", "final_norm", "embed"} <= values  # IR names, traceable
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer if t.dims and
               t.dims[0] > 64)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["target"] == target and manifest["data"] == "model.onnx.data"


def test_ort_target_fuses_attention_and_norms(tmp_path):
    folder, _ = export_tiny(tiny(), "ort", tmp_path)
    ops = [n.op_type for n in onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count("GroupQueryAttention") == 2 and "RotaryEmbedding" not in ops
    assert ops.count("RMSNormalization") == 6  # 2 per layer, the final one, and the hidden states' (embeddings)
    assert ops.count("MatMul") == 2 * 2 + 2 * 2 + 1  # per layer: qkv, o, gate_up, down; plus lm_head


def test_ort_target_computes_logits_for_the_positions_asked_only(tmp_path, report):
    """`logits_to_keep` (passes.keep_last_positions): the ort graph slices the hidden state before the final norm
    and the head. Each keep's logits equal the last rows of the executor's on the unsliced graph; a caller that
    does not feed the input (onnxruntime-genai) gets every position from its initializer 0."""
    from llgraph.passes import KEEP_INPUT, keep_last_positions
    from llgraph.runtime.backends.ort import OrtBackend
    from llgraph.runtime.backends.pytorch import TorchBackend

    cfg = tiny()
    folder, source = export_tiny(cfg, "ort", tmp_path)
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    assert KEEP_INPUT in [i.name for i in model.graph.input] and KEEP_INPUT in [t.name for t in model.graph.initializer]
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(7).expand(2, 7)
    reference = TorchBackend(cfg, source, max_seq_len=64)
    sliced = TorchBackend(cfg, source, max_seq_len=64, graph=keep_last_positions(model_graph(cfg)))
    ort = OrtBackend(folder, max_seq_len=64)
    reference.allocate(2, zeroed=True)
    full = reference.forward(ids, pos)
    worst = 0.0
    for keep, rows in ((0, 7), (1, 1), (3, 3), (7, 7), (99, 7)):
        for backend in (ort, sliced):
            backend.allocate(2, zeroed=True)
            logits = backend.forward(ids, pos, keep=keep)
            assert logits.shape == (2, rows, cfg.vocab_size), (type(backend).__name__, keep)
            worst = max(worst, max_diff(logits, full[:, 7 - rows:]))
    report("kept logits vs the executor's last rows", worst, TOL)


@pytest.mark.parametrize("kwargs, message", [
    (dict(target="tensorrt"), "unknown target 'tensorrt'"),
    (dict(dtype="fp8"), "unknown dtype 'fp8'"),
    (dict(max_seq_len=0), "--max-seq-len (0) must be a positive"),
])
def test_bad_requests_fail_before_writing(tmp_path, kwargs, message):
    with pytest.raises(ExportError, match=message.replace("(", r"\(").replace(")", r"\)")):
        weights = Weights(**{k: kwargs.pop(k) for k in ("dtype",) if k in kwargs})
        export_model("tiny", out=tmp_path / "out", weights=weights, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for force in (False, True):  # a folder llgraph did not write is never replaced (tests/export/test_outputs.py)
        with pytest.raises(OutputError, match="exists and is not empty"):
            export_model("tiny", out=out, force=force)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("target", ["ort", "onnx"])
def test_large_matrices_stream_by_rows_into_the_same_bytes(target, tmp_path, monkeypatch):
    """A matrix past CHUNK_BYTES whose source reads rows alone (random weights, safetensors) is never loaded whole:
    written a block of rows at a time, transposed ones (MatMul's [in, out]) scattered into place. Lowering the
    threshold streams every such matrix of the tiny model; the export must be byte-identical."""
    import llgraph.export.lower as lower
    from llgraph.source_views import QuantizedSource

    cfg = tiny()
    whole = export_model("tiny", out=tmp_path / "whole", target=target)
    streamed_calls = []
    original = lower.Emitter._write_rows
    monkeypatch.setattr(lower.Emitter, "_write_rows", lambda self, *a: streamed_calls.append(a[-1]) or
                        original(self, *a))
    monkeypatch.setattr(lower, "CHUNK_BYTES", 1024)
    streamed = export_model("tiny", out=tmp_path / "streamed", target=target)
    assert True in streamed_calls and False in streamed_calls  # transposed Linears and the embedding table
    for name in ("model.onnx", "model.onnx.data"):
        assert (whole / name).read_bytes() == (streamed / name).read_bytes()
    source = random_weights(cfg, seed=0)  # rows drawn alone == the same rows of the whole tensor
    assert np.array_equal(source.load_rows("lm_head.weight", 13, 60), source.load("lm_head.weight")[13:60])
    rtn = QuantizedSource(source, 4)  # RTN passes float rows through; its quantized Linears are not rows
    assert rtn.load_rows("lm_head.weight", 0, 2) is not None
    assert rtn.load_rows("model.layers.0.mlp.down_proj.weight", 0, 2) is None


def test_checkpoint_that_does_not_fit_leaves_no_output(tmp_path):
    from safetensors.numpy import save_file

    source = random_weights(tiny(), seed=1)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({n: source.load(n) for n in source.names()}, str(ckpt / "model.safetensors"))
    from llgraph.weights import WeightError
    with pytest.raises(WeightError, match="does not fit config"):
        export_model("smollm2-135m", checkpoint=ckpt, out=tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_unwritable_output(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OutputError, match="cannot write to"):
        export_model("tiny", out=blocker / "sub" / "out")


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_smollm2_onnxruntime_matches_executor(target, smollm2_export, smollm2_truth, report):
    cfg, truth = smollm2_truth
    folder = smollm2_export(target)
    onnx.checker.check_model(str(folder / "model.onnx"), full_check=True)
    # Reference: the executor in float64. Two fp32 implementations each sit ~6e-5 from it on this 30-layer model
    # (logits ~30), so fp32-vs-fp32 would double-count rounding; each is held to 1e-4 of the truth instead.
    compare_steps(cfg, truth.session(), OrtStepper(folder, cfg, max_seq=64), report,
                  f"SmolLM2 {target} vs float64 executor",
                  batch=1, prompt_len=12)


@pytest.mark.slow
def test_smollm2_fp32_executor_vs_float64(report):
    """The fp32 reference's own rounding, for scale: the ONNX Runtime errors above are of the same size."""
    from llgraph.bundled import bundled_model
    from llgraph.checkpoint import load_config
    from llgraph.gguf_source import GGUFSource

    path = bundled_model("smollm2")
    cfg, source = load_config(path), GGUFSource(path)
    compare_steps(cfg, Stepper(cfg, source, max_seq=64, dtype="float64"), Stepper(cfg, source, max_seq=64), report,
                  "SmolLM2 fp32 executor vs float64 executor", batch=1, prompt_len=12)


LOADER = '''
import numpy as np
def load_data():
    positions = np.arange(5, dtype=np.int64)[None]
    feeds = {"input_ids": positions % VOCAB, "position_ids": positions}
    for i in range(LAYERS):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((1, KV_HEADS, 16, HEAD_DIM), np.float32)
    yield feeds
'''


@pytest.mark.parametrize("target", TARGETS)
def test_polygraphy_lint_reports_no_errors(target, tmp_path):
    """polygraphy lint runs the model, so it gets valid inputs (positions 0..4 in a 16-slot cache)."""
    import shutil
    import subprocess

    cfg = tiny()
    folder, _ = export_tiny(cfg, target, tmp_path)
    loader = tmp_path / "loader.py"
    loader.write_text(LOADER.replace("VOCAB", str(cfg.vocab_size)).replace("LAYERS", str(cfg.num_layers))
                      .replace("KV_HEADS", str(cfg.num_kv_heads)).replace("HEAD_DIM", str(cfg.head_dim)))
    report_path = tmp_path / "lint.json"
    beside = Path(sys.executable).with_name("polygraphy")  # this interpreter's, activated or not
    r = subprocess.run([str(beside) if beside.exists() else shutil.which("polygraphy"), "check", "lint",
                        str(folder / "model.onnx"),
                        "--data-loader-script", str(loader), "-o", str(report_path)], capture_output=True, text=True)
    report = json.loads(report_path.read_text())
    errors = [e for e in report["lint_entries"] if e["level"] in ("exception", "error")]
    print(f"{target}: lint {len(report['summary']['passing'])} nodes passing, {len(errors)} errors")
    assert r.returncode == 0 and not errors and not report["summary"]["failing"], r.stdout[-2000:]


@pytest.mark.parametrize("target", TARGETS)
def test_half_precision_exports(target, tmp_path, report):
    """fp16 runs in ONNX Runtime CPU and is as accurate as the executor in fp16: against the float64 executor, its
    error is at most twice the fp16 executor's own (+1e-3). (An absolute 1e-2 between two fp16 implementations is
    ~2.5 ulp at |logits| ~7: rounding, not disagreement.) bf16 passes the checker and shape inference; ONNX
    Runtime's CPU provider has no bf16 MatMul, so running it is left to GPU runtimes."""
    import numpy as np
    import onnxruntime as ort

    cfg = tiny()
    source = random_weights(cfg, seed=3, std=0.25)
    for dtype in ("float16", "bfloat16"):
        graph = model_graph(cfg, dtype)
        folder = export(graph, source, _target(target), tmp_path / dtype, max_positions=128)
        onnx.checker.check_model(str(folder / "model.onnx"), full_check=True)
        onnx.shape_inference.infer_shapes_path(str(folder / "model.onnx"), str(tmp_path / f"{dtype}.onnx"),
                                               strict_mode=True)
    ids = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    ours = Stepper(cfg, source, dtype="float16").step(ids)["logits"]
    session = ort.InferenceSession(str(tmp_path / "float16" / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids.numpy(), "position_ids": np.arange(7)[None]}
    for i in range(cfg.num_layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((1, cfg.num_kv_heads, 16, cfg.head_dim), np.float16)
    theirs = torch.from_numpy(session.run(["logits"], feeds)[0])
    truth = Stepper(cfg, source, dtype="float64").step(ids)["logits"]
    own = max_diff(ours, truth)
    print(f"fp16 executor vs float64: {own:.3e}; |logits| up to {truth.abs().max():.1f}")
    report(f"{target} fp16 ORT vs float64 executor", max_diff(theirs, truth), 2 * own + 1e-3)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("rows", [1, 3])
def test_expert_matmul_alone_on_every_target(target, rows, tmp_path, report):
    """ops.py's ExpertMatMul as an IR node of its own (MoE lowers to it; here nothing else is around it), on every
    ONNX target — the trt target's plugin node through its function body — against the executor: one row a token
    for its k experts (gate, up), or one each (down); tokens choose overlapping experts."""
    from llgraph.executor import TORCH_IMPLS
    from llgraph.export import get_target
    from llgraph.export.lower import lower
    from llgraph.ir import GraphBuilder
    from llgraph.weights import RandomSource, param_shapes

    b = GraphBuilder()
    x, chosen = b.input("x", "float32", ("tokens", rows, 24)), b.input("chosen", "int64", ("tokens", 3))
    b.add("ExpertMatMul", (x, b.param("experts", "float32", (5, 24, 20)), chosen), ("y",))
    b.output("y")
    graph = b.build({"config": json.dumps({"name": "one op", "tie_word_embeddings": False,
                                           "rope": {"layout": "half"}})})  # what the weights check reads
    source = RandomSource(param_shapes(graph), seed=4, std=0.5)
    (tmp_path / "out").mkdir()
    lower(graph, source, get_target(target), tmp_path / "out", max_positions=0, metadata={})
    import onnxruntime as ort

    session = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    feed = {"x": np.random.default_rng(0).standard_normal((4, rows, 24), dtype=np.float32),
            "chosen": np.array([[0, 4, 2], [4, 1, 0], [3, 2, 1], [2, 3, 4]], dtype=np.int64)}
    (got,) = session.run(None, feed)
    (want,) = TORCH_IMPLS["ExpertMatMul"](graph.nodes[0], torch.from_numpy(feed["x"]),
                                          torch.from_numpy(source.load("experts")), torch.from_numpy(feed["chosen"]))
    assert got.shape == (4, 3, 20)
    report(f"ExpertMatMul on {target}, {rows} row(s) a token", max_diff(torch.from_numpy(got), want), 1e-5)
