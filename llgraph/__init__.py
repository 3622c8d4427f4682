"""llgraph: a declarative graph compiler for Llama-family decoders."""

__version__ = "0.16.0"


def _source_tree_subpackages() -> None:
    """In a source checkout, `llgraph.export`, `.runtime` and `.plugins` live in the checkout's top-level folders.
    Whether this package was found in the checkout itself (the repo root on sys.path, as under pytest) or through
    the editable install's link tree, its path becomes the checkout's real folders, so every module — a new one
    too — imports from the working tree, the same way as from an install (which maps the folders into `llgraph/`).
    An installed copy has no such sibling folders and is left alone."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and all((root / d / "__init__.py").is_file()
                                                   for d in ("export", "runtime", "plugins")):
        __path__[:] = [str(root / "llgraph"), str(root)]  # noqa: F821 (a package's __path__)


_source_tree_subpackages()
