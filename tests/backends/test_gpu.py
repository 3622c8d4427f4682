"""The PyTorch executor on a CUDA GPU: against itself in float64 on CPU (prefill + 8 cached decode steps), and every
family of tests/core/test_families.py (windows, sinks, soft caps, the routed experts) against transformers' own
class on CPU. Marked `gpu`; skips, with the reason, where no GPU is visible."""

import pytest
import torch
from conftest import max_diff
from reference import Stepper, tiny
from test_families import FAMILIES, TOL, hf_checkpoint, hf_steps

from llgraph.checkpoint import load_config, open_checkpoint, random_weights

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


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_on_cuda_equals_transformers(name, tmp_path, report):
    """The family's checkpoint (saved by transformers) on the GPU in float32, held to transformers on CPU with the
    CPU rows' tolerance: prefill of 9 tokens, 8 cached decode steps, 2 rows."""
    model = hf_checkpoint(name, tmp_path)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    want = hf_steps(model, ids, 8)
    cfg = load_config(tmp_path)
    ours = Stepper(cfg, open_checkpoint(tmp_path, cfg), batch=2, max_seq=64, device="cuda")
    worst = 0.0
    for logits in want:
        worst = max(worst, max_diff(ours.step(ids.cuda())["logits"].cpu(), logits))
        ids = logits[:, -1:].argmax(-1)
    report(f"{name} on the CUDA executor: prefill + 8 decode steps vs transformers on CPU, logits", worst, TOL)
