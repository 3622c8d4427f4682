"""Backends for the shared loop: each allocates its static KV cache once per request and runs one step on it.

- `OrtBackend`: ONNX Runtime with IO binding; the cache OrtValues are bound as both past and present, so nothing is
  copied or allocated for the cache per step (GroupQueryAttention's shared-buffer mode writes in place).
- `TorchBackend`: the PyTorch executor; it writes the same tensors in place.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from llgraph.builder import DEFAULT_MAX_SEQ, cache_pairs, new_cache
from llgraph.config import LlamaConfig
from llgraph.errors import LlgraphError
from llgraph.export_folder import Manifest
from llgraph.passes import model_graph
from llgraph.runtime.loop import Backend
from llgraph.weights import TORCH_DTYPES, WeightSource


def cache_length(requested: int | None, limit: int, what: str) -> int:
    """The KV-cache length for a runner: `requested` (default min(2048, limit)), refused when out of 2..limit."""
    if requested is None:
        return min(DEFAULT_MAX_SEQ, limit)
    if not isinstance(requested, int) or requested < 2:
        raise LlgraphError(f"--max-seq-len ({requested}) must be at least 2 tokens")
    if requested > limit:
        raise LlgraphError(f"--max-seq-len ({requested}) exceeds {what} ({limit} positions); lower it, or "
                           f"re-export with `llgraph export --max-seq-len {requested}`")
    return requested


class OrtBackend(Backend):
    def __init__(self, folder: str | Path, max_seq_len: int | None = None, threads: int | None = None):
        import onnxruntime as ort

        folder = Path(folder)
        manifest = Manifest.read(folder)
        self.config, self.dtype = manifest.config, manifest.dtype
        if self.dtype == "bfloat16":
            raise LlgraphError(f"{folder} is a bf16 export and ONNX Runtime's CPU kernels have no bf16 MatMul; "
                               "re-export with --dtype fp32 (or fp16) for CPU, or build it with `llgraph build`")
        self.max_seq_len = cache_length(max_seq_len, manifest.max_positions, "this export's RoPE range")
        self.vocab_size = self.config.vocab_size
        self._np_dtype = {"float32": np.float32, "float16": np.float16}[self.dtype]
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or os.cpu_count() or 1
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(folder / manifest.model), opts,
                                            providers=["CPUExecutionProvider"])
        self._ort, self._batch, self._binding = ort, None, None

    def allocate(self, batch: int) -> None:
        if batch == self._batch:
            return  # stale slots from an earlier request are finite and masked out
        self._binding = self.session.io_binding()
        # zeroed once: ONNX Attention weighs masked slots by 0, and 0 * (uninitialized NaN) is NaN
        self._arrays = new_cache(self.config, batch, self.max_seq_len, lambda shape: np.zeros(shape, self._np_dtype))
        self._batch, self._rows = batch, None
        self._bind_cache(slice(0, batch))

    def _bind_cache(self, rows: slice) -> None:
        """Rows `rows` of each cache array as both past and present (a view: ORT writes the array in place)."""
        if rows == self._rows:
            return
        for past, present in cache_pairs(self.config):
            value = self._ort.OrtValue.ortvalue_from_numpy(self._arrays[past][rows])  # borrows the memory
            self._binding.bind_ortvalue_input(past, value)
            self._binding.bind_ortvalue_output(present, value)
        self._rows = rows

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        self._bind_cache(slice(0, self._batch) if rows is None else rows)
        self._binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids.numpy()))
        self._binding.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids.numpy()))
        # a fresh array per step, bound as the logits: no copy, nothing aliased between steps, and no call to
        # get_outputs, which wraps every cache output too (61 OrtValues a step for SmolLM2: ~0.25 ms)
        logits = np.empty((*input_ids.shape, self.vocab_size), self._np_dtype)
        self._binding.bind_ortvalue_output("logits", self._ort.OrtValue.ortvalue_from_numpy(logits))
        self.session.run_with_iobinding(self._binding)
        return torch.from_numpy(logits)


class TorchBackend(Backend):
    def __init__(self, config: LlamaConfig, source: WeightSource, max_seq_len: int | None = None,
                 dtype: str = "float32", device: str = "cpu", progress: bool = False):
        from llgraph.executor import TorchExecutor

        self.config, self.dtype, self.device = config, dtype, device
        self.max_seq_len = cache_length(max_seq_len, config.max_position_embeddings, "the model's context")
        self.vocab_size = config.vocab_size
        self.executor = TorchExecutor(model_graph(config, dtype), source, device, progress)
        self._batch, self._cache = None, {}

    def allocate(self, batch: int) -> None:
        if batch == self._batch:
            return
        self._cache = new_cache(self.config, batch, self.max_seq_len,
                                lambda shape: torch.zeros(shape, dtype=TORCH_DTYPES[self.dtype], device=self.device))
        self._batch = batch

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        cache = self._cache if rows is None else {k: v[rows] for k, v in self._cache.items()}  # views, written in place
        feeds = {"input_ids": input_ids.to(self.device), "position_ids": position_ids.to(self.device), **cache}
        return self.executor.run(feeds)["logits"].float().cpu()
