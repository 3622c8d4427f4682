"""Test helpers: drive llgraph's executor step by step, and build the independent HF transformers twin."""

from __future__ import annotations

from pathlib import Path

import torch

from llgraph.builder import build_graph, cache_pairs, new_cache
from llgraph.config import LlamaConfig
from llgraph.executor import TORCH_DTYPES, TorchExecutor, as_torch
from llgraph.weights import WeightSource


class Stepper:
    """Prefill then cached decode against a static cache of max_seq slots (what the runtime loop will do)."""

    def __init__(self, cfg: LlamaConfig, source: WeightSource, batch: int = 1, max_seq: int = 64,
                 dtype: str = "float32", graph=None, device: str = "cpu"):
        self.cfg, self.graph = cfg, graph or build_graph(cfg, dtype)
        self.ex = TorchExecutor(self.graph, source, device)
        self.cache = new_cache(cfg, batch, max_seq,
                               lambda shape: torch.zeros(shape, dtype=TORCH_DTYPES[dtype], device=device))
        self.pos = 0

    def step(self, ids: torch.Tensor, record=()) -> dict[str, torch.Tensor]:
        b, s = ids.shape
        positions = torch.arange(self.pos, self.pos + s).expand(b, s)
        out = self.ex.run({"input_ids": ids, "position_ids": positions, **self.cache}, record=record)
        for past, present in cache_pairs(self.cfg):  # present is the same storage as past: nothing to copy
            assert out[present].data_ptr() == self.cache[past].data_ptr()
        self.pos += s
        return out


def hf_config(cfg: LlamaConfig):
    """transformers' LlamaConfig for the same model, written from transformers' documented fields."""
    from transformers import LlamaConfig as HFLlamaConfig

    r = cfg.rope
    rope = {"rope_type": r.type, "rope_theta": r.theta}
    if r.type == "ntk":  # transformers has no static NTK type: it is the default RoPE with a stretched base
        d = r.rotary_dim
        rope = {"rope_type": "default", "rope_theta": r.theta * r.factor ** (d / (d - 2))}
    elif r.type in ("linear", "dynamic"):
        rope["factor"] = r.factor
    elif r.type == "llama3":
        rope.update(factor=r.factor, low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                    original_max_position_embeddings=r.original_max_position_embeddings)
    elif r.type == "yarn":
        rope.update(factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                    beta_fast=r.beta_fast, beta_slow=r.beta_slow)
    return HFLlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias,
        rope_parameters=rope, bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) or None,
    )


def hf_model(cfg: LlamaConfig, source: WeightSource, attn: str = "eager", unread: str | None = None):
    """LlamaForCausalLM (fp32, eager attention) holding the source's weights, in HF's half-split layout. `unread`:
    a name fragment of HF params the source has no tensors for (a reference that never reads them)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config(cfg)).eval()
    model.config._attn_implementation = attn
    state = {n: as_torch(source.load(n)) for n in source.names()}
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    missing = {k for k in result.missing_keys if not (unread and unread in k)}
    assert missing <= {"lm_head.weight"} and (cfg.tie_word_embeddings or not missing), missing
    return model


TINY = dict(name="tiny-test", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
            num_kv_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128, rope={"theta": 10000.0})


def tiny(**changes) -> LlamaConfig:
    """A tiny config: TINY with `changes`; a `rope` dict is merged into TINY's."""
    rope = dict(TINY["rope"], **changes.pop("rope", {}))
    return LlamaConfig(**dict(TINY, **changes, rope=rope))


