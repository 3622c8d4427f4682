"""Ahead-of-time compilation of the plugin kernels: Triton -> PTX for a given compute capability, the form a
TensorRT plugin's `aot_impl` returns so an engine runs without Python. Needs no GPU; `assemble` checks the PTX with
ptxas (Triton's bundled copy, else the one on PATH).

Must run without TRITON_INTERPRET: interpreted kernels cannot be compiled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from llgraph.plugins import kernels

POINTER = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}


@dataclass(frozen=True)
class Compiled:
    name: str  # the kernel's entry symbol in the PTX
    ptx: str
    num_warps: int
    shared_bytes: int


def signature(kernel: str, dtype: str) -> dict[str, str]:
    p = POINTER[dtype]
    return {
        "rmsnorm": {"x_ptr": p, "w_ptr": p, "y_ptr": p, "n_cols": "i32", "eps": "fp32", "BLOCK": "constexpr"},
        "swiglu": {"g_ptr": p, "u_ptr": p, "y_ptr": p, "n": "i32", "BLOCK": "constexpr"},
        "rotary": {"x_ptr": p, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "y_ptr": p, "num_heads": "i32",
                   "head_dim": "i32", "half": "i32", "INTERLEAVED": "constexpr", "BLOCK": "constexpr"},
        "cache_write": {"new_ptr": p, "pos_ptr": "*i64", "cache_ptr": p, "seq": "i32", "kv_heads": "i32",
                        "max_seq": "i32", "head_dim": "i32", "BLOCK_D": "constexpr"},
        "attention": {"q_ptr": p, "pos_ptr": "*i64", "k_ptr": p, "v_ptr": p, "out_ptr": p, "seq": "i32",
                      "num_heads": "i32", "kv_heads": "i32", "max_seq": "i32", "head_dim": "i32", "scale": "fp32",
                      "BLOCK_N": "constexpr", "BLOCK_D": "constexpr"},
    }[kernel]


def compile_kernel(kernel: str, dtype: str, cc: int, **constexprs) -> Compiled:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(kernels, f"{kernel}_kernel")
    source = ASTSource(fn=fn, signature=signature(kernel, dtype), constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32))
    return Compiled(compiled.metadata.name, compiled.asm["ptx"], compiled.metadata.num_warps,
                    compiled.metadata.shared)


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
