"""The PyTorch executor against transformers' LlamaForCausalLM (eager attention) with the same weights:
prefill, then 8 cached decode steps, fp32, max |logits diff| <= 1e-4 at every step."""

import numpy as np
import pytest
import torch
from conftest import max_diff
from reference import Stepper, hf_model, tiny

from llgraph.builder import build_graph
from llgraph.checkpoint import random_weights
from llgraph.gguf_source import interleaved_to_half
from llgraph.weights import RandomSource, param_shapes

TOL = 1e-4
DECODE_STEPS = 8
# std 0.25 makes attention peaky and logits O(10): a wrong RoPE variant then moves logits by O(1), not O(1e-4)
STD = 0.25

CONFIGS = {
    "gqa-4:2": tiny(),
    "mha": tiny(num_kv_heads=4),
    "mqa": tiny(num_kv_heads=1),
    "head_dim!=hidden/heads": tiny(head_dim=32),
    "tied": tiny(tie_word_embeddings=True),
    "bias": tiny(attention_bias=True, mlp_bias=True),
    "rope-linear": tiny(rope={"type": "linear", "factor": 2.0}),
    "rope-ntk": tiny(rope={"type": "ntk", "factor": 4.0}),
    # max_position 12: the 7-token prompt starts below it and decoding crosses it, so the base stretches mid-run
    "rope-dynamic": tiny(max_position_embeddings=12, rope={"type": "dynamic", "factor": 2.0}),
    "rope-yarn": tiny(rope={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "rope-llama3": tiny(rope={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 32}),
}


def compare_with_hf(cfg, stepper, model, report, batch=2, prompt_len=7):
    from transformers import DynamicCache

    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len))
    cache = DynamicCache(config=model.config)
    worst = 0.0
    with torch.no_grad():
        for step in range(DECODE_STEPS + 1):
            ref = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            ours = stepper.step(ids)["logits"]
            worst = max(worst, max_diff(ours, ref))
            assert max_diff(ours, ref) <= TOL, f"step {step}: max|diff| {max_diff(ours, ref):.3e}"
            ids = ref[:, -1:].argmax(-1)
    report("logits over prefill + 8 decode steps", worst, TOL)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_transformers(name, report):
    cfg = CONFIGS[name]
    source = random_weights(cfg, seed=3, std=STD)
    compare_with_hf(cfg, Stepper(cfg, source, batch=2), hf_model(cfg, source), report)


class InterleavedView(RandomSource):
    """The same random model with q/k rows stored for interleaved RoPE, as GGUF stores them."""

    rope_layout = "interleaved"

    def __init__(self, cfg, **kwargs):
        super().__init__(param_shapes(build_graph(cfg)), **kwargs)
        self.cfg = cfg

    def load(self, name, dtype=None):
        t = super().load(name, dtype)
        if "q_proj" in name or "k_proj" in name:
            heads = self.cfg.num_heads if "q_proj" in name else self.cfg.num_kv_heads
            d = t.shape[0] // heads
            half = t.reshape(heads, 2, d // 2, *t.shape[1:])  # rows (i, i + d/2) -> pairs (2i, 2i+1)
            t = half.swapaxes(1, 2).reshape(t.shape)
            assert np.array_equal(interleaved_to_half(t, heads), super().load(name))
        return t


def test_interleaved_layout_matches_transformers(report):
    """RoPE layout is an attribute: interleaved rotary on permuted q/k rows equals HF's half-split model."""
    cfg = tiny(rope={"layout": "interleaved"})
    hf_source = random_weights(cfg, seed=5, std=STD)
    ours = InterleavedView(cfg, seed=5, std=STD)
    ours.cfg = cfg
    compare_with_hf(cfg, Stepper(cfg, ours, batch=2), hf_model(cfg, hf_source), report)


def test_prefill_then_decode_equals_longer_prefill(report):
    cfg = tiny()
    source = random_weights(cfg, seed=7, std=STD)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    a = Stepper(cfg, source, batch=2)
    a.step(ids[:, :8])
    split = a.step(ids[:, 8:])["logits"][:, -1]
    whole = Stepper(cfg, source, batch=2).step(ids)["logits"][:, -1]
    report("prefill(8)+decode(1) vs prefill(9)", max_diff(split, whole), 1e-5)


def test_parallel_block_equals_its_equation(report):
    """Parallel attention + MLP (GPT-J/PaLM): no transformers RMSNorm model has it, so the reference is
    transformers' Llama modules wired by the equation x + attn(norm(x)) + mlp(norm(x)), one norm per layer."""
    from transformers.models.llama import modeling_llama

    cfg = tiny(parallel_block=True)
    source = random_weights(cfg, seed=4, std=STD)

    def parallel(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                 use_cache=False, position_embeddings=None, **kwargs):
        n = self.input_layernorm(hidden_states)
        attn, _ = self.self_attn(hidden_states=n, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)
        return hidden_states + attn + self.mlp(n)

    original = modeling_llama.LlamaDecoderLayer.forward
    modeling_llama.LlamaDecoderLayer.forward = parallel
    try:
        model = hf_model(cfg, source, unread="post_attention_layernorm")  # the equation never reads it
        compare_with_hf(cfg, Stepper(cfg, source, batch=2), model, report)
    finally:
        modeling_llama.LlamaDecoderLayer.forward = original
    ids = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # the switch matters: the sequential block on the same weights is far off
        sequential = hf_model(cfg, source, unread="post_attention_layernorm")(ids).logits
    gap = max_diff(Stepper(cfg, source, batch=1).step(ids)["logits"], sequential)
    print(f"parallel vs sequential on the same weights: {gap:.3f}")
    assert gap > 100 * TOL
