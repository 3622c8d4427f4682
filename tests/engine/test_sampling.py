"""Sampling against constructed logits whose answers are known by hand."""

import ml_dtypes
import numpy as np
import pytest

from llgraph.errors import RequestError
from llgraph.runtime.engine.sampling import Sampling, apply_repetition_penalty, filter_logits, sample

NONE_SEEN = np.zeros((1, 4), np.bool_)


def draws(logits, n=400, **kwargs):
    params = Sampling(**kwargs)
    g = params.generator()
    return [int(sample(np.array([logits], np.float32), params, NONE_SEEN, g)[0]) for _ in range(n)]


def test_greedy_and_top_k_1_pick_the_argmax():
    logits = [0.1, 3.0, 2.9, -1.0]
    assert set(draws(logits, 20)) == {1}
    assert set(draws(logits, 50, temperature=5.0, top_k=1, seed=0)) == {1}


def test_greedy_takes_the_first_of_tied_maxima_per_row_in_any_float_dtype():
    rows = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 0.0, 2.0, 2.0], [-1.0, -2.0, -1.0, -5.0]])
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        got = sample(rows.astype(dtype), Sampling(), np.zeros((3, 4), np.bool_), None)
        assert got.dtype == np.int64 and got.tolist() == [1, 0, 0], dtype


def test_top_k_keeps_only_the_k_largest():
    assert set(draws([1.0, 1.1, 0.9, 5.0], temperature=3.0, top_k=2, seed=1)) == {1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = np.log([0.6, 0.3, 0.1, 1e-9]).tolist()  # probabilities 0.6, 0.3, 0.1, ~0
    assert set(draws(logits, temperature=1.0, top_p=0.5, seed=2)) == {0}  # 0.6 alone reaches 0.5
    assert set(draws(logits, temperature=1.0, top_p=0.8, seed=2)) == {0, 1}  # 0.6 < 0.8 <= 0.9
    kept = filter_logits(np.array([logits], np.float32), 0, 0.95)
    assert np.isfinite(kept).tolist() == [[True, True, True, False]]


def test_temperature_follows_the_softmax():
    logits = [0.0, 1.0, 2.0, 0.0]
    n = 4000
    got = np.bincount(draws(logits, n, temperature=2.0, seed=3), minlength=4) / n
    want = np.exp(np.array(logits) / 2.0) / np.exp(np.array(logits) / 2.0).sum()  # softmax(l / T), by hand
    print(f"empirical {got.tolist()} vs softmax(l/T) {want.tolist()}")
    assert np.abs(got - want).max() < 0.03  # 4000 draws: standard error < 0.008


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = np.array([[2.0, -2.0, 1.0, 0.5]], np.float32)
    seen = np.array([[True, True, False, False]])
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -4.0, 1.0, 0.5]]
    # after the penalty token 2 (1.0) ties token 0 (1.0); greedy takes the first, and the penalty decides between 0, 2
    params = Sampling(repetition_penalty=3.0)
    assert int(sample(logits, params, seen, params.generator())[0]) == 2


def test_seeded_sampling_is_reproducible():
    logits = np.random.default_rng(0).standard_normal(50).tolist()
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
    rows = np.array([[0.5, 40.0, 39.0, -3.0], [2.0, -1.0, 7.5, 7.4]], np.float32)
    seen = np.zeros((2, 4), np.bool_)
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
        sample(np.array([[0.0, float("nan"), 1.0, 2.0]], np.float32), params, NONE_SEEN, params.generator())


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.97])
def test_top_p_sorts_only_candidates_yet_keeps_what_a_full_sort_keeps(top_p):
    """300 tied most likely tokens (more than the first 256 candidates) in the middle of a 1000-token row, the
    rest spread out: the kept set equals a full stable sort's (ties by index) in float64."""
    logits = np.random.default_rng(0).standard_normal((1, 1000)).astype(np.float32)
    logits[0, 500:800] = 5.0
    order = np.argsort(-logits[0].astype(np.float64), kind="stable")
    p = np.exp(logits[0, order].astype(np.float64) - 5.0)
    p /= p.sum()
    want = set(order[:max(1, int((np.cumsum(p) - p < top_p).sum()))].tolist())
    got = set(np.flatnonzero(np.isfinite(filter_logits(logits, 0, top_p))[0]).tolist())
    print(f"top_p {top_p}: {len(got)} kept")
    assert got == want


def _openai_reference(logits, counts, frequency, presence, bias):
    """OpenAI's definition, written out: mu[j] - c[j] * frequency - (c[j] > 0) * presence + bias[j]."""
    out = logits.astype(np.float64) - counts * frequency - (counts > 0) * presence
    for token, b in bias.items():
        out[token] = -np.inf if b <= -100 else out[token] + b
    return out


