"""Weight sources that are views over another source: what a checkpoint holds, seen as the graph wants it.

- `QuantizedSource`: the decoder-layer Linears rounded to nearest (`--quantize int4|int8`).
- `FusedSplitSource`: Phi-3's fused `qkv_proj` / `gate_up_proj` under the Llama names.
- `NormOffsetSource`: Gemma's RMSNorm weights stored as w - 1, seen as 1 + w.
"""

from __future__ import annotations

import re

import torch

from llgraph.config import LlamaConfig
from llgraph.quant import QuantFormat, QuantTensor, dequantize, quantize_rtn
from llgraph.weights import _QUANTIZABLE, WeightError, WeightSource


class QuantizedSource(WeightSource):
    """Another source with its decoder-layer Linear weights quantized by round-to-nearest (`llgraph export
    --quantize int4|int8`); `load` returns the dequantized values, so every backend sees the same weights."""

    def __init__(self, base: WeightSource, bits: int, block_size: int = 32, symmetric: bool = False):
        self.base, self.bits, self.block_size, self.symmetric = base, bits, block_size, symmetric
        self.description = f"{base.description}, RTN int{bits} (block {block_size}, " \
                           f"{'symmetric' if symmetric else 'asymmetric'})"
        self.rope_layout = base.rope_layout
        self._last: tuple[str, QuantTensor] | None = None

    def names(self):
        return self.base.names()

    def shape(self, name):
        return self.base.shape(name)

    def tokenizer_files(self):
        return self.base.tokenizer_files()

    def quant_format(self, name):
        if not _QUANTIZABLE.fullmatch(name):
            return self.base.quant_format(name)
        fmt = QuantFormat(self.bits, self.block_size, 1 << (self.bits - 1) if self.symmetric else 0,
                          not self.symmetric)
        if self.shape(name)[-1] % self.block_size:
            raise WeightError(f"--block-size {self.block_size} does not divide the input features of {name} "
                              f"({self.shape(name)[-1]}); choose a block size that does (32 divides most)")
        return fmt

    def load_quantized(self, name):
        if not _QUANTIZABLE.fullmatch(name):
            return self.base.load_quantized(name)
        if self._last is None or self._last[0] != name:  # codes, scales and mins are asked for one after another
            self._last = (name, quantize_rtn(self.base.load(name, torch.float32).float(), self.bits,
                                             self.block_size, self.symmetric))
        return self._last[1]

    def load_rows(self, name, start, stop, dtype=None):
        return self.base.load_rows(name, start, stop, dtype) if self.quant_format(name) is None else None

    def load(self, name, dtype=None):
        if self.quant_format(name) is None:
            return self.base.load(name, dtype)
        q = self.load_quantized(name)
        return dequantize(q.codes, q.scales, q.mins, q.fmt.bits, q.fmt.zero_point, torch.float32)


# what round-to-nearest quantizes: the Linears inside decoder layers (the embedding and lm head stay float)


class FusedSplitSource(WeightSource):
    """A checkpoint with fused projections (Phi-3's `qkv_proj` = [q; k; v] rows and `gate_up_proj` = [gate; up]
    rows) seen under the Llama names, each part a row slice of its fused tensor (the QKV and gate/up packing passes
    then pack them again for the backends that want them packed)."""

    _FUSED = re.compile(r"(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)")

    def __init__(self, base: WeightSource, cfg: LlamaConfig):
        self.base, self.cfg = base, cfg
        self.description, self.rope_layout = base.description, base.rope_layout
        self._parts: dict[str, tuple[str, int, int]] = {}  # name -> (fused name, first row, rows)
        self._names = []
        for name in base.names():
            m = self._FUSED.fullmatch(name)
            if m is None:
                self._names.append(name)
                continue
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
        return self.base.load(fused, dtype)[start:start + rows].clone()

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
        return t.float() + self.offset if name.endswith("norm.weight") else t

    def tokenizer_files(self):
        return self.base.tokenizer_files()
