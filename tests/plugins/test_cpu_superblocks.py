"""llgraph's CPU kernels on GGUF K-quant super-blocks read as stored (plugins/cpu/superblocks.inc): on every
instruction-set path, each format's QLinear against numpy's float64 of gguf's own dequantization (exact mode) or of
level 4's stated arithmetic (x rounded to int8 per 32), QEmbedding's rows against gguf's, and the ort export of a
Q4_K_M-shaped GGUF carrying every super-block byte for byte."""

import os
import subprocess
import sys

import onnx
import pytest
from reference import OrtStepper, Stepper, tiny
from test_cpu_kernels import QLINEAR_PROBE, library  # noqa: F401 (fixture)
from test_export import compare_steps
from test_quant import K_CFG, T, write_gguf

from llgraph.checkpoint import load_config, random_weights
from llgraph.export import export_model
from llgraph.gguf_source import GGUFSource
from llgraph.plugins import cpu
from llgraph.weight_request import Weights

# One QLinear node per (format, level, rows), 37 output rows (the last group partial), 2 super-blocks a row; the
# truth in float64: exact, x @ W^T with W gguf's dequantization; level 4, the same with x replaced by its int8
# rounding per block of 32 (numpy's rint is round-half-even, as the kernels' nearbyint), which is what level 4 is
# defined to compute — so both comparisons are tight, and level 4's own error is printed beside them.
PROBE = QLINEAR_PROBE + r'''
import gguf
from gguf.quants import dequantize
from llgraph.export.cpu_layout import interleaver
from llgraph.quant import CENTRE, _from_k_blocks, superblock_format
sys.path.insert(0, sys.argv[2])
from reference import random_k_blocks

worst = {}
N, K = 37, 512
for kind in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q3_K", "Q2_K", "IQ4_NL", "MXFP4"):
    raw = random_k_blocks((N, K), gguf.GGMLQuantizationType[kind], seed=3)
    w = dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(N, K).astype(np.float64)
    per = superblock_format(kind).block_size  # weights a block: 256 (IQ4_NL, MXFP4: 32)
    codes = interleaver(kind)(raw.reshape(N, K // per, -1))
    _, S, mins = _from_k_blocks(raw.reshape(N, K // per, -1), kind)  # w = S (q - c) + O per sub-block
    centre = {"Q4_K": 8, "Q5_K": 16, "Q6_K": 32, "Q3_K": 4, "Q2_K": 2}.get(kind, 128)  # (IQ4, MXFP4: kv + 128)
    offsets = np.zeros((N, K)) if mins is None else \
        np.repeat(S.astype(np.float64) * centre + mins, K // S.shape[1], axis=1)
    bias = rng.standard_normal(N).astype(np.float32)
    for level in (0, 4):
        for M in (1, 3, 5, 8, 19, 70):  # from 8 to 70: the Panel path for many rows (superblocks_panel.inc)
            x = rng.standard_normal((1, M, K)).astype(np.float32)
            # x as level 4 sees it: codes rint(x * (127 / amax)) and scale amax / 127, each in float32 as the kernels
            # compute them (in float64 a product within an ulp of a half rounds the other way: 70 rows find one)
            xb = x.reshape(M, K // 32, 32)
            amax = np.abs(xb).max(-1, keepdims=True)
            xq = np.rint(np.clip(xb * (np.float32(127) / amax), -127, 127)).astype(np.float64)
            x4 = (xq * (amax / np.float32(127)).astype(np.float64)).reshape(M, K)
            exact = x.reshape(M, K).astype(np.float64) @ w.T + bias
            # level 4 meets the sub-blocks' offsets (w = S (q - c) + O) with x's own block sums
            want = exact if level == 0 else x4 @ w.T + (x.reshape(M, K) - x4) @ offsets.T + bias
            got = qlinear({"codes": codes, "scales": None, "mins": None, "bias": bias}, x, format=kind,
                          bits=superblock_format(kind).bits, block_size=per,
                          zero_point=CENTRE[kind], interleave=16, rows=N,
                          accuracy_level=level).reshape(M, N)
            key = f"{kind}-level{level}"
            worst[key] = max(worst.get(key, 0.0), float(np.abs(got - want).max() / np.abs(want).max()))
            if M == 70:  # batch invariance: each row alone (Rows' path) is the same bits as in the batch (Panel's)
                alone = [qlinear({"codes": codes, "scales": None, "mins": None, "bias": bias}, x[:, m:m + 1],
                                 format=kind, bits=superblock_format(kind).bits, block_size=per,
                                 zero_point=CENTRE[kind], interleave=16, rows=N, accuracy_level=level)
                         for m in (0, 33, 69)]
                worst[key + "-alone"] = float(np.abs(np.concatenate(alone).reshape(3, N) - got[[0, 33, 69]]).max())
            worst[key + "-vs-exact"] = max(worst.get(key + "-vs-exact", 0.0),
                                           float(np.abs(got - exact).max() / np.abs(exact).max()))
    # QEmbedding: rows of the table, gguf's values (the table padded to 48 rows; ids to the last)
    ids = np.array([[0, 5, 16, 36, 17]], np.int64)
    inits = [numpy_helper.from_array(codes, "codes")]
    node = helper.make_node("QEmbedding", ["ids", "codes"], ["y"], domain="llgraph", format=kind,
                            bits=superblock_format(kind).bits, block_size=per,
                            zero_point=CENTRE[kind], rows=N)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("llgraph", 1)])
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(lib)
    rows = ort.InferenceSession(model.SerializeToString(), opts).run(None, {"ids": ids})[0]
    worst[f"{kind}-embedding"] = float(np.abs(rows[0] - w[ids[0]]).max() / np.abs(w).max())
# MXFP4's E8M0 scales over their range: row r's blocks all at exponent E[r % 7] (2^-108 .. 2^72), each row held to
# its own float64 (relative to its own max), so a wrong power of two anywhere shows (not lower: there level 4's
# d * dx, or a dot's share, falls below float32's normal range and rounds as a subnormal)
E = (20, 40, 100, 127, 128, 160, 200)
raw = random_k_blocks((N, K), gguf.GGMLQuantizationType.MXFP4, seed=4).reshape(N, K // 32, 17)
raw[..., 0] = np.array(E, np.uint8)[np.arange(N) % 7][:, None]
w = dequantize(raw.reshape(N, -1), gguf.GGMLQuantizationType.MXFP4).reshape(N, K).astype(np.float64)
for level in (0, 4):
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    got = qlinear({"codes": interleaver("MXFP4")(raw), "scales": None, "mins": None, "bias": None}, x,
                  format="MXFP4", bits=4, block_size=32, zero_point=128, interleave=16, rows=N,
                  accuracy_level=level).reshape(3, N).astype(np.float64)
    xs = x.reshape(3, K).astype(np.float64)
    if level == 4:  # x as level 4 sees it
        xb = xs.reshape(3, K // 32, 32)
        amax = np.abs(xb).max(-1, keepdims=True)
        xs = (np.rint(np.clip(xb * 127 / amax, -127, 127)) * (amax / 127)).reshape(3, K)
    want = xs @ w.T
    worst[f"MXFP4-exponents-level{level}"] = float((np.abs(got - want).max(0) / np.abs(want).max(0)).max())
# the exponent (an IQ3_XXS tensor carried as Q6_K with its file's d: the weights are 1/2 of the blocks'), with a bias
raw = random_k_blocks((N, K), gguf.GGMLQuantizationType.Q6_K, seed=5)
w = dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(N, K).astype(np.float64) / 2
bias = rng.standard_normal(N).astype(np.float32)
for level in (0, 4):
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    got = qlinear({"codes": interleaver("Q6_K")(raw.reshape(N, K // 256, -1)), "scales": None, "mins": None,
                   "bias": bias}, x, format="Q6_K", bits=6, block_size=256, zero_point=32, interleave=16, rows=N,
                  accuracy_level=level, exponent=-1).reshape(3, N).astype(np.float64)
    xs = x.reshape(3, K).astype(np.float64)
    if level == 4:  # x as level 4 sees it (x / 2 rounds to the same codes, at half the scale)
        xb = xs.reshape(3, K // 32, 32)
        amax = np.abs(xb).max(-1, keepdims=True)
        xs = (np.rint(np.clip(xb * 127 / amax, -127, 127)) * (amax / 127)).reshape(3, K)
    want = xs @ w.T + bias
    worst[f"Q6_K-exponent-1-level{level}"] = float(np.abs(got - want).max() / np.abs(want).max())
print(isa().decode(), " ".join(f"{k}={v}" for k, v in worst.items()))
'''


