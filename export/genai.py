"""genai_config.json for the `ort` target, so onnxruntime-genai runs an llgraph export folder unchanged.

The model takes `position_ids` (not `attention_mask`) and a static cache bound as past and present
(`past_present_share_buffer`), the same contract llgraph's own runners use.
"""

from __future__ import annotations

import json
from pathlib import Path

from llgraph.config import LlamaConfig


def genai_config(cfg: LlamaConfig, context_length: int, model_file: str = "model.onnx") -> dict:
    eos = list(cfg.eos_token_ids)
    return {
        "model": {
            "type": cfg.family,  # llama, mistral, qwen2, phi3: each a model type onnxruntime-genai knows
            "bos_token_id": cfg.bos_token_id if cfg.bos_token_id is not None else 0,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": eos[0] if eos else 0,
            "context_length": context_length,
            "vocab_size": cfg.vocab_size,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": model_file,
                "head_size": cfg.head_dim,
                "hidden_size": cfg.hidden_size,
                "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads,
                "num_hidden_layers": cfg.num_layers,
                "inputs": {"input_ids": "input_ids", "position_ids": "position_ids",
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        "search": {"do_sample": False, "max_length": context_length, "min_length": 0, "num_beams": 1,
                   "num_return_sequences": 1, "past_present_share_buffer": True, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0, "early_stopping": True, "length_penalty": 1.0,
                   "no_repeat_ngram_size": 0, "diversity_penalty": 0.0},
    }


def write_genai_config(folder: Path, manifest, custom_ops_library: str | None = None) -> None:
    """genai's config for the export in `folder`; with `custom_ops_library` (a path relative to the folder) genai
    registers llgraph's CPU kernels, as ORTRunner does."""
    config = genai_config(manifest.config, manifest.max_positions, manifest.model)
    if custom_ops_library:
        config["model"]["decoder"]["session_options"]["custom_ops_library"] = custom_ops_library
    (Path(folder) / "genai_config.json").write_text(json.dumps(config, indent=2))
