"""A long prefill on llgraph's CPU kernels holds one node's working buffers, not every node's: the resident memory a
2,048-token forward adds stays near what the activations of one layer need, whatever the number of layers (each
QLinear kept its own buffers before: SmolLM2 grew by 1.2 GB, an 8B by 13 GB at 2,048 tokens)."""

import subprocess
import sys

PROBE = r'''
import sys
import numpy as np
from llgraph.runtime.backends.ort import OrtBackend


def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096


b = OrtBackend(sys.argv[1], 2048, threads=2)
b.allocate(1)
ids = np.random.default_rng(0).integers(0, 49152, (1, 2048))
b.forward(ids[:, :64], np.arange(64)[None], keep=1)
before = resident()
b.forward(ids, np.arange(2048)[None], keep=1)
print(resident() - before)
'''


def test_a_long_prefill_adds_one_nodes_buffers_not_every_nodes(smollm2_export):
    """SmolLM2 (30 layers) as stored (Q4_1 on llgraph's kernels): a 2,048-token forward. One layer's activations at
    2,048 tokens are ~35 MB and the head's input ~5 MB; every layer's would be ~1 GB. Bound: 400 MB (the largest
    node's buffers, ONNX Runtime's arena rounding, the 2,048-position cache's pages)."""
    folder = smollm2_export("ort", quantized=True, max_seq_len=2048)
    r = subprocess.run([sys.executable, "-c", PROBE, str(folder)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    grown = int(r.stdout.split()[-1])
    print(f"resident memory added by a 2,048-token forward: {grown / 1e6:.0f} MB (bound 400 MB)")
    assert grown < 400e6
