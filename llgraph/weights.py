"""Weight sources, lazy per tensor: HF safetensors (single or sharded, memory-mapped), GGUF (dequantized on
load), and seeded random weights (each tensor reproducible on its own, so an 8B model can be streamed).

Every source speaks HF tensor names. `check_weights(graph, source)` compares the checkpoint with what the graph
needs and raises one WeightError listing every missing, unexpected and mis-shaped tensor.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from llgraph.config import LlamaConfig
from llgraph.errors import LlgraphError
from llgraph.ir import Graph, Param

TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}
# Tensors some checkpoints carry that no Llama graph reads: HF's old rotary buffers.
_IGNORABLE = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


class WeightError(LlgraphError):
    """A checkpoint that does not fit the config; the message lists every problem."""


class WeightSource:
    """Lazy tensors by HF name. `rope_layout` is the Q/K row order the checkpoint stores ("half" for HF,
    "interleaved" for GGUF/Meta), None when any layout fits (random weights)."""

    description = "weights"
    rope_layout: str | None = None

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def load(self, name: str) -> torch.Tensor:
        """The tensor as a CPU float tensor (its stored float dtype, or float32 after dequantization)."""
        raise NotImplementedError

    def tokenizer_files(self) -> list[Path]:
        return []


class SafetensorsSource(WeightSource):
    def __init__(self, path: str | Path):
        from safetensors import safe_open

        path = Path(path)
        self.rope_layout = "half"
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.exists():
                weight_map = _read_json(index)["weight_map"]
                files = {f: path / f for f in set(weight_map.values())}
            else:
                files = {p.name: p for p in sorted(path.glob("*.safetensors"))}
                if not files:
                    raise WeightError(f"{path} holds no *.safetensors file; pass an HF checkpoint folder or a .gguf")
                weight_map = None
            self.folder = path
        else:
            files, weight_map, self.folder = {path.name: path}, None, path.parent
        self.description = f"safetensors {path}"
        self._handles = {}
        for f, p in files.items():
            if not p.exists():
                raise WeightError(f"shard {p} named in the index is missing; re-download the checkpoint")
            try:
                self._handles[f] = safe_open(str(p), framework="pt")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise WeightError(f"cannot read {p}: {e}; the file is not a valid safetensors file") from None
        if weight_map is None:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}
        self._where = weight_map

    def names(self):
        return list(self._where)

    def shape(self, name):
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def load(self, name):
        return self._handles[self._where[name]].get_tensor(name)

    def tokenizer_files(self):
        names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
        return [self.folder / n for n in names if (self.folder / n).exists()]


_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        part = _GGUF_NAMES.get(m[2])
        return f"model.layers.{m[1]}.{part}.{m[3]}" if part else gguf_name
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_GGUF_NAMES[stem]}.{kind}" if stem in _GGUF_NAMES else gguf_name


class GGUFSource(WeightSource):
    """A GGUF file, dequantized per tensor with the `gguf` package (F32, F16, Q4_0, Q4_1, Q8_0, K-quants, ...).

    llama.cpp's converter permutes the q/k projection rows so that RoPE pairs are adjacent (interleaved layout).
    By default the rows are kept as stored and the config says rope.layout='interleaved'. `rope_layout='half'`
    undoes the permutation explicitly, for use with an HF-layout config.
    """

    def __init__(self, path: str | Path, rope_layout: str = "interleaved"):
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self._reader = GGUFReader(str(self.path), "r")
        except (OSError, ValueError) as e:
            raise WeightError(f"cannot read GGUF {self.path}: {e}") from None
        if rope_layout not in ("half", "interleaved"):
            raise ValueError(f"rope_layout '{rope_layout}' must be 'half' or 'interleaved'")
        self.rope_layout = rope_layout
        self.description = f"GGUF {self.path.name}"
        self._tensors = {_hf_name(t.name): t for t in self._reader.tensors}
        heads = self._reader.fields.get("llama.attention.head_count")
        kv = self._reader.fields.get("llama.attention.head_count_kv")
        self._heads = int(heads.contents()) if heads else None
        self._kv_heads = int(kv.contents()) if kv else self._heads

    def names(self):
        return list(self._tensors)

    def shape(self, name):
        return tuple(int(d) for d in reversed(self._tensors[name].shape))  # ggml lists the fastest dim first

    def load(self, name):
        from gguf.quants import dequantize

        t = self._tensors[name]
        data = dequantize(t.data, t.tensor_type).reshape(self.shape(name))
        if self.rope_layout == "half" and (m := re.search(r"self_attn\.([qk])_proj", name)):
            data = interleaved_to_half(data, self._heads if m[1] == "q" else self._kv_heads)
        return torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy, not a view of the mmap


def interleaved_to_half(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows from RoPE pairs (2i, 2i+1) to pairs (i, i + d/2), per head."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class RandomSource(WeightSource):
    """Seeded random weights; tensor `name` depends only on (seed, name), so tensors can be drawn in any order.
    Linear weights ~ N(0, std), norm weights ~ 1 + N(0, std), biases ~ N(0, std)."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0, std: float = 0.02):
        from llgraph.builder import build_graph

        self.description = f"random weights (seed {seed})"
        self.seed, self.std = seed, std
        graph = build_graph(cfg)
        self._shapes = {part.name: part.shape for p in graph.params.values() for part in p.parts}

    def names(self):
        return list(self._shapes)

    def shape(self, name):
        return self._shapes[name]

    def load(self, name):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        t = torch.randn(self._shapes[name], generator=g) * self.std
        return t + 1.0 if "norm" in name else t


