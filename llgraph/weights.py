"""Weight sources, lazy per tensor: HF safetensors (single or sharded, memory-mapped), GGUF (dequantized on
load, or its blocks as stored: llgraph/gguf_source.py), and seeded random weights (each tensor reproducible on its
own, so an 8B model can be streamed).

Every source speaks HF tensor names. `check_weights(graph, source)` compares the checkpoint with what the graph
needs and raises one WeightError listing every missing, unexpected and mis-shaped tensor.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from llgraph.errors import LlgraphError
from llgraph.ir import Graph, Param
from llgraph.quant import QuantFormat, QuantTensor

# numpy is the tensor library of weights and exports (torch is the executor's alone); ml_dtypes gives numpy a
# bfloat16 that rounds as torch's does (to nearest even)
DTYPES = {"float64": np.dtype(np.float64), "float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16)}
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

    def load(self, name: str, dtype: np.dtype | None = None) -> np.ndarray:
        """The tensor as a float numpy array: its stored float dtype (float32 after dequantization). `dtype` is a
        hint a source may use to avoid a full-size intermediate; the caller still casts."""
        raise NotImplementedError

    def load_rows(self, name: str, start: int, stop: int, dtype: np.dtype | None = None) -> np.ndarray | None:
        """Rows [start, stop) of a 2-D float tensor, read without loading the rest, as `load` would give them; None
        where this source cannot (the exporter then loads the tensor whole)."""
        return None

    def tokenizer_files(self) -> list[Path]:
        return []

    def quant_format(self, name: str) -> QuantFormat | None:
        """The blocked integer format `name` is stored in (llgraph/quant.py), or None for a float tensor."""
        return None

    def load_quantized(self, name: str) -> QuantTensor:
        """The tensor in its blocked form, as stored (no rounding); only for names with a `quant_format`."""
        raise WeightError(f"{self.description}: {name} is not stored quantized")


class SourceView(WeightSource):
    """Another source seen as it is: a view (llgraph/source_views.py, llgraph/lora.py) overrides only what it
    changes."""

    def __init__(self, base: WeightSource):
        self.base, self.description, self.rope_layout = base, base.description, base.rope_layout

    def names(self):
        return self.base.names()

    def shape(self, name):
        return self.base.shape(name)

    def load(self, name, dtype=None):
        return self.base.load(name, dtype)

    def load_rows(self, name, start, stop, dtype=None):
        return self.base.load_rows(name, start, stop, dtype)

    def tokenizer_files(self):
        return self.base.tokenizer_files()

    def quant_format(self, name):
        return self.base.quant_format(name)

    def load_quantized(self, name):
        return self.base.load_quantized(name)


QUANTIZABLE = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")
# what a GGUF's blocks are carried for: those Linears and the lm head (its own tensor, or the tied embedding's; the
# embedding's gather reads a float copy of the same tensor)
CARRIED = re.compile(rf"{QUANTIZABLE.pattern}|lm_head\.weight|model\.embed_tokens\.weight")
# a mixture's stacked experts [experts, out, in] (llgraph/source_views.StackedExperts; a GGUF's *_exps): carried in
# GGUF's super-blocks (ops.py's QMoE)
EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate|up|down)_proj\.weight")


_ST_DTYPES = {"F64": DTYPES["float64"], "F32": DTYPES["float32"], "F16": DTYPES["float16"], "BF16": DTYPES["bfloat16"]}


class SafetensorsSource(WeightSource):
    """HF safetensors, one file or sharded with model.safetensors.index.json.

    Tensors are read with plain file reads at the header's offsets rather than through a memory map: mapped pages
    stay resident in the process as they are touched, which would make exporting an N GB checkpoint cost N GB of
    RSS. The format (8-byte little-endian header length, JSON header, raw bytes) is read here; writing it is left
    to the `safetensors` package."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.rope_layout = "half"
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.exists():
                files = sorted({path / f for f in _read_json(index)["weight_map"].values()})
            else:
                files = sorted(path.glob("*.safetensors"))
                if not files:
                    raise WeightError(f"{path} holds no *.safetensors file; pass an HF checkpoint folder or a .gguf")
            self.folder = path
        else:
            files, self.folder = [path], path.parent
        self.description = f"safetensors {path}"
        self._entries: dict[str, tuple[Path, int, np.dtype, tuple[int, ...]]] = {}
        for f in files:
            if not f.exists():
                raise WeightError(f"shard {f} named in the index is missing; re-download the checkpoint")
            self._entries.update(_safetensors_header(f))

    def names(self):
        return list(self._entries)

    def shape(self, name):
        return self._entries[name][3]

    def load(self, name, dtype=None):
        return self._read(name, 0, self._entries[name][3][0] if self._entries[name][3] else 1)

    def load_rows(self, name, start, stop, dtype=None):
        return self._read(name, start, stop) if len(self._entries[name][3]) == 2 else None

    def _read(self, name, start, stop):
        path, offset, st_dtype, shape = self._entries[name]
        out = np.empty((stop - start, *shape[1:]) if shape else shape, dtype=st_dtype)
        row_bytes = out[0].nbytes if shape else 0
        with open(path, "rb") as f:
            f.seek(offset + start * row_bytes)
            if f.readinto(out.reshape(-1).view(np.uint8).data) != out.nbytes:
                raise WeightError(f"{path} ends inside tensor {name}; the file is truncated, re-download it")
        return out

    def tokenizer_files(self):
        names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                 "chat_template.jinja")
        return [self.folder / n for n in names if (self.folder / n).exists()]


