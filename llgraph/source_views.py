"""Weight sources that are views over another source: what a checkpoint holds, seen as the graph wants it.

- `QuantizedSource`: the decoder-layer Linears and/or the lm head rounded to nearest (`--quantize`, `--lm-head`).
- `FusedSplitSource`: Phi-3's fused `qkv_proj` / `gate_up_proj` under the Llama names.
- `NormOffsetSource`: Gemma's RMSNorm weights stored as w - 1, seen as 1 + w.
- `WidenedSource`: GGUF K-quant super-blocks seen in the blocked form, for runtimes without a super-block kernel.
- `StackedExperts`: a mixture of experts' per-expert tensors seen stacked, as ops.py's MoE takes them.
- `PackedExperts`: gpt-oss's experts (gate and up interleaved in one tensor, stored input-major) and router, seen as
  ops.py's MoE takes them.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

import numpy as np

from llgraph.config import LlamaConfig
from llgraph.quant import QuantFormat, QuantTensor, dequantize, quantize_rtn
from llgraph.weights import QUANTIZABLE, SourceView, WeightError, WeightSource


class QuantizedSource(SourceView):
    """Another source with weights quantized by round-to-nearest: the decoder-layer Linears at `bits` (`llgraph
    export --quantize int4|int8`; 0: as the base has them) and the lm head at `head_bits` (`--lm-head int4|int8`;
    0: as the base has it), the embedding table with it when `tied` (one table, read by both). `load` returns the
    dequantized values, so every backend sees the same weights."""

    ROUND_BYTES = 64 << 20  # float rows rounded at a time

    def __init__(self, base: WeightSource, bits: int, block_size: int = 32, symmetric: bool = False,
                 head_bits: int = 0, tied: bool = False):
        super().__init__(base)
        self.bits, self.block_size, self.symmetric = bits, block_size, symmetric
        self._head_bits = {"lm_head.weight": head_bits, **({"model.embed_tokens.weight": head_bits} if tied else {})}
        what = ([f"RTN int{bits}"] if bits else []) + ([f"lm head RTN int{head_bits}"] if head_bits else [])
        self.description = f"{base.description}, {', '.join(what)} (block {block_size}, " \
                           f"{'symmetric' if symmetric else 'asymmetric'})"
        self._last: tuple[str, QuantTensor] | None = None

    def _bits(self, name: str) -> int:
        return self.bits if QUANTIZABLE.fullmatch(name) else self._head_bits.get(name, 0)

    def quant_format(self, name):
        bits = self._bits(name)
        if not bits:
            return self.base.quant_format(name)
        if self.shape(name)[-1] % self.block_size:
            raise WeightError(f"--block-size {self.block_size} does not divide the input features of {name} "
                              f"({self.shape(name)[-1]}); choose a block size that does (32 divides most)")
        return QuantFormat(bits, self.block_size, 1 << (bits - 1) if self.symmetric else 0, not self.symmetric)

    def load_quantized(self, name):
        bits = self._bits(name)
        if not bits:
            return self.base.load_quantized(name)
        if self._last is None or self._last[0] != name:  # codes, scales and mins are asked for one after another
            self._last = (name, self._round(name, bits))
        return self._last[1]

    def _round(self, name: str, bits: int) -> QuantTensor:
        """RTN of `name`, ~64 MB of float rows at a time where the base reads rows (an 8B model's lm head is
        2.1 GB in float32: rounded whole, its temporaries alone would pass 2 GB)."""
        out, n_in = self.shape(name)
        step = max(1, self.ROUND_BYTES // (4 * n_in))
        parts = []
        for start in range(0, out, step):
            rows = self.base.load_rows(name, start, min(out, start + step), np.dtype(np.float32))
            if rows is None:  # a source without row reads: the tensor whole
                return quantize_rtn(self.base.load(name, np.dtype(np.float32)), bits, self.block_size,
                                    self.symmetric)
            parts.append(quantize_rtn(rows, bits, self.block_size, self.symmetric))
        if len(parts) == 1:
            return parts[0]
        mins = None if parts[0].mins is None else np.concatenate([p.mins for p in parts])
        return QuantTensor(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]), mins,
                           parts[0].fmt)

    def load_rows(self, name, start, stop, dtype=None):
        return self.base.load_rows(name, start, stop, dtype) if self.quant_format(name) is None else None

    def load(self, name, dtype=None):
        if self.quant_format(name) is None:
            return self.base.load(name, dtype)
        q = self.load_quantized(name)
        return dequantize(q.codes, q.scales, q.mins, q.fmt.bits, q.fmt.zero_point, np.dtype(np.float32))


def rtn_view(source: WeightSource, cfg: LlamaConfig, quantize: str | None = None, block_size: int = 32,
             symmetric: bool = False, lm_head: str | None = None) -> WeightSource:
    """`source` as the weight flags --quantize / --lm-head (int4, int8 or None) want it rounded: a QuantizedSource,
    or `source` itself when neither is given."""
    bits, head_bits = (int(q[3:]) if q else 0 for q in (quantize, lm_head))
    if not (bits or head_bits):
        return source
    return QuantizedSource(source, bits, block_size, symmetric, head_bits, cfg.tie_word_embeddings)


class FusedSplitSource(WeightSource):
    """A checkpoint with fused projections (Phi-3's `qkv_proj` = [q; k; v] rows and `gate_up_proj` = [gate; up]
    rows) seen under the Llama names, each part a row slice of its fused tensor (the QKV and gate/up packing passes
    then pack them again for the backends that want them packed)."""

    FUSED = re.compile(r"(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)")

    def __init__(self, base: WeightSource, cfg: LlamaConfig):
        self.base, self.cfg = base, cfg
        self.description, self.rope_layout = base.description, base.rope_layout
        self._parts: dict[str, tuple[str, int, int]] = {}  # name -> (fused name, first row, rows)
        self._names = []
        for name in base.names():
            m = self.FUSED.fullmatch(name)
            if m is None:
                self._names.append(name)
                continue
            sizes: tuple[tuple[str, int], ...]
            if m[2] == "self_attn.qkv_proj":
                sizes = (("self_attn.q_proj", cfg.q_size), ("self_attn.k_proj", cfg.kv_size),
                         ("self_attn.v_proj", cfg.kv_size))
            else:
                half = base.shape(name)[0] // 2
                sizes = (("mlp.gate_proj", half), ("mlp.up_proj", half))
            start = 0
            for part, rows in sizes:
                self._parts[f"{m[1]}{part}.{m[3]}"] = (name, start, rows)
                self._names.append(f"{m[1]}{part}.{m[3]}")
                start += rows

    def names(self):
        return list(self._names)

    def shape(self, name):
        if name not in self._parts:
            return self.base.shape(name)
        fused, _, rows = self._parts[name]
        return (rows, *self.base.shape(fused)[1:])

    def load(self, name, dtype=None):
        if name not in self._parts:
            return self.base.load(name, dtype)
        fused, start, rows = self._parts[name]
        return self.base.load(fused, dtype)[start:start + rows].copy()

    def tensor_type(self, name) -> str:
        """A GGUF base's stored type of the tensor (a part's: its fused tensor's)."""
        return self.base.tensor_type(self._parts[name][0] if name in self._parts else name)  # type: ignore[attr-defined]

    def quant_format(self, name):
        return self.base.quant_format(self._parts[name][0] if name in self._parts else name)

    def load_quantized(self, name):
        """A part's blocks: the fused tensor's rows, as stored (a GGUF's Phi-3 keeps its bits)."""
        if name not in self._parts:
            return self.base.load_quantized(name)
        fused, start, rows = self._parts[name]
        q = self.base.load_quantized(fused)
        cut = slice(start, start + rows)
        return dataclasses.replace(q, codes=q.codes[cut], scales=None if q.scales is None else q.scales[cut],
                                   mins=None if q.mins is None else q.mins[cut])

    def tokenizer_files(self):
        return self.base.tokenizer_files()


