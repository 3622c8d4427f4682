"""What a GGUF's metadata says of the model: `gguf_config`, each architecture read as llama.cpp reads it, including
what its converter leaves out of the metadata — Gemma's norms stored as 1 + w (so no offset), its post-sublayer norms
(`post_attention_norm`, `ffn_norm` as the pre-MLP norm, `post_ffw_norm`), soft-caps, query scale (head_dim,
hidden/heads at 27B), windows on every other layer (Gemma 2) or five of six with RoPE base `freq_base_swa` (Gemma 3);
OLMo 2's whole-projection QK-norm; Llama 3.1's `rope_freqs.weight` as its llama3 scaling; Qwen's q/k/v biases; the
mixtures' routing — and its end-of-generation and special tokens (`end_of_generation`, the texts llama.cpp knows).
LongRoPE (Phi-3 128k) is refused in one line."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from llgraph.config import ConfigError, LlamaConfig, MoeConfig, RopeConfig
from llgraph.gguf_source import gguf_reader, metadata, stored_rope_layout

# general.architecture values read (Mistral GGUFs are 'llama'), as llama.cpp's converter writes them
GGUF_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "olmo2", "gemma2", "gemma3", "qwen3moe", "olmoe", "qwen2moe",
              "gpt-oss")
# a mixture of experts' family by architecture (Mixtral's GGUFs are 'llama' with experts) and whether llama.cpp
# renormalises the top k weights (build_moe_ffn's norm_w in its src/models/<arch>.cpp)
_MOE_ARCHS = {"llama": ("mixtral", True), "qwen3moe": ("qwen3_moe", True), "olmoe": ("olmoe", False),
              "qwen2moe": ("qwen2_moe", False), "gpt-oss": ("gpt_oss", True)}
# gpt-oss's experts: biased, through the clamped SwiGLU at the constants llama.cpp's build_moe_ffn hard-codes
_GPT_OSS_EXPERTS: dict[str, Any] = dict(bias=True, alpha=1.702, beta=1.0, limit=7.0)



GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales their queries by hidden / heads, not head_dim


def gguf_config(path: str | Path) -> LlamaConfig:
    """Config from a GGUF file's metadata, as llama.cpp reads each architecture (what its converter leaves out,
    llama.cpp fixes per architecture, and so does this); rope.layout is the layout its rows are stored in
    (stored_rope_layout)."""
    r = gguf_reader(path)
    arch = metadata(r, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ConfigError(f"GGUF architecture '{arch}' is not supported; llgraph reads {', '.join(GGUF_ARCHS)} GGUF "
                          "files (and the other families from their HF folders)")

    def get(key, default=None):
        v = metadata(r, f"{arch}.{key}")
        return default if v is None else v

    n_head = get("attention.head_count")
    hidden = get("embedding_length")
    tokens = r.fields.get("tokenizer.ggml.tokens")
    tensor_names = {t.name for t in r.tensors}
    embedding = next((t for t in r.tensors if t.name == "token_embd.weight"), None)
    vocab = get("vocab_size") or (len(tokens.data) if tokens is not None else
                                  int(embedding.shape[-1]) if embedding is not None else None)
    if vocab is None:
        raise ConfigError("this GGUF states no vocabulary size (no vocab_size, tokenizer.ggml.tokens or "
                          "token_embd.weight); it is not a complete model file")
    if any(n.startswith("rope_factors_") for n in tensor_names):
        raise ConfigError("this GGUF's RoPE is LongRoPE (rope_factors_long/short: Phi-3 128k), which llgraph does not "
                          "build; use the 4k-context model, or an HF folder of a model with a supported RoPE")
    n_layers, head_dim = get("block_count"), get("attention.key_length") or hidden // n_head
    gemma = arch.startswith("gemma")
    window, layers, rope_local = get("attention.sliding_window") or None, None, None  # 0: none (Phi-3's converter)
    if window and arch == "gemma2":  # llama.cpp: every other layer from the first
        layers = tuple(range(0, n_layers, 2))
    elif window and arch == "gpt-oss":  # llama.cpp: every other layer from the first (its swa pattern 2)
        layers = tuple(range(0, n_layers, 2))
    elif window and arch == "gemma3":  # llama.cpp: five local layers (RoPE base 10,000, unscaled), one global
        layers = tuple(i for i in range(n_layers) if (i + 1) % 6)
        rope_local = RopeConfig(theta=float(get("rope.freq_base_swa", 10000.0)))
    scale = None
    if gemma:
        scale = (hidden / n_head if n_layers == GEMMA_27B_LAYERS[arch] else head_dim) ** -0.5
    family, moe = ("llama" if arch == "llama" else arch), None
    if get("expert_count"):
        if arch not in _MOE_ARCHS:
            raise ConfigError(f"a GGUF '{arch}' with experts is not supported; llgraph reads the mixtures of experts "
                              f"of {', '.join(_MOE_ARCHS)} GGUFs")
        family, normalize = _MOE_ARCHS[arch]
        moe = MoeConfig(num_experts=get("expert_count"), top_k=get("expert_used_count"), normalize=normalize,
                        intermediate_size=get("expert_feed_forward_length") or get("feed_forward_length"),
                        shared_intermediate_size=get("expert_shared_feed_forward_length", 0),
                        **(_GPT_OSS_EXPERTS if arch == "gpt-oss" else {}))
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=get("feed_forward_length"),
        num_layers=n_layers, num_heads=n_head, num_kv_heads=get("attention.head_count_kv", n_head),
        head_dim=head_dim, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope=_rope(r, arch, get, tensor_names),
        bos_token_id=metadata(r, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=end_of_generation(r),  # eos, eot, eom and the end-of-turn tokens llama.cpp stops on
        name=metadata(r, "general.name") or "gguf",
        family=family, moe=moe, attention_sinks=any(n.endswith("attn_sinks.weight") for n in tensor_names),
        attention_bias=any(n.endswith("attn_q.bias") for n in tensor_names),
        attention_out_bias=any(n.endswith("attn_output.bias") for n in tensor_names),
        qk_norm=("projection" if arch in ("olmo2", "olmoe") else "head")
        if any(n.endswith("attn_q_norm.weight") for n in tensor_names) else "none",
        sliding_window=window, sliding_layers=layers, rope_local=rope_local,
        norm_placement="sandwich" if gemma else "post" if arch == "olmo2" else "pre",
        mlp_activation="gelu_tanh" if gemma else "silu",
        embedding_scale=float(hidden) ** 0.5 if gemma else 1.0,  # the norms are stored as 1 + w: no offset
        attention_scale=scale, attention_softcap=get("attn_logit_softcapping"),
        final_softcap=get("final_logit_softcapping"),
    )


def _rope(r, arch: str, get, tensor_names) -> RopeConfig:
    """The global RoPE: base, rotated dims, linear/YaRN scaling from the metadata; Llama 3.1's frequency factors
    (`rope_freqs.weight`, what llama.cpp multiplies the wavelengths by) recognised as its llama3 scaling."""
    rope = dict(theta=float(get("rope.freq_base", 10000.0)), layout=stored_rope_layout(arch),
                rotary_dim=get("rope.dimension_count"))
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling == "yarn":
        rope.update(type="yarn", factor=float(get("rope.scaling.factor")),
                    original_max_position_embeddings=get("rope.scaling.original_context_length"))
    elif scaling not in ("none", None):
        raise ConfigError(f"GGUF rope.scaling.type '{scaling}' is not supported")
    if "rope_freqs.weight" in tensor_names:
        rope.update(_llama3_rope(r, rope["theta"]))
    return RopeConfig(**{k: v for k, v in rope.items() if v is not None})


def _llama3_rope(r, theta: float) -> dict:
    """Llama 3.1's scaling from the factors llama.cpp's converter stores: factor is their largest; low/high
    frequency factors 1 and 4 over 8,192 original positions, as every Llama 3.1/3.2 ships — checked against the
    stored factors, else refused in one line."""
    from gguf.quants import dequantize

    t = next(t for t in r.tensors if t.name == "rope_freqs.weight")
    factors = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
    d = 2 * len(factors)
    factor = float(factors.max())
    llama3 = dict(type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192)
    base = 1.0 / theta ** (np.arange(0, d, 2) / d)
    wavelen = 2 * math.pi / base
    smooth = np.clip((8192 / wavelen - 1.0) / (4.0 - 1.0), 0.0, 1.0)
    want = 1.0 / ((1 - smooth) / factor + smooth)  # the wavelengths' multipliers of llama3's formula
    if not np.allclose(factors, want, rtol=1e-5):
        raise ConfigError("this GGUF's rope_freqs are not Llama 3.1's scaling (factor, 1, 4, 8192), which is what "
                          "llgraph builds from them; convert the model from its HF folder instead")
    return llama3


SPECIAL_TYPES = {2, 3, 4}  # token types unknown, control, user-defined: split out of the text before the model runs
# end-of-generation tokens by their text, as llama.cpp knows them (beside the eos/eot/eom ids a GGUF names)
# (src/llama-vocab.cpp's list; such a token is control whatever type the file gives it)
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
             "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_utterance>", "<｜end▁of▁sentence｜>")
# fill-in-the-middle tokens by their text: control too, as llama.cpp reads them
FIM_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|fim_suffix|>",
             "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|fim_middle|>", "<fim-middle>",
             "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|fim_pad|>", "<fim-pad>", "<fim_pad>",
             "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>")


def end_of_generation(reader) -> tuple[int, ...]:
    """Every id that ends a turn: the GGUF's eos, eot and eom ids, and the control tokens llama.cpp stops on."""
    tokens, types = metadata(reader, "tokenizer.ggml.tokens") or [], metadata(reader, "tokenizer.ggml.token_type")
    ids = {metadata(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")} - {None}
    ids |= {i for i, t in enumerate(tokens) if t in EOG_TEXTS and (types is None or types[i] in SPECIAL_TYPES)}
    texts = {tokens[i]: i for i in ids if i < len(tokens)}
    if end_is_text(set(texts)):
        ids.discard(texts["<|end|>"])
    return tuple(sorted(int(i) for i in ids))


def end_is_text(stops: set[str]) -> bool:
    """Whether `<|end|>` closes a message and the turn goes on (gpt-oss's harmony: <|return|> or <|call|> ends it;
    solar-open's <|calls|>/<|flush|>): llama.cpp then takes it out of the end-of-turn tokens and renders it as text."""
    return "<|end|>" in stops and ({"<|return|>", "<|call|>"} <= stops or
                                   bool({"<|call|>", "<|calls|>"} & stops) and "<|flush|>" in stops)
