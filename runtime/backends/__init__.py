"""The backends the engine runs on: one module each (its Backend, its Runner and a BACKEND spec) plus one line here:
`ort.py` (ONNX Runtime, the CPU default), `pytorch.py` (the executor, the reference), `trt.py` (a TensorRT engine)
and `trt_twin.py` (its CPU twin), and `export_cache.py` (checkpoints exported once into the user's cache).
`open_runner`, the CLI's --backend choices, diff's sides and the weight checks all find a backend here. May import
the engine.

    BACKENDS = {"ort": (module, help), ...}     # the one registration per backend
    backend("ort").open(path, RunOptions(...))   # -> a Runner on an export folder or a checkpoint
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from llgraph.weight_request import Weights

if TYPE_CHECKING:
    from llgraph.runtime.engine.runner import Runner

# name -> (its module, what it runs); modules load on first use, so the CLI lists them without importing torch
BACKENDS = {
    "ort": ("llgraph.runtime.backends.ort", "ONNX Runtime on the CPU (the default): an export folder, or a checkpoint "
                                   "exported once into the cache"),
    "torch": ("llgraph.runtime.backends.pytorch", "the PyTorch executor on a checkpoint (the numeric reference)"),
    "trt": ("llgraph.runtime.backends.trt", "a TensorRT engine built by `llgraph build` from a trt export (a GPU)"),
}


@dataclass(frozen=True)
class RunOptions:
    """How a runner is opened: what generate, eval, serve and lm-eval pass for every backend."""
    max_seq_len: int | None = None
    cache_dir: str | None = None
    tensorrt: str = "auto"
    weights: Weights = Weights()
    model: str = ""  # the reference the user gave ('smollm2', a path), for messages
    threads: int | None = None  # CPU threads: ONNX Runtime's intra-op pool (llgraph's kernels obey it), torch's
    kv_cache: str | None = None  # the KV cache's format (llgraph/kv_cache.py); None: the backend's default


@dataclass(frozen=True)
class SideRequest:
    """What a diff side is built from (runtime/eval/diff.py): the model, its weights, and where to run it."""
    config: object
    source: object
    dtype: str = "float32"
    max_seq: int = 256
    engine: Path | None = None  # a built engine's folder (the trt side)
    tensorrt: str = "auto"  # the trt side's TensorRT ("twin": its CPU twin)


@dataclass(frozen=True)
class BackendSpec:
    name: str
    open: Callable[[Path, RunOptions], Runner]  # an export folder or a checkpoint -> a runner, or a one-line error
    sides: dict[str, Callable[[SideRequest], Callable]] = field(default_factory=dict)  # diff's sides it runs
    bf16: bool = True  # runs bfloat16 weights
    accuracy_level: bool = False  # takes ONNX Runtime's MatMulNBits accuracy level
    kernels: bool = False  # runs llgraph's CPU kernels (--kernels llgraph)
    # makes every runner the process opens after it share one thread pool of N threads (a model and its draft model
    # on the same cores); None: the backend's runners need nothing
    share_threads: Callable[[int | None], None] | None = None
    kv_formats: tuple[str, ...] = ()  # the KV cache formats it keeps (llgraph/kv_cache.py); (): its engine's floats


def backend(name: str) -> BackendSpec:
    from llgraph.errors import LlgraphError, MissingExtra

    if name not in BACKENDS:
        raise LlgraphError(f"unknown backend '{name}'; use one of {', '.join(BACKENDS)}")
    try:
        return importlib.import_module(BACKENDS[name][0]).BACKEND
    except ImportError as e:  # torch is the executor's and TensorRT's buffers' package, not the ORT path's
        if (e.name or "").split(".")[0] != "torch":
            raise
        raise MissingExtra(f"--backend {name}", "torch", "torch", e) from None


def check_weights(name: str, weights: Weights) -> Weights:
    """The weight request against what backend `name` declares it runs (bf16, accuracy level, llgraph's kernels)."""
    spec = backend(name)
    return weights.check(name, spec.bf16, spec.accuracy_level, spec.kernels)


def diff_sides(wanted=()) -> dict[str, Callable[[SideRequest], Callable]]:
    """Every diff side of every backend that imports here, by name (torch, ort, onnx, trt); a side in `wanted`
    that none gives, because a backend's packages are missing, raises that backend's one-line error."""
    from llgraph.errors import MissingExtra

    sides, missing = {}, None
    for name in BACKENDS:
        try:
            sides.update(backend(name).sides)
        except MissingExtra as e:
            missing = missing or e
    if missing is not None and any(w is not None and w not in sides for w in wanted):
        raise missing
    return sides


def open_runner(model: str, name: str = "ort", *, max_seq_len: int | None = None, cache_dir: str | None = None,
                tensorrt: str = "auto", weights: Weights = Weights(), threads: int | None = None,
                kv_cache: str | None = None):
    """MODEL is an export folder (has manifest.json) or a checkpoint (or 'smollm2'); the backend opens it. A
    checkpoint for the ort backend is exported once into the cache (keyed on the checkpoint's content and
    `weights.mode`, see runtime/backends/export_cache.py) and reused. `kv_cache`: the KV cache's format (f32, f16, int8;
    llgraph/kv_cache.py), default the backend's."""
    from llgraph.bundled import resolve
    from llgraph.errors import LlgraphError
    from llgraph.export_folder import Manifest

    spec = backend(name)
    check_weights(name, weights)
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise LlgraphError(f"--threads ({threads}) must be a positive number of CPU threads")
    if threads is not None and name == "trt":
        raise LlgraphError("--threads sets CPU threads (--backend ort or torch); a TensorRT engine runs on the GPU")
    kv_cache = check_kv_cache(spec, kv_cache)
    path = Path(resolve(model))
    if not path.exists():
        raise FileNotFoundError(f"model {model} does not exist; pass an export folder, a checkpoint or 'smollm2'")
    if Manifest.find(path) is not None and weights != Weights():
        raise LlgraphError(f"{model} is already exported, weights and all; --dtype, --quantize, --lm-head, "
                           "--dequantize and --accuracy-level apply to a checkpoint (or pass them to "
                           "`llgraph export`)")
    return spec.open(path, RunOptions(max_seq_len, cache_dir, tensorrt, weights, str(model), threads, kv_cache))


def check_kv_cache(spec: BackendSpec, kv_cache: str | None) -> str | None:
    """The KV format asked of backend `spec` by its full name (None: the backend's default); one line where it has
    none such."""
    from llgraph.errors import LlgraphError
    from llgraph.kv_cache import kv_format

    if kv_cache is None:
        return None
    name = kv_format(kv_cache).name
    if name not in spec.kv_formats:
        runs = ", ".join(spec.kv_formats) if spec.kv_formats else "its engine's own float cache only"
        raise LlgraphError(f"--backend {spec.name} keeps no {name} KV cache (it runs {runs}); leave --kv-cache out")
    return name


def share_threads_with_a_draft(name: str, threads: int | None) -> None:
    """Before any runner of the process opens: a model and its draft model share one thread pool where the backend
    has one (ONNX Runtime's, runtime/backends/ort.share_threads)."""
    spec = backend(name)
    if spec.share_threads is not None:
        spec.share_threads(threads)


def open_draft(model: str, runner, name: str, *, cache_dir: str | None = None, tensorrt: str = "auto",
               threads: int | None = None):
    """A draft model for `runner` (speculative decoding): on the same backend with the same cache length, refused in
    one line (RequestError) unless it shares the runner's vocabulary."""
    from llgraph.runtime.engine.speculative import check_draft

    draft = open_runner(model, name, max_seq_len=runner.backend.max_seq_len, cache_dir=cache_dir, tensorrt=tensorrt,
                        threads=threads)
    check_draft(runner, draft)
    return draft
