"""llama-perplexity's --kl-divergence-base file, as runtime/bench/kl.py writes it (llama.cpp reads llgraph's float64
reference from it) and reads it (llama.cpp's own distributions, written by llama-perplexity from a model)."""

import numpy as np

from llgraph.runtime.bench.kl import log_softmax, read_base, write_base


def test_a_base_file_reads_back_its_tokens_and_log_probabilities_within_its_16_bit_step(tmp_path):
    rng = np.random.default_rng(0)
    chunks, ctx, vocab = 3, 16, 301  # an odd vocabulary: the rows are padded to an even count of uint16
    tokens = rng.integers(0, vocab, (chunks, ctx))
    ref = log_softmax(rng.standard_normal((chunks, ctx, vocab)) * 4)
    write_base(tmp_path / "base.kld", tokens, ref)
    got_tokens, got = read_base(tmp_path / "base.kld")
    assert (got_tokens == tokens).all()
    want = ref[:, ctx // 2:ctx - 1]
    assert got.shape == want.shape
    top = want.max(-1, keepdims=True)
    step = (top - np.maximum(want.min(-1, keepdims=True), top - 16)) / 65535
    kept = want >= top - 16 + step  # entries more than 16 nats below the top read as that floor
    worst = float((np.abs(got - want) / step)[kept].max())
    print(f"{kept.sum()} log-probabilities back within {worst:.3f} steps; {(~kept).sum()} floored")
    assert worst <= 0.51  # half a step, and the float32 rounding of the stored scale and floor
    floor = (top - 16).repeat(vocab, -1)[~kept]
    assert (got[~kept] >= want[~kept] - step.repeat(vocab, -1)[~kept]).all() and (got[~kept] <= floor + 1e-3).all()
