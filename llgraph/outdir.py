"""Output folders that are written whole or not at all, and replaced only when llgraph wrote them.

    with staged_folder(out, force=force) as tmp:   # tmp = .OUT.partial-PID beside OUT, marked as llgraph's
        ...write every file into tmp...
    # on success tmp becomes OUT; on any exception (Ctrl-C, SIGTERM via `signals_raise`) tmp is removed

`--force` replaces OUT only if it is an llgraph export folder holding nothing but files llgraph wrote (its manifest
lists them, plus what `llgraph build` adds); anything else — a user's folder, a file, `.`, `/`, home, an ancestor of
the working directory — is refused with one line. The replacement is atomic: the new tree is renamed in, the old
one is removed after. A partial folder left by a run that was killed outright (SIGKILL, power loss) is recognised by
its mark and dead PID and removed by the next run writing to the same place.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from llgraph.errors import LlgraphError
from llgraph.export_folder import llgraph_files

PARTIAL_MARK = ".llgraph-partial"  # present in every temporary folder llgraph creates
CACHE_ENV = "LLGRAPH_CACHE_DIR"


def user_cache(override: str | Path | None = None) -> Path:
    """Where llgraph keeps what it makes once (checkpoint exports, built kernels): --cache-dir, else
    $LLGRAPH_CACHE_DIR, else ~/.cache/llgraph."""
    return Path(override or os.environ.get(CACHE_ENV) or "~/.cache/llgraph").expanduser()


class OutputError(LlgraphError):
    """An output path llgraph must not write or replace; one line naming the fix."""


class Terminated(BaseException):
    """SIGTERM/SIGHUP turned into an exception, so cleanup runs as it does for Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def signals_raise():
    """Within the block (main thread only), SIGTERM and SIGHUP raise `Terminated` instead of killing the process."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(signum)
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def check_writable_target(out: Path, force: bool, what: str = "output") -> None:
    """Refuse, with one line, any `out` llgraph must not create or replace."""
    resolved = out.resolve()
    cwd = Path.cwd().resolve()
    home = Path.home().resolve()
    if resolved == cwd or resolved in cwd.parents:
        place = "the current directory" if resolved == cwd else "an ancestor of the current directory"
        raise OutputError(f"{what} {out} is {place}; name a new folder for -o (e.g. -o {resolved / 'export'})")
    if resolved == home or resolved == Path(resolved.anchor):
        raise OutputError(f"{what} {out} is {'your home' if resolved == home else 'the root'} folder; "
                          "name a new folder for -o")
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise OutputError(f"{what} {out} exists and is not a folder; choose a new folder for -o")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    owned = llgraph_files(out)
    if owned is None:
        hint = "it is not an llgraph export, so --force will not replace it" if force else \
            "pass --force to replace an earlier llgraph export"
        raise OutputError(f"{what} {out} exists and is not empty ({len(entries)} entries); {hint}; "
                          "choose another -o")
    if not force:
        raise OutputError(f"{what} {out} holds an earlier llgraph export; pass --force to replace it or choose "
                          "another -o")
    foreign = [n for n in entries if n not in owned]
    if foreign:
        shown = ", ".join(foreign[:5]) + (" …" if len(foreign) > 5 else "")
        raise OutputError(f"{what} {out} holds files llgraph did not write ({shown}); --force replaces only an "
                          "llgraph export: move them out or choose another -o")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_written(folder: Path) -> list[str]:
    """Remove what llgraph wrote into an export folder (its manifest's files, what `llgraph build` added), then the
    folder once empty; anything else in it (a user's file) stays, and so does the folder. A symbolic link is never
    followed: the link itself is removed where llgraph's file should be, and a linked folder is not an export folder
    llgraph wrote. Returns the names left."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        return [folder.name]
    ours = llgraph_files(folder) or set()
    for name in ours:
        path = folder / name
        if path.is_symlink() or path.is_file():
            path.unlink()
    left = sorted(p.name for p in folder.iterdir())
    if not left:
        folder.rmdir()
    return left


def remove_stale(out: Path) -> list[Path]:
    """Remove `.OUT.partial-PID` / `.OUT.old-PID` siblings left by killed llgraph runs (marked, PID not alive)."""
    removed: list[Path] = []
    parent = out.resolve().parent
    if not parent.is_dir():
        return removed
    for kind in ("partial", "old"):
        for p in parent.glob(f".{out.name}.{kind}-*"):
            pid = p.name.rsplit("-", 1)[-1]
            ours = (p / PARTIAL_MARK).exists() if kind == "partial" else llgraph_files(p) is not None
            if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)) and ours and p.is_dir() \
                    and not p.is_symlink():
                if kind == "partial":  # a staging folder llgraph made whole
                    shutil.rmtree(p, ignore_errors=True)
                elif remove_written(p):  # an old export replaced: only what llgraph wrote in it
                    print(f"llgraph: kept {p}: it holds files llgraph did not write", file=sys.stderr)
                    continue
                removed.append(p)
    for p in removed:
        print(f"llgraph: removed {p}, left by an earlier run that was killed", file=sys.stderr)
    return removed


@contextmanager
def staged_folder(out: str | Path, force: bool = False, what: str = "output"):
    """Yield a fresh temporary folder beside `out`; on success it replaces `out` atomically, on failure it is
    removed. `out` is checked first (see `check_writable_target`)."""
    out = Path(out)
    check_writable_target(out, force, what)
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale(out)
        tmp = parent / f".{out.name}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        (tmp / PARTIAL_MARK).touch()
    except OSError as e:
        raise OutputError(f"cannot write to {parent}: {e.strerror}; choose a writable -o") from None
    try:
        yield tmp
        (tmp / PARTIAL_MARK).unlink()
        check_writable_target(out, force, what)  # nothing appeared there while we wrote
        old = parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write a file under a temporary name beside it and rename: a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
