"""Config -> IR graph of the whole decoder: embedding, N blocks, final norm, lm head, KV cache in/out.

One graph serves prefill (seq > 1) and decode (seq == 1): `seq` and `max_seq` are symbolic. Parameter names are
HF's (`model.layers.0.self_attn.q_proj.weight`), so every weight source maps onto one naming.

    x = embed(input_ids)                                       # [B, S, H]
    for each layer:
        h = x + o_proj(attention(rotary(q(norm(x))), rotary(k(norm(x))), v(norm(x)), cache))
        x = h + down(silu(gate(norm(h))) * up(norm(h)))
    logits = lm_head(norm(x))                                  # [B, S, V]
"""

from __future__ import annotations

import math

import numpy as np

from llgraph.config import LlamaConfig
from llgraph.ir import FLOAT_DTYPES, Graph, GraphBuilder
from llgraph.rope import rope_inv_freq

BATCH, SEQ, MAX_SEQ = "batch", "seq", "max_seq"
DEFAULT_MAX_SEQ = 2048  # the cache length a runner or an engine build takes when none is asked for


def cache_names(layer: int) -> tuple[str, str, str, str]:
    """(past key, past value, present key, present value) graph I/O names, HF/Optimum style."""
    return (f"past_key_values.{layer}.key", f"past_key_values.{layer}.value",
            f"present.{layer}.key", f"present.{layer}.value")


def cache_pairs(cfg: LlamaConfig) -> list[tuple[str, str]]:
    """(past input, present output) names of every cache tensor, layer by layer, key before value."""
    return [pair for i in range(cfg.num_layers) for pair in zip(cache_names(i)[:2], cache_names(i)[2:])]


def new_cache(cfg: LlamaConfig, batch: int, max_seq: int, alloc, row: int | None = None, ring: int = 0) -> dict:
    """The static cache as graph feeds: past name -> alloc(shape), shape [batch, kv_heads, max_seq, row] (row: the
    head_dim, or the cache format's row, llgraph/kv_cache.py); with `ring`, a windowed layer's holds `ring` slots
    (kv_cache.ring_length). `alloc` makes one zeroed buffer (torch.zeros with a dtype, np.zeros, ...)."""
    def shape(layer: int) -> tuple[int, int, int, int]:
        slots = ring if ring and cfg.layer_window(layer) else max_seq
        return (batch, cfg.num_kv_heads, slots, row or cfg.head_dim)
    return {cache_names(i)[j]: alloc(shape(i)) for i in range(cfg.num_layers) for j in (0, 1)}