class NormOffsetSource(WeightSource):
    """Gemma stores each RMSNorm weight as w - 1 and multiplies by (1 + w): seen here as the weight the RMSNorm op
    multiplies by, 1 + w computed in float32 as transformers computes it."""

    def __init__(self, base: WeightSource, offset: float):
        self.base, self.offset = base, offset
        self.description, self.rope_layout = base.description, base.rope_layout

    def names(self):
        return self.base.names()

    def shape(self, name):
        return self.base.shape(name)

    def load(self, name, dtype=None):
        t = self.base.load(name, dtype)
        return t.astype(np.float32) + np.float32(self.offset) if name.endswith("norm.weight") else t

    def tokenizer_files(self):
        return self.base.tokenizer_files()


class WidenedSource(SourceView):
    """Another source whose GGUF super-blocks (Q4_K, Q5_K, Q6_K, IQ4_XS) are seen widened to the blocked form, exactly
    (QuantTensor.widened): what a runtime without a super-block kernel reads (ONNX Runtime's MatMulNBits, ONNX's
    DequantizeLinear, TensorRT)."""

    def __init__(self, base: WeightSource):
        super().__init__(base)
        self._last: tuple[str, QuantTensor] | None = None

    def quant_format(self, name):
        fmt = self.base.quant_format(name)
        return None if fmt is None else fmt.widened

    def load_quantized(self, name):
        if self._last is None or self._last[0] != name:  # codes, scales and mins are asked for one after another
            self._last = (name, self.base.load_quantized(name).widened())
        return self._last[1]


