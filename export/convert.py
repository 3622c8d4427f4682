"""A GGUF file as an HF folder (config.json, model.safetensors in float32, the tokenizer's files), for what wants
one: `--lora` (PEFT trains on HF folders), transformers, a fine-tune.

    llgraph convert model.gguf -o model-hf         # or convert_gguf("model.gguf", "model-hf")

transformers reads the GGUF (its GGUF loader: the architectures it knows — llama, mistral, qwen2, qwen3, gemma2/3,
phi3, ...), dequantizes it and un-permutes Q/K to HF's layout; a GGUF-loaded model will not save itself, so its weights
are copied into a plain model of the same config, which does. Written whole or not at all (outdir.staged_folder).
Needs torch and transformers (the test extra, or `pip install torch transformers`).
"""

from __future__ import annotations

from pathlib import Path

from llgraph.errors import LlgraphError, MissingExtra


def convert_gguf(gguf: str | Path, out: str | Path, force: bool = False) -> Path:
    from llgraph.outdir import staged_folder

    gguf = Path(gguf)
    if not gguf.is_file() or gguf.suffix.lower() != ".gguf":
        raise LlgraphError(f"{gguf} is not a GGUF file; give the path of a .gguf (e.g. `llgraph convert "
                           "model.Q4_K_M.gguf -o model-hf`)")
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise MissingExtra("llgraph convert", "torch transformers", "test", e) from None
    from llgraph.gguf_source import shared_gguf_reads

    try:
        with shared_gguf_reads():  # one parse of the file, not transformers' three
            loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ValueError, KeyError, RuntimeError, OSError) as e:
        raise LlgraphError(f"transformers cannot read {gguf.name} ({str(e).splitlines()[0][:160]}); it converts the "
                           "GGUF architectures transformers knows") from None
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # a GGUF-loaded model will not save; a plain one with its weights does
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    with staged_folder(out, force=force, what="convert output") as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out)
