"""The runners users call: each is the shared loop (loop.Runner) on one backend.

    ORTRunner("smollm2-onnx").generate("Hello", max_new_tokens=32)          # an export folder, ONNX Runtime CPU
    TorchRunner("smollm2").generate([[1, 2, 3]], max_new_tokens=8)        # a checkpoint, the PyTorch executor
    TRTRunner("smollm2-trt").generate("Hello", max_new_tokens=32)           # a built `trt` export folder, GPU
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from llgraph.errors import LlgraphError
from llgraph.runtime.backends import OrtBackend, TorchBackend
from llgraph.runtime.loop import Runner
from llgraph.runtime.tokenizer import Tokenizer
from llgraph.runtime.trt import TRTBackend


def _tokenizer(ref: Path) -> Tokenizer | None:
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
                 device: str = "cpu", progress: bool = False, weights: "Weights | None" = None):
        from llgraph.bundled import resolve
        from llgraph.config import load_config
        from llgraph.source_views import rtn_view
        from llgraph.weights import open_checkpoint

        checkpoint = resolve(checkpoint)
        cfg = load_config(resolve(config) or checkpoint)
        source = open_checkpoint(checkpoint, cfg)
        if weights is not None:  # the RTN weights an int4/int8 export carries, dequantized
            source = rtn_view(source, cfg, weights.quantize, weights.block_size, weights.symmetric, weights.lm_head)
        backend = TorchBackend(cfg, source, max_seq_len, dtype, device, progress)
        super().__init__(backend, _tokenizer(Path(checkpoint)), cfg.eos_token_ids)


class TRTRunner(Runner):
    """A TensorRT engine built by `llgraph build` from a `trt` export folder (TensorRT or TensorRT-RTX, as it was
    built with, and a GPU)."""

    def __init__(self, folder: str | Path, tensorrt: str = "auto"):
        backend = TRTBackend(folder, tensorrt)
        super().__init__(backend, _tokenizer(Path(folder)), backend.config.eos_token_ids)


@dataclass(frozen=True)
class Weights:
    """How a checkpoint's weights are run (the export flags of the same names): `dtype`; a quantized GGUF as stored
    or `dequantize`d; a float checkpoint `quantize`d (int4/int8) by round-to-nearest; the ort target's
    MatMulNBits `accuracy_level` (None: its default, llgraph.export.ort.DEFAULT_ACCURACY_LEVEL); the lm head
    (and a table tied to it) rounded to `lm_head` (int4/int8) too."""
    dtype: str = "float32"
    quantize: str | None = None
    block_size: int = 32
    symmetric: bool = False
    dequantize: bool = False
    accuracy_level: int | None = None
    lm_head: str | None = None

    @property
    def mode(self) -> str:
        """The export cache's name for these choices."""
        from llgraph.export.ort import DEFAULT_ACCURACY_LEVEL

        level = f"-l{DEFAULT_ACCURACY_LEVEL if self.accuracy_level is None else self.accuracy_level}"
        if self.dequantize:
            return f"{self.dtype}-dequantized"
        head = f"-head{self.lm_head}" if self.lm_head else ""
        rounding = f"-b{self.block_size}-{'sym' if self.symmetric else 'asym'}" if self.quantize or self.lm_head else ""
        return f"{self.dtype}-{self.quantize or 'stored'}{head}{rounding}{level}"


def open_runner(model: str, backend: str, max_seq_len: int | None, cache_dir: str | None = None,
                tensorrt: str = "auto", weights: Weights = Weights()):
    """MODEL is an export folder (has manifest.json) or a checkpoint; a checkpoint for the ort backend is exported
    once into the cache (keyed on the checkpoint's content and `weights.mode`, see llgraph/cache.py) and reused."""
    from llgraph.bundled import resolve
    from llgraph.cache import cache_dir as resolve_cache
    from llgraph.cache import entry_for
    from llgraph.export import check_weight_request

    check_weight_request(weights.dtype, backend, weights.quantize, weights.block_size, weights.dequantize,
                         weights.accuracy_level if backend == "ort" else None,  # torch computes exactly anyway
                         weights.lm_head)
    path = Path(resolve(model))
    if not path.exists():
        raise FileNotFoundError(f"model {model} does not exist; pass an export folder, a checkpoint or 'smollm2'")
    if (path / "manifest.json").exists():
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
    if not (folder / "manifest.json").exists():
        print(f"exporting {path.name} for ONNX Runtime into {folder} (once; `llgraph cache list` shows it)",
              file=sys.stderr)
        export_model(path, checkpoint=path, out=folder, target="ort", dtype=weights.dtype, force=True, progress=True,
                     quantize=weights.quantize, block_size=weights.block_size, symmetric=weights.symmetric,
                     dequantize=weights.dequantize, accuracy_level=weights.accuracy_level, lm_head=weights.lm_head)
    return ORTRunner(folder, max_seq_len)
