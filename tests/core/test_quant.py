"""Quantized weights (llgraph/quant.py, op QLinear): GGUF blocks carried exactly, round-to-nearest for float
checkpoints, every backend against the executor on the same weights dequantized, and bad requests refused."""

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import onnx
import pytest
from conftest import max_diff
from reference import OrtStepper, Stepper, tiny, write_gguf, write_hf_checkpoint
from test_export import compare_steps

from llgraph.bundled import bundled_model
from llgraph.checkpoint import load_config, random_weights
from llgraph.export import export_model
from llgraph.gguf_source import GGUFSource
from llgraph.op_shapes import SUPERBLOCK_BYTES
from llgraph.quant import dequantize, quantize_rtn
from llgraph.runtime.engine.logprobs import log_softmax
from llgraph.source_views import QuantizedSource
from llgraph.weight_request import Weights

T = gguf.GGMLQuantizationType
TARGETS = ("ort", "onnx", "trt")


def llgraph(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llgraph", *args], capture_output=True, text=True, cwd=cwd)


def tiny_gguf(path, qtype, cfg=None):
    """A tiny GGUF whose Linears and embedding table are `qtype` (the norms F32), written by gguf's writer."""
    cfg = cfg or tiny(hidden_size=64, intermediate_size=128, head_dim=16)
    source = random_weights(cfg, seed=5, std=0.25)
    quantized = ("_proj", "embed_tokens", "lm_head")
    expected = write_gguf(path, cfg, source, lambda i, name, x: qtype if any(q in name for q in quantized) else T.F32)
    return cfg, expected


EXACT = {"ort": 0}  # MatMulNBits' exact-compute accuracy level (the default; 4 quantizes activations to int8)
K_CFG = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # K-quant rows are super-blocks of 256
# the blocked form's bits (super-blocks: widened); IQ4_NL's and IQ4_XS's values are 8-bit codes there
BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 8, T.Q5_1: 8, T.Q8_0: 8, T.IQ4_NL: 8, T.Q2_K: 4, T.Q3_K: 8, T.Q4_K: 4,
        T.Q5_K: 8, T.Q6_K: 8, T.IQ4_XS: 8}


def superblocks(qtype) -> bool:
    return qtype.name in SUPERBLOCK_BYTES


def cfg_for(qtype):
    """A tiny config whose rows are whole super-blocks where `qtype` needs them (None: tiny_gguf's own)."""
    return tiny(**K_CFG) if superblocks(qtype) else None


@pytest.mark.parametrize("qtype", list(BITS))
def test_gguf_blocks_map_exactly(qtype, tmp_path, report):
    """Our blocked form of each GGUF tensor, dequantized by llgraph, == gguf's own dequantization, bit for bit
    (K-quants: random super-blocks, as gguf's writer cannot quantize to them)."""
    cfg, expected = tiny_gguf(tmp_path / "t.gguf", qtype, cfg_for(qtype))
    source = GGUFSource(tmp_path / "t.gguf")
    worst, n = 0.0, 0
    for name, (want, kind, _) in expected.items():
        if kind != qtype:
            continue
        q = source.load_quantized(name)
        assert source.quant_format(name) == q.fmt
        if q.fmt.superblocks:  # carried as stored, byte for byte; widened (for MatMulNBits, ONNX, TensorRT) exactly
            assert q.codes.tobytes() == source._tensors[name].data.tobytes()
            wide = q.widened()
            assert wide.fmt.bits == BITS[qtype] and not wide.fmt.superblocks
            worst = max(worst, max_diff(dequantize(wide.codes, wide.scales, wide.mins, wide.fmt.bits,
                                                   wide.fmt.zero_point, np.dtype(np.float32)), want))
        else:
            assert q.fmt.bits == BITS[qtype]
        worst, n = max(worst, max_diff(q.dequantized(np.dtype(np.float32)), want)), n + 1
    assert n == 7 * cfg.num_layers + 2
    report(f"{qtype.name} blocks vs gguf.dequantize", worst, 0.0)


