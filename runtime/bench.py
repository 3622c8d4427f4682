"""llama-bench for llgraph: prompt processing (pp) and token generation (tg) speed of one model on one backend, with
the bytes a decode step reads and the bandwidth that implies, optionally beside a peer timed in the same run.

    python -m llgraph.runtime.bench MODEL [--backend ort|torch] [--device cpu|cuda] [--dtype D] [-p 512] [-n 128]
                                          [--repeats 3] [--threads N] [--peer transformers]

MODEL is what `llgraph generate` takes (an export folder, a checkpoint, 'smollm2'), or, for --backend torch, a
config preset (`llama-3.2-1b`, `8b`, ...) run on seeded random weights: speed does not depend on the values.
pp: one forward of `-p` random prompt tokens into an empty cache (tok/s = p / its time); tg: `-n` one-token steps
after it (tok/s = n / their time), as llama-bench measures, with no sampling or text. Each figure is the best of
`--repeats` runs after a warm-up run. `--peer transformers`: HF transformers' LlamaForCausalLM of the same config
(random weights, same dtype and device, its own KV cache), timed the same way in the same invocation, so the ratio
holds whatever the machine's load.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def time_backend(forward, allocate, vocab: int, p: int, n: int, repeats: int, sync=lambda: None,
                 depth: int = 0) -> dict:
    """Best-of-`repeats` pp and tg seconds of a model behind `forward(ids, positions)` after one warm-up run, as
    llama-bench measures them: pp, one forward of `p` prompt tokens into an empty cache (`allocate()`); tg, `n`
    one-token steps into an empty one (each after `depth` tokens of context when given, like llama-bench's -d)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, (1, max(p, depth, 1)), dtype=np.int64)
    steps = rng.integers(0, vocab, (n, 1, 1), dtype=np.int64)
    best = {"pp": float("inf"), "tg": float("inf")}
    for _ in range(repeats + 1):
        if p:
            allocate()
            sync()
            t0 = time.perf_counter()
            forward(prompt[:, :p], np.arange(p, dtype=np.int64)[None])
            sync()
            best["pp"] = min(best["pp"], time.perf_counter() - t0)
        if n:
            allocate()
            if depth:
                forward(prompt[:, :depth], np.arange(depth, dtype=np.int64)[None])
            sync()
            t0 = time.perf_counter()
            for i in range(n):
                forward(steps[i], np.array([[depth + i]], np.int64))
            sync()
            best["tg"] = min(best["tg"], time.perf_counter() - t0)
    return best


def llgraph_times(args) -> tuple[dict, int | None, str]:
    """(times, weight bytes a decode step reads or None, a description) of MODEL on llgraph's --backend."""
    from llgraph.runtime.registry import open_runner
    from llgraph.weight_request import Weights

    if args.backend == "torch":
        import torch

        from llgraph.bundled import resolve
        from llgraph.checkpoint import _preset_path
        from llgraph.runtime.pytorch import TorchRunner

        if args.threads:
            torch.set_num_threads(args.threads)
        preset = not __import__("pathlib").Path(resolve(args.model)).exists() and _preset_path(args.model).exists()
        runner = TorchRunner(None if preset else args.model, config=args.model if preset else None,
                             max_seq_len=max(args.p, args.depth + args.n) + 1, dtype=args.dtype, device=args.device,
                             progress=True)
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        b = runner.backend
        weight_bytes = _read_per_token({k: v.numel() * v.element_size() for k, v in b.executor.params.items()},
                                       b.config.tie_word_embeddings)
    else:
        runner = open_runner(args.model, args.backend, max(args.p, args.depth + args.n) + 1, threads=args.threads,
                             weights=Weights(args.dtype) if args.dtype != "float32" else Weights())
        b, sync, weight_bytes = runner.backend, (lambda: None), getattr(runner.backend, "weight_bytes", None)
    times = time_backend(lambda ids, pos: b.forward(ids, pos, keep=1), lambda: b.allocate(1, zeroed=True)
                         if args.backend == "torch" else b.allocate(1), b.vocab_size, args.p, args.n, args.repeats,
                         sync, args.depth)
    return times, weight_bytes, f"llgraph {args.backend} {args.dtype} on {args.device}"


def _read_per_token(sizes: dict[str, int], tied: bool) -> int:
    """Bytes of weights one decode step reads: every tensor but the embedding table (one row of it is read), which
    is read whole when the head shares it."""
    return sum(v for k, v in sizes.items() if tied or "embed" not in k)


def transformers_times(args, config) -> tuple[dict, int, str]:
    """HF transformers' eager LlamaForCausalLM of the same config (random init), timed like llgraph."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = config
    hf = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                     num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                     tie_word_embeddings=c.tie_word_embeddings, rope_theta=c.rope.theta,
                     max_position_embeddings=c.max_position_embeddings)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = LlamaForCausalLM(hf).to(dtype).eval()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    state = {}

    def allocate():
        state.clear()

    @torch.inference_mode()
    def forward(ids, pos):
        out = model(input_ids=torch.from_numpy(ids).to(args.device), past_key_values=state.get("past"),
                    use_cache=True, logits_to_keep=1)
        state["past"] = out.past_key_values
        return out.logits[:, -1].float().cpu()

    times = time_backend(forward, allocate, c.vocab_size, args.p, args.n, args.repeats, sync, args.depth)
    sizes = {k: v.numel() * v.element_size() for k, v in model.named_parameters()}  # tied: once
    return times, _read_per_token(sizes, c.tie_word_embeddings), f"transformers {args.dtype} on {args.device}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--backend", default="ort", choices=["ort", "torch"])
    p.add_argument("--device", default="cpu", help="torch's device (cuda: a GPU)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("-p", type=int, default=512, help="prompt tokens (pp)")
    p.add_argument("-n", type=int, default=128, help="generated tokens (tg)")
    p.add_argument("-d", "--depth", type=int, default=0, help="tokens of context before tg's steps (llama-bench's -d)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--peer", choices=["transformers"], default=None)
    args = p.parse_args(argv)
    from llgraph.checkpoint import load_config

    rows = [llgraph_times(args)]
    if args.peer == "transformers":
        rows.append(transformers_times(args, load_config(args.model)))
    tg = f"tg{args.n}" + (f" @ d{args.depth}" if args.depth else "")
    print(f"| engine | pp{args.p} tok/s | {tg} tok/s | weights read / token | GB/s in tg | pp × row 1 | "
          "tg × row 1 |\n|---|---|---|---|---|---|---|")
    first = rows[0][0]
    for times, weight_bytes, what in rows:
        pp, tg = args.p / times["pp"] if args.p else 0.0, args.n / times["tg"] if args.n else 0.0
        gbs = f"{weight_bytes * tg / 1e9:.1f}" if weight_bytes else "-"
        read = f"{weight_bytes / 1e9:.3f} GB" if weight_bytes else "-"
        ratio = [f"{first[k] / times[k]:.2f}" if times[k] < float("inf") else "-" for k in ("pp", "tg")]
        print(f"| {what} | {pp:.1f} | {tg:.1f} | {read} | {gbs} | {ratio[0]} | {ratio[1]} |", flush=True)


if __name__ == "__main__":
    main()
