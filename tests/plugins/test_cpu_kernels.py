"""llgraph's ONNX Runtime CPU kernels (plugins/cpu): built here from nothing (headers fetched from Debian's
archive, compiled with g++), each instruction-set path equal to a float64 reference of the op's definition, every
GGUF block type exported on them equal to the executor on the dequantized blocks, SmolLM2's greedy tokens equal to
transformers', and one-line errors where they cannot be had."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from reference import OrtStepper, Stepper, tiny
from test_export import compare_steps
from test_quant import K_CFG, T, cfg_for, llgraph, superblocks, tiny_gguf
from test_smollm2 import gguf_path, greedy_against, hf, hf_greedy, hf_logits, prompt  # noqa: F401 (fixtures)

from llgraph.checkpoint import load_config
from llgraph.export import export_model
from llgraph.export_folder import MANIFEST, Manifest, integrity_record
from llgraph.gguf_source import GGUFSource
from llgraph.passes import HIDDEN
from llgraph.plugins import cpu
from llgraph.weight_request import Weights

KERNELS = Weights(kernels="llgraph")

# What the probes of the kernels share (run with `python -c`, the library's path as argv[1]): one case's random
# blocks, one QLinear node on the library, and the instruction set it ran.
QLINEAR_PROBE = r'''
import ctypes, os, sys
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
lib, rng = sys.argv[1], np.random.default_rng(0)


def blocks(bits, B, with_mins, with_bias, M, N, nb):
    q = rng.integers(0, 2 ** bits, size=(N, nb, B)).astype(np.uint8)
    codes = q[..., 0::2] | (q[..., 1::2] << 4) if bits == 4 else q
    scales = (rng.standard_normal((N, nb)) * 0.01).astype(np.float32)
    mins = (rng.standard_normal((N, nb)) * 0.01).astype(np.float32) if with_mins else None
    bias = rng.standard_normal(N).astype(np.float32) if with_bias else None
    x = rng.standard_normal((1, M, nb * B)).astype(np.float32)
    return q, codes, scales, mins, bias, x


def qlinear(given, x, **attrs):
    inits = [numpy_helper.from_array(v, k) for k, v in given.items() if v is not None]
    names = ["x"] + [k if v is not None else "" for k, v in given.items()]
    while names[-1] == "":
        names.pop()
    node = helper.make_node("QLinear", names, ["y"], domain="llgraph", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("llgraph", 1)])
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(lib)
    return ort.InferenceSession(model.SerializeToString(), opts).run(None, {"x": x})[0]


isa = ctypes.CDLL(lib).llgraph_cpu_isa
isa.restype = ctypes.c_char_p
'''

# One QLinear node per case and layout (the blocks as stored, and interleaved 16 rows at a time as
# cpu_layout.interleave16 writes them), run by ONNX Runtime on the library, against numpy's float64 of its definition
# w[o, b*B + j] = scales[o, b] * (q[o, b, j] - zero_point) + mins[o, b]. Run in a fresh process per instruction
# set: the library picks it when it loads.
PROBE = QLINEAR_PROBE + r'''
from llgraph.export.cpu_layout import interleave16
worst = {"stored": 0.0, "interleaved": 0.0, "interleaved, half": 0.0}
cases = [(4, 32, 8, False, False, 1), (4, 32, 0, True, False, 3), (8, 32, 128, False, True, 5),
         (8, 16, 32, False, False, 1), (4, 64, 8, True, True, 7), (4, 16, 8, True, False, 2),
         (8, 128, 0, True, True, 9), (4, 32, 8, True, True, 8), (8, 32, 128, True, False, 17)]  # exact tiles: 1-8 rows
for bits, B, zp, with_mins, with_bias, M in cases:
    N, nb = 37, 5
    q, codes, scales, mins, bias, x = blocks(bits, B, with_mins, with_bias, M, N, nb)
    scales = scales.astype(np.float16).astype(np.float32)  # as GGUF stores them: the half layout is lossless
    mins = None if mins is None else mins.astype(np.float16).astype(np.float32)
    w = scales[..., None].astype(np.float64) * (q.astype(np.float64) - zp) + (0 if mins is None else mins[..., None])
    want = x.astype(np.float64) @ w.reshape(N, -1).T + (0 if bias is None else bias)
    given = {"codes": codes, "scales": scales, "mins": mins, "bias": bias}
    for layout in worst:
        attrs = {}
        if layout == "interleaved":
            given = {k: v if v is None or k == "bias" else interleave16(v)
                     for k, v in given.items()}
        if layout == "interleaved, half":
            given = {k: v.astype(np.float16) if k in ("scales", "mins") and v is not None else v
                     for k, v in given.items()}
        if layout != "stored":
            attrs = {"interleave": 16, "rows": N}
        got = qlinear(given, x, bits=bits, block_size=B, zero_point=zp, **attrs)
        worst[layout] = max(worst[layout], float(np.abs(got - want).max() / np.abs(want).max()))
# activation=swiglu: one node on [gate; up] (21 outputs: the last group partial), silu(gate) * up
from llgraph.export.cpu_layout import glu_groups, glu_groups_half
worst["swiglu"] = 0.0
for bits, B, zp, M in [(4, 32, 0, 1), (8, 32, 128, 3), (4, 16, 8, 5)]:
    I, nb = 21, 4
    q, codes, scales, mins, _, x = blocks(bits, B, True, False, M, 2 * I, nb)
    scales = scales.astype(np.float16).astype(np.float32)
    mins = mins.astype(np.float16).astype(np.float32)
    w = scales[..., None].astype(np.float64) * (q.astype(np.float64) - zp) + mins[..., None]
    y = x.reshape(M, -1).astype(np.float64) @ w.reshape(2 * I, -1).T
    want = y[:, :I] / (1 + np.exp(-y[:, :I])) * y[:, I:]
    for per_block in (glu_groups(), glu_groups_half):
        given = {"codes": glu_groups()(codes),
                 "scales": per_block(scales),
                 "mins": per_block(mins)}
        got = qlinear(given, x, bits=bits, block_size=B, zero_point=zp, interleave=16, rows=I, activation=1)
        worst["swiglu"] = max(worst["swiglu"], float(np.abs(got.reshape(M, I) - want).max() / np.abs(want).max()))
# a norm weight (x's RMSNorm first, epsilon as the attribute) and a residual (added to y): one node
worst["norm, residual"] = 0.0
for bits, B, zp, M in [(4, 32, 0, 1), (8, 32, 128, 3), (4, 64, 8, 6)]:
    N, nb = 37, 6
    q, codes, scales, mins, bias, x = blocks(bits, B, True, True, M, N, nb)
    norm = rng.standard_normal(nb * B).astype(np.float32)
    residual = rng.standard_normal((1, M, N)).astype(np.float32)
    w = scales[..., None].astype(np.float64) * (q.astype(np.float64) - zp) + mins[..., None]
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * norm
    want = xn @ w.reshape(N, -1).T + bias + residual
    given = {"codes": interleave16(codes),
             "scales": interleave16(scales),
             "mins": interleave16(mins), "bias": bias, "residual": residual, "norm": norm}
    got = qlinear(given, x, bits=bits, block_size=B, zero_point=zp, interleave=16, rows=N, epsilon=1e-5)
    worst["norm, residual"] = max(worst["norm, residual"], float(np.abs(got - want).max() / np.abs(want).max()))
# 5-bit codes at their own bits (GGUF's Q5_0: zero point 16, no mins; Q5_1: mins), blocks of 32, exact, as the
# ort export writes them (cpu_layout.interleave16_5bit); with the swiglu epilogue, and with a norm and a residual
from llgraph.export.cpu_layout import interleave16_5bit
worst["5-bit"] = 0.0
for zp, with_mins, with_bias, M, fused in [(16, False, True, 1, ""), (0, True, False, 3, ""), (16, False, False, 8, ""),
                                            (0, True, False, 2, "swiglu"), (16, True, True, 5, "norm")]:
    N, nb = (2 * 21 if fused == "swiglu" else 37), 4
    q, codes, scales, mins, bias, x = blocks(5, 32, with_mins, with_bias, M, N, nb)
    scales = scales.astype(np.float16).astype(np.float32)
    mins = None if mins is None else mins.astype(np.float16).astype(np.float32)
    w = scales[..., None].astype(np.float64) * (q.astype(np.float64) - zp) + (0 if mins is None else mins[..., None])
    x64, attrs = x.reshape(M, -1).astype(np.float64), {}
    given = {"codes": interleave16_5bit(q), "scales": interleave16(scales).astype(np.float16),
             "mins": None if mins is None else interleave16(mins).astype(np.float16), "bias": bias}
    if fused == "swiglu":
        y = x64 @ w.reshape(N, -1).T
        want = y[:, :21] / (1 + np.exp(-y[:, :21])) * y[:, 21:]
        given = {"codes": glu_groups(interleave16_5bit)(q), "scales": glu_groups_half(scales),
                 "mins": glu_groups_half(mins)}
        attrs = {"activation": 1}
    elif fused == "norm":
        norm = rng.standard_normal(nb * 32).astype(np.float32)
        residual = rng.standard_normal((1, M, N)).astype(np.float32)
        xn = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * norm
        want = xn @ w.reshape(N, -1).T + bias + residual[0]
        given |= {"residual": residual, "norm": norm}
        attrs = {"epsilon": 1e-5}
    else:
        want = x64 @ w.reshape(N, -1).T + (0 if bias is None else bias)
    got = qlinear(given, x, bits=5, block_size=32, zero_point=zp, code_bits=5, interleave=16,
                  rows=21 if fused == "swiglu" else N, **attrs).reshape(M, -1)
    worst["5-bit"] = max(worst["5-bit"], float(np.abs(got - want).max() / np.abs(want).max()))
print(isa().decode(), *worst.values())
'''


@pytest.fixture(scope="module")
def library():
    path = cpu.library()
    assert path is not None, cpu.why_not()  # g++ and Debian's archive are there wherever the tests run
    return path


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_every_instruction_set_path_equals_float64(library, isa, report):
    """4- and 8-bit codes, blocks of 16 to 128, with and without mins and bias, 1 to 9 rows at once, both layouts,
    the interleaved one with float and half-float scales and mins (37 output rows: its last group is partial), and
    with what the export fuses into it: the SwiGLU epilogue, the RMSNorm before, the residual Add after; and 5-bit
    codes at their own bits (GGUF's Q5_0/Q5_1), alone and fused."""
    r = subprocess.run([sys.executable, "-c", PROBE, str(library)], capture_output=True, text=True,
                       env={**os.environ, cpu.ISA_ENV: isa}, check=True)
    ran, *worst = r.stdout.split()
    if ran != isa:
        pytest.skip(f"this CPU has no {isa} (the library runs {ran})")
    for layout, diff in zip(("blocks as stored", "interleaved", "interleaved, half-float scales and mins",
                             "interleaved with activation=swiglu", "interleaved with a norm and a residual",
                             "5-bit codes interleaved (Q5_0/Q5_1 as stored)"), worst,
                            strict=True):
        report(f"llgraph QLinear on {isa}, {layout}, vs float64, relative to max |y|", float(diff), 2e-6)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
                                   T.Q6_K, T.IQ4_XS])