@pytest.mark.parametrize("qtype", list(BITS))
@pytest.mark.parametrize("target", TARGETS)
def test_quantized_export_matches_executor_on_dequantized_weights(qtype, target, tmp_path, report):
    """Prefill + 8 decode steps, batch 2: logits and caches of the QLinear/QEmbedding export (MatMulNBits and
    GatherBlockQuantized for ort, blocked DequantizeLinear and a dequantized table for onnx/trt) vs the float
    executor on gguf's dequantization of the same file."""
    tiny_gguf(tmp_path / "t.gguf", qtype, cfg_for(qtype))
    cfg = load_config(tmp_path / "t.gguf")  # the GGUF's own: interleaved RoPE rows
    folder = export_model(tmp_path / "t.gguf", checkpoint=tmp_path / "t.gguf", out=tmp_path / target,
                          target=target, max_seq_len=64,
                          weights=Weights(accuracy_level=EXACT.get(target), kernels="standard"))
    nodes = __import__("onnx").load(str(folder / "model.onnx"), load_external_data=False).graph.node
    ops = [n.op_type for n in nodes]
    if target != "ort":
        assert "DequantizeLinear" in ops
    else:  # 8-bit at the exact accuracy level: two 4-bit MatMulNBits on the nibbles (ORT's CPU has no fast exact
        # 8-bit kernel), so every Linear is 4-bit MatMulNBits — two per Linear for 8-bit codes
        bits = [a.i for n in nodes if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"]
        # qkv, o, gate_up, down, head
        assert set(bits) == {4} and len(bits) == (4 * cfg.num_layers + 1) * BITS[qtype] // 4
        assert "GatherBlockQuantized" in ops
    if superblocks(qtype):  # 256/512-wide sums and logits of O(15): float32 rounding reaches ~3e-5 relative,
        # so the truth is float64 and the tolerance 1e-3 (3e-5 of the logits' range of ~30; measured up to 6.7e-4
        # on the onnx and ort targets alike, ONNX Runtime's float32 sums either way)
        truth, tol = Stepper(cfg, GGUFSource(tmp_path / "t.gguf"), batch=2, max_seq=64, dtype="float64"), 1e-3
    else:
        truth, tol = Stepper(cfg, GGUFSource(tmp_path / "t.gguf"), batch=2, max_seq=64), None
    compare_steps(cfg, truth, OrtStepper(folder, cfg, batch=2, max_seq=64), report, f"{target} {qtype.name}",
                  tol=tol)


def test_rtn_error_is_within_half_a_step():
    """Round-to-nearest, from its definition: each weight lands within half a quantization step of itself."""
    w = np.random.default_rng(0).standard_normal((48, 256), dtype=np.float32)
    for bits in (4, 8):
        for symmetric in (True, False):
            q = quantize_rtn(w, bits, 64, symmetric)
            back = dequantize(q.codes, q.scales, q.mins, bits, q.fmt.zero_point, np.dtype(np.float32))
            step = np.repeat(q.scales, 64, axis=1)
            assert (np.abs(back - w) <= step / 2 + 1e-6).all(), (bits, symmetric)
            assert q.codes.shape == (48, 4, 64 * bits // 8)


RTN_CASES = {"layers int4": dict(quantize="int4"),  # the lm head float
             "layers int4, tied head int8, symmetric": dict(quantize="int4", lm_head="int8", symmetric=True, tied=True),
             "untied head int4 alone": dict(lm_head="int4")}


@pytest.mark.parametrize("case", RTN_CASES)
@pytest.mark.parametrize("target", TARGETS)
def test_rtn_export_matches_executor(target, case, tmp_path, report):
    """--quantize / --lm-head: the export == the executor on the same RTN weights, and what was rounded is what the
    flags name (a tied table: its embedding gathers from the lm head's blocks)."""
    flags = dict(RTN_CASES[case])
    tied = flags.pop("tied", False)
    cfg = tiny(hidden_size=64, intermediate_size=128, head_dim=16, tie_word_embeddings=tied)
    ckpt = write_hf_checkpoint(tmp_path / "ckpt", cfg, random_weights(cfg, seed=3, std=0.25))
    folder = export_model(ckpt, checkpoint=ckpt, out=tmp_path / target, target=target, max_seq_len=64,
                          weights=Weights(block_size=32, accuracy_level=EXACT.get(target), kernels="standard", **flags))
    from llgraph.source_views import rtn_view
    from llgraph.weights import SafetensorsSource
    truth = Stepper(cfg, rtn_view(SafetensorsSource(ckpt), cfg, block_size=32, **flags), batch=2, max_seq=64)
    compare_steps(cfg, truth, OrtStepper(folder, cfg, batch=2, max_seq=64), report, f"{target} RTN {case}")
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    names = {i.name for i in graph.initializer}
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert any(n.startswith(f"{head}.codes") for n in names) == bool(flags.get("lm_head")), sorted(names)
    assert any(n.startswith("model.layers.0.mlp.down_proj.weight.codes") for n in names) == bool(flags.get("quantize"))
    assert ("model.embed_tokens.weight" in names) == (not tied or not flags.get("lm_head"))


def test_rtn_by_rows_is_rtn_of_the_whole(monkeypatch):
    """A big lm head is rounded a few rows at a time (bounded memory): the same blocks as rounding it whole."""
    cfg = tiny(hidden_size=64, intermediate_size=128, head_dim=16)
    base = random_weights(cfg, seed=4, std=0.25)
    monkeypatch.setattr(QuantizedSource, "ROUND_BYTES", 7 * 4 * 64)  # 7 rows a time: 97 = 13 x 7 + 6
    for symmetric in (False, True):
        got = QuantizedSource(base, 0, 32, symmetric, head_bits=4).load_quantized("lm_head.weight")
        want = quantize_rtn(base.load("lm_head.weight"), 4, 32, symmetric)
        for part in ("codes", "scales", "mins"):
            a, b = got.component(part), want.component(part)
            assert (a is None and b is None) or np.array_equal(a, b), (symmetric, part)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_smollm2_int4_from_its_q4_1_gguf(target, smollm2_export, smollm2_truth, report):
    """The bundled Q4_1 GGUF exported as it is stored: == the float64 executor on the dequantized weights (itself
    == transformers loading the same GGUF, tests/core/test_smollm2.py); prefill + 8 decode steps. Tolerance 1e-4 as for
    the float exports: ort runs on llgraph's CPU kernels (the default; 7.2e-5 measured). On MatMulNBits
    (`--kernels standard`) the mins term is summed apart from x*q*s, another rounding order: 2.4e-4 measured there."""
    from llgraph.bundled import bundled_model

    path = bundled_model("smollm2")
    cfg, truth = smollm2_truth
    folder = smollm2_export(target, quantized=True)
    manifest = __import__("json").loads((folder / "manifest.json").read_text())
    assert manifest["quantized"] == {"int4/b32/zp0": 4 * cfg.num_layers, "int8/b32/zp128": 1}  # + the lm head
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"SmolLM2 {target} int4 export: {size / 2**20:.0f} MiB (GGUF {path.stat().st_size / 2**20:.0f} MiB)")
    compare_steps(cfg, truth.session(), OrtStepper(folder, cfg, max_seq=64), report, f"SmolLM2 int4 {target}", batch=1,
                  prompt_len=12, tol=1e-4)


@pytest.mark.slow
def test_smollm2_int4_greedy_equals_the_executor(smollm2_export, tmp_path, report):
    """Exact compute (accuracy level 0, the default): 32 greedy tokens == the executor's (== transformers',
    test_smollm2.py). Level 4 (int8 activations, opt-in) is approximate: its mean KL divergence from the exact
    next-token distributions and its top-1 agreement are printed, with a bound the uncentred codes broke."""
    from llgraph.runtime import ORTRunner, TorchRunner
    from llgraph.runtime.backends.ort import OrtBackend

    prompt = "The capital of France is"
    want = TorchRunner("smollm2", max_seq_len=128).generate(prompt, max_new_tokens=32)
    exact = smollm2_export("ort", quantized=True, kernels="standard")
    got = ORTRunner(exact, max_seq_len=128).generate(prompt, max_new_tokens=32)
    print(f"executor: {want.text!r}\nint4 ort: {got.text!r}")
    assert got.token_ids == want.token_ids
    fast = export_model("smollm2", checkpoint="smollm2", out=tmp_path / "fast", max_seq_len=256,
                         weights=Weights(accuracy_level=4, kernels="standard"))
    gguf = bundled_model("smollm2").stat().st_size
    for folder, level, gathers, bound in ((exact, 0, 2, 1.35), (fast, 4, 1, 1.25)):
        # the tied Q8_0 table is stored once: the embedding's GatherBlockQuantized reads the lm head's MatMulNBits
        # codes (level 0: the two nibble tables of its exact 8-bit compute)
        nodes = __import__("onnx").load(str(folder / "model.onnx"), load_external_data=False).graph.node
        read = [n.input[0] for n in nodes if n.op_type == "GatherBlockQuantized"]
        assert len(read) == gathers and set(read) <= {n.input[1] for n in nodes if n.op_type == "MatMulNBits"}
        size = (folder / "model.onnx.data").stat().st_size
        print(f"int4 export (level {level}) {size / 2**20:.1f} MiB vs the GGUF's {gguf / 2**20:.1f} MiB")
        assert size < bound * gguf  # the float32 scales and mins of a GGUF's float16 ones make the difference
    ids = np.array([want.token_ids])
    pos = np.arange(ids.shape[1])[None]
    logp = []
    for folder in (exact, fast):
        backend = OrtBackend(folder, 64)
        backend.allocate(1)
        logp.append(log_softmax(backend.forward(ids, pos))[0])
    kl = float((np.exp(logp[0]) * (logp[0] - logp[1])).sum(-1).mean())
    agree = float((logp[0].argmax(-1) == logp[1].argmax(-1)).mean())
    print(f"accuracy level 4 vs 0 over {ids.shape[1]} tokens: top-1 agreement {agree:.2f}")
    # 0.0025 here; 0.013-0.016 before Q4_1's codes were centred (q - 8, the mins term carrying the rest)
    report("accuracy level 4 vs 0, mean KL of next-token distributions", kl, 0.006)


@pytest.mark.parametrize("qtype", [T.F16, T.Q8_0])
def test_gguf_rows_read_alone_equal_the_whole(qtype, tmp_path, monkeypatch):
    """GGUF matrices stream by rows into a float export (--dequantize) as they do from safetensors: the rows read
    alone equal the whole tensor's, and the export streamed in 1 KB blocks is byte-identical."""
    import llgraph.export.lower as lower

    tiny_gguf(tmp_path / "t.gguf", qtype)
    source = GGUFSource(tmp_path / "t.gguf")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight"):
        assert np.array_equal(source.load_rows(name, 3, 40), source.load(name)[3:40])
    whole = export_model(tmp_path / "t.gguf", checkpoint=tmp_path / "t.gguf", out=tmp_path / "whole",
                         weights=Weights(dequantize=True))
    monkeypatch.setattr(lower, "CHUNK_BYTES", 1024)
    streamed = export_model(tmp_path / "t.gguf", checkpoint=tmp_path / "t.gguf", out=tmp_path / "streamed",
                            weights=Weights(dequantize=True))
    assert (whole / "model.onnx.data").read_bytes() == (streamed / "model.onnx.data").read_bytes()


def test_gguf_reader_reads_what_ggufs_own_reads():
    """llgraph's reader is gguf's over a plain view of the same memory map: every field and tensor of the bundled
    GGUF (a 49k-token vocabulary, merges, Q4_1 and Q8_0 tensors) equals what gguf's own reader reads."""
    import numpy as np

    from llgraph.gguf_source import gguf_reader

    path = bundled_model("smollm2")
    ours, theirs = gguf_reader(path), gguf.GGUFReader(str(path), "r")
    assert list(ours.fields) == list(theirs.fields) and len(ours.fields["tokenizer.ggml.tokens"].data) == 49152
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert mine.types == field.types and mine.data == field.data, name
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True)), name
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


