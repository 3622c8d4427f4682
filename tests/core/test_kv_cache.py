"""The KV cache formats (llgraph/kv_cache.py): the int8 rows as defined, the torch executor writing the same bytes,
ONNX Runtime (llgraph's kernels) and the executor agreeing in each format, and a long context in each format within
its stated KL of the float32 cache."""

import numpy as np
import pytest
import torch

from llgraph.attention_torch import from_cache, to_cache
from llgraph.errors import LlgraphError
from llgraph.kv_cache import dequantize_int8, kv_format, quantize_int8

# mean KL(f32 cache || format) along a 1,024-token greedy generation of SmolLM2 (runtime/bench/kv_cache.py measures
# ~2e-4 for int8, ~1e-7 for float16 there, and 1.2e-3 / 1.3e-6 on 2,048 tokens of prose)
STATED_KL = {"float16": 1e-5, "int8": 2e-3}


def test_int8_rows_hold_codes_then_the_float32_scale():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 3, 64)) * np.array([1e-3, 1, 50])[None, :, None]).astype(np.float32)
    x[0, 0] = 0  # a row of zeros: scale 0, codes 0
    rows = quantize_int8(x)
    assert rows.shape == (5, 3, 68) and rows.dtype == np.int8
    scale = np.ascontiguousarray(rows[..., 64:]).view(np.float32)[..., 0].astype(np.float64)
    np.testing.assert_allclose(scale, np.abs(x.astype(np.float64)).max(-1) / 127, rtol=1e-6)
    err = np.abs(dequantize_int8(rows) - x)
    ratio = float((err / (scale[..., None] / 2 + 1e-30)).max())
    print(f"int8 rows: worst error {ratio:.4f} of half a code step")
    assert ratio <= 1 + 1e-5 and not dequantize_int8(rows)[0, 0].any()


def test_the_executor_writes_the_definitions_bytes():
    """The torch executor's int8 and float16 rows equal numpy's of the definition, byte for byte."""
    x = torch.randn(2, 4, 3, 64) * 5
    assert np.array_equal(to_cache(x, torch.int8).numpy(), quantize_int8(x.numpy()))
    assert np.array_equal(to_cache(x, torch.float16).numpy(), x.numpy().astype(np.float16))
    np.testing.assert_allclose(from_cache(to_cache(x, torch.int8), torch.float32).numpy(),
                               dequantize_int8(quantize_int8(x.numpy())), rtol=1e-6, atol=1e-6)


def test_format_names_and_refusals():
    assert kv_format("f16").name == "float16" and kv_format("INT8").name == "int8" and kv_format("fp32").row(64) == 64
    assert kv_format("int8").bytes_per_token(30, 3, 64) == 2 * 30 * 3 * 68
    with pytest.raises(LlgraphError, match="use f32, f16 or int8"):
        kv_format("q4")


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_the_executor_keeps_its_own_dtype_by_default(dtype):
    """Without a format asked, the executor's cache holds its dtype's floats, whichever (the float64 reference)."""
    from llgraph.checkpoint import random_weights
    from llgraph.config import LlamaConfig
    from llgraph.runtime.backends.pytorch import TorchBackend

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2)
    b = TorchBackend(cfg, random_weights(cfg), max_seq_len=8, dtype=dtype)
    b.allocate(1)
    assert b.kv_format().name == dtype and b.kv_bytes_per_token() == 2 * 1 * 2 * 8 * (8 if dtype == "float64" else 2)
    assert np.isfinite(b.forward(np.array([[1, 2, 3]]), np.array([[0, 1, 2]]))).all()


@pytest.fixture(scope="module")
def smollm2_kernels(smollm2_export):
    return smollm2_export("ort", kernels="llgraph", max_seq_len=1200)


# KL between the two engines keeping the same format: their float32 computations differ by ~1e-6, and where that
# moves a value across a rounding boundary the stored code differs (int8: one in ~4,000 values; the rest of the model
# carries it on), so the agreement is the format's own scale: int8's KL from the float32 cache is ~8e-4 here
AGREE_KL = {"float16": 1e-5, "int8": 1e-3}


@pytest.mark.parametrize("fmt", ["float16", "int8"])
def test_onnx_runtime_and_the_executor_agree_in_each_format(smollm2_kernels, fmt, report):
    """The same 96-token prompt through SmolLM2 on llgraph's C++ kernel and on the torch executor, both keeping the
    cache in `fmt`: two implementations of the format (with a float32 cache they agree to KL ~1e-11)."""
    from llgraph.bundled import bundled_model
    from llgraph.runtime.backends.ort import OrtBackend
    from llgraph.runtime.backends.pytorch import TorchRunner
    from llgraph.runtime.bench.kl import log_softmax

    ids = np.random.default_rng(1).integers(0, 49152, (1, 96))
    pos = np.arange(96)[None]
    ort_b = OrtBackend(smollm2_kernels, 128, kv_cache=fmt)
    torch_b = TorchRunner(bundled_model("smollm2"), max_seq_len=128, kv_cache=fmt).backend
    got = []
    for b in (ort_b, torch_b):
        b.allocate(1, zeroed=True)
        b.forward(ids[:, :80], pos[:, :80])  # a prefill, then decode steps reading it
        got.append(np.concatenate([b.forward(ids[:, t:t + 1], pos[:, t:t + 1]) for t in range(80, 96)], 1))
    a, b = (log_softmax(g[0].astype(np.float64)) for g in got)
    relative = np.abs(got[0] - got[1]).max() / np.abs(got[1]).max()
    print(f"{fmt}: logits' max |difference| relative to max |logit|: {relative:.2e}")
    report(f"SmolLM2 with a {fmt} cache, mean KL(ONNX Runtime || the executor) over 16 decode steps",
           float((np.exp(a) * (a - b)).sum(-1).mean()), AGREE_KL[fmt])


def test_a_long_context_in_each_format_stays_within_its_stated_kl(smollm2_kernels):
    from llgraph.runtime.backends.ort import ORTRunner
    from llgraph.runtime.bench.kv_cache import against_exact, sequence

    exact = ORTRunner(smollm2_kernels, 1100, kv_cache="f32")
    seq = sequence(exact, "Write a long, detailed history of the city of Paris, century by century.", 1024)
    engines = {f: ORTRunner(smollm2_kernels, 1100, kv_cache=f).backend for f in STATED_KL}
    kls, same = against_exact(exact.backend, engines, seq)
    for f, kl in kls.items():
        print(f"{f} cache over {len(seq)} tokens: mean KL {kl.mean():.2e} (stated {STATED_KL[f]:.0e}), top token "
              f"the f32 cache's at {same[f].mean() * 100:.1f}% of positions")
        assert kl.mean() <= STATED_KL[f]