def widened_view(source: WeightSource) -> WeightSource:
    """`source` with its super-blocks widened (a WidenedSource), or itself when it stores none."""
    formats = {source.quant_format(n) for n in source.names()}
    return WidenedSource(source) if any(f is not None and f.superblocks for f in formats) else source


class StackedExperts(WeightSource):
    """A checkpoint's experts, one tensor each (`model.layers.0.mlp.experts.3.gate_proj.weight`; Mixtral's
    `block_sparse_moe.experts.3.w1.weight`, w1/w3/w2 = gate/up/down), seen stacked on a first axis as ops.py's MoE
    takes them (`model.layers.0.mlp.experts.gate_proj.weight` [experts, ffn, hidden]); Mixtral's router
    `block_sparse_moe.gate.weight` as `mlp.gate.weight`."""

    EXPERT = re.compile(r"(model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
    ROUTER = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.gate\.weight")
    MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def __init__(self, base: WeightSource):
        self.base = base
        self.description, self.rope_layout = base.description, base.rope_layout
        self._parts: dict[str, list[str]] = {}  # stacked name -> the experts' names, in expert order
        self._renamed: dict[str, str] = {}  # a router's name here -> its name in the base
        found: dict[str, dict[int, str]] = {}
        self._names = []
        for name in base.names():
            if (m := self.EXPERT.fullmatch(name)) is not None:
                stacked = f"{m[1]}mlp.experts.{self.MIXTRAL.get(m[3], m[3])}.weight"
                found.setdefault(stacked, {})[int(m[2])] = name
            elif (r := self.ROUTER.fullmatch(name)) is not None:
                self._renamed[f"{r[1]}mlp.gate.weight"] = name
                self._names.append(f"{r[1]}mlp.gate.weight")
            else:
                self._names.append(name)
        for stacked, by_index in found.items():
            if sorted(by_index) != list(range(len(by_index))):
                raise WeightError(f"{base.description}: {stacked} has experts {sorted(by_index)}, not 0..n-1; the "
                                  "checkpoint is incomplete")
            self._parts[stacked] = [by_index[i] for i in range(len(by_index))]
            self._names.append(stacked)

    @classmethod
    def applies(cls, source: WeightSource) -> bool:
        return any(cls.EXPERT.fullmatch(n) for n in source.names())

    def names(self):
        return list(self._names)

    def shape(self, name):
        if name in self._parts:
            return (len(self._parts[name]), *self.base.shape(self._parts[name][0]))
        return self.base.shape(self._renamed.get(name, name))

    def load(self, name, dtype=None):
        if name in self._parts:
            return np.stack([self.base.load(part, dtype) for part in self._parts[name]])
        return self.base.load(self._renamed.get(name, name), dtype)

    def load_rows(self, name, start, stop, dtype=None):
        return None if name in self._parts else self.base.load_rows(self._renamed.get(name, name), start, stop, dtype)

    def tokenizer_files(self):
        return self.base.tokenizer_files()


def _as_is(t: np.ndarray) -> np.ndarray:
    return t


def _out_in(t: np.ndarray) -> np.ndarray:
    """[experts, in, out] -> [experts, out, in]"""
    return t.transpose(0, 2, 1)


def _every_other(t: np.ndarray, start: int) -> np.ndarray:
    """gate_up [experts, hidden, 2 ffn] -> gate (start 0) or up (1) as [experts, ffn, hidden]"""
    return t[:, :, start::2].transpose(0, 2, 1)


def _every_other_bias(t: np.ndarray, start: int) -> np.ndarray:
    return t[:, start::2]


class PackedExperts(SourceView):
    """gpt-oss's experts as transformers stores them: `mlp.experts.gate_up_proj` [experts, hidden, 2 * ffn] with gate
    and up columns interleaved (gate 0, up 0, gate 1, ...), its bias [experts, 2 * ffn], `down_proj` [experts, ffn,
    hidden], `mlp.router.weight/bias`: seen as `mlp.experts.{gate,up,down}_proj.weight/bias` [experts, out, in] and
    `mlp.gate.weight/bias`. OpenAI's own release stores the experts in MXFP4 (`*_blocks`, `*_scales`): refused in
    one line naming the converter that keeps those bits."""

    PACKED = re.compile(r"(model\.layers\.\d+\.mlp\.)(experts\.gate_up_proj|experts\.down_proj|router)"
                        r"(_bias|\.weight|\.bias|)")

    def __init__(self, base: WeightSource):
        super().__init__(base)
        self._parts: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {}  # name -> (base name, its view)
        self._names = []
        for name in base.names():
            m = self.PACKED.fullmatch(name)
            if m is None:
                if re.fullmatch(r"model\.layers\.\d+\.mlp\.experts\.\w+_(blocks|scales)", name):
                    raise WeightError(f"{base.description}: {name} is MXFP4 as OpenAI ships gpt-oss; llgraph reads "
                                      "those bits from a GGUF: convert with llama.cpp's convert_hf_to_gguf.py (it "
                                      "keeps MXFP4) and pass the .gguf")
                self._names.append(name)
                continue
            prefix, what, tail = m[1], m[2], m[3]
            bias = tail in ("_bias", ".bias")
            kind = "bias" if bias else "weight"
            if what == "router":
                self._add(f"{prefix}gate.{kind}", name, _as_is)
            elif what == "experts.down_proj":
                self._add(f"{prefix}experts.down_proj.{kind}", name, _as_is if bias else _out_in)
            else:  # gate: the even columns of gate_up, up: the odd ones
                for part, start in (("gate_proj", 0), ("up_proj", 1)):
                    self._add(f"{prefix}experts.{part}.{kind}", name,
                              functools.partial(_every_other_bias if bias else _every_other, start=start))

    def _add(self, name: str, base_name: str, view: Callable[[np.ndarray], np.ndarray]) -> None:
        self._parts[name] = (base_name, view)
        self._names.append(name)

    @classmethod
    def applies(cls, source: WeightSource) -> bool:
        return any(n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_blocks")) for n in source.names())

    def names(self):
        return list(self._names)

    def shape(self, name):
        if name not in self._parts:
            return self.base.shape(name)
        base_name, view = self._parts[name]
        return view(np.broadcast_to(np.uint8(0), self.base.shape(base_name))).shape  # no data touched

    def load(self, name, dtype=None):
        if name not in self._parts:
            return self.base.load(name, dtype)
        base_name, view = self._parts[name]
        return np.ascontiguousarray(view(self.base.load(base_name, dtype)))

    def load_rows(self, name, start, stop, dtype=None):
        return None if name in self._parts else self.base.load_rows(name, start, stop, dtype)
