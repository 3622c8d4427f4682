"""TRTBackend through TensorRT's CPU twin (runtime/backends/trt_twin.py): engines built here by TensorRT-RTX, run by the
real backend code on CPU with TensorRT's execution contract enforced. Greedy tokens equal ONNX Runtime's on the `ort`
export of the same weights, the scheduler's concurrent requests equal their solo answers, `llgraph diff --b trt`
passes, and each runtime defect of issue 25 (streams, alignment, unchecked calls, I/O, contiguity) is caught."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llgraph.bundled import bundled_model
from llgraph.errors import LlgraphError
from llgraph.export import export_model
from llgraph.export.trt_build import build_engine
from llgraph.runtime.backends.ort import ORTRunner
from llgraph.runtime.backends.trt import TRTBackend, TRTRunner
from llgraph.runtime.backends.trt_twin import ContractError, DataType, Engine
from llgraph.runtime.engine.runner import Runner

PROMPTS = [[1, 5, 9, 13], [7, 3], [2, 4, 6, 8, 10, 12, 14], [11]]


def built(folder: Path, **kw) -> Path:
    build_engine(folder, tensorrt="rtx", progress=False, **kw)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the tiny model's trt export with an engine built by TensorRT-RTX, its ort export: the same weights)"""
    root = tmp_path_factory.mktemp("twin")
    trt = built(export_model("tiny", out=root / "trt", target="trt", max_seq_len=64), max_batch=8)
    return trt, export_model("tiny", out=root / "ort", target="ort", max_seq_len=64)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = bundled_model("smollm2")
    root = tmp_path_factory.mktemp("twin-smollm2")
    trt = built(export_model(path, checkpoint=path, out=root / "trt", target="trt", max_seq_len=128), max_batch=4)
    return trt, export_model(path, checkpoint=path, out=root / "ort", target="ort", max_seq_len=128)


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_trt_runner_on_the_twin_answers_as_onnx_runtime(model, request):
    trt, ort = request.getfixturevalue(model)
    runner, reference = TRTRunner(trt, tensorrt="twin"), ORTRunner(ort)
    prompt = "The capital of France is" if model == "smollm2" else PROMPTS[0]
    got, want = runner.generate(prompt, 32, eos_token_ids=[]), reference.generate(prompt, 32, eos_token_ids=[])
    print(f"{model}: {got.token_ids[:12]}... after {runner.backend.context.executions} twin executions")
    assert got.token_ids == want.token_ids
    batch = runner.generate(PROMPTS, 8, eos_token_ids=[])  # mixed lengths, one prefill on the prefill profile
    assert [g.token_ids for g in batch] == [g.token_ids for g in reference.generate(PROMPTS, 8, eos_token_ids=[])]


def test_speculative_decoding_on_the_twin_equals_plain(smollm2):
    """Verify steps of several positions after a cached prefix, on the prefill profile, one row and a padded batch
    (TRTBackend runs them in one forward), give plain decoding's tokens."""
    runner = TRTRunner(smollm2[0], tensorrt="twin")
    quote = "Repeat: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat, the cat sat on"
    prompts = [quote, "The capital of France is", [1, 2, 3]]
    plain = runner.generate(prompts, 24, eos_token_ids=[])
    stats = {}
    "".join(runner.stream(quote, 24, eos_token_ids=[], speculative="ngram", stats=stats))
    fast = runner.generate(prompts, 24, eos_token_ids=[], speculative="ngram")
    print(f"twin: {stats['accepted']} of {stats['drafted']} drafted tokens accepted")
    assert [g.token_ids for g in fast] == [g.token_ids for g in plain] and stats["accepted"] > 0


def test_scheduler_over_trt_backend_on_the_twin(tiny):
    """8 concurrent requests through the scheduler (one slot's rows bound per prefill, the live rows per decode
    step, profile switches between them) equal their solo answers."""
    from llgraph.runtime.engine.scheduler import Scheduler

    runner = TRTRunner(tiny[0], tensorrt="twin")
    prompts = [[1 + i, 5 + 2 * i, 9 + i][: 1 + i % 3] for i in range(8)]
    solo = [runner.generate(p, 12, eos_token_ids=[]).token_ids for p in prompts]
    scheduler = Scheduler(runner, slots=8).start()
    try:
        handles = [scheduler.submit(p, 12, eos_token_ids=[]) for p in prompts]  # all at once: 8 live slots
        results = [h.result(timeout=120).tokens for h in handles]
    finally:
        scheduler.stop()
    assert results == solo


def test_llgraph_diff_against_the_engine_on_the_twin(tiny, tmp_path):
    r = subprocess.run([sys.executable, "-m", "llgraph", "diff", "tiny", "--b", "trt", "--engine", str(tiny[0]),
                        "--tensorrt", "twin", "--tokens", "1,5,9,13", "--steps", "3"],
                       capture_output=True, text=True, timeout=300)
    print(r.stdout[-1500:])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


