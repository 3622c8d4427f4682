"""The export folder's format, in one place: its file names and its manifest, written by export and read by the
runners, `llgraph build`, the export cache and `--force`.

    FOLDER/model.onnx, model.onnx.data      the graph and its weights (external data)
    FOLDER/manifest.json                    Manifest: what was exported, how, and every file export wrote
    FOLDER/genai_config.json, tokenizer...  what the target and the checkpoint add
    FOLDER/model.engine, engine.json        what `llgraph build` adds (a `trt` or `onnx` export)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llgraph import __version__
from llgraph.config import LlamaConfig
from llgraph.errors import LlgraphError

MANIFEST = "manifest.json"
FORMAT = "llgraph-onnx"
MODEL_FILE, DATA_FILE = "model.onnx", "model.onnx.data"
ENGINE_FILE, ENGINE_META, TIMING_CACHE = "model.engine", "engine.json", "timing.cache"
BUILD_FILES = (ENGINE_FILE, ENGINE_META, TIMING_CACHE)  # what `llgraph build` adds to an export folder
# what an export wrote before manifests listed their files
HASH_ON_OPEN = 64 << 20  # files up to this size are hashed each time a folder is opened; larger ones by `cache verify`
LEGACY_FILES = (MODEL_FILE, DATA_FILE, MANIFEST, "genai_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "generation_config.json", "chat_template.jinja")


class ExportFolderError(LlgraphError):
    """A folder that is not the export a command needs; one line naming how to make one."""


@dataclass(frozen=True)
class Manifest:
    target: str  # ort | onnx | trt
    dtype: str
    config: LlamaConfig
    max_positions: int  # the RoPE range the export tabulates: the longest cache it can run
    weights: str  # the source's description
    files: tuple[str, ...] = ()  # every file export wrote (manifest.json included)
    quantized: dict = field(default_factory=dict)  # "int4/b32/zp0" -> number of QLinears
    options: dict = field(default_factory=dict)  # the target's options (accuracy_level)
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    sizes: dict = field(default_factory=dict)  # the integrity record: file -> bytes, as export wrote them
    sha256: dict = field(default_factory=dict)  # file -> sha256 (checked on open below HASH_ON_OPEN, else by verify)
    model: str = MODEL_FILE
    data: str = DATA_FILE
    llgraph_version: str = __version__
    format: str = FORMAT

    def write(self, folder: Path) -> None:
        data = asdict(self)
        data["config"] = self.config.to_dict()
        data = {"format": data.pop("format"), "llgraph_version": data.pop("llgraph_version"), **data}
        (Path(folder) / MANIFEST).write_text(json.dumps(data, indent=2))

    @classmethod
    def read(cls, folder: str | Path) -> Manifest:
        """The manifest of an export folder; one line saying how to make one when `folder` is not one."""
        folder = Path(folder)
        found = cls.find(folder)
        if found is None:
            raise ExportFolderError(f"{folder} is not an llgraph export folder (no manifest.json); make one with "
                                    "`llgraph export`")
        return found

    @classmethod
    def find(cls, folder: Path) -> Manifest | None:
        """The manifest, or None where `folder` holds no llgraph export."""
        try:
            data = json.loads((Path(folder) / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return None
        known = set(cls.__dataclass_fields__)
        data = {k: v for k, v in data.items() if k in known}
        data["config"] = LlamaConfig(**data["config"])
        data.setdefault("weights", "?")
        data["files"] = tuple(data.get("files") or LEGACY_FILES)
        for key in ("inputs", "outputs"):
            data[key] = tuple(data.get(key) or ())
        data.setdefault("max_positions", data["config"].max_position_embeddings)
        return cls(**data)

    def written_files(self, folder: Path) -> set[str]:
        """Every name llgraph wrote into the folder: the export's files, and what `llgraph build` added."""
        names = {*self.files, MANIFEST, *BUILD_FILES}
        try:
            names.add(str(json.loads((Path(folder) / ENGINE_META).read_text()).get("engine")))
        except (OSError, ValueError, AttributeError):
            pass
        return names


def llgraph_files(folder: Path) -> set[str] | None:
    """Names llgraph wrote into `folder`, or None if it is not an llgraph export folder."""
    manifest = Manifest.find(folder)
    return None if manifest is None else manifest.written_files(folder)


def file_sha256(path: Path) -> str:
    """A file's sha256, read 8 MB at a time (the export cache's keys, the integrity record, the kernel library's)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def integrity_record(folder: Path, names) -> tuple[dict, dict]:
    """Sizes and sha256 of the files `names` in `folder`, for the manifest (export writes it last)."""
    paths = {name: Path(folder) / name for name in sorted(names)}
    return {n: p.stat().st_size for n, p in paths.items()}, {n: file_sha256(p) for n, p in paths.items()}


def damage(folder: Path, manifest: Manifest, hashes: bool = False) -> str | None:
    """What differs from the integrity record, in a few words, or None: every size; the hashes of small files (all
    with `hashes`). A folder exported before the record existed has nothing to check."""
    for name, size in manifest.sizes.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size:,} bytes where export wrote {size:,}"
    for name, digest in manifest.sha256.items():
        small = manifest.sizes.get(name, 0) <= HASH_ON_OPEN
        if (hashes or small) and file_sha256(Path(folder) / name) != digest:
            return f"{name} is not the file export wrote (its sha256 differs)"
    return None
