"""Where a model comes from, behind one entry point: its config (llgraph's JSON, a bundled preset, an HF
config.json or folder, a GGUF header) and its weights (safetensors, GGUF, or seeded random), seen as a weight
request asks, with the graph every backend runs.

    model = open_model("smollm2", "smollm2", Weights())     # -> Model(config, source, graph)

Export, the runners, the CLI, diff, serve and the lm-eval adapter all start here.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llgraph.bundled import resolve
from llgraph.config import ConfigError, LlamaConfig, from_fields
from llgraph.errors import ExportError
from llgraph.weight_request import Weights

if TYPE_CHECKING:  # the weight readers (and torch) load when weights are opened, not when a config is read
    from llgraph.ir import Graph
    from llgraph.weights import RandomSource, WeightSource

PRESET_DIR = Path(__file__).parent / "configs"


# -- configs ---------------------------------------------------------------------------------------------------------

def load_config(ref: str | Path | dict | LlamaConfig) -> LlamaConfig:
    """A LlamaConfig from a dict, a JSON path, a GGUF path, a checkpoint folder, an llgraph export folder, a bundled
    model's name ('smollm2': its checkpoint's) or a bundled preset name."""
    if isinstance(ref, LlamaConfig):
        return ref
    if isinstance(ref, dict):
        return from_dict(ref)
    path = Path(resolve(str(ref)))
    if not path.exists():
        path = _preset_path(str(ref))
    if path.is_dir():
        from llgraph.export_folder import Manifest

        manifest = Manifest.find(path)
        if manifest is not None:  # an export folder: the config it was exported with
            return manifest.config
        path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"{ref} is a folder with neither config.json nor an llgraph export's manifest.json; "
                              "give a checkpoint (an HF folder, a .gguf file), an export folder or 'smollm2'")
    if path.suffix == ".gguf":
        from llgraph.gguf_config import gguf_config
        from llgraph.gguf_source import gguf_reader
        from llgraph.gguf_tokenizer import check

        config = gguf_config(path)
        check(gguf_reader(path))  # a tokenizer llgraph cannot build is refused here, before anything is exported
        return config
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    except json.JSONDecodeError as e:
        if path.suffix != ".json":  # not meant as a config at all (`--checkpoint README.md`)
            raise ConfigError(f"{ref} is neither a config (JSON) nor a checkpoint; give an HF folder, a .safetensors "
                              "or .gguf file, or 'smollm2'") from None
        raise ConfigError(f"config {path} is not valid JSON (line {e.lineno}: {e.msg}); fix the file") from None
    return from_dict(data)


def from_dict(data: dict) -> LlamaConfig:
    """llgraph's own JSON (the fields of LlamaConfig), or an HF config.json when it looks like one."""
    if isinstance(data, dict) and ("num_attention_heads" in data or "model_type" in data):
        from llgraph.hf_config import from_hf_dict

        return from_hf_dict(data)
    return from_fields(LlamaConfig, data)


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def _preset_path(name: str) -> Path:
    stem = name[:-5] if name.endswith(".json") else name
    p = PRESET_DIR / f"{stem}.json"
    if not p.exists():
        raise ConfigError(f"config '{name}' is neither a file nor a bundled preset; presets: {', '.join(presets())}")
    return p


# -- weights ---------------------------------------------------------------------------------------------------------

def open_checkpoint(path: str | Path | None, cfg: LlamaConfig | None = None, seed: int = 0) -> WeightSource:
    """A source for a checkpoint folder / safetensors file / GGUF file, or random weights when path is None."""
    from llgraph.weights import SafetensorsSource, WeightError

    if path is None:
        if cfg is None:
            raise ValueError("random weights need a config")
        return random_weights(cfg, seed)
    p = Path(path)
    if not p.exists():
        raise WeightError(f"checkpoint {p} does not exist; pass an HF folder, a .safetensors or a .gguf file")
    if p.suffix == ".gguf":
        from llgraph.gguf_source import GGUFSource

        return _split_fused(GGUFSource(p), cfg)  # llama.cpp keeps Phi-3's projections fused too
    if p.is_dir() or p.suffix == ".safetensors":
        from llgraph.source_views import NormOffsetSource

        source = _split_fused(SafetensorsSource(p), cfg)
        if cfg is not None and cfg.norm_weight_offset:
            source = NormOffsetSource(source, cfg.norm_weight_offset)
        return source
    raise WeightError(f"checkpoint {p} is neither a folder, a .safetensors nor a .gguf file")


