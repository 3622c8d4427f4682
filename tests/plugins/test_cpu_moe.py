"""llgraph's MoE kernel (plugins/cpu/moe.inc: ops.py's QMoE, experts as GGUF super-blocks) on every instruction-set
path, one node against numpy's float64: the routing (softmax, top k, renormalised or not) and each token's experts
with gguf's own dequantization (exact mode), or level 4's stated arithmetic (x, then the activations, rounded to int8
per 32); and a row's output the same bits whether it runs alone or among others that chose other experts."""

import os
import subprocess
import sys

import pytest
from test_cpu_kernels import QLINEAR_PROBE, library  # noqa: F401 (fixture)

from llgraph.plugins import cpu

PROBE = QLINEAR_PROBE + r'''
import gguf
from gguf.quants import dequantize
from llgraph.export.cpu_layout import glu_groups, interleaver
from llgraph.quant import _from_k_blocks
sys.path.insert(0, sys.argv[2])
from reference import random_k_blocks

E, H, F = 6, 512, 256
CENTRE = {"Q4_K": 8, "Q5_K": 16, "Q6_K": 32, "IQ4_XS": 128, "Q3_K": 4, "Q2_K": 2, "MXFP4": 128}


def experts(kind, rows, cols, seed):
    """([E, rows, cols] float64 weights, [E, rows, cols] offsets O of w = S (q - c) + O, [E, rows, nsb, bytes])"""
    qtype = gguf.GGMLQuantizationType[kind]
    per = 32 if kind == "MXFP4" else 256
    raw = random_k_blocks((E * rows, cols), qtype, seed).reshape(E * rows, cols // per, -1)
    w = dequantize(raw.reshape(E * rows, -1), qtype).astype(np.float64).reshape(E, rows, cols)
    _, S, mins = _from_k_blocks(raw, kind)
    sub = 16 if kind in ("Q6_K", "Q3_K", "Q2_K") else 32
    offsets = np.zeros((E * rows, cols)) if mins is None else \
        np.repeat(S.astype(np.float64) * CENTRE[kind] + mins, sub, axis=1)
    return w, offsets.reshape(E, rows, cols), raw.reshape(E, rows, cols // per, -1)


def rounded(x):
    """x as level 4 sees it: int8 per 32, round half to even (the kernels' nearbyint)"""
    xb = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    q = np.rint(np.clip(xb * np.where(amax > 0, 127 / np.where(amax > 0, amax, 1), 0), -127, 127))
    return (q * (amax / 127)).reshape(x.shape)


def project(x, w, offsets, level):
    if level == 0:
        return x @ w.T
    x4 = rounded(x)
    return x4 @ w.T + (x - x4) @ offsets.T


def moe(x, logits, gate_up, down, biases=None, **attrs):
    names = ["x", "logits", "gate_up", "down"] + ([] if biases is None else ["gate_bias", "up_bias", "down_bias"])
    node = helper.make_node("MoE", names, ["y"], domain="llgraph", **attrs)
    inits = [numpy_helper.from_array(gate_up, "gate_up"), numpy_helper.from_array(down, "down"),
             *([] if biases is None else [numpy_helper.from_array(b, n) for b, n in zip(biases, names[4:])])]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape)),
                                            helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                                          list(logits.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("llgraph", 1)])
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(lib)
    return ort.InferenceSession(model.SerializeToString(), opts).run(None, {"x": x, "logits": logits})[0]


worst, alone_differs = {}, 0
# gpt-oss's variant last: biases on gate, up and down, its activation (alpha 1.702, beta 1), a clamp that bites; on
# K-quant experts (llama-quantize's Q4_K_M of it) and on MXFP4, as gpt-oss's GGUFs store them (blocks of 32)
# (and Q6_K experts with exponent -1, as IQ3_XXS experts run: the weights half the blocks', on gate/up or on down)
for gate_kind, down_kind, oai, (eg, ed) in (
        ("Q4_K", "Q6_K", 0, (0, 0)), ("Q5_K", "Q4_K", 0, (0, 0)), ("Q6_K", "Q5_K", 0, (0, 0)),
        ("IQ4_XS", "IQ4_XS", 0, (0, 0)), ("Q2_K", "Q3_K", 0, (0, 0)), ("MXFP4", "MXFP4", 0, (0, 0)),
        ("Q4_K", "Q6_K", 1, (0, 0)), ("MXFP4", "MXFP4", 1, (0, 0)), ("Q6_K", "Q4_K", 0, (-1, 0)),
        ("Q4_K", "Q6_K", 0, (0, -1))):
    g, og, graw = experts(gate_kind, F, H, 1)
    u, ou, uraw = experts(gate_kind, F, H, 2)
    d, od, draw = experts(down_kind, H, F, 3)
    glu = glu_groups(interleaver(gate_kind))
    gate_up = np.stack([glu(np.concatenate([graw[e], uraw[e]])) for e in range(E)])
    down = np.stack([interleaver(down_kind)(draw[e]) for e in range(E)])
    alpha, beta, limit, biases = 1.0, 0.0, 0.0, None
    if oai:
        scale = float(np.abs((rng.standard_normal(H) * 0.05) @ g[0].T).mean())  # a gate projection's size
        biases = [(rng.standard_normal(shape) * scale).astype(np.float32) for shape in ((E, F), (E, F), (E, H))]
        alpha, beta, limit = 1.702, 1.0, 1.5 * scale
    for level in (0, 4):
        for k, normalize in ((2, 1), (3, 0)):
            for T in (1, 5, 9):
                x = (rng.standard_normal((T, H)) * 0.05).astype(np.float32)
                logits = rng.standard_normal((T, E)).astype(np.float32)
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                want = np.zeros((T, H))
                for t in range(T):
                    top = np.argsort(-p[t], kind="stable")[:k]
                    w = p[t, top] / (p[t, top].sum() if normalize else 1)
                    xt = x[t].astype(np.float64)
                    for e, we in zip(top, w):
                        a, b = (2.0 ** eg * project(xt, m[e], o[e], level) for m, o in ((g, og), (u, ou)))
                        if oai:
                            a, b = a + biases[0][e], b + biases[1][e]
                            a, b = np.minimum(a, limit), np.clip(b, -limit, limit)
                        act = a / (1 + np.exp(-alpha * a)) * (b + beta)
                        want[t] += we * (2.0 ** ed * project(act, d[e], od[e], level) + (biases[2][e] if oai else 0))
                attrs = dict(k=k, normalize=normalize, format=gate_kind, down_format=down_kind, rows=F,
                             accuracy_level=level, **(dict(alpha=alpha, beta=beta, limit=limit) if oai else {}),
                             **(dict(exponent=eg, down_exponent=ed) if eg or ed else {}))
                got = moe(x, logits, gate_up, down, biases, **attrs)
                variant = "-gpt-oss" if oai else f"-exponents{eg},{ed}" if eg or ed else ""
                key = f"{gate_kind}/{down_kind}{variant}-level{level}"
                worst[key] = max(worst.get(key, 0.0), float(np.abs(got - want).max() / np.abs(want).max()))
                for t in range(T):  # each row alone: the same bits as among the others
                    alone_differs += int(not np.array_equal(moe(x[t:t + 1], logits[t:t + 1], gate_up, down,
                                                                biases, **attrs)[0], got[t]))
print(isa().decode(), f"alone_differs={alone_differs}", " ".join(f"{k}={v}" for k, v in worst.items()))
'''


