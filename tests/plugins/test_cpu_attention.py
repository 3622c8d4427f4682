"""llgraph's GroupedAttention kernel (plugins/cpu/attention.inc), the ort export's attention on llgraph's kernels:
one node against numpy's float64 of the schema's definition (llgraph/ops.py GroupedAttention, with the rotary
embedding of q and k), on each instruction-set path, with a cache whose other slots hold noise."""

import os
import subprocess
import sys

import pytest
from test_cpu_kernels import library  # noqa: F401 (fixture)

from llgraph.plugins import cpu

# the schema's definition in float64: the step's rows written (`write`), then each query attending (`attend`)
REFERENCE = r'''
import ctypes, sys
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
lib, rng = sys.argv[1], np.random.default_rng(0)


def rotate(x, cos, sin, interleaved):
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else np.split(x, 2, -1)
    ra, rb = a * cos - b * sin, b * cos + a * sin
    return np.stack([ra, rb], -1).reshape(x.shape) if interleaved else np.concatenate([ra, rb], -1)


def write(qkv, past_k, past_v, pos, cos, sin, H, KV, interleaved, rows=None):
    """The caches (float64) with the step's keys (rotated) and values at their positions (position p in slot p mod
    T, the cache's length: a windowed layer's ring where T is shorter than the positions), token (b, s) in cache
    row rows[b, s] (None: b)."""
    B, S, _ = qkv.shape
    D = qkv.shape[-1] // (H + 2 * KV)
    k, v = past_k.astype(np.float64), past_v.astype(np.float64)
    new_k = qkv[..., H * D:(H + KV) * D].reshape(B, S, KV, D)
    new_v = qkv[..., (H + KV) * D:].reshape(B, S, KV, D)
    for b in range(B):
        for s in range(S):
            at, row = pos[b, s], b if rows is None else rows[b, s]
            k[row, :, at % k.shape[2]] = rotate(new_k[b, s].astype(np.float64), cos[at], sin[at], interleaved)
            v[row, :, at % k.shape[2]] = new_v[b, s]
    return k, v


def reference(qkv, past_k, past_v, pos, cos, sin, H, KV, scale, window, softcap, interleaved, rows=None, sinks=None):
    k, v = write(qkv, past_k, past_v, pos, cos, sin, H, KV, interleaved, rows)
    return attend(qkv, k, v, pos, cos, sin, H, KV, scale, window, softcap, interleaved, rows, sinks), k, v


def attend(qkv, k, v, pos, cos, sin, H, KV, scale, window, softcap, interleaved, rows=None, sinks=None):
    B, S, _ = qkv.shape
    D = k.shape[-1]
    q = qkv[..., :H * D].reshape(B, S, H, D).astype(np.float64)
    out = np.zeros((B, S, H * D))
    for b in range(B):
        for s in range(S):
            at, row = pos[b, s], b if rows is None else rows[b, s]
            lo = max(0, at - window + 1) if window else 0
            held = np.arange(lo, at + 1) % k.shape[2]  # the slots of positions lo..at
            for h in range(H):
                g = h // (H // KV)
                qr = rotate(q[b, s, h], cos[at], sin[at], interleaved)
                scores = scale * (k[row, g, held] @ qr)
                if softcap:
                    scores = softcap * np.tanh(scores / softcap)
                top = scores.max() if sinks is None else max(scores.max(), sinks[h])
                w = np.exp(scores - top)
                total = w.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))  # gpt-oss's sink
                out[b, s, h * D:(h + 1) * D] = (w / total) @ v[row, g, held]
    return out


def node_model(H, KV, scale, window, softcap, interleaved, inputs, cos, sin, sinks=None):
    """One GroupedAttention node; `inputs`: (name, onnx type, shape) of qkv, past_k, past_v, pos (and slots);
    `sinks` an initializer where given."""
    names = ["qkv", "past_k", "past_v", "pos", "cos", "sin"] + (["slots"] if len(inputs) > 4 else [])
    if sinks is not None:
        names += [""] * (7 - len(names)) + ["sinks"]
    node = helper.make_node("GroupedAttention", names, ["out", "k", "v"],
                            domain="llgraph", num_heads=H, num_kv_heads=KV, scale=float(scale), window=window,
                            softcap=softcap, rotary_interleaved=interleaved)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(*i) for i in inputs],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
         *(helper.make_tensor_value_info(n, inputs[1][1], None) for n in ("k", "v"))],
        [numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin"),
         *([] if sinks is None else [numpy_helper.from_array(sinks, "sinks")])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("llgraph", 1)])
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(lib)
    return ort.InferenceSession(model.SerializeToString(), opts)


def tables(P, D):
    angles = np.arange(P)[:, None] * (10000.0 ** (-np.arange(D // 2) / (D // 2)))[None]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

'''

