"""The ONNX Runtime path without torch: export (random weights, RTN, a GGUF's blocks), generate, chat, eval, serve's
runner, inspect, cache, a TensorRT-RTX build and diff between ONNX sides run in a process where importing torch
fails as it does where torch is not installed; asking for a torch backend there is one line and exit 2."""

import subprocess
import sys

import pytest
from conftest import need

# A process where `import torch` (and triton, which imports it) raises what a missing package raises.
NO_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton"):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
sys.meta_path.insert(0, NoTorch())
"""


def without_torch(*args, cwd):
    """`llgraph ARGS` in a process that cannot import torch; fails the test if torch was imported anyway."""
    code = NO_TORCH + f"""
from llgraph.runtime.cli import main
try:
    code = main({list(args)!r})
finally:
    assert "torch" not in sys.modules, "torch was imported"
sys.exit(code)
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd)


def test_the_blocker_really_blocks_torch(tmp_path):
    r = subprocess.run([sys.executable, "-c", NO_TORCH + "import torch"], capture_output=True, text=True)
    assert r.returncode == 1 and "ModuleNotFoundError: No module named 'torch'" in r.stderr


@pytest.mark.parametrize("args, expect", [
    (("export", "--config", "tiny", "-o", "tiny-ort"), "wrote tiny-ort/"),
    (("export", "--config", "tiny", "--quantize", "int4", "--target", "onnx", "-o", "tiny-q4"), "wrote tiny-q4/"),
    (("export", "--config", "tiny", "--dtype", "bf16", "--target", "trt", "-o", "tiny-trt"), "wrote tiny-trt/"),
    (("inspect", "smollm2"), "GroupedAttention  30"),
    (("cache", "list"), ""),
])
def test_export_inspect_and_cache_run_without_torch(args, expect, tmp_path):
    r = without_torch(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert expect in r.stdout + r.stderr


def test_generate_eval_build_and_diff_run_without_torch(tmp_path):
    assert without_torch("export", "--config", "tiny", "-o", "tiny-ort", cwd=tmp_path).returncode == 0
    r = without_torch("generate", "tiny-ort", "--tokens", "1,2,3", "--max-new-tokens", "4", "--temperature", "0.8",
                      "--seed", "1", cwd=tmp_path)
    assert r.returncode == 0 and len(r.stdout.strip().split(",")) == 4, r.stderr[-2000:]
    (tmp_path / "t.txt").write_text("It was the best of times, it was the worst of times. " * 8)
    r = without_torch("eval", "smollm2", "--task", "perplexity", "--data", "t.txt", "--context", "64",
                      cwd=tmp_path)
    assert r.returncode == 0 and "perplexity" in r.stdout, r.stderr[-2000:]
    r = without_torch("diff", "tiny", "--tokens", "1,2,3", "--a", "ort", "--b", "onnx", cwd=tmp_path)
    assert r.returncode == 0 and "first divergence: none" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    need("tensorrt_rtx_bindings", linux_x86_64=True)
    assert without_torch("export", "--config", "tiny", "--target", "trt", "-o", "tiny-trt",
                         cwd=tmp_path).returncode == 0
    r = without_torch("build", "tiny-trt", "--tensorrt", "rtx", cwd=tmp_path)
    assert r.returncode == 0 and (tmp_path / "tiny-trt" / "model.engine").exists(), r.stderr[-2000:]


def test_the_readme_chat_runs_without_torch(tmp_path):
    """The README's first command's job: SmolLM2's GGUF exported with its own blocks, on llgraph's kernels (or
    ONNX Runtime's ops where they cannot be built), then a chat answer."""
    r = without_torch("generate", "smollm2", "--chat", "--prompt", "What is the capital of France?",
                      "--max-new-tokens", "12", cwd=tmp_path)
    print(r.stdout)
    assert r.returncode == 0 and "Paris" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("args", [("generate", "tiny", "--backend", "torch", "--tokens", "1,2"),
                                  ("diff", "tiny", "--tokens", "1,2", "--b", "ort")])  # side a defaults to torch
def test_a_torch_backend_without_torch_is_one_line(args, tmp_path):
    r = without_torch(*args, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "needs torch" in r.stderr and "pip install torch" in r.stderr


def test_the_python_api_runs_without_torch(tmp_path):
    """ORTRunner.generate and its sampler, scoring and the scheduler's loop, imported as a user's script would."""
    assert without_torch("export", "--config", "tiny", "-o", "tiny-ort", cwd=tmp_path).returncode == 0
    code = NO_TORCH + """
from llgraph.runtime import ORTRunner
from llgraph.runtime.engine.scheduler import Scheduler
runner = ORTRunner("tiny-ort", max_seq_len=64)
greedy = runner.generate([[1, 2, 3], [4, 5]], 6)
sampled = runner.generate([1, 2, 3], 6, temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.1, seed=3)
assert sampled.token_ids == runner.generate([1, 2, 3], 6, temperature=0.9, top_k=20, top_p=0.9,
                                            repetition_penalty=1.1, seed=3).token_ids
assert runner.generate([1, 2, 3], 6, speculative="ngram").token_ids == greedy[0].token_ids
score = runner.score([1, 2, 3], [4, 5])
scheduler = Scheduler(runner, slots=2).start()
served = scheduler.submit([1, 2, 3], 6).result(timeout=60)
scheduler.stop()
assert served.tokens == greedy[0].token_ids, (served.tokens, greedy[0].token_ids)
assert "torch" not in sys.modules, "torch was imported"
print(greedy[0].token_ids, score.logprob)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
