"""Every file and module a docstring, comment or the README names exists: paths (`runtime/engine/step.py`,
`plugins/cpu/moe.inc`, `llgraph/runtime/bench/gguf.py`) and dotted names (`llgraph.runtime.engine.grammar.Grammar`,
`runtime.grammar`), so a move or rename that leaves a stale word behind fails here rather than misleading a reader
(issue 65: such words had piled up after moves)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = {"runtime": "runtime", "export": "export", "plugins": "plugins"}  # llgraph.X lives in ROOT/X
SOURCES = [p for top in ("llgraph", "runtime", "export", "plugins", "tests", ".ci") for p in (ROOT / top).rglob("*")
           if p.suffix in (".py", ".inc", ".cc", ".md") and "data" not in p.relative_to(ROOT).parts] + \
    [ROOT / "README.md", ROOT / "pyproject.toml"]
PATH = re.compile(r"(?<![\w/.\-])((?:llgraph|runtime|export|plugins|tests|\.ci)/[\w/\-]*"
                  r"\.(?:py|inc|cc|md|json|jsonl|txt))")
DOTTED = re.compile(r"(?<![\w./\-`])((?:llgraph|runtime|export|plugins)(?:\.[a-z_][a-z_0-9]*)+)\b(?![/\-])")


def _file(path: str) -> Path | None:
    """ROOT's file for a repository path or a package path (llgraph/runtime/... lives in runtime/...)."""
    candidates = [path]
    if path.startswith("llgraph/") and path.split("/")[1] in PACKAGE:
        candidates.append(path[len("llgraph/"):])
    return next((ROOT / c for c in candidates if (ROOT / c).exists()), None)


def _module(parts: list[str]) -> tuple[Path | None, list[str]]:
    """The longest prefix of dotted `parts` that is a module (file or package) -> (its file, the rest)."""
    if parts[0] != "llgraph":
        parts = ["llgraph", *parts]
    for i in range(len(parts), 0, -1):
        base = "/".join(parts[:i])
        for candidate in (base + ".py", base + "/__init__.py"):
            found = _file(candidate) or (_file(candidate[len("llgraph/"):]) if i > 1 else None)
            if found is not None:
                return found, parts[i:]
    return None, parts


def _defines(source: Path, name: str) -> bool:
    text = source.read_text(errors="replace")
    return re.search(rf"^\s*(def|class|async def) {name}\b|^\s*{name}\s*(:|=)|import .*\b{name}\b|\b{name}\s*=",
                     text, re.M) is not None


def test_every_named_file_and_module_exists():
    stale = []
    for source in SOURCES:
        text = source.read_text(errors="replace")
        for m in PATH.finditer(text):
            if _file(m[1]) is None:
                stale.append(f"{source.relative_to(ROOT)}: {m[1]}")
        for m in DOTTED.finditer(text):
            name = m[1]
            if name.endswith((".py", ".inc", ".cc", ".md", ".json")) or name.startswith("llgraph.__"):
                continue
            module, rest = _module(name.split("."))
            if module is None or (rest and not rest[0].startswith("__") and not _defines(module, rest[0])):
                stale.append(f"{source.relative_to(ROOT)}: {name}")
    assert not stale, "names of files or modules that do not exist:\n" + "\n".join(sorted(set(stale)))
