"""The export cache: `llgraph generate CHECKPOINT` exports a checkpoint for ONNX Runtime once and reuses it.

    $LLGRAPH_CACHE_DIR (default ~/.cache/llgraph)/
        SmolLM2-135M-Instruct.Q4_1-ort-float32-3f2a…/   an llgraph export folder (manifest.json names its source)
        hashes.json                                      path+size+mtime -> sha256, so a file is hashed once

An entry is keyed on the checkpoint's *content* (sha256 of its files), llgraph's version, the target, the dtype and
weights mode, and the sources of the CPU kernels it carries: a reinstalled wheel or a copied checkpoint reuses the
entry; a changed file, a new llgraph or changed kernels make a new one.
`llgraph cache list` shows each entry's size and source, and the kernel builds; `llgraph cache verify` hashes every
file against the entry's integrity record; `llgraph cache clean` removes entries (all: the cache is left empty).
An entry that is damaged (no manifest, a file missing or of the wrong size) is exported again by the next `generate`
that needs it (`heal`); a file of the right size whose bytes differ is found by the xxh3 check of every open
(export_folder.Checked) and ends the run in one line naming `llgraph cache clean NAME` — never an answer.
`cache list` and `cache clean` also see what killed Hub downloads left (llgraph/hub.py, cut_downloads).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from llgraph import __version__
from llgraph.errors import LlgraphError
from llgraph.export_folder import BUILD_FILES, CHECKED, LEGACY_FILES, MANIFEST, Manifest, damage, file_sha256
from llgraph.outdir import remove_stale, remove_written, user_cache
from llgraph.plugins import cpu

HASHES = "hashes.json"
ENTRY_NAME = re.compile(r"-(ort|onnx|trt)-[A-Za-z0-9_.-]+-[0-9a-f]{16}$")  # entry_for's: STEM-TARGET-MODE-KEY
_CHECKPOINT_SUFFIXES = {".json", ".safetensors", ".gguf", ".jinja", ".model", ".txt"}


def cache_dir(override: str | Path | None = None) -> Path:
    """--cache-dir, else $LLGRAPH_CACHE_DIR, else ~/.cache/llgraph."""
    return user_cache(override)


def _file_sha256(path: Path, memo: dict) -> str:
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    if key not in memo:
        memo[key] = file_sha256(path)
    return memo[key]


def content_key(checkpoint: Path, root: Path, *parts: str) -> str:
    """sha256 over the checkpoint's files (a file, or a folder's weight/config/tokenizer files) and `parts`."""
    files = [checkpoint] if checkpoint.is_file() else sorted(
        p for p in checkpoint.iterdir() if p.is_file() and p.suffix in _CHECKPOINT_SUFFIXES)
    memo_path = root / HASHES
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    h = hashlib.sha256("|".join((__version__, *parts)).encode())
    for f in files:
        h.update(f"{f.name}:{_file_sha256(f, memo)}".encode())
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f".{HASHES}.{os.getpid()}")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_path)
    except OSError:
        pass  # an unwritable cache only costs re-hashing
    return h.hexdigest()[:16]


def entry_for(checkpoint: Path, root: Path, target: str = "ort", dtype: str = "float32") -> Path:
    """The entry for this content: an existing one under any name (a copy or reinstall has another), else a new
    name that starts with the checkpoint's for `cache list`."""
    # an entry that carries llgraph's kernels is of one version of their sources: a kernel change makes a new entry
    kernels = (cpu.source_key(),) if "-kllgraph" in dtype else ()
    suffix = f"-{target}-{dtype}-{content_key(checkpoint, root, target, dtype, *kernels)}"
    existing = [p for p in root.glob(f"*{suffix}") if (p / MANIFEST).exists()]
    return existing[0] if existing else root / f"{checkpoint.stem}{suffix}"


def superseded(folder: Path) -> list[Path]:
    """Entries of the same checkpoint, target and weights mode as `folder` under another key (an older llgraph or
    older kernels made them): kept, never removed unasked; the caller says how to remove them."""
    prefix = folder.name[:-16]  # entry_for's STEM-TARGET-MODE-, before the key
    return sorted(p for p in folder.parent.glob(f"{prefix}*") if p != folder and len(p.name) == len(folder.name)
                  and (p / MANIFEST).exists())


