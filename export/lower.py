"""IR -> ONNX: the one lowering mechanism every target shares.

A target is a `Target`: a table op -> lowering function, an optional `plan` that picks fusions before emission
(nodes a fusion absorbs are skipped), and the opsets it imports. Lowerings call `Emitter` methods; weights are
streamed into the external-data file the moment a lowering asks for them, tensor by tensor, so the model is never
in memory. ONNX value names are the IR's (`layers.3.attn_norm`), so any IR value can be traced in the ONNX graph.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper

from llgraph import __version__
from llgraph.config import LlamaConfig
from llgraph.errors import LlgraphError
from llgraph.export_folder import DATA_FILE, MANIFEST, MODEL_FILE, Manifest, integrity_record
from llgraph.ir import DTYPE_BYTES, Graph, Node
from llgraph.outdir import PARTIAL_MARK, staged_folder
from llgraph.passes import run_passes
from llgraph.weights import DTYPES, WeightSource, check_weights, load_param

ONNX_DTYPES = {"float64": TensorProto.DOUBLE, "float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
               "bfloat16": TensorProto.BFLOAT16, "int64": TensorProto.INT64, "int32": TensorProto.INT32,
               "uint8": TensorProto.UINT8, "int8": TensorProto.INT8, "bool": TensorProto.BOOL}
ALIGN = 4096  # page-aligned offsets let ONNX Runtime memory-map large initializers
CHUNK_BYTES = 64 << 20  # tensors are made contiguous and written this much at a time
SPARE_BYTES = 256 << 20  # what an export leaves free beyond its weights (the graph, the manifest, the file system)

Lowering = Callable[["Emitter", Node], None]


@dataclass
class Target:
    name: str
    lowerings: dict[str, Lowering]
    opsets: dict[str, int]
    plan: Callable[[Emitter], None] = lambda emitter: None
    bf16: bool = True  # its runtimes run bfloat16 weights
    accuracy_level: bool = False  # it takes ONNX Runtime's MatMulNBits accuracy level
    kernels: bool = False  # its QLinear can run on llgraph's CPU kernels (plugins/cpu/__init__.py)
    passes: tuple = ()  # graph passes of this target only, applied before lowering (llgraph/passes.py)
    # a pass that depends on the export's options (the ort target's ragged rows, on llgraph's kernels only)
    options_pass: Callable[[Graph, dict], Graph] = lambda graph, options: graph
    # the target's own files beside the model (the ort target's genai_config.json): (folder, manifest) -> None
    extras: Callable[[Path, Manifest], None] = lambda folder, manifest: None


@dataclass
class Emitter:
    graph: Graph
    source: WeightSource
    data: BinaryIO  # the open external-data file
    on_weight: Callable[[int], None] = lambda nbytes: None
    max_positions: int = 0  # for targets that tabulate RoPE (ORT's GroupQueryAttention)
    nodes: list = field(default_factory=list)
    initializers: list = field(default_factory=list)
    absorbed: set = field(default_factory=set)  # names of IR nodes a planned fusion emits instead
    fused: dict = field(default_factory=dict)  # IR node name -> lowering that replaces the table's
    shared: dict = field(default_factory=dict)  # values a target computes once per graph (e.g. seqlens)
    functions: dict = field(default_factory=dict)  # model-local ONNX functions by name (the `trt` target's)
    options: dict = field(default_factory=dict)  # target options from the export request (accuracy_level, ...)
    _weights: dict = field(default_factory=dict)
    _count: int = 0

    # -- names and nodes ----------------------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}/{self._count}"

    def node(self, op: str, inputs, outputs=1, domain: str = "", hint: str = "", **attrs) -> list[str]:
        """Append an ONNX node; `outputs` is a list of names or a count of fresh names. Returns the output names."""
        if isinstance(outputs, int):
            outputs = [self.fresh(f"{hint or op}/{op}") for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), list(outputs), name=self.fresh(hint or op),
                                           domain=domain, **attrs))
        return list(outputs)

    def const(self, value, dtype=None, hint: str = "const") -> str:
        """A small constant as an inline initializer."""
        array = np.asarray(value, dtype=dtype)
        name = self.fresh(hint)
        self.initializers.append(onnx.numpy_helper.from_array(array, name))
        return name

    def dtype_of(self, ir_value: str) -> int:
        return ONNX_DTYPES[self.graph.values[ir_value].dtype]

    # -- weights --------------------------------------------------------------------------------------------------
    def weight(self, param: str, transpose: bool = False, compute=None) -> str:
        """Initializer for an IR param, written to the data file once per (param, layout). `compute(tensor)`
        derives a tensor from it (e.g. a RoPE table), named after `compute.__name__`."""
        key = (param, transpose, getattr(compute, "__name__", None))
        if key in self._weights:
            return self._weights[key]
        name = param + (".T" if transpose else "") + (f".{compute.__name__}" if compute else "")
        rows = self._row_reader(self.graph.params[param]) if compute is None else None
        if rows is not None:
            self.initializers.append(self._write_rows(name, rows[0], rows[1], rows[2], transpose))
        else:
            tensor = load_param(self.graph.params[param], self.source)
            if compute is not None:
                tensor = compute(tensor)
            if transpose:
                tensor = tensor.T  # a view: _write makes it contiguous a chunk at a time
            self.initializers.append(self._write(name, tensor))
        self._weights[key] = name
        return name

    def _row_reader(self, param):
        """(shape, dtype, read(a, b) -> rows a..b) for a float checkpoint matrix larger than CHUNK_BYTES whose source
        reads rows alone (an 8B model's embedding and lm head: 2.1 GB each in fp32), else None."""
        if param.is_constant or param.component is not None or len(param.parts) != 1 or len(param.value.shape) != 2:
            return None
        dtype, (part,) = DTYPES[param.value.dtype], param.parts
        if math.prod(param.value.shape) * dtype.itemsize <= CHUNK_BYTES or \
                self.source.load_rows(part.name, 0, 1, dtype) is None:
            return None
        def rows(a: int, b: int) -> np.ndarray:
            out = self.source.load_rows(part.name, a, b, dtype)
            assert out is not None  # the source read rows of this tensor above
            return out.astype(dtype, copy=False)
        return tuple(param.value.shape), dtype, rows

    def derived(self, name: str, fn, *params: str, onnx_type: int | None = None, dims=None) -> str:
        """Initializer `name` = fn(*the params' tensors), written once. `onnx_type`/`dims` store the bytes under
        another element type (e.g. INT4 codes, two per byte, as [out, in])."""
        if name not in self._weights:
            tensor = fn(*(load_param(self.graph.params[p], self.source) for p in params))
            proto = self._write(name, tensor)
            if onnx_type is not None:
                proto.data_type, proto.dims[:] = onnx_type, list(dims)
            self.initializers.append(proto)
            self._weights[name] = name
        return self._weights[name]

    def _write(self, name: str, tensor: np.ndarray) -> TensorProto:
        offset = self._align()
        rows = max(1, CHUNK_BYTES // max(1, tensor[0].nbytes)) if tensor.ndim else 1
        for i in range(0, max(1, tensor.shape[0] if tensor.ndim else 1), rows):
            self._put(np.ascontiguousarray(tensor[i:i + rows] if tensor.ndim else tensor))
        return self._proto(name, tensor.dtype, tensor.shape, offset)

    def _write_rows(self, name: str, shape, dtype: np.dtype, read, transpose: bool) -> TensorProto:
        """A matrix read rows at a time (never whole): as it is, or transposed — each block of rows is then a
        block of columns of the output, written row by row at its place."""
        offset, (rows, cols) = self._align(), shape
        step = max(1, CHUNK_BYTES // (cols * dtype.itemsize))
        for a in range(0, rows, step):
            b = min(rows, a + step)
            if not transpose:
                self._put(np.ascontiguousarray(read(a, b)))
                continue
            block = np.ascontiguousarray(read(a, b).T)  # [cols, b - a]: output rows i, columns a..b
            for i in range(cols):
                self.data.seek(offset + (i * rows + a) * dtype.itemsize)
                self._put(block[i], progress=False)
            self.on_weight(block.nbytes)
        self.data.seek(offset + rows * cols * dtype.itemsize)
        return self._proto(name, dtype, (cols, rows) if transpose else (rows, cols), offset)

    def _align(self) -> int:
        self.data.write(b"\0" * (-self.data.tell() % ALIGN))
        return self.data.tell()

    def _put(self, chunk: np.ndarray, progress: bool = True) -> None:
        self.data.write(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8).data)
        if progress:
            self.on_weight(chunk.nbytes)

    @staticmethod
    def _proto(name: str, dtype: np.dtype, dims, offset: int) -> TensorProto:
        proto = TensorProto(name=name, data_type=ONNX_DTYPES[np.dtype(dtype).name], dims=list(dims),
                            data_location=TensorProto.EXTERNAL)
        length = math.prod(dims) * dtype.itemsize
        for k, v in (("location", DATA_FILE), ("offset", str(offset)), ("length", str(length))):
            proto.external_data.add(key=k, value=v)
        return proto


def to_model(emitter: Emitter, target: Target, metadata: dict[str, str]) -> onnx.ModelProto:
    g = emitter.graph

    def info(v):
        return helper.make_tensor_value_info(v.name, ONNX_DTYPES[v.dtype], list(v.shape))

    graph = helper.make_graph(emitter.nodes, "llgraph", [info(v) for v in g.inputs], [info(v) for v in g.outputs],
                              initializer=emitter.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in target.opsets.items()],
                              producer_name="llgraph", producer_version=__version__,
                              functions=list(emitter.functions.values()))
    model.ir_version = 10
    helper.set_model_props(model, metadata)
    return model


RING = "attention.ring"  # Emitter.shared's marks: a windowed layer's attention takes a ring (Manifest.window_ring),
FULL_WINDOWS = "attention.full_windows"  # or one does not (every layer then holds every position)


def lower(graph: Graph, source: WeightSource, target: Target, out_dir: Path, *, max_positions: int,
          metadata: dict[str, str], progress: bool = False, options: dict | None = None,
          destination: Path | None = None) -> bool:
    """Write `out_dir/model.onnx` + `model.onnx.data` (out_dir must exist and be empty); `destination`: the folder
    the progress line names (out_dir is its staged temporary). -> whether every windowed layer's attention takes a
    ring (Manifest.window_ring)."""
    from tqdm import tqdm

    missing = sorted({n.op for n in graph.nodes} - set(target.lowerings))
    if missing:
        raise NotImplementedError(f"target '{target.name}' cannot lower {missing}")
    check_weights(graph, source)
    total = sum(math.prod(int(d) for d in p.value.shape) * DTYPE_BYTES[p.value.dtype] for p in graph.params.values())
    check_free_space(out_dir, total)
    if progress:
        print(f"export {target.name}: about {total / 1e9:.2f} GB of weights into {destination or out_dir}",
              file=sys.stderr)
    with open(out_dir / DATA_FILE, "wb") as data, \
            tqdm(total=total, unit="B", unit_scale=True, desc=f"export {target.name}", disable=not progress) as bar:
        em = Emitter(graph, source, data, on_weight=bar.update, max_positions=max_positions, options=options or {})
        target.plan(em)
        for node in graph.nodes:
            if node.name in em.absorbed:
                continue
            em.fused.get(node.name, target.lowerings[node.op])(em, node)
        bar.total = bar.n  # the estimate counted each param at its nominal width; stored blocks can be narrower
        bar.refresh()
    onnx.save(to_model(em, target, metadata), out_dir / MODEL_FILE)
    return RING in em.shared and FULL_WINDOWS not in em.shared and target.name in ("ort", "onnx")


def check_free_space(out_dir: Path, need: int) -> None:
    """Refuse up front, in one line, an export the disk cannot hold (rather than an ENOSPC halfway through)."""
    free = shutil.disk_usage(out_dir).free
    if need + SPARE_BYTES > free:
        raise LlgraphError(f"the export needs about {need / 1e9:.2f} GB and {out_dir.parent} has {free / 1e9:.2f} GB "
                           f"free: free some space, or write it elsewhere with -o DIR (--cache-dir or "
                           f"$LLGRAPH_CACHE_DIR for the cache)")


def export(graph: Graph, source: WeightSource, target: Target, out: str | Path, *, max_positions: int,
           force: bool = False, progress: bool = False, extra_files=(), write_extras=None,
           options: dict | None = None) -> Path:
    """Export into folder `out`, written under a temporary name and renamed at the end: a failure leaves nothing.
    `force` replaces only an earlier llgraph export (see `llgraph.outdir`)."""
    out = Path(out)
    graph = target.options_pass(run_passes(graph, target.passes), options or {})
    with staged_folder(out, force) as tmp:
        metadata = {"llgraph_version": __version__, "target": target.name, "dtype": graph.metadata["dtype"],
                    "config": graph.metadata["config"], "weights": source.description}
        ring = lower(graph, source, target, tmp, max_positions=max_positions, metadata=metadata,
                     progress=progress, options=options, destination=out)
        for f in extra_files:
            shutil.copy(f, tmp / Path(f).name)
        if write_extras is not None:
            write_extras(tmp)
        manifest = Manifest(target.name, graph.metadata["dtype"],
                            LlamaConfig(**json.loads(graph.metadata["config"])), max_positions, source.description,
                            quantized=_quant_summary(graph), options=options or {},
                            inputs=tuple(v.name for v in graph.inputs), outputs=tuple(v.name for v in graph.outputs),
                            window_ring=ring)
        target.extras(tmp, manifest)
        files = tuple(sorted({p.name for p in tmp.iterdir()} - {PARTIAL_MARK} | {MANIFEST}))
        dataclasses.replace(manifest, files=files, **integrity_record(tmp, set(files) - {MANIFEST})).write(tmp)
    return out


def _quant_summary(graph: Graph) -> dict:
    """How many Linears (and mixtures' experts) are quantized, in which formats (for the manifest and `llgraph cache
    list`)."""
    counts: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "QLinear":
            bits = n.attrs["bits"] if n.attrs.get("code_bits", n.attrs["bits"]) == n.attrs["bits"] else \
                f"{n.attrs['code_bits']}in{n.attrs['bits']}"
            key = f"int{bits}/b{n.attrs['block_size']}/zp{n.attrs['zero_point']}"
            counts[key] = counts.get(key, 0) + 1
        elif n.op == "QMoE":  # routed experts in GGUF super-blocks
            key = f"experts {n.attrs['format']}/{n.attrs['down_format']}"
            counts[key] = counts.get(key, 0) + 1
    return counts
