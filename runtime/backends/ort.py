"""ONNX Runtime as a backend of the shared loop (the CPU default): an `llgraph export` folder, or a checkpoint
exported once into the export cache.

    ORTRunner("smollm2-ort").generate("Hello", max_new_tokens=32)

`OrtBackend` binds each cache buffer once as both past and present through IO binding: nothing is copied or
allocated for the cache per step (GroupQueryAttention's shared-buffer mode writes in place). `onnx_side` runs an
export with every IR value exposed, for `llgraph diff`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from llgraph.builder import cache_pairs, new_cache
from llgraph.config import LlamaConfig
from llgraph.errors import LlgraphError
from llgraph.export_folder import CHECKED, MODEL_FILE, Checked, Manifest, check_damage, damage
from llgraph.ir import Graph, value_order
from llgraph.kv_cache import CPU_DEFAULT, FORMATS, KvFormat, kv_format, of_dtype, retype
from llgraph.passes import HIDDEN, KEEP_INPUT, SLOTS_INPUT, model_graph
from llgraph.plugins import cpu
from llgraph.runtime.backends import BackendSpec, RunOptions
from llgraph.runtime.engine.backend import Backend, Rows, cache_length, in_pieces, span_of, token_rows
from llgraph.runtime.engine.runner import Runner
from llgraph.tokenizer import Tokenizer
from llgraph.weights import WeightSource

TAPPED = "model.tapped.onnx"  # a diff side's copy of the graph with every IR value as an output


_SHARED_POOL: list[int] = []  # the global thread pool's size, once share_threads() made it


def share_threads(threads: int | None = None) -> None:
    """Every ONNX Runtime session opened after this call, in this process, runs on one global pool of `threads`
    (default: every core) instead of a pool of its own. For a model and its draft model: two pools' spinning
    workers fight over the cores between each other's runs (measured on 2 cores: a float32 SmolLM2 with its 4-bit
    self drafting decoded at 1.2x plain with a pool each, 2.1x with one shared). Takes effect once, before the
    first session of the process."""
    import onnxruntime as ort

    if not _SHARED_POOL:
        ort.capi._pybind_state.set_global_thread_pool_sizes(threads or os.cpu_count() or 1, 1)
        _SHARED_POOL.append(threads or os.cpu_count() or 1)


class OrtBackend(Backend):
    multi_token_rows = False  # GroupQueryAttention: "batch_size must be 1 when sequence_length > 1 and past ..."
    scratch: object = None  # a diff side's temporary export folder, removed with its backend

    def __init__(self, folder: str | Path, max_seq_len: int | None = None, threads: int | None = None,
                 model_file: str | None = None, kv_cache: str | None = None):
        """`model_file`: another graph of the same export to run (a diff side's tapped model); `kv_cache`: the cache's
        format (llgraph/kv_cache.py; default: kv_cache.CPU_DEFAULT where the export runs llgraph's kernels in
        float32, else the export's own floats)."""
        import onnxruntime as ort

        self.folder = folder = Path(folder)
        manifest = Manifest.read(folder)
        check_damage(folder, damage(folder, manifest))
        checked = Checked(folder, manifest, _memo(folder))  # every byte hashed beside the load (export_folder.Checked)
        self.config, self.dtype = manifest.config, manifest.dtype
        if self.dtype == "bfloat16":
            raise LlgraphError(f"{folder} is a bf16 export and ONNX Runtime's CPU kernels have no bf16 MatMul; "
                               "re-export with --dtype fp32 (or fp16) for CPU, or build it with `llgraph build`")
        self.max_seq_len = cache_length(max_seq_len, manifest.max_positions, "this export's RoPE range")
        self.context_limit = manifest.max_positions
        self.vocab_size = self.config.vocab_size
        self._np_dtype = {"float32": np.float32, "float16": np.float16}[self.dtype]
        opts = ort.SessionOptions()
        if _SHARED_POOL:  # share_threads(): the process's one pool
            opts.use_per_session_threads = False
        else:
            opts.intra_op_num_threads = threads or os.cpu_count() or 1
        opts.log_severity_level = 3
        if manifest.options.get("kernels") == "llgraph":
            _register_kernels(opts, folder)
        own = manifest.options.get("kernels") == "llgraph" and self.dtype == "float32"
        self.kv = kv_format(kv_cache) if kv_cache else kv_format(CPU_DEFAULT) if own else of_dtype(self.dtype)
        try:
            model = _model_with_cache(folder / (model_file or manifest.model), self.kv, manifest, opts)
            self.session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        except Exception:
            check_damage(folder, checked.result())  # a damaged graph fails to load: say so, not ORT's words
            raise
        self._checked: Checked | None = checked  # waited for by ready(): after the first forward, before its answer
        self._ort = ort
        self._batch: int | None = None
        self._binding: Any = None  # an onnxruntime IOBinding once allocated
        self._rows: slice | None = None
        overridable = {i.name for i in self.session.get_overridable_initializers()}
        self._keeps = KEEP_INPUT in overridable
        # llgraph's attention reading each token's cache row (export/ort.py ragged): any rows, several in a batch
        # row, and several rows of several tokens after a cached prefix
        self.ragged = self.multi_token_rows = self._slotted = SLOTS_INPUT in overridable
        self._no_slots = np.zeros(0, np.int64)
        outputs = {o.name for o in self.session.get_outputs()}
        self._hidden = np.empty((0, self.config.hidden_size), self._np_dtype) if HIDDEN in outputs else None
        self.hidden_in_forward = self._hidden is not None
        self.takes_ring = manifest.window_ring

    def ready(self) -> None:
        if self._checked is not None:  # the weights are what export wrote, or one line
            checked, self._checked = self._checked, None
            check_damage(self.folder, checked.result())

    def allocate(self, batch: int, zeroed: bool = False) -> None:
        if batch == self._batch and not zeroed:
            return  # stale slots from an earlier request are finite and masked out
        self._binding = self.session.io_binding()
        # zeroed once: ONNX Attention weighs masked slots by 0, and 0 * (uninitialized NaN) is NaN
        dtype = np.dtype(self.kv.dtype)  # the export's floats (float32, float16) or another format's
        self.plan_ring()
        self._arrays = new_cache(self.config, batch, self.max_seq_len, lambda shape: np.zeros(shape, dtype),
                                 self.kv.row(self.config.head_dim), self.ring)
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

    def _run(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows, keep: int, hidden: bool):
        """One forward (in a ring's pieces) -> (logits of the positions `keep` asks for, a copy of every position's
        hidden states or None)."""
        self.track(rows, position_ids, self._batch or 0)

        def once(ids, pos, part, kept):
            logits = self._once(ids, pos, part, kept)
            return logits, self._hidden_out(*ids.shape).astype(np.float32) if hidden else None  # (the buffer is
            # the next execution's)
        return in_pieces(once, input_ids, position_ids, rows, keep, self.pieces(input_ids.shape[1]))

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows = None,
                keep: int = 0) -> np.ndarray:
        return self._run(input_ids, position_ids, rows, keep, False)[0]

    def _once(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows, keep: int) -> np.ndarray:
        slots = None
        if self.ragged:  # the whole cache bound once; each token names its row
            self._bind_cache(slice(0, self._batch))
            slots = token_rows(rows, input_ids.shape)
        else:  # (a ragged graph run as contiguous rows, by runtime/bench/holes.py: no slots, row b)
            span = span_of(rows, input_ids.shape[0])
            self._bind_cache(slice(0, self._batch) if span is None else span)
        if self._slotted:
            self._binding.bind_ortvalue_input(SLOTS_INPUT, self._ort.OrtValue.ortvalue_from_numpy(
                self._no_slots if slots is None else slots))
        self._binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, np.int64))
        self._binding.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, np.int64))
        batch, seq = input_ids.shape
        if self._keeps:  # the graph computes the head for the last `keep` positions only (passes.py)
            # an overridable initializer: bind_cpu_input looks among the required inputs only
            keep_value = self._ort.OrtValue.ortvalue_from_numpy(np.array(keep, np.int64))
            self._binding.bind_ortvalue_input(KEEP_INPUT, keep_value)
        kept = min(keep, seq) if self._keeps and keep > 0 else seq
        # a fresh array per step, bound as the logits: no copy, nothing aliased between steps, and no call to
        # get_outputs, which wraps every cache output too (61 OrtValues a step for SmolLM2: ~0.25 ms)
        logits = np.empty((batch, kept, self.vocab_size), self._np_dtype)
        self._binding.bind_ortvalue_output("logits", self._ort.OrtValue.ortvalue_from_numpy(logits))
        if self._hidden is not None:  # an output left unbound would be allocated by ONNX Runtime each step
            self._binding.bind_ortvalue_output(HIDDEN, self._ort.OrtValue.ortvalue_from_numpy(self._hidden_out(
                batch, seq)))
        tapped = self._tapped if self.record else []
        for name in tapped:  # bound after every other output, so they are the binding's last outputs
            self._binding.bind_output(name)
        self.session.run_with_iobinding(self._binding)
        self.ready()  # the first forward ran beside the check of its weights; its answer waits for the verdict
        if self.record:
            rows = self._rows if self._rows is not None else slice(None)
            outs = self._binding.get_outputs()
            outs = outs[len(outs) - len(tapped):]
            self.recorded = {"logits": logits.astype(np.float32),
                             **{present: self._arrays[past][rows].astype(np.float32)
                                for past, present in cache_pairs(self.config)},
                             **{name: v.numpy().astype(np.float32) for name, v in zip(tapped, outs)}}
        return logits

    def _hidden_out(self, batch: int, seq: int) -> np.ndarray:
        assert self._hidden is not None  # the export has the output (hidden_in_forward)
        if self._hidden.shape[0] < batch * seq:
            self._hidden = np.empty((batch * seq, self.config.hidden_size), self._np_dtype)
        return self._hidden[:batch * seq].reshape(batch, seq, -1)

    def forward_hidden(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows = None,
                       keep: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
        if self._hidden is None:
            return None
        return self._run(input_ids, position_ids, rows, keep, True)

    def hidden(self, input_ids: np.ndarray, position_ids: np.ndarray, rows: Rows = None) -> np.ndarray:
        if self._hidden is None:
            return super().hidden(input_ids, position_ids, rows)
        return self._run(input_ids, position_ids, rows, 1, True)[1]

    def caches(self) -> list:
        return list(self._arrays.values()) if self._batch is not None else []

    @property
    def _tapped(self) -> list[str]:
        """The graph's outputs beyond the logits, the present caches and the hidden states: a diff side's tapped
        model's IR values, recorded by a forward when `record` is set."""
        served = {"logits", HIDDEN, *(present for _, present in cache_pairs(self.config))}
        return [o.name for o in self.session.get_outputs() if o.name not in served]


def _model_with_cache(path: Path, kv: KvFormat, manifest: Manifest, opts) -> str | bytes:
    """The graph to open: the file as exported (its cache float), or its bytes with the cache inputs and outputs
    retyped to format `kv` (llgraph/kv_cache.py; the weights are read from the folder as they are)."""
    if kv.dtype == manifest.dtype:
        return str(path)
    if manifest.options.get("kernels") != "llgraph" or manifest.dtype != "float32":
        raise LlgraphError(f"--kv-cache {kv.name} runs on llgraph's CPU kernels over a float32 export; "
                           f"{path.parent} is a {manifest.dtype} export on "
                           f"{manifest.options.get('kernels') or 'standard'} kernels: use --kv-cache "
                           f"{kv_format(manifest.dtype).name}, or re-export with --kernels llgraph --dtype fp32")
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    retype(model, kv, cache_pairs(manifest.config), manifest.config.head_dim)
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return model.SerializeToString()


def _memo(folder: Path) -> Path:
    """Where Checked keeps what it hashed of `folder`: the user cache, never the export folder itself."""
    import hashlib

    from llgraph.outdir import user_cache

    return user_cache() / CHECKED / f"{hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]}.json"


def _register_kernels(opts, folder: Path) -> None:
    """llgraph's CPU kernels, from the copy export put in the folder; one line when they cannot load."""
    library = folder / cpu.LIBRARY
    if not library.exists():
        raise LlgraphError(f"{folder} runs on llgraph's CPU kernels but holds no {cpu.LIBRARY}; re-export it "
                           "(`llgraph export ... --kernels llgraph`, or --kernels standard for ONNX Runtime's ops)")
    try:
        opts.register_custom_ops_library(str(library))
    except Exception as e:  # onnxruntime raises its own error types for a library it cannot load
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first.split(" : ")[-1] if first.startswith("[ONNXRuntimeError]") else first
        if first.startswith("llgraph's CPU kernels"):  # the library's own word on why (an older runtime)
            raise LlgraphError(f"{library}: {first}") from None
        raise LlgraphError(f"cannot load {library}: {first}; re-export with --kernels standard to run on ONNX "
                           "Runtime's own ops") from None


class ORTRunner(Runner):
    """ONNX Runtime on an `llgraph export` folder (any target)."""

    def __init__(self, folder: str | Path, max_seq_len: int | None = None, threads: int | None = None,
                 kv_cache: str | None = None):
        backend = OrtBackend(folder, max_seq_len, threads, kv_cache=kv_cache)
        target = Manifest.read(Path(folder)).target
        if target != "ort" and target not in _SAID:  # it runs, but a user comparing speeds should know
            _SAID.add(target)
            print(f"llgraph: {folder} is a --target {target} export; ONNX Runtime runs a --target ort export of the "
                  "same checkpoint several times faster, in less memory", file=sys.stderr)
        try:
            tokenizer = Tokenizer.find(Path(folder))
        except Exception:  # a damaged tokenizer.json: the integrity record says so in one line, not the parser
            backend.ready()
            raise
        super().__init__(backend, tokenizer, backend.config.eos_token_ids, folder)


_SAID: set[str] = set()  # the targets ORTRunner has said this of, once a process


def onnx_side(cfg: LlamaConfig, source: WeightSource, target: str = "ort", dtype: str = "float32",
              max_seq: int = 256, folder: str | Path | None = None, graph: Graph | None = None):
    """A diff side (runtime/eval/diff.py): exports (into `folder`, or a temporary one removed when the side is dropped)
    and runs an OrtBackend on the export with every IR-named node output exposed as a graph output."""
    import onnx

    from llgraph.export import get_target
    from llgraph.export.lower import ONNX_DTYPES, export

    graph = graph or model_graph(cfg, dtype)
    scratch = None
    if not folder:
        scratch = tempfile.TemporaryDirectory(prefix="llgraph-diff-")  # removed with the side
        folder = scratch.name
    folder = Path(folder) / target
    export(graph, source, get_target(target), folder, max_positions=max_seq, force=True)
    model = onnx.load(str(folder / MODEL_FILE), load_external_data=False)
    present = {o.name for o in model.graph.output}
    produced = {o for n in model.graph.node for o in n.output}
    for name in value_order(graph):
        if name in produced and name not in present:
            v = graph.values[name]
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, ONNX_DTYPES[v.dtype], None))
    onnx.save(model, str(folder / TAPPED))
    backend = OrtBackend(folder, max_seq, model_file=TAPPED, kv_cache=dtype)  # the float cache torch's side keeps
    backend.scratch = scratch  # the export lives as long as its backend
    return backend.recorder()