def test_gguf_export_on_the_kernels_matches_executor(library, qtype, tmp_path, report):
    """Prefill + 8 decode steps, batch 2, logits and caches: every Linear one llgraph QLinear node on the blocks
    as stored, vs the executor on the GGUF's dequantization (float64 for the K-quants' wide sums)."""
    tiny_gguf(tmp_path / "t.gguf", qtype, cfg_for(qtype))
    cfg = load_config(tmp_path / "t.gguf")
    folder = export_model(tmp_path / "t.gguf", checkpoint=tmp_path / "t.gguf", out=tmp_path / "ort", max_seq_len=64,
                          weights=KERNELS.replace(accuracy_level=0))  # exact (the K-quants' default is level 4)
    graph = __import__("onnx").load(str(folder / "model.onnx"), load_external_data=False).graph
    ours = [n for n in graph.node if n.domain == cpu.DOMAIN and n.op_type == "QLinear"]
    assert len(ours) == 4 * cfg.num_layers + 1  # qkv, o, gate_up, down; the head
    tables = [n for n in graph.node if n.op_type in ("Gather", "GatherBlockQuantized", "QEmbedding")]
    assert [(n.domain, n.op_type) for n in tables] == [(cpu.DOMAIN, "QEmbedding")]  # the table in the head's layout
    assert "MatMulNBits" not in [n.op_type for n in graph.node]
    # the blocks interleaved (all but a tied head's); their scales half floats, as GGUF stores them; the K-quants'
    # super-blocks hold their own (no scales input: tests/plugins/test_cpu_superblocks.py)
    layers = [n for n in ours if any(a.name == "interleave" for a in n.attribute)]
    assert len(layers) >= 4 * cfg.num_layers
    scale_types = {i.data_type for i in graph.initializer if i.name in {n.input[2] for n in layers if len(n.input) > 2}}
    assert scale_types == (set() if superblocks(qtype) else {10})  # FLOAT16
    # Q5_0/Q5_1 at their own bits (20 code bytes a block of 32, as the file's 22 less its scale), the tied table's
    # QEmbedding reading the head's codes
    bits = {a.i for n in ours + tables for a in n.attribute if a.name == "bits"}
    if not superblocks(qtype):  # (a super-block format's bits attribute is its own: 4, 5, 6)
        assert bits == ({5} if qtype.name in ("Q5_0", "Q5_1") else {4} if qtype.name in ("Q4_0", "Q4_1") else {8})
    if qtype.name in ("Q5_0", "Q5_1"):
        codes = {i.name: i for i in graph.initializer}
        assert all(list(codes[n.input[1]].dims)[2] == 16 * 20 for n in ours + tables)
    # each MLP's gate/up QLinear computes the SwiGLU itself, the norms and the residual Adds are the QLinears' too:
    # no Split, no separate activation, no norm, no Add; the attention is llgraph's GroupedAttention (rotary inside,
    # reading the positions itself: no sequence-length nodes)
    fused = [n for n in layers if any(a.name == "activation" and a.i == 1 for a in n.attribute)]
    ops = [n.op_type for n in graph.node if list(n.output) != [HIDDEN]]  # the hidden states' own norm (embeddings)
    assert len(fused) == cfg.num_layers and not {"Split", "QuickGelu", "Sigmoid", "RMSNormalization"} & set(ops)
    assert "Add" not in ops and "GroupQueryAttention" not in ops, ops
    assert [n.domain for n in graph.node if n.op_type == "GroupedAttention"] == [cpu.DOMAIN] * cfg.num_layers
    # the K-quants' tolerance is test_quant's (float32 sums of 256/512 terms against a float64 truth: 6.7e-4 here)
    dtype, tol = ("float64", 1e-3) if superblocks(qtype) else ("float32", None)
    truth = Stepper(cfg, GGUFSource(tmp_path / "t.gguf"), batch=2, max_seq=64, dtype=dtype)
    compare_steps(cfg, truth, OrtStepper(folder, cfg, batch=2, max_seq=64), report, f"ort llgraph {qtype.name}",
                  tol=tol)


