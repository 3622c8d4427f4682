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
