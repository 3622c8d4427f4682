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
import os
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
CHECKED = "checked"  # under the user cache: Checked's memos, a file per export folder opened
# what an export wrote before manifests listed their files
HASH_ON_OPEN = 64 << 20  # an export without an xxh3 record: files up to this size are sha256'd in the foreground
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
    window_ring: bool = False  # the windowed layers' attention takes a ring cache (llgraph/kv_cache.py ring_length)
    sizes: dict = field(default_factory=dict)  # the integrity record: file -> bytes, as export wrote them
    sha256: dict = field(default_factory=dict)  # file -> sha256 (`llgraph cache verify`; provenance)
    xxh3: dict = field(default_factory=dict)  # file -> xxh3-128: every file checked at each open (Checked)
    model: str = MODEL_FILE
    data: str = DATA_FILE
    llgraph_version: str = __version__
    format: str = FORMAT

    def write(self, folder: Path) -> None:
        data = asdict(self)
        data["config"] = self.config.to_dict()
        data = {"format": data.pop("format"), "llgraph_version": data.pop("llgraph_version"), **data}
        (Path(folder) / MANIFEST).write_text(json.dumps({**data, SEAL: seal(data)}, indent=2))

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


SEAL = "seal"  # the manifest's own digest: a manifest edited after export (an eos id, the vocabulary size) is damage


def seal(data: dict) -> str:
    """sha256 of a manifest's fields (less its seal), in one canonical JSON form."""
    body = {k: v for k, v in data.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def manifest_damage(folder: Path) -> str | None:
    """Whether manifest.json is the one export wrote: its seal, where it has one (exports before 0.14 have none)."""
    try:
        data = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{MANIFEST} cannot be read"
    if isinstance(data, dict) and SEAL in data and data[SEAL] != seal(data):
        return f"{MANIFEST} is not the file export wrote: edited after export, its seal differs"
    return None


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


XXH3_CHUNK = 128 << 20  # a file's xxh3 is over its chunks' digests: the chunks hashed on every core


def file_xxh3(path: Path) -> str:
    """xxh3-128 (xxhash) of the xxh3-128 digests of a file's 128 MiB chunks, hashed in parallel over a memory map
    (each call releases the GIL: ~18 GB/s a core from the page cache, the machine's read bandwidth on all)."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    size = path.stat().st_size
    if not size:
        return xxhash.xxh3_128(b"").hexdigest()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as view:
        chunks = [view[i:i + XXH3_CHUNK] for i in range(0, size, XXH3_CHUNK)]
        try:
            with ThreadPoolExecutor(min(len(chunks), os.cpu_count() or 1)) as pool:
                digests = list(pool.map(lambda chunk: xxhash.xxh3_128(chunk).digest(), chunks))
        finally:
            for chunk in chunks:
                chunk.release()
    return xxhash.xxh3_128(b"".join(digests)).hexdigest()


def integrity_record(folder: Path, names) -> dict:
    """The manifest's integrity record (export writes it last): sizes, sha256 and xxh3 of the files `names`."""
    paths = {name: Path(folder) / name for name in sorted(names)}
    return {"sizes": {n: p.stat().st_size for n, p in paths.items()},
            "sha256": {n: file_sha256(p) for n, p in paths.items()},
            "xxh3": {n: file_xxh3(p) for n, p in paths.items()}}


def damage(folder: Path, manifest: Manifest, hashes: bool = False) -> str | None:
    """What differs from the integrity record, in a few words, or None: every size; the sha256 of every file with
    `hashes` (`cache verify`), else of the small ones where the export has no xxh3 record (an older export). The
    xxh3 of every file is Checked's, in the background of an open. A folder exported before the record existed has
    nothing to check. The manifest itself by its seal."""
    if (why := manifest_damage(folder)) is not None:
        return why
    for name, size in manifest.sizes.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size:,} bytes where export wrote {size:,}"
    for name, digest in manifest.sha256.items():
        small = manifest.sizes.get(name, 0) <= HASH_ON_OPEN and not manifest.xxh3
        if (hashes or small) and file_sha256(Path(folder) / name) != digest:
            return f"{name} is not the file export wrote (its sha256 differs)"
    return None


class Checked:
    """Every file of an export checked against its record in a background thread, while the runner loads and runs
    its first forward; `result()` waits for it (the backend calls it before its first answer) and says the damage,
    or None. xxh3-128 where the export recorded it (an older export: its large files' sha256).

    A file whose size, mtime, ctime and inode are those of its last matching hash (`memo`: a file in the user
    cache's CHECKED/, never one in the export folder) is not hashed again: any write to it through the file system
    — a program, an editor, a copy, a `touch` — moves its ctime, which no user-space call sets back. So a warm start
    costs nothing, and the first open after a change (an export, a copy, a hand) hashes what changed: ~0.2 s for
    4.5 GB here, beside the first forward."""

    def __init__(self, folder: Path, manifest: Manifest, memo: Path | None = None):
        import threading

        self.folder, self.memo = Path(folder), memo
        self._why: str | None = None
        record = manifest.xxh3 or {n: d for n, d in manifest.sha256.items() if manifest.sizes.get(n, 0) > HASH_ON_OPEN}
        hasher = file_xxh3 if manifest.xxh3 else file_sha256
        self._thread = threading.Thread(target=self._run, args=(record, hasher), daemon=True, name="llgraph-check")
        self._thread.start()

    def _run(self, record: dict, hasher) -> None:
        try:
            memo = json.loads(self.memo.read_text()) if self.memo else {}
        except (OSError, ValueError):
            memo = {}
        seen, hashed = {}, False
        for name, digest in record.items():
            try:
                st = (self.folder / name).stat()
                seen[name] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, digest]
                if memo.get(name) == seen[name]:
                    continue
                hashed = True
                try:
                    same = hasher(self.folder / name) == digest
                except RuntimeError:  # the interpreter is exiting (a one-line error, say): nothing awaits this check
                    return
                if not same:
                    self._why = f"{name} is not the file export wrote (its {hasher.__name__[5:]} differs)"
                    return
            except OSError as e:
                self._why = f"{name} cannot be read ({e.strerror or e})"
                return
        if hashed and self.memo:
            try:  # best effort: an unwritable cache only costs hashing at each open
                self.memo.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.memo.with_name(f".{self.memo.name}.{os.getpid()}")
                tmp.write_text(json.dumps(seen))
                tmp.replace(self.memo)
            except OSError:
                pass

    def result(self) -> str | None:
        self._thread.join()
        return self._why


def check_damage(folder: Path, why: str | None) -> None:
    """One line naming the fix when an export folder is damaged (`why` from damage() or Checked)."""
    if why:
        raise ExportFolderError(f"{folder} is damaged ({why}): a cache entry: `llgraph cache clean {Path(folder).name}`"
                                f", then run again; an export of yours: export it again (llgraph export ... --force -o "
                                f"{folder})")
