"""Ahead-of-time compilation of the plugin kernels: Triton -> PTX for a given compute capability, the form a
TensorRT plugin's `aot_impl` returns so an engine runs without Python. Needs no GPU; `assemble` checks the PTX with
ptxas (Triton's bundled copy, else the one on PATH).

Must run without TRITON_INTERPRET: interpreted kernels cannot be compiled.

Triton (3.3+) appends two hidden pointer parameters to every kernel (global and profile scratch). A TensorRT AOT
launch passes only inputs, scalars and outputs, so `compile_op` refuses a kernel that would use either scratch
buffer and `fit_for_tensorrt` removes the two from the entry (the body never names them; a launch that passes N
arguments to an entry that declares N + 2 reads past TensorRT's argument array). It also lowers `.version`,
which follows Triton's bundled ptxas (9.x), to PTX_FLOOR: a driver older than the ISA version rejects the module.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from llgraph.plugins.tensorrt import spec
from llgraph.plugins.tensorrt import triton_kernels as kernels

POINTER = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}
# the same in every model dtype
FIXED_POINTERS = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "slots_ptr": "*i64", "sinks_ptr": "*fp32",
                  "chosen_ptr": "*i64", "order_ptr": "*i64", "blocks_ptr": "*i64"}


# the PTX ISA each module declares: CUDA 12.0's (8.0, what TensorRT 10.15+'s CUDA 12 drivers all read; the kernels
# use features of 7.1+, e.g. cvt.f32.bf16) or, for a newer target, the first ISA that has it (PTX ISA release notes)
PTX_FLOOR = {80: (8, 0), 86: (8, 0), 87: (8, 0), 89: (8, 0), 90: (8, 0), 100: (8, 6), 103: (8, 8), 120: (8, 7),
             121: (8, 8)}


@dataclass(frozen=True)
class Compiled:
    name: str  # the kernel's entry symbol in the PTX
    ptx: str
    num_warps: int
    shared_bytes: int


def signature(kernel, dtype: str) -> dict[str, str]:
    """Triton's signature for `kernel` in model dtype `dtype`, read from its parameters: pointers by name (RoPE
    tables and sinks fp32, positions and slots int64, the rest the model's dtype), scalars int32, constexprs as such."""
    def kind(p):
        if p.is_constexpr:
            return "constexpr"
        return FIXED_POINTERS.get(p.name, POINTER[dtype]) if p.name.endswith("_ptr") else "i32"
    return {p.name: kind(p) for p in kernel.params}


def compile_op(op: str, dtype: str, shapes: dict, attrs: dict, cc: int) -> tuple[Compiled, kernels.Launch]:
    """PTX for plugin op `op` on `shapes` (ints or TensorRT shape expressions) for compute capability `cc`, with
    the launch that goes with it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch = kernels.plan(op, shapes, attrs)
    source = ASTSource(fn=launch.kernel, signature=signature(launch.kernel, dtype), constexprs=launch.constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32))
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise RuntimeError(f"{launch.kernel.__name__} needs Triton scratch memory, which a TensorRT AOT launch "
                           "does not pass; use the JIT plugin (impl) for it")
    arguments = len(spec.inputs(op)) + len(launch.scalars) + len(spec.outputs(op))  # what TensorRT passes
    ptx = fit_for_tensorrt(compiled.asm["ptx"], meta.name, arguments, cc)
    return Compiled(meta.name, ptx, meta.num_warps, meta.shared), launch


def fit_for_tensorrt(ptx: str, entry: str, arguments: int, cc: int) -> str:
    """The PTX with entry `entry` declaring exactly `arguments` parameters (the trailing ones beyond, Triton's
    scratch pointers, dropped; refused if the body reads one) at the oldest `.version` that has sm_{cc}."""
    head = re.search(rf"\.entry\s+{re.escape(entry)}\s*\(([^)]*)\)", ptx)
    if head is None:
        raise RuntimeError(f"no .entry {entry} in the PTX")
    params = [p.strip() for p in head.group(1).split(",") if p.strip()]
    if len(params) < arguments:
        raise RuntimeError(f"{entry} declares {len(params)} parameters, fewer than the {arguments} TensorRT passes")
    body = ptx[head.end():]
    for extra in params[arguments:]:
        name = extra.split()[-1]
        if re.search(rf"\b{re.escape(name)}\b", body):
            raise RuntimeError(f"{entry} reads its parameter {name}, which a TensorRT AOT launch does not pass")
    joined = ",\n\t".join(params[:arguments])
    ptx = ptx[:head.start(1)] + f"\n\t{joined}\n" + ptx[head.end(1):]
    floor = PTX_FLOOR.get(cc)
    version = re.search(r"^\.version (\d+)\.(\d+)", ptx, re.M)
    if floor is not None and version is not None and (int(version[1]), int(version[2])) > floor:
        ptx = ptx[:version.start()] + f".version {floor[0]}.{floor[1]}" + ptx[version.end():]
    return ptx


def ptxas_candidates() -> list[str]:
    """The machine's ptxas first, then Triton's bundled ones, newest first (Triton emits PTX 9.x for sm_90a,
    which the CUDA 12.9 ptxas it also bundles rejects)."""
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    found = [shutil.which("ptxas"), os.path.join(bundled, "ptxas-blackwell"), os.path.join(bundled, "ptxas")]
    return [p for p in found if p and os.path.exists(p)]


def assemble(ptx: str, cc: int) -> bytes:
    """cubin bytes for sm_{cc} (sm_90a for 90, as Triton targets it), from the first ptxas that accepts the PTX;
    raises with every ptxas's message when none does."""
    arch = f"sm_{cc}a" if cc == 90 else f"sm_{cc}"
    errors = []
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        for ptxas in ptxas_candidates():
            r = subprocess.run([ptxas, f"--gpu-name={arch}", src, "-o", out], capture_output=True, text=True)
            if r.returncode == 0:
                with open(out, "rb") as f:
                    return f.read()
            errors.append(f"{ptxas}: {r.stderr.strip().splitlines()[0] if r.stderr.strip() else r.returncode}")
    raise RuntimeError(f"no ptxas assembled the PTX for {arch}: " + "; ".join(errors) if errors
                       else "ptxas not found (neither on PATH nor bundled with Triton)")
