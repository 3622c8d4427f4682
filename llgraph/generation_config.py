"""The sampling a model's makers recommend, read where checkpoints carry it, and what a request that names no
sampling field gets.

    recommended(folder_or_gguf) -> Recommended(values, source)

An HF folder carries it in `generation_config.json` (`temperature`, `top_k`, `top_p`, `min_p`,
`repetition_penalty`: the fields vLLM takes from it); a GGUF in `general.sampling.*` (llama.cpp's converter writes
them from the same file: `temp`, `top_k`, `top_p`, `min_p`, `penalty_repeat`). An export folder holds the
checkpoint's as `generation_config.json` (a GGUF's keys written there at export). A field the model does not name
takes llama-server's default (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05): sampling at temperature 1 over the
whole vocabulary, OpenAI's default, makes a small model answer nonsense."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FILE = "generation_config.json"
# llama-server's defaults (common/common.h's common_params_sampling), for a field the model leaves unnamed
LLAMA_SERVER = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}
# generation_config.json's field -> the GGUF key llama.cpp's converter writes it to (gguf-py's Keys.General)
GGUF_KEYS = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k",
             "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p",
             "repetition_penalty": "general.sampling.penalty_repeat"}
_TYPES = {"top_k": int}


@dataclass(frozen=True)
class Recommended:
    values: dict  # every field of LLAMA_SERVER
    source: dict  # field -> where its value came from ("generation_config.json", "GGUF", "llama-server")

    def describe(self) -> str:
        """One line: `temperature 0.7 (generation_config.json), top_k 40 (llama-server), ...`."""
        return ", ".join(f"{k} {v:g} ({self.source[k]})" for k, v in self.values.items())


def of_gguf(reader) -> dict:
    """The sampling fields a GGUF names (general.sampling.*), as generation_config.json's fields."""
    from llgraph.gguf_source import metadata

    found = {field: metadata(reader, key) for field, key in GGUF_KEYS.items()}
    return _checked({k: v for k, v in found.items() if v is not None})


def of_folder(folder: str | Path) -> dict:
    """The sampling fields a folder's generation_config.json names ({} without one, or one that is unreadable)."""
    path = Path(folder) / FILE
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return _checked({k: data[k] for k in LLAMA_SERVER if isinstance(data, dict) and data.get(k) is not None})


def recommended(ref: str | Path | None) -> Recommended:
    """The model's own sampling fields (a folder's generation_config.json, a GGUF's keys) over llama-server's."""
    own, where = {}, ""
    if ref is not None and Path(ref).suffix == ".gguf" and Path(ref).is_file():
        from llgraph.gguf_source import gguf_reader

        own, where = of_gguf(gguf_reader(ref)), "GGUF"
    elif ref is not None and Path(ref).is_dir():
        own, where = of_folder(ref), FILE
    return Recommended({**LLAMA_SERVER, **own}, {k: where if k in own else "llama-server" for k in LLAMA_SERVER})


# what a field may hold to be taken (else llama-server's default stands): vLLM's top_k -1 means "off", as 0 here
_VALID = {"temperature": lambda v: 0 <= v <= 100, "top_k": lambda v: v >= -1, "top_p": lambda v: 0 < v <= 1,
          "min_p": lambda v: 0 <= v <= 1, "repetition_penalty": lambda v: 0 < v <= 100}


def _checked(values: dict) -> dict:
    """Numbers in their field's range only, of its type (top_k -1 as 0: off); anything else (a file's
    `"top_k": null`, a string, a top_p of 0) is left out."""
    out = {}
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _VALID[k](v):
            continue
        out[k] = max(_TYPES.get(k, float)(v), 0)
    return out
