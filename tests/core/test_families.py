"""The families built from the Llama block: with other names, biases and weight layouts — Qwen2 (q/k/v biases, no
o bias), Mistral, Phi-3 (fused qkv_proj and gate_up_proj tensors) — and with variants in the IR — Qwen3 (QK-norm
per head), OLMo 2 (QK-norm over the projection, norms after attention and MLP) — and mixtures of experts in place
of the MLP (ops.py's MoE): Qwen3-MoE (renormalised top k), Mixtral (its own tensor names), OLMoE (top k as the
softmax gave them). Each is a random tiny checkpoint made and saved by transformers' own class, held to that class
on every backend, prefill + 8 cached decode steps."""

import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from reference import OrtStepper, Stepper, finish_gguf, gguf_writer
from test_export import compare_steps

from llgraph.checkpoint import load_config, open_checkpoint
from llgraph.config import ConfigError
from llgraph.export import export_model
from llgraph.plugins import cpu
from llgraph.weight_request import Weights

TOL = 1e-4
DIMS = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral-window": ("MistralConfig", {"sliding_window": 5}),  # 9 prompt + 8 decode positions: the window bites
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "phi3": ("Phi3Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),  # QK-norm per head; head_dim != hidden / heads
    "olmo2": ("Olmo2Config", {}),  # QK-norm over the whole projection; norms on the sublayer outputs only
    # soft-capping (small caps, so they bite), a window of 5 on every other layer, GeGLU, sandwich norms,
    # sqrt(hidden) embeddings, (1 + w) norms, query_pre_attn_scalar != head_dim, tied embeddings
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 5,
                                "attn_logit_softcapping": 4.0, "final_logit_softcapping": 10.0}),
    # a local layer (window 5, RoPE base 10,000) and a global one (base 1,000,000, linear scaling x2), QK-norm per
    # head with (1 + w), sandwich norms, GeGLU, sqrt(hidden) embeddings, query_pre_attn_scalar, tied head
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 5,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "rope_parameters": {
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                           "rope_theta": 1000000.0}}}),
    # 4 experts, 2 a token: the routed MLP in every layer
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 48, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    # and a shared expert beside them, gated by its own sigmoid; q/k/v biases
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                     "shared_expert_intermediate_size": 80}),
    # attention sinks, a window of 5 on the even layers, YaRN (untruncated), q/k/v/o biases, biased router and
    # experts, the clamped SwiGLU (limit 7: the test's logits reach it)
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                                 "sliding_window": 5, "intermediate_size": 48}),
}
MOE = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss")


def hf_checkpoint(family: str, folder, std: float = 0.3, **overrides):
    """transformers' own class, Linear and embedding weights drawn with std 0.3 (or `std`) and norm weights around 1,
    so the logits are decisive (the test checks), saved with save_pretrained."""
    import transformers

    cls, extra = FAMILIES[family]
    config = getattr(transformers, cls)(**{**DIMS, **extra, **overrides})
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, std)
    model.save_pretrained(folder)
    return model


