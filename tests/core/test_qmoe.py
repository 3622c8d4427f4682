"""A mixture of experts from a GGUF whose experts are K-quant super-blocks (tests/kquant_moe.py: Q4_K, Q5_K and Q6_K,
as a Q4_K_M file stores them) runs as ops.py's QMoE: the executor dequantizes each chosen expert, llgraph's CPU
kernels read the experts as stored (plugins/cpu/moe.inc), ONNX Runtime's own ops and standard ONNX read them
dequantized — every one held to float64 on the file's float twin (its experts dequantized by gguf itself)."""

import subprocess
import sys

import onnx
import pytest
import torch
from kquant_moe import FORMATS, write
from reference import OrtStepper, Stepper, finish_gguf
from test_export import compare_steps

from llgraph.checkpoint import load_config, open_model
from llgraph.export import export_model, get_target
from llgraph.export.lower import export
from llgraph.gguf_source import GGUFSource
from llgraph.grid_superblocks import AS_SUPERBLOCKS
from llgraph.weight_request import Weights

TOL = 1e-4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kquant_moe")
    return write(folder / "q.gguf"), write(folder / "f.gguf", dequantized=True)


def truth(cfg, files):
    return Stepper(cfg, GGUFSource(files[1]), batch=2, max_seq=64, dtype="float64")


