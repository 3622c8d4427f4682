"""llgraph: a declarative graph compiler for Llama-family decoders."""

__version__ = "0.1.0"


def _source_tree_subpackages() -> None:
    """Run from a source checkout (the repo root on sys.path, as under pytest), `llgraph.export`, `.runtime` and
    `.plugins` live in the checkout's top-level folders: add the root to this package's path so they import the
    same way as from an install (which maps them into `llgraph/`). An installed copy has no such sibling folders."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and all((root / d / "__init__.py").is_file()
                                                   for d in ("export", "runtime", "plugins")):
        __path__.append(str(root))  # noqa: F821 (a package's __path__)


_source_tree_subpackages()