def _open(path: Path, options: RunOptions) -> ORTRunner:
    """An export folder as it is; a checkpoint exported once into the cache (runtime/backends/export_cache.py), then
    run."""
    if Manifest.find(path) is not None:
        return ORTRunner(path, options.max_seq_len, options.threads, options.kv_cache)
    from llgraph.checkpoint import load_config
    from llgraph.export import export_model, resolve_kernels
    from llgraph.runtime.backends.export_cache import cache_dir, entry_for, heal, superseded

    load_config(path)  # a folder or file that is no checkpoint fails here, before "exporting ..." is said
    for adapter in options.weights.lora:  # and an adapter that cannot be merged
        adapter.validate()
    weights = resolve_kernels(options.weights, "ort", path)  # its kernels are part of the cache key
    folder = entry_for(path, cache_dir(options.cache_dir), "ort", weights.mode)
    why = heal(folder)
    if why is not None:
        print(f"exporting {path.name} for ONNX Runtime into {folder} ({why}; `llgraph cache list` shows it)",
              file=sys.stderr)
        export_model(path, checkpoint=path, out=folder, target="ort", weights=weights, force=True, progress=True)
        older = superseded(folder)
        if older:  # an older llgraph's or older kernels' export of the same file: the user's to remove
            size = sum(f.stat().st_size for p in older for f in p.rglob("*") if f.is_file())
            print(f"llgraph: {len(older)} older export(s) of {path.name} ({size / 1e9:.2f} GB) remain in the cache; "
                  f"`llgraph cache clean {' '.join(p.name for p in older)}` removes them", file=sys.stderr)
    return ORTRunner(folder, options.max_seq_len, options.threads, options.kv_cache)


def _side(target: str):
    return lambda r: onnx_side(r.config, r.source, target, r.dtype, r.max_seq)


BACKEND = BackendSpec("ort", _open, {"ort": _side("ort"), "onnx": _side("onnx")}, bf16=False, accuracy_level=True,
                      kernels=True, share_threads=share_threads, kv_formats=tuple(FORMATS))
