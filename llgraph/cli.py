"""`llgraph` command line. Every expected failure is one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import sys

from llgraph.config import load_config, presets
from llgraph.errors import LlgraphError

USER_ERRORS = (LlgraphError, FileNotFoundError, PermissionError)


def cmd_inspect(args) -> None:
    from llgraph.builder import build_graph
    from llgraph.passes import DEFAULT_PASSES, run_passes

    cfg = load_config(args.config)
    graph = build_graph(cfg, args.dtype)
    if args.passes:
        graph = run_passes(graph, DEFAULT_PASSES)
    print(f"model: {cfg.name}  ({cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
          f"{cfg.num_kv_heads} kv, head_dim {cfg.head_dim}, vocab {cfg.vocab_size}, rope {cfg.rope.type}/"
          f"{cfg.rope.layout})")
    print(f"parameters: {graph.param_count():,}")
    for dtype, nbytes in (("float16", 2), ("float32", 4)):
        per_token = cfg.kv_cache_bytes_per_token(nbytes)
        print(f"KV cache ({dtype}): {per_token:,} bytes/token, "
              f"{per_token * cfg.max_position_embeddings / 2**30:.2f} GiB at {cfg.max_position_embeddings} tokens")
    print(f"ops ({len(graph.nodes)} nodes):")
    for op, n in sorted(graph.op_counts().items()):
        print(f"  {op:<18}{n}")


def cmd_export(args) -> None:
    from llgraph.export import export_model

    if args.checkpoint is None:
        print(f"no --checkpoint: exporting seeded random weights (seed {args.seed})", file=sys.stderr)
    out = export_model(args.config or args.checkpoint, args.checkpoint, args.output, args.target, args.dtype,
                       args.max_seq_len, args.force, progress=True, seed=args.seed)
    print(f"wrote {out}/ ({', '.join(sorted(p.name for p in out.iterdir()))})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llgraph", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="summarize the graph a config builds: ops, parameters, KV-cache size")
    i.add_argument("--config", required=True,
                   help=f"a config file (llgraph JSON, HF config.json, .gguf) or a preset: {', '.join(presets())}")
    i.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    i.add_argument("--passes", action="store_true", help="show the graph after QKV and gate/up packing")
    i.set_defaults(func=cmd_inspect)
    e = sub.add_parser("export", help="export a model to an ONNX folder (model.onnx + external data + manifest)")
    e.add_argument("--config", help="config file or preset; defaults to the checkpoint's own (config.json / GGUF)")
    e.add_argument("--checkpoint", help="HF folder, .safetensors, .gguf, or 'smollm2' (the bundled SmolLM2-135M "
                   "GGUF); without it, seeded random weights")
    e.add_argument("--target", default="ort", help="ort (ONNX Runtime, default) or onnx (standard ops only)")
    e.add_argument("--dtype", default="fp32", help="fp32, fp16 or bf16")
    e.add_argument("--max-seq-len", type=int, help="longest position the RoPE tables cover (default: the config's)")
    e.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    e.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    e.add_argument("-o", "--output", required=True, help="output folder")
    e.set_defaults(func=cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) == "export" and not (args.config or args.checkpoint):
        print("llgraph: error: export needs --config or --checkpoint", file=sys.stderr)
        return 2
    try:
        args.func(args)
    except USER_ERRORS as e:
        print(f"llgraph: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `llgraph inspect ... | head`
        sys.stdout = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
