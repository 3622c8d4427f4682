"""Config loading (llgraph JSON, HF 4.x / 5.x spellings, presets), one-line validation errors, and every RoPE
variant's frequencies against transformers' modeling_rope_utils."""

import json

import numpy as np
import pytest
import torch
from reference import hf_config, tiny

from llgraph.checkpoint import load_config, presets
from llgraph.config import ConfigError, LlamaConfig
from llgraph.rope import rope_inv_freq


def test_presets_load_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert {"8b", "llama-2-7b", "llama-3.1-8b", "smollm2-135m", "tiny"} <= set(presets())
    assert load_config("8b.json").param_count() == 8_030_261_248  # Llama-3-8B's published size
    assert load_config("llama-2-7b").param_count() == 6_738_415_616
    assert load_config("smollm2-135m").param_count() == 134_515_008


def test_a_path_wins_over_a_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "8b.json").write_text(json.dumps(dict(vocab_size=10, hidden_size=8, intermediate_size=8,
                                                      num_layers=1, num_heads=2)))
    assert load_config("8b.json").vocab_size == 10


HF_4X = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
         "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 500000.0, "hidden_act": "silu",
         "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"},
         "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
         "torch_dtype": "bfloat16", "transformers_version": "4.43.0"}


def test_hf_config_4x_and_5x_spellings_agree_with_the_preset():
    hf5 = {k: v for k, v in HF_4X.items() if k not in ("rope_theta", "rope_scaling")}
    hf5["rope_parameters"] = dict(HF_4X["rope_scaling"], rope_theta=500000.0)
    a, b, preset = load_config(HF_4X), load_config(hf5), load_config("llama-3.1-8b")
    assert a.rope == b.rope == preset.rope
    assert a.param_count() == preset.param_count() and a.eos_token_ids == (128001, 128008, 128009)


def test_hf_config_written_by_transformers_round_trips(tmp_path):
    cfg = tiny(num_kv_heads=1, head_dim=32, tie_word_embeddings=True,
               rope={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    hf_config(cfg).save_pretrained(tmp_path)
    back = load_config(tmp_path)  # a folder means its config.json
    assert back.rope.type == "yarn" and back.rope.factor == 4.0 and back.head_dim == 32
    assert (back.num_kv_heads, back.tie_word_embeddings) == (1, True)


BAD = {
    "kv heads": (dict(num_heads=4, num_kv_heads=3), "num_heads (4) must be divisible by num_kv_heads (3)"),
    "odd rotary": (dict(rope={"rotary_dim": 7}), "rope.rotary_dim (7) must be even"),
    "zero size": (dict(hidden_size=0), "hidden_size (0) must be a positive integer"),
    "negative layers": (dict(num_layers=-2), "num_layers (-2) must be a positive integer"),
    "unknown rope": (dict(rope={"type": "longrope"}), "rope.type 'longrope' is unknown"),
    "unknown layout": (dict(rope={"layout": "neox"}), "rope.layout 'neox' is unknown"),
    "unknown key": (dict(num_head=4), "unknown config key(s) num_head"),
    "unknown rope key": (dict(rope={"thetta": 1.0}), "unknown config key(s) rope.thetta"),
    "llama3 without original": (dict(rope={"type": "llama3", "factor": 8.0}),
                                "rope.type 'llama3' needs rope.original_max_position_embeddings"),
    "eos outside vocab": (dict(eos_token_ids=[500]), "special token id 500 is outside the vocabulary"),
    "heads do not split hidden": (dict(hidden_size=66), "hidden_size (66) is not divisible by num_heads (4)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_gets_one_line_error(case):
    changes, message = BAD[case]
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
    rope = changes.pop("rope", None)
    data = dict(base, **changes, **({"rope": rope} if rope else {}))
    with pytest.raises(ConfigError) as e:
        load_config(data)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not valid JSON"),
    (json.dumps({"model_type": "gpt2", "num_attention_heads": 2}), "model_type 'gpt2' is not supported"),
    (json.dumps(dict(HF_4X, hidden_act="gelu")), "hidden_act 'gelu' is not supported"),
    (json.dumps({"model_type": "llama", "num_attention_heads": 2}), "HF config is missing vocab_size"),
    (json.dumps(dict(HF_4X, rope_scaling={"rope_type": "su", "factor": 2.0})), "rope type 'su' is unknown"),
])
def test_bad_config_file_gets_one_line_error(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_preset_names_the_presets():
    with pytest.raises(ConfigError, match="neither a file nor a bundled preset; presets: 8b"):
        load_config("70b.json")


ROPES = {
    "default": {},
    "linear": {"type": "linear", "factor": 4.0},
    "dynamic": {"type": "dynamic", "factor": 2.0},
    "yarn": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                    "mscale_all_dim": 0.5, "truncate": False},
    "yarn-attention-factor": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0},
    "llama3": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "partial-linear": {"type": "linear", "factor": 2.0, "rotary_dim": 16},
}


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_frequencies_match_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tiny(hidden_size=256, num_heads=4, num_kv_heads=2, max_position_embeddings=128, rope=ROPES[name])
    hfc = hf_config(cfg)
    rope = dict(hfc.rope_parameters)
    for key in ("mscale", "mscale_all_dim", "truncate", "attention_factor"):
        if getattr(cfg.rope, key) is not None:
            rope[key] = getattr(cfg.rope, key)
    if cfg.rope.rotary_dim != cfg.head_dim:
        rope["partial_rotary_factor"] = cfg.rope.rotary_dim / cfg.head_dim
    hfc.rope_parameters = rope
    kind = rope["rope_type"]
    seq_lens = [None, 1000] if kind == "dynamic" else [None]  # dynamic: below and far above max positions
    for seq_len in seq_lens:
        kwargs = {"seq_len": seq_len} if seq_len else {}
        if kind == "default":
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
            ref, ref_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hfc)
        else:
            ref, ref_scale = ROPE_INIT_FUNCTIONS[kind](hfc, torch.device("cpu"), **kwargs)
        ours, scale = rope_inv_freq(cfg, seq_len)
        diff = np.abs(ours - ref.double().numpy()).max() / ours.max()
        print(f"{name} seq_len={seq_len}: inv_freq max rel diff {diff:.2e}, scaling {scale} vs {ref_scale}")
        assert ours.shape == tuple(ref.shape) and diff < 1e-6
        assert scale == pytest.approx(ref_scale, rel=1e-9)


def test_ntk_static_stretches_the_base_by_alpha():
    cfg = tiny(rope={"type": "ntk", "factor": 4.0})
    d = cfg.rope.rotary_dim
    stretched = 10000.0 * 4.0 ** (d / (d - 2))
    np.testing.assert_allclose(rope_inv_freq(cfg)[0], stretched ** (-np.arange(0, d, 2) / d), rtol=1e-12)


def test_config_json_round_trip():
    cfg = load_config("llama-3.1-8b")
    assert LlamaConfig(**json.loads(cfg.to_json())) == cfg
