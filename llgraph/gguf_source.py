"""GGUF checkpoints: gguf's reader (one parse per file per process), llama.cpp's tensor names mapped to HF's, and
`GGUFSource` — tensors dequantized on load (rows at a time), or the blocks of the formats llgraph carries as stored
(llgraph/quant.py). What the metadata says of the model (its config, its end-of-generation tokens) is
llgraph/gguf_config.py's.

Tensors are read as llama.cpp reads them: Phi-3's fused `attn_qkv`/`ffn_up` split by rows (blocks kept), q and k
rows unpermuted where llama.cpp's converter permuted them, Llama 3.1's `rope_freqs.weight` left to the config, a
tied head where `output.weight` is absent."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
from pathlib import Path

import numpy as np

from llgraph.config import ConfigError
from llgraph.grid_superblocks import AS_SUPERBLOCKS, as_superblocks, fits, target_format
from llgraph.op_shapes import EXPERT_FORMATS
from llgraph.quant import GGUF_FORMATS, QuantTensor, from_gguf_blocks
from llgraph.quant_grid import GRID_FORMATS, widen_grid
from llgraph.weights import CARRIED, EXPERTS, WeightError, WeightSource


def stored_rope_layout(arch: str) -> str:
    """The Q/K row order a GGUF stores: llama.cpp's converter permutes q/k rows into interleaved RoPE pairs for its
    llama architecture only; qwen2/qwen3 keep HF's half-split rows."""
    return "interleaved" if arch == "llama" else "half"

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    # a mixture of experts: the router, and the experts stacked [experts, ffn, hidden] as ops.py's MoE takes them
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# where an architecture's names mean other HF tensors: the norms after a sublayer (OLMo 2, Gemma) make llama's
# ffn_norm Gemma's pre-MLP norm; Phi-3 keeps its fused projections
_ARCH_NAMES = {
    "gemma": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"},
    "olmo2": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
}


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    names = {**_GGUF_NAMES, **_ARCH_NAMES.get("gemma" if arch.startswith("gemma") else arch, {})}
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        part = names.get(m[2])
        if part == "self_attn.sinks":  # a parameter of its own in HF, no .weight
            return f"model.layers.{m[1]}.{part}"
        return f"model.layers.{m[1]}.{part}.{m[3]}" if part else gguf_name
    stem, _, kind = gguf_name.rpartition(".")
    return f"{names[stem]}.{kind}" if stem in names else gguf_name


@functools.lru_cache(maxsize=4)
def _gguf_reader(path: str, mtime_ns: int, size: int):
    from gguf.gguf_reader import GGUFReader  # the class itself, whatever shared_gguf_reads put in gguf's namespace

    class Reader(GGUFReader):
        """gguf's reader over a plain ndarray view of its memory map (the same pages, no copy): numpy's memmap
        subclass costs ~2 us per slice in `__array_finalize__`, and the header of a 49k-token vocabulary is ~750k
        slices (SmolLM2's parse: 3.0-3.4 s -> 0.8-1.3 s; fields and tensors equal, tested)."""

        def _get(self, *args, **kwargs):
            data: np.ndarray = self.__dict__["data"]
            if type(data) is np.memmap:
                self.data = data.view(np.ndarray)  # its base is the memmap, which stays open
            return super()._get(*args, **kwargs)

    return Reader(path, "r")


