"""llgraph's ONNX Runtime CPU kernels: the custom ops of domain "llgraph" in plugins/cpu/*.cc, built once per
machine into the user cache and loaded with `SessionOptions.register_custom_ops_library`.

    path = library()           # the built library (built now if needed, with a progress line), or None
    why_not()                  # one line: why there is none, and how to get it

Headers: ONNX Runtime's C/C++ API headers come from $ORT_INCLUDE_DIR, else the system's (Debian 13+'s
libonnxruntime-dev), else Debian's archive: that package (85 KB, MIT) is fetched once into the user cache with a
private apt sources list, so nothing of the system's apt setup is touched. Built against API version 21
(ONNX Runtime 1.21), the library runs on that runtime or a newer one. The compiler: $CXX, else g++ or c++.
Instruction sets are chosen when the library loads (AVX-512 VNNI for level 4's int8 dots, AVX-512, AVX2+FMA or
scalar; LLGRAPH_CPU_ISA caps it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llgraph.export_folder import file_sha256
from llgraph.outdir import user_cache

DOMAIN = "llgraph"
LIBRARY = "libllgraph_ort.so"
SOURCE = Path(__file__).parent / "llgraph_ort.cc"
SOURCES = sorted([*SOURCE.parent.glob("*.cc"), *SOURCE.parent.glob("*.inc")])  # what the build key covers
HEADERS_PACKAGE = "libonnxruntime-dev"  # Debian 13 (trixie): ONNX Runtime 1.21's headers
HEADERS_SUITE = "deb http://deb.debian.org/debian trixie main"
BUILDS, HEADERS = "kernels", "ort-headers"  # under the user cache: one folder per build key, the fetched headers
CHECKSUM = ".sha256"  # beside the built library: its sha256, checked before each use (a damaged one is rebuilt)
BUILD_LOG = "build.log"  # beside the built library: its command line, then the compiler's warning lines (FLAGS)
FAILED, RETRY_AFTER = ".failed", 3600  # a failed header fetch, remembered an hour (an unreachable archive costs
# each run ~7 s of apt-get timeouts before the fallback to ONNX Runtime's own ops)
SCRATCH = "tmp-fetch-"  # the headers' scratch folders: tmp-fetch-PID-…, removed by the next fetch once PID is dead
ISA_ENV = "LLGRAPH_CPU_ISA"  # avx512vnni | avx512 | avx2 | scalar: the widest instruction set the kernels may use
SANITIZE_ENV = "LLGRAPH_CPU_SANITIZE"  # 1: build (and use) the kernels under AddressSanitizer and UBSan, for tests
# (the process must preload the compiler's libasan: tests/plugins/test_cpu_hardening.py)
FLAGS = ["-std=c++17", "-O3", "-Wall", "-Wextra", "-fPIC", "-shared", "-fvisibility=hidden"]
# GCC's link-time optimisation spreads the one translation unit's code generation over the machine's cores: 16.0 ->
# 9.5 s of a first run's build on 2 cores (user time 15.4 -> 13.3 s), the same kernels; another compiler builds it
# without (clang's LTO wants a linker plugin the machine may lack)
PARALLEL = ["-flto=auto"]
SANITIZED = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]

_why_not: str | None = None


class KernelsUnavailable(Exception):
    """Why llgraph's CPU kernels cannot be built or loaded here; one line."""


def library(progress: bool = True, build: bool = True) -> Path | None:
    """The kernel library for this machine, built into the user cache on first use (`build`: else only one built
    before); None (see why_not()) where there is none."""
    global _why_not
    try:
        return _built(progress, build)
    except KernelsUnavailable as e:
        _why_not = str(e)
        return None


def status() -> str:
    """One line for `llgraph --version`: whether the kernels are built here, and the instruction set they run."""
    path = library(progress=False, build=False)
    if path is None:
        return f"CPU kernels: not built ({why_not()})"
    return f"CPU kernels: {isa(path)} ({path})"


def why_not() -> str:
    return _why_not or "llgraph's CPU kernels were not looked for"


def isa(path: Path) -> str:
    """The instruction set the library runs with in this process (after LLGRAPH_CPU_ISA)."""
    f = ctypes.CDLL(str(path)).llgraph_cpu_isa
    f.restype = ctypes.c_char_p
    return f().decode()


