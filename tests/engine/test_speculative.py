"""Speculative decoding (runtime/engine/speculative.py): greedy output equals plain decoding token for token on every
backend, batched and alone; sampled output keeps plain sampling's distribution (a chi-square test over many seeds,
which a deliberately broken rejection rule fails); bad settings are one line."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import llgraph.runtime.engine.speculative as speculative
from llgraph.runtime import RequestError
from llgraph.runtime.engine.sampling import Sampling

# mixed lengths; the first two repeat themselves, so prompt lookup has something to draft from
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [3, 4, 3, 4, 3], [60, 61, 62, 63, 64], [7]]


@pytest.mark.parametrize("backend", ["torch", "ort", "ort-llgraph", "onnx", "trt"])
def test_greedy_speculative_equals_plain_on_every_backend(backend, tiny_runners, monkeypatch):
    """A random tiny model never repeats its context, so its drafts are forced: the plain continuation with every
    third drafted token wrong, so steps verify drafts of every length, accept some and reject the rest."""
    runner = tiny_runners[2][backend]
    plain = runner.generate(PROMPTS, 40)
    assert runner.generate(PROMPTS, 40, speculative="ngram")[0].token_ids == plain[0].token_ids  # real lookup
    sequences = [[*p, *g.token_ids] for p, g in zip(PROMPTS, plain)]

    def propose(self, k):
        whole = next(s for s in sequences if s[:len(self.tokens)] == self.tokens)
        draft = whole[len(self.tokens):len(self.tokens) + k]
        return [t if (len(self.tokens) + i) % 3 else (t + 1) % 97 for i, t in enumerate(draft)]

    monkeypatch.setattr(speculative.Lookup, "propose", propose)
    fast = runner.generate(PROMPTS, 40, speculative="ngram")
    assert [g.token_ids for g in fast] == [g.token_ids for g in plain]
    for p, g in zip(PROMPTS, plain):
        assert runner.generate(p, 40, speculative="ngram").token_ids == g.token_ids
    stats = {}
    "".join(runner.stream(PROMPTS[0], 40, speculative="ngram", stats=stats))
    print(f"{backend}: drafted {stats['drafted']}, accepted {stats['accepted']}")
    assert 0 < stats["accepted"] < stats["drafted"]  # the steps really verified drafts, and rejected some


def test_greedy_speculative_equals_plain_on_smollm2_with_penalty_and_stop(serve_export):
    from llgraph.runtime import ORTRunner

    runner = ORTRunner(serve_export, max_seq_len=256)
    text = __import__("llgraph.bundled").bundled.PASSAGE.read_text()[:600]
    prompts = [[{"role": "user", "content": "Repeat this passage exactly:\n\n" + text}], "The capital of France is",
               [{"role": "user", "content": "Write a haiku about the sea."}]]
    for kwargs in ({}, {"repetition_penalty": 1.3}, {"stop": ["\n\n"]}):
        plain = runner.generate(prompts, 48, **kwargs)
        fast = runner.generate(prompts, 48, speculative="ngram", **kwargs)
        assert [(g.token_ids, g.text, g.finish_reason) for g in fast] == \
               [(g.token_ids, g.text, g.finish_reason) for g in plain], kwargs
    stats = {}
    "".join(runner.stream(prompts[0], 48, speculative="ngram", stats=stats))
    print(f"quoting: {stats['accepted']} of {stats['drafted']} drafted tokens accepted")
    assert stats["accepted"] >= 24


def _chi_square_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square test of equal distributions over counts `a`, `b` (categories with any count)."""
    keep = (a + b) > 0
    a, b = a[keep].double(), b[keep].double()
    total = a + b
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    stat = (((a - ea) ** 2 / ea) + ((b - eb) ** 2 / eb)).sum()
    df = keep.sum().item() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _first_tokens(runner, draft, n: int, mode: str) -> torch.Tensor:
    """Counts of the 2nd and 3rd sampled tokens (the ones speculation verifies) over n seeds: batches of rows, row r
    of a batch sampling with seed + r as that prompt alone would."""
    counts = torch.zeros(2, runner.backend.vocab_size, dtype=torch.int64)
    for seed in range(0, n, 250):
        for g in runner.generate([[5, 6, 7]] * min(250, n - seed), 3, temperature=1.5, seed=seed, speculative=mode):
            counts[0, g.token_ids[1]] += 1
            counts[1, g.token_ids[2]] += 1
    return counts