@pytest.mark.slow
def test_smollm2_on_the_kernels_gives_transformers_greedy_tokens(library, gguf_path, greedy_against,  # noqa: F811
                                                                  tmp_path):
    folder = export_model(gguf_path, checkpoint=gguf_path, out=tmp_path / "ort", max_seq_len=128, weights=KERNELS)
    greedy_against(OrtStepper(folder, load_config(gguf_path), max_seq=128), "ort on llgraph's kernels")


def test_without_a_compiler_the_export_says_so_in_one_line(tmp_path):
    tiny_gguf(tmp_path / "t.gguf", T.Q4_0)
    env = {**os.environ, "CXX": str(tmp_path / "no-compiler"), "LLGRAPH_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "llgraph", "export", "--checkpoint", str(tmp_path / "t.gguf"), "-o",
                        str(tmp_path / "out"), "--kernels", "llgraph"], capture_output=True, text=True, env=env)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    print(lines)
    assert r.returncode == 2 and len(lines) == 1 and "--kernels" in lines[0] and "compiler" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_folder_missing_its_kernels_is_one_line(library, tmp_path):
    tiny_gguf(tmp_path / "t.gguf", T.Q4_1)
    folder = export_model(tmp_path / "t.gguf", checkpoint=tmp_path / "t.gguf", out=tmp_path / "ort", weights=KERNELS)
    (folder / cpu.LIBRARY).unlink()
    r = llgraph("generate", str(folder), "--tokens", "1,2,3", "--max-new-tokens", "2")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "libllgraph_ort.so is missing" in lines[0], r.stderr
    # a folder exported before integrity records: the kernels' own check says it
    manifest = json.loads((folder / MANIFEST).read_text())
    older = {k: v for k, v in manifest.items() if k not in ("sizes", "sha256", "seal")}  # no record, no seal
    (folder / MANIFEST).write_text(json.dumps(older))
    r = llgraph("generate", str(folder), "--tokens", "1,2,3", "--max-new-tokens", "2")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--kernels standard" in lines[0], r.stderr


