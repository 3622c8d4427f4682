"""TRTBackend through TensorRT's CPU twin (runtime/backends/trt_twin.py): engines built here by TensorRT-RTX, run by the
real backend code on CPU with TensorRT's execution contract enforced. Greedy tokens equal ONNX Runtime's on the `ort`
export of the same weights, the scheduler's concurrent requests equal their solo answers, `llgraph diff --b trt`
passes, and each runtime defect of issue 25 (streams, alignment, unchecked calls, I/O, contiguity) is caught."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

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
def smollm2(tmp_path_factory, shallow_smollm2, shallow_export):
    """(the trt export of SmolLM2 cut to 2 layers, 128 positions, with an engine built by TensorRT-RTX; its float32
    ort export). A real tokenizer, real widths and weights: what the twin holds (the backend's bindings, profiles,
    cache and rows) is the same at every depth, and the full model's build took a minute of the suite;
    tests/export/test_trt_build.py builds SmolLM2's layers in every dtype"""
    root = tmp_path_factory.mktemp("twin-smollm2")
    path = shallow_smollm2
    trt = built(export_model(path, checkpoint=path, out=root / "trt", target="trt", max_seq_len=128), max_batch=4)
    yield trt, shallow_export
    shutil.rmtree(root)


def as_plugin_engine(folder: Path, out: Path) -> Path:
    """A copy of `folder` whose engine.json is what a build on llgraph's plugins writes (no such build runs here:
    TensorRT-RTX runs no plugins): ragged, its profiles taking slot_ids (trt_build.profiles). The twin then presents
    slot_ids among the engine's inputs, and enforces those profiles."""
    from llgraph.export.trt_build import profiles
    from llgraph.export_folder import Manifest

    shutil.copytree(folder, out)
    meta = json.loads((out / "engine.json").read_text())
    shapes = profiles(Manifest.read(out).config, meta["max_batch"], meta["max_seq_len"], meta["opt_prefill"],
                      ragged=True)
    meta.update(plugins="aot", ragged=True,
                profile_shapes=[{n: [list(d) for d in dims] for n, dims in p.items()} for p in shapes])
    (out / "engine.json").write_text(json.dumps(meta))
    return out


@pytest.fixture(scope="module")
def ragged(tiny, tmp_path_factory):
    return as_plugin_engine(tiny[0], tmp_path_factory.mktemp("ragged") / "trt"), tiny[1]


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


def test_ragged_engine_runs_only_the_busy_rows(ragged):
    """An engine on llgraph's plugins takes each token's cache row (slot_ids): the scheduler's step packs the busy
    rows' tokens into one forward and an idle slot costs nothing (one active row among 8 slots runs one token, not
    8 rows); concurrent requests, with prompts arriving mid-run, equal their solo answers, and a request equals ONNX
    Runtime's on the ort export of the same weights."""
    from llgraph.runtime.engine.scheduler import Scheduler

    runner = TRTRunner(ragged[0], tensorrt="twin")
    assert runner.backend.ragged and "slot_ids" in runner.backend.engine.tensors
    assert runner.generate(PROMPTS[0], 16, eos_token_ids=[]).token_ids == \
        ORTRunner(ragged[1]).generate(PROMPTS[0], 16, eos_token_ids=[]).token_ids
    prompts = [[1 + i, 5 + 2 * i, 9 + i, 3, 7][: 1 + i % 5] for i in range(8)]
    solo = [runner.generate(p, 12, eos_token_ids=[]).token_ids for p in prompts]
    shapes, slots = [], []
    run = runner.backend._run

    def recording(ids, positions, rows_of_tokens, rows):
        shapes.append(ids.shape)
        slots.append(sorted(set(rows_of_tokens.tolist())))
        return run(ids, positions, rows_of_tokens, rows)
    runner.backend._run = recording
    scheduler = Scheduler(runner, slots=8).start()
    try:
        handles = [scheduler.submit(p, 12, eos_token_ids=[]) for p in prompts]
        results = [h.result(timeout=120).tokens for h in handles]
        together = len(shapes)
        again = scheduler.submit(prompts[7], 12, eos_token_ids=[])  # alone, in the slot holding its prompt (7)
        assert again.result(timeout=120).tokens == solo[7]
    finally:
        scheduler.stop()
    alone = shapes[together:]
    print(f"8 requests: {together} forwards of up to {max(s[0] * s[1] for s in shapes[:together])} tokens; one "
          f"request in slot {slots[-1]} of 8: forwards of {sorted(set(alone))}")
    assert results == solo
    assert all(s[0] * s[1] == 1 for s in alone) and slots[-1] == [7], (alone, slots[-1])  # rows 0-6 idle, not run


