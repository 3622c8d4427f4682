"""Every `import` in llgraph's four folders (function-level ones too: a lazy import is still a dependency), as edges
between the project's modules under their installed names (export/ort.py is llgraph.export.ort); the floors they
belong to; and the circles among them."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"llgraph": "llgraph", "plugins": "llgraph.plugins", "export": "llgraph.export",
            "runtime": "llgraph.runtime"}
# bottom up: each imports only from floors below it (or its own). The runtime's rooms are floors of their own: the
# engine, the backends on it, then serve / eval / bench side by side ("apps"), the CLI above all
FLOORS = ["core", "plugins", "export", "engine", "backends", "apps", "cli"]
ROOMS = (("llgraph.runtime.cli", "cli"), ("llgraph.runtime.serve", "apps"), ("llgraph.runtime.eval", "apps"),
         ("llgraph.runtime.bench", "apps"), ("llgraph.runtime.backends", "backends"),
         ("llgraph.runtime.engine", "engine"), ("llgraph.runtime", "backends"), ("llgraph.export", "export"),
         ("llgraph.plugins", "plugins"))


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def floor(module: str) -> str:
    if module == "llgraph.__main__":
        return "cli"
    for prefix, name in ROOMS:
        if module == prefix or module.startswith(prefix + "."):
            return name
    return "core"


def edges() -> dict[str, set[str]]:
    """module -> the project's modules it imports."""
    mods = modules()
    graph = {m: set() for m in mods}
    for module, path in mods.items():
        package = module if path.stem == "__init__" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                # `from P import n` reads P's namespace (and runs P's __init__), and n too if it is a module
                targets = [base, *(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods)]
            else:
                continue
            for target in targets:
                while target and target not in mods:  # `import llgraph.export.ort as x`: the module itself
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if FLOORS.index(floor(a)) < FLOORS.index(floor(b)))


if __name__ == "__main__":
    g = edges()
    print(len(g), "modules,", sum(len(p.read_text().splitlines()) for p in modules().values()), "lines")
    for c in circles(g):
        print("circle:", c)
    for a, b in upward(g):
        print(f"upward: {a} ({floor(a)}) -> {b} ({floor(b)})")