def test_sampled_speculation_keeps_the_distribution_and_a_broken_rule_does_not(tiny_runners, monkeypatch):
    """Whatever the draft, the rule keeps plain sampling's distribution: the drafts here are forced (the plain
    greedy continuation), so every seed verifies two drafted tokens."""
    runner = tiny_runners[2]["torch"]
    draft = runner.generate([5, 6, 7], 3).token_ids[1:]
    monkeypatch.setattr(speculative.Lookup, "propose", lambda self, k: draft[:k])
    n = 1500
    plain, spec = _first_tokens(runner, draft, n, "off"), _first_tokens(runner, draft, n, "ngram")
    p = [_chi_square_p(plain[i], spec[i]) for i in range(2)]
    print(f"speculative vs plain sampling, {n} seeds: chi-square p = {p[0]:.3f} (2nd token), {p[1]:.3f} (3rd)")
    assert min(p) > 1e-3

    def broken(logits, draft, params, seen, generator, matcher=None, counts=None):  # keeps every draft: q in place of p
        row = logits[len(draft)].astype(np.float64) / params.temperature
        return [*draft, int(generator.choice(len(row), p=np.exp(row - row.max()) / np.exp(row - row.max()).sum()))]
    monkeypatch.setattr(speculative, "accept", broken)
    bad = _first_tokens(runner, draft, n, "ngram")
    p_bad = _chi_square_p(plain[0], bad[0])
    print(f"a rule that keeps every draft: p = {p_bad:.2e}")
    assert p_bad < 1e-6


def test_accept_draws_from_p_exactly():
    """The rule on its own: the first emitted token's frequencies over 20,000 draws match p (goodness of fit), with
    a draft token of probability 0.3; sampling the residual with the draft left in fails."""
    gen = np.random.default_rng(0)
    logits = (gen.standard_normal((2, 12)) * 1.5).astype(np.float32)
    logits[0, 4] = logits[0].max() + 0.2
    p = torch.from_numpy(logits[0]).softmax(-1)
    params, counts = Sampling(temperature=1.0), torch.zeros(12, dtype=torch.int64)
    for _ in range(20000):
        counts[speculative.accept(logits, [4], params, np.zeros((1, 12), np.bool_), gen)[0]] += 1
    expected = p.double() * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    p_fit = float(torch.special.gammaincc(torch.tensor(11 / 2, dtype=torch.float64), stat / 2))
    print(f"p(draft) = {p[4]:.3f}; goodness of fit p = {p_fit:.3f}")
    assert p_fit > 1e-3


@pytest.mark.parametrize("mode", ["always", "draft", None, 3])
def test_a_bad_mode_is_one_line(mode, tiny_runners):
    with pytest.raises(RequestError, match="speculative .* must be one of off, ngram"):
        tiny_runners[2]["torch"].generate([5, 6], 4, speculative=mode)


@pytest.mark.parametrize("draft_max", [1, 3])
def test_draft_max_bounds_every_draft_and_keeps_the_output(draft_max, tiny_runners, monkeypatch):
    """--draft-max / draft_max: no step drafts more, whatever the lookup offers; greedy output unchanged."""
    runner = tiny_runners[2]["ort"]
    plain = runner.generate(PROMPTS[0], 30).token_ids
    offered = plain[:]  # the lookup proposes the true continuation: every draft would be kept, so k would grow
    lengths = []
    real = speculative.Drafter.draft

    def draft(self, room):
        d = real(self, room)
        lengths.append(len(d))
        return d
    monkeypatch.setattr(speculative.Lookup, "propose", lambda self, k: offered[len(self.tokens) - len(PROMPTS[0]):][:k])
    monkeypatch.setattr(speculative.Drafter, "draft", draft)
    assert runner.generate(PROMPTS[0], 30, speculative="ngram", draft_max=draft_max).token_ids == plain
    print(f"draft_max {draft_max}: draft lengths {lengths}")
    assert max(lengths) == draft_max


@pytest.mark.parametrize("draft_max", [0, -2, 1.5, "4", True])
def test_a_bad_draft_max_is_one_line(draft_max, tiny_runners):
    with pytest.raises(RequestError, match=r"draft_max \(.*\) must be an integer >= 1"):
        tiny_runners[2]["torch"].generate([5, 6], 4, speculative="ngram", draft_max=draft_max)


def test_a_draft_model_gives_plain_greedy_output(serve_export, smollm2_export, tiny_runners):
    """A draft model (here the 4-bit SmolLM2 drafting for the float32 one; and the tiny model for itself, with a
    batch) drafts greedily, so the target's greedy output is unchanged; most of its drafts are kept."""
    from llgraph.runtime import ORTRunner

    target = ORTRunner(serve_export, max_seq_len=256)  # the GGUF dequantized to float32
    draft = ORTRunner(smollm2_export("ort", quantized=True), max_seq_len=256)  # its Q4_1 blocks as stored
    prompts = [[{"role": "user", "content": "Write a haiku about the sea."}], "The capital of France is"]
    stats = {}
    "".join(target.stream(prompts[0], 32, speculative=draft, stats=stats))
    assert [g.token_ids for g in target.generate(prompts, 32, speculative=draft)] == \
           [g.token_ids for g in target.generate(prompts, 32)]
    print(f"int4 drafting for fp32: {stats['accepted']} of {stats['drafted']} drafted tokens kept")
    assert stats["accepted"] > stats["drafted"] / 2
    tiny = tiny_runners[2]["ort"]
    assert [g.token_ids for g in tiny.generate(PROMPTS, 20, speculative=tiny_runners[2]["torch"])] == \
           [g.token_ids for g in tiny.generate(PROMPTS, 20)]

    with pytest.raises(RequestError, match="the draft model's vocabulary \\(97 tokens\\) is not the model's"):
        target.generate("Hi", 4, speculative=tiny)


