"""LoRA adapters merged into the base weights, as PEFT's `merge_and_unload` merges them: for each adapted Linear,
W' = W + s * scaling * (B @ A), with scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)) and `s` the adapter's
weight on the command line (`--lora DIR[:SCALE]`, 1 by default). The folder is PEFT's: `adapter_config.json` and
`adapter_model.safetensors`. Several adapters add up, in order.

The merge is a view over the checkpoint's weights (`LoraSource`), so it reaches every backend and every target alike,
and happens before `--quantize` rounds (an RTN export rounds the merged weights). A GGUF's blocks are refused: its
Q/K rows are permuted for interleaved RoPE and its codes are already rounded; merge into the HF checkpoint instead.
What PEFT can express and this merge cannot (DoRA, per-module ranks or alphas, LoRA on the embedding, replaced
modules) is one line naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from llgraph.errors import ExportError
from llgraph.weights import SourceView, WeightSource

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


class LoraError(ExportError):
    """An adapter that cannot be merged: one line naming the folder and the fix."""


@dataclass(frozen=True)
class Adapter:
    """One adapter folder and its weight `scale`."""
    path: Path
    scale: float = 1.0

    @classmethod
    def parse(cls, spec: str) -> Adapter:
        """'DIR' or 'DIR:SCALE' (the command line's --lora)."""
        path, _, scale = str(spec).rpartition(":") if ":" in str(spec) and not Path(spec).exists() else (spec, "", "")
        try:
            value = float(scale) if scale else 1.0
        except ValueError:
            value = float("nan")
        if not math.isfinite(value):
            raise LoraError(f"--lora {spec}: the scale after ':' must be a finite number (DIR or DIR:0.5)")
        adapter = cls(Path(path), value)
        adapter.check()
        return adapter

    def check(self) -> None:
        for name in (CONFIG, WEIGHTS):
            if not (self.path / name).is_file():
                raise LoraError(f"--lora {self.path}: no {name} there; give a PEFT adapter folder "
                                f"(adapter_config.json + adapter_model.safetensors, as save_pretrained writes)")

    @cached_property
    def config(self) -> dict:
        try:
            config = json.loads((self.path / CONFIG).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LoraError(f"--lora {self.path}: {CONFIG} is not readable JSON ({e})") from None
        if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
            raise LoraError(f"--lora {self.path}: {CONFIG} is not a LoRA adapter's (peft_type "
                            f"{config.get('peft_type') if isinstance(config, dict) else None!r})")
        refused = {"use_dora": "DoRA", "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
                   "modules_to_save": "replaced modules", "fan_in_fan_out": "transposed (Conv1D) weights"}
        for key, what in refused.items():
            if config.get(key):
                raise LoraError(f"--lora {self.path}: {what} ({key}) cannot be merged by llgraph; merge the "
                                "adapter with PEFT's merge_and_unload and export the merged checkpoint")
        if config.get("bias", "none") != "none":
            raise LoraError(f"--lora {self.path}: trained biases (bias {config['bias']!r}) cannot be merged by "
                            "llgraph; merge with PEFT's merge_and_unload and export the merged checkpoint")
        r, alpha = config.get("r"), config.get("lora_alpha")
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise LoraError(f"--lora {self.path}: {CONFIG} needs a positive integer 'r', not {r!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
            raise LoraError(f"--lora {self.path}: {CONFIG} needs a positive finite 'lora_alpha', not {alpha!r}")
        return config

    @property
    def scaling(self) -> float:
        r, alpha = self.config["r"], self.config["lora_alpha"]
        return self.scale * alpha / (r ** 0.5 if self.config.get("use_rslora") else r)

    @cached_property
    def pairs(self) -> dict[str, tuple[str, str]]:
        """The adapted weight's name in the checkpoint -> (its A tensor, its B tensor) in the adapter's file."""
        from safetensors import safe_open

        try:
            with safe_open(self.path / WEIGHTS, "np") as f:
                keys = list(f.keys())
        except Exception as e:
            raise LoraError(f"--lora {self.path}: {WEIGHTS} is not a readable safetensors file ({e})") from None
        pairs = {}
        for key in keys:
            if "lora_embedding_" in key or key.endswith(("lora_magnitude_vector", "lora_magnitude_vector.weight")):
                raise LoraError(f"--lora {self.path}: {key} (LoRA on an embedding, or DoRA) cannot be merged by "
                                "llgraph; merge with PEFT's merge_and_unload and export the merged checkpoint")
            if ".lora_A." not in key:
                continue
            module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
            b = key.replace(".lora_A.", ".lora_B.")
            if b not in keys:
                raise LoraError(f"--lora {self.path}: {key} has no lora_B beside it")
            pairs[f"{module}.weight"] = (key, b)
        if not pairs:
            raise LoraError(f"--lora {self.path}: {WEIGHTS} holds no lora_A/lora_B tensors")
        return pairs

    def validate(self) -> None:
        """Everything that can be checked without the base model, before anything is written: the scale finite,
        the config's r and alpha, each A [r, in] and B [out, r] two-dimensional with the config's r, every value
        finite (a NaN would turn every merged weight into NaN and the answer into nothing). Raises LoraError."""
        _ = self._validated  # the cached property does the checking

    @cached_property
    def _validated(self) -> bool:
        from safetensors import safe_open

        if not math.isfinite(self.scale):
            raise LoraError(f"--lora {self.path}: the scale ({self.scale}) must be a finite number")
        r = self.config["r"]
        with safe_open(self.path / WEIGHTS, "np") as f:
            for a_key, b_key in self.pairs.values():
                a, b = f.get_slice(a_key).get_shape(), f.get_slice(b_key).get_shape()
                if len(a) != 2 or len(b) != 2 or a[0] != r or b[1] != r:
                    raise LoraError(f"--lora {self.path}: {a_key} is {list(a)} and {b_key} is {list(b)}; LoRA "
                                    f"wants A [r, in] and B [out, r] with r = {r} ({CONFIG}); the adapter's file is "
                                    "damaged or not PEFT's")
                for key in (a_key, b_key):
                    if not np.isfinite(f.get_tensor(key)).all():
                        raise LoraError(f"--lora {self.path}: {key} holds NaN or infinite values; the adapter's "
                                        "training diverged or its file is damaged")
        return True

    def delta_shape(self, name: str) -> tuple[int, int]:
        """[out, in] of the delta for `name` (B's rows, A's columns), read from the file's header."""
        from safetensors import safe_open

        a_key, b_key = self.pairs[name]
        with safe_open(self.path / WEIGHTS, "np") as f:
            return f.get_slice(b_key).get_shape()[0], f.get_slice(a_key).get_shape()[1]

    def delta(self, name: str) -> np.ndarray:
        """scaling * B @ A for the checkpoint's weight `name`, float32 [out, in]."""
        from safetensors import safe_open

        a_key, b_key = self.pairs[name]
        with safe_open(self.path / WEIGHTS, "np") as f:
            a, b = f.get_tensor(a_key).astype(np.float32), f.get_tensor(b_key).astype(np.float32)
        return (b @ a) * np.float32(self.scaling)

    def files(self) -> list[Path]:
        return [self.path / CONFIG, self.path / WEIGHTS]


class LoraSource(SourceView):
    """Another source with `adapters` merged into the weights they adapt (W + sum of their deltas, computed in
    float32 and cast back to the weight's dtype)."""

    def __init__(self, base: WeightSource, adapters: list[Adapter]):
        if base.rope_layout == "interleaved" or any(base.quant_format(n) is not None for n in self._adapted(adapters)):
            raise LoraError("--lora merges into float HF checkpoints (safetensors); this checkpoint stores "
                            "GGUF blocks with permuted Q/K rows: export the adapter's HF base model instead")
        names = set(base.names())
        for adapter in adapters:
            adapter.validate()
            missing = sorted(set(adapter.pairs) - names)
            if missing:
                raise LoraError(f"--lora {adapter.path} adapts {missing[0]}, which this checkpoint does not have "
                                f"(its base_model_name_or_path: {adapter.config.get('base_model_name_or_path')})")
            for name in adapter.pairs:
                if adapter.delta_shape(name) != tuple(base.shape(name)):
                    raise LoraError(f"--lora {adapter.path}: the adapter's {name} is {adapter.delta_shape(name)}, "
                                    f"the checkpoint's {tuple(base.shape(name))}; it was trained on another base "
                                    "model")
        super().__init__(base)
        self.adapters = adapters
        self.description = f"{base.description} + LoRA " + ", ".join(  # the scale too: `cache list` tells entries apart
            a.path.name + ("" if a.scale == 1 else f":{a.scale:g}") for a in adapters)

    @staticmethod
    def _adapted(adapters: list[Adapter]) -> set[str]:
        return {name for a in adapters for name in a.pairs}

    def load_rows(self, name, start, stop, dtype=None):
        return None if any(name in a.pairs for a in self.adapters) else self.base.load_rows(name, start, stop, dtype)

    def load(self, name, dtype=None):
        w = self.base.load(name, dtype)
        adapters = [a for a in self.adapters if name in a.pairs]
        if not adapters:
            return w
        merged = w.astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is found below and said in one line
            for adapter in adapters:
                merged += adapter.delta(name)
            out = merged.astype(w.dtype)
        if not np.isfinite(out).all():  # finite A, B, alpha and scale can still overflow once multiplied
            raise LoraError(f"--lora {', '.join(str(a.path) for a in adapters)}: merging into {name} overflows "
                            f"{w.dtype} (its values, lora_alpha / r or the scale are too large); check the adapter, "
                            "or give a smaller scale (DIR:0.5)")
        return out