def _export_files_only(folder: Path) -> bool:
    """A folder without a manifest holds only names an export writes: a damaged entry, not a user's folder."""
    return all(p.is_file() and p.name in {*LEGACY_FILES, *BUILD_FILES, cpu.LIBRARY} for p in folder.iterdir())


def heal(folder: Path) -> str | None:
    """None when cache entry `folder` is whole; else why it must be exported (a damaged entry is removed first: an
    export renames its folder in only once it is complete, so a damaged one is what a disk or a hand did to it)."""
    if not folder.exists():
        return "once"
    manifest = Manifest.find(folder)
    if manifest is None and not _export_files_only(folder):
        raise LlgraphError(f"{folder} has no manifest.json and holds files llgraph did not write; move it out of the "
                           "cache and run again")
    why = "its manifest.json is missing or unreadable" if manifest is None else damage(folder, manifest)
    if why is None:
        return None
    shutil.rmtree(folder)
    return f"again: the entry was damaged, {why}"


@dataclass
class Entry:
    path: Path
    bytes: int
    source: str  # the checkpoint it was exported from; for a damaged entry, what is wrong
    manifest: Manifest | None = None

    @property
    def name(self) -> str:
        return self.path.name


def entries(root: Path) -> list[Entry]:
    """The exports in the cache, and folders named like one that hold no readable manifest (damaged: shown by
    `cache list`, removed by `cache clean`)."""
    found = []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not p.is_dir() or p.is_symlink():  # a linked folder is not an entry llgraph wrote
            continue
        manifest = Manifest.find(p)
        if manifest is None and not (ENTRY_NAME.search(p.name) and _export_files_only(p)):
            continue
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        found.append(Entry(p, size, manifest.weights if manifest else "damaged: no readable manifest.json", manifest))
    return found


def kernel_builds(root: Path) -> tuple[int, int]:
    """llgraph's CPU kernel builds and fetched headers in the cache: (folders, bytes)."""
    folders = cpu.built_here(root)
    return len(folders), sum(f.stat().st_size for d in folders for f in d.rglob("*") if f.is_file())


def verify(root: Path, names: list[str] | None = None) -> list[tuple[Entry, str | None]]:
    """Each entry (the named ones, else all) against its integrity record, every file hashed: (entry, damage)."""
    chosen = _chosen(root, names)
    return [(e, "no readable manifest.json" if e.manifest is None else damage(e.path, e.manifest, hashes=True))
            for e in chosen]


def _chosen(root: Path, names: list[str] | None) -> list[Entry]:
    known = {e.name: e for e in entries(root)}
    missing = [n for n in names or () if n not in known]
    if missing:
        raise LlgraphError(f"no cache entry {', '.join(missing)} in {root}; `llgraph cache list` shows them")
    return [known[n] for n in names] if names else list(known.values())


def clean(root: Path, names: list[str] | None = None) -> tuple[list[Entry], int]:
    """Remove the named entries (all when `names` is empty) and, with all, the hash memos and llgraph's kernel builds
    (plugins/cpu/). Only what llgraph wrote is ever removed. Returns the entries removed and the bytes freed."""
    chosen = _chosen(root, names)
    for e in chosen:
        if e.manifest is None:  # damaged: a folder of export files only (entries()), no manifest to list them
            shutil.rmtree(e.path)
        elif left := remove_written(e.path):
            print(f"llgraph: kept {e.path}: it holds {', '.join(left[:4])}{' ...' if len(left) > 4 else ''}, which "
                  "llgraph did not write", file=sys.stderr)
    freed = sum(e.bytes for e in chosen)
    if not names:  # all: the hash memo, killed runs' folders, llgraph's CPU kernel builds and their headers
        for p in [*root.glob(".*.partial-*"), *root.glob(".*.old-*")]:
            remove_stale(root / p.name[1:].rsplit(".", 1)[0])
        if (root / HASHES).is_file() or (root / HASHES).is_symlink():
            (root / HASHES).unlink()
        if (root / CHECKED).is_dir() and not (root / CHECKED).is_symlink():  # the open checks' memos (Checked)
            shutil.rmtree(root / CHECKED)
        freed += kernel_builds(root)[1]
        for folder in cpu.built_here(root):
            shutil.rmtree(folder)
            if folder.parent != root and folder.parent.is_dir() and not any(folder.parent.iterdir()):
                folder.parent.rmdir()  # kernels/, ort-headers/ once empty
    return chosen, freed