# argv: the library; prints the instruction set it ran and, per case, the worst |difference| of (out, present_k,
# present_v) relative to max |reference|
PROBE = r'''
isa = ctypes.CDLL(lib).llgraph_cpu_isa
isa.restype = ctypes.c_char_p
print(isa().decode())
f = TensorProto.FLOAT
# (H, KV, D, positions per row, window, softcap, interleaved, sinks, ring): D 64 takes the vector loops, D 24 their
# fallback; gpt-oss's sinks (a logit per head in the denominator), scaled to matter; then windowed layers' rings of
# T slots shorter than the positions: a window that wraps (two runs of slots), one that does not, a prefill whose
# row spans all the ring allows beside its window (T = window + span - 1), int8-friendly D 24 on a wrap
cases = [(6, 2, 64, [[5, 6, 7], [2, 3, 4]], 0, 0.0, 0, 0, 0), (6, 2, 64, [[9]], 3, 0.0, 1, 0, 0),
         (4, 4, 24, [[0, 1], [6, 7]], 0, 0.5, 0, 0, 0), (6, 3, 64, [[40], [17]], 5, 0.7, 1, 0, 0),
         (2, 1, 32, [[3, 4, 5, 6, 7]], 2, 0.0, 0, 0, 0), (4, 2, 64, [[150, 151]], 0, 0.0, 0, 0, 0),  # > 64: blocks
         (6, 2, 64, [[0, 1, 2], [7, 8, 9]], 0, 0.0, 0, 1, 0), (8, 2, 64, [[70], [3]], 4, 0.0, 1, 1, 0),
         (6, 2, 64, [[37, 38, 39], [20, 21, 22]], 12, 0.0, 0, 0, 16), (6, 2, 64, [[40], [45]], 12, 0.0, 1, 1, 16),
         (4, 2, 64, [list(range(90, 99))], 8, 0.3, 0, 0, 16), (4, 4, 24, [[33, 34], [47, 48]], 5, 0.0, 0, 0, 8),
         # deep queries, their keys in several blocks of 256: a decode's blocks on their own threads, a prefill's in
         # turn (over 64 queries), on a ring too
         (8, 2, 64, [[700], [299]], 0, 0.0, 0, 1, 0), (4, 1, 32, [list(range(530, 600))], 0, 0.4, 1, 0, 0),
         (4, 1, 64, [[1000, 1001]], 300, 0.0, 0, 0, 320)]
for H, KV, D, positions, window, softcap, interleaved, with_sinks, ring in cases:
    sinks = (rng.standard_normal(H) * 2).astype(np.float32) if with_sinks else None
    pos = np.array(positions, np.int64)
    B, S = pos.shape
    T = ring or max(48, int(pos.max()) + 1)
    P = int(pos.max()) + 16
    qkv = rng.standard_normal((B, S, (H + 2 * KV) * D)).astype(np.float32)
    past_k, past_v = (rng.standard_normal((B, KV, T, D)).astype(np.float32) for _ in range(2))  # noise in every slot
    cos, sin = tables(P, D)
    scale = 1 / np.sqrt(D)
    session = node_model(H, KV, scale, window, softcap, interleaved,
                         [("qkv", f, qkv.shape), ("past_k", f, past_k.shape), ("past_v", f, past_v.shape),
                          ("pos", TensorProto.INT64, pos.shape)], cos, sin, sinks)
    got = session.run(None, {"qkv": qkv, "past_k": past_k, "past_v": past_v, "pos": pos})
    want = reference(qkv, past_k, past_v, pos, cos.astype(np.float64), sin.astype(np.float64), H, KV, scale, window,
                     softcap, interleaved, sinks=sinks)
    print(max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want)))
'''


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_grouped_attention_equals_float64_on_every_path(library, isa, report):  # noqa: F811
    """Rows of 1 to 5 queries at their own positions (a prefill, decode steps, a verify), 1 to 3 query heads per
    kv head, windows that cut and softcaps that bite, half and interleaved rotary, sinks (gpt-oss); the returned
    caches hold the step's keys (rotated) and values at their positions and the noise everywhere else, as passed."""
    r = subprocess.run([sys.executable, "-c", REFERENCE + PROBE, str(library)], capture_output=True, text=True,
                       env={**os.environ, cpu.ISA_ENV: isa}, check=True)
    ran, *worst = r.stdout.split()
    if ran != isa:
        pytest.skip(f"this CPU has no {isa} (the library runs {ran})")
    assert len(worst) == 15
    report(f"llgraph GroupedAttention on {ran}, worst of 15 cases (5 on rings), vs float64, relative to max "
           "|reference|",
           max(map(float, worst)), 1e-5)