def test_a_library_for_a_newer_onnxruntime_is_one_line(library, tmp_path):
    """The library asks the runtime for the C API of the headers it was built with; built for one newer than this
    onnxruntime (here: API 999), opening the folder says so in one line of llgraph's (ONNX Runtime adds its own)."""
    tiny_gguf(tmp_path / "t.gguf", T.Q4_1)
    folder = export_model(tmp_path / "t.gguf", checkpoint=tmp_path / "t.gguf", out=tmp_path / "ort", weights=KERNELS)
    headers = cpu._headers(progress=False)
    subprocess.run([os.environ.get("CXX") or "g++", "-std=c++17", "-O0", "-fPIC", "-shared", "-fvisibility=hidden",
                    "-DLLGRAPH_ORT_API=999", f"-I{headers}", f"-I{cpu.SOURCE.parent}", str(cpu.SOURCE), "-o",
                    str(folder / cpu.LIBRARY)], check=True, capture_output=True)
    manifest = Manifest.read(folder)  # as an export built against those headers would have recorded it
    record = integrity_record(folder, [cpu.LIBRARY])
    dataclasses.replace(manifest, **{k: {**getattr(manifest, k), **v} for k, v in record.items()}).write(folder)
    r = llgraph("generate", str(folder), "--tokens", "1,2,3", "--max-new-tokens", "2")
    ours = [line for line in r.stderr.splitlines() if "llgraph" in line]
    print(r.stderr)
    assert r.returncode == 2 and len(ours) == 1 and "C API 999" in ours[0] and "--kernels standard" in ours[0]
    assert "Traceback" not in r.stderr


