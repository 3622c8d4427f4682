"""Typed, frozen model config for Llama-family decoders, and its validation. Every problem is a `ConfigError`
with one line naming the field and the fix.

Reading a config from a file (llgraph's JSON, a bundled preset, an HF config.json, a GGUF header) is the
checkpoint readers' job: `llgraph.checkpoint.load_config`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from llgraph.errors import LlgraphError

FAMILIES = ("llama", "mistral", "qwen2", "phi3", "qwen3", "olmo2", "gemma2", "gemma3",  # the Llama block, its variants
            "qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss")  # ... with routed experts for its MLP (MoeConfig)
QK_NORMS = ("none", "head", "projection")  # RMSNorm of q and k before RoPE: per head (Qwen3), whole (OLMo 2)
NORM_PLACEMENTS = ("pre", "post", "sandwich")  # before attention and MLP (Llama), on their outputs (OLMo 2),
# or both (Gemma 2)
ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's: SwiGLU (Llama), GeGLU (Gemma)
ROPE_TYPES = ("default", "linear", "ntk", "dynamic", "yarn", "llama3")
ROPE_LAYOUTS = ("half", "interleaved")


DERIVED: Any = None  # the default of a field __post_init__ fills in: typed as what it holds from then on


class ConfigError(LlgraphError):
    """A config that cannot describe a model; the message names the field and the fix."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding. `layout` says how pairs are formed: "half" rotates (x[i], x[i + d/2]) as HF does,
    "interleaved" rotates (x[2i], x[2i+1]) as Meta's complex-pair code and GGUF checkpoints do."""

    theta: float = 10000.0
    type: str = "default"
    layout: str = "half"
    rotary_dim: int = DERIVED  # None: the whole head_dim (LlamaConfig fills it in); else the first dims (partial)
    factor: float = 1.0  # linear / ntk / dynamic / yarn / llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn; dynamic's threshold
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None derives it from factor / mscale
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts in place of the MLP (ops.py's MoE): a router picks `top_k` of `num_experts` gated MLPs of
    `intermediate_size` per token by softmax over all experts; `normalize` rescales the k weights to sum to 1
    (Qwen3-MoE's norm_topk_prob; Mixtral's softmax over the top k logits is the same), else they stay as the
    softmax gave them (OLMoE). `shared_intermediate_size`: a shared expert every token takes, weighted by a sigmoid
    gate of its own (Qwen2-MoE; 0: none). gpt-oss: biases on the router and on every expert's gate, up and down
    (`bias`), and its clamped SwiGLU, min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, +-limit) + beta)
    (alpha 1.702, beta 1, limit 7; plain SwiGLU is alpha 1, beta 0, limit 0 meaning no clamp)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize: bool = True
    shared_intermediate_size: int = 0
    bias: bool = False
    alpha: float = 1.0
    beta: float = 0.0
    limit: float = 0.0


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int = DERIVED  # None: = num_heads (MHA)
    head_dim: int = DERIVED  # None: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q, k, v (and o unless attention_out_bias says otherwise) have biases
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"
    family: str = "llama"  # the model_type it came from: llama, mistral, qwen2, phi3
    attention_out_bias: bool = DERIVED  # o_proj's bias; None: = attention_bias (Qwen2: q/k/v only)
    sliding_window: int | None = None  # keys visible to a query: the last `sliding_window` positions (None: all)
    sliding_layers: tuple[int, ...] | None = None  # the layers with the window (None: every layer)
    qk_norm: str = "none"  # see QK_NORMS
    norm_placement: str = "pre"  # see NORM_PLACEMENTS
    mlp_activation: str = "silu"  # see ACTIVATIONS
    embedding_scale: float = 1.0  # the embedding rows are multiplied by it (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None  # None: 1/sqrt(head_dim) (Gemma 2: query_pre_attn_scalar^-0.5)
    attention_softcap: float | None = None  # attention logits capped as cap * tanh(x / cap) (Gemma 2)
    final_softcap: float | None = None  # the output logits, likewise
    norm_weight_offset: float = 0.0  # RMSNorm multiplies by (offset + weight): Gemma stores weight - 1
    parallel_block: bool = False  # attention and MLP both read the layer's one norm; both add to the residual
    rope_local: RopeConfig | None = None  # the sliding-window layers' own RoPE (Gemma 3: theta 10,000 there,
    # 1,000,000 and any scaling on the global layers); None: every layer uses `rope`
    moe: MoeConfig | None = None  # routed experts in every layer's MLP (None: the dense gated MLP)
    attention_sinks: bool = False  # a learned logit per head joins each softmax's denominator (gpt-oss)

    def __post_init__(self):
        # Derive the optional fields, then validate; frozen, so derived values go through object.__setattr__.
        if isinstance(self.rope, dict):
            object.__setattr__(self, "rope", from_fields(RopeConfig, self.rope, "rope."))
        if isinstance(self.rope_local, dict):
            object.__setattr__(self, "rope_local", from_fields(RopeConfig, self.rope_local, "rope_local."))
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", from_fields(MoeConfig, self.moe, "moe."))
        if self.sliding_layers is not None:
            object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        if isinstance(self.eos_token_ids, int):
            object.__setattr__(self, "eos_token_ids", (self.eos_token_ids,))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        _positive(self, "num_heads")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                    "set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.rope.rotary_dim is None:
            object.__setattr__(self, "rope", dataclasses.replace(self.rope, rotary_dim=self.head_dim))
        if self.rope_local is not None:  # the same weights: the same pairs and rotated dims as `rope`
            local = self.rope_local
            object.__setattr__(self, "rope_local", dataclasses.replace(
                local, layout=self.rope.layout, rotary_dim=local.rotary_dim or self.rope.rotary_dim))
        if self.attention_out_bias is None:
            object.__setattr__(self, "attention_out_bias", self.attention_bias)
        self._validate()

    def _validate(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            _positive(self, name)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.family not in FAMILIES:
            raise ConfigError(f"family '{self.family}' is unknown; llgraph builds {', '.join(FAMILIES)}")
        if self.sliding_window is not None:
            _positive(self, "sliding_window")
            if self.sliding_window > self.max_position_embeddings:
                raise ConfigError(f"sliding_window ({self.sliding_window}) is larger than the context "
                                  f"(max_position_embeddings {self.max_position_embeddings}); it would never apply: "
                                  "set it to null, or fix the config")
        if self.sliding_layers is not None and not all(0 <= i < self.num_layers for i in self.sliding_layers):
            raise ConfigError(f"sliding_layers {list(self.sliding_layers)} must be layer indices in "
                              f"0..{self.num_layers - 1}")
        if self.qk_norm not in QK_NORMS:
            raise ConfigError(f"qk_norm '{self.qk_norm}' is unknown; use one of {', '.join(QK_NORMS)}")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ConfigError(f"norm_placement '{self.norm_placement}' is unknown; use one of "
                              f"{', '.join(NORM_PLACEMENTS)}")
        if self.mlp_activation not in ACTIVATIONS:
            raise ConfigError(f"mlp_activation '{self.mlp_activation}' is unknown; use one of {', '.join(ACTIVATIONS)}")
        for key in ("attention_softcap", "final_softcap", "attention_scale"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ConfigError(f"{key} ({value}) must be > 0 (or null for none)")
        if self.parallel_block and self.norm_placement != "pre":
            raise ConfigError(f"parallel_block needs norm_placement 'pre' (one norm both sublayers read), not "
                              f"'{self.norm_placement}'")
        if not self.embedding_scale > 0:
            raise ConfigError(f"embedding_scale ({self.embedding_scale}) must be > 0")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps ({self.rms_norm_eps}) must be > 0")
        for name, r in (("rope", self.rope), ("rope_local", self.rope_local)):
            if r is not None:
                self._check_rope(name, r)
        if self.rope_local is not None and not self.sliding_window:
            raise ConfigError("rope_local is the sliding-window layers' RoPE, but the config has no sliding_window; "
                              "drop rope_local or set the window")
        if self.moe is not None:
            for key in ("num_experts", "top_k", "intermediate_size"):
                _positive(self.moe, key, "moe.")
            if self.moe.top_k > self.moe.num_experts:
                raise ConfigError(f"moe.top_k ({self.moe.top_k}) exceeds moe.num_experts ({self.moe.num_experts})")
            if self.mlp_bias or self.mlp_activation != "silu":
                raise ConfigError("moe experts are SwiGLU MLPs (their biases: moe.bias); drop mlp_bias or "
                                  "mlp_activation")
            if not (self.moe.alpha > 0 and self.moe.limit >= 0):
                raise ConfigError(f"moe.alpha ({self.moe.alpha}) must be > 0 and moe.limit ({self.moe.limit}) >= 0 "
                                  "(0: no clamp)")
        for t in (self.bos_token_id, *self.eos_token_ids):
            if t is not None and not 0 <= t < self.vocab_size:
                raise ConfigError(f"special token id {t} is outside the vocabulary (0..{self.vocab_size - 1})")

    def _check_rope(self, name: str, r: RopeConfig) -> None:
        if r.type not in ROPE_TYPES:
            raise ConfigError(f"{name}.type '{r.type}' is unknown; use one of {', '.join(ROPE_TYPES)}")
        if r.layout not in ROPE_LAYOUTS:
            raise ConfigError(f"{name}.layout '{r.layout}' is unknown; use 'half' (HF) or 'interleaved' (Meta/GGUF)")
        if not r.theta > 0:
            raise ConfigError(f"{name}.theta ({r.theta}) must be > 0")
        if r.rotary_dim <= 0 or r.rotary_dim % 2 or r.rotary_dim > self.head_dim:
            raise ConfigError(f"{name}.rotary_dim ({r.rotary_dim}) must be even and in 2..head_dim ({self.head_dim})")
        if r.type != "default" and not r.factor > 0:
            raise ConfigError(f"{name}.factor ({r.factor}) must be > 0 for rope.type '{r.type}'")
        if r.type in ("llama3", "yarn") and not r.original_max_position_embeddings:
            raise ConfigError(f"{name}.type '{r.type}' needs rope.original_max_position_embeddings")
        if r.type == "llama3" and not r.high_freq_factor > r.low_freq_factor:
            raise ConfigError(f"{name}.high_freq_factor ({r.high_freq_factor}) must exceed "
                              f"{name}.low_freq_factor ({r.low_freq_factor})")

    # -- derived sizes --------------------------------------------------------------------------------------------
    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` (0: none)."""
        if not self.sliding_window or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return 0
        return self.sliding_window

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE of `layer`: rope_local on a sliding-window layer where the config has one, else rope."""
        return self.rope_local if self.rope_local is not None and self.layer_window(layer) else self.rope

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def param_count(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) * self.attention_bias + h * self.attention_out_bias
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        if self.moe is not None:  # the router and every expert
            mlp = self.moe.num_experts * (h + 3 * h * self.moe.intermediate_size)
            mlp += self.moe.num_experts * (1 + 2 * self.moe.intermediate_size + h) if self.moe.bias else 0
            mlp += (h + 3 * h * self.moe.shared_intermediate_size) if self.moe.shared_intermediate_size else 0
        qk = {"none": 0, "head": 2 * self.head_dim, "projection": self.q_size + self.kv_size}[self.qk_norm]
        norms = 4 if self.norm_placement == "sandwich" else 1 if self.parallel_block else 2
        per_layer = attn + mlp + norms * h + qk + self.num_heads * self.attention_sinks
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + h

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _positive(cfg, name, prefix: str = ""):
    v = getattr(cfg, name)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{prefix}{name} ({v!r}) must be a positive integer")


def from_fields(cls, data: dict, prefix: str = ""):
    """`cls(**data)` with one ConfigError naming any unknown or missing key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a JSON object, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        hint = ", ".join(prefix + k for k in unknown)
        raise ConfigError(f"unknown config key(s) {hint}; known keys are {', '.join(sorted(known))}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [prefix + k for k in required if k not in data]
    if missing:
        where = f"config section {prefix.rstrip('.')}" if prefix else "the config"
        raise ConfigError(f"{where} lacks required key(s) {', '.join(missing)} (an HF config.json, a preset name such "
                          f"as 'tiny' or '8b', or a JSON object with them, like llgraph/configs/*.json)")
    return cls(**data)
