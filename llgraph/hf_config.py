"""An HF `config.json` -> the typed LlamaConfig: the families' keys, their defaults (Qwen2's biases, Gemma 2's
scales and caps, ...), RoPE in transformers 4.x and 5.x spellings, and a warning naming the closest known key for a
typo. Every problem is a ConfigError with one line.
"""

from __future__ import annotations

import dataclasses

from llgraph.config import DERIVED, FAMILIES, ROPE_TYPES, ConfigError, LlamaConfig, MoeConfig, RopeConfig, from_fields

_HF_MODEL_TYPES = {"gemma3_text": "gemma3"}  # HF model_type -> llgraph family, where the names differ
_HF_LLAMA_TYPES = tuple(next((t for t, f in _HF_MODEL_TYPES.items() if f == family), family) for family in FAMILIES)
# HF keys that carry no semantics for inference of a Llama block (training or bookkeeping).
_HF_IGNORED = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "use_cache", "initializer_range",
    "pad_token_id", "pretraining_tp", "hidden_act", "_name_or_path", "attention_dropout", "auto_map",
    "quantization_config", "sliding_window", "is_llama_config", "rope_interleaved", "transformers.js_config",
    "output_attentions", "output_hidden_states", "return_dict", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "max_window_layers",
    "use_sliding_window", "rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern",
    "router_aux_loss_coef", "output_router_logits", "router_jitter_noise",  # MoE training only
}


# keys llgraph reads from an HF config.json
_HF_READ = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "attention_bias",
            "mlp_bias", "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
            "final_logit_softcapping", "layer_types", "num_experts", "num_local_experts", "num_experts_per_tok",
            "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "clip_qkv",
            "shared_expert_intermediate_size", "qkv_bias", "swiglu_alpha", "swiglu_limit"}
# keys transformers' PretrainedConfig documents (generation defaults, task heads, bookkeeping): no warning for them
_HF_DOCUMENTED = {
    "is_decoder", "is_encoder_decoder", "add_cross_attention", "tie_encoder_decoder", "torchscript", "pruned_heads",
    "chunk_size_feed_forward", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "problem_type", "id2label", "label2id", "num_labels", "finetuning_task",
    "cross_attention_hidden_size", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "use_bfloat16", "tf_legacy_loss", "_attn_implementation", "_commit_hash", "embd_pdrop", "resid_pdrop",
    "mlp_attention_dropout",
    "_model_name_or_path", "unk_token_id"}  # what transformers' own GGUF loader writes into a saved config


class ConfigWarning(UserWarning):
    """A config key llgraph ignores that is probably a typo."""


def _warn_unknown_hf_keys(d: dict) -> None:
    import difflib
    import warnings

    known = _HF_READ | _HF_IGNORED | _HF_DOCUMENTED
    if set(d) - known:
        try:  # where transformers is installed, whatever its configs define is documented
            from transformers import AutoConfig

            known |= set(AutoConfig.for_model(d.get("model_type", "llama")).to_dict())
        except Exception:  # noqa: BLE001 (transformers is optional; any failure just means no extra keys)
            pass
    for key in sorted(set(d) - known):
        close = difflib.get_close_matches(key, sorted(_HF_READ | _HF_IGNORED), n=1, cutoff=0.75)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        warnings.warn(f"HF config key '{key}' is unknown to llgraph and transformers and is ignored{hint}",
                      ConfigWarning, stacklevel=3)


def from_hf_dict(d: dict) -> LlamaConfig:
    _warn_unknown_hf_keys(d)
    mt = d.get("model_type", "llama")
    if mt not in _HF_LLAMA_TYPES:
        raise ConfigError(f"model_type '{mt}' is not supported; llgraph builds {', '.join(_HF_LLAMA_TYPES)} "
                          "(the Llama block and the families that share it)")
    mt = _HF_MODEL_TYPES.get(mt, mt)
    act = d.get("hidden_activation") or d.get("hidden_act", "silu")
    activation = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act)
    if activation is None:
        raise ConfigError(f"hidden_act '{act}' is not supported; llgraph's gated MLPs are SwiGLU ('silu') and GeGLU "
                          "('gelu_pytorch_tanh')")
    gemma = mt in ("gemma2", "gemma3")
    # Qwen2/Qwen3 window only with use_sliding_window, then the layers >= max_window_layers; Mistral and Phi-3
    # every layer whenever sliding_window is set. transformers 5 spells the layers out in layer_types.
    qwen = mt in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
    window = d.get("sliding_window") if d.get("use_sliding_window", not qwen) else None
    layers = None
    if window and d.get("layer_types"):
        layers = tuple(i for i, t in enumerate(d["layer_types"]) if t == "sliding_attention")
    elif window and mt == "gemma2":  # transformers 4.x: every other layer from the first
        layers = tuple(range(0, d["num_hidden_layers"], 2))
    elif window and mt == "gemma3":  # transformers 4.x: five local layers, then a global one
        pattern = d.get("sliding_window_pattern", 6)
        layers = tuple(i for i in range(d["num_hidden_layers"]) if (i + 1) % pattern)
    elif window and qwen:
        layers = tuple(range(d.get("max_window_layers", 0), d["num_hidden_layers"]))
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in d]
    if missing:
        raise ConfigError(f"HF config is missing {', '.join(missing)}")
    eos = d.get("eos_token_id")
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    return LlamaConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"], num_heads=d["num_attention_heads"],
        num_kv_heads=d.get("num_key_value_heads") or DERIVED, head_dim=d.get("head_dim") or DERIVED,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6), max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
        attention_bias=bool(d.get("attention_bias", d.get("qkv_bias", mt in ("qwen2", "qwen2_moe")))),
        mlp_bias=bool(d.get("mlp_bias", False)),
        attention_out_bias=False if mt in ("qwen2", "qwen2_moe") else DERIVED, family=mt, sliding_window=window,
        sliding_layers=layers,
        qk_norm={"qwen3": "head", "qwen3_moe": "head", "gemma3": "head", "olmo2": "projection",
                 "olmoe": "projection"}.get(mt, "none"),
        norm_placement={"olmo2": "post", "gemma2": "sandwich", "gemma3": "sandwich"}.get(mt, "pre"),
        mlp_activation=activation,
        embedding_scale=float(d["hidden_size"]) ** 0.5 if gemma else 1.0,
        attention_scale=float(d["query_pre_attn_scalar"]) ** -0.5 if d.get("query_pre_attn_scalar") else None,
        attention_softcap=d.get("attn_logit_softcapping"), final_softcap=d.get("final_logit_softcapping"),
        norm_weight_offset=1.0 if gemma else 0.0,
        rope=_hf_rope(d, head_dim, "full_attention"),
        rope_local=_hf_local_rope(d, head_dim) if window and mt == "gemma3" else None,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=() if eos is None else (tuple(eos) if isinstance(eos, list) else (eos,)),
        name=d.get("_name_or_path") or mt, moe=_hf_moe(d, mt), attention_sinks=mt == "gpt_oss",
    )


