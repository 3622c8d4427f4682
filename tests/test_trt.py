"""TensorRT engine build and TRTRunner. What needs no GPU runs everywhere: the build's refusals (one line, exit 2,
nothing written) and its optimization profiles. The engine tests are marked `tensorrt` and skip, with the reason,
where TensorRT or a GPU is missing (as on the CPU machines this project is developed and tested on)."""

import importlib.util
import subprocess
import sys

import pytest
import torch
from conftest import max_diff
from reference import tiny

from llgraph.builder import cache_pairs
from llgraph.export import get_target
from llgraph.export.lower import export
from llgraph.passes import model_graph
from llgraph.runtime.trt import EngineError, build_engine, profiles
from llgraph.weights import RandomSource

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()
needs_trt = pytest.mark.skipif(not HAVE_TRT, reason="needs TensorRT (10.15+/11) and an NVIDIA GPU; neither is on "
                               "the CPU machines this project is developed and tested on")


def export_folder(cfg, target, path, dtype="float32"):
    source = RandomSource(cfg, seed=3, std=0.25)
    return export(model_graph(cfg, dtype), source, get_target(target), path / target, max_positions=128), source


def llgraph(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llgraph", *args], capture_output=True, text=True, cwd=cwd)


def test_build_refuses_a_non_trt_export(tmp_path):
    folder, _ = export_folder(tiny(), "ort", tmp_path)
    with pytest.raises(EngineError, match="exported for target 'ort'; re-export it with"):
        build_engine(folder)
    r = llgraph("build", str(folder))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--target trt" in r.stderr
    r = llgraph("build", str(tmp_path / "missing"))
    assert r.returncode == 2 and "not an llgraph export folder" in r.stderr


@pytest.mark.skipif(HAVE_TRT, reason="checks the error shown where TensorRT is missing")
def test_build_without_tensorrt_says_so_and_writes_nothing(tmp_path):
    folder, _ = export_folder(tiny(), "trt", tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    r = llgraph("build", str(folder))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "TensorRT is not installed" in r.stderr or "needs an NVIDIA GPU" in r.stderr
    assert sorted(p.name for p in folder.iterdir()) == before
    r = llgraph("build", str(folder), "--max-seq-len", "4096")
    assert r.returncode == 2 and "must be in 2..128" in r.stderr
    r = llgraph("generate", str(folder), "--backend", "trt", "--prompt", "hi")
    assert r.returncode == 2 and "has no engine; build one with `llgraph build" in r.stderr


def test_profiles_cover_every_input_prefill_and_decode():
    cfg = tiny()
    prefill, decode = profiles(cfg, max_batch=4, max_seq_len=64, opt_prefill=128)
    inputs = {"input_ids", "position_ids"} | {past for past, _ in cache_pairs(cfg)}
    assert set(prefill) == set(decode) == inputs
    assert prefill["input_ids"] == ((1, 1), (1, 64), (4, 64)) and decode["input_ids"] == ((1, 1), (1, 1), (4, 1))
    cache = (cfg.num_kv_heads, 64, cfg.head_dim)
    assert prefill["past_key_values.0.key"] == ((1, *cache), (1, *cache), (4, *cache))


# -- on a GPU with TensorRT ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if not HAVE_TRT:
        pytest.skip("needs TensorRT and an NVIDIA GPU")
    cfg = tiny()
    folder, source = export_folder(cfg, "trt", tmp_path_factory.mktemp("engine"))
    build_engine(folder, max_batch=2, max_seq_len=64, progress=False)
    return cfg, folder, source


@needs_trt
@pytest.mark.tensorrt
def test_engine_builds_with_its_metadata(engine):
    _, folder, _ = engine
    assert {"model.engine", "engine.json", "timing.cache"} <= {p.name for p in folder.iterdir()}


@needs_trt
@pytest.mark.tensorrt
def test_trt_logits_and_caches_match_executor_per_step(engine, report):
    """Prefill + 8 decode steps, batch 2, fp32 (TF32 off): logits and present caches within 1e-3 of the executor
    (the CPU check of the same file through ONNX Runtime holds 1e-4; a GPU's reduction order differs)."""
    from llgraph.diff import engine_side, torch_side

    cfg, folder, source = engine
    ours, theirs = torch_side(cfg, source, max_seq=64)(), engine_side(folder)()
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1)).numpy()
    pos = torch.arange(7).expand(2, 7).numpy()
    worst = {"logits": 0.0, "present": 0.0}
    for step in range(9):
        a, b = ours({"input_ids": ids, "position_ids": pos}), theirs({"input_ids": ids, "position_ids": pos})
        worst["logits"] = max(worst["logits"], max_diff(torch.from_numpy(a["logits"]), torch.from_numpy(b["logits"])))
        for _, present in cache_pairs(cfg):
            worst["present"] = max(worst["present"],
                                   max_diff(torch.from_numpy(a[present]), torch.from_numpy(b[present])))
        ids = a["logits"][:, -1:].argmax(-1)
        pos = pos[:, -1:] + 1
    report("trt vs executor logits", worst["logits"], 1e-3)
    report("trt vs executor present caches", worst["present"], 1e-3)


@needs_trt
@pytest.mark.tensorrt
def test_trt_runner_greedy_equals_torch_runner(engine):
    from llgraph.runtime import TRTRunner
    from llgraph.runtime.backends import TorchBackend
    from llgraph.runtime.loop import Runner

    cfg, folder, source = engine
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    torch_runner = Runner(TorchBackend(cfg, source, max_seq_len=64))
    want = [g.token_ids for g in torch_runner.generate(prompts, max_new_tokens=16)]
    got = [g.token_ids for g in TRTRunner(folder).generate(prompts, max_new_tokens=16)]
    assert got == want


@needs_trt
@pytest.mark.tensorrt
@pytest.mark.slow
def test_smollm2_trt_runner_greedy_equals_torch_runner(tmp_path):
    from llgraph.export import export_model
    from llgraph.runtime import TorchRunner, TRTRunner

    folder = export_model("smollm2", checkpoint="smollm2", out=tmp_path / "trt", target="trt", max_seq_len=512)
    build_engine(folder, max_batch=1, max_seq_len=256)
    prompt = "The capital of France is"
    want = TorchRunner("smollm2", max_seq_len=256).generate(prompt, max_new_tokens=32)
    got = TRTRunner(folder).generate(prompt, max_new_tokens=32)
    print(f"torch: {want.text!r}\ntrt:   {got.text!r}")
    assert got.token_ids == want.token_ids