def hf_steps(model, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    with torch.no_grad():
        for _ in range(steps + 1):
            logits = model(ids, past_key_values=cache, use_cache=True).logits
            out.append(logits)
            ids = logits[:, -1:].argmax(-1)
    return out


def worst_over_steps(ours, want: list[torch.Tensor], ids: torch.Tensor) -> float:
    """The largest |logits - transformers' logits| over the steps of `want` (hf_steps), each step fed the token
    transformers chose."""
    worst = 0.0
    for logits in want:
        worst = max(worst, (ours.step(ids)["logits"] - logits).abs().max().item())
        ids = logits[:, -1:].argmax(-1)
    return worst


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = hf_checkpoint(request.param, folder)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    want = hf_steps(model, ids, 8)
    top = want[0].softmax(-1).amax(-1).mean().item()
    assert top > 0.2, f"logits too close to uniform (mean top probability {top:.2f}) to tell variants apart"
    return request.param, folder, want, ids


@pytest.mark.parametrize("backend", ["torch", "ort", "ort-kernels", "onnx", "trt"])
def test_family_equals_transformers(family, backend, tmp_path, report):
    """ort-kernels: the ort export on llgraph's CPU kernels, whose GroupedAttention carries the windows and caps."""
    name, folder, want, ids = family
    cfg = load_config(folder)
    assert cfg.family == name.split("-")[0]
    assert bool(cfg.sliding_window) == (name.endswith("window") or name.startswith(("gemma", "gpt_oss")))
    assert (cfg.moe is not None) == (name in MOE)
    assert cfg.attention_sinks == (name == "gpt_oss")
    assert (cfg.qk_norm, cfg.norm_placement) == {"qwen3": ("head", "pre"), "olmo2": ("projection", "post"),
                                                 "qwen3_moe": ("head", "pre"), "olmoe": ("projection", "pre"),
                                                 "gemma2": ("none", "sandwich"),
                                                 "gemma3": ("head", "sandwich")}.get(cfg.family, ("none", "pre"))
    assert (cfg.rope_local is not None) == (name == "gemma3")
    if backend == "torch":
        ours = Stepper(cfg, open_checkpoint(folder, cfg), batch=2, max_seq=64)
    else:
        target, _, kernels = backend.partition("-")
        out = export_model(folder, checkpoint=folder, out=tmp_path / backend, target=target, max_seq_len=64,
                           weights=Weights(kernels="llgraph") if kernels else Weights())
        if kernels:  # every layer's attention on llgraph's kernel: q, k, v packed, or (QK-norm between, or q, k, v
            # in two formats) concatenated first
            nodes = onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node
            attention = [n for n in nodes if (n.domain, n.op_type) == (cpu.DOMAIN, "GroupedAttention")]
            assert len(attention) == cfg.num_layers, [n.op_type for n in nodes]
            concats = [n for n in nodes if n.op_type == "Concat"]
            assert len(concats) == (0 if cfg.qk_norm == "none" else cfg.num_layers), [n.op_type for n in nodes]
        if target == "ort" and cfg.moe is not None:  # the experts on ONNX Runtime's MoE op (export/ort_moe.py)
            nodes = onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node
            assert sum((n.domain, n.op_type) == ("com.microsoft", "MoE") for n in nodes) == cfg.num_layers
        ours = OrtStepper(out, cfg, batch=2, max_seq=64)
    worst = worst_over_steps(ours, want, ids)
    report(f"{name} on {backend}: prefill + 8 decode steps vs transformers, logits", worst, TOL)


def test_qwen2_has_qkv_biases_and_no_o_bias(tmp_path):
    hf_checkpoint("qwen2", tmp_path)
    cfg = load_config(tmp_path)
    assert (cfg.attention_bias, cfg.attention_out_bias, cfg.family) == (True, False, "qwen2")


def test_phi3_fused_tensors_are_split_by_the_weight_mapping(tmp_path):
    hf_checkpoint("phi3", tmp_path)
    cfg = load_config(tmp_path)
    source = open_checkpoint(tmp_path, cfg)
    names = set(source.names())
    assert "model.layers.0.self_attn.k_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    assert source.shape("model.layers.1.self_attn.v_proj.weight") == (cfg.kv_size, cfg.hidden_size)


@pytest.mark.parametrize("family, switch", [("mistral-window", {"sliding_window": None}),
                                            ("gemma2", {"attention_softcap": None}),
                                            ("gemma2", {"final_softcap": None}),
                                            ("gemma3", {"rope_local": None}),  # the global RoPE everywhere
                                            ("gemma3", {"sliding_layers": (1,)})])  # the window on the other
def test_each_switch_matters(family, switch, tmp_path):
    """The model run without one of its switches differs from transformers by far more than the tolerance: the
    parity above is the switch's, not an accident of small logits or short prompts."""
    import dataclasses

    hf = hf_checkpoint(family, tmp_path)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    want = hf_steps(hf, ids, 8)
    cfg = load_config(tmp_path)
    without = Stepper(dataclasses.replace(cfg, **switch), open_checkpoint(tmp_path, cfg), batch=2, max_seq=64)
    worst = max((without.step(x)["logits"] - w).abs().max().item()
                for x, w in zip([ids] + [w[:, -1:].argmax(-1) for w in want[:-1]], want))
    print(f"{family} without {switch}: max |dlogits| {worst:.3f}")
    assert worst > 100 * TOL


def test_per_layer_windows_come_from_the_config(tmp_path):
    hf_checkpoint("qwen2-window", tmp_path)
    cfg = load_config(tmp_path)
    assert (cfg.sliding_window, cfg.sliding_layers) == (4, (1,))
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == [0, 4]


def test_batched_right_padded_prompts_keep_their_solo_tokens_with_a_window(tmp_path):
    from llgraph.runtime import ORTRunner

    hf_checkpoint("mistral-window", tmp_path)
    runner = ORTRunner(export_model(tmp_path, checkpoint=tmp_path, out=tmp_path / "ort", max_seq_len=64), 64)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33, 34, 35, 36]]
    solo = [runner.generate(p, 12).token_ids for p in prompts]
    assert [g.token_ids for g in runner.generate(prompts, 12)] == solo


