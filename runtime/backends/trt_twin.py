"""A CPU twin of TensorRT's runtime: `TRTBackend` runs unchanged on it, on CPU memory, with TensorRT's execution
contract enforced and each step computed by ONNX Runtime from the export's function bodies.

    TRTRunner(FOLDER, tensorrt="twin").generate("Hello")    # llgraph generate FOLDER --backend trt --tensorrt twin

No engine can run on this machine, so the twin stands in for `IRuntime`, `ICudaEngine` and `IExecutionContext`:
- **the engine's I/O** is what TensorRT-RTX's builder reports for the folder's export on this machine (the parsed
  network's tensor names, modes and dtypes; an engine on llgraph's plugins adds slot_ids, its ragged rows), with
  the optimization profiles `llgraph build` recorded from TensorRT (`engine.json`) and each present cache aliased
  to its past input (the plugin's alias, the native KV-cache update);
- **the contract** (TensorRT's API documentation): a profile is selected before shapes; `set_input_shape` is refused
  outside the active profile; `set_tensor_address` is refused unless 256-byte aligned; at `execute_async_v3` every
  input shape and every I/O address is set, each address lies in memory the twin device allocated with room for the
  tensor, an aliased output is bound to its input's address, and every input was last written on the executing
  stream (or that stream waited for its writer). A refusal returns False as TensorRT's calls do; a broken rule at
  execution raises `ContractError` naming it;
- **the step**: ONNX Runtime runs the export's model (its plugin nodes through their function bodies) on the bound
  buffers, and writes the logits and the present caches back into them.

`TwinDevice` is the twin of `CudaDevice` (runtime/backends/trt.py): 256-byte aligned CPU buffers, and streams that
record which stream last wrote each buffer.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from llgraph.builder import cache_pairs
from llgraph.export.trt_build import EngineError, TensorRT, load_tensorrt, parse
from llgraph.passes import SLOTS_INPUT

ALIGN = 256  # setTensorAddress: "the pointer must have at least 256-byte alignment" (NvInferRuntime.h)


class ContractError(EngineError):
    """The backend broke TensorRT's execution contract (TensorRT would fail or compute garbage)."""


class DataType(enum.Enum):  # TensorRT's names
    FLOAT = torch.float32
    HALF = torch.float16
    BF16 = torch.bfloat16
    INT32 = torch.int32
    INT64 = torch.int64


class TensorIOMode(enum.Enum):
    INPUT = 1
    OUTPUT = 2


@dataclass(frozen=True)
class Tensor:
    name: str
    mode: TensorIOMode
    dtype: DataType


# -- the device ---------------------------------------------------------------------------------------------------

class Stream:
    def __init__(self, handle: int):
        self.cuda_stream, self.waited = handle, set[object]()

    def synchronize(self) -> None:
        pass  # the twin computes at execute time

    def wait_stream(self, other: Stream) -> None:
        self.waited.add(other.cuda_stream)


