"""llgraph as an lm-evaluation-harness model: `llgraph lm-eval --model llgraph` and the harness's own Hugging Face
model (`lm_eval --model hf`) run the same local tasks (task YAMLs over JSONL files in tests/data/lm_eval, no hub
access) on the same HF folder, and every per-sample response must agree: log-likelihoods of multiple choice,
rolling log-likelihoods of texts longer than the model (several windows each), and greedy generations."""

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import need

need("lm_eval")

TASKS = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
MAX_LEN = 64  # both models: the 170-token text takes three windows


def _tol(value: float) -> float:
    """float32 logits summed over a request: 1e-4 absolute plus 1e-5 relative (a 150-token text: ~6e-3)."""
    return 1e-4 + 1e-5 * abs(value)


def _samples(out: Path, task: str) -> list[dict]:
    (path,) = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
    return sorted((json.loads(line) for line in Path(path).read_text().splitlines()), key=lambda s: s["doc_id"])


COMMON = ["--tasks", "llgraph_mc", "llgraph_ppl", "llgraph_gen", "--include_path", str(TASKS), "--log_samples",
          "--batch_size", "4"]


def _run_side_by_side(runs: dict, out: Path) -> str:
    """lm_eval command lines run at once (each is mostly one core); the last one's output."""
    # the environment as the test sees it (conftest points LLGRAPH_CACHE_DIR at the session's own export cache)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = {name: subprocess.Popen([*cmd, *COMMON, "--output_path", str(out / name)], cwd=TASKS, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in runs.items()}
    for name, p in procs.items():
        text = p.communicate()[0]
        assert p.returncode == 0, f"{name}:\n{text[-3000:]}"
    return text


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
    """The SmolLM2 HF folder and `lm_eval --model hf`'s samples on it, with llgraph's adapter run beside it."""
    from reference import hf_folder_from_gguf

    from llgraph.bundled import bundled_model

    tmp = tmp_path_factory.mktemp("lm-eval")
    folder = hf_folder_from_gguf(bundled_model("smollm2"), tmp / "smollm2-hf")
    out = _run_side_by_side({
        "hf": [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
               f"pretrained={folder},dtype=float32,max_length={MAX_LEN}", "--device", "cpu"],
        "llgraph": [sys.executable, "-m", "llgraph", "lm-eval", "--model", "llgraph", "--model_args",
                    f"model={folder},backend=ort,max_seq_len={MAX_LEN}"],
    }, tmp)
    yield folder, tmp, out
    # 1 GB the rest of the session does not read: the HF folder, and its export in the session's cache
    from llgraph.runtime.backends.export_cache import cache_dir, clean, entries

    shutil.rmtree(tmp)
    clean(cache_dir(), [e.name for e in entries(cache_dir()) if e.name.startswith("smollm2-hf-")])


def _same_as_hf(out: Path, name: str, report) -> None:
    """Every per-sample response of run `name` equals lm_eval --model hf's: log-likelihoods within _tol, is_greedy,
    accuracies and greedy generations identical."""
    for task in ("llgraph_mc", "llgraph_ppl"):
        hf, llg = _samples(out / "hf", task), _samples(out / name, task)
        assert len(hf) == len(llg) > 0
        worst, pairs = 0.0, 0
        for a, b in zip(hf, llg):
            assert a["arguments"] == b["arguments"]  # the same requests
            for (ra,), (rb,) in zip(a["resps"], b["resps"]):  # mc: [log-likelihood, is_greedy]; ppl: one string
                ra, rb = (r if isinstance(r, list) else [r] for r in (ra, rb))
                worst = max(worst, abs(float(ra[0]) - float(rb[0])) / _tol(float(ra[0])))
                pairs += 1
                assert ra[1:] == rb[1:]  # is_greedy
            if task == "llgraph_mc":
                assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
        report(f"lm-eval {name} {task}: {pairs} log-likelihoods, max |{name} - hf| / (1e-4 + 1e-5 |ll|)", worst, 1.0)
    gen_hf, gen_llg = _samples(out / "hf", "llgraph_gen"), _samples(out / name, "llgraph_gen")
    print(f"{name} generations:", [s["resps"][0][0] for s in gen_llg])
    assert [s["resps"] for s in gen_llg] == [s["resps"] for s in gen_hf]
    assert any(s["resps"][0][0].strip() for s in gen_llg)  # something was generated


@pytest.mark.slow
def test_lm_eval_llgraph_equals_lm_eval_hf_per_sample(hf_reference, report):
    folder, out, text = hf_reference
    print(text[-900:])  # llgraph's table
    assert "exporting smollm2-hf for ONNX Runtime" in text  # the checkpoint really went through an llgraph export
    _same_as_hf(out, "llgraph", report)


@pytest.mark.slow
def test_lm_eval_api_client_against_llgraph_serve_equals_lm_eval_hf(hf_reference, report):
    """lm-eval's own OpenAI-compatible client (`--model local-completions`: batched token-id prompts, echo,
    logprobs, 4 concurrent requests) against `llgraph serve` on the same weights, with the HF tokenizer and with
    the server's own (tokenizer_backend=remote: /tokenize, /detokenize, /tokenizer_info)."""
    from serving import Server

    folder, out, _ = hf_reference
    server = Server(str(folder), "--name", "smollm2", "--slots", "4", "--max-seq-len", str(2 * MAX_LEN))
    try:
        url = f"{server.url}/v1/completions"
        # the API client keeps max_length - 1 for its requests (room for the one generated token) and makes rolling
        # windows one shorter still; hf's windows are max_length: two more here gives both the same windows
        base = f"model=smollm2,base_url={url},num_concurrent=4,max_retries=1,max_length={MAX_LEN + 2}"
        _run_side_by_side({
            "served": [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                       f"{base},tokenizer_backend=huggingface,tokenizer={folder}"],
            "served-remote": [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                              f"{base},tokenizer_backend=remote"],
        }, out)
    finally:
        assert server.stop() == 0, "".join(server.lines[-20:])
    for name in ("served", "served-remote"):
        _same_as_hf(out, name, report)


def test_harness_rejects_unknown_model_args():
    from llgraph.errors import LlgraphError
    from llgraph.runtime.eval.harness import LlgraphLM

    with pytest.raises(LlgraphError, match=r"unknown model_args \['pretrained'\]"):
        LlgraphLM(model="smollm2", pretrained="x")


def test_llgraph_lm_eval_is_the_harness_command_line_with_llgraph_registered():
    r = subprocess.run([sys.executable, "-m", "llgraph", "lm-eval", "run", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--model_args" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-c", "import llgraph.runtime.eval.harness; from lm_eval.api.registry import "
                        "get_model; print(get_model('llgraph').__name__, get_model('hf').__name__)"],
                       capture_output=True, text=True)
    assert r.stdout.split() == ["LlgraphLM", "HFLM"], r.stderr