@pytest.mark.parametrize("isa", ["avx512vnni", "avx512", "avx2", "scalar"])
def test_moe_kernel_equals_float64_on_every_path(library, isa, report):  # noqa: F811
    """Q4_K/Q6_K, Q5_K/Q4_K, Q6_K/Q5_K, IQ4_XS and Q2_K/Q3_K experts (gate-up/down), and Q4_K/Q6_K as gpt-oss's (biased
    experts, its clamped activation), Q6_K experts with exponent -1 on gate/up or on down (IQ3_XXS's); 6 experts, k 2
    renormalised and 3 not, 1 to 9 tokens; exact mode against gguf's dequantization in float64 (the routing
    included), level 4 against float64 of its int8 arithmetic: the kernel rounds its float32 activations where the
    reference rounds float64's, so an activation on a rounding boundary can take the next code, one step dx =
    max|a|/127 of its block, about 2e-3 of max |y| at these shapes (seen on the avx512 path), hence 5e-3; every row
    alone equals itself in the batch, bit for bit."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", PROBE, str(library), tests], capture_output=True, text=True,
                       env={**os.environ, cpu.ISA_ENV: isa})
    assert r.returncode == 0, r.stderr
    ran, alone, *pairs = r.stdout.split()
    if ran != isa:
        pytest.skip(f"this CPU has no {isa} (the library runs {ran})")
    assert alone == "alone_differs=0", alone
    for key, diff in ((k, float(v)) for k, v in (p.split("=") for p in pairs)):
        report(f"MoE {key} on {isa} vs float64, relative to max |y|", diff, 2e-6 if "level0" in key else 5e-3)
