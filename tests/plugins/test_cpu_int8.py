"""llgraph's CPU kernels at accuracy level 4 (int8 activations, integer dots): each path (AVX-512 VNNI, AVX2 for
4-bit codes, the portable one) and each layout (the blocks as stored; the interleaved one the ort export writes)
equal to numpy's float64 of the same arithmetic — x rounded to int8 per block, integer dots, the scales after — and
an export on them no farther from the executor's exact computation than ONNX Runtime's own level 4."""

import os
import subprocess
import sys

import onnx
import pytest
from reference import OrtStepper, Stepper, tiny
from test_cpu_kernels import QLINEAR_PROBE, library  # noqa: F401 (fixture)
from test_export import compare_steps
from test_quant import K_CFG, T, tiny_gguf

from llgraph.checkpoint import load_config
from llgraph.export import export_model
from llgraph.gguf_source import GGUFSource
from llgraph.plugins import cpu
from llgraph.weight_request import Weights

# One QLinear node at accuracy_level 4 per case, against numpy: x quantized per block as the kernel's definition
# says (d = max|x| / 127, round half to even), dots of the codes centred on 2^(bits-1) with it in float64, then
# scales * d, and the mins and the centre's shift through the block sums of x itself. INTERLEAVE=16 writes the
# codes as cpu_layout.interleave16 does; HALF=1 then passes the scales and mins as half floats (every case's are
# rounded to half first, as GGUF stores them).
PROBE = QLINEAR_PROBE + r'''
from llgraph.export.cpu_layout import interleave16, interleave16_5bit
worst, far = 0.0, 0.0
interleave, half = int(os.environ["INTERLEAVE"]), os.environ["HALF"] == "1"
cases = [(4, 32, 8, False, False, 1), (4, 32, 0, True, False, 3), (8, 32, 128, False, True, 5),
         (8, 16, 32, False, False, 1), (4, 64, 8, True, True, 7), (4, 16, 8, True, False, 2),
         (8, 64, 0, True, True, 9), (4, 128, 8, False, False, 2)]
if interleave:  # 5-bit codes at their own bits (GGUF's Q5_0, Q5_1), interleaved only
    cases += [(5, 32, 16, False, True, 1), (5, 32, 0, True, False, 3), (5, 32, 16, True, True, 6)]
for bits, B, zp, with_mins, with_bias, M in cases:
    N, nb = 37, 5 if B < 128 else 3
    q, codes, scales, mins, bias, x = blocks(bits, B, with_mins, with_bias, M, N, nb)
    scales = scales.astype(np.float16).astype(np.float32)
    mins = None if mins is None else mins.astype(np.float16).astype(np.float32)
    blocks_x = x.reshape(M, nb, B)
    amax = np.abs(blocks_x).max(-1)
    inv = np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32)
    xq = np.rint(np.clip(blocks_x * inv[..., None], -127, 127))
    centre = 2 ** (bits - 1)
    dots = np.einsum("mbj,obj->mob", xq, q.astype(np.float64) - centre)
    want = (dots * scales[None] * (amax / np.float32(127)).astype(np.float32)[:, None, :]).sum(-1)
    offsets = scales.astype(np.float64) * (centre - zp) + (0 if mins is None else mins)
    want = want + np.einsum("mb,ob->mo", blocks_x.astype(np.float64).sum(-1), offsets)
    w = scales[..., None].astype(np.float64) * (q.astype(np.float64) - zp) + (0 if mins is None else mins[..., None])
    exact = x.reshape(M, -1).astype(np.float64) @ w.reshape(N, -1).T
    if bias is not None:
        want, exact = want + bias, exact + bias
    attrs = {"interleave": 16, "rows": N} if interleave else {}
    given = {"codes": codes, "scales": scales, "mins": mins}
    if interleave:
        given = {k: v if v is None else interleave16(v) for k, v in given.items()}
        if bits == 5:
            given["codes"] = interleave16_5bit(q)
    if half:
        given = {k: v if v is None or k == "codes" else v.astype(np.float16) for k, v in given.items()}
    given["bias"] = bias
    got = qlinear(given, x, bits=bits, block_size=B, zero_point=zp, accuracy_level=4, **attrs).reshape(M, N)
    worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    far = max(far, float(np.abs(got - exact).max() / np.abs(exact).max()))
print(isa().decode(), worst, far)
'''


@pytest.mark.parametrize("interleave, half", [(0, 0), (16, 0), (16, 1)])
@pytest.mark.parametrize("isa", ["avx512vnni", "avx2", "scalar"])
def test_level_4_paths_equal_float64_of_the_int8_arithmetic(library, isa, interleave, half, report):  # noqa: F811
    r = subprocess.run([sys.executable, "-c", PROBE, str(library)], capture_output=True, text=True,
                       env={**os.environ, cpu.ISA_ENV: isa, "INTERLEAVE": str(interleave), "HALF": str(half)})
    assert r.returncode == 0, r.stderr
    ran, worst, far = r.stdout.split()
    if ran != isa:
        pytest.skip(f"this CPU has no {isa} (the library runs {ran})")
    report(f"level 4 on {isa}, interleave {interleave}{', half scales' if half else ''}, vs float64 of its int8 "
           "arithmetic (relative)", float(worst), 2e-6)
    print(f"(and {float(far):.2e} from the exact product: the int8 rounding of x, not an error)")
    assert 1e-4 < float(far) < 0.05  # it does round x (else level 4 would not be running), and only that much


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K])
def test_level_4_export_is_interleaved_and_as_near_exact_as_onnxruntime_s_own(library, qtype, tmp_path,  # noqa: F811
                                                                              report):
    """Prefill + 8 decode steps, batch 2, against the executor's exact computation (float64): int8 activations move
    a tiny random model's logits by tenths, so the bound is ONNX Runtime's own level 4 (MatMulNBits, an independent
    implementation of the same idea) on the same file — llgraph's may stray at most 1.25x as far. Every Linear reads
    the interleaved layout."""
    tiny_gguf(tmp_path / "t.gguf", qtype, tiny(**K_CFG) if qtype.name.endswith("_K") else None)
    cfg = load_config(tmp_path / "t.gguf")
    seen = {}
    for kernels in ("standard", "llgraph"):
        folder = export_model(tmp_path / "t.gguf", checkpoint=tmp_path / "t.gguf", out=tmp_path / kernels,
                              max_seq_len=64, weights=Weights(kernels=kernels, accuracy_level=4))
        truth = Stepper(cfg, GGUFSource(tmp_path / "t.gguf"), batch=2, max_seq=64, dtype="float64")
        compare_steps(cfg, truth, OrtStepper(folder, cfg, batch=2, max_seq=64),
                      lambda what, diff, tol: seen.setdefault(what, diff), kernels, tol=1.0)
    nodes = [n for n in onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node
             if n.domain == cpu.DOMAIN and n.op_type == "QLinear"]
    attrs = [{a.name: a.i for a in n.attribute} for n in nodes]
    assert all(a["accuracy_level"] == 4 and a["interleave"] == 16 for a in attrs)
    if qtype == T.Q5_0:  # at its own bits at level 4 too
        assert {a["bits"] for a in attrs} == {5}
    assert len(attrs) == 4 * cfg.num_layers + 1
    for part in ("logits", "present caches"):
        print(f"{qtype.name} {part} from exact: ONNX Runtime's level 4 {seen[f'standard {part}']:.3e}")
        report(f"{qtype.name} level 4 on llgraph's kernels, {part} from exact", seen[f"llgraph {part}"],
               1.25 * seen[f"standard {part}"])