def test_a_window_larger_than_the_context_is_one_line():
    from llgraph.hf_config import from_hf_dict

    with pytest.raises(ConfigError, match=r"sliding_window \(4096\) is larger than the context"):
        from_hf_dict({"model_type": "mistral", **DIMS, "sliding_window": 4096})


def test_unknown_model_type_names_the_supported_ones():
    from llgraph.hf_config import from_hf_dict

    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported; llgraph builds llama, mistral, qwen2, "
                                          "phi3, qwen3, olmo2, gemma2"):
        from_hf_dict({"model_type": "gpt2", **DIMS})


def test_inspect_shows_the_family_switches(tmp_path):
    import subprocess
    import sys

    import transformers

    transformers.Qwen2Config(**DIMS).save_pretrained(tmp_path)
    r = subprocess.run([sys.executable, "-m", "llgraph", "inspect", "--config", str(tmp_path / "config.json")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "family: qwen2  (attention biases: q/k/v; mlp biases: no; tied embeddings: no; sliding window: none)" \
        in r.stdout, r.stdout
    assert "block: norms pre, QK-norm none, MLP SwiGLU, soft-capping none, embedding scale 1" in r.stdout


def test_a_qk_norm_weight_of_the_wrong_shape_is_one_line(tmp_path):
    """A Qwen3 checkpoint whose q_norm is over the whole projection (OLMo 2's shape): export refuses it by name."""
    from safetensors.torch import load_file, save_file

    hf_checkpoint("qwen3", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.self_attn.q_norm.weight"] = torch.ones(4 * 32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    from llgraph.weights import WeightError

    with pytest.raises(WeightError, match=r"mis-shaped model.layers.1.self_attn.q_norm.weight \(128,\) "
                                          r"\(config needs \(32,\)\)"):
        export_model(tmp_path, checkpoint=tmp_path, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, message", [
    ({"attn_logit_softcapping": -1.0}, "attention_softcap (-1.0) must be > 0"),
    ({"final_logit_softcapping": 0.0}, "final_softcap (0.0) must be > 0"),
    ({"sliding_window": 1000}, "sliding_window (1000) is larger than the context"),
    ({"hidden_activation": "relu"}, "hidden_act 'relu' is not supported"),
])
def test_bad_family_configs_are_one_line_and_write_nothing(change, message, tmp_path):
    import json
    import subprocess
    import sys

    import transformers

    config = transformers.Gemma2Config(**DIMS, head_dim=16, sliding_window=5).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    r = subprocess.run([sys.executable, "-m", "llgraph", "export", "--config", "config.json", "-o", "out"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def write_family_gguf(folder, path, arch: str, cfg) -> None:
    """The HF checkpoint as a GGUF of `arch` (float32 tensors), named by gguf's own tensor-name map — not by
    llgraph's — with the metadata keys llama.cpp's converter writes for it."""
    import gguf
    from safetensors.torch import load_file

    w = gguf_writer(path, arch, cfg)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), cfg.num_layers)
    for name, tensor in load_file(folder / "model.safetensors").items():
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    finish_gguf(w)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_gguf_of_the_family_equals_transformers(family, tmp_path, report):
    """The family's GGUF metadata and tensor names (q/k rows stored as in HF: llama.cpp permutes only its llama
    architecture): llgraph's ort export of the GGUF == transformers on the original checkpoint, prefill + 8 decode."""
    model = hf_checkpoint(family, tmp_path / "hf")
    hf_cfg = load_config(tmp_path / "hf")
    write_family_gguf(tmp_path / "hf", tmp_path / "m.gguf", family, hf_cfg)
    cfg = load_config(tmp_path / "m.gguf")
    assert (cfg.family, cfg.rope.layout, cfg.attention_bias, cfg.attention_out_bias, cfg.qk_norm) == (
        hf_cfg.family, "half", hf_cfg.attention_bias, hf_cfg.attention_out_bias, hf_cfg.qk_norm)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    want = hf_steps(model, ids, 8)
    out = export_model(tmp_path / "m.gguf", checkpoint=tmp_path / "m.gguf", out=tmp_path / "ort", max_seq_len=64)
    worst = worst_over_steps(OrtStepper(out, cfg, batch=2, max_seq=64), want, ids)
    report(f"{family} GGUF on ort vs transformers", worst, TOL)
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads:
        return  # transformers' GGUF reader derives head_dim from the hidden size (it ignores key_length)
    from transformers import AutoModelForCausalLM  # the file is a GGUF transformers itself reads the same way

    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    first = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (theirs(first).logits - want[0]).abs().max().item() < TOL


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3", "olmo2", "qwen3_moe", "mixtral", "olmoe",
                                    "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("backend", ["torch", "ort"])
def test_llama_cpp_s_gguf_of_the_family_equals_transformers(family, backend, tmp_path, report):
    """A GGUF as llama.cpp's own converter writes the family (tests/gguf_families.py: Gemma's norms stored as
    1 + w, Phi-3's fused qkv and gate/up, OLMo 2's and Gemma's post-sublayer norms, Gemma 3's local RoPE base and
    window pattern; the experts stacked in ffn_{gate,up,down}_exps, the router ffn_gate_inp, Mixtral as a 'llama'
    with experts; gpt-oss's sinks, biases, even-layer windows and YaRN) == transformers on the checkpoint it was
    converted from, prefill + 8 decode steps."""
    from gguf_families import DATA
    from transformers import AutoModelForCausalLM

    folder = DATA / family
    model = AutoModelForCausalLM.from_pretrained(str(folder / "hf"), attn_implementation="eager").float().eval()
    gguf, hf_cfg = folder / "model.gguf", load_config(folder / "hf")
    cfg = load_config(gguf)
    assert (cfg.family, cfg.qk_norm, cfg.norm_placement, cfg.sliding_layers, cfg.rope_local, cfg.moe) == (
        hf_cfg.family, hf_cfg.qk_norm, hf_cfg.norm_placement, hf_cfg.sliding_layers, hf_cfg.rope_local, hf_cfg.moe)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    want = hf_steps(model, ids, 8)
    if backend == "torch":
        ours = Stepper(cfg, open_checkpoint(gguf, cfg), batch=2, max_seq=64)
    else:
        ours = OrtStepper(export_model(gguf, checkpoint=gguf, out=tmp_path / "ort", max_seq_len=64), cfg, batch=2,
                          max_seq=64)
    worst = worst_over_steps(ours, want, ids)
    report(f"llama.cpp's {family} GGUF on {backend} vs transformers", worst, TOL)


@pytest.mark.parametrize("backend", ["torch", "ort"])
def test_a_one_row_shared_expert_gate_stored_flat(backend, tmp_path, report):
    """llama.cpp writes a [1, n] tensor as [n] wherever it writes tensors itself (ggml_n_dims drops trailing dims of
    1): llama-quantize's Qwen2-MoE files store ffn_gate_inp_shexp so. The converter's file with that one tensor
    re-stored flat reads as the same model: transformers' logits, prefill + 8 decode steps."""
    from gguf_families import DATA
    from reference import copying_fields
    from transformers import AutoModelForCausalLM

    from llgraph.gguf_source import gguf_reader

    folder = DATA / "qwen2_moe"
    source, flat = gguf_reader(folder / "model.gguf"), tmp_path / "flat.gguf"
    w = copying_fields(source, flat)
    for t in source.tensors:
        data = np.array(t.data)
        w.add_tensor(t.name, data.reshape(-1) if "ffn_gate_inp_shexp" in t.name else data, raw_dtype=t.tensor_type)
    finish_gguf(w)
    assert [list(t.shape) for t in gguf_reader(flat).tensors if "inp_shexp" in t.name] == [[64], [64]]
    model = AutoModelForCausalLM.from_pretrained(str(folder / "hf"), attn_implementation="eager").float().eval()
    cfg = load_config(flat)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    want = hf_steps(model, ids, 8)
    ours = Stepper(cfg, open_checkpoint(flat, cfg), batch=2, max_seq=64) if backend == "torch" else \
        OrtStepper(export_model(flat, checkpoint=flat, out=tmp_path / "ort", max_seq_len=64), cfg, batch=2, max_seq=64)
    worst = worst_over_steps(ours, want, ids)
    report(f"Qwen2-MoE GGUF, shared-expert gate stored [n], on {backend} vs transformers", worst, TOL)


def test_phi3_s_fused_blocks_are_carried_as_stored(tmp_path, report):
    """A Q8_0 Phi-3 GGUF: its fused qkv and gate/up blocks are split by rows, not dequantized (every Linear a
    QLinear on the export), and the export equals the executor on gguf's own dequantization of the same file."""
    import gguf
    import gguf.quants as gq
    from gguf_families import DATA

    r = gguf.GGUFReader(str(DATA / "phi3" / "model.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "q8.gguf"), "phi3")
    for key, f in r.fields.items():
        if key.startswith("phi3.") or key == "general.name":
            if f.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_array(key, f.contents())
            else:
                w.add_key_value(key, f.contents(), f.types[0])
    for t in r.tensors:
        x = np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)])
        if x.ndim == 2:
            q = gq.quantize(x, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, x)
    finish_gguf(w)
    path = tmp_path / "q8.gguf"
    cfg = load_config(path)
    out = export_model(path, checkpoint=path, out=tmp_path / "ort", max_seq_len=64,
                       weights=Weights(kernels="llgraph", accuracy_level=0))
    nodes = onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node
    assert len([n for n in nodes if n.op_type == "QLinear"]) == 4 * cfg.num_layers + 1
    truth = Stepper(cfg, open_checkpoint(path, cfg), batch=2, max_seq=64)
    compare_steps(cfg, truth, OrtStepper(out, cfg, batch=2, max_seq=64), report, "phi3 Q8_0 on llgraph's kernels")


def test_a_moe_gguf_with_blocked_experts_runs_them_widened_and_says_so(tmp_path, report):
    """llama.cpp's Qwen3-MoE GGUF with its gate/up experts re-stored as Q8_0 blocks (gguf's own quantizer): it runs, its
    experts widened to float32 with one line saying so and the cost, and it stays within Q8_0's error of the float
    file; the ort export equals the executor on the same file."""
    import gguf
    import gguf.quants as gq
    from gguf_families import DATA
    from reference import Stepper, copying_fields

    src = gguf.GGUFReader(str(DATA / "qwen3_moe" / "model.gguf"))
    path = tmp_path / "q8-experts.gguf"
    w = copying_fields(src, path)
    for t in src.tensors:
        data = np.array(t.data)
        if "_exps" in t.name and data.shape[-1] % 32 == 0:  # gate and up (down's 48 inputs are no whole blocks)
            w.add_tensor(t.name, gq.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    finish_gguf(w)
    r = subprocess.run([sys.executable, "-m", "llgraph", "generate", str(path), "--tokens", "5,17,33",
                        "--max-new-tokens", "2"], capture_output=True, text=True)
    notes = [line for line in r.stderr.splitlines() if "widened to float32" in line]
    assert r.returncode == 0 and len(notes) == 1 and "Q8_0" in notes[0], r.stderr
    cfg = load_config(path)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    exact = Stepper(cfg, open_checkpoint(DATA / "qwen3_moe" / "model.gguf", cfg), batch=2, max_seq=64)
    blocked = Stepper(cfg, open_checkpoint(path, cfg), batch=2, max_seq=64)
    out = OrtStepper(export_model(path, checkpoint=path, out=tmp_path / "ort", max_seq_len=64), cfg, batch=2,
                     max_seq=64)
    a, b, c = exact.step(ids)["logits"], blocked.step(ids)["logits"], out.step(ids)["logits"]
    report("Qwen3-MoE with Q8_0 experts, ort vs the executor on the same file", (c - b).abs().max().item(), TOL)
    print(f"Q8_0 experts vs float: max |diff| {(b - a).abs().max().item():.3e}")
    assert 0 < (b - a).abs().max().item() < 0.1 * a.abs().max().item()
