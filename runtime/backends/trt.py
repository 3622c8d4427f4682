"""TensorRT as a backend of the shared loop: a built engine (export/trt_build.py builds it) run on a GPU.

    TRTRunner(FOLDER).generate("Hello", max_new_tokens=32)

The backend binds each cache buffer (a torch CUDA tensor) as both past and present, once per request (the
engine's GroupedAttention plugin aliases present to past), and nothing is copied per step; prefill and decode
run on the engine's two optimization profiles. An engine on llgraph's plugins is ragged: the whole cache stays
bound and each token names its row (slot_ids), so a step runs only the busy rows; a packed step of up to
max_batch tokens runs on the decode profile, one longer than the prefill profile in pieces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llgraph.builder import cache_pairs, new_cache
from llgraph.errors import LlgraphError, RequestError
from llgraph.executor import ids_tensor
from llgraph.export.trt_build import (
    ALIGN,
    DECODE,
    PREFILL,
    EngineError,
    cache_row_bytes,
    check_gpu,
    io_dtypes,
    load_tensorrt,
    read_manifest,
    trt_logger,
)
from llgraph.export_folder import ENGINE_META, Manifest
from llgraph.passes import SLOTS_INPUT
from llgraph.plugins.tensorrt.qdp import register_plugins
from llgraph.runtime.backends import BackendSpec, RunOptions
from llgraph.runtime.engine.backend import Backend, Rows, span_of, token_rows
from llgraph.runtime.engine.runner import Runner
from llgraph.tokenizer import Tokenizer


class CudaDevice:
    """The memory and streams TRTBackend binds: torch's CUDA (runtime/backends/trt_twin.py has the CPU twin of it)."""

    def stream(self):
        return torch.cuda.Stream()

    def on(self, stream):
        return torch.cuda.stream(stream)

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device="cuda")

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cuda")

    def upload(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to("cuda", dtype, non_blocking=True)


class TRTBackend(Backend):
    def __init__(self, folder: str | Path, tensorrt: str = "auto"):
        """`tensorrt`: "auto" (the flavour the engine was built with), "tensorrt", "rtx", or "twin" (TensorRT's CPU
        twin: the engine's contract enforced and each step computed by ONNX Runtime; runtime/backends/trt_twin.py)."""
        folder = Path(folder)
        manifest = read_manifest(folder)
        meta_path = folder / ENGINE_META
        if not meta_path.exists():
            raise EngineError(f"{folder} has no engine; build one with `llgraph build {folder}`")
        meta = json.loads(meta_path.read_text())
        self.config = manifest.config
        # what the build test checks the network against, as the torch dtypes bound
        # a ragged engine (llgraph's plugins) takes each token's cache row: a step runs only the busy rows
        self.ragged = bool(meta.get("ragged", False))
        self.io = {name: getattr(torch, d) for name, d in io_dtypes(self.config, manifest.dtype, self.ragged).items()}
        self.vocab_size = self.config.vocab_size
        self.max_seq_len, self.max_batch = meta["max_seq_len"], meta["max_batch"]
        if tensorrt == "twin":
            from llgraph.runtime.backends.trt_twin import load_twin

            trt, self.device = load_twin(folder, meta)
        else:
            trt = load_tensorrt(meta.get("flavor", "tensorrt") if tensorrt == "auto" else tensorrt)
            check_gpu()
            self.device = CudaDevice()
        if meta.get("plugins", "aot") == "jit":
            register_plugins()  # a JIT engine calls back into them; AOT and native engines need no Python
        self._logger = trt_logger(trt)
        self._runtime = trt.module.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine((folder / meta["engine"]).read_bytes())
        if self.engine is None:
            raise EngineError(f"{trt.name} could not load {folder / meta['engine']} (built with "
                              f"{meta.get('flavor', 'tensorrt')} {meta['tensorrt']} for {meta.get('runs_on')}); "
                              f"rebuild it with `llgraph build {folder}`")
        self._check_io(trt, folder)
        row = cache_row_bytes(self.config, manifest.dtype, self.max_seq_len)
        if row % ALIGN:  # a slot's rows are bound at slot * row bytes, and TensorRT takes 256-byte aligned addresses
            raise EngineError(f"{folder}'s engine holds a {self.max_seq_len}-position cache whose rows ({row} bytes) "
                              f"are not {ALIGN}-byte aligned; rebuild it with `llgraph build {folder}` (which rounds "
                              "--max-seq-len up)")
        self.context = self.engine.create_execution_context()
        self.stream = self.device.stream()
        self.cache: dict[str, Any] = {}
        self._profile = None
        self._bound: slice | None = None

    def _check_io(self, trt, folder: Path) -> None:
        """The engine's I/O tensors are exactly the ones this backend binds, in the modes and dtypes it binds them
        (a dtype mismatch would have TensorRT read or write past a buffer)."""
        t = trt.module
        dtypes = {getattr(t.DataType, n): d for n, d in (("FLOAT", torch.float32), ("HALF", torch.float16),
                  ("BF16", torch.bfloat16), ("INT64", torch.int64), ("INT32", torch.int32)) if hasattr(t.DataType, n)}
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        for name in sorted(set(names) ^ set(self.io)):
            where = "the engine has" if name in names else "the engine lacks"
            raise EngineError(f"{where} the I/O tensor {name} (the export's are {len(self.io)}); rebuild the engine "
                              f"from this folder with `llgraph build {folder}`")
        inputs = {n for n in self.io if not n.startswith(("present.", "logits"))}  # ids, slot_ids, past caches
        for name in names:
            mode = self.engine.get_tensor_mode(name)
            dtype = dtypes.get(self.engine.get_tensor_dtype(name))
            if (mode == t.TensorIOMode.INPUT) != (name in inputs) or dtype != self.io[name]:
                raise EngineError(f"the engine's {name} is a {dtype} {str(mode).rsplit('.', 1)[-1].lower()}; "
                                  f"this backend binds a {self.io[name]} {'input' if name in inputs else 'output'}: "
                                  f"rebuild the engine with `llgraph build {folder}`")

    def _call(self, ok: bool, what: str) -> None:
        """TensorRT's binding calls return False (and log why) instead of raising: a failure ends the step here."""
        if not ok:
            raise EngineError(f"TensorRT refused {what} (see its log above)")

    def allocate(self, batch: int, zeroed: bool = False) -> None:  # zeroed anew each time
        if batch > self.max_batch:
            raise RequestError(f"batch of {batch} prompts exceeds the engine's max batch ({self.max_batch}); "
                               "rebuild with `llgraph build --max-batch`")
        with self.device.on(self.stream):  # zero-filled on the stream the engine runs on: no step reads it early
            self.cache = new_cache(self.config, batch, self.max_seq_len,
                                   lambda shape: self.device.zeros(shape, self.io["past_key_values.0.key"]))
        self._bound = None

    def caches(self) -> list:
        return list(self.cache.values())

    def ordered(self):
        return self.device.on(self.stream)  # a copy between rows ordered with the steps that wrote and read them

    def _bind_cache(self, rows: slice) -> None:
        """Rows `rows` of each cache buffer (a contiguous view) as both past and present: the plugin writes it in
        place. Once per request, per profile switch (shapes are per profile) and per change of rows, not per step."""
        for past, present in cache_pairs(self.config):
            t = self.cache[past][rows]
            self._call(self.context.set_input_shape(past, tuple(t.shape)), f"the shape {tuple(t.shape)} of {past}")
            self._call(self.context.set_tensor_address(past, t.data_ptr()), f"the address of {past}")
            self._call(self.context.set_tensor_address(present, t.data_ptr()), f"the address of {present}")
        self._bound = rows

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows = None,
                keep: int = 0) -> np.ndarray:  # the engine computes every position's; the last `keep` leave the GPU
        batch, seq = input_ids.shape
        want = min(keep, seq) if keep > 0 else seq
        whole = slice(0, next(iter(self.cache.values())).shape[0])
        if not self.ragged:  # one contiguous range of rows, bound as the cache
            return self._host(self._run(input_ids, position_ids, None, span_of(rows, batch) or whole)[:, seq - want:])
        slots = token_rows(rows, input_ids.shape)
        slots = np.repeat(np.arange(batch, dtype=np.int64), seq) if slots is None else slots
        check_runs(slots, position_ids.reshape(-1))
        if batch == 1 and 1 < seq <= self.max_batch:  # a packed step of few tokens: the decode profile, one a row
            logits = self._run(input_ids.reshape(seq, 1), position_ids.reshape(seq, 1), slots, whole)
            return self._host(logits[seq - want:, 0][None])
        step = self.max_seq_len if batch == 1 else seq  # a packed step longer than the prefill profile: in pieces
        pieces = []
        for a in range(0, seq, step):
            b = min(seq, a + step)
            logits = self._run(input_ids[:, a:b], position_ids[:, a:b], slots.reshape(batch, seq)[:, a:b].ravel(),
                               whole)
            if b > seq - want:
                pieces.append(self._host(logits[:, max(a, seq - want) - a:]))
        return np.concatenate(pieces, axis=1)

    def _run(self, input_ids: np.ndarray, position_ids: np.ndarray, slots: np.ndarray | None, rows: slice):
        """One execution on cache rows `rows` (bound as the cache; a ragged engine binds them all and reads each
        token's row from `slots`) -> the logits of every position [B, S, V] on the device."""
        batch, seq = input_ids.shape
        with self.device.on(self.stream):
            profile = DECODE if seq == 1 else PREFILL
            if profile != self._profile:
                self._call(self.context.set_optimization_profile_async(profile, self.stream.cuda_stream),
                           f"optimization profile {profile}")
                self._profile, self._bound = profile, None
            if self._bound != rows:
                self._bind_cache(rows)
            # row-major copies: TensorRT reads a bound address as a dense tensor of the shape set
            feeds = {"input_ids": self.device.upload(ids_tensor(input_ids), self.io["input_ids"]),
                     "position_ids": self.device.upload(ids_tensor(position_ids), self.io["position_ids"])}
            if slots is not None:
                feeds[SLOTS_INPUT] = self.device.upload(torch.tensor(slots, dtype=torch.int64), torch.int64)
            logits = self.device.empty((batch, seq, self.vocab_size), self.io["logits"])
            for name, t in feeds.items():
                self._call(self.context.set_input_shape(name, tuple(t.shape)), f"the shape {tuple(t.shape)} of {name}")
                self._call(self.context.set_tensor_address(name, t.data_ptr()), f"the address of {name}")
            self._call(self.context.set_tensor_address("logits", logits.data_ptr()), "the address of logits")
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise EngineError("TensorRT failed to run the engine (see its log above)")
            if self.record:  # an engine exposes its outputs: the logits and the present caches (copies)
                self.recorded = {"logits": logits.float().cpu().numpy()} | {
                    present: self.cache[past][rows].to("cpu", torch.float32, copy=True).numpy()
                    for past, present in cache_pairs(self.config)}
        return logits

    def _host(self, kept: torch.Tensor) -> np.ndarray:
        """Device logits to the host as float32, converted and copied on the stream that wrote them."""
        with self.device.on(self.stream):
            kept = kept.float().cpu()
        self.stream.synchronize()
        return kept.numpy()