def test_the_graph_carries_the_experts_as_stored(files, tmp_path):
    """One QMoE a layer in the file's formats; the export on llgraph's kernels holds the experts' super-blocks
    byte for byte (as many bytes as the GGUF's expert tensors) in one llgraph::MoE node a layer, and says nothing
    of widening; ONNX Runtime's own ops widen them, with one line saying so."""
    q, _ = files
    model = open_model(q, q)
    found = [(n.attrs["format"], n.attrs["down_format"]) for n in model.graph.nodes if n.op == "QMoE"]
    assert found == FORMATS and not any(n.op == "MoE" for n in model.graph.nodes)
    out = subprocess.run([sys.executable, "-m", "llgraph", "export", "--checkpoint", str(q), "-o",
                          str(tmp_path / "ort"), "--kernels", "llgraph", "--max-seq-len", "64"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "widened" not in out.stderr, out.stderr
    graph = onnx.load(str(tmp_path / "ort" / "model.onnx"), load_external_data=False).graph
    moe = [n for n in graph.node if n.op_type == "MoE"]
    assert len(moe) == len(FORMATS) and all(n.domain == "llgraph" for n in moe)
    sizes = {i.name: int(next(e.value for e in i.external_data if e.key == "length")) for i in graph.initializer
             if i.data_location == onnx.TensorProto.EXTERNAL}
    carried = sum(sizes[name] for n in moe for name in n.input[2:4])
    stored = sum(GGUFSource(q).stored_bytes(name) for name in GGUFSource(q).names() if ".experts." in name)
    print(f"expert initializers {carried} B; the GGUF's expert tensors {stored} B")
    assert carried == stored
    std = subprocess.run([sys.executable, "-m", "llgraph", "export", "--checkpoint", str(q), "-o",
                          str(tmp_path / "std"), "--kernels", "standard", "--max-seq-len", "64"],
                         capture_output=True, text=True)
    notes = [line for line in std.stderr.splitlines() if "widened to float32" in line]
    assert std.returncode == 0 and len(notes) == 1 and "Q4_K/Q5_K/Q6_K" in notes[0], std.stderr


def test_the_executor_dequantizes_as_gguf_does(files, report):
    q, f = files
    cfg = load_config(q)
    ours = Stepper(cfg, GGUFSource(q), batch=2, max_seq=64, graph=open_model(q, q).graph)
    compare_steps(cfg, truth(cfg, files), ours, report, "QMoE on the executor vs float64 of gguf's experts", tol=TOL)


@pytest.mark.parametrize("kernels", ["llgraph", "standard"])
def test_onnx_runtime_runs_the_experts(files, kernels, tmp_path, report):
    """llgraph's kernels exact (level 0) and ONNX Runtime's MoE op on the dequantized experts, within TOL of
    float64; llgraph's level 4 (int8 activations, its default for a K-quant file) bounded by its own rounding."""
    q, _ = files
    cfg = load_config(q)
    levels = (0, 4) if kernels == "llgraph" else (None,)
    for level in levels:
        folder = export_model(q, checkpoint=q, out=tmp_path / f"{kernels}{level}", max_seq_len=64,
                              weights=Weights(kernels=kernels, accuracy_level=level))
        compare_steps(cfg, truth(cfg, files), OrtStepper(folder, cfg, batch=2, max_seq=64), report,
                      f"ort {kernels} level {level}", tol=TOL if level != 4 else 0.1)


@pytest.mark.parametrize("target", ["onnx", "trt"])
def test_the_standard_lowering_dequantizes_the_experts(files, target, tmp_path, report):
    """QMoE through export/onnx_moe.py's decomposition (what the onnx and trt targets run), the graph taken as the
    executor runs it, checked by ONNX Runtime (decode steps on the chosen experts, the prefill on all): the onnx
    export's If gathers the chosen experts' matrices for few tokens and runs every expert for many; the trt export
    has no If, its ExpertMatMul plugin nodes take the pairs grouped by expert at every step (ONNX Runtime runs their
    function bodies: batched MatMuls over the runs)."""
    q, _ = files
    model = open_model(q, q)
    folder = export(model.graph, model.source, get_target(target), tmp_path / target, max_positions=64)
    onnx.checker.check_model(str(folder / "model.onnx"))
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    branches = [n for n in graph.node if n.op_type == "If"]
    if target == "onnx":  # an If a layer, its then-branch gathering each token's k experts (decode here: N * k =
        # 2 * 2 <= 8 experts), its else-branch every expert (the 7-token prefill: 28 > 8)
        assert len(branches) == model.config.num_layers
        for n in branches:
            then = next(a.g for a in n.attribute if a.name == "then_branch")
            assert [m.op_type for m in then.node if m.op_type in ("Gather", "ExpertMatMul")] == ["Gather"] * 3
    else:  # three plugin nodes a layer on one grouping of the pairs by expert (export/expert_schedule.py)
        products = [m for m in graph.node if m.op_type == "ExpertMatMul"]
        assert not branches and len(products) == 3 * model.config.num_layers
        assert len({tuple(m.input[3:]) for m in products}) == model.config.num_layers
    compare_steps(model.config, truth(model.config, files), OrtStepper(folder, model.config, batch=2, max_seq=64),
                  report, f"{target} QMoE", tol=TOL)


@pytest.mark.parametrize("kind, backend", [("IQ3_XXS", "torch"), ("IQ3_XXS", "ort-llgraph"),
                                           ("IQ3_XXS", "ort-standard"), ("IQ3_S", "ort-llgraph")])
def test_iq3_experts_run_as_superblocks(tmp_path, kind, backend, capfd, report):
    """Experts stored as IQ3_XXS or IQ3_S (as the small files of 30B mixtures store many) are carried as the Q6_K or
    Q5_K super-blocks whose weights they are (llgraph/grid_superblocks.py), not widened to float; one line says so;
    the executor, llgraph's kernels (exact) and ONNX Runtime's MoE op (on them widened, as on any K-quant experts)
    match float64 of gguf's dequantization."""
    target = AS_SUPERBLOCKS[kind]
    formats = [(kind, kind), ("Q4_K", kind)]
    q, f = write(tmp_path / "q.gguf", formats=formats), write(tmp_path / "f.gguf", dequantized=True, formats=formats)
    cfg = load_config(q)
    export, _, kernels = backend.partition("-")
    weights = Weights(kernels=kernels or "auto", accuracy_level=0 if kernels == "llgraph" else None)
    model = open_model(q, q, weights)
    found = [(n.attrs["format"], n.attrs["down_format"]) for n in model.graph.nodes if n.op == "QMoE"]
    assert found == [(target, target), ("Q4_K", target)], found
    if backend == "torch":
        ours = Stepper(cfg, GGUFSource(q), batch=2, max_seq=64, graph=model.graph)
    else:
        ours = OrtStepper(export_model(q, checkpoint=q, out=tmp_path / backend, max_seq_len=64, weights=weights), cfg,
                          batch=2, max_seq=64)
    err = capfd.readouterr().err  # (ONNX Runtime's MoE op takes float experts: widened, as K-quant ones are)
    assert f"as {target} super-blocks" in err and ("widened to float32" in err) == (backend == "ort-standard"), err
    compare_steps(cfg, truth(cfg, (q, f)), ours, report, f"{kind} experts as {target} on {backend}", tol=TOL)


def test_a_row_chooses_its_experts_alone(files):
    """Batch invariance on the kernels: a row's logits are the same bits alone as beside rows that chose others."""
    q, _ = files
    cfg = load_config(q)
    folder = export_model(q, checkpoint=q, out=q.parent / "inv", max_seq_len=64, force=True,
                          weights=Weights(kernels="llgraph"))
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(5))
    both = OrtStepper(folder, cfg, batch=2, max_seq=64).step(ids)["logits"]
    alone = OrtStepper(folder, cfg, batch=1, max_seq=64).step(ids[1:])["logits"]
    assert torch.equal(both[1], alone[0])


# gpt-oss as its published GGUFs store it: experts MXFP4 (blocks of 32, an E8M0 scale), written by llama.cpp's own
# converter and llama-quantize's MXFP4_MOE (tests/gguf_families.py --mxfp4), biases F32, the rest Q8_0
def dequantized_twin(src, dst):
    """`src` with every quantized tensor replaced by gguf's own dequantization of it (float32): the truth the file's
    numbers define, computed by code that is not llgraph's."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize
    from reference import copying_fields

    r = gguf.GGUFReader(str(src))
    w = copying_fields(r, dst)
    for t in r.tensors:
        quantized = t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        data = dequantize(t.data, t.tensor_type).astype(np.float32) if quantized else np.array(t.data)
        w.add_tensor(t.name, data)
    finish_gguf(w)
    return dst


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    from gguf_families import DATA

    q = DATA / "gpt_oss" / "mxfp4.gguf"
    return q, dequantized_twin(q, tmp_path_factory.mktemp("mxfp4") / "f.gguf")


def test_gpt_oss_mxfp4_experts_are_carried_at_their_bits(mxfp4, tmp_path):
    """Every layer a QMoE in MXFP4 with gpt-oss's biases and activation; the export on llgraph's kernels holds the
    experts' bytes as many as the file's, and says nothing of widening."""
    q, _ = mxfp4
    model = open_model(q, q)
    moe = [n for n in model.graph.nodes if n.op == "QMoE"]
    assert len(moe) == model.config.num_layers and all(
        (n.attrs["format"], n.attrs["down_format"], n.attrs["limit"]) == ("MXFP4", "MXFP4", 7.0) for n in moe)
    out = subprocess.run([sys.executable, "-m", "llgraph", "export", "--checkpoint", str(q), "-o",
                          str(tmp_path / "ort"), "--kernels", "llgraph", "--max-seq-len", "64"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "widened" not in out.stderr, out.stderr
    graph = onnx.load(str(tmp_path / "ort" / "model.onnx"), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "MoE" and n.domain == "llgraph"]
    sizes = {i.name: int(next(e.value for e in i.external_data if e.key == "length")) for i in graph.initializer
             if i.data_location == onnx.TensorProto.EXTERNAL}
    carried = sum(sizes[name] for n in nodes for name in n.input[2:4])
    src = GGUFSource(q)
    stored = sum(src.stored_bytes(n) for n in src.names() if ".experts." in n and n.endswith(".weight"))
    print(f"MXFP4 expert initializers {carried} B; the GGUF's {stored} B")
    assert len(nodes) == model.config.num_layers and carried == stored


@pytest.mark.parametrize("backend", ["torch", "ort-llgraph-0", "ort-llgraph-4", "ort-standard", "onnx"])
def test_gpt_oss_mxfp4_runs_as_gguf_dequantizes_it(mxfp4, backend, tmp_path, report):
    """Prefill + 8 decode steps of the MXFP4 file against float64 of its gguf-dequantized twin: the executor, llgraph's
    kernels exact (level 0) and at int8 activations (level 4, bounded by its own rounding), ONNX Runtime's MoE op on
    the experts widened, and standard ONNX."""
    q, f = mxfp4
    cfg = load_config(q)
    truth_steps = Stepper(cfg, GGUFSource(f), batch=2, max_seq=64, dtype="float64")
    target, _, rest = backend.partition("-")
    kernels, _, level = rest.partition("-")
    if backend == "torch":
        ours = Stepper(cfg, GGUFSource(q), batch=2, max_seq=64, graph=open_model(q, q).graph)
    else:
        folder = export_model(q, checkpoint=q, out=tmp_path / backend, target=target, max_seq_len=64,
                              weights=Weights(kernels=kernels or "auto", accuracy_level=int(level) if level else None))
        ours = OrtStepper(folder, cfg, batch=2, max_seq=64)
    compare_steps(cfg, truth_steps, ours, report, f"gpt-oss MXFP4 on {backend} vs float64 of gguf's dequantization",
                  tol=0.1 if level == "4" else TOL)


def test_a_decode_step_reads_its_k_experts_on_the_standard_lowering(files, tmp_path):
    """`llgraph bench`'s weight bytes a token (runtime/bench/speed.py) follow the lowering: one token takes the
    gathered branch (k of the stacked experts' bytes), as the trt export's ExpertMatMul nodes; the onnx export as a
    TensorRT-RTX build parses it (its Ifs inlined as their else-branch, trt_network.without_branches) reads every
    expert, and ONNX Runtime runs it to the same logits."""
    import shutil

    import numpy as np
    from kquant_moe import EXPERTS, TOP_K

    from llgraph.export.trt_network import without_branches
    from llgraph.runtime.bench.speed import onnx_bytes_per_token

    q, _ = files
    model = open_model(q, q)
    folder = export(model.graph, model.source, get_target("onnx"), tmp_path / "onnx", max_positions=64)
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    experts = sum(next(int(e.value) for e in i.external_data if e.key == "length") for i in proto.graph.initializer
                  if len(i.dims) == 3 and i.dims[0] == EXPERTS)
    dense = shutil.copytree(folder, tmp_path / "dense")
    without_branches(proto)
    assert not any(n.op_type == "If" for n in proto.graph.node)
    onnx.save(proto, str(dense / "model.onnx"))
    trt = export(model.graph, model.source, get_target("trt"), tmp_path / "trt", max_positions=64)
    got = {"gathered": onnx_bytes_per_token(folder), "dense": onnx_bytes_per_token(dense),
           "trt": onnx_bytes_per_token(trt)}
    print(got, "expert bytes", experts)
    # equal but for the If's own few int64 constants (the condition's, the branches' axes): under 1 KB
    assert experts > 0 and abs(got["gathered"] - (got["dense"] - experts * (1 - TOP_K / EXPERTS))) < 1024
    # the trt export's ExpertMatMul reads a token's k experts too (its grouping's constants: under 4 KB)
    assert abs(got["trt"] - got["gathered"]) < 4096
    steppers = [OrtStepper(f, model.config, batch=2, max_seq=64) for f in (folder, dense)]
    for ids in (np.arange(14).reshape(2, 7) % model.config.vocab_size, np.array([[3], [5]])):  # prefill, a step
        a, b = (s.step(torch.tensor(ids))["logits"] for s in steppers)
        assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())
