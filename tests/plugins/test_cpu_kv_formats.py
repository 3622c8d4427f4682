"""GroupedAttention over each KV cache format (llgraph/kv_cache.py: float16; int8 rows of D codes and a float32 scale)
on each instruction-set path, against numpy's float64: the rows the step writes within the format's own rounding of
the exact float64 keys and values, every other slot's bytes untouched, and the output equal to float64 attention over
the cache as stored (decoded here, independently of llgraph)."""

import os
import subprocess
import sys

import pytest
from test_cpu_attention import REFERENCE
from test_cpu_kernels import library  # noqa: F401 (fixture)

from llgraph.plugins import cpu

# argv: the library, the format; prints the instruction set, then per case: the output's worst |difference| relative
# to max |reference|, the written rows' worst error as a fraction of the format's bound, and whether every other
# slot kept its bytes
PROBE = r'''
fmt = sys.argv[2]


def encode(x):  # float rows [..., D] -> the format (the definition in llgraph/kv_cache.py, written out again here)
    if fmt == "float16":
        return x.astype(np.float16)
    scale = (np.abs(x).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    codes = np.rint(x / np.where(scale > 0, scale, 1)).astype(np.int8)
    return np.concatenate([codes, scale.view(np.int8)], -1)


def decode(rows):  # the format -> float64 [..., D]
    if fmt == "float16":
        return rows.astype(np.float64)
    scale = np.ascontiguousarray(rows[..., -4:]).view(np.float32).astype(np.float64)
    return rows[..., :-4].astype(np.float64) * scale


def bound(x):  # the format's rounding bound of each value of float64 rows x
    if fmt == "float16":
        return np.abs(x) * 2.0 ** -11 + 2.0 ** -25  # half an ulp (subnormals: half their spacing)
    return np.abs(x).max(-1, keepdims=True) / 127 / 2 * (1 + 1e-5) + 1e-12  # half a code step (float32 division)


isa = ctypes.CDLL(lib).llgraph_cpu_isa
isa.restype = ctypes.c_char_p
print(isa().decode())
onnx_type = TensorProto.FLOAT16 if fmt == "float16" else TensorProto.INT8
cases = [(6, 2, 64, [[5, 6, 7], [2, 3, 4]], 0, 0.0, 0), (6, 2, 64, [[40]], 3, 0.0, 1),
         (4, 4, 24, [[0, 1], [6, 7]], 0, 0.5, 0), (8, 2, 128, [[33], [17]], 0, 0.0, 1),
         (2, 1, 32, [[3, 4, 5]], 2, 0, 0), (8, 2, 128, [[140], [70]], 0, 0.0, 0)]  # > 64 rows: several blocks
for H, KV, D, positions, window, softcap, interleaved in cases:
    pos = np.array(positions, np.int64)
    B, S = pos.shape
    T = max(48, int(pos.max()) + 1)
    P = T + 16
    qkv = (rng.standard_normal((B, S, (H + 2 * KV) * D)) * 3).astype(np.float32)
    qkv[..., -D:] *= 1e-4  # a value head of small magnitudes: the format's relative precision, not just absolute
    past_k, past_v = (encode((rng.standard_normal((B, KV, T, D)) * 3).astype(np.float32)) for _ in range(2))
    cos, sin = tables(P, D)
    scale = 1 / np.sqrt(D)
    session = node_model(H, KV, scale, window, softcap, interleaved,
                         [("qkv", TensorProto.FLOAT, qkv.shape), ("past_k", onnx_type, past_k.shape),
                          ("past_v", onnx_type, past_v.shape), ("pos", TensorProto.INT64, pos.shape)], cos, sin)
    out, got_k, got_v = session.run(None, {"qkv": qkv, "past_k": past_k, "past_v": past_v, "pos": pos})
    want_k, want_v = write(qkv, decode(past_k), decode(past_v), pos, cos.astype(np.float64), sin.astype(np.float64),
                           H, KV, interleaved)
    written = np.zeros((B, KV, T), bool)
    for b in range(B):
        written[b, :, pos[b]] = True
    kept = all(np.array_equal(g[~written], p[~written]) for g, p in ((got_k, past_k), (got_v, past_v)))
    rows = max(float((np.abs(decode(g)[written] - w[written]) / bound(w[written])).max())
               for g, w in ((got_k, want_k), (got_v, want_v)))
    want = attend(qkv, decode(got_k), decode(got_v), pos, cos.astype(np.float64), sin.astype(np.float64), H, KV,
                  scale, window, softcap, interleaved)
    print(float(np.abs(out - want).max() / np.abs(want).max()), rows, int(kept))
'''


@pytest.mark.parametrize("fmt", ["float16", "int8"])
@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_each_kv_format_equals_float64_on_every_path(library, isa, fmt, report):  # noqa: F811
    """Prefill rows, decode steps and a verify, windows and softcaps, head sizes 24 (the vector loops' fallback),
    32, 64 and 128; one value head a ten-thousandth the others' size (the format's relative precision)."""
    r = subprocess.run([sys.executable, "-c", REFERENCE + PROBE, str(library), fmt], capture_output=True, text=True,
                       env={**os.environ, cpu.ISA_ENV: isa})
    assert r.returncode == 0, r.stderr[-2000:]
    ran, *cases = r.stdout.split("\n")
    if ran != isa:
        pytest.skip(f"this CPU has no {isa} (the library runs {ran})")
    results = [tuple(map(float, c.split())) for c in cases if c]
    assert len(results) == 6 and all(kept == 1 for *_, kept in results), "a slot the step did not write changed"
    report(f"{fmt} cache on {ran}: written rows' worst error / the format's rounding bound",
           max(r[1] for r in results), 1.0)
    report(f"{fmt} cache on {ran}: attention over the stored cache vs float64, relative to max |reference|",
           max(r[0] for r in results), 1e-5)