def _hf_moe(d: dict, mt: str) -> MoeConfig | None:
    """The routed experts of Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE and gpt-oss (None for a dense family), as their
    transformers classes route: softmax over every expert, the top k, renormalised where norm_topk_prob (always for
    Mixtral and gpt-oss, whose softmax over the top k logits is the same); Qwen2-MoE's shared expert beside them;
    gpt-oss's biases and clamped SwiGLU."""
    if mt == "gpt_oss":
        return MoeConfig(num_experts=d["num_local_experts"], top_k=d["num_experts_per_tok"],
                         intermediate_size=d["intermediate_size"], normalize=True, bias=True,
                         alpha=float(d.get("swiglu_alpha", 1.702)), beta=1.0, limit=float(d.get("swiglu_limit", 7.0)))
    if mt not in ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe"):
        return None
    if d.get("decoder_sparse_step", 1) != 1 or d.get("mlp_only_layers"):
        raise ConfigError("a Qwen3-MoE with dense layers among the sparse ones (decoder_sparse_step != 1 or "
                          "mlp_only_layers) is not supported; every layer must route to experts")
    if d.get("clip_qkv") is not None:
        raise ConfigError(f"OLMoE's clip_qkv ({d['clip_qkv']}) is not supported; only checkpoints without it")
    experts = d.get("num_experts", d.get("num_local_experts"))  # transformers 5 writes the latter for all three
    size = d.get("moe_intermediate_size") if mt in ("qwen3_moe", "qwen2_moe") else d.get("intermediate_size")
    if experts is None or d.get("num_experts_per_tok") is None or size is None:
        raise ConfigError(f"HF config of {mt} lacks its experts' count, num_experts_per_tok or their size")
    return MoeConfig(num_experts=experts, top_k=d["num_experts_per_tok"], intermediate_size=size,
                     normalize=True if mt == "mixtral" else bool(d.get("norm_topk_prob", False)),
                     shared_intermediate_size=d.get("shared_expert_intermediate_size") or 0)


def _hf_local_rope(d: dict, head_dim: int) -> RopeConfig:
    """Gemma 3's sliding layers' RoPE: transformers 5.x's rope_parameters['sliding_attention'], 4.x's
    rope_local_base_freq (unscaled)."""
    if "sliding_attention" in (d.get("rope_parameters") or {}):
        return _hf_rope(d, head_dim, "sliding_attention")
    return RopeConfig(theta=float(d.get("rope_local_base_freq", 10000.0)), rotary_dim=head_dim)


def _hf_rope(d: dict, head_dim: int, layer_type: str | None = None) -> RopeConfig:
    """transformers 4.x spells it `rope_theta` + `rope_scaling`; 5.x `rope_parameters` (theta inside), per layer
    type where the layers differ (Gemma 3: `layer_type`'s)."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    if layer_type in params and isinstance(params[layer_type], dict):
        params = dict(params[layer_type])
    theta = params.pop("rope_theta", d.get("rope_theta", 10000.0))
    rtype = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if rtype not in ROPE_TYPES:
        raise ConfigError(f"rope type '{rtype}' is unknown; llgraph supports {', '.join(ROPE_TYPES)}")
    known = {f.name for f in dataclasses.fields(RopeConfig)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigError(f"rope parameter(s) {', '.join(unknown)} are not supported for rope type '{rtype}'")
    if rtype == "dynamic":  # transformers' dynamic NTK scales past max_position_embeddings
        params["original_max_position_embeddings"] = d.get("max_position_embeddings", 2048)
    if rtype == "yarn" and params.get("factor") is None and params.get("original_max_position_embeddings"):
        params["factor"] = d["max_position_embeddings"] / params["original_max_position_embeddings"]
    params = {k: v for k, v in params.items() if v is not None}
    layout = "interleaved" if d.get("rope_interleaved") else "half"
    return from_fields(RopeConfig, dict(params, theta=theta, type=rtype, layout=layout,
                                   rotary_dim=int(head_dim * partial)), "rope.")
