"""What a step of the PyTorch executor dispatches, beside transformers' eager LlamaForCausalLM of the same config:
the aten ops of one decode step (and of one prefill) per layer, by name. On a GPU each compute op is a kernel launch
and an eager decode step is bound by them, so this counts, on any machine, what `llgraph bench --backend torch
--device cuda` times there (views and no-op casts launch nothing; they are listed apart or counted as their op).

    python -m llgraph.runtime.bench.torch_ops [CONFIG] [--prefill 100] [--dtype bfloat16]

CONFIG: a preset (`llama-3.2-1b`, `8b`, `tiny`, ...) or config file; random weights, cut to 2 layers (a layer's ops
do not depend on how many there are). Today: llgraph's decode step 71.5 compute ops a layer, transformers' 52.5 (the
mask is built once a step, and the RoPE table converted to the model's dtype once, since 2026-11-30; it was 78).

Measured on a lent H200 (torch 2.11+cu130, random weights, bf16):
- 2026-11-30, `python -m llgraph.runtime.bench.speed llama-3.2-1b --backend torch --device cuda --dtype bfloat16 -p
  512 -n 128 --repeats 3 --peer transformers`: llgraph pp512 32,580 / tg128 66.3 tok/s, transformers 47,086 / 100.5
  (0.69x / 0.66x). That benchmark repeats the same shapes, and so hid the cost that mattered: SDPA with a mask ran
  cuDNN's attention, which builds a plan for each new shape, and a served decode step's key span is new every step.
  16 layers of Llama-3.2-1B decoding at positions not seen before (`python -m llgraph.runtime.bench.fresh_shapes`):
  63-71 ms a step on SDPA, 15.7-16.5 ms with the scores spelled out (llgraph/attention_torch.py, now the GPU's path);
  a prompt of a length not seen before: 0.9-1.8 s of prefill on SDPA, 42-53 ms spelled out.
- 2026-11-29, the same benchmark: 19,270 / 53.1 against 41,896 / 85.3 (0.46x / 0.62x; 0.77x / 0.78x on 2026-11-27,
  before the ragged step; a long prefill then read the device three times a layer, once a step since)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import tempfile
from pathlib import Path

import numpy as np

# views, and promote_types (a dtype's arithmetic): nothing launched
NO_KERNEL = {"view", "_unsafe_view", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "t",
             "alias", "as_strided", "detach", "split", "split_with_sizes", "reshape", "unbind", "lift_fresh",
             "_reshape_alias", "unflatten", "flatten", "promote_types"}


def counted(fn) -> collections.Counter:
    """The aten ops `fn()` dispatches, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Count() as mode:
        fn()
    return mode.ops


def line(name: str, ops: collections.Counter, layers: int) -> str:
    compute = {k: v for k, v in ops.items() if k not in NO_KERNEL}
    top = ", ".join(f"{k} {v}" for k, v in sorted(compute.items(), key=lambda kv: -kv[1])[:12])
    return (f"{name}: {sum(compute.values()) / layers:.1f} compute ops a layer "
            f"({sum(ops.values()) - sum(compute.values())} views and such in all); {top}")


def main(argv=None) -> None:
    import torch

    from llgraph.checkpoint import load_config
    from llgraph.runtime.backends.pytorch import TorchRunner
    from llgraph.runtime.engine.packed import step_logits

    p = argparse.ArgumentParser(prog="python -m llgraph.runtime.bench.torch_ops", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default="llama-3.2-1b")
    p.add_argument("--prefill", type=int, default=100, help="prompt tokens of the counted prefill")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    cfg = dataclasses.replace(load_config(args.config), num_layers=2)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(cfg.to_json())
        b = TorchRunner(None, config=Path(tmp) / "config.json", max_seq_len=args.prefill + 8, dtype=args.dtype).backend
    b.allocate(1, zeroed=True)
    step_logits(b, np.arange(5), 0)  # a cache to decode after
    print(line("llgraph decode step", counted(lambda: step_logits(b, [4], 5)), cfg.num_layers))
    print(line(f"llgraph prefill of {args.prefill}", counted(
        lambda: step_logits(b, np.arange(args.prefill) % cfg.vocab_size, 0)), cfg.num_layers))

    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                     num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                     tie_word_embeddings=cfg.tie_word_embeddings, rope_theta=cfg.rope.theta)
    model = LlamaForCausalLM(hf).to(getattr(torch, args.dtype)).eval()
    with torch.inference_mode():
        past = model(input_ids=torch.arange(5)[None], use_cache=True, logits_to_keep=1).past_key_values

        def decode():
            out = model(input_ids=torch.tensor([[4]]), past_key_values=past, use_cache=True, logits_to_keep=1)
            out.logits[:, -1].float().cpu()
        print(line("transformers decode step", counted(decode), cfg.num_layers))


if __name__ == "__main__":
    main()