@contextlib.contextmanager
def shared_gguf_reads():
    """Inside the block, `gguf.GGUFReader(path)` is gguf_reader(path): one parse a file, shared. transformers' GGUF
    loader (llgraph convert's, a test's reference) parses a file with gguf's own reader three times — config,
    tokenizer, weights —, ~4 s each for SmolLM2's 49k-token vocabulary. The fields and tensors are gguf's own."""
    import gguf

    original = gguf.GGUFReader

    def shared(path, mode="r"):
        return gguf_reader(path) if mode == "r" else original(path, mode)
    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _why_unreadable(path: Path, size: int, error: Exception) -> str:
    """Why gguf's reader failed, in a user's words: not a GGUF (its magic), ended early, or (otherwise) the
    reader's own first line."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        return f"it does not start with GGUF's magic bytes but {head!r}"
    if isinstance(error, (ValueError, IndexError, EOFError)):  # numpy reading past the end of the file
        return "it ends before its header, metadata and tensors do"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def gguf_reader(path: str | Path):
    """gguf's reader of a GGUF file, parsed once per process for the config, the weights and the tokenizer alike
    (parsing SmolLM2's 49k-token vocabulary takes seconds; it was parsed four times per export)."""
    st = os.stat(path)
    try:
        return _gguf_reader(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
    except OSError:
        raise
    except Exception as e:  # gguf's reader fails on a bad file with whatever numpy or struct raised
        why = "it is empty" if st.st_size == 0 else _why_unreadable(Path(path), st.st_size, e)
        raise WeightError(f"{path} is not a readable GGUF file ({why}; {st.st_size:,} bytes): it is truncated, "
                          "damaged or not a GGUF; download it again, or check the path") from None


# HF weights of one row ([1, n]), which a GGUF may store as [n]
ROW_MATRICES = re.compile(r".*\.mlp\.shared_expert_gate\.weight")


class GGUFSource(WeightSource):
    """A GGUF file, dequantized per tensor with the `gguf` package (F32, F16, Q4_0, Q4_1, Q8_0, K-quants, ...).

    llama.cpp's converter permutes the q/k projection rows so that RoPE pairs are adjacent (interleaved layout).
    By default the rows are kept as stored and the config says rope.layout='interleaved'. `rope_layout='half'`
    undoes the permutation explicitly, for use with an HF-layout config.
    """

    def __init__(self, path: str | Path, rope_layout: str | None = None):
        self.path = Path(path)
        self._recent: dict = {}
        self._fits: dict[str, bool] = {}  # runs_as_superblocks, by tensor
        try:
            self._reader = gguf_reader(self.path)
        except OSError as e:
            raise WeightError(f"cannot read GGUF {self.path}: {e.strerror or e}") from None
        arch = self._reader.fields.get("general.architecture")
        self.arch = arch.contents() if arch is not None else "llama"
        stored = stored_rope_layout(self.arch)
        rope_layout = rope_layout or stored
        if rope_layout not in ("half", "interleaved") or (stored == "half" and rope_layout != "half"):
            raise ValueError(f"rope_layout '{rope_layout}' is not available for GGUF architecture '{self.arch}'")
        self.rope_layout = rope_layout
        self._unpermute = rope_layout != stored
        self.description = f"GGUF {self.path.name}"
        self._tensors = {_hf_name(t.name, self.arch): t for t in self._reader.tensors if t.name not in _NOT_WEIGHTS}
        heads = self._reader.fields.get(f"{self.arch}.attention.head_count")
        kv = self._reader.fields.get(f"{self.arch}.attention.head_count_kv")
        self._heads = int(heads.contents()) if heads else 0
        self._kv_heads = int(kv.contents()) if kv else self._heads
        if self._unpermute and not self._heads:
            raise ConfigError(f"{self.path.name} lacks {self.arch}.attention.head_count, which unpermuting its q and k "
                              "needs; fix the file's metadata, or keep the stored rope_layout")

    def names(self):
        return list(self._tensors)

    def shape(self, name):
        shape = tuple(int(d) for d in reversed(self._tensors[name].shape))  # ggml lists the fastest dim first
        if len(shape) == 1 and ROW_MATRICES.fullmatch(name):  # llama.cpp writes [1, n] as [n] (ggml_n_dims drops
            return (1, *shape)  # trailing dims of 1: llama-quantize's Qwen2-MoE files): the same one row
        return shape

    def tensor_type(self, name) -> str:
        return self._tensors[name].tensor_type.name

    def stored_bytes(self, name) -> int:
        """The tensor's bytes in the file (its blocks, as stored)."""
        return int(self._tensors[name].n_bytes)

    def quant_format(self, name):
        kind = self.tensor_type(name)
        fmt = target_format(kind) if self.runs_as_superblocks(name) else \
            GGUF_FORMATS.get(kind) or GRID_FORMATS.get(kind)
        if EXPERTS.fullmatch(name):  # stacked experts: their super-blocks (QMoE); other blocks are read widened
            return fmt if fmt is not None and fmt.format in EXPERT_FORMATS else None
        return fmt if CARRIED.fullmatch(name) else None

    def runs_as_superblocks(self, name) -> bool:
        """Whether the tensor's grid blocks run as the super-block type whose weights they are (grid_superblocks'
        AS_SUPERBLOCKS; decided once a tensor, from its scales)."""
        if self.tensor_type(name) not in AS_SUPERBLOCKS:
            return False
        if name not in self._fits:
            self._fits[name] = fits(np.asarray(self._tensors[name].data), self.tensor_type(name))
        return self._fits[name]

    def load_quantized(self, name):
        """A tensor's blocks; the last few are kept, as an export reads codes, scales and mins one after another."""
        if name not in self._recent:
            self._recent[name] = self._read_quantized(name)
            while len(self._recent) > 3:
                self._recent.pop(next(iter(self._recent)))
        return self._recent[name]

    def _read_quantized(self, name):
        t = self._tensors[name]
        if self.quant_format(name) is None:
            return super().load_quantized(name)
        raw = np.fromfile(self.path, dtype=np.uint8, count=t.n_bytes, offset=t.data_offset)
        kind = t.tensor_type.name
        fmt = self.quant_format(name)
        if self.runs_as_superblocks(name):  # IQ3_XXS as Q6_K (exponent -1), IQ3_S as Q5_K
            raw, kind = as_superblocks(raw, kind), AS_SUPERBLOCKS[kind]
        q = (widen_grid if kind in GRID_FORMATS else from_gguf_blocks)(raw, kind, self.shape(name))
        q = QuantTensor(q.codes, q.scales, q.mins, fmt) if fmt.exponent else q
        if self._unpermute and (m := re.search(r"self_attn\.([qk])_proj", name)):
            heads = self._heads if m[1] == "q" else self._kv_heads
            def half(a):
                return None if a is None else interleaved_to_half(a, heads)
            q = QuantTensor(half(q.codes), half(q.scales), half(q.mins), q.fmt)
        return q

    def load(self, name, dtype=None):
        shape = self.shape(name)
        out = np.empty(shape, np.float32)
        rows = out.reshape(-1, shape[-1])
        step = max(1, (16 << 20) // (4 * shape[-1]))  # dequantize ~16 MB of rows at a time: bounded temporaries
        for i in range(0, rows.shape[0], step):
            rows[i:i + step] = self._rows(name, i, min(rows.shape[0], i + step))
        if self._unpermute and (m := re.search(r"self_attn\.([qk])_proj", name)):
            out = interleaved_to_half(out, self._heads if m[1] == "q" else self._kv_heads)
        return np.ascontiguousarray(out)

    def load_rows(self, name, start, stop, dtype=None):
        if len(self.shape(name)) != 2 or (self._unpermute and re.search(r"self_attn\.[qk]_proj", name)):
            return None  # unpermuting q/k moves rows between heads
        return self._rows(name, start, stop)

    def _rows(self, name, start, stop) -> np.ndarray:
        """Rows [start, stop) dequantized to float32 (a row is whole blocks). The bytes are read rather than touched
        through the reader's memory map, whose pages would stay resident (see SafetensorsSource)."""
        from gguf.quants import dequantize

        t, cols = self._tensors[name], self.shape(name)[-1]
        row_bytes = t.n_bytes // (math.prod(self.shape(name)) // cols)
        raw = np.fromfile(self.path, dtype=np.uint8, count=(stop - start) * row_bytes,
                          offset=t.data_offset + start * row_bytes)
        try:
            return dequantize(raw.view(t.data.dtype).reshape(stop - start, -1), t.tensor_type).reshape(-1, cols)
        except NotImplementedError:
            raise WeightError(f"{name} is stored as GGUF {t.tensor_type.name}, a block type neither llgraph nor gguf "
                              f"{_gguf_version()} reads yet; a newer gguf (pip install -U gguf) may, else convert "
                              "the model to another type with llama-quantize") from None


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def interleaved_to_half(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows from RoPE pairs (2i, 2i+1) to pairs (i, i + d/2), per head."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NOT_WEIGHTS = {"rope_freqs.weight"}  # Llama 3.1's RoPE factors: read into the config, not a graph weight
def metadata(reader, key: str, default=None):
    """A GGUF metadata field's value (a Python scalar, string or list), or `default` where the file has none."""
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v.item() if hasattr(v, "item") else v