# argv: the library; the slots input (each token's cache row): tokens of three rows of a five-row cache packed into
# one batch row in a mixed order, and two batch rows naming rows out of order; then the refusals
RAGGED = r'''
f, i64 = TensorProto.FLOAT, TensorProto.INT64
H, KV, D = 6, 2, 64
cases = [([[2, 2, 0, 4, 4, 4, 2]], [[7, 8, 3, 0, 1, 2, 9]]), ([[3], [1]], [[40], [12]])]
for rows, positions in cases:
    rows, pos = np.array(rows, np.int64), np.array(positions, np.int64)
    B, S = pos.shape
    T, P = 48, 64
    qkv = rng.standard_normal((B, S, (H + 2 * KV) * D)).astype(np.float32)
    past_k, past_v = (rng.standard_normal((5, KV, T, D)).astype(np.float32) for _ in range(2))
    cos, sin = tables(P, D)
    session = node_model(H, KV, 0.125, 0, 0.0, 0, [("qkv", f, qkv.shape), ("past_k", f, past_k.shape),
                         ("past_v", f, past_v.shape), ("pos", i64, pos.shape), ("slots", i64, ["n"])], cos, sin)
    feeds = {"qkv": qkv, "past_k": past_k, "past_v": past_v, "pos": pos, "slots": rows.reshape(-1)}
    got = session.run(None, feeds)
    want = reference(qkv, past_k, past_v, pos, cos.astype(np.float64), sin.astype(np.float64), H, KV, 0.125, 0, 0.0,
                     0, rows)
    print(max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want)))
for bad in (np.array([0, 5], np.int64), np.array([0], np.int64)):  # a row past the cache's; one row for two tokens
    try:
        session.run(None, {**feeds, "slots": bad})
        print("accepted")
    except Exception as e:
        print("refused:" + str(e).split("llgraph GroupedAttention: ")[-1].split(",")[0].replace(" ", "_"))
# a windowed layer's ring of 8 slots for a window of 5: a row writing 5 positions past the ring's end in one call
# would overwrite keys its own first query reads (8 < 5 + 5 - 1)
pos = np.array([[20, 21, 22, 23, 24]], np.int64)
qkv = rng.standard_normal((1, 5, (H + 2 * KV) * D)).astype(np.float32)
past_k, past_v = (rng.standard_normal((1, KV, 8, D)).astype(np.float32) for _ in range(2))
session = node_model(H, KV, 0.125, 5, 0.0, 0, [("qkv", f, qkv.shape), ("past_k", f, past_k.shape),
                     ("past_v", f, past_v.shape), ("pos", i64, pos.shape)], cos, sin)
try:
    session.run(None, {"qkv": qkv, "past_k": past_k, "past_v": past_v, "pos": pos})
    print("accepted")
except Exception as e:
    print("refused:" + str(e).split("llgraph GroupedAttention: ")[-1].split(" (")[0].replace(" ", "_"))
'''


def test_grouped_attention_reads_each_token_s_cache_row(library, report):  # noqa: F811
    """The ragged form (passes.ragged_slots): each token names its cache row; rows interleaved in one batch row and
    named out of order equal the float64 definition with that row map; a row outside the cache, a row count that
    is not one per token, or a step too long for a windowed layer's ring, is refused by name."""
    r = subprocess.run([sys.executable, "-c", REFERENCE + RAGGED, str(library)], capture_output=True, text=True,
                       check=True)
    *worst, outside, count, ring = r.stdout.split()
    assert (outside, count) == ("refused:a_slot_is_outside_the_cache's_rows",
                                "refused:slots_must_name_one_cache_row_per_token_(B_S_values)"), r.stdout
    assert ring == "refused:a_row's_positions_in_one_call_span_more_than_its_ring_holds_beside_the_window", r.stdout
    report("llgraph GroupedAttention with slots vs float64 (2 cases), relative to max |reference|",
           max(map(float, worst)), 1e-5)


# argv: the library. One row's 600 queries written whole, then its last 70 again (a prefill chunk: over 64 queries,
# each query's key blocks in turn) and its last one again (a decode: its blocks on threads of their own): the
# outputs of the same queries, and the caches, as bits
BLOCKS = r'''
f, i64 = TensorProto.FLOAT, TensorProto.INT64
H, KV, D, T, n = 8, 2, 64, 640, 600
qkv = rng.standard_normal((1, n, (H + 2 * KV) * D)).astype(np.float32)
cos, sin = tables(T, D)
session = node_model(H, KV, 0.125, 0, 0.0, 0, [("qkv", f, [1, "s", qkv.shape[2]]), ("past_k", f, [1, KV, T, D]),
                     ("past_v", f, [1, KV, T, D]), ("pos", i64, [1, "s"])], cos, sin)
zero = np.zeros((1, KV, T, D), np.float32)
whole, k, v = session.run(None, {"qkv": qkv, "past_k": zero, "past_v": zero, "pos": np.arange(n)[None]})
for start in (n - 70, n - 1):
    part, k2, v2 = session.run(None, {"qkv": qkv[:, start:], "past_k": k, "past_v": v,
                                      "pos": np.arange(start, n)[None]})
    print(int((part != whole[:, start:]).sum() + (k2 != k).sum() + (v2 != v).sum()))
'''


def test_a_query_is_the_same_bits_whether_its_blocks_run_in_turn_or_apart(library):  # noqa: F811
    r = subprocess.run([sys.executable, "-c", REFERENCE + BLOCKS, str(library)], capture_output=True, text=True,
                       check=True)
    assert r.stdout.split() == ["0", "0"], r.stdout
