"""TensorRT engine build and TRTRunner. What needs no GPU runs everywhere: the build's refusals (one line, exit 2,
nothing written) and its optimization profiles. The engine tests are marked `tensorrt` and skip, with the reason,
where TensorRT or a GPU is missing (as on the CPU machines this project is developed and tested on)."""

import subprocess
import sys

import pytest
import torch
from conftest import max_diff
from reference import tiny

from llgraph.builder import cache_pairs
from llgraph.checkpoint import random_weights
from llgraph.errors import LlgraphError
from llgraph.export import get_target
from llgraph.export.lower import export
from llgraph.export.trt_build import EngineError, build_engine, load_tensorrt, profiles
from llgraph.passes import model_graph


def _importable(flavor):
    try:
        load_tensorrt(flavor)
        return True
    except LlgraphError:
        return False


FLAVORS = {f: _importable(f) for f in ("tensorrt", "rtx")}
# TensorRT-RTX engines run on compute capability 8.0/8.6/8.9/12.x, not Hopper (9.0)
RTX_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() in ((8, 0), (8, 6), (8, 9), (12, 0),
                                                                              (12, 1))
RUNNABLE = [f for f in FLAVORS if FLAVORS[f] and torch.cuda.is_available() and (f == "tensorrt" or RTX_GPU)]
HAVE_TRT = bool(RUNNABLE)
needs_trt = pytest.mark.skipif(not HAVE_TRT, reason="running an engine needs an NVIDIA GPU with TensorRT 10.15+/11, "
                               "or TensorRT-RTX on an Ampere/Ada/Blackwell GPU; the CPU machines this project is "
                               "tested on have none (tests/export/test_trt_build.py builds engines there)")


def export_folder(cfg, target, path, dtype="float32"):
    source = random_weights(cfg, seed=3, std=0.25)
    return export(model_graph(cfg, dtype), source, get_target(target), path / target, max_positions=128), source


def llgraph(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llgraph", *args], capture_output=True, text=True, cwd=cwd)


def test_build_refuses_a_non_trt_export(tmp_path):
    folder, _ = export_folder(tiny(), "ort", tmp_path)
    with pytest.raises(EngineError, match="exported for target 'ort' .ONNX Runtime's contrib ops.; re-export it with"):
        build_engine(folder)
    r = llgraph("build", str(folder))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--target trt" in r.stderr
    r = llgraph("build", str(tmp_path / "missing"))
    assert r.returncode == 2 and "not an llgraph export folder" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors shown where no GPU is visible")
def test_running_without_a_gpu_says_so_and_writes_nothing(tmp_path):
    folder, _ = export_folder(tiny(), "trt", tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    r = llgraph("build", str(folder), "--max-seq-len", "4096")
    assert r.returncode == 2 and "must be in 2..128" in r.stderr
    r = llgraph("generate", str(folder), "--backend", "trt", "--prompt", "hi")
    assert r.returncode == 2 and "has no engine; build one with `llgraph build" in r.stderr
    assert sorted(p.name for p in folder.iterdir()) == before
    if FLAVORS["rtx"]:  # an engine built here by TensorRT-RTX still needs a GPU to run
        assert llgraph("build", str(folder), "--tensorrt", "rtx", "--max-seq-len", "64").returncode == 0
        r = llgraph("generate", str(folder), "--backend", "trt", "--prompt", "hi")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "needs an NVIDIA GPU" in r.stderr, r.stderr


def test_profiles_cover_every_input_prefill_and_decode():
    cfg = tiny()
    prefill, decode = profiles(cfg, max_batch=4, max_seq_len=64, opt_prefill=128)
    inputs = {"input_ids", "position_ids"} | {past for past, _ in cache_pairs(cfg)}
    assert set(prefill) == set(decode) == inputs
    assert prefill["input_ids"] == ((1, 1), (1, 64), (4, 64)) and decode["input_ids"] == ((1, 1), (1, 1), (4, 1))
    cache = (cfg.num_kv_heads, 64, cfg.head_dim)
    assert prefill["past_key_values.0.key"] == ((1, *cache), (1, *cache), (4, *cache))


# -- on a GPU with TensorRT ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=RUNNABLE or ["none"])
def engine(request, tmp_path_factory):
    """A tiny engine per TensorRT that can run here: TensorRT (AOT plugins) and TensorRT-RTX (native layers)."""
    if not HAVE_TRT:
        pytest.skip("needs an NVIDIA GPU with TensorRT or TensorRT-RTX")
    cfg = tiny()
    folder, source = export_folder(cfg, "trt", tmp_path_factory.mktemp(f"engine-{request.param}"))
    build_engine(folder, max_batch=2, max_seq_len=64, tensorrt=request.param, progress=False)
    return cfg, folder, source


@needs_trt
@pytest.mark.tensorrt
def test_engine_builds_with_its_metadata(engine):
    _, folder, _ = engine
    assert {"model.engine", "engine.json"} <= {p.name for p in folder.iterdir()}


@needs_trt
@pytest.mark.tensorrt
def test_trt_logits_and_caches_match_executor_per_step(engine, report):
    """Prefill + 8 decode steps, batch 2, fp32 (TF32 off): logits and present caches within 1e-3 of the executor
    (the CPU check of the same file through ONNX Runtime holds 1e-4; a GPU's reduction order differs)."""
    from llgraph.runtime.backends.pytorch import torch_side
    from llgraph.runtime.backends.trt import engine_side

    cfg, folder, source = engine
    ours, theirs = torch_side(cfg, source, max_seq=64)(), engine_side(folder)()
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1)).numpy()
    pos = torch.arange(7).expand(2, 7).numpy()
    worst = {"logits": 0.0, "present": 0.0}
    for _ in range(9):
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
    from llgraph.runtime.backends.pytorch import TorchBackend
    from llgraph.runtime.engine.runner import Runner

    cfg, folder, source = engine
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    torch_runner = Runner(TorchBackend(cfg, source, max_seq_len=64))
    want = [g.token_ids for g in torch_runner.generate(prompts, max_new_tokens=16)]
    got = [g.token_ids for g in TRTRunner(folder).generate(prompts, max_new_tokens=16)]
    assert got == want


@needs_trt
@pytest.mark.tensorrt
@pytest.mark.slow
@pytest.mark.parametrize("flavor", RUNNABLE or ["none"])
def test_smollm2_trt_runner_greedy_equals_torch_runner(flavor, tmp_path):
    from llgraph.export import export_model
    from llgraph.runtime import TorchRunner, TRTRunner

    folder = export_model("smollm2", checkpoint="smollm2", out=tmp_path / "trt", target="trt", max_seq_len=512)
    build_engine(folder, max_batch=1, max_seq_len=256, tensorrt=flavor)
    prompt = "The capital of France is"
    want = TorchRunner("smollm2", max_seq_len=256).generate(prompt, max_new_tokens=32)
    got = TRTRunner(folder).generate(prompt, max_new_tokens=32)
    print(f"torch: {want.text!r}\ntrt:   {got.text!r}")
    assert got.token_ids == want.token_ids