def random_weights(cfg: LlamaConfig, seed: int = 0, std: float = 0.02, graph: Graph | None = None) -> RandomSource:
    """Seeded random weights for every tensor `cfg`'s graph reads (`graph` if already built)."""
    from llgraph.builder import build_graph
    from llgraph.weights import RandomSource, param_shapes

    return RandomSource(param_shapes(graph or build_graph(cfg)), seed, std)


# -- the one entry point ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Model:
    config: LlamaConfig
    source: WeightSource  # as `weights` asks: a GGUF's blocks as stored, or rounded (--quantize / --lm-head)
    graph: Graph  # the graph every backend runs (passes applied; QLinear where the source carries blocks)
    checkpoint: Path | None  # the checkpoint file or folder (None: random weights)


def checkpoint_path(checkpoint) -> Path | None:
    """A checkpoint reference ('smollm2' or a path; None: random weights) as an existing path, or one line."""
    checkpoint = resolve(checkpoint)
    if checkpoint is not None and not Path(checkpoint).exists():
        raise ExportError(f"--checkpoint {checkpoint} does not exist; pass an HF folder, a .safetensors or .gguf "
                          "file, or 'smollm2'")
    return None if checkpoint is None else Path(checkpoint)


def open_model(config, checkpoint=None, weights: Weights = Weights(), seed: int = 0,
               superblocks: bool = True) -> Model:
    """config: a preset, config file, checkpoint or 'smollm2' (None: the checkpoint's own); checkpoint: a folder,
    .safetensors, .gguf or 'smollm2' (None: seeded random weights). The graph is built once. `superblocks`: whether
    what runs the model reads GGUF K-quant super-blocks as stored; else they are widened to the blocked form."""
    from llgraph.passes import model_graph
    from llgraph.source_views import rtn_view, widened_view

    checkpoint = checkpoint_path(checkpoint)
    cfg = load_config(resolve(config) if config is not None else checkpoint)
    plain = model_graph(cfg, weights.dtype) if checkpoint is None else None  # random weights draw its shapes
    source: WeightSource
    if checkpoint is None:
        if weights.lora:
            raise ExportError("--lora merges an adapter into a checkpoint's weights; pass the adapter's base model "
                              "as the checkpoint")
        source = random_weights(cfg, seed, graph=plain)
    else:
        source = open_checkpoint(checkpoint, cfg, seed)
        if weights.lora:
            from llgraph.lora import LoraSource

            source = LoraSource(source, list(weights.lora))
        if not (weights.quantize or weights.dequantize):
            _check_stored_formats(source)
            _say_widened_blocks(source)
        if not superblocks:
            source = widened_view(source)
    source = rtn_view(source, cfg, weights.quantize, weights.block_size, weights.symmetric, weights.lm_head)
    graph = plain if plain is not None and not weights.rounds else \
        model_graph(cfg, weights.dtype, None if weights.dequantize else source.quant_format)
    if checkpoint is not None:
        _say_widened_experts(source, graph)
    return Model(cfg, source, graph, None if checkpoint is None else Path(checkpoint))


def _split_fused(source: WeightSource, cfg: LlamaConfig | None) -> WeightSource:
    """`source`, with fused projections (Phi-3's qkv_proj, gate_up_proj) seen under the Llama names and per-expert
    tensors seen stacked (a mixture of experts)."""
    from llgraph.source_views import FusedSplitSource, PackedExperts, StackedExperts

    if StackedExperts.applies(source):
        source = StackedExperts(source)
    elif PackedExperts.applies(source):
        source = PackedExperts(source)
    if cfg is None or not any(FusedSplitSource.FUSED.fullmatch(n) for n in source.names()):
        return source
    return FusedSplitSource(source, cfg)


