"""TensorRT engines: built from a `trt` (or `onnx`) export folder, with TensorRT or TensorRT-RTX.

    llgraph build FOLDER [-o FOLDER/model.engine]      # or build_engine(folder)

The engine has two optimization profiles over the same I/O: 0 = prefill (seq 1..max_seq_len), 1 = decode
(seq 1). The KV cache is the static [rows, kv_heads, max_seq_len, head_dim] of the export, fixed at build time;
GroupedAttention's plugin aliases present to past. An engine on llgraph's plugins takes `slot_ids`, each token's
cache row (ragged rows: a step runs only the busy rows); one on TensorRT's native layers runs contiguous rows.
`engine.json` in the export folder records the profiles and limits; runtime/backends/trt.py runs the engine.
tensorrt is imported lazily, with a one-line error when it is missing.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llgraph.builder import DEFAULT_MAX_SEQ, cache_pairs
from llgraph.config import LlamaConfig
from llgraph.errors import LlgraphError
from llgraph.export.trt_network import for_build
from llgraph.export_folder import ENGINE_FILE, ENGINE_META, TIMING_CACHE, Manifest
from llgraph.ir import DTYPE_BYTES
from llgraph.outdir import write_atomic
from llgraph.passes import SLOTS_INPUT
from llgraph.plugins.tensorrt.qdp import TensorRTMissing, register_plugins

PREFILL, DECODE = 0, 1
ALIGN = 256  # TensorRT's setTensorAddress takes 256-byte aligned addresses only
FLAVORS = ("auto", "tensorrt", "rtx")  # and, to run an engine folder's contract on the CPU, "twin" (trt_twin.py)
PLUGIN_MODES = ("aot", "jit", "none")
BUILDABLE = ("trt", "onnx")  # `onnx` is standard ops only: TensorRT builds it with its native layers
INSTALL = {"tensorrt": "pip install tensorrt (10.15+/11; datacenter GPUs, Hopper included)",
           "rtx": "pip install tensorrt-rtx-cu12-libs tensorrt-rtx-cu12-bindings (TensorRT-RTX: engines for "
                  "RTX/Ampere+ GPUs, built on any machine, no GPU needed)"}
# the parser names a layer after its function-body node, so every call site of one body repeats the same names
_BENIGN = ("already exists, the output tensors of this new instance will not be queryable",
           "has Int64 binding")


class EngineError(LlgraphError):
    """A bad build request or an engine TensorRT refused; one line naming the fix."""


@dataclass(frozen=True)
class TensorRT:
    """The TensorRT Python module in use: standard TensorRT (`tensorrt`) or TensorRT-RTX (`tensorrt_rtx_bindings`),
    one API for what llgraph calls."""
    module: Any
    flavor: str  # "tensorrt" | "rtx"

    @property
    def name(self) -> str:
        kind = {"tensorrt": "TensorRT", "rtx": "TensorRT-RTX"}.get(self.flavor, "TensorRT's CPU twin")
        return f"{kind} {self.module.__version__}"


def load_tensorrt(flavor: str = "auto") -> TensorRT:
    """Import TensorRT (`flavor` "tensorrt"), TensorRT-RTX ("rtx"), or whichever is installed ("auto", TensorRT
    first). Missing → one line naming both install commands."""
    if flavor not in FLAVORS:
        raise EngineError(f"unknown --tensorrt '{flavor}'; use one of {', '.join(FLAVORS)}")
    tried = []
    for name, modules in (("tensorrt", ("tensorrt",)), ("rtx", ("tensorrt_rtx_bindings", "tensorrt_rtx"))):
        if flavor not in ("auto", name):
            continue
        for module in modules:
            try:
                mod = importlib.import_module(module)
                mod.Builder  # noqa: B018  (PyPI's `tensorrt` stub imports but has no API)
                return TensorRT(mod, name)
            except Exception as e:  # an import of a stub or a library without its CUDA runtime raises anything
                tried.append(f"{module}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    wanted = " or ".join(INSTALL[f] for f in (("tensorrt", "rtx") if flavor == "auto" else (flavor,)))
    who = "neither TensorRT nor TensorRT-RTX is" if flavor == "auto" else \
        f"{'TensorRT' if flavor == 'tensorrt' else 'TensorRT-RTX'} is not"
    raise TensorRTMissing(f"{who} installed "
                          f"({'; '.join(tried)}); {wanted}")


def read_manifest(folder: Path) -> Manifest:
    """The manifest of an export TensorRT can build."""
    manifest = Manifest.find(folder)
    if manifest is None:
        raise EngineError(f"{folder} is not an llgraph export folder (no manifest.json); run llgraph export first")
    if manifest.target not in BUILDABLE:
        raise EngineError(f"{folder} was exported for target '{manifest.target}' (ONNX Runtime's contrib ops); "
                          "re-export it with `llgraph export ... --target trt` to build a TensorRT engine")
    return manifest


def io_dtypes(cfg: LlamaConfig, dtype: str, ragged: bool = False) -> dict[str, str]:
    """Every engine I/O tensor and the dtype `TRTBackend` binds it with (ids int64; logits and caches the model's;
    a ragged engine's slot_ids int64)."""
    pairs = cache_pairs(cfg)
    return {"input_ids": "int64", "position_ids": "int64", **({SLOTS_INPUT: "int64"} if ragged else {}),
            **{past: dtype for past, _ in pairs}, "logits": dtype, **{present: dtype for _, present in pairs}}


def profiles(cfg: LlamaConfig, max_batch: int, max_seq_len: int, opt_prefill: int, ragged: bool = False
             ) -> list[dict]:
    """Per profile, input name -> (min, opt, max) shape. The cache's max_seq dim is fixed at max_seq_len; a ragged
    engine's slot_ids name one row per token (its cache bound whole, any rows running)."""
    batch = (1, 1, max_batch)

    def shapes(seq: tuple[int, int, int]) -> dict:
        ids = tuple(zip(batch, seq))
        cache = tuple((b, cfg.num_kv_heads, max_seq_len, cfg.head_dim) for b in batch)
        slots = {SLOTS_INPUT: tuple((b * n,) for b, n in ids)} if ragged else {}
        return {"input_ids": ids, "position_ids": ids, **slots, **{past: cache for past, _ in cache_pairs(cfg)}}
    return [shapes((1, min(opt_prefill, max_seq_len), max_seq_len)), shapes((1, 1, 1))]


def cuda_device() -> str | None:
    """The visible CUDA GPU's name, through torch (which TensorRT's runtime side binds buffers with); None where
    there is none, or no torch to ask."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def check_gpu() -> None:
    if cuda_device() is None:
        raise TensorRTMissing("TensorRT needs an NVIDIA GPU and none is visible to torch (torch.cuda.is_available() "
                              "is False, or torch is not installed); run this on a GPU machine with torch, or use "
                              "--backend ort on CPU")


def trt_logger(trt: TensorRT):
    """TensorRT's log at WARNING, less the parser's notes that are expected for every llgraph export."""
    class Logger(trt.module.ILogger):  # type: ignore[name-defined]
        def __init__(self):
            trt.module.ILogger.__init__(self)

        def log(self, severity, msg):
            if severity <= trt.module.ILogger.Severity.WARNING and not any(b in msg for b in _BENIGN):
                print(f"[{trt.name}] {msg}", file=sys.stderr)
    return Logger()


@dataclass
class Parsed:
    """A parsed network and what must outlive it (TensorRT's parser owns the imported weights)."""
    trt: TensorRT
    builder: Any
    network: Any
    parser: Any
    logger: Any


def parse(folder: str | Path, max_seq_len: int, trt: TensorRT, plugins: str = "none") -> Parsed:
    """Parse a `trt` export with its cache length pinned to `max_seq_len` in the model header (the weights stay in
    their external file; nothing is copied). Every attention is marked decomposable so that shapes and dtypes
    without a dedicated kernel (fp32) build from TensorRT's own layers."""
    import onnx

    folder = Path(folder)
    manifest = read_manifest(folder)
    model_path = folder / manifest.model
    model = onnx.load(str(model_path), load_external_data=False)
    for_build(model, max_seq_len, plugins, trt.flavor)
    t = trt.module
    logger = trt_logger(trt)
    builder = t.Builder(logger)
    flags = 0
    wanted = ["STRONGLY_TYPED", {"jit": "PREFER_JIT_PYTHON_PLUGINS", "aot": "PREFER_AOT_PYTHON_PLUGINS"}.get(plugins)]
    for flag in wanted:  # TensorRT 11 is always strongly typed and has no such flag
        if flag and hasattr(t.NetworkDefinitionCreationFlag, flag):
            flags |= 1 << int(getattr(t.NetworkDefinitionCreationFlag, flag))
    network = builder.create_network(flags)
    parser = t.OnnxParser(network, logger)
    if not parser.parse(model.SerializeToString(), str(model_path)):
        errors = "; ".join(str(parser.get_error(i)).replace("\n", " ") for i in range(parser.num_errors))
        raise EngineError(f"{trt.name} could not parse {model_path}: {errors}")
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == t.LayerType.ATTENTION_OUTPUT:
            layer.__class__ = t.IAttentionOutputLayer  # get_layer returns the base class
            layer.attention.decomposable = True
    return Parsed(trt, builder, network, parser, logger)


def check_build_request(folder: Path, max_batch: int, max_seq_len: int | None, plugins: str | None
                        ) -> tuple[Manifest, int]:
    """Validate a build before importing TensorRT; returns the manifest and the cache length."""
    manifest = read_manifest(folder)
    max_seq_len = max_seq_len or min(DEFAULT_MAX_SEQ, manifest.max_positions)
    if not 1 <= max_batch <= 1024:
        raise EngineError(f"--max-batch ({max_batch}) must be in 1..1024")
    if not 2 <= max_seq_len <= manifest.max_positions:
        raise EngineError(f"--max-seq-len ({max_seq_len}) must be in 2..{manifest.max_positions} (the export's "
                          "RoPE range); re-export with a larger --max-seq-len for more")
    if plugins is not None and plugins not in PLUGIN_MODES:
        raise EngineError(f"unknown --plugins '{plugins}'; use one of {', '.join(PLUGIN_MODES)}")
    return manifest, aligned_cache_length(manifest, max_seq_len)


def cache_row_bytes(cfg: LlamaConfig, dtype: str, max_seq_len: int) -> int:
    """Bytes of one batch row of a cache tensor, [kv_heads, max_seq_len, head_dim] in the model's dtype."""
    return cfg.num_kv_heads * max_seq_len * cfg.head_dim * DTYPE_BYTES[dtype]


def aligned_cache_length(manifest: Manifest, max_seq_len: int) -> int:
    """`max_seq_len` rounded up so that one row of a cache ([kv_heads, max_seq, head_dim]) is a multiple of 256
    bytes: the scheduler binds row `slot` of each cache at slot * row bytes, and TensorRT refuses an address that is
    not 256-byte aligned (SmolLM2 in fp16: 384 bytes a position, so an even length)."""
    step = ALIGN // math.gcd(ALIGN, cache_row_bytes(manifest.config, manifest.dtype, 1))
    rounded = -(-max_seq_len // step) * step
    if rounded > manifest.max_positions:
        raise EngineError(f"--max-seq-len ({max_seq_len}) must round up to {rounded} for 256-byte aligned cache rows, "
                          f"past the export's RoPE range ({manifest.max_positions}); ask for {rounded - step} or less")
    return rounded


def configure(config, trt: TensorRT, dtype: str, plugins: str):
    """A builder config's flags for this build: no TF32 in an fp32 engine (fp32 means fp32: the engine is compared
    with the executor); with llgraph's plugins, aliased plugin I/O on — GroupedAttention's present_key/value alias
    its past inputs, which TensorRT honours only under PreviewFeature ALIASED_PLUGIN_IO_10_03 (NvInferRuntime.h:
    getAliasedInput "will only be called and have an effect when" it is on); without it present_* would be plain
    outputs and the cache update would not land in the bound cache."""
    t = trt.module
    if dtype == "float32" and hasattr(t.BuilderFlag, "TF32"):
        config.clear_flag(t.BuilderFlag.TF32)
    if plugins != "none":
        feature = getattr(getattr(t, "PreviewFeature", None), "ALIASED_PLUGIN_IO_10_03", None)
        if feature is None:
            raise EngineError(f"{trt.name} has no PreviewFeature.ALIASED_PLUGIN_IO_10_03, which llgraph's attention "
                              "plugin needs to update the cache in place; use TensorRT 10.15+ or --plugins none")
        config.set_preview_feature(feature, True)
    return config


def build_engine(folder, engine: str | Path | None = None, *, max_batch: int = 8, max_seq_len: int | None = None,
                 opt_prefill: int = 128, plugins: str | None = None, tensorrt: str = "auto",
                 progress: bool = True) -> Path:
    """Build `folder/model.engine` (or `engine`) from a `trt` export with TensorRT or TensorRT-RTX; written under a
    temporary name and renamed. `plugins`: "aot" (TensorRT's default: llgraph's Triton plugins, PTX inside the
    engine), "jit" (the same plugins called from Python) or "none" (TensorRT's native layers built from the
    function bodies; TensorRT-RTX's default and only choice)."""
    folder = Path(folder)
    asked = max_seq_len
    manifest, max_seq_len = check_build_request(folder, max_batch, max_seq_len, plugins)
    if asked is not None and asked != max_seq_len:
        print(f"--max-seq-len {asked} rounded up to {max_seq_len}, so that each row of the cache is 256-byte "
              "aligned as TensorRT binds it", file=sys.stderr)
    cfg = manifest.config
    engine = Path(engine) if engine else folder / ENGINE_FILE
    if engine.is_dir():
        raise EngineError(f"-o {engine} is a folder; name the engine file, e.g. -o {engine / ENGINE_FILE}")
    trt = load_tensorrt(tensorrt)
    if manifest.target == "onnx" and plugins not in (None, "none"):
        raise EngineError(f"{folder} is an `onnx` export (standard ops, no plugin nodes); drop --plugins")
    plugins = plugins or ("none" if trt.flavor == "rtx" or manifest.target == "onnx" else "aot")
    if trt.flavor == "rtx" and plugins != "none":
        raise EngineError(f"{trt.name} cannot run llgraph's plugins (its Python wheel has no tensorrt.plugin); "
                          "use --plugins none (its native attention, KV-cache and rotary layers)")
    if plugins == "none" and cfg.attention_softcap:
        raise EngineError(f"{cfg.name} soft-caps its attention logits, which TensorRT's own attention layer cannot "
                          f"({trt.name} refuses 'softcap'); build it with TensorRT and --plugins aot, so llgraph's "
                          "attention plugin runs it, or run the export with ONNX Runtime")
    if trt.flavor == "tensorrt":
        check_gpu()  # TensorRT-RTX builds ahead of time on the CPU; TensorRT needs the GPU it builds for
    if plugins != "none":
        register_plugins()
    t = trt.module
    net = parse(folder, max_seq_len, trt, plugins)
    config = configure(net.builder.create_builder_config(), trt, manifest.dtype, plugins)
    reported = []  # each profile's shapes as TensorRT holds them, recorded in engine.json
    inputs = {net.network.get_input(i).name for i in range(net.network.num_inputs)}
    for shapes in profiles(cfg, max_batch, max_seq_len, opt_prefill, SLOTS_INPUT in inputs):
        profile = net.builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
        reported.append({name: [list(d) for d in profile.get_shape(name)] for name in shapes})
    timing = folder / TIMING_CACHE
    if trt.flavor == "tensorrt":  # TensorRT-RTX: a timing cache queries the GPU and blocks a CPU-only build
        config.set_timing_cache(config.create_timing_cache(timing.read_bytes() if timing.exists() else b""), False)
    if progress:
        config.progress_monitor = _progress_monitor(t)
    started = time.perf_counter()
    serialized = net.builder.build_serialized_network(net.network, config)
    if serialized is None:
        raise EngineError(f"{trt.name} failed to build the engine (see its log above)")
    data = bytes(serialized)
    write_atomic(engine, data)
    if trt.flavor == "tensorrt":
        write_atomic(timing, bytes(config.get_timing_cache().serialize()))
    gpu = cuda_device()
    meta = {"engine": os.path.relpath(engine.resolve(), folder.resolve()), "max_batch": max_batch,
            "max_seq_len": max_seq_len, "opt_prefill": opt_prefill,
            "profiles": {"prefill": PREFILL, "decode": DECODE}, "profile_shapes": reported, "plugins": plugins,
            "ragged": SLOTS_INPUT in inputs,
            "tensorrt": trt.module.__version__, "flavor": trt.flavor,
            "runs_on": RUNS_ON[trt.flavor], "built_on": gpu or "CPU (ahead of time, no GPU)",
            "build_seconds": round(time.perf_counter() - started, 2), "engine_bytes": len(data)}
    write_atomic(folder / ENGINE_META, json.dumps(meta, indent=2).encode())  # in the folder even when -o is elsewhere
    return engine


RUNS_ON = {"tensorrt": "the GPU model it was built on (TensorRT engines are per GPU and TensorRT version)",
           "rtx": "NVIDIA GPUs of compute capability 8.0, 8.6, 8.9 and 12.x (Ampere, Ada, Blackwell RTX); not Hopper"}


def _progress_monitor(t):
    from tqdm import tqdm

    class Monitor(t.IProgressMonitor):  # type: ignore[name-defined]
        """One bar for the build's top-level phase; the nested phase at work is shown beside it."""

        def __init__(self):
            t.IProgressMonitor.__init__(self)
            self.bar: Any = None
            self.top: str | None = None

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None and self.bar is None:
                self.bar, self.top = tqdm(total=num_steps, desc="build engine", file=sys.stderr), phase_name
            elif self.bar is not None:
                self.bar.set_postfix_str(phase_name, refresh=True)

        def step_complete(self, phase_name, step):
            if phase_name == self.top:
                self.bar.update(step + 1 - self.bar.n)
            return True  # keep building

        def phase_finish(self, phase_name):
            if phase_name == self.top:
                self.bar.set_postfix_str("done")
                self.bar.close()
                self.bar, self.top = None, None
    return Monitor()