def _safetensors_header(path: Path) -> dict:
    """name -> (file, absolute byte offset, dtype, shape) from a safetensors header."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= 100 << 20:
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
        size = path.stat().st_size
        entries = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            if e["dtype"] not in _ST_DTYPES:
                raise WeightError(f"{path}: tensor {name} has dtype {e['dtype']}; llgraph reads F64/F32/F16/BF16")
            begin, end = e["data_offsets"]
            if not 0 <= begin <= end <= size - 8 - n:
                raise ValueError(f"tensor {name} lies outside the file")
            entries[name] = (path, 8 + n + begin, _ST_DTYPES[e["dtype"]], tuple(e["shape"]))
        return entries
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise WeightError(f"cannot read {path}: {e}; the file is not a valid safetensors file") from None


class RandomSource(WeightSource):
    """Seeded random weights; tensor `name` depends only on (seed, name), so tensors can be drawn in any order.
    Linear weights ~ N(0, std), norm weights ~ 1 + N(0, std), biases ~ N(0, std). Values are drawn in float32
    chunks, each from its own generator (so any rows can be drawn alone), and rounded into `dtype`: a float16 draw
    equals the float32 one rounded, with no float32 copy."""

    CHUNK = 1 << 22

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int = 0, std: float = 0.02):
        """`shapes`: every tensor's HF name and shape (param_shapes(graph) of the graph it is drawn for)."""
        self.description = f"random weights (seed {seed})"
        self.seed, self.std = seed, std
        self._shapes = dict(shapes)

    def names(self):
        return list(self._shapes)

    def shape(self, name):
        return self._shapes[name]

    def load(self, name, dtype=None):
        shape = self._shapes[name]
        return self._draw(name, 0, math.prod(shape), dtype).reshape(shape)

    def load_rows(self, name, start, stop, dtype=None):
        shape = self._shapes[name]
        if len(shape) != 2:
            return None
        return self._draw(name, start * shape[1], stop * shape[1], dtype).reshape(stop - start, shape[1])

    def _draw(self, name, begin, end, dtype):
        """Flat elements [begin, end) of tensor `name`: chunk k of CHUNK elements is drawn from a generator seeded by
        (seed, name, k) — chunk 0 by (seed, name) alone, so a tensor of one chunk draws what it always drew."""
        out = np.empty(end - begin, dtype=dtype or np.float32)
        seed, offset = self.seed * 1_000_003 + zlib.crc32(name.encode()), 1.0 if "norm" in name else 0.0
        for k in range(begin // self.CHUNK, -(-end // self.CHUNK)):
            lo, hi = max(begin, k * self.CHUNK), min(end, (k + 1) * self.CHUNK)
            g = np.random.default_rng(seed * 65_537 + k if k else seed)
            n = min(self.CHUNK, math.prod(self._shapes[name]) - k * self.CHUNK)
            drawn = g.standard_normal(n, dtype=np.float32)[lo - k * self.CHUNK:hi - k * self.CHUNK]
            out[lo - begin:hi - begin] = drawn * np.float32(self.std) + np.float32(offset)
        return out


def param_shapes(graph: Graph) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors a graph reads: HF name -> shape."""
    return {part.name: tuple(int(d) for d in part.shape) for p in graph.params.values() for part in p.parts}


def check_weights(graph: Graph, source: WeightSource) -> None:
    """One WeightError naming every missing, unexpected and mis-shaped tensor, and a RoPE layout mismatch."""
    cfg = json.loads(graph.metadata["config"])
    expected = param_shapes(graph)
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


def load_param(param: Param, source: WeightSource) -> np.ndarray:
    """The parameter's tensor in its graph dtype: its constant, its checkpoint tensor, or its parts concatenated
    along axis 0 (a packed param)."""
    if param.component is not None:  # a piece of the blocked form: codes stay uint8, scales/mins take the dtype
        pieces = []
        for p in param.parts:
            t = source.load_quantized(p.name).component(param.component)
            if t is None:
                raise ValueError(f"{p.name} is stored without {param.component}, which {param.name} reads")
            pieces.append(t if param.component == "codes" else t.astype(DTYPES[param.value.dtype]))
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)
    dtype = DTYPES[param.value.dtype]
    if param.is_constant:
        return np.asarray(param.constant).astype(dtype)
    tensors = [source.load(p.name, dtype).astype(dtype, copy=False) for p in param.parts]
    return tensors[0] if len(tensors) == 1 else np.concatenate(tensors, axis=0)


def iter_params(graph: Graph, source: WeightSource, progress: bool = False
                ) -> Iterator[tuple[str, np.ndarray]]:
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
