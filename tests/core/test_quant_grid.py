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
from llgraph.grid_superblocks import AS_SUPERBLOCKS, EXPONENT, as_superblocks, fits
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


@pytest.mark.parametrize("kind", ["IQ2_XXS", "IQ2_S", "IQ1_M", "TQ1_0"])
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


# a block's d that keeps its scale, and one that does not (IQ3_S: 16 d past 65,504; IQ3_XXS's d always does, the odd
# subnormal 3 x 2^-24 too, whose d / 2 is no float16: the exponent holds the 1/2)
D_BYTES = {"IQ3_XXS": ((3, 0), None), "IQ3_S": (np.float16(4094).tobytes(), np.float16(4096).tobytes())}


@pytest.mark.parametrize("kind", list(AS_SUPERBLOCKS))
def test_iq3_blocks_are_superblock_weights_exactly(kind, report):
    """Random IQ3_XXS / IQ3_S blocks as Q6_K / Q5_K super-blocks (grid_superblocks.AS_SUPERBLOCKS): gguf's
    dequantization of the repacked bytes, times 2^EXPONENT (IQ3_XXS's 1/2), equals its dequantization of the file's
    bit for bit, at the target's bytes a block of 256. A d whose scale the target cannot hold is found before
    (`fits`), and refused by the repacking."""
    target, times = AS_SUPERBLOCKS[kind], np.float32(2.0 ** EXPONENT[kind])
    raw = random_k_blocks((48, 512), T[kind], seed=7)
    packed = as_superblocks(raw, kind)
    want = gguf.quants.dequantize(raw, T[kind])
    got = gguf.quants.dequantize(packed.reshape(48, -1), T[target]) * times
    (_, size), (_, target_size) = gguf.GGML_QUANT_SIZES[T[kind]], gguf.GGML_QUANT_SIZES[T[target]]
    assert fits(raw, kind) and packed.size * size == raw.size * target_size and want.std() > 0
    report(f"{kind} as {target} vs gguf.dequantize of the {kind} blocks", float(np.abs(got - want).max()), 0.0)
    blocks = raw.reshape(-1, size).copy()
    keeps, loses = D_BYTES[kind]
    blocks[5, 0:2] = np.frombuffer(bytes(keeps), np.uint8)
    assert fits(blocks, kind) and np.array_equal(
        gguf.quants.dequantize(as_superblocks(blocks, kind).reshape(48, -1), T[target]) * times,
        gguf.quants.dequantize(blocks.reshape(48, -1), T[kind]))
    if loses is None:
        return
    blocks[5, 0:2] = np.frombuffer(bytes(loses), np.uint8)
    assert not fits(blocks, kind)
    with pytest.raises(ValueError, match=f"not {target}'s weights exactly"):
        as_superblocks(blocks, kind)


@pytest.mark.parametrize("kind, backend", [("IQ3_XXS", "ort-llgraph"), ("IQ3_XXS", "ort-standard"),
                                           ("IQ3_XXS", "onnx"), ("IQ3_S", "ort-llgraph"), ("IQ3_S", "onnx")])
def test_an_iq3_gguf_runs_as_superblocks(kind, backend, tmp_path, capfd, report):
    """A tiny GGUF whose Linears are IQ3_XXS (IQ3_S) runs as Q6_K (Q5_K) (the graph's QLinear formats; IQ3_XXS's with
    exponent -1), the tensor whose first d was made odd and subnormal (d / 2 no float16) too; a line says so;
    prefill + 8 decode steps match the float64 executor on gguf's dequantization of the file — on llgraph's kernels
    (exact, level 0), and on ONNX Runtime's and ONNX's standard ops (super-blocks widened to blocks). The targets at
    level 4 are the kernels' own test's."""
    from llgraph.checkpoint import open_model

    target, path = AS_SUPERBLOCKS[kind], tmp_path / "t.gguf"
    tiny_gguf(path, T[kind], tiny(**K_CFG))
    odd = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    assert odd.tensor_type == T[kind]
    if kind == "IQ3_XXS":  # (IQ3_S's non-fitting d, 4,096, would make weights of millions: the unit test has it)
        with open(path, "r+b") as f:  # its first block's d: 3 x 2^-24
            f.seek(odd.data_offset)
            f.write(bytes((3, 0)))
    cfg = load_config(path)
    export, _, kernels = backend.partition("-")
    weights = Weights(kernels=kernels or "auto", accuracy_level=0 if kernels == "llgraph" else None)
    formats = [(n.attrs["format"], n.attrs["exponent"]) for n in open_model(path, path, weights).graph.nodes
               if n.op == "QLinear"]
    carried = (target, EXPONENT[kind]) if kernels == "llgraph" else None  # else widened: the exponent in the scales
    assert carried is None or set(formats) == {carried}, formats
    folder = export_model(path, checkpoint=path, out=tmp_path / backend, target=export, max_seq_len=64,
                          weights=weights)
    said = [line for line in capfd.readouterr().err.splitlines() if "no llgraph kernel" in line]
    print(said)
    assert any(kind in line and f"as {target} super-blocks" in line for line in said)
    assert not any("8-bit blocks" in line for line in said)
    truth = Stepper(cfg, GGUFSource(path), batch=2, max_seq=64, dtype="float64")
    compare_steps(cfg, truth, OrtStepper(folder, cfg, batch=2, max_seq=64), report, f"{backend} {kind} as {target}",
                  tol=1e-3)
