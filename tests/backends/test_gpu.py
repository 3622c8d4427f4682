"""The PyTorch executor on a CUDA GPU, against itself in float64 on CPU (prefill + 8 cached decode steps). Marked
`gpu`; skips, with the reason, where no GPU is visible."""

import pytest
import torch
from conftest import max_diff
from reference import Stepper, tiny

from llgraph.checkpoint import random_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_executor_on_cuda_matches_float64(dtype, report):
    """fp32 within 1e-4 of float64; half precisions within twice the CPU executor's own error in that dtype."""
    cfg = tiny()
    source = random_weights(cfg, seed=3, std=0.25)
    truth, cpu = Stepper(cfg, source, batch=2, dtype="float64"), Stepper(cfg, source, batch=2, dtype=dtype)
    gpu = Stepper(cfg, source, batch=2, dtype=dtype, device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    worst_gpu = worst_cpu = 0.0
    for _ in range(9):
        want = truth.step(ids)["logits"]
        worst_cpu = max(worst_cpu, max_diff(cpu.step(ids)["logits"], want))
        worst_gpu = max(worst_gpu, max_diff(gpu.step(ids.cuda())["logits"].cpu(), want))
        ids = want[:, -1:].argmax(-1)
    print(f"{dtype}: CPU executor vs float64 {worst_cpu:.3e}")
    report(f"CUDA executor {dtype} vs float64", worst_gpu, 1e-4 if dtype == "float32" else 2 * worst_cpu + 1e-3)
