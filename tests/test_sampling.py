"""Sampling against constructed logits whose answers are known by hand."""

import pytest
import torch

from llgraph.runtime.sampling import RequestError, Sampling, apply_repetition_penalty, filter_logits, sample

NONE_SEEN = torch.zeros(1, 4, dtype=torch.bool)


def draws(logits, n=400, **kwargs):
    params = Sampling(**kwargs)
    g = params.generator()
    return [int(sample(torch.tensor([logits]), params, NONE_SEEN, g)) for _ in range(n)]


def test_greedy_and_top_k_1_pick_the_argmax():
    logits = [0.1, 3.0, 2.9, -1.0]
    assert set(draws(logits, 20)) == {1}
    assert set(draws(logits, 50, temperature=5.0, top_k=1, seed=0)) == {1}


def test_greedy_takes_the_first_of_tied_maxima_per_row_in_any_float_dtype():
    rows = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 0.0, 2.0, 2.0], [-1.0, -2.0, -1.0, -5.0]])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = sample(rows.to(dtype), Sampling(), torch.zeros(3, 4, dtype=torch.bool), None)
        assert got.dtype == torch.int64 and got.tolist() == [1, 0, 0], dtype


def test_top_k_keeps_only_the_k_largest():
    assert set(draws([1.0, 1.1, 0.9, 5.0], temperature=3.0, top_k=2, seed=1)) == {1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([0.6, 0.3, 0.1, 1e-9]).log().tolist()  # probabilities 0.6, 0.3, 0.1, ~0
    assert set(draws(logits, temperature=1.0, top_p=0.5, seed=2)) == {0}  # 0.6 alone reaches 0.5
    assert set(draws(logits, temperature=1.0, top_p=0.8, seed=2)) == {0, 1}  # 0.6 < 0.8 <= 0.9
    kept = filter_logits(torch.tensor([logits]), 0, 0.95)
    assert torch.isfinite(kept).tolist() == [[True, True, True, False]]


def test_temperature_follows_the_softmax():
    logits = [0.0, 1.0, 2.0, 0.0]
    n = 4000
    got = torch.bincount(torch.tensor(draws(logits, n, temperature=2.0, seed=3)), minlength=4) / n
    want = torch.tensor(logits).div(2.0).softmax(-1)
    print(f"empirical {got.tolist()} vs softmax(l/T) {want.tolist()}")
    assert (got - want).abs().max() < 0.03  # 4000 draws: standard error < 0.008


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seen = torch.tensor([[True, True, False, False]])
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -4.0, 1.0, 0.5]]
    # after the penalty token 2 (1.0) ties token 0 (1.0); greedy takes the first, and the penalty decides between 0, 2
    params = Sampling(repetition_penalty=3.0)
    assert int(sample(logits, params, seen, params.generator())) == 2


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(50).tolist()
    assert draws(logits, 100, temperature=1.0, seed=7) == draws(logits, 100, temperature=1.0, seed=7)
    assert draws(logits, 100, temperature=1.0, seed=7) != draws(logits, 100, temperature=1.0, seed=8)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature (-0.5) must be >= 0"),
    (dict(top_k=-1), "top_k (-1) must be an integer >= 0"),
    (dict(top_p=0.0), "top_p (0.0) must be in (0, 1]"),
    (dict(top_p=1.5), "top_p (1.5) must be in (0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty (0.0) must be > 0"),
])
def test_nonsensical_values_are_rejected(kwargs, message):
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        Sampling(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(temperature=1e-39), dict(temperature=1e-40), dict(temperature=5e-324),
                                    dict(temperature=1.0, top_p=1e-300), dict(temperature=1e-6, top_p=1e-45),
                                    dict(temperature=1e-3, repetition_penalty=1e-300)])
def test_degenerate_values_sample_the_argmax_instead_of_failing(kwargs):
    """Issue 22: temperature 1e-40 divided float32 logits into inf and top_p 1e-300 rounded to 0 in float32 and
    dropped every token; softmax then gave NaN and multinomial failed, and in the server every request decoding
    beside it. A temperature this small, or a top_p this small, means the most likely token."""
    rows = torch.tensor([[0.5, 40.0, 39.0, -3.0], [2.0, -1.0, 7.5, 7.4]])
    seen = torch.zeros(2, 4, dtype=torch.bool)
    seen[:, 1] = "repetition_penalty" in kwargs  # the penalty divides 40 by 1e-300: +inf, clamped
    params = Sampling(seed=0, **kwargs)
    got = sample(rows, params, seen, params.generator())
    assert got.tolist() == [1, 2], (kwargs, got)


@pytest.mark.parametrize("kwargs", [dict(temperature=float("inf")), dict(temperature=float("nan")),
                                    dict(top_p=float("nan")), dict(repetition_penalty=float("inf"))])
def test_non_finite_values_are_refused_naming_the_field(kwargs):
    with pytest.raises(RequestError, match=next(iter(kwargs))):
        Sampling(**kwargs)


def test_non_finite_logits_are_a_request_error_not_a_crash():
    params = Sampling(temperature=0.7, seed=0)
    with pytest.raises(RequestError, match="not finite"):
        sample(torch.tensor([[0.0, float("nan"), 1.0, 2.0]]), params, NONE_SEEN, params.generator())
