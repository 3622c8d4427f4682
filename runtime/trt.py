"""TensorRT: build an engine from a `trt` export folder, and run it as a backend of the shared loop.

    llgraph build FOLDER [-o FOLDER/model.engine]      # or build_engine(folder)
    TRTRunner(FOLDER).generate("Hello", max_new_tokens=32)

The engine has two optimization profiles over the same I/O: 0 = prefill (seq 1..max_seq_len), 1 = decode
(seq 1). The KV cache is the static [batch, kv_heads, max_seq_len, head_dim] of the export, fixed at build time;
GroupedAttention's plugin aliases present to past, so the backend binds each cache buffer (a torch CUDA tensor)
as both, once per request, and nothing is copied per step. `engine.json` in the export folder records the profiles
and limits. tensorrt is imported only here, lazily, with a one-line error when it (or a GPU) is missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from llgraph.builder import cache_pairs, new_cache
from llgraph.config import LlamaConfig
from llgraph.errors import LlgraphError
from llgraph.plugins.qdp import TensorRTMissing, import_tensorrt, register_plugins
from llgraph.runtime.backends import DEFAULT_MAX_SEQ
from llgraph.runtime.loop import Backend
from llgraph.runtime.sampling import RequestError
from llgraph.weights import TORCH_DTYPES

ENGINE_FILE, ENGINE_META, TIMING_CACHE = "model.engine", "engine.json", "timing.cache"
PREFILL, DECODE = 0, 1


class EngineError(LlgraphError):
    """A bad build request or an engine TensorRT refused; one line naming the fix."""


def read_manifest(folder: Path) -> dict:
    path = folder / "manifest.json"
    if not path.exists():
        raise EngineError(f"{folder} is not an llgraph export folder (no manifest.json); run llgraph export first")
    manifest = json.loads(path.read_text())
    if manifest["target"] != "trt":
        raise EngineError(f"{folder} was exported for target '{manifest['target']}'; re-export it with "
                          "`llgraph export ... --target trt` to build a TensorRT engine")
    return manifest


def profiles(cfg: LlamaConfig, max_batch: int, max_seq_len: int, opt_prefill: int) -> list[dict]:
    """Per profile, input name -> (min, opt, max) shape. The cache's max_seq dim is fixed at max_seq_len."""
    batch = (1, 1, max_batch)

    def shapes(seq: tuple[int, int, int]) -> dict:
        ids = tuple(zip(batch, seq))
        cache = tuple((b, cfg.num_kv_heads, max_seq_len, cfg.head_dim) for b in batch)
        return {"input_ids": ids, "position_ids": ids, **{past: cache for past, _ in cache_pairs(cfg)}}
    return [shapes((1, min(opt_prefill, max_seq_len), max_seq_len)), shapes((1, 1, 1))]


def _check_gpu() -> None:
    if not torch.cuda.is_available():
        raise TensorRTMissing("TensorRT needs an NVIDIA GPU and none is visible (torch.cuda.is_available() is "
                              "False); run this on a GPU machine, or use --backend ort on CPU")