def build_graph(cfg: LlamaConfig, dtype: str = "float32", kv: str | None = None) -> Graph:
    """`kv`: the cache's format (llgraph/kv_cache.py; default: `dtype`'s floats)."""
    from llgraph.kv_cache import kv_format

    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype '{dtype}' is not supported; use one of {', '.join(FLOAT_DTYPES)}")
    b = GraphBuilder()
    h, d = cfg.hidden_size, cfg.head_dim
    cache = kv_format(kv) if kv else None
    cache_dtype, row = (cache.dtype, cache.row(d)) if cache else (dtype, d)
    ids = b.input("input_ids", "int64", (BATCH, SEQ))
    pos = b.input("position_ids", "int64", (BATCH, SEQ))
    for i in range(cfg.num_layers):
        pk, pv, _, _ = cache_names(i)
        b.input(pk, cache_dtype, (BATCH, cfg.num_kv_heads, MAX_SEQ, row))
        b.input(pv, cache_dtype, (BATCH, cfg.num_kv_heads, MAX_SEQ, row))

    def weight(name, *shape):
        return b.param(name, dtype, shape)

    def linear(x, prefix, out_features, in_features, bias, out):
        w = weight(f"{prefix}.weight", out_features, in_features)
        bb = weight(f"{prefix}.bias", out_features) if bias else None
        return b.add("Linear", (x, w, bb), (out,))[0]

    embed_w = weight("model.embed_tokens.weight", cfg.vocab_size, h)
    (x,) = b.add("Embedding", (ids, embed_w), ("embed",), scale=float(cfg.embedding_scale))
    def cos_sin(r, name):  # one table pair per RoPE of the config (Gemma 3: its sliding layers' own)
        inv_freq, scaling = rope_inv_freq(cfg, rope=r)
        inv = b.param(f"{name}.inv_freq", "float32", inv_freq.shape, constant=inv_freq.astype(np.float32))
        return b.add("RotaryCosSin", (pos, inv), (f"{name}.cos", f"{name}.sin"), scaling=float(scaling),
                     dynamic_factor=float(r.factor) if r.type == "dynamic" else 0.0,
                     original_max_position=r.original_max_position_embeddings or cfg.max_position_embeddings)

    r = cfg.rope
    tables = {id(r): cos_sin(r, "rope")}
    if cfg.rope_local is not None:
        tables[id(cfg.rope_local)] = cos_sin(cfg.rope_local, "rope_local")

    def norm(x, name, size, out, group=None):
        return b.add("RMSNorm", (x, weight(name, size)), (out,), eps=cfg.rms_norm_eps, group=group or size)[0]

    # a norm before each sublayer (Llama), on its output (OLMo 2), or both (Gemma 2's "sandwich")
    pre, post = cfg.norm_placement in ("pre", "sandwich"), cfg.norm_placement in ("post", "sandwich")
    mlp_norm = "pre_feedforward_layernorm" if post else "post_attention_layernorm"  # Llama's name for its pre-MLP
    scale = cfg.attention_scale or 1.0 / math.sqrt(d)
    for i in range(cfg.num_layers):
        p, v = f"model.layers.{i}", f"layers.{i}"
        pk, pv, ok, ov = cache_names(i)
        n = norm(x, f"{p}.input_layernorm.weight", h, f"{v}.attn_norm") if pre else x
        q = linear(n, f"{p}.self_attn.q_proj", cfg.q_size, h, cfg.attention_bias, f"{v}.q")
        k = linear(n, f"{p}.self_attn.k_proj", cfg.kv_size, h, cfg.attention_bias, f"{v}.k")
        vv = linear(n, f"{p}.self_attn.v_proj", cfg.kv_size, h, cfg.attention_bias, f"{v}.v")
        if cfg.qk_norm != "none":  # before RoPE: per head (weight [head_dim]) or over the whole projection
            per_head = cfg.qk_norm == "head"
            q = norm(q, f"{p}.self_attn.q_norm.weight", d if per_head else cfg.q_size, f"{v}.q_norm")
            k = norm(k, f"{p}.self_attn.k_norm.weight", d if per_head else cfg.kv_size, f"{v}.k_norm")
        interleaved = r.layout == "interleaved"
        cos, sin = tables[id(cfg.layer_rope(i))]
        (q,) = b.add("Rotary", (q, cos, sin), (f"{v}.q_rot",), num_heads=cfg.num_heads, interleaved=interleaved)
        (k,) = b.add("Rotary", (k, cos, sin), (f"{v}.k_rot",), num_heads=cfg.num_kv_heads, interleaved=interleaved)
        sinks = (None, b.param(f"{p}.self_attn.sinks", "float32", (cfg.num_heads,))) if cfg.attention_sinks else ()
        attn, _, _ = b.add("GroupedAttention", (q, k, vv, pos, pk, pv, *sinks), (f"{v}.attn", ok, ov),
                           num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, scale=scale, causal=True,
                           window=cfg.layer_window(i), softcap=float(cfg.attention_softcap or 0.0))
        o = linear(attn, f"{p}.self_attn.o_proj", h, cfg.q_size, cfg.attention_out_bias, f"{v}.attn_out")
        if post:
            o = norm(o, f"{p}.post_attention_layernorm.weight", h, f"{v}.attn_out_norm")
        (x,) = b.add("Add", (x, o), (f"{v}.attn_residual",))
        if not cfg.parallel_block:  # parallel (GPT-J, PaLM): the MLP reads the attention's normed input
            n = norm(x, f"{p}.{mlp_norm}.weight", h, f"{v}.mlp_norm") if pre else x
        if cfg.moe is not None:  # routed experts, stacked on a first axis (llgraph/source_views.StackedExperts)
            e, f = cfg.moe.num_experts, cfg.moe.intermediate_size
            experts = [weight(f"{p}.mlp.experts.{w}.weight", e, *shape)
                       for w, shape in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f)))]
            s, shared = cfg.moe.shared_intermediate_size, []
            if s:  # Qwen2-MoE's shared expert and its sigmoid gate
                shared = [weight(f"{p}.mlp.shared_expert.{w}.weight", *shape)
                          for w, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s)))]
                shared.append(weight(f"{p}.mlp.shared_expert_gate.weight", 1, h))
            biases = []
            if cfg.moe.bias:  # gpt-oss: the router's and every expert's (optional inputs after the shared expert's)
                biases = [None] * (4 - len(shared)) + [weight(f"{p}.mlp.gate.bias", e)] + [
                    weight(f"{p}.mlp.experts.{w}.bias", e, size) for w, size in (("gate_proj", f), ("up_proj", f),
                                                                                  ("down_proj", h))]
            mc = cfg.moe
            (m,) = b.add("MoE", (n, weight(f"{p}.mlp.gate.weight", e, h), *experts, *shared, *biases),
                         (f"{v}.mlp_out",), top_k=mc.top_k, normalize=mc.normalize, alpha=float(mc.alpha),
                         beta=float(mc.beta), limit=float(mc.limit))
        else:
            g = linear(n, f"{p}.mlp.gate_proj", cfg.intermediate_size, h, cfg.mlp_bias, f"{v}.gate")
            u = linear(n, f"{p}.mlp.up_proj", cfg.intermediate_size, h, cfg.mlp_bias, f"{v}.up")
            (a,) = b.add("SwiGLU" if cfg.mlp_activation == "silu" else "GeGLU", (g, u), (f"{v}.gated",))
            m = linear(a, f"{p}.mlp.down_proj", h, cfg.intermediate_size, cfg.mlp_bias, f"{v}.mlp_out")
        if post:
            m = norm(m, f"{p}.post_feedforward_layernorm.weight", h, f"{v}.mlp_out_norm")
        (x,) = b.add("Add", (x, m), (f"{v}.out",))  # parallel: residual + attention + MLP

    n = norm(x, "model.norm.weight", h, "final_norm")
    head = embed_w if cfg.tie_word_embeddings else weight("lm_head.weight", cfg.vocab_size, h)
    if cfg.final_softcap:
        (raw,) = b.add("Linear", (n, head, None), ("logits.raw",))
        b.add("SoftCap", (raw,), ("logits",), cap=float(cfg.final_softcap))
    else:
        b.add("Linear", (n, head, None), ("logits",))
    b.output("logits")
    for i in range(cfg.num_layers):
        _, _, ok, ov = cache_names(i)
        b.output(ok)
        b.output(ov)
    return b.build(metadata={"config": cfg.to_json(), "dtype": dtype})