class TwinDevice:
    """CPU buffers (256-byte aligned, as CUDA's allocator gives) and streams that record each buffer's writer."""

    def __init__(self):
        self.default = Stream(0)
        self.streams, self._current = [self.default], [self.default]
        # start address -> (bytes, handle of the stream that last wrote it); dropped once its memory is freed
        self.buffers: dict[int, tuple[int, int | None]] = {}
        self._storages: dict[int, StorageWeakRef] = {}

    def stream(self) -> Stream:
        s = Stream(len(self.streams))
        self.streams.append(s)
        return s

    @contextlib.contextmanager
    def on(self, stream: Stream):
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def _alloc(self, shape, dtype: torch.dtype, written: bool) -> torch.Tensor:
        size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        raw = torch.empty(size + ALIGN, dtype=torch.uint8)
        start = -raw.data_ptr() % ALIGN
        t = raw[start:start + size].view(dtype).view(tuple(shape))
        for gone in [a for a, ref in self._storages.items() if ref.expired()]:  # no tensor holds that memory now
            del self.buffers[gone], self._storages[gone]
        address = t.data_ptr()
        self.buffers[address] = (size, self._current[-1].cuda_stream if written else None)
        self._storages[address] = StorageWeakRef(raw.untyped_storage())
        return t

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return self._alloc(shape, dtype, written=True).zero_()

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return self._alloc(shape, dtype, written=False)

    def upload(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A copy on this device, written on the current stream, laid out as torch's `.to("cuda")` lays it out:
        a dense non-contiguous source (a transposed view) keeps its strides, so binding its data_ptr as a
        row-major tensor would read the wrong elements, as it would on a GPU."""
        order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
        dense = t.permute(order).is_contiguous()
        out = self._alloc(t.shape, dtype, written=True)
        if dense and not t.is_contiguous():
            size = tuple(t.shape[d] for d in order)
            out = out.view(size).permute([order.index(d) for d in range(t.dim())])  # same memory, t's strides
        out.copy_(t)
        return out

    def owner(self, address: int) -> tuple[int, int, int | None] | None:
        """(start, bytes, writer) of the buffer holding `address`, or None."""
        for start, (size, writer) in self.buffers.items():
            if start <= address < start + size:
                return start, size, writer
        return None

    def mark_written(self, address: int, stream: int) -> None:
        owned = self.owner(address)
        if owned is None:
            raise RuntimeError(f"address {address:#x} is in no allocated buffer")
        start, size, _ = owned
        self.buffers[start] = (size, stream)


# -- the runtime ----------------------------------------------------------------------------------------------------

class ILogger:
    class Severity(enum.IntEnum):
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    def __init__(self):
        pass


class Engine:
    def __init__(self, folder: Path, meta: dict, device: TwinDevice):
        self.folder, self.meta, self.device = folder, meta, device
        self.tensors, self.aliases = contract(folder, meta["max_seq_len"], bool(meta.get("ragged")))
        self.profiles = meta["profile_shapes"]  # per profile, input -> [min, opt, max], as TensorRT reported them
        self._session = None

    @property
    def num_io_tensors(self) -> int:
        return len(self.tensors)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def get_tensor_name(self, i: int) -> str:
        return list(self.tensors)[i]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return self.tensors[name].mode

    def get_tensor_dtype(self, name: str) -> DataType:
        return self.tensors[name].dtype

    def create_execution_context(self) -> Context:
        return Context(self)

    def session(self):
        if self._session is None:
            import onnxruntime as ort

            from llgraph.export_folder import Manifest

            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            model = self.folder / Manifest.read(self.folder).model
            self._session = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
        return self._session


class Context:
    def __init__(self, engine: Engine):
        self.engine, self.device = engine, engine.device
        self.active_optimization_profile = 0  # TensorRT's first context starts on profile 0
        self.shapes: dict[str, tuple] = {}
        self.addresses: dict[str, int] = {}
        self.executions = 0

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        if not 0 <= index < self.engine.num_optimization_profiles:
            return False
        self.active_optimization_profile, self.shapes = index, {}  # shapes are per profile: set them again
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        t = self.engine.tensors.get(name)
        if t is None or t.mode != TensorIOMode.INPUT:
            return False
        lo, _, hi = self.engine.profiles[self.active_optimization_profile][name]
        shape = tuple(int(d) for d in shape)
        if len(shape) != len(lo) or any(not a <= d <= b for d, a, b in zip(shape, lo, hi)):
            return False
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        if name not in self.engine.tensors or address % ALIGN:
            return False
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream: int) -> bool:
        e = self.engine
        inputs = [n for n, t in e.tensors.items() if t.mode == TensorIOMode.INPUT]
        unset = [n for n in inputs if n not in self.shapes]
        if unset:
            raise ContractError(f"execute before the input shapes of {unset[:3]} were set on profile "
                                f"{self.active_optimization_profile}")
        unbound = [n for n in e.tensors if n not in self.addresses]
        if unbound:
            raise ContractError(f"execute with no address for {unbound[:3]}")
        for output, source in e.aliases.items():
            if self.addresses[output] != self.addresses[source]:
                raise ContractError(f"{output} aliases {source} and must be bound to its address")
        shapes = dict(self.shapes)
        feeds = {}
        for name in inputs:
            feeds[name] = self._view(name, shapes[name], stream)
        session = e.session()
        wanted = [o.name for o in session.get_outputs()]
        results = dict(zip(wanted, session.run(wanted, feeds)))
        for name in wanted:
            out = self._view(name, results[name].shape, None)
            out[...] = results[name]
            self.device.mark_written(self.addresses[name], stream)
        self.executions += 1
        return True

    def _view(self, name: str, shape: tuple, stream: int | None) -> np.ndarray:
        """The bound memory of `name` as an array of `shape` (checked to lie in one buffer, and for an input read on
        `stream`, to have been written on it or on a stream it waited for)."""
        dtype = self.engine.tensors[name].dtype.value
        size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        address = self.addresses[name]
        owner = self.device.owner(address)
        if owner is None or address + size > owner[0] + owner[1]:
            raise ContractError(f"{name}'s address holds no {size}-byte {dtype} buffer of shape {shape}")
        if stream is not None and owner[2] not in (None, stream):
            waited = self.device.streams[stream].waited if stream < len(self.device.streams) else set()
            if owner[2] not in waited:
                raise ContractError(f"{name} is read on stream {stream} but was written on stream {owner[2]}, "
                                    "which it never waited for: the engine may read it before it is written")
        raw = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(address))
        np_dtype = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64,
                    torch.int32: np.int32}.get(dtype)
        if np_dtype is None:
            raise ContractError(f"the twin computes with ONNX Runtime on the CPU, which has no {dtype}; use an fp32 "
                                "export")
        return raw.view(np_dtype).reshape(shape)


class Runtime:
    def __init__(self, logger, folder: Path, meta: dict, device: TwinDevice):
        self.folder, self.meta, self.device = folder, meta, device

    def deserialize_cuda_engine(self, data: bytes) -> Engine | None:
        return Engine(self.folder, self.meta, self.device) if data else None


def contract(folder: Path, max_seq_len: int, ragged: bool = False) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(name -> Tensor, present -> past) of the export as TensorRT-RTX's builder parses it here; `ragged`: an engine
    built on llgraph's plugins (on a GPU: TensorRT-RTX runs no plugins), whose I/O adds slot_ids, int64."""
    from llgraph.export_folder import Manifest

    rtx = load_tensorrt("rtx")
    net = parse(folder, max_seq_len, rtx, "none").network
    tensors = {SLOTS_INPUT: Tensor(SLOTS_INPUT, TensorIOMode.INPUT, DataType.INT64)} if ragged else {}
    for count, get, mode in ((net.num_inputs, net.get_input, TensorIOMode.INPUT),
                             (net.num_outputs, net.get_output, TensorIOMode.OUTPUT)):
        for i in range(count):
            t = get(i)
            tensors[t.name] = Tensor(t.name, mode, DataType[str(t.dtype).rsplit(".", 1)[-1]])
    aliases = {present: past for past, present in cache_pairs(Manifest.read(folder).config)}
    return tensors, aliases


def load_twin(folder: Path, meta: dict) -> tuple[TensorRT, TwinDevice]:
    """The twin as a TensorRT module (what TRTBackend calls: Runtime, ILogger, DataType, TensorIOMode) and its
    device."""
    import types

    device = TwinDevice()
    module = types.SimpleNamespace(
        __version__="twin", ILogger=ILogger, DataType=DataType, TensorIOMode=TensorIOMode,
        Runtime=lambda logger: Runtime(logger, folder, meta, device))
    return TensorRT(module, "twin"), device