def built_here(root: Path) -> list[Path]:
    """What this module wrote under cache root `root`: each build's folder (named by its key, holding the library,
    its checksum and partial builds only), the fetched headers and any scratch folder a killed fetch left;
    `llgraph cache clean` removes them with the exports. Anything else there is left alone."""
    def ours(name: str) -> bool:
        return name in (LIBRARY, LIBRARY + CHECKSUM) or name.endswith(".partial")
    builds = [d for d in sorted((root / BUILDS).glob("*")) if d.is_dir() and len(d.name) == 16
              and all(c in "0123456789abcdef" for c in d.name) and all(ours(p.name) for p in d.iterdir())]
    headers = [d for d in sorted((root / HEADERS).glob("*"))
               if d.is_dir() and (d.name == "x" or d.name.startswith(SCRATCH))]
    return builds + headers


def _intact(out: Path) -> bool:
    """The built library is the one the build wrote (its checksum beside it) and loads."""
    record = out.with_name(LIBRARY + CHECKSUM)
    try:
        if record.read_text().strip() != file_sha256(out):
            return False
        isa(out)
    except (OSError, AttributeError):
        return False
    return True


def _ago(path: Path) -> str:
    minutes = int((time.time() - path.stat().st_mtime) // 60)
    return f"{minutes} min ago" if minutes else "just now"


def _remove_stale(folder: Path, pattern: str) -> None:
    """Partial builds or scratch folders (named with their writer's PID) whose writer is dead: a killed run's."""
    for p in folder.glob(pattern):
        try:
            pid = int(p.name.split(".")[1] if p.name.startswith(".") else p.name.split("-")[2])
            os.kill(pid, 0)
            continue  # its writer is alive
        except ProcessLookupError:
            pass
        except (ValueError, IndexError, PermissionError):
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def source_key() -> str:
    """The kernels' sources, hashed (16 hex digits): an export that carries a build of them is of this version of
    the kernels (the export cache keys its entries on it, so a kernel change is never served by an old copy)."""
    key = hashlib.sha256()
    for path in SOURCES:
        key.update(path.read_bytes())
    return key.hexdigest()[:16]


def _built(progress: bool, build: bool = True) -> Path:
    if sys.platform != "linux":
        raise KernelsUnavailable(f"llgraph's CPU kernels are built for Linux; this is {sys.platform}")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler or not shutil.which(compiler):
        raise KernelsUnavailable("no C++ compiler (g++) to build llgraph's CPU kernels; install one "
                                 "(apt-get install g++) or set $CXX")
    headers = _headers(progress, fetch=build)
    key = hashlib.sha256()
    for path in SOURCES:
        key.update(path.read_bytes())
    version, gcc = _version(compiler)
    flags = FLAGS + (SANITIZED if os.environ.get(SANITIZE_ENV) == "1" else PARALLEL if gcc else [])
    key.update(version.encode() + (headers / "onnxruntime_c_api.h").read_bytes() + " ".join(flags).encode())
    out = user_cache() / BUILDS / key.hexdigest()[:16] / LIBRARY
    damaged = out.exists() and not _intact(out)
    if out.exists() and not damaged:
        return out
    if not build:
        raise KernelsUnavailable("they build on first use: `llgraph export ... --kernels llgraph`")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out.parent, ".*.partial")
    if progress:
        unrecorded = not out.with_name(LIBRARY + CHECKSUM).exists()  # built before libraries had checksums
        why = "once" if not damaged or unrecorded else "again: the library there is damaged"
        print(f"building llgraph's CPU kernels ({why}, into {out.parent}) ...", file=sys.stderr, flush=True)
    partial = out.parent / f".{os.getpid()}.{os.urandom(4).hex()}.partial"
    cmd = [compiler, *flags, f"-I{headers}", f"-I{SOURCE.parent}", str(SOURCE), "-o", str(partial)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            first = next((line for line in r.stderr.splitlines() if "error" in line), r.stderr.strip()[:200])
            raise KernelsUnavailable(f"building llgraph's CPU kernels failed ({first}); report it, or use "
                                     "--kernels standard")
        said = [line for line in r.stderr.splitlines() if ": warning: " in line or ": error: " in line]
        out.with_name(BUILD_LOG).write_text("\n".join([" ".join(cmd), *said]) + "\n")  # not 1.8 MB of context
        out.with_name(LIBRARY + CHECKSUM).write_text(file_sha256(partial) + "\n")
        partial.replace(out)  # the checksum first: a library without its record is rebuilt, never trusted
    finally:
        partial.unlink(missing_ok=True)
    return out


def _version(compiler: str) -> tuple[str, bool]:
    """(the compiler's version line, whether it is GCC)."""
    r = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    said = r.stdout if r.returncode == 0 else ""
    return (said.splitlines()[0] if said else compiler), "Free Software Foundation" in said


def _headers(progress: bool, fetch: bool = True) -> Path:
    """A folder holding onnxruntime_cxx_api.h: $ORT_INCLUDE_DIR, the system's, or fetched once from Debian."""
    given = os.environ.get("ORT_INCLUDE_DIR")
    if given:
        if not (Path(given) / "onnxruntime_cxx_api.h").exists():
            raise KernelsUnavailable(f"$ORT_INCLUDE_DIR ({given}) holds no onnxruntime_cxx_api.h; point it at ONNX "
                                     "Runtime's include folder")
        return Path(given)
    for system in (Path("/usr/include/onnxruntime"), Path("/usr/local/include/onnxruntime")):
        if (system / "onnxruntime_cxx_api.h").exists():
            return system
    fetched = user_cache() / HEADERS
    if not fetch and not (fetched / "x").exists():
        raise KernelsUnavailable("they build on first use: `llgraph export ... --kernels llgraph`")
    return fetch_headers(progress, fetched)


def fetch_headers(progress: bool = True, root: Path | None = None) -> Path:
    """ONNX Runtime's headers from Debian's `libonnxruntime-dev`, fetched once into the user cache with apt-get
    and a private sources list, lists and cache (the system's apt setup is not read or changed)."""
    root = root or user_cache() / HEADERS
    include = root / "x" / "usr" / "include" / "onnxruntime"
    if (include / "onnxruntime_cxx_api.h").exists():
        return include
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        raise KernelsUnavailable("ONNX Runtime's C++ headers are not installed and apt-get is not here to fetch "
                                 "them; set $ORT_INCLUDE_DIR to ONNX Runtime's include folder")
    failed = root / FAILED
    if failed.exists() and time.time() - failed.stat().st_mtime < RETRY_AFTER:
        raise KernelsUnavailable(failed.read_text().strip() + f" (tried {_ago(failed)}; retried after an hour, or "
                                 "now after `llgraph cache clean`)")
    if progress:
        print(f"fetching ONNX Runtime's C++ headers ({HEADERS_PACKAGE}, Debian) into {root} ...", file=sys.stderr,
              flush=True)
    root.mkdir(parents=True, exist_ok=True)
    failed.unlink(missing_ok=True)
    _remove_stale(root, f"{SCRATCH}*")
    with tempfile.TemporaryDirectory(dir=root, prefix=f"{SCRATCH}{os.getpid()}-") as scratch:
        s = Path(scratch)
        (s / "lists" / "partial").mkdir(parents=True)
        (s / "cache" / "archives" / "partial").mkdir(parents=True)
        (s / "sources.list").write_text(HEADERS_SUITE + "\n")
        apt = ["apt-get", "-q", f"-o=Dir::Etc::SourceList={s / 'sources.list'}", "-o=Dir::Etc::SourceParts=/dev/null",
               f"-o=Dir::State::Lists={s / 'lists'}", f"-o=Dir::Cache={s / 'cache'}",
               "-o=APT::Sandbox::User=root"]
        said = []  # apt-get update exits 0 when the archive cannot be reached; what it warned is the cause
        for step in (["update"], ["download", HEADERS_PACKAGE]):
            r = subprocess.run(apt + step, capture_output=True, text=True, cwd=s)
            said += [line.split(": ", 1)[-1] for line in r.stderr.splitlines() if "Failed to fetch" in line]
            if r.returncode != 0:
                last = (said or r.stderr.strip().splitlines() or ["no output"])[-1]
                why = (f"could not fetch {HEADERS_PACKAGE} from Debian ({last}); set $ORT_INCLUDE_DIR to ONNX "
                       "Runtime's include folder")
                (root / FAILED).write_text(why)  # remembered: the next runs do not wait on the archive again
                raise KernelsUnavailable(why)
        deb = next(s.glob(f"{HEADERS_PACKAGE}_*.deb"))
        unpacked = s / "x"
        subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True, capture_output=True)
        if (root / "x").exists():
            shutil.rmtree(root / "x")
        unpacked.replace(root / "x")
    return include