@pytest.mark.parametrize("isa", ["avx512vnni", "avx512", "avx2", "scalar"])
def test_every_superblock_path_equals_float64(library, isa, report):  # noqa: F811
    """Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ4_NL, MXFP4 at the exact level (fp32) and at level 4 (int8 x), 1 to
    70 input rows, with a bias, a row alone the same bits as in the batch; Q6_K with exponent -1 (IQ3_XXS's) at both
    levels."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where reference.py is
    r = subprocess.run([sys.executable, "-c", PROBE, str(library), tests], capture_output=True, text=True,
                       env={**os.environ, cpu.ISA_ENV: isa})
    assert r.returncode == 0, r.stderr
    ran, *pairs = r.stdout.split()
    if ran != isa:
        pytest.skip(f"this CPU has no {isa} (the library runs {ran})")
    worst = {k: float(v) for k, v in (p.split("=") for p in pairs)}
    for key, diff in worst.items():
        if key.endswith("-alone"):  # a row alone against the same row in a batch of 70: bit for bit
            report(f"{key} on {isa}: a row alone vs in a batch of 70", diff, 0.0)
        elif key.endswith("-vs-exact"):  # level 4's own rounding of x, reported, bounded loosely
            report(f"{key} on {isa} (x's int8 rounding), relative to max |y|", diff, 2e-2 if "level4" in key else 2e-6)
        else:
            report(f"llgraph {key} on {isa} vs float64, relative to max |y| (|w| for the table)", diff, 2e-6)


def q4_k_m_gguf(path, cfg):
    """A tiny GGUF in llama.cpp's Q4_K_M layout: Q4_K Linears and embedding, Q6_K head and every other layer's
    v and down projections, F32 norms (so q, k and v are in two formats on layer 0)."""
    source = random_weights(cfg, seed=5, std=0.25)

    def qtype(i, name, x):
        if "norm" in name:
            return T.F32
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        return T.Q6_K if name == "lm_head.weight" or (layer % 2 == 0 and ("v_proj" in name or "down_proj" in name)) \
            else T.Q4_K
    return write_gguf(path, cfg, source, qtype)


@pytest.mark.parametrize("level", [0, 4])
def test_q4_k_m_export_carries_the_superblocks_and_matches_float64(library, level, tmp_path, report):  # noqa: F811
    """The ort export on the kernels holds each GGUF tensor's super-blocks, the same bytes reordered (the weight file
    no larger than the GGUF's tensors + 2%), and runs them: prefill + 8 decode steps against the float64 executor
    on gguf's dequantization (exact: 1e-3, as test_quant's K-quants; level 4: x's int8 rounding, 0.1)."""
    cfg = tiny(**K_CFG, num_layers=2)
    expected = q4_k_m_gguf(tmp_path / "m.gguf", cfg)
    gcfg = load_config(tmp_path / "m.gguf")
    folder = export_model(tmp_path / "m.gguf", checkpoint=tmp_path / "m.gguf", out=tmp_path / "ort", max_seq_len=64,
                          weights=Weights(kernels="llgraph", accuracy_level=level))
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    formats = sorted(a.s.decode() for n in graph.node if n.op_type in ("QLinear", "QEmbedding")
                     for a in n.attribute if a.name == "format")
    print(formats)
    assert set(formats) == {"Q4_K", "Q6_K"} and "MatMulNBits" not in {n.op_type for n in graph.node}
    # the codes initializers hold the GGUF's super-blocks: as many bytes as its K-quant tensors, and no more than the
    # rows a group of 16 pads (zeros; real models' row counts are multiples of 16)
    inits = {i.name: i for i in graph.initializer}
    real = padded = 0
    for n in graph.node:
        if n.op_type in ("QLinear", "QEmbedding"):
            a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
            groups, nsb, group_bytes = inits[n.input[1]].dims
            rows = a["rows"] * (2 if a.get("activation") == 1 else 1)  # swiglu: gate and up rows
            real += rows * nsb * group_bytes // 16
            padded += groups * nsb * group_bytes
    stored = sum(GGUFSource(tmp_path / "m.gguf")._tensors[n].n_bytes for n, (_, kind, _) in expected.items()
                 if kind in (T.Q4_K, T.Q6_K))
    print(f"codes initializers {padded} B ({real} B of rows, the rest padding); the GGUF's K-quant tensors {stored} B")
    assert real == stored
    # beside them only the norms (as the GGUF's F32) and the RoPE tables the GGUF does not hold; the 4 KB alignment
    # of each initializer aside (at real sizes the folder is within 2% of the GGUF: `llgraph.runtime.bench.speed`)
    lengths = {i.name: int(next(e.value for e in i.external_data if e.key == "length")) for i in graph.initializer
               if i.data_location == onnx.TensorProto.EXTERNAL}
    rope = sum(v for k, v in lengths.items() if "cache" in k)
    gguf_tensors = sum(t.n_bytes for t in GGUFSource(tmp_path / "m.gguf")._tensors.values())
    print(f"initializers {sum(lengths.values())} B: {rope} B of RoPE tables; the GGUF's tensors {gguf_tensors} B")
    assert sum(lengths.values()) - rope - (padded - real) == gguf_tensors
    truth = Stepper(gcfg, GGUFSource(tmp_path / "m.gguf"), batch=2, max_seq=64, dtype="float64")
    if level == 0:
        compare_steps(gcfg, truth, OrtStepper(folder, gcfg, batch=2, max_seq=64), report, "Q4_K_M level 0", tol=1e-3)
        return
    # level 4 moves a tiny random model's logits by tenths: bounded by ONNX Runtime's own level 4 (MatMulNBits on the
    # widened blocks, an independent implementation of int8 activations) on the same file, as test_cpu_int8's
    theirs = export_model(tmp_path / "m.gguf", checkpoint=tmp_path / "m.gguf", out=tmp_path / "std", max_seq_len=64,
                          weights=Weights(kernels="standard", accuracy_level=4))
    seen = {}
    for what, f in (("llgraph", folder), ("standard", theirs)):
        truth = Stepper(gcfg, GGUFSource(tmp_path / "m.gguf"), batch=2, max_seq=64, dtype="float64")
        compare_steps(gcfg, truth, OrtStepper(f, gcfg, batch=2, max_seq=64),
                      lambda what, diff, tol: seen.setdefault(what, diff), what, tol=1.0)
    for part in ("logits", "present caches"):
        print(f"Q4_K_M {part} from exact: ONNX Runtime's level 4 {seen[f'standard {part}']:.3e}")
        report(f"Q4_K_M level 4 on llgraph's super-block kernels, {part} from exact", seen[f"llgraph {part}"],
               1.25 * seen[f"standard {part}"])
