"""The runners users call: each is the shared loop (loop.Runner) on one backend.

    ORTRunner("smollm2-onnx").generate("Hello", max_new_tokens=32)          # an export folder, ONNX Runtime CPU
    TorchRunner("smollm2").generate([[1, 2, 3]], max_new_tokens=8)        # a checkpoint, the PyTorch executor
    TRTRunner("smollm2-trt").generate("Hello", max_new_tokens=32)           # a built `trt` export folder, GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

from llgraph.checkpoint import open_model
from llgraph.errors import LlgraphError
from llgraph.export_folder import Manifest
from llgraph.runtime.backends import OrtBackend, TorchBackend
from llgraph.runtime.loop import Runner
from llgraph.runtime.trt import TRTBackend
from llgraph.tokenizer import Tokenizer
from llgraph.weight_request import Weights


def _tokenizer(ref: Path | None) -> Tokenizer | None:
    if ref is None:
        return None
    ref = Path(ref)
    if ref.suffix == ".gguf" or (ref.is_dir() and (ref / "tokenizer.json").exists()):
        return Tokenizer.load(ref)
    return None


class ORTRunner(Runner):
    """ONNX Runtime on an `llgraph export` folder (either target)."""

    def __init__(self, folder: str | Path, max_seq_len: int | None = None, threads: int | None = None):
        backend = OrtBackend(folder, max_seq_len, threads)
        super().__init__(backend, _tokenizer(Path(folder)), backend.config.eos_token_ids)


class TorchRunner(Runner):
    """The PyTorch executor on a checkpoint (HF folder, .safetensors, .gguf, or 'smollm2')."""

    def __init__(self, checkpoint, config=None, max_seq_len: int | None = None, dtype: str = "float32",
                 device: str = "cpu", progress: bool = False, weights: Weights | None = None):
        """`weights`: the RTN rounding an int4/int8 export carries, computed dequantized (its dtype: `dtype`)."""
        weights = (weights or Weights()).replace(dtype=dtype, accuracy_level=None)
        if not weights.rounds:  # the executor reads a GGUF's blocks dequantized, whatever their type
            weights = weights.replace(dequantize=True)
        model = open_model(config, checkpoint, weights)
        backend = TorchBackend(model.config, model.source, max_seq_len, weights.dtype, device, progress)
        super().__init__(backend, _tokenizer(model.checkpoint), model.config.eos_token_ids)


class TRTRunner(Runner):
    """A TensorRT engine built by `llgraph build` from a `trt` export folder (TensorRT or TensorRT-RTX, as it was
    built with, and a GPU)."""

    def __init__(self, folder: str | Path, tensorrt: str = "auto"):
        backend = TRTBackend(folder, tensorrt)
        super().__init__(backend, _tokenizer(Path(folder)), backend.config.eos_token_ids)


def open_runner(model: str, backend: str, max_seq_len: int | None, cache_dir: str | None = None,
                tensorrt: str = "auto", weights: Weights = Weights()):
    """MODEL is an export folder (has manifest.json) or a checkpoint; a checkpoint for the ort backend is exported
    once into the cache (keyed on the checkpoint's content and `weights.mode`, see llgraph/cache.py) and reused."""
    from llgraph.bundled import resolve
    from llgraph.runtime.cache import cache_dir as resolve_cache
    from llgraph.runtime.cache import entry_for

    weights.check(backend)
    path = Path(resolve(model))
    if not path.exists():
        raise FileNotFoundError(f"model {model} does not exist; pass an export folder, a checkpoint or 'smollm2'")
    if Manifest.find(path) is not None:
        if weights != Weights():
            raise LlgraphError(f"{model} is already exported, weights and all; --dtype, --quantize, --lm-head, "
                               "--dequantize and --accuracy-level apply to a checkpoint (or pass them to "
                               "`llgraph export`)")
        if backend == "trt":
            return TRTRunner(path, tensorrt)
        if backend != "ort":
            raise LlgraphError(f"{model} is an ONNX export folder; it runs with --backend ort (or trt once built)")
        return ORTRunner(path, max_seq_len)
    if backend == "torch":
        return TorchRunner(path, max_seq_len=max_seq_len, dtype=weights.dtype, progress=True, weights=weights)
    if backend == "trt":
        raise LlgraphError(f"--backend trt runs a built engine: `llgraph export --checkpoint {model} --target trt "
                           "--dtype fp16 -o OUT`, then `llgraph build OUT`, then pass OUT")
    from llgraph.export import export_model

    folder = entry_for(path, resolve_cache(cache_dir), "ort", weights.mode)
    if Manifest.find(folder) is None:
        print(f"exporting {path.name} for ONNX Runtime into {folder} (once; `llgraph cache list` shows it)",
              file=sys.stderr)
        export_model(path, checkpoint=path, out=folder, target="ort", weights=weights, force=True, progress=True)
    return ORTRunner(folder, max_seq_len)