class OrtStepper:
    """The same prefill/decode steps through ONNX Runtime on an exported folder (plain run; presents fed back)."""

    def __init__(self, folder, cfg: LlamaConfig, batch: int = 1, max_seq: int = 64):
        import numpy as np
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if (folder / "libllgraph_ort.so").exists():  # an export on llgraph's CPU kernels carries them
            opts.register_custom_ops_library(str(folder / "libllgraph_ort.so"))
        self.session = ort.InferenceSession(str(folder / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        self.cfg, self.pos = cfg, 0
        self.cache = new_cache(cfg, batch, max_seq, lambda shape: np.zeros(shape, np.float32))
        self.outputs = [o.name for o in self.session.get_outputs()]

    def step(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        import numpy as np

        b, s = ids.shape
        positions = np.broadcast_to(np.arange(self.pos, self.pos + s), (b, s)).astype(np.int64)
        feeds = {"input_ids": ids.numpy().astype(np.int64), "position_ids": positions, **self.cache}
        out = dict(zip(self.outputs, self.session.run(self.outputs, feeds)))
        for past, present in cache_pairs(self.cfg):
            self.cache[past] = out[present]
        self.pos += s
        return {k: torch.from_numpy(v) for k, v in out.items()}


def gguf_writer(path, arch: str, cfg: LlamaConfig):
    """gguf's own writer for `arch`, with the model metadata llama.cpp's converter writes."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-gguf")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_vocab_size(cfg.vocab_size)
    return w


def copying_fields(src, dst, skip=()):
    """A gguf writer at `dst` with every metadata field of the GGUFReader `src` (its architecture's too) but the keys
    in `skip`."""
    import gguf

    w = gguf.GGUFWriter(str(dst), src.fields["general.architecture"].contents())
    for key, f in src.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture" and key not in skip:
            kind = f.types[0]
            w.add_array(key, f.contents()) if kind == gguf.GGUFValueType.ARRAY else \
                w.add_key_value(key, f.contents(), kind)
    return w


def truncated_gguf(src, dst, layers: int):
    """A copy of the GGUF `src` keeping its first `layers` blocks (tensors as stored, every other field as is): a
    real model's tokenizer, template and shapes at a fraction of its forward's cost, for tests that hold the model's
    surroundings (a server's answers to hostile input, a runtime against itself), not its quality."""
    import re

    import numpy as np

    from llgraph.gguf_source import gguf_reader

    r = gguf_reader(src)
    key = f"{r.fields['general.architecture'].contents()}.block_count"
    w = copying_fields(r, dst, skip={key})
    w.add_uint32(key, layers)
    for t in r.tensors:
        if not ((m := re.match(r"blk\.(\d+)\.", t.name)) and int(m[1]) >= layers):
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    finish_gguf(w)
    return dst


def finish_gguf(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(path, cfg: LlamaConfig, source: WeightSource, qtype_of, fields=None) -> dict:
    """A llama GGUF written with gguf's own writer: config metadata, every tensor of `source` in
    `qtype_of(index, hf_name, array)`, q/k rows permuted as llama.cpp's converter does; `fields(writer)` adds more
    metadata (a tokenizer). Returns, per HF name, (gguf's own dequantization of what was written, its type, the head
    count for q/k rows or None)."""
    import gguf.quants as gq

    from llgraph.gguf_source import _GGUF_NAMES

    to_gguf = {v: k for k, v in _GGUF_NAMES.items()}
    w = gguf_writer(path, "llama", cfg)
    w.add_rope_dimension_count(cfg.head_dim)
    expected = {}
    for i, name in enumerate(source.names()):
        x = source.load(name)
        heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}.get(name.split(".")[-2])
        if heads:  # HF rows (i, i + d/2) -> GGUF rows (2i, 2i+1), as convert_hf_to_gguf permutes them
            d = x.shape[0] // heads
            x = x.reshape(heads, 2, d // 2, -1).swapaxes(1, 2).reshape(x.shape)
        qtype = qtype_of(i, name, x)
        data = random_k_blocks(x.shape, qtype, seed=i) if qtype.name in _K_LAYOUT else gq.quantize(x, qtype)
        try:
            expected[name] = (gq.dequantize(data, qtype).reshape(x.shape), qtype, heads)
        except NotImplementedError:  # a type gguf cannot read (a refusal's test)
            expected[name] = (None, qtype, heads)
        stem, kind = name.rsplit(".", 1)
        m = stem.split(".")
        gname = (f"blk.{m[2]}.{to_gguf['.'.join(m[3:])]}" if stem.startswith("model.layers.") else to_gguf[stem])
        w.add_tensor(f"{gname}.{kind}", data, raw_shape=data.shape, raw_dtype=qtype)
    if fields is not None:
        fields(w)
    finish_gguf(w)
    return expected


# (bytes per super-block, {offset of a float16: its value}): d*sc*q and dmin*m balance on average (zero-mean weights)
_K_LAYOUT = {"Q4_K": (144, {0: 1e-3, 2: 7.5e-3}), "Q5_K": (176, {0: 5e-4, 2: 7.75e-3}), "Q6_K": (210, {208: 2e-4}),
             "IQ4_XS": (136, {0: 2e-4}), "IQ4_NL": (18, {0: 3.5e-3}),  # (IQ4_NL: blocks of 32)
             "Q3_K": (110, {108: 6e-3}), "Q2_K": (84, {80: 1.5e-2, 82: 2.25e-2}),
             # the types read exactly as 8-bit blocks (llgraph/quant_grid.py); IQ1_M's d and MXFP4's exponent below
             "IQ2_XXS": (66, {0: 5e-3}), "IQ2_XS": (74, {0: 5e-3}), "IQ2_S": (82, {0: 5e-3}),
             "IQ3_XXS": (98, {0: 2e-3}), "IQ3_S": (110, {0: 2e-3}), "IQ1_S": (50, {0: 3e-2}), "IQ1_M": (56, {}),
             "TQ1_0": (54, {52: 0.25}), "TQ2_0": (66, {64: 0.25}), "MXFP4": (17, {}), "NVFP4": (36, {}),
             "Q1_0": (18, {0: 0.25})}


def random_k_blocks(shape, qtype, seed: int):
    """K-quant (and IQ4) blocks of random codes, sub-block scales and mins (gguf cannot quantize to them), with
    float16 d/dmin chosen so the weights are zero-mean, std ~0.25: valid blocks of a [rows, cols] tensor, as the
    writer takes."""
    import numpy as np

    size, halves = _K_LAYOUT[qtype.name]
    rows, cols = shape
    per = {"IQ4_NL": 32, "MXFP4": 32, "NVFP4": 64, "Q1_0": 128}.get(qtype.name, 256)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for offset, value in halves.items():
        raw[..., offset:offset + 2] = np.full(raw.shape[:-1] + (1,), value, np.float16).view(np.uint8)
    if qtype.name == "MXFP4":  # e8m0 exponents near 2^-4 (values up to 12 times it)
        raw[..., 0] = rng.integers(123, 126, size=raw.shape[:-1])
    if qtype.name == "NVFP4":  # E4M3 scales near 2^-5 (exponent field 2..4, bias 7)
        raw[..., 0:4] = (rng.integers(2, 5, size=(*raw.shape[:-1], 4)) << 3) | rng.integers(0, 8, (*raw.shape[:-1], 4))
    if qtype.name == "IQ1_M":  # d's 16 bits in the top nibbles of the 4 scale words (bytes 49, 51, 53, 55)
        d = int(np.float16(3e-2).view(np.uint16))
        for i in range(4):
            raw[..., 49 + 2 * i] = (raw[..., 49 + 2 * i] & 0x0F) | (((d >> (4 * i)) & 15) << 4)
    return raw.reshape(rows, -1)


def write_hf_checkpoint(folder, cfg: LlamaConfig, source: WeightSource):
    """An HF-style checkpoint folder: config.json (llgraph's JSON of `cfg`) + model.safetensors of `source`."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: as_torch(source.load(n)).contiguous() for n in source.names()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    return folder


def hf_folder_from_gguf(gguf_path, folder):
    """A plain HF folder (config.json, model.safetensors, tokenizer) of what transformers reads from a GGUF: its own
    dequantization, so tools that take only HF folders (lm-eval's `hf` model) see the same weights."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llgraph.gguf_source import shared_gguf_reads

    gguf_path = Path(gguf_path)
    kw = {"gguf_file": gguf_path.name}
    with shared_gguf_reads():  # gguf's parse of the file, once, not transformers' three times
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    tied = model.config.tie_word_embeddings
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)  # the weights are plain float32 now
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(folder)
    return folder
