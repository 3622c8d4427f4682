"""How a checkpoint's weights are to be run: the one request the CLI or the Python API builds, checked once, and
passed whole to export, the runners and the export cache.

    Weights()                                  # float32; a GGUF's 4/8-bit blocks as stored, computed exactly
    Weights("fp16", quantize="int4")           # a float checkpoint rounded to int4 blocks (aliases: fp32/fp16/bf16)
    Weights(accuracy_level=4).check("ort", bf16=False, accuracy_level=True)   # where it runs
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llgraph.errors import ExportError

DTYPES = ("float32", "float16", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
BITS = ("int4", "int8")
# How ONNX Runtime runs QLinear: llgraph's CPU kernels (plugins/cpu/) where they build, else its own ops ("auto",
# resolved by export.resolve_kernels before anything is keyed on it), or either one by name
KERNELS = ("auto", "standard", "llgraph")
ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # ONNX Runtime MatMulNBits': 0 exact (fp32) ... 4 int8 activations
# MatMulNBits' accuracy_level by default: 0, exact fp32 compute on the stored blocks. Level 4 (int8 activations per
# block of 32, as llama.cpp quantizes them to Q8 for its Q4_1 dot products) decodes SmolLM2's Q4_1 GGUF 1.6x faster
# and stays closer to the exact next-token distributions than llama.cpp on the same file (mean KL 0.0033 vs 0.0042,
# `python -m llgraph.runtime.bench.engines --int4`), yet it turns the README's own question ("What is the capital of
# France?", chat) from "The capital of France is Paris." into "L'Etoile, la Marseur, la France, ..." (llama.cpp
# answers "L'Etoile, la Marseillaise, ..."): the stored weights' own answers are the default; `--accuracy-level 4`
# opts in to the speed.
DEFAULT_ACCURACY_LEVEL = 0
# ... except for GGUF K-quant super-blocks (Q4_K, Q5_K, Q6_K: the 1B-8B models users run), whose default is level 4 on
# llgraph's kernels: there exact fp32 compute is prefill-bound at half llama.cpp's speed, while int8 x (per 32,
# centred) keeps the next-token distributions closer to the exact ones than llama.cpp's own Q8_K (per 256,
# uncentred) does: the README's "Quantized weights" has the figures. The level is the model's: the blocked tensors a
# K-quant file carries beside its super-blocks (llama.cpp's Q4_K_M writes Q5_0/Q8_0 wherever a row is not whole
# super-blocks: 166 of SmolLM2-Q4_K_M's 272 tensors) take it too, since exact fp32 on them runs decode at a third and
# prefill at 0.4x the rate of int8 x (`python -m llgraph.runtime.bench.gemv --types Q5_0,Q8_0 --level 0|4`).
SUPERBLOCK_ACCURACY_LEVEL = 4


def accuracy_level_of(requested: int | None, superblocks: bool) -> int:
    """A quantized Linear's accuracy level: the one requested, else its model's default (`superblocks`: the model
    holds GGUF super-blocks, in a QLinear or in a QMoE's experts)."""
    if requested is not None:
        return requested
    return SUPERBLOCK_ACCURACY_LEVEL if superblocks else DEFAULT_ACCURACY_LEVEL


class WeightRequestError(ExportError):
    """A weight flag that cannot be honoured; one line naming the flag and its choices."""


@dataclass(frozen=True)
class Weights:
    """`dtype` of the float parts; a quantized GGUF as stored, or `dequantize`d to floats; a float checkpoint
    `quantize`d (int4/int8) by round-to-nearest in blocks of `block_size` codes, `symmetric` or with per-block mins;
    the lm head (and an embedding table tied to it) rounded to `lm_head` too; ONNX Runtime's `accuracy_level` (the
    ort target only; None: DEFAULT_ACCURACY_LEVEL); `kernels`: ONNX Runtime's own ops for the quantized Linears
    ("standard"), llgraph's CPU kernels ("llgraph": the stored blocks at exact fp32 compute, or with int8
    activations at accuracy level 4), or llgraph's where they can be had ("auto"); `lora`: adapters merged into a
    float checkpoint's weights before anything rounds them (llgraph/lora.py)."""
    dtype: str = "float32"
    quantize: str | None = None
    block_size: int = 32
    symmetric: bool = False
    dequantize: bool = False
    accuracy_level: int | None = None
    lm_head: str | None = None
    kernels: str = "auto"
    lora: tuple = ()  # llgraph.lora.Adapter's merged into the checkpoint's weights, in order (--lora DIR[:SCALE])

    def __post_init__(self):
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        if self.dtype not in DTYPES:
            raise WeightRequestError(f"unknown dtype '{self.dtype}'; use one of fp32, fp16, bf16")
        for flag, value in (("quantize", self.quantize), ("lm-head", self.lm_head)):
            if value not in (None, *BITS):
                raise WeightRequestError(f"unknown --{flag} '{value}'; use int4 or int8")
            if value and self.dequantize:
                raise WeightRequestError(f"--{flag} and --dequantize contradict each other; pass one")
        if not isinstance(self.block_size, int) or self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise WeightRequestError(f"--block-size ({self.block_size}) must be a power of 2 >= 16 (32, 64 or 128)")
        if self.kernels not in KERNELS:
            raise WeightRequestError(f"unknown --kernels '{self.kernels}'; use auto, standard or llgraph")
        if self.accuracy_level not in (None, *ACCURACY_LEVELS):
            raise WeightRequestError(f"--accuracy-level ({self.accuracy_level}) is MatMulNBits' (0..4) and only for "
                                     "--target ort")

    def check(self, where: str, bf16: bool = True, accuracy_level: bool = False, kernels: bool = False) -> Weights:
        """The request checked against where it runs: an export target or a backend named `where`, which runs
        bfloat16 weights (`bf16`), takes an accuracy level (`accuracy_level`) and llgraph's CPU kernels
        (`kernels`) or not. Returns itself."""
        if self.kernels == "llgraph" and not kernels:
            raise WeightRequestError(f"--kernels llgraph is for ONNX Runtime (--target ort), not {where}")
        if self.kernels == "llgraph" and self.dtype != "float32":
            raise WeightRequestError("llgraph's CPU kernels compute in float32; use --dtype fp32 or --kernels "
                                     "standard")
        if self.dtype == "bfloat16" and not bf16:
            raise WeightRequestError(
                f"--dtype bf16 cannot run on the {where} target (ONNX Runtime's CPU kernels have no bf16 MatMul); "
                "use --dtype fp32 or fp16 for ONNX Runtime, or --target trt / onnx for a GPU runtime with bf16")
        if self.accuracy_level is not None and not accuracy_level:
            raise WeightRequestError(f"--accuracy-level ({self.accuracy_level}) is MatMulNBits' (0..4) and only "
                                     "for --target ort")
        return self

    @property
    def rounds(self) -> bool:
        """Whether float weights are rounded to blocks (--quantize or --lm-head)."""
        return bool(self.quantize or self.lm_head)

    @property
    def mode(self) -> str:
        """Its part of the export cache's key: every choice that changes the exported bytes."""
        level = f"-l{'auto' if self.accuracy_level is None else self.accuracy_level}"  # auto: by format
        if self.dequantize:
            return f"{self.dtype}-dequantized{self._lora_key()}"
        head = f"-head{self.lm_head}" if self.lm_head else ""
        rounding = f"-b{self.block_size}-{'sym' if self.symmetric else 'asym'}" if self.rounds else ""
        if self.kernels == "auto":
            raise ValueError("--kernels auto is resolved (export.resolve_kernels) before it keys anything")
        kernels = "" if self.kernels == "standard" else f"-k{self.kernels}"  # standard: the keys made before it
        return f"{self.dtype}-{self.quantize or 'stored'}{head}{rounding}{level}{kernels}{self._lora_key()}"

    def _lora_key(self) -> str:
        """The adapters' part of the key: their files' content and their scales, in order ('' without any)."""
        if not self.lora:
            return ""
        import hashlib

        from llgraph.export_folder import file_sha256

        h = hashlib.sha256()
        for adapter in self.lora:
            h.update(f"{adapter.scale!r}:{':'.join(file_sha256(f) for f in adapter.files())}|".encode())
        return f"-lora{h.hexdigest()[:12]}"

    def replace(self, **changes) -> Weights:
        return dataclasses.replace(self, **changes)