def build_engine(folder, engine: str | Path | None = None, max_batch: int = 8, max_seq_len: int | None = None,
                 opt_prefill: int = 128, jit: bool = False, progress: bool = True) -> Path:
    """Build `folder/model.engine` (or `engine`) from a `trt` export; written under a temporary name and renamed."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    cfg = LlamaConfig(**manifest["config"])
    max_seq_len = max_seq_len or min(DEFAULT_MAX_SEQ, manifest["max_positions"])
    if not 1 <= max_batch <= 1024:
        raise EngineError(f"--max-batch ({max_batch}) must be in 1..1024")
    if not 2 <= max_seq_len <= manifest["max_positions"]:
        raise EngineError(f"--max-seq-len ({max_seq_len}) must be in 2..{manifest['max_positions']} (the export's "
                          "RoPE range); re-export with a larger --max-seq-len for more")
    engine = Path(engine) if engine else folder / ENGINE_FILE
    trt = import_tensorrt()
    _check_gpu()
    register_plugins()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    for flag in ("STRONGLY_TYPED", "PREFER_JIT_PYTHON_PLUGINS" if jit else "PREFER_AOT_PYTHON_PLUGINS"):
        if hasattr(trt.NetworkDefinitionCreationFlag, flag):  # TensorRT 11 is always strongly typed
            flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, flag))
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(folder / manifest["model"])):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT could not parse {folder / manifest['model']}: {errors}")
    config = builder.create_builder_config()
    if manifest["dtype"] == "float32" and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32: the engine is compared with the executor
    for shapes in profiles(cfg, max_batch, max_seq_len, opt_prefill):
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    timing = folder / TIMING_CACHE
    config.set_timing_cache(config.create_timing_cache(timing.read_bytes() if timing.exists() else b""), False)
    if progress:
        config.progress_monitor = _progress_monitor(trt)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineError("TensorRT failed to build the engine (see its log above)")
    _write(engine, bytes(serialized))
    _write(timing, bytes(config.get_timing_cache().serialize()))
    meta = {"engine": os.path.relpath(engine.resolve(), folder.resolve()), "max_batch": max_batch, "max_seq_len": max_seq_len, "opt_prefill": opt_prefill,
            "profiles": {"prefill": PREFILL, "decode": DECODE}, "plugins": "jit" if jit else "aot",
            "tensorrt": trt.__version__, "gpu": torch.cuda.get_device_name()}
    _write(folder / ENGINE_META, json.dumps(meta, indent=2).encode())  # in the folder even when -o is elsewhere
    return engine


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)


def _progress_monitor(trt):
    from tqdm import tqdm

    class Monitor(trt.IProgressMonitor):
        """One tqdm bar per build phase."""

        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.bars = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            self.bars[phase_name] = tqdm(total=num_steps, desc=f"build: {phase_name}", leave=parent_phase is None)

        def step_complete(self, phase_name, step):
            self.bars[phase_name].update(step + 1 - self.bars[phase_name].n)
            return True  # keep building

        def phase_finish(self, phase_name):
            self.bars.pop(phase_name).close()
    return Monitor()


class TRTBackend(Backend):
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        manifest = read_manifest(folder)
        meta_path = folder / ENGINE_META
        if not meta_path.exists():
            raise EngineError(f"{folder} has no engine; build one with `llgraph build {folder}`")
        meta = json.loads(meta_path.read_text())
        self.config = LlamaConfig(**manifest["config"])
        self.dtype, self.vocab_size = TORCH_DTYPES[manifest["dtype"]], self.config.vocab_size
        self.max_seq_len, self.max_batch = meta["max_seq_len"], meta["max_batch"]
        trt = import_tensorrt()
        _check_gpu()
        register_plugins()  # a JIT engine calls back into them; an AOT engine needs none, registering is harmless
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self._runtime.deserialize_cuda_engine((folder / meta["engine"]).read_bytes())
        if self.engine is None:
            raise EngineError(f"TensorRT could not load {folder / meta['engine']} (built with TensorRT "
                              f"{meta['tensorrt']} on {meta['gpu']}); rebuild it with `llgraph build {folder}`")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.cache, self._profile, self._bound = {}, None, False

    def allocate(self, batch: int) -> None:
        if batch > self.max_batch:
            raise RequestError(f"batch of {batch} prompts exceeds the engine's max batch ({self.max_batch}); "
                               "rebuild with `llgraph build --max-batch`")
        self.cache = new_cache(self.config, batch, self.max_seq_len,
                               lambda shape: torch.zeros(shape, dtype=self.dtype, device="cuda"))
        self._bound = False

    def _bind_cache(self) -> None:
        """Each cache buffer as both past and present: the plugin writes it in place. Once per request and per
        profile switch (shapes are per profile), not per step."""
        for past, present in cache_pairs(self.config):
            t = self.cache[past]
            self.context.set_input_shape(past, tuple(t.shape))
            self.context.set_tensor_address(past, t.data_ptr())
            self.context.set_tensor_address(present, t.data_ptr())
        self._bound = True

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        batch, seq = input_ids.shape
        with torch.cuda.stream(self.stream):
            profile = DECODE if seq == 1 else PREFILL
            if profile != self._profile:
                self.context.set_optimization_profile_async(profile, self.stream.cuda_stream)
                self._profile, self._bound = profile, False
            if not self._bound:
                self._bind_cache()
            ids, pos = input_ids.to("cuda", non_blocking=True), position_ids.to("cuda", non_blocking=True)
            logits = torch.empty(batch, seq, self.vocab_size, dtype=self.dtype, device="cuda")
            for name, t in (("input_ids", ids), ("position_ids", pos)):
                self.context.set_input_shape(name, tuple(t.shape))
                self.context.set_tensor_address(name, t.data_ptr())
            self.context.set_tensor_address("logits", logits.data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise EngineError("TensorRT failed to run the engine (see its log above)")
        self.stream.synchronize()
        return logits.float().cpu()