def test_ragged_engine_verifies_drafts_in_the_packed_step(ragged):
    """Speculative decoding on a ragged engine: each row's token and its draft ride the step's one packed forward
    (a run of positions per row, as the plugin takes them) and give plain decoding's tokens."""
    runner = TRTRunner(ragged[0], tensorrt="twin")
    seed = [5, 6, 7]
    told = runner.generate(seed, 12, eos_token_ids=[]).token_ids
    prompts = [seed + told + seed, [9, 4, 9, 4, 9], [3]]  # the first repeats its own answer: lookup drafts it
    plain = runner.generate(prompts, 16, eos_token_ids=[])
    stats: dict = {}
    "".join(runner.stream(prompts[0], 16, eos_token_ids=[], speculative="ngram", stats=stats))
    fast = runner.generate(prompts, 16, eos_token_ids=[], speculative="ngram")
    print(f"ragged twin: {stats['drafted']} tokens drafted, {stats['accepted']} accepted")
    assert [g.token_ids for g in fast] == [g.token_ids for g in plain] and stats["drafted"] > 0


def test_ragged_engine_runs_a_long_packed_step_in_pieces(ragged):
    """A packed forward longer than the engine's prefill profile (its max_seq_len tokens) runs as consecutive
    pieces and gives what each row run alone gives (ONNX Runtime, a forward per row): the kept logits, and each
    row's cache (the next token's logits of every row); tokens of a row that are not one run are refused."""
    backend, reference = TRTBackend(ragged[0], tensorrt="twin"), ORTRunner(ragged[1]).backend
    backend.allocate(4)
    reference.allocate(4)
    rng = np.random.default_rng(0)
    lengths, rows = [40, 50, 30], [3, 0, 2]  # 120 tokens > 64
    prompts = [rng.integers(1, 200, n) for n in lengths]
    ids, positions = np.concatenate(prompts)[None], np.concatenate([np.arange(n) for n in lengths])[None]
    got = backend.forward(ids, positions, rows=np.repeat(rows, lengths)[None], keep=5)
    want = [reference.forward(p[None], np.arange(len(p))[None], rows=slice(r, r + 1), keep=5)[:, -5:]
            for p, r in zip(prompts, rows)]
    nxt = np.array([[7], [8], [9]])
    after = backend.forward(nxt, np.array(lengths)[:, None], rows=np.array(rows), keep=1)
    after_want = np.concatenate([reference.forward(nxt[i:i + 1], np.array([[n]]), rows=slice(r, r + 1), keep=1)
                                 for i, (n, r) in enumerate(zip(lengths, rows))])
    diff = max(np.abs(got - want[-1]).max(), np.abs(after - after_want).max())
    print(f"{ids.shape[1]} tokens in pieces of {backend.max_seq_len}: max |diff| {diff:.2e} (tol 1e-4)")
    assert got.shape == (1, 5, backend.vocab_size) and diff < 1e-4
    with pytest.raises(LlgraphError, match="cache row 1's tokens in one forward are not consecutive"):
        backend.forward(np.array([[5, 6, 7]]), np.array([[4, 6, 5]]), rows=np.array([[1, 1, 1]]), keep=1)


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


def test_a_mixture_on_the_twin_answers_as_onnx_runtime(tmp_path):
    """A Qwen3-MoE `trt` export — no If: every step's pairs grouped by expert, each run multiplied by its expert's
    matrix (export/trt.py's moe) — built by TensorRT-RTX (the ExpertMatMul function bodies on its own layers) and run
    by the twin: the greedy tokens of ONNX Runtime's own MoE op on the ort export, a
    batch of two prompts."""
    from test_families import hf_checkpoint

    hf_checkpoint("qwen3_moe", tmp_path / "hf")
    trt = built(export_model(tmp_path / "hf", checkpoint=tmp_path / "hf", out=tmp_path / "trt", target="trt",
                             max_seq_len=64), max_batch=2)
    ort = export_model(tmp_path / "hf", checkpoint=tmp_path / "hf", out=tmp_path / "ort", max_seq_len=64)
    prompts = PROMPTS[:2]
    got = TRTRunner(trt, tensorrt="twin").generate(prompts, 8, eos_token_ids=[])
    want = ORTRunner(ort).generate(prompts, 8, eos_token_ids=[])
    print([g.token_ids for g in got])
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