def test_the_default_is_the_kernels_where_they_serve(library, tmp_path):
    """--kernels auto: llgraph's kernels for quantized blocks on ort in float32; ONNX Runtime's ops elsewhere."""
    from llgraph.export import resolve_kernels

    gguf = tmp_path / "m.gguf"
    assert resolve_kernels(Weights(), "ort", gguf).kernels == "llgraph"
    assert resolve_kernels(Weights(quantize="int4"), "ort", tmp_path / "hf").kernels == "llgraph"
    for weights, target, checkpoint in ((Weights(), "onnx", gguf), (Weights(), "trt", gguf),
                                        (Weights("fp16"), "ort", gguf), (Weights(dequantize=True), "ort", gguf),
                                        (Weights(), "ort", tmp_path / "hf")):  # float weights: no QLinear to run
        assert resolve_kernels(weights, target, checkpoint).kernels == "standard", (weights, target)
    assert resolve_kernels(Weights(kernels="standard"), "ort", gguf).kernels == "standard"
    with pytest.raises(ValueError, match="resolved"):
        Weights().mode  # noqa: B018 (an unresolved request keys nothing)


@pytest.mark.slow
def test_without_a_compiler_generate_answers_on_onnx_runtime_s_ops_and_says_so(tmp_path):
    """The README's main job on a machine where the kernels cannot be built: it still answers, on MatMulNBits, and
    one line says why and how to get the kernels."""
    env = {**os.environ, "CXX": str(tmp_path / "no-compiler"), "LLGRAPH_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "llgraph", "generate", "smollm2", "--chat", "--prompt",
                        "What is the capital of France?", "--max-new-tokens", "12"], capture_output=True, text=True,
                       env=env)
    print(r.stdout, r.stderr)
    assert r.returncode == 0 and "Paris" in r.stdout, r.stderr
    said = [line for line in r.stderr.splitlines() if "kernels" in line]
    assert len(said) == 1 and "ONNX Runtime's own ops" in said[0] and "compiler" in said[0], r.stderr
    (model,) = (tmp_path / "cache").glob("*/model.onnx")
    ops = {n.op_type for n in __import__("onnx").load(str(model), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops and "QLinear" not in ops


def test_kernels_are_an_ort_choice_and_part_of_the_cache_key():
    assert Weights(kernels="llgraph").mode != Weights(kernels="standard").mode
    with pytest.raises(Exception, match="--kernels llgraph is for ONNX Runtime"):
        Weights(kernels="llgraph").check("trt")
    with pytest.raises(Exception, match="float32"):
        Weights("fp16", kernels="llgraph").check("ort", kernels=True)


def test_cache_clean_takes_llgraph_s_kernel_builds_and_nothing_else(tmp_path):
    """Each change of the kernels' source builds into a new folder of the cache; `llgraph cache clean` (all) removes
    those builds and the fetched headers with the exports, and leaves a user's files where it found them."""
    cache = tmp_path / "cache"
    for key in ("0123456789abcdef", "fedcba9876543210"):
        (cache / cpu.BUILDS / key).mkdir(parents=True)
        (cache / cpu.BUILDS / key / cpu.LIBRARY).write_bytes(b"\0" * 1000)
    (cache / cpu.BUILDS / "mine").mkdir()
    (cache / cpu.BUILDS / "mine" / "notes.txt").write_text("a user's")
    include = cache / cpu.HEADERS / "x" / "usr" / "include" / "onnxruntime"
    include.mkdir(parents=True)
    (include / "onnxruntime_cxx_api.h").write_text("//")
    r = llgraph("cache", "clean", "--cache-dir", str(cache))
    assert r.returncode == 0, r.stderr
    left = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
    print(r.stdout.strip(), left)
    assert left == [cpu.BUILDS, f"{cpu.BUILDS}/mine", f"{cpu.BUILDS}/mine/notes.txt"]


def test_a_k_quant_files_blocked_fallbacks_take_its_level(tmp_path):
    """The accuracy level is the model's (llgraph/weight_request.py): in a file with K-quant super-blocks, the blocked
    tensors llama.cpp writes beside them (Q5_0/Q8_0 where a row is not whole super-blocks) run at level 4 too; a
    file of blocked formats alone stays exact; an explicit --accuracy-level wins in both."""
    import onnx
    from reference import write_gguf

    from llgraph.checkpoint import random_weights

    cfg = tiny(**K_CFG)
    mixed = {"mlp": T.Q4_K, "self_attn": T.Q5_0, "embed_tokens": T.Q8_0, "lm_head": T.Q8_0}

    def levels(path, weights=KERNELS):
        folder = export_model(path, checkpoint=path, out=tmp_path / f"ort-{len(list(tmp_path.iterdir()))}",
                              max_seq_len=64, weights=weights)
        graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
        attrs = [{a.name: a for a in n.attribute} for n in graph.node if n.op_type == "QLinear"]
        return {(a["accuracy_level"].i, a["format"].s.decode()) for a in attrs}

    for name, types in (("mixed", mixed), ("blocked", {"mlp": T.Q5_0, "self_attn": T.Q8_0, "embed_tokens": T.Q8_0,
                                                       "lm_head": T.Q8_0})):
        write_gguf(tmp_path / f"{name}.gguf", cfg, random_weights(cfg, seed=3, std=0.25),
                   lambda i, name, x, types=types: next((t for k, t in types.items() if k in name), T.F32))
    found = levels(tmp_path / "mixed.gguf")
    print(f"a Q4_K file with Q5_0/Q8_0 fallbacks: (level, format) of its QLinears {sorted(found)}")
    assert {level for level, _ in found} == {4} and len({fmt for _, fmt in found}) > 1  # blocks and super-blocks
    assert {level for level, _ in levels(tmp_path / "blocked.gguf")} == {0}
    assert {level for level, _ in levels(tmp_path / "mixed.gguf", KERNELS.replace(accuracy_level=0))} == {0}