def _say_widened_experts(source, graph) -> None:
    """GGUF experts stored in blocks that the graph runs in float (MoE, where QMoE carries them as stored): one line
    saying so, why, and the cost."""
    from llgraph.gguf_source import GGUFSource
    from llgraph.op_shapes import EXPERT_FORMATS

    while not isinstance(source, GGUFSource) and hasattr(source, "base"):  # the file under its views
        source = source.base
    if not isinstance(source, GGUFSource):
        return
    names = {p.name for n in graph.nodes if n.op == "MoE" for i in n.inputs[2:5] for p in graph.params[i].parts}
    experts = sorted(n for n in names if n in source.names() and source.tensor_type(n) not in ("F32", "F16", "BF16"))
    if experts:
        stored = sum(source.stored_bytes(n) for n in experts)
        wide = sum(4 * math.prod(source.shape(n)) for n in experts)
        kinds = sorted({source.tensor_type(n) for n in experts})
        why = (f"llgraph's MoE kernels read {', '.join(EXPERT_FORMATS)} experts (gate and up in one type) as stored, "
               "on the ort target's own kernels (--kernels llgraph)")
        print(f"llgraph: this GGUF's experts ({'/'.join(kinds)}, {stored / 1e9:.2f} GB as stored) run widened to "
              f"float32 ({wide / 1e9:.2f} GB): {why}", file=sys.stderr)


def _say_widened_blocks(source) -> None:
    """GGUF Linears in a block type llgraph has no kernel for (llgraph/quant_grid.py): one line saying they run read
    exactly as 8-bit blocks, and the cost; another for those (and experts) that run as the super-blocks whose
    weights they are."""
    from llgraph.gguf_source import GGUFSource
    from llgraph.grid_superblocks import AS_SUPERBLOCKS, superblocks_line, why_not
    from llgraph.quant_grid import GRID_TYPES, widened_line
    from llgraph.weights import EXPERTS, QUANTIZABLE

    base = getattr(source, "base", source)
    if not isinstance(base, GGUFSource):
        return
    kinds: dict[str, tuple[int, int]] = {}
    superblocks: dict[str, tuple[int, int]] = {}
    for name in base.names():
        kind = base.tensor_type(name)
        if kind not in GRID_TYPES or not (QUANTIZABLE.fullmatch(name) or EXPERTS.fullmatch(name)):
            continue
        into = superblocks if base.runs_as_superblocks(name) else kinds if QUANTIZABLE.fullmatch(name) else None
        if into is not None:
            stored, n = into.get(kind, (0, 0))
            into[kind] = (stored + base.stored_bytes(name), n + math.prod(base.shape(name)))
    if kinds:
        print(widened_line(kinds, why_not(set(kinds) & set(AS_SUPERBLOCKS))), file=sys.stderr)
    if superblocks:
        print(superblocks_line(superblocks), file=sys.stderr)


def _check_stored_formats(source) -> None:
    """A GGUF Linear stored in a block type llgraph cannot carry exactly: one line naming it (or --dequantize)."""
    from llgraph.gguf_source import GGUFSource
    from llgraph.quant import GGUF_FORMATS
    from llgraph.quant_grid import GRID_TYPES
    from llgraph.weights import QUANTIZABLE

    if not isinstance(getattr(source, "base", source), GGUFSource):  # a GGUF, or its fused parts (Phi-3)
        return
    known = [*GGUF_FORMATS, *GRID_TYPES]
    for name in source.names():
        kind = source.tensor_type(name)
        if QUANTIZABLE.fullmatch(name) and kind not in known and kind not in ("F32", "F16", "BF16"):
            raise ExportError(f"{name} is stored as GGUF {kind}; llgraph reads {', '.join(known)} blocks exactly — "
                              "pass --dequantize to export it in float (or --quantize int4 to re-round it)")
