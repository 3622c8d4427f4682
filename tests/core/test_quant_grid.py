"""The GGUF block types llgraph has no kernel for (llgraph/quant_grid.py: the grid i-quants, ternary, MXFP4), read
exactly: against gguf's own dequantization bit for bit, and through an export against the float64 executor."""

import gguf
import numpy as np
import pytest
from reference import OrtStepper, Stepper, random_k_blocks, tiny
from test_export import compare_steps
from test_quant import K_CFG, tiny_gguf

from llgraph.checkpoint import load_config
from llgraph.export import export_model
from llgraph.gguf_source import GGUFSource
from llgraph.quant_grid import GRID_TYPES, halves_exactly, iq3xxs_as_q6k, widen_grid
from llgraph.weight_request import Weights

T = gguf.GGMLQuantizationType


@pytest.mark.parametrize("kind", list(GRID_TYPES))
def test_grid_blocks_widen_exactly(kind, report):
    """Random blocks of each type (valid bytes: grids and signs are any bits) -> codes x scales == gguf's
    dequantization, bit for bit; the codes within int8."""
    raw = random_k_blocks((48, 512), T[kind], seed=7)
    want = gguf.quants.dequantize(raw, T[kind]).reshape(48, 512)
    q = widen_grid(raw.reshape(-1), kind, (48, 512))
    got = q.dequantized(np.dtype(np.float32))
    print(f"{kind}: |w| max {np.abs(want).max():.3g}, std {want.std():.3g}, codes {q.codes.min()}..{q.codes.max()}")
    assert np.isfinite(want).all() and want.std() > 0
    report(f"{kind} read as 8-bit blocks vs gguf.dequantize", float(np.abs(got - want).max()), 0.0)


def test_a_block_that_is_not_scale_times_codes_is_refused():
    raw = random_k_blocks((16, 256), T.IQ2_XXS, seed=1).reshape(-1).copy()
    raw[0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # a NaN scale: no codes give its weights
    with pytest.raises(ValueError, match="IQ2_XXS blocks"):
        widen_grid(raw, "IQ2_XXS", (16, 256))


@pytest.mark.parametrize("kind", ["IQ2_XXS", "IQ3_S", "IQ1_M", "TQ1_0"])
def test_a_grid_gguf_exports_and_matches_the_executor(kind, tmp_path, capfd, report):
    """A tiny GGUF whose Linears are `kind` exports on llgraph's kernels (no --dequantize), says in one line that
    those tensors run as 8-bit blocks and what that costs, and matches the float64 executor on gguf's dequantization:
    prefill + 8 decode steps."""
    tiny_gguf(tmp_path / "t.gguf", T[kind], tiny(**K_CFG))
    cfg = load_config(tmp_path / "t.gguf")
    folder = export_model(tmp_path / "t.gguf", checkpoint=tmp_path / "t.gguf", out=tmp_path / "ort", max_seq_len=64,
                          weights=Weights(kernels="llgraph", accuracy_level=0))
    said = [line for line in capfd.readouterr().err.splitlines() if "no llgraph kernel" in line]
    print(said)
    assert len(said) == 1 and kind in said[0] and "8-bit blocks" in said[0]
    truth = Stepper(cfg, GGUFSource(tmp_path / "t.gguf"), batch=2, max_seq=64, dtype="float64")
    compare_steps(cfg, truth, OrtStepper(folder, cfg, batch=2, max_seq=64), report, f"ort llgraph {kind}", tol=1e-3)


def test_iq3_xxs_blocks_are_q6k_weights_exactly(report):
    """Random IQ3_XXS blocks as Q6_K super-blocks (quant_grid.AS_SUPERBLOCKS): gguf's dequantization of the Q6_K bytes
    equals its dequantization of the IQ3_XXS ones bit for bit, at 210 bytes a block of 256 for 98. A d that does not
    halve in float16 (odd and subnormal) is found before, and refused by the repacking."""
    raw = random_k_blocks((48, 512), T.IQ3_XXS, seed=7)
    q6k = iq3xxs_as_q6k(raw)
    want = gguf.quants.dequantize(raw, T.IQ3_XXS)
    got = gguf.quants.dequantize(q6k.reshape(48, -1), T.Q6_K)
    assert halves_exactly(raw) and q6k.size * 98 == raw.size * 210 and want.std() > 0
    report("IQ3_XXS as Q6_K vs gguf.dequantize of the IQ3_XXS blocks", float(np.abs(got - want).max()), 0.0)
    blocks = raw.reshape(-1, 98).copy()
    blocks[5, 0:2] = (4, 0)  # d = 4 x 2^-24: halves
    assert halves_exactly(blocks) and np.array_equal(
        gguf.quants.dequantize(iq3xxs_as_q6k(blocks).reshape(48, -1), T.Q6_K),
        gguf.quants.dequantize(blocks.reshape(48, -1), T.IQ3_XXS))
    blocks[5, 0:2] = (3, 0)  # 3 x 2^-24: its half is no float16
    assert not halves_exactly(blocks)
    with pytest.raises(ValueError, match="not Q6_K's weights exactly"):
        iq3xxs_as_q6k(blocks)


@pytest.mark.parametrize("backend", ["ort-llgraph", "ort-standard", "onnx"])
def test_an_iq3_xxs_gguf_runs_as_q6k(backend, tmp_path, capfd, report):
    """A tiny GGUF whose Linears are IQ3_XXS: every one but the tensor whose d was made odd and subnormal runs as
    Q6_K (the graph's QLinear formats), that one as 8-bit blocks; a line says each; prefill + 8 decode steps match
    the float64 executor on gguf's dequantization of the file — on llgraph's Q6_K kernels (exact, level 0), and
    on ONNX Runtime's and ONNX's standard ops (Q6_K widened to blocks). Q6_K at level 4 is the kernels' own test's."""
    from llgraph.checkpoint import open_model

    path = tmp_path / "t.gguf"
    tiny_gguf(path, T.IQ3_XXS, tiny(**K_CFG))
    odd = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    assert odd.tensor_type == T.IQ3_XXS
    with open(path, "r+b") as f:  # its first block's d: 3 x 2^-24
        f.seek(odd.data_offset)
        f.write(bytes((3, 0)))
    cfg = load_config(path)
    target, _, kernels = backend.partition("-")
    weights = Weights(kernels=kernels or "auto", accuracy_level=0 if kernels == "llgraph" else None)
    formats = [n.attrs["format"] for n in open_model(path, path, weights).graph.nodes if n.op == "QLinear"]
    assert formats.count("blocks") == 1 and formats.count("Q6_K") == len(formats) - 1, formats
    folder = export_model(path, checkpoint=path, out=tmp_path / backend, target=target, max_seq_len=64,
                          weights=weights)
    said = [line for line in capfd.readouterr().err.splitlines() if "no llgraph kernel" in line]
    print(said)
    assert any("IQ3_XXS" in line and "as Q6_K super-blocks" in line for line in said)
    assert any("IQ3_XXS" in line and "8-bit blocks" in line for line in said)
    truth = Stepper(cfg, GGUFSource(path), batch=2, max_seq=64, dtype="float64")
    compare_steps(cfg, truth, OrtStepper(folder, cfg, batch=2, max_seq=64), report, f"{backend} IQ3_XXS as Q6_K",
                  tol=1e-3)