def test_frequency_presence_and_logit_bias_as_openai_defines_them():
    from llgraph.runtime.engine.sampling import distribution

    rng = np.random.default_rng(3)
    logits = rng.standard_normal(50).astype(np.float32) * 3
    counts = rng.integers(0, 4, 50).astype(np.float32)
    bias = {7: 2.5, 11: -100, int(np.argmax(logits)): -3.0}
    params = Sampling(temperature=0.7, frequency_penalty=0.6, presence_penalty=-0.4, logit_bias=tuple(bias.items()))
    got = distribution(logits[None], params, np.zeros((1, 50), np.bool_), None, counts[None])[0]
    ref = _openai_reference(logits, counts, 0.6, -0.4, bias) / 0.7
    want = np.exp(ref - ref.max())
    want /= want.sum()
    print(f"penalized distribution vs the written-out definition: max |diff| {np.abs(got - want).max():.2e}")
    assert np.abs(got - want).max() < 1e-6 and got[11] == 0  # -100 bans
    greedy = Sampling(frequency_penalty=2.0, logit_bias=tuple(bias.items()))
    assert int(sample(logits[None], greedy, np.zeros((1, 50), np.bool_), None, counts=counts[None])[0]) == \
        int(np.argmax(_openai_reference(logits, counts, 2.0, 0.0, bias)))
    with pytest.raises(RequestError, match="frequency_penalty"):
        Sampling(frequency_penalty=2.5)


def test_penalties_and_a_ban_hold_on_every_path(smollm2_export):
    """Greedy, sampled, speculative (ngram) and grammar-constrained generation with a -100 bias on the token greedy
    decoding would pick first never emits it; a frequency penalty's greedy output equals a step-by-step reference
    that applies OpenAI's formula to the model's own logits."""
    from llgraph.runtime import open_runner
    from llgraph.runtime.engine.grammar import Grammar

    runner = open_runner(str(smollm2_export("ort", quantized=True)), "ort", max_seq_len=128)
    prompt = runner.encode("List the numbers one two three one two three one two three")
    plain = runner.generate(prompt, 12).token_ids
    banned = {plain[0]: -100}
    for kwargs in ({}, {"speculative": "ngram"}, {"temperature": 0.8, "seed": 5},
                   {"grammar": Grammar.json_schema({"type": "object"})}):
        out = runner.generate(prompt, 12, logit_bias=banned, **kwargs).token_ids
        assert plain[0] not in out, (kwargs, out)
    got = runner.generate(prompt, 10, frequency_penalty=1.5, presence_penalty=0.5).token_ids
    # the reference: the model's logits for the sequence so far, the formula applied here, argmax
    ids, counts, want = list(prompt), np.zeros(runner.backend.vocab_size), []
    for _ in range(10):
        runner.backend.allocate(1)
        logits = np.asarray(runner.backend.forward(np.array([ids]), np.arange(len(ids))[None]), np.float64)[0, -1]
        token = int(np.argmax(logits - counts * 1.5 - (counts > 0) * 0.5))
        want.append(token)
        if token in runner.eos_token_ids:
            break
        counts[token] += 1
        ids.append(token)
    print("with penalties:", got, "reference:", want, "plain:", plain[:10])
    assert got == want[:len(got)] and got != plain[:len(got)]


def test_min_p_keeps_what_reaches_min_p_of_the_most_likely():
    """Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.2 keeps p >= 0.1 (the first three), renormalised; after a
    temperature of 2 the floor applies to the tempered probabilities (vLLM's order)."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(p).tolist()
    n = 6000
    got = np.bincount(draws(logits, n, temperature=1.0, min_p=0.2, seed=4), minlength=4) / n
    want = np.where(p >= 0.2 * p.max(), p, 0) / p[p >= 0.2 * p.max()].sum()
    print(f"min_p 0.2: empirical {got.tolist()} vs formula {want.tolist()}")
    assert got[3] == 0 and np.abs(got - want).max() < 0.03  # 6000 draws: standard error < 0.007
    tempered = np.sqrt(p) / np.sqrt(p).sum()  # softmax(log p / 2)
    kept = np.isfinite(filter_logits(np.log(tempered)[None].astype(np.float32), 0, 1.0, 0.5))[0]
    assert kept.tolist() == (tempered >= 0.5 * tempered.max()).tolist() == [True, True, True, False]
    with pytest.raises(RequestError, match="min_p"):
        Sampling(min_p=1.5)


def test_min_p_holds_on_every_path(smollm2_export):
    """min_p 1 keeps only the most likely token: sampled, speculative and grammar-constrained generation at
    temperature 1 then equal greedy decoding."""
    from llgraph.runtime import open_runner
    from llgraph.runtime.engine.grammar import Grammar

    runner = open_runner(str(smollm2_export("ort", quantized=True)), "ort", max_seq_len=128)
    prompt = runner.encode("One two three one two three one two")
    greedy = runner.generate(prompt, 10).token_ids
    for kwargs in ({}, {"speculative": "ngram"}):
        assert runner.generate(prompt, 10, temperature=1.0, min_p=1.0, seed=1, **kwargs).token_ids == greedy, kwargs
    schema = Grammar.json_schema({"type": "object"})
    assert runner.generate(prompt, 8, temperature=1.0, min_p=1.0, seed=2, grammar=schema).token_ids == \
        runner.generate(prompt, 8, grammar=schema).token_ids
