"""TensorRT plugin registrations (`tensorrt.plugin`, QDP) for RMSNorm, Rotary, GroupedAttention, SwiGLU and
ExpertMatMul.

Nothing here is written per op twice: each plugin's signature (its input tensors, then its fields with their types)
is generated from the op schema through spec.py, its kernels and launches come from triton_kernels.py
(`plan`), and its AOT code from aot.py. Each plugin gets:
- `register`: output descriptions (GroupedAttention's present_key/present_value alias past_key/past_value: the
  cache is updated in place; ExpertMatMul's is [tokens, k, out]);
- `impl` (JIT): runs the Triton kernel from Python on TensorRT's stream;
- `aot_impl`: Triton-compiled PTX for this GPU + launch parameters + the int32 scalars as symbolic expressions, so
  the engine runs without Python;
- `autotune`: fp32, fp16 and bf16 (RoPE tables and sinks stay fp32, positions, slots and chosen experts int64),
  linear formats.

`register_plugins()` imports tensorrt lazily; `trtp` may be passed in (the tests pass TensorRT's own plugin module
loaded over a stand-in `tensorrt`, to run its validators on these signatures without the TensorRT libraries).
"""

from __future__ import annotations

import inspect
import typing

from llgraph.errors import LlgraphError
from llgraph.plugins.tensorrt import spec

TYPES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16"}
# the same in every model dtype
FIXED_TYPES = {"cos": "FP32", "sin": "FP32", "positions": "INT64", "slots": "INT64", "sinks": "FP32", "chosen": "INT64",
               "order": "INT64", "blocks": "INT64"}
_registered: set[int] = set()


class TensorRTMissing(LlgraphError):
    """tensorrt (or a GPU) is not available; one line naming the fix."""


def import_tensorrt():
    try:
        import tensorrt
        import tensorrt.plugin  # noqa: F401
    except ImportError as e:
        raise TensorRTMissing(f"TensorRT is not installed ({e}); on a machine with an NVIDIA GPU, "
                              "pip install tensorrt (10.15+ or 11)") from None
    return tensorrt


def register_plugins(trtp=None) -> None:
    """Register every llgraph plugin with TensorRT once per plugin module."""
    if trtp is None:
        import_tensorrt()
        import tensorrt.plugin as trtp  # type: ignore[no-redef]
    if id(trtp) in _registered:
        return
    for op in spec.PLUGIN_OPS:
        _register(trtp, op)
    _registered.add(id(trtp))


def _params(names, annotation=inspect.Parameter.empty):
    return [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation) for n in names]


def _function(name: str, params: list, body, returns=inspect.Signature.empty):
    """A function with an explicit signature (TensorRT validates plugin functions by their signatures)."""
    signature = inspect.Signature(params, return_annotation=returns)

    def fn(*args, **kwargs):
        return body(signature.bind(*args, **kwargs).arguments)
    fn.__signature__, fn.__name__ = signature, name  # type: ignore[attr-defined]
    return fn


def _register(trtp, op: str) -> None:
    pid, names, fields, n_out = spec.plugin_id(op), spec.inputs(op), spec.fields(op), len(spec.outputs(op))
    attrs = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=t) for n, t in fields.items()]

    def describe(args):
        if op == "GroupedAttention":
            return args["q"].like(), args["past_key"].aliased(), args["past_value"].aliased()
        if op == "ExpertMatMul":  # [tokens, k, out]
            x = args["x"]
            return (trtp.from_shape_expr((x.shape_expr[0], args["chosen"].shape_expr[1], args["weight"].shape_expr[2]),
                                         dtype=x.dtype),)
        return (args[names[0]].like(),)

    def impl(args):
        import torch

        from llgraph.plugins.tensorrt import triton_kernels as kernels

        with torch.cuda.stream(torch.cuda.ExternalStream(args["stream"])):
            kernels.launch(op, {n: _as_torch(args[n]) for n in names}, [_as_torch(t) for t in args["outputs"]],
                           {n: args[n] for n in fields})

    def aot_impl(args):
        return _aot(trtp, op, {n: args[n] for n in names}, {n: args[n] for n in fields})

    def autotune(args):
        types = [FIXED_TYPES.get(n, "FP32|FP16|BF16") for n in names] + ["FP32|FP16|BF16"] * n_out
        return [trtp.AutoTuneCombination(", ".join(types), "LINEAR")]

    tensors = _params(names, trtp.TensorDesc)
    trtp.register(pid)(_function(f"{op}_desc", tensors + attrs, describe,
                                 typing.Tuple[tuple([trtp.TensorDesc] * n_out)]))  # noqa: UP006 (a runtime-built arity)
    trtp.impl(pid)(_function(f"{op}_impl", _params(names) + attrs + _params(["outputs", "stream"]), impl))
    trtp.aot_impl(pid)(_function(f"{op}_aot_impl", _params(names) + attrs + _params(["outputs", "tactic"]), aot_impl,
                                 tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]))
    trtp.autotune(pid)(_function(f"{op}_autotune", _params(names) + attrs + _params(["outputs"]), autotune))


def _aot(trtp, op: str, descs: dict, attrs: dict):
    """(kernel name, PTX, launch params, scalar args) for TensorRT to embed in the engine."""
    import tensorrt as trt
    import torch

    from llgraph.plugins.tensorrt.aot import compile_op

    dtype = {trt.float32: "float32", trt.float16: "float16", trt.bfloat16: "bfloat16"}[descs[spec.inputs(op)[0]].dtype]
    major, minor = torch.cuda.get_device_capability()
    compiled, launch = compile_op(op, dtype, {n: tuple(d.shape_expr) for n, d in descs.items()}, attrs,
                                  10 * major + minor)
    params = trtp.KernelLaunchParams()
    for axis, size in zip("xyz", launch.grid):
        setattr(params, f"grid_{axis}", size)
    params.block_x = compiled.num_warps * 32
    params.shared_mem = compiled.shared_bytes
    scalars = trtp.SymIntExprs(len(launch.scalars))
    for i, value in enumerate(launch.scalars):
        scalars[i] = trtp.SymInt32(value)
    return compiled.name, compiled.ptx, params, scalars


class _CudaArray:
    def __init__(self, interface):
        self.__cuda_array_interface__ = interface


def _as_torch(t):
    """A TensorRT plugin tensor as a torch CUDA tensor on the same memory (bf16 through an int16 view: the CUDA
    array interface has no bfloat16)."""
    import tensorrt as trt
    import torch

    typestr, view = {trt.float32: ("<f4", None), trt.float16: ("<f2", None), trt.bfloat16: ("<i2", torch.bfloat16),
                     trt.int64: ("<i8", None), trt.int32: ("<i4", None)}[t.dtype]
    tensor = torch.as_tensor(_CudaArray({"shape": tuple(t.shape), "typestr": typestr, "data": (t.data_ptr, False),
                                         "version": 3}), device="cuda")
    return tensor.view(view) if view is not None else tensor
