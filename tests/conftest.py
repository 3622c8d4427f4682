"""The suite's shared fixtures. Tests live in rooms that mirror the code (core, plugins, export, engine, backends,
serve, eval, cli); the helpers they share sit here beside this file (reference.py: independent references;
serving.py: a server in a subprocess; imports.py: the layering scan), and every room is importable from every other
(a room's test may reuse another's helpers, e.g. test_export.compare_steps)."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

# The Triton kernels' tests run interpreted on CPU tensors (tests/plugins/test_kernels.py) unless told to compile for a
# GPU. Triton reads this when it is first imported, which any test module's imports may cause (peft's do), so it is
# set here, before any of them.
if os.environ.get("LLGRAPH_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS)] + sorted(str(room) for room in TESTS.iterdir() if room.is_dir() and room.name != "data"
                                     and not room.name.startswith((".", "_")))


def need(module: str, linux_x86_64: bool = False):
    """`module`, which the [test] extra installs: its absence fails the test (a partial install must not drop a
    suite silently), in one line naming the install. `linux_x86_64`: the extra installs it only there (its
    platform marker in pyproject.toml: triton, TensorRT-RTX), so elsewhere the test is skipped."""
    import importlib
    import platform

    if linux_x86_64 and (sys.platform != "linux" or platform.machine() != "x86_64"):
        pytest.skip(f"the test extra installs {module} on Linux x86_64 only", allow_module_level=True)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"{module} is missing ({e}); the test extra installs it: pip install -e '.[test]'", pytrace=False)


def max_diff(a, b) -> float:
    """max |a - b| in float64 of two tensors or arrays (torch tensors, numpy arrays, ml_dtypes' bfloat16)."""
    return float(np.abs(_f64(a) - _f64(b)).max())


def expert_schedule(chosen: np.ndarray, experts: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, blocks) for chosen [tokens, k] as the `trt` export computes them (export/expert_schedule.py's ONNX
    nodes, checked by ONNX's checker and run by ONNX Runtime)."""
    import onnx

    from llgraph.export import expert_schedule as schedule

    onnx.checker.check_model(schedule.model(experts, rows), full_check=True)
    return schedule.run(chosen, experts, rows)


def _f64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        return x.detach().double().cpu().numpy()
    return np.asarray(x).astype(np.float64)


@pytest.fixture
def report(request):
    """report(what, diff, tol): print the max difference seen, then assert it is within tolerance."""
    def check(what: str, diff: float, tol: float):
        print(f"{request.node.name}: {what} max|diff| = {diff:.3e} (tol {tol:.0e})")
        assert diff <= tol, f"{what}: max|diff| {diff:.3e} > {tol:.0e}"
    return check


@pytest.fixture(scope="session")
def smollm2_export(tmp_path_factory):
    """smollm2_export(target, dtype="float32", max_seq_len=256) -> the bundled SmolLM2's export folder, made once per
    test session and shared by every test that asks for the same one (each is hundreds of MB and seconds to write)."""
    from llgraph.bundled import bundled_model
    from llgraph.export import export_model
    from llgraph.weight_request import Weights

    made = {}

    def get(target: str, dtype: str = "float32", max_seq_len: int = 256, quantized: bool = False,
            kernels: str = "auto"):
        """quantized: the GGUF's blocks as stored (Q4_1 layers, Q8_0 lm head; ort with the exact-compute accuracy
        level 0, on `kernels`); else dequantized to `dtype`."""
        if (target, dtype, quantized, kernels) == ("ort", "float32", False, "auto") and max_seq_len <= 512:
            max_seq_len = 512  # one float32 export for the tests that open it at 512 positions or fewer
        key = (target, dtype, max_seq_len, quantized, kernels)
        if key not in made:
            path = bundled_model("smollm2")
            out = tmp_path_factory.mktemp("smollm2") / f"{target}-{dtype}-{max_seq_len}-{'q' if quantized else 'f'}"
            weights = Weights(dtype, dequantize=not quantized,
                              accuracy_level=0 if quantized and target == "ort" else None, kernels=kernels)
            made[key] = export_model(path, checkpoint=path, out=out, target=target, weights=weights,
                                     max_seq_len=max_seq_len)
        return made[key]
    return get


@pytest.fixture(scope="session")
def serve_export(smollm2_export):
    """The SmolLM2 export the server tests serve: ort on llgraph's CPU kernels, its GGUF's blocks as stored (as
    `llgraph serve smollm2` runs them, here at the exact accuracy level 0; a decode step reads a quarter of the
    float32 export's bytes, and a row's bits do not depend on its neighbours), 512 positions
    (servers and runners of the tests pick their cache length below it: 256 mostly, 512 for tool calling's longer
    prompts)."""
    return smollm2_export("ort", max_seq_len=512, quantized=True)


@pytest.fixture(scope="session")
def shallow_smollm2(tmp_path_factory):
    """The bundled SmolLM2 cut to its first 2 layers (reference.truncated_gguf): its tokenizer, chat template and
    widths at 1/15 of its forward, for the tests that hold what surrounds the model — a server's answers to hostile
    input, a runtime against another on the same weights — not its text."""
    from reference import truncated_gguf

    from llgraph.bundled import bundled_model

    return truncated_gguf(bundled_model("smollm2"), tmp_path_factory.mktemp("smollm2-2") / "smollm2-2.gguf", 2)


@pytest.fixture(scope="session")
def shallow_export(shallow_smollm2):
    """shallow_smollm2 exported for ort, dequantized to float32, 512 positions (as serve_export)."""
    from llgraph.export import export_model
    from llgraph.weight_request import Weights

    return export_model(shallow_smollm2, checkpoint=shallow_smollm2, out=shallow_smollm2.parent / "ort",
                        target="ort", weights=Weights("float32", dequantize=True), max_seq_len=512)


@pytest.fixture(scope="session", autouse=True)
def private_export_cache(tmp_path_factory):
    """Tests never read or fill the user's export cache (~/.cache/llgraph): `llgraph generate CHECKPOINT` run by a
    test exports into a cache of this test session's own."""
    import os

    old = os.environ.get("LLGRAPH_CACHE_DIR")
    os.environ["LLGRAPH_CACHE_DIR"] = str(tmp_path_factory.mktemp("llgraph-cache"))
    yield
    if old is None:
        os.environ.pop("LLGRAPH_CACHE_DIR", None)
    else:
        os.environ["LLGRAPH_CACHE_DIR"] = old


class Replay:
    """A deterministic stepper shared by tests: each sequence of inputs is run once and its outputs recorded, so
    tests that feed the same steps reuse them. `session()` starts a new sequence (an empty cache)."""

    def __init__(self, make):
        self.make, self.memo, self.live, self.live_history = make, {}, None, None

    def session(self):
        replay, history = self, []

        class Session:
            def step(self, ids):
                history.append((tuple(ids.shape), tuple(ids.flatten().tolist())))
                key = tuple(history)
                if key not in replay.memo:
                    if replay.live_history != key[:-1]:  # bring a fresh stepper to this history
                        replay.live, replay.live_history = replay.make(), ()
                        for shape, values in key[:-1]:
                            replay.live.step(_ids(values, shape, ids))
                    out = replay.live.step(ids)
                    replay.memo[key] = {k: _copy(v) for k, v in out.items()}  # presents alias the live cache
                    replay.live_history = key
                return replay.memo[key]
        return Session()


def _copy(v):
    return v.clone() if hasattr(v, "clone") else v.copy()


def _ids(values, shape, like):
    """Recorded ids as the kind of array a step was given (a torch tensor or a numpy array)."""
    if hasattr(like, "detach"):
        import torch

        return torch.tensor(values).reshape(shape)
    return np.array(values, np.int64).reshape(shape)


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' own SmolLM2 from the bundled GGUF (its own dequantization, float32, eval) and its tokenizer,
    loaded once (~10 s) for every test that holds llgraph to it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llgraph.bundled import bundled_model
    from llgraph.gguf_source import shared_gguf_reads

    path = bundled_model("smollm2")
    with shared_gguf_reads():  # gguf's parse of the file, once, not transformers' three times
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        return model.eval(), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def smollm2_truth():
    """The float64 executor on the bundled SmolLM2's dequantized GGUF weights (cache 64), shared by the tests that
    hold an export to it."""
    from reference import Stepper

    from llgraph.bundled import bundled_model
    from llgraph.checkpoint import load_config
    from llgraph.gguf_source import GGUFSource

    path = bundled_model("smollm2")
    cfg = load_config(path)
    return cfg, Replay(lambda: Stepper(cfg, GGUFSource(path), max_seq=64, dtype="float64"))


@pytest.fixture(scope="session")
def tiny_runners(tmp_path_factory):
    """(cfg, source, runners): the same random tiny model (std 0.25: decisive logits) behind every CPU runner —
    torch, and ONNX Runtime on the ort, onnx and trt exports (trt through its function bodies), and "ort-llgraph":
    the ort export on llgraph's CPU kernels, whose attention takes ragged rows (passes.ragged_slots), with a float32
    cache — cache 64."""
    from reference import tiny, write_hf_checkpoint

    from llgraph.checkpoint import random_weights
    from llgraph.export import export_model
    from llgraph.runtime import ORTRunner, TorchRunner

    cfg = tiny()
    source = random_weights(cfg, seed=11, std=0.25)
    ckpt = write_hf_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), cfg, source)
    runners = {"torch": TorchRunner(ckpt, max_seq_len=64)}
    for target in ("ort", "onnx", "trt"):
        folder = export_model(ckpt, checkpoint=ckpt, out=tmp_path_factory.mktemp("tiny") / target, target=target)
        runners[target] = ORTRunner(folder, max_seq_len=64)
    from llgraph.weight_request import Weights

    folder = export_model(ckpt, checkpoint=ckpt, out=tmp_path_factory.mktemp("tiny") / "ort-llgraph", target="ort",
                          weights=Weights(kernels="llgraph"))
    runners["ort-llgraph"] = ORTRunner(folder, max_seq_len=64, kv_cache="float32")  # exact (the default is lossy)
    assert runners["ort-llgraph"].backend.ragged and runners["torch"].backend.ragged
    return cfg, source, runners