def open_checkpoint(path: str | Path | None, cfg: LlamaConfig | None = None, seed: int = 0) -> WeightSource:
    """A source for a checkpoint folder / safetensors file / GGUF file, or random weights when path is None."""
    if path is None:
        if cfg is None:
            raise ValueError("random weights need a config")
        return RandomSource(cfg, seed)
    p = Path(path)
    if not p.exists():
        raise WeightError(f"checkpoint {p} does not exist; pass an HF folder, a .safetensors or a .gguf file")
    if p.suffix == ".gguf":
        return GGUFSource(p)
    if p.is_dir() or p.suffix == ".safetensors":
        return SafetensorsSource(p)
    raise WeightError(f"checkpoint {p} is neither a folder, a .safetensors nor a .gguf file")


def check_weights(graph: Graph, source: WeightSource) -> None:
    """One WeightError naming every missing, unexpected and mis-shaped tensor, and a RoPE layout mismatch."""
    cfg = json.loads(graph.metadata["config"])
    expected = {part.name: part.shape for p in graph.params.values() for part in p.parts}
    available = set(source.names())
    missing = sorted(set(expected) - available)
    unexpected = sorted(n for n in available - set(expected)
                        if not _IGNORABLE.fullmatch(n) and not (n == "lm_head.weight" and cfg["tie_word_embeddings"]))
    misshaped = [f"{n} {source.shape(n)} (config needs {expected[n]})"
                 for n in sorted(set(expected) & available) if tuple(source.shape(n)) != tuple(expected[n])]
    problems = []
    if missing:
        problems.append(f"missing {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected {_few(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped {_few(misshaped)}")
    layout = cfg["rope"]["layout"]
    if source.rope_layout not in (None, layout):
        problems.append(f"it stores Q/K rows for rope layout '{source.rope_layout}' but the config says '{layout}'")
    if problems:
        raise WeightError(f"{source.description} does not fit config '{cfg['name']}': " + "; ".join(problems)
                          + " — use the config that belongs to this checkpoint")


def _few(items: list[str], n: int = 8) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def load_param(param: Param, source: WeightSource) -> torch.Tensor:
    """The parameter's tensor in its graph dtype: its constant, its checkpoint tensor, or its parts concatenated
    along axis 0 (a packed param)."""
    if param.is_constant:
        t = torch.from_numpy(np.asarray(param.constant))
    else:
        tensors = [source.load(p.name) for p in param.parts]
        t = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
    return t.to(TORCH_DTYPES[param.value.dtype])


def iter_params(graph: Graph, source: WeightSource, progress: bool = False
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """Checks the source once, then yields (name, tensor) one parameter at a time."""
    from tqdm import tqdm

    check_weights(graph, source)
    items = tqdm(graph.params.items(), desc=f"loading {source.description}", unit="tensor", disable=not progress)
    for name, p in items:
        yield name, load_param(p, source)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise WeightError(f"cannot read {path}: {e}") from None
