"""The PyTorch executor as a backend of the shared loop: the numeric reference, run on a checkpoint.

    TorchRunner("smollm2").generate([[1, 2, 3]], max_new_tokens=8)

`TorchBackend` writes its static cache in place (index_copy by position); `torch_side` is the same backend recording
every IR value of a step, for `llgraph diff`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from llgraph.builder import new_cache
from llgraph.checkpoint import open_model
from llgraph.config import LlamaConfig
from llgraph.errors import LlgraphError
from llgraph.executor import TORCH_DTYPES, TorchExecutor, ids_tensor
from llgraph.export_folder import Manifest
from llgraph.ir import Graph
from llgraph.kv_cache import FORMATS, kv_format, of_dtype
from llgraph.passes import (
    HIDDEN,
    KEEP_INPUT,
    SLOTS_INPUT,
    expose_hidden,
    keep_last_positions,
    model_graph,
    ragged_slots,
)
from llgraph.runtime.backends import BackendSpec, RunOptions
from llgraph.runtime.engine.backend import Backend, Rows, cache_length, in_pieces, span_of, token_rows
from llgraph.runtime.engine.runner import Runner
from llgraph.tokenizer import Tokenizer
from llgraph.weight_request import Weights
from llgraph.weights import WeightSource


class TorchBackend(Backend):
    def __init__(self, config: LlamaConfig, source: WeightSource, max_seq_len: int | None = None,
                 dtype: str = "float32", device: str = "cpu", progress: bool = False, graph: Graph | None = None,
                 limit: int | None = None, kv_cache: str | None = None):
        """`limit`: the longest cache allowed (default the model's context; the executor computes RoPE at any
        position, and a diff side matches an export's range); `kv_cache`: the cache's format (llgraph/kv_cache.py;
        default `dtype`'s floats), which `graph`'s cache inputs must declare."""
        self.config, self.dtype, self.device = config, dtype, device
        self.kv = kv_format(kv_cache) if kv_cache else of_dtype(dtype)
        self.context_limit = limit or config.max_position_embeddings
        self.max_seq_len = cache_length(max_seq_len, self.context_limit, "the model's context")
        self.vocab_size = config.vocab_size
        self.takes_ring = True  # the executor's attention takes a windowed layer's ring (llgraph/executor.py)
        self.executor = TorchExecutor(graph or model_graph(config, dtype, kv=kv_cache), source, device, progress)
        self._batch: int | None = None
        self._cache: dict[str, Any] = {}
        self._keeps = any(v.name == KEEP_INPUT for v in self.executor.graph.inputs)
        self.ragged = any(v.name == SLOTS_INPUT for v in self.executor.graph.inputs)  # passes.ragged_slots
        self.hidden_in_forward = any(v.name == HIDDEN for v in self.executor.graph.outputs)

    def allocate(self, batch: int, zeroed: bool = False) -> None:
        """The cache for `batch` rows; kept as it is for the same batch (stale slots are masked) unless `zeroed`."""
        if batch == self._batch and not zeroed:
            return
        self.plan_ring()
        self._cache = new_cache(self.config, batch, self.max_seq_len,
                                lambda shape: torch.zeros(shape, dtype=TORCH_DTYPES[self.kv.dtype], device=self.device),
                                self.kv.row(self.config.head_dim), self.ring)
        self._batch = batch

    def caches(self) -> list:
        return list(self._cache.values())

    def _feeds(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows, keep: int = 0) -> dict:
        feeds = {"input_ids": ids_tensor(input_ids, self.device), "position_ids": ids_tensor(position_ids, self.device)}
        if self.ragged:  # the whole cache; each token names its row
            slots = token_rows(rows, input_ids.shape)
            feeds[SLOTS_INPUT] = ids_tensor(np.zeros(0, np.int64) if slots is None else slots, self.device)
            feeds.update(self._cache)
        else:
            span = span_of(rows, input_ids.shape[0])
            feeds.update(self._cache if span is None else {k: v[span] for k, v in self._cache.items()})  # views
        if self._keeps:  # a graph with passes.keep_last_positions applied
            feeds[KEEP_INPUT] = torch.tensor(keep, dtype=torch.int64)
        return feeds

    def _run(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows, keep: int, hidden: bool):
        """One forward (in a ring's pieces) -> (logits of the positions `keep` asks for, hidden states or None)."""
        self.track(rows, position_ids, self._batch or 0)

        def once(ids, pos, part, kept):
            out = self.executor.run(self._feeds(ids, pos, part, kept), record=self.record)
            if self.record:  # the present caches are live storage: copied
                self.recorded = {k: v.float().cpu().numpy().copy() for k, v in out.items()}
            logits = out["logits"]
            if 0 < kept < logits.shape[1]:  # a graph without logits_to_keep: only the rows asked for leave the device
                logits = logits[:, -kept:]
            return logits.float().cpu().numpy(), out[HIDDEN].float().cpu().numpy() if hidden else None
        return in_pieces(once, input_ids, position_ids, rows, keep, self.pieces(input_ids.shape[1]))

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows = None,
                keep: int = 0) -> np.ndarray:
        return self._run(input_ids, position_ids, rows, keep, False)[0]

    def forward_hidden(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows = None,
                       keep: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
        if not self.hidden_in_forward:
            return None
        return self._run(input_ids, position_ids, rows, keep, True)

    def hidden(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows = None) -> np.ndarray:
        if not self.hidden_in_forward:
            return super().hidden(input_ids, position_ids, rows)
        return self._run(input_ids, position_ids, rows, 1, True)[1]


class TorchRunner(Runner):
    """The PyTorch executor on a checkpoint (HF folder, .safetensors, .gguf, or 'smollm2')."""

    def __init__(self, checkpoint, config=None, max_seq_len: int | None = None, dtype: str = "float32",
                 device: str = "cpu", progress: bool = False, weights: Weights | None = None,
                 kv_cache: str | None = None):
        """`weights`: the RTN rounding an int4/int8 export carries, computed dequantized (its dtype: `dtype`)."""
        weights = (weights or Weights()).replace(dtype=dtype, accuracy_level=None, kernels="standard")
        if not weights.rounds:  # the executor reads a GGUF's blocks dequantized, whatever their type
            weights = weights.replace(dequantize=True)
        model = open_model(config, checkpoint, weights)
        # the head on the positions a step samples from (a prompt's logits are not computed, nor copied off a GPU)
        graph = ragged_slots(keep_last_positions(expose_hidden(model_graph(model.config, weights.dtype, kv=kv_cache))))
        backend = TorchBackend(model.config, model.source, max_seq_len, weights.dtype, device, progress, graph,
                               kv_cache=kv_cache)
        super().__init__(backend, Tokenizer.find(model.checkpoint), model.config.eos_token_ids, model.checkpoint)


def torch_side(cfg: LlamaConfig, source: WeightSource, dtype: str = "float32", max_seq: int = 256,
               graph: Graph | None = None):
    """A diff side (runtime/eval/diff.py): a TorchBackend recording every value, each stepper from a zeroed cache."""
    return TorchBackend(cfg, source, max_seq, dtype, graph=graph, limit=max_seq).recorder()


def _open(path: Path, options: RunOptions) -> TorchRunner:
    if Manifest.find(path) is not None:
        raise LlgraphError(f"{options.model} is an ONNX export folder; it runs with --backend ort (or trt once "
                           "built)")
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    return TorchRunner(path, max_seq_len=options.max_seq_len, dtype=options.weights.dtype, progress=True,
                       weights=options.weights, kv_cache=options.kv_cache)


# accuracy_level and kernels: accepted and ignored (the executor is exact anyway)
BACKEND = BackendSpec("torch", _open, {"torch": lambda r: torch_side(r.config, r.source, r.dtype, r.max_seq)},
                      bf16=True, accuracy_level=True, kernels=True, kv_formats=tuple(FORMATS))
