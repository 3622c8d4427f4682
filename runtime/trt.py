"""TensorRT as a backend of the shared loop: a built engine (export/engine.py builds it) run on a GPU.

    TRTRunner(FOLDER).generate("Hello", max_new_tokens=32)

The backend binds each cache buffer (a torch CUDA tensor) as both past and present, once per request (the
engine's GroupedAttention plugin aliases present to past), and nothing is copied per step; prefill and decode
run on the engine's two optimization profiles.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llgraph.builder import cache_pairs, new_cache
from llgraph.errors import LlgraphError
from llgraph.export.engine import (
    DECODE,
    PREFILL,
    EngineError,
    check_gpu,
    io_dtypes,
    load_tensorrt,
    read_manifest,
    trt_logger,
)
from llgraph.export_folder import ENGINE_META, Manifest
from llgraph.plugins.qdp import register_plugins
from llgraph.runtime.loop import Backend, Runner
from llgraph.runtime.registry import BackendSpec, RunOptions
from llgraph.runtime.sampling import RequestError
from llgraph.tokenizer import Tokenizer


class TRTBackend(Backend):
    def __init__(self, folder: str | Path, tensorrt: str = "auto"):
        folder = Path(folder)
        manifest = read_manifest(folder)
        meta_path = folder / ENGINE_META
        if not meta_path.exists():
            raise EngineError(f"{folder} has no engine; build one with `llgraph build {folder}`")
        meta = json.loads(meta_path.read_text())
        self.config = manifest.config
        self.io = io_dtypes(self.config, manifest.dtype)  # what the build test checks the network against
        self.vocab_size = self.config.vocab_size
        self.max_seq_len, self.max_batch = meta["max_seq_len"], meta["max_batch"]
        trt = load_tensorrt(meta.get("flavor", "tensorrt") if tensorrt == "auto" else tensorrt)
        check_gpu()
        if meta.get("plugins", "aot") == "jit":
            register_plugins()  # a JIT engine calls back into them; AOT and native engines need no Python
        self._logger = trt_logger(trt)
        self._runtime = trt.module.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine((folder / meta["engine"]).read_bytes())
        if self.engine is None:
            raise EngineError(f"{trt.name} could not load {folder / meta['engine']} (built with "
                              f"{meta.get('flavor', 'tensorrt')} {meta['tensorrt']} for {meta.get('runs_on')}); "
                              f"rebuild it with `llgraph build {folder}`")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.cache, self._profile, self._bound = {}, None, None

    def allocate(self, batch: int) -> None:
        if batch > self.max_batch:
            raise RequestError(f"batch of {batch} prompts exceeds the engine's max batch ({self.max_batch}); "
                               "rebuild with `llgraph build --max-batch`")
        self.cache = new_cache(self.config, batch, self.max_seq_len,
                               lambda shape: torch.zeros(shape, dtype=self.io["past_key_values.0.key"], device="cuda"))
        self._bound = None

    def _bind_cache(self, rows: slice) -> None:
        """Rows `rows` of each cache buffer (a contiguous view) as both past and present: the plugin writes it in
        place. Once per request, per profile switch (shapes are per profile) and per change of rows, not per step."""
        for past, present in cache_pairs(self.config):
            t = self.cache[past][rows]
            self.context.set_input_shape(past, tuple(t.shape))
            self.context.set_tensor_address(past, t.data_ptr())
            self.context.set_tensor_address(present, t.data_ptr())
        self._bound = rows

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: slice | None = None,
                keep: int = 0) -> torch.Tensor:  # every position's logits, whatever `keep` asks
        batch, seq = input_ids.shape
        rows = slice(0, next(iter(self.cache.values())).shape[0]) if rows is None else rows
        with torch.cuda.stream(self.stream):
            profile = DECODE if seq == 1 else PREFILL
            if profile != self._profile:
                self.context.set_optimization_profile_async(profile, self.stream.cuda_stream)
                self._profile, self._bound = profile, None
            if self._bound != rows:
                self._bind_cache(rows)
            ids = input_ids.to("cuda", self.io["input_ids"], non_blocking=True)
            pos = position_ids.to("cuda", self.io["position_ids"], non_blocking=True)
            logits = torch.empty(batch, seq, self.vocab_size, dtype=self.io["logits"], device="cuda")
            for name, t in (("input_ids", ids), ("position_ids", pos)):
                self.context.set_input_shape(name, tuple(t.shape))
                self.context.set_tensor_address(name, t.data_ptr())
            self.context.set_tensor_address("logits", logits.data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise EngineError("TensorRT failed to run the engine (see its log above)")
        self.stream.synchronize()
        return logits.float().cpu()


def engine_side(folder: str | Path):
    """A diff side (runtime/diff.py): a TensorRT engine built from a `trt` export folder (needs tensorrt and a
    GPU). It exposes the final outputs: logits and the present caches."""
    backend = TRTBackend(folder)

    def stepper():
        fresh = [True]

        def step(s: dict) -> dict:
            if fresh[0]:
                backend.allocate(s["input_ids"].shape[0])
                fresh[0] = False
            logits = backend.forward(torch.from_numpy(s["input_ids"]), torch.from_numpy(s["position_ids"]))
            values = {"logits": logits.numpy()}
            for past, present in cache_pairs(backend.config):
                values[present] = backend.cache[past].float().cpu().numpy()
            return values
        return step
    return stepper


class TRTRunner(Runner):
    """A TensorRT engine built by `llgraph build` from a `trt` export folder (TensorRT or TensorRT-RTX, as it was
    built with, and a GPU)."""

    def __init__(self, folder: str | Path, tensorrt: str = "auto"):
        backend = TRTBackend(folder, tensorrt)
        super().__init__(backend, Tokenizer.find(Path(folder)), backend.config.eos_token_ids)


def _open(path: Path, options: RunOptions) -> TRTRunner:
    if Manifest.find(path) is None:
        raise LlgraphError(f"--backend trt runs a built engine: `llgraph export --checkpoint {options.model} "
                           "--target trt --dtype fp16 -o OUT`, then `llgraph build OUT`, then pass OUT")
    return TRTRunner(path, options.tensorrt)


BACKEND = BackendSpec("trt", _open, {"trt": lambda r: engine_side(r.engine)}, bf16=True, accuracy_level=False)