def test_cli_draft_of_another_vocabulary_is_one_line_exit_2(tmp_path):
    import subprocess
    import sys

    def llgraph(*args):
        return subprocess.run([sys.executable, "-m", "llgraph", *args], capture_output=True, text=True, cwd=tmp_path)

    assert llgraph("export", "--config", "tiny", "-o", "tiny-ort").returncode == 0
    r = llgraph("generate", "smollm2", "--prompt", "Hi", "--max-new-tokens", "4", "--max-seq-len", "128",
                "--speculative", f"draft={tmp_path / 'tiny-ort'}")
    print(r.stderr)
    last = r.stderr.strip().splitlines()[-1]  # (after the first run's progress lines)
    assert r.returncode == 2 and not r.stdout
    assert last.startswith("llgraph: error: the draft model's vocabulary (256 tokens)")
    r = llgraph("serve", "smollm2", "--max-seq-len", "128", "--port", "0", "--speculative",
                f"draft={tmp_path / 'tiny-ort'}")  # before anything listens
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("llgraph: error: the draft model's vocabulary (256 tokens)")
    r = llgraph("generate", "smollm2", "--prompt", "Hi", "--speculative", "draft=")
    assert r.returncode == 2 and "is not off, ngram or draft=MODEL" in r.stderr
    for args in (("generate", "smollm2", "--prompt", "Hi"), ("serve", "smollm2")):
        r = llgraph(*args, "--draft-max", "0")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is not an integer >= 1" in r.stderr, r.stderr


class _Noisy:
    """A weight source's tensors plus seeded noise: a draft model that agrees with the model on most tokens."""

    def __init__(self, source, scale: float):
        self.source, self.scale = source, scale

    def names(self):
        return self.source.names()

    def load(self, name):
        w = np.asarray(self.source.load(name))
        rng = np.random.default_rng(sum(map(ord, name)))
        return (w + rng.normal(0, self.scale, w.shape)).astype(w.dtype)


@pytest.mark.parametrize("backend", ["ort", "ort-llgraph", "torch"])
def test_the_scheduler_s_draft_model_keeps_16_concurrent_requests_solo(backend, tiny_runners, tmp_path):
    """The scheduler's own draft model (a request's "draft"): 16 greedy requests through 4 slots, drafting with the
    tiny model plus noise (so drafts are partly wrong), with ngram and plain requests among them, each equal to its
    solo greedy answer; drafts were both kept and rejected."""
    from reference import write_hf_checkpoint

    from llgraph.runtime import TorchRunner
    from llgraph.runtime.engine.scheduler import Metrics, Scheduler

    cfg, source, runners = tiny_runners
    runner = runners[backend]
    draft = TorchRunner(write_hf_checkpoint(tmp_path / "noisy", cfg, _Noisy(source, 0.02)), max_seq_len=64)
    prompts = [PROMPTS[i % len(PROMPTS)][: 3 + i % 5] + [i + 1] for i in range(16)]
    modes = ["draft", "draft", "ngram", "off"] * 4
    solo = [runner.generate(p, 24).token_ids for p in prompts]

    class Counts(Metrics):
        drafted = accepted = 0

        def speculated(self, drafted, accepted):
            Counts.drafted, Counts.accepted = Counts.drafted + drafted, Counts.accepted + accepted

    scheduler = Scheduler(runner, slots=4, metrics=Counts(), draft=draft).start()
    try:
        handles = [scheduler.submit(p, 24, speculative=m) for p, m in zip(prompts, modes)]
        got = [h.result(timeout=120).tokens for h in handles]
    finally:
        scheduler.stop()
    print(f"{backend}: the draft model's drafts kept {Counts.accepted} of {Counts.drafted}")
    assert got == solo
    assert 0 < Counts.accepted < Counts.drafted


def test_a_scheduler_without_a_draft_model_refuses_draft_requests(tiny_runners):
    from llgraph.runtime.engine.scheduler import Scheduler

    scheduler = Scheduler(tiny_runners[2]["ort"], slots=1)
    with pytest.raises(RequestError, match="speculative 'draft' needs a draft model and this server has none"):
        scheduler.submit([5, 6], 4, speculative="draft")
    with pytest.raises(RequestError, match=r"speculative \('always'\) must be one of off, ngram$"):
        scheduler.submit([5, 6], 4, speculative="always")
    with pytest.raises(RequestError, match="the draft model's vocabulary"):
        other = SimpleNamespace(backend=SimpleNamespace(vocab_size=50, max_seq_len=64), tokenizer=None)
        Scheduler(tiny_runners[2]["ort"], slots=1, draft=other)
