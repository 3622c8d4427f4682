"""Batch invariance of llgraph's CPU kernels: a row's logits and the keys and values it writes into the cache are the
same bits whatever shares its forward — the prompt written whole, in chunks of any length (a reused prefix followed
by the rest, chunked prefill), token by token (decode), or as one row of a right-padded batch beside others, on one
thread or two. This is what makes a seeded answer independent of the prefix cache and of its neighbours
(runtime/engine/scheduler.py).

Every GGUF block type, exact (level 0) and int8 (level 4), every KV cache format, every instruction-set path: a
tiny GGUF exported on the kernels, run by OrtBackend in a fresh process per instruction set (the library picks it
when it loads)."""

import os
import subprocess
import sys

import pytest
from test_cpu_kernels import library  # noqa: F401 (fixture)
from test_quant import T, cfg_for, tiny_gguf

from llgraph.export import export_model
from llgraph.plugins import cpu
from llgraph.weight_request import Weights

QTYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS,
          T.IQ4_NL)  # Q5_0 exact: at 5 bits

# argv: the export folders. Prints one line per folder and cache format: the largest difference of any shape from
# the whole prompt in one forward (0.0 is bit-identical).
PROBE = r'''
import sys
import numpy as np
from llgraph.plugins import cpu
from llgraph.runtime.backends.ort import OrtBackend

rng = np.random.default_rng(0)
print(cpu.isa(cpu.library(progress=False)))
for folder in sys.argv[1:]:
    for fmt in ("float32", "float16", "int8"):
        b = OrtBackend(folder, max_seq_len=64, kv_cache=fmt)
        ids = rng.integers(0, b.vocab_size, 37).tolist()
        n = len(ids)

        def run(splits):
            b.allocate(1, zeroed=True)
            start, logits = 0, []
            for end in [*splits, n]:
                logits.append(b.forward(np.array([ids[start:end]]), np.arange(start, end)[None])[0])
                start = end
            return np.concatenate(logits), {k: v[0, :, :n].astype(np.float64) for k, v in b._arrays.items()}

        whole, cache = run([])
        worst = 0.0
        for splits in ([1], [5], [9], [36], list(range(1, n)), [3, 10, 17, 30]):
            logits, c = run(splits)
            worst = max(worst, float(np.abs(logits - whole).max()), *(float(np.abs(c[k] - cache[k]).max()) for k in c))
        b.allocate(3, zeroed=True)  # the prompt as row 1 of a right-padded batch of 3 rows of other lengths
        tokens = np.zeros((3, n), np.int64)
        tokens[0, :20], tokens[1], tokens[2, :5] = ids[:20], ids, ids[5:10]
        batch = b.forward(tokens, np.broadcast_to(np.arange(n), (3, n)))
        worst = max(worst, float(np.abs(batch[1] - whole).max()))
        one = OrtBackend(folder, max_seq_len=64, kv_cache=fmt, threads=1)  # the whole prompt on one thread
        one.allocate(1, zeroed=True)
        worst = max(worst, float(np.abs(one.forward(np.array([ids]), np.arange(n)[None])[0] - whole).max()))
        print(folder, fmt, worst)
'''


@pytest.fixture(scope="module")
def exports(tmp_path_factory, library):  # noqa: F811
    folders = []
    root = tmp_path_factory.mktemp("invariance")
    for qtype in QTYPES:
        gguf = root / f"{qtype.name}.gguf"
        tiny_gguf(gguf, qtype, cfg_for(qtype))
        for level in (0, 4):
            folders.append(export_model(gguf, checkpoint=gguf, out=root / f"{qtype.name}-level{level}",
                                        max_seq_len=64, weights=Weights(kernels="llgraph", accuracy_level=level)))
    return folders


@pytest.mark.parametrize("isa", ["avx512vnni", "avx512", "avx2", "scalar"])
def test_a_row_is_the_same_bits_whatever_shares_its_forward(exports, isa):
    r = subprocess.run([sys.executable, "-c", PROBE, *map(str, exports)], capture_output=True, text=True,
                       env={**os.environ, cpu.ISA_ENV: isa})
    assert r.returncode == 0, r.stderr
    ran, *lines = r.stdout.splitlines()
    if ran != isa:
        pytest.skip(f"this CPU has no {isa} (the library runs {ran})")
    assert len(lines) == 3 * len(exports)
    for line in lines:
        print(isa, line)
    differing = [line for line in lines if float(line.split()[-1]) != 0.0]
    assert not differing, f"rows differ with the forward's shape on {isa}: {differing}"
