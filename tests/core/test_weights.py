"""Weight sources: lazy and deterministic; a checkpoint that does not fit gets one error listing every problem."""

import numpy as np
import pytest
import torch
from reference import tiny
from safetensors.torch import save_file

from llgraph.builder import build_graph
from llgraph.bundled import bundled_model
from llgraph.checkpoint import load_config, open_checkpoint, random_weights
from llgraph.executor import as_torch
from llgraph.gguf_source import GGUFSource
from llgraph.weights import SafetensorsSource, WeightError, check_weights


def write_checkpoint(path, cfg, edit=lambda state: state):
    source = random_weights(cfg, seed=1)
    save_file(edit({n: as_torch(source.load(n)) for n in source.names()}), str(path / "model.safetensors"))
    return path


def test_random_weights_are_deterministic_per_tensor():
    cfg = tiny()
    a, b = random_weights(cfg, seed=1), random_weights(cfg, seed=1)
    names = a.names()
    assert np.array_equal(a.load(names[3]), b.load(names[3]))  # drawn in any order, same tensor
    assert not np.array_equal(a.load(names[3]), random_weights(cfg, seed=2).load(names[3]))


def test_every_problem_is_listed_in_one_line(tmp_path):
    cfg = tiny()

    def edit(state):
        del state["model.layers.0.mlp.up_proj.weight"]
        del state["model.norm.weight"]
        state["model.layers.9.extra.weight"] = torch.zeros(3)
        state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(5, 64)
        return state

    source = SafetensorsSource(write_checkpoint(tmp_path, cfg, edit))
    with pytest.raises(WeightError) as e:
        check_weights(build_graph(cfg), source)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg
    assert "missing model.layers.0.mlp.up_proj.weight, model.norm.weight" in msg
    assert "unexpected model.layers.9.extra.weight" in msg
    assert "mis-shaped model.layers.1.self_attn.k_proj.weight (5, 64) (config needs (32, 64))" in msg


def test_harmless_extras_are_accepted(tmp_path):
    cfg = tiny(tie_word_embeddings=True)

    def edit(state):
        state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # old HF checkpoints carry these
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # tied, yet saved
        return state

    check_weights(build_graph(cfg), SafetensorsSource(write_checkpoint(tmp_path, cfg, edit)))


def test_unreadable_files_get_one_line_errors(tmp_path):
    with pytest.raises(WeightError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightError, match="holds no \\*.safetensors file"):
        open_checkpoint(tmp_path / "empty")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(WeightError, match="not a valid safetensors file"):
        open_checkpoint(bad)
    (tmp_path / "bad.gguf").write_bytes(b"GGUF-not-really")
    with pytest.raises(WeightError, match="is not a readable GGUF file"):
        open_checkpoint(tmp_path / "bad.gguf")
    from gguf_families import DATA  # a real file cut short, and a file that is no GGUF: said without numpy's words
    whole = (DATA / "qwen3_moe" / "model.gguf").read_bytes()
    for data, says in ((whole[:300_000], "it ends before its header, metadata and tensors do"),
                       (whole[:2000], "it ends before its header, metadata and tensors do"),
                       (b"hello world", "does not start with GGUF's magic bytes")):
        (tmp_path / "cut.gguf").write_bytes(data)
        with pytest.raises(WeightError, match=says) as e:
            open_checkpoint(tmp_path / "cut.gguf")
        assert "reshape" not in str(e.value) and "axis" not in str(e.value), e.value
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(WeightError, match="neither a folder, a .safetensors nor a .gguf"):
        open_checkpoint(tmp_path / "weights.bin")


def test_shard_missing_from_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(WeightError, match="shard .*model-00001-of-00002.safetensors named in the index is missing"):
        SafetensorsSource(tmp_path)


@pytest.mark.slow
def test_gguf_layout_must_match_the_config():
    path = bundled_model("smollm2")
    with pytest.raises(WeightError, match="Q/K rows for rope layout 'interleaved' but the config says 'half'"):
        check_weights(build_graph(load_config("smollm2-135m")), GGUFSource(path))
    check_weights(build_graph(load_config(path)), GGUFSource(path))  # the GGUF's own config fits


@pytest.mark.slow
def test_gguf_against_a_different_config_lists_misshapes():
    with pytest.raises(WeightError, match="mis-shaped model.embed_tokens.weight \\(49152, 576\\)"):
        check_weights(build_graph(load_config("tiny")), GGUFSource(bundled_model("smollm2")))


def test_gguf_quantized_types_and_metadata(tmp_path):
    """A llama GGUF written with gguf's own writer, its tensors in Q8_0, Q4_0, Q4_1, Q5_0, F16, BF16 and F32, q/k
    rows permuted as llama.cpp's converter does: the config comes back from the metadata, every tensor equals gguf's
    own quantize -> dequantize round trip, and rope_layout='half' undoes the permutation."""
    import gguf
    from reference import write_gguf

    from llgraph.gguf_source import interleaved_to_half

    T = gguf.GGMLQuantizationType
    types = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.F16, T.BF16]
    cfg = tiny()
    source = random_weights(cfg, seed=9)
    path = tmp_path / "tiny.gguf"
    expected = write_gguf(path, cfg, source, lambda i, name, x: T.F32 if x.ndim == 1 else types[i % len(types)])

    from llgraph.checkpoint import load_config
    back = load_config(path)
    assert (back.hidden_size, back.num_layers, back.num_heads, back.num_kv_heads, back.vocab_size) == \
        (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size)
    assert back.rope.layout == "interleaved" and not back.tie_word_embeddings
    check_weights(build_graph(back), GGUFSource(path))
    stored, half = GGUFSource(path), GGUFSource(path, rope_layout="half")
    seen = set()
    for name, (want, qtype, heads) in expected.items():
        assert np.array_equal(stored.load(name), want), (name, qtype.name)
        if heads:
            assert np.array_equal(half.load(name), interleaved_to_half(want, heads))
        seen.add(qtype.name)
    assert seen == {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "F16", "BF16", "F32"}
