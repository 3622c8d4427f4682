"""GGUF checkpoints: gguf's reader (one parse per file per process), llama.cpp's tensor names mapped to HF's, and
`GGUFSource` — tensors dequantized on load (rows at a time), or the blocks of the formats llgraph carries as stored
(llgraph/quant.py)."""

from __future__ import annotations

import functools
import math
import os
import re
from pathlib import Path

import numpy as np

from llgraph.config import ConfigError, LlamaConfig, RopeConfig
from llgraph.quant import GGUF_FORMATS, QuantTensor, from_gguf_blocks
from llgraph.weights import CARRIED, WeightError, WeightSource

GGUF_ARCHS = ("llama", "qwen2", "qwen3")  # general.architecture values read (Mistral GGUFs are 'llama')


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
}


def _hf_name(gguf_name: str) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        part = _GGUF_NAMES.get(m[2])
        return f"model.layers.{m[1]}.{part}.{m[3]}" if part else gguf_name
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_GGUF_NAMES[stem]}.{kind}" if stem in _GGUF_NAMES else gguf_name


@functools.lru_cache(maxsize=4)
def _gguf_reader(path: str, mtime_ns: int, size: int):
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """gguf's reader over a plain ndarray view of its memory map (the same pages, no copy): numpy's memmap
        subclass costs ~2 us per slice in `__array_finalize__`, and the header of a 49k-token vocabulary is ~750k
        slices (SmolLM2's parse: 3.0-3.4 s -> 0.8-1.3 s; fields and tensors equal, tested)."""

        def _get(self, *args, **kwargs):
            if type(self.data) is np.memmap:
                self.data = self.data.view(np.ndarray)  # its base is the memmap, which stays open
            return super()._get(*args, **kwargs)

    return Reader(path, "r")


def gguf_reader(path: str | Path):
    """gguf's reader of a GGUF file, parsed once per process for the config, the weights and the tokenizer alike
    (parsing SmolLM2's 49k-token vocabulary takes seconds; it was parsed four times per export)."""
    st = os.stat(path)
    try:
        return _gguf_reader(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
    except OSError:
        raise
    except Exception as e:  # gguf's reader fails on a bad file with whatever numpy or struct raised
        why = "it is empty" if st.st_size == 0 else f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        raise WeightError(f"{path} is not a readable GGUF file ({why}; {st.st_size:,} bytes): it is truncated, "
                          "damaged or not a GGUF; download it again, or check the path") from None


class GGUFSource(WeightSource):
    """A GGUF file, dequantized per tensor with the `gguf` package (F32, F16, Q4_0, Q4_1, Q8_0, K-quants, ...).

    llama.cpp's converter permutes the q/k projection rows so that RoPE pairs are adjacent (interleaved layout).
    By default the rows are kept as stored and the config says rope.layout='interleaved'. `rope_layout='half'`
    undoes the permutation explicitly, for use with an HF-layout config.
    """

    def __init__(self, path: str | Path, rope_layout: str | None = None):
        self.path = Path(path)
        self._recent: dict = {}
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
        self._tensors = {_hf_name(t.name): t for t in self._reader.tensors}
        heads = self._reader.fields.get(f"{self.arch}.attention.head_count")
        kv = self._reader.fields.get(f"{self.arch}.attention.head_count_kv")
        self._heads = int(heads.contents()) if heads else None
        self._kv_heads = int(kv.contents()) if kv else self._heads

    def names(self):
        return list(self._tensors)

    def shape(self, name):
        return tuple(int(d) for d in reversed(self._tensors[name].shape))  # ggml lists the fastest dim first

    def tensor_type(self, name) -> str:
        return self._tensors[name].tensor_type.name

    def quant_format(self, name):
        return GGUF_FORMATS.get(self.tensor_type(name)) if CARRIED.fullmatch(name) else None

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
        q = from_gguf_blocks(raw, t.tensor_type.name, self.shape(name))
        if self._unpermute and (m := re.search(r"self_attn\.([qk])_proj", name)):
            heads = self._heads if m[1] == "q" else self._kv_heads
            q = QuantTensor(*(None if a is None else interleaved_to_half(a, heads)
                              for a in (q.codes, q.scales, q.mins)), q.fmt)
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
        return dequantize(raw.view(t.data.dtype).reshape(stop - start, -1), t.tensor_type).reshape(-1, cols)


def interleaved_to_half(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows from RoPE pairs (2i, 2i+1) to pairs (i, i + d/2), per head."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(path: str | Path) -> LlamaConfig:
    """Config from a GGUF file's metadata; rope.layout is the layout its rows are stored in (stored_rope_layout)."""
    r = gguf_reader(path)
    arch = _value(r, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ConfigError(f"GGUF architecture '{arch}' is not supported; llgraph reads {', '.join(GGUF_ARCHS)} GGUF "
                          "files (and the other families from their HF folders)")

    def get(key, default=None):
        v = _value(r, f"{arch}.{key}")
        return default if v is None else v

    n_head = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = r.fields.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens.data) if tokens is not None else None)
    tensor_names = {t.name for t in r.tensors}
    scaling = get("rope.scaling.type", "none")
    rope = dict(theta=float(get("rope.freq_base", 10000.0)), layout=stored_rope_layout(arch),
                rotary_dim=get("rope.dimension_count"))
    if scaling == "linear":
        rope.update(type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling == "yarn":
        rope.update(type="yarn", factor=float(get("rope.scaling.factor")),
                    original_max_position_embeddings=get("rope.scaling.original_context_length"))
    elif scaling not in ("none", None):
        raise ConfigError(f"GGUF rope.scaling.type '{scaling}' is not supported")
    from llgraph.gguf_tokenizer import end_of_generation
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"), num_heads=n_head, num_kv_heads=get("attention.head_count_kv", n_head),
        head_dim=get("attention.key_length") or hidden // n_head,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope=RopeConfig(**{k: v for k, v in rope.items() if v is not None}),
        bos_token_id=_value(r, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=end_of_generation(r),  # eos, eot, eom and the end-of-turn tokens llama.cpp stops on
        name=_value(r, "general.name") or "gguf",
        family="llama" if arch == "llama" else arch,
        attention_bias=any(n.endswith("attn_q.bias") for n in tensor_names),
        attention_out_bias=any(n.endswith("attn_output.bias") for n in tensor_names),
        qk_norm="head" if any(n.endswith("attn_q_norm.weight") for n in tensor_names) else "none",
        sliding_window=get("attention.sliding_window"),
    )


def _value(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    v = f.contents()
    return v.item() if hasattr(v, "item") else v