def check_runs(slots: np.ndarray, positions: np.ndarray) -> None:
    """A ragged forward's tokens as TensorRT's attention plugin takes them: each cache row's tokens one run of
    consecutive positions, in order along the batch (a prompt chunk, a decode token and its drafts; the engine's
    packed steps and right-padded batches are such). The kernel reads the cache below a row's first new position
    and the call's own tokens above it (plugins/tensorrt/triton_kernels.py), and a long step runs in pieces."""
    order = np.argsort(slots, kind="stable")
    rows, at = slots[order], positions[order]
    broken = (rows[1:] == rows[:-1]) & (at[1:] != at[:-1] + 1)
    if broken.any():
        row = int(rows[1:][broken][0])
        raise LlgraphError(f"cache row {row}'s tokens in one forward are not consecutive positions in order "
                           f"({at[rows == row].tolist()[:8]}...); TensorRT's attention plugin takes each row's tokens "
                           "as one run (split the forward)")


def engine_side(folder: str | Path, tensorrt: str = "auto"):
    """A diff side (runtime/eval/diff.py): a TensorRT engine built from a `trt` export folder (needs tensorrt and a
    GPU, or `tensorrt="twin"`). It exposes the final outputs: logits and the present caches."""
    return TRTBackend(folder, tensorrt).recorder()


class TRTRunner(Runner):
    """A TensorRT engine built by `llgraph build` from a `trt` export folder (TensorRT or TensorRT-RTX, as it was
    built with, and a GPU)."""

    def __init__(self, folder: str | Path, tensorrt: str = "auto"):
        backend = TRTBackend(folder, tensorrt)
        super().__init__(backend, Tokenizer.find(Path(folder)), backend.config.eos_token_ids, folder)


def _open(path: Path, options: RunOptions) -> TRTRunner:
    if Manifest.find(path) is None:
        raise LlgraphError(f"--backend trt runs a built engine: `llgraph export --checkpoint {options.model} "
                           "--target trt --dtype fp16 -o OUT`, then `llgraph build OUT`, then pass OUT")
    return TRTRunner(path, options.tensorrt)


BACKEND = BackendSpec("trt", _open, {"trt": lambda r: engine_side(r.engine, r.tensorrt)}, bf16=True,
                      accuracy_level=False)
