import pytest
import torch


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.fixture
def report(request):
    """report(what, diff, tol): print the max difference seen, then assert it is within tolerance."""
    def check(what: str, diff: float, tol: float):
        print(f"{request.node.name}: {what} max|diff| = {diff:.3e} (tol {tol:.0e})")
        assert diff <= tol, f"{what}: max|diff| {diff:.3e} > {tol:.0e}"
    return check


@pytest.fixture(scope="session")
def smollm2_export(tmp_path_factory):
    """smollm2_export(target, dtype="float32", max_seq_len=256) -> the bundled SmolLM2's export folder, made once per
    test session and shared by every test that asks for the same one (each is hundreds of MB and seconds to write)."""
    from llgraph.bundled import bundled_model
    from llgraph.export import export_model

    made = {}

    def get(target: str, dtype: str = "float32", max_seq_len: int = 256, quantized: bool = False):
        """quantized: the GGUF's blocks as stored (Q4_1 layers, Q8_0 lm head; ort with the exact-compute accuracy
        level 0); else dequantized to `dtype`."""
        key = (target, dtype, max_seq_len, quantized)
        if key not in made:
            path = bundled_model("smollm2")
            out = tmp_path_factory.mktemp("smollm2") / f"{target}-{dtype}-{max_seq_len}-{'q' if quantized else 'f'}"
            made[key] = export_model(path, checkpoint=path, out=out, target=target, dtype=dtype,
                                     max_seq_len=max_seq_len, dequantize=not quantized,
                                     accuracy_level=0 if quantized and target == "ort" else None)
        return made[key]
    return get


@pytest.fixture(scope="session", autouse=True)
def private_export_cache(tmp_path_factory):
    """Tests never read or fill the user's export cache (~/.cache/llgraph): `llgraph generate CHECKPOINT` run by a
    test exports into a cache of this test session's own."""
    import os

    old = os.environ.get("LLGRAPH_CACHE_DIR")
    os.environ["LLGRAPH_CACHE_DIR"] = str(tmp_path_factory.mktemp("llgraph-cache"))
    yield
    if old is None:
        os.environ.pop("LLGRAPH_CACHE_DIR", None)
    else:
        os.environ["LLGRAPH_CACHE_DIR"] = old
