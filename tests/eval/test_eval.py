"""Log-likelihood scoring and `llgraph eval`: every backend's log-likelihoods against transformers computing the
same quantities independently, rolling perplexity from its definition, and bad data refused with file and line."""

import json
import subprocess
import sys

import pytest
import torch
from reference import hf_model

from llgraph.bundled import MC_BASICS, PASSAGE
from llgraph.runtime import ORTRunner, TorchRunner

TOL = 1e-4


def hf_logprob(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """log p(continuation | context) and is-greedy, from one transformers forward, in float64."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logp = model(ids).logits[0].double().log_softmax(-1)
    span = logp[len(context) - 1:len(ids[0]) - 1]
    target = torch.tensor(continuation)
    return span.gather(-1, target[:, None]).sum().item(), bool((span.argmax(-1) == target).all())


@pytest.fixture(scope="module")
def tiny_setup(tiny_runners):
    cfg, source, runners = tiny_runners
    return cfg, hf_model(cfg, source), runners


PAIRS = [([5, 6, 7], [8, 9]), ([1], [2, 3, 4, 5, 6]), ([10, 11, 12, 13, 14, 15, 16], [17]), ([3, 3], [3, 3])]


@pytest.mark.parametrize("backend", ["torch", "ort", "ort-llgraph", "onnx", "trt"])
def test_scores_equal_transformers(backend, tiny_setup, report):
    _, hf, runners = tiny_setup
    got = runners[backend].score_batch(PAIRS, batch_size=3)  # two batches, rows of different lengths
    want = [hf_logprob(hf, c, x) for c, x in PAIRS]
    report(f"{backend} log-likelihoods vs transformers", max(abs(g.logprob - w[0]) for g, w in zip(got, want)), TOL)
    assert [g.greedy for g in got] == [w[1] for w in want] and [g.tokens for g in got] == [len(x) for _, x in PAIRS]


def test_a_pair_one_token_longer_than_the_cache_scores(tiny_setup, report):
    """The last token is only predicted, never input: 65 tokens score on a 64-token cache (lm-eval's windows are
    exactly that long)."""
    _, hf, runners = tiny_setup
    ids = torch.randint(0, 97, (65,), generator=torch.Generator().manual_seed(4)).tolist()
    for backend in ("ort", "ort-llgraph"):  # one right-padded forward; a row of the engine's packed step
        got = runners[backend].score(ids[:1], ids[1:])
        report(f"{backend}: 65 tokens on a 64-token cache vs transformers",
               abs(got.logprob - hf_logprob(hf, ids[:1], ids[1:])[0]), TOL)


@pytest.mark.parametrize("window, stride", [(None, None), (16, 16), (16, 5), (8, 1)])
def test_rolling_perplexity_from_its_definition(window, stride, tiny_setup, report):
    """Every token t >= 1 scored once. stride 1: with the w-1 tokens before it; one window: with all of them."""
    _, hf, runners = tiny_setup
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ppl, nll, n = runners["ort-llgraph"].perplexity(ids, window, stride)
    assert n == len(ids) - 1
    if window is None or stride == 1:
        keep = len(ids) if window is None else window - 1
        want = -sum(hf_logprob(hf, ids[max(0, t - keep):t], [ids[t]])[0] for t in range(1, len(ids)))
        report(f"rolling NLL (window {window}, stride {stride}) vs transformers", abs(nll - want), 1e-3)
    torch_nll = runners["torch"].perplexity(ids, window, stride)[1]
    report(f"rolling NLL (window {window}, stride {stride}) ort vs torch", abs(nll - torch_nll), 1e-3)
    assert ppl == pytest.approx(torch.tensor(nll / n).exp().item())


def llgraph(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llgraph", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("content, message", [
    ('{"context": "a", "choices": ["b", "c"], "answer": 0}\n{"context": "a", "choices": ["b"',
     "items.jsonl:2: not valid"),
    ('{"context": "a", "choices": ["b", "c"], "answer": 2}', "items.jsonl:1: 'answer' (2) must be an index"),
    ('{"question": 5, "choices": ["b", "c"], "answer": 0}', "items.jsonl:1: 'context' (or 'question') must be a"),
    ('{"context": "a", "choices": ["b"], "answer": 0}', "items.jsonl:1: 'choices' must be a list of at least two"),
    ("\n\n", "items.jsonl: no items"),
])
def test_bad_mc_data_is_one_line_naming_file_and_line(content, message, tmp_path):
    (tmp_path / "items.jsonl").write_text(content)
    r = llgraph("eval", "smollm2", "--task", "mc", "--data", "items.jsonl", "--cache-dir", "cache", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert not (tmp_path / "cache").exists()  # refused before anything was exported


def test_empty_text_and_too_long_context(tmp_path, tiny_setup):
    (tmp_path / "empty.txt").write_text("  \n")
    r = llgraph("eval", "smollm2", "--task", "perplexity", "--data", "empty.txt", cwd=tmp_path)
    assert r.returncode == 2 and "empty.txt: the text is empty" in r.stderr
    from llgraph.errors import RequestError
    with pytest.raises(RequestError, match="exceed the model's cache"):
        tiny_setup[2]["ort"].score_batch([(list(range(1, 60)), list(range(1, 10)))])


MC = [{"context": "The capital of France is", "choices": ["Paris", "London", "Berlin"], "answer": 0},
      {"question": "Water freezes at a temperature of", "choices": ["zero degrees Celsius", "fifty degrees Celsius"],
       "answer": 0},
      {"context": "The opposite of hot is", "choices": ["cold", "loud", "green"], "answer": 0},
      {"context": "", "choices": ["The sky is blue.", "The sky is made of cheese."], "answer": 0}]  # as lm-eval: BOS
TEXT = PASSAGE.read_text()  # Dickens, 1859: public domain


@pytest.mark.slow
def test_smollm2_eval_equals_transformers_on_every_backend(tmp_path, smollm2_export, smollm2_transformers, report):
    """Per-item log-likelihoods of a multiple-choice file and the perplexity of a text on SmolLM2, every backend vs
    transformers loading the same GGUF (its own tokenizer, scoring written here); accuracy identical."""
    from llgraph.runtime.eval import evaluate

    hf, tok = smollm2_transformers
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in MC))
    items = evaluate.load_mc(data)
    want = []
    for item in items:
        if not item.context:  # an empty context: the choices are predicted from the beginning-of-text token
            start = [tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id]
            want.append([hf_logprob(hf, start, tok(" " + c)["input_ids"])[0] for c in item.choices])
            continue
        ctx = tok(item.context)["input_ids"]
        want.append([hf_logprob(hf, ctx, tok(item.context + " " + c)["input_ids"][len(ctx):])[0]
                     for c in item.choices])
    ids = tok(TEXT)["input_ids"]
    with torch.no_grad():  # every token after the first, with all the text before it: one causal forward
        logp = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    want_nll = -logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).sum().item()
    assert len(ids) < 256  # one window: the runners' cache holds the whole text
    runners = {"torch": TorchRunner("smollm2", max_seq_len=256),
               "ort int4": ORTRunner(smollm2_export("ort", quantized=True), max_seq_len=256, kv_cache="f32"),
               "ort": ORTRunner(smollm2_export("ort"), max_seq_len=256),
               "onnx": ORTRunner(smollm2_export("onnx"), max_seq_len=256),
               "trt": ORTRunner(smollm2_export("trt"), max_seq_len=256)}
    for name, runner in runners.items():
        got = evaluate.evaluate_mc(runner, items, batch_size=4)
        worst = max(abs(g - w) for gs, ws in zip(got.logprobs, want) for g, w in zip(gs, ws))
        report(f"{name}: multiple-choice log-likelihoods vs transformers", worst, 5e-4)
        want_acc = sum(w.index(max(w)) == i.answer for w, i in zip(want, items)) / len(items)
        assert got.acc == want_acc
        ppl = evaluate.evaluate_perplexity(runner, TEXT)
        report(f"{name}: perplexity, relative to transformers'", abs(ppl["nll"] - want_nll) / want_nll, 1e-4)
    print(f"SmolLM2 accuracy {want_acc:.3f} on {len(items)} items; perplexity of the text "
          f"{torch.tensor(want_nll / (len(ids) - 1)).exp().item():.3f} ({len(ids) - 1} tokens)")


@pytest.mark.slow
def test_eval_cli_compares_two_backends_and_writes_json(tmp_path):
    (tmp_path / "items.jsonl").write_text("\n".join(json.dumps(d) for d in MC))
    # the export's weight flags apply to both backends: RTN int8 of the GGUF's float values, on ort (exact compute:
    # accuracy level 0) and torch
    r = llgraph("eval", "smollm2", "--task", "mc", "--data", "items.jsonl", "--compare", "torch", "--output",
                "out.json", "--max-seq-len", "128", "--quantize", "int8", "--symmetric", "--accuracy-level", "0",
                "--kv-cache", "f32", cwd=tmp_path)  # exact throughout: the comparison is of the weights' paths
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "acc_norm" in r.stdout and "largest:" in r.stdout and "scoring" in r.stderr  # the progress bar
    assert "RTN int8 (block 32, symmetric)" in r.stderr  # both loaded the re-rounded weights
    out = json.loads((tmp_path / "out.json").read_text())
    assert set(out) == {"ort", "torch"} and out["ort"]["acc"] == out["torch"]["acc"]
    assert max(abs(a - b) for ra, rb in zip(out["ort"]["logprobs"], out["torch"]["logprobs"])
               for a, b in zip(ra, rb)) < 5e-4


@pytest.mark.slow
def test_eval_has_built_in_tasks_a_new_user_can_run(tmp_path):
    """`llgraph eval smollm2 --task mc` with no --data: llgraph's own 20 items (one with an empty context, which
    lm-eval accepts), ONNX Runtime against the PyTorch executor item by item; perplexity on the bundled passage."""
    assert len(MC_BASICS.read_text().splitlines()) == 20
    # the session's export cache (conftest: this test run's own), where `llgraph generate smollm2` left its export
    r = llgraph("eval", "smollm2", "--task", "mc", "--compare", "torch", "--kv-cache", "f32", cwd=tmp_path)
    print(r.stdout[-600:])
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith(("ort ", "torch "))]
    assert [row[1] for row in rows] == ["20", "20"] and rows[0][2] == rows[1][2]  # the same accuracy
    largest = float(r.stdout.rsplit("largest: ", 1)[1].split()[0])
    assert largest < 1e-3, largest
    r = llgraph("eval", "smollm2", "--task", "perplexity", cwd=tmp_path)
    assert r.returncode == 0 and "perplexity" in r.stdout, r.stderr
