"""ExpertMatMul's TensorRT kernel (plugins/tensorrt/triton_kernels.py) on a CUDA GPU, at Qwen3-30B-A3B's expert
shapes (128 experts, 8 a token; gate/up 2048 -> 768, down 768 -> 2048), float16, against the two ways PyTorch would
run the same products in the same run: every expert on every token (what TensorRT-RTX's build of a MoE runs) and
each pair's matrix gathered then multiplied (the executor's way). The pairs' grouping by expert is computed once per
case by the export's own ONNX nodes (export/expert_schedule.py, ONNX Runtime on the CPU) and not timed: in an engine
it is TensorRT's layers.

    python -m llgraph.runtime.bench.expert_kernel [--tokens 1 8 64 512] [--repeats 20]
    python -m llgraph.runtime.bench.expert_kernel --device cpu --tokens 1 2 --repeats 1   # interpreted: a smoke run

Prints, per token count and product: milliseconds, the distinct chosen experts' bytes over the time (GB/s) and the
chosen pairs' TFLOP/s, and the kernel's speed over each peer's. Needs torch with CUDA and triton; no TensorRT.
Not yet run on a GPU (no device in the sessions since it was written).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

EXPERTS, TOP_K, HIDDEN, FFN = 128, 8, 2048, 768


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn() (after one warm-up call), the device synchronized around each."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def products(kernels, x, w, chosen, schedule, dense):
    """The three ways to time: the kernel, every expert on every row, each pair's matrix gathered."""
    def grouped():
        return kernels.expert_matmul(x, w, chosen, *schedule)

    def every():
        return torch.matmul(dense, w)  # [E, tokens, out]

    def gathered():
        tokens, k = chosen.shape
        pairs = x.expand(tokens, k, x.shape[-1]).reshape(-1, 1, x.shape[-1])
        return torch.bmm(pairs, w[chosen.reshape(-1)]).reshape(tokens, k, -1)
    return grouped, every, gathered


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cuda, or cpu: the kernel interpreted (a smoke run, no speed)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark times the TensorRT plugin's kernel on a GPU (--device cpu "
                         "runs it interpreted, for no figures)")
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    dev = args.device
    from llgraph.export import expert_schedule
    from llgraph.plugins.tensorrt import spec
    from llgraph.plugins.tensorrt import triton_kernels as kernels

    print(f"{torch.cuda.get_device_name() if dev == 'cuda' else 'CPU, interpreted'}; {EXPERTS} experts, {TOP_K} a "
          "token, float16")
    g = torch.Generator().manual_seed(0)
    for name, (n_in, n_out, rows) in {"gate/up": (HIDDEN, FFN, 1), "down": (FFN, HIDDEN, TOP_K)}.items():
        w = (torch.randn(EXPERTS, n_in, n_out, generator=g) / n_in ** 0.5).half().to(dev)
        for tokens in args.tokens:
            chosen = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
            schedule = [torch.from_numpy(a).to(dev) for a in expert_schedule.run(chosen.numpy(), EXPERTS,
                                                                                  spec.EXPERT_ROWS)]
            chosen = chosen.to(dev)
            x = torch.randn(tokens, rows, n_in, generator=g).half().to(dev)
            # the rows every expert meets: the tokens' (gate/up), or each expert's activations of every token (down)
            dense = (x.reshape(tokens, n_in) if rows == 1
                     else torch.randn(EXPERTS, tokens, n_in, generator=g).half().to(dev))
            grouped, every, gathered = products(kernels, x, w, chosen, schedule, dense)
            got, want = grouped().float(), gathered().float()
            err = float((got - want).abs().max())
            ms = {f.__name__: timed(f, args.repeats) for f in (grouped, every, gathered)}
            read = chosen.unique().numel() * n_in * n_out * 2
            flops = 2 * tokens * TOP_K * n_in * n_out
            print(f"{name:7s} {tokens:4d} tokens: " + ", ".join(
                f"{k} {v:.3f} ms ({read / v / 1e6:.0f} GB/s, {flops / v / 1e9:.1f} TFLOP/s)" for k, v in ms.items())
                + f"; grouped x every {ms['every'] / ms['grouped']:.2f}, "
                  f"x gathered {ms['gathered'] / ms['grouped']:.2f}"
                + f"; max|grouped - gathered| {err:.1e}")


if __name__ == "__main__":
    main()