def test_shared_gguf_reads_hand_out_the_one_parse_and_put_gguf_back(tmp_path):
    """Inside shared_gguf_reads, gguf.GGUFReader(path) (what transformers' GGUF loader calls, once each for config,
    tokenizer and weights) is llgraph's cached reader of that file; a write-mode reader is gguf's own; after the
    block, even one left by an exception, gguf's class is back."""
    from llgraph.gguf_source import gguf_reader, shared_gguf_reads

    path, original = bundled_model("smollm2"), gguf.GGUFReader
    with shared_gguf_reads():
        assert gguf.GGUFReader(str(path)) is gguf.GGUFReader(path) is gguf_reader(path)
        copy = tmp_path / "copy.gguf"  # a small GGUF (a vocabulary), opened for writing
        copy.write_bytes((Path(__file__).parents[1] / "data" / "gguf_tokenizers" / "sentencepiece-bpe-800.gguf")
                         .read_bytes())
        assert type(gguf.GGUFReader(str(copy), "r+")) is original
    assert gguf.GGUFReader is original
    with pytest.raises(RuntimeError), shared_gguf_reads():
        raise RuntimeError
    assert gguf.GGUFReader is original


def test_accuracy_level_is_a_weight_flag_of_the_runners(tmp_path):
    """generate/eval/serve/lm-eval take --accuracy-level like export: its own export-cache entry, its MatMulNBits."""

    from llgraph.runtime.backends import open_runner
    from llgraph.weight_request import Weights

    standard = Weights(kernels="standard")
    # each level its own entry; the default (by format: level 4 for K-quant super-blocks, 0 else) one of its own
    assert len({standard.mode, standard.replace(accuracy_level=4).mode, standard.replace(accuracy_level=0).mode}) == 3
    open_runner("smollm2", "ort", max_seq_len=64, cache_dir=str(tmp_path),
                weights=standard.replace(accuracy_level=4))
    (model,) = tmp_path.glob("*/model.onnx")
    levels = {a.i for n in onnx.load(str(model), load_external_data=False).graph.node if n.op_type == "MatMulNBits"
              for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {4}


def test_bench_times_each_accuracy_level_asked(tmp_path):
    """`llgraph bench --accuracy-level 0,4`: a row per level, each timing an export whose quantized Linears compute at
    that level (what a user reads to choose one); a level that is not a number is one line, exit 2."""
    import os
    from pathlib import Path

    path = tmp_path / "bench-levels.gguf"  # a name of its own, to find the exports the bench makes in the cache
    tiny_gguf(path, T.Q8_0)
    r = llgraph("bench", str(path), "-p", "8", "-n", "2", "--repeats", "1", "--threads", "1", "--accuracy-level", "0,4")
    bad = llgraph("bench", str(path), "--accuracy-level", "exact")
    print(r.stdout[-600:])
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| llgraph ort")]
    assert [row.split("|")[1].strip() for row in rows] == ["llgraph ort, accuracy level 0",
                                                           "llgraph ort, accuracy level 4"]
    found = set()
    for model in Path(os.environ["LLGRAPH_CACHE_DIR"]).glob("bench-levels-*/model.onnx"):
        found |= {a.i for n in onnx.load(str(model), load_external_data=False).graph.node
                  if n.op_type in ("QLinear", "MatMulNBits") for a in n.attribute if a.name == "accuracy_level"}
    assert found == {0, 4}, found  # two exports, one at each level
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "0,4" in bad.stderr, bad.stderr


def test_bad_quantization_requests(tmp_path):
    path = tmp_path / "q1.gguf"
    tiny_gguf(path, T.Q1_0, tiny(**K_CFG))  # llama.cpp's newest 1-bit type: neither llgraph nor gguf reads it
    r = llgraph("export", "--checkpoint", str(path), "-o", "out", cwd=tmp_path)
    assert r.returncode == 2 and "stored as GGUF Q1_0" in r.stderr and "--dequantize" in r.stderr, r.stderr
    assert r.stderr.count("llgraph: error:") == 1
    r = llgraph("export", "--checkpoint", str(path), "--dequantize", "-o", "out", cwd=tmp_path)
    print(r.stderr)
    errors = [line for line in r.stderr.splitlines() if "llgraph: error:" in line]
    assert r.returncode == 2 and len(errors) == 1 and "Q1_0" in errors[0] and "Traceback" not in r.stderr
    for args, message in ((["--quantize", "int4", "--block-size", "48"], "must be a power of 2"),
                          (["--quantize", "int4", "--block-size", "128"], "does not divide the input features"),
                          (["--quantize", "int3"], "invalid choice: 'int3'"),
                          (["--lm-head", "int4", "--block-size", "128"], "does not divide the input features of "
                                                                         "lm_head.weight"),
                          (["--lm-head", "int4", "--dequantize"], "--lm-head and --dequantize contradict"),
                          (["--quantize", "int4", "--target", "onnx", "--accuracy-level", "4"],
                           "only for --target ort")):
        r = llgraph("export", "--config", "tiny", *args, "-o", "bad", cwd=tmp_path)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q1.gguf"]


def test_packed_qkv_keeps_one_format(tmp_path):
    """q, k, v of a layer in different GGUF types cannot share one quantized Linear: they stay three, each in its
    own format (Q4_K_M stores v in Q6_K on some layers), never one float Linear."""
    cfg = tiny(hidden_size=64, intermediate_size=128, head_dim=16)
    source = random_weights(cfg, seed=5, std=0.25)
    write_gguf(tmp_path / "mixed.gguf", cfg, source,
               lambda i, name, x: T.F32 if x.ndim == 1 or "_proj" not in name else
               (T.Q8_0 if "v_proj" in name else T.Q4_0))
    from llgraph.passes import model_graph
    graph = model_graph(cfg, quant=GGUFSource(tmp_path / "mixed.gguf").quant_format)
    ops = [(n.op, n.inputs[1], n.attrs.get("bits")) for n in graph.nodes if n.op in ("Linear", "QLinear")]
    print(ops)
    assert "Linear" not in [op for op, name, _ in ops if name.startswith("model.layers.")]  # the head is F32 here
    for part, bits in (("q_proj", 4), ("k_proj", 4), ("v_proj", 8), ("o_proj", 4)):
        assert ("QLinear", f"model.layers.0.self_attn.{part}.weight.codes", bits) in ops
