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
from llgraph.quant_grid import GRID_TYPES, widen_grid
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