# -- the defects, each caught ------------------------------------------------------------------------------------

def test_a_cache_zero_filled_on_another_stream_is_caught(tiny, monkeypatch):
    """Defect 4: the cache zero-filled on torch's current stream while the engine runs on its own, with no wait."""
    backend = TRTBackend(tiny[0], tensorrt="twin")

    def racy_allocate(batch):
        from llgraph.builder import new_cache
        backend.cache = new_cache(backend.config, batch, backend.max_seq_len,
                                  lambda shape: backend.device.zeros(shape, torch.float32))
        backend._bound = None
    backend.allocate = racy_allocate
    backend.allocate(1)
    with pytest.raises(ContractError, match="written on stream 0, which it never waited for"):
        backend.forward(np.array([[1, 2]]), np.array([[0, 1]]))
    backend.stream.wait_stream(backend.device.default)  # the other fix: the engine's stream waits for the fill
    backend.forward(np.array([[1, 2]]), np.array([[0, 1]]))


def test_cache_rows_are_256_byte_aligned(tiny, tmp_path):
    """Defect 5: the build rounds --max-seq-len up so each slot's rows start 256-byte aligned (tiny fp32: 128 bytes
    a position); the twin refuses a misaligned address as TensorRT does, and the backend refuses an engine whose
    rows would misalign instead of binding them."""
    folder = export_model("tiny", out=tmp_path / "trt", target="trt", max_seq_len=64)
    built(folder, max_batch=4, max_seq_len=63)
    meta = json.loads((folder / "engine.json").read_text())
    assert meta["max_seq_len"] == 64
    backend = TRTBackend(folder, tensorrt="twin")
    address = backend.device.zeros((64,), torch.float32).data_ptr()
    assert backend.context.set_tensor_address("logits", address) and not \
        backend.context.set_tensor_address("logits", address + 128)
    assert Runner(backend).generate([[1, 2, 3], [4, 5]], 4)  # rows 1.. bound at slot offsets, all accepted
    (folder / "engine.json").write_text(json.dumps({**meta, "max_seq_len": 63}))  # as an older llgraph built it
    with pytest.raises(LlgraphError, match="not 256-byte aligned; rebuild it"):
        TRTBackend(folder, tensorrt="twin")


def test_a_refused_binding_call_stops_the_step(tiny, monkeypatch):
    """Defect 6: set_optimization_profile_async, set_input_shape and set_tensor_address return False instead of
    raising; the backend stops there (before, a refused profile switch silently kept the old profile)."""
    backend = TRTBackend(tiny[0], tensorrt="twin")
    backend.allocate(1)
    backend.forward(np.array([[1, 2]]), np.array([[0, 1]]))
    monkeypatch.setattr(type(backend.context), "set_optimization_profile_async", lambda self, i, s: False)
    with pytest.raises(LlgraphError, match="TensorRT refused optimization profile 1"):
        backend.forward(np.array([[3]]), np.array([[2]]))
    monkeypatch.undo()
    with pytest.raises(LlgraphError, match="TensorRT refused the shape \\(1, 99\\) of input_ids"):
        backend.forward(np.array([list(range(99))]), np.arange(99)[None])  # past the prefill profile


def test_an_engine_whose_io_differs_is_refused_at_load(tiny, monkeypatch):
    """Defect 6: the engine's tensors, modes and dtypes are checked against what the backend binds."""
    contract = Engine.__init__

    def half_logits(self, *args):
        contract(self, *args)
        self.tensors["logits"] = type(self.tensors["logits"])("logits", self.tensors["logits"].mode, DataType.HALF)
    monkeypatch.setattr(Engine, "__init__", half_logits)
    with pytest.raises(LlgraphError, match="the engine's logits is a torch.float16 output; this backend binds a "
                                           "torch.float32 output"):
        TRTBackend(tiny[0], tensorrt="twin")


def test_non_contiguous_inputs_are_bound_as_their_values(tiny):
    """Defect 7: ids given as a transposed view; the bound memory must hold them in row-major order."""
    backend = TRTBackend(tiny[0], tensorrt="twin")
    ids = np.array([[1, 4], [2, 5], [3, 6]]).T  # [[1, 2, 3], [4, 5, 6]], not contiguous
    positions = np.broadcast_to(np.arange(3), (2, 3))  # what the loop passes; np.array(positions) is column-major
    assert not ids.flags.c_contiguous and not positions.flags.c_contiguous
    backend.allocate(2)
    got = backend.forward(ids, positions)
    backend.allocate(2)
    want = backend.forward(np.ascontiguousarray(ids), np.array([[0, 1, 2], [0, 1, 2]]))
    assert np.array_equal(got, want)
