"""`llgraph`'s commands that make or manage files: inspect (a graph), export (a folder), build (an engine), convert (a
GGUF to an HF folder), cache (the export cache: list, verify, clean). The commands that run a model are in
commands.py, which dispatches to both."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from llgraph.checkpoint import load_config
from llgraph.errors import LlgraphError
from llgraph.runtime.cli.args import weights_of


def cmd_inspect(args) -> None:
    from llgraph.builder import build_graph
    from llgraph.kv_cache import FORMATS, ring_length, row_bytes
    from llgraph.passes import DEFAULT_PASSES, run_passes

    if (args.model is None) == (args.config is None):
        raise LlgraphError("give the model to inspect once: `llgraph inspect MODEL` or `llgraph inspect --config "
                           "CONFIG`")
    cfg = load_config(args.model or args.config)
    graph = build_graph(cfg, args.dtype)
    if args.passes:
        graph = run_passes(graph, DEFAULT_PASSES)
    print(f"model: {cfg.name}  ({cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
          f"{cfg.num_kv_heads} kv, head_dim {cfg.head_dim}, vocab {cfg.vocab_size}, rope {cfg.rope.type}/"
          f"{cfg.rope.layout})")
    bias = ("q/k/v/o" if cfg.attention_out_bias else "q/k/v") if cfg.attention_bias else \
        ("o" if cfg.attention_out_bias else "none")
    window = "none" if not cfg.sliding_window else f"{cfg.sliding_window} tokens, " + (
        "every layer" if cfg.sliding_layers is None else f"layers {', '.join(map(str, cfg.sliding_layers))}")
    print(f"family: {cfg.family}  (attention biases: {bias}; mlp biases: {'yes' if cfg.mlp_bias else 'no'}; "
          f"tied embeddings: {'yes' if cfg.tie_word_embeddings else 'no'}; sliding window: {window})")
    caps = ", ".join(f"{k} {v:g}" for k, v in (("attention", cfg.attention_softcap), ("final", cfg.final_softcap))
                     if v) or "none"
    print(f"block: norms {cfg.norm_placement}{' (parallel attention + MLP)' if cfg.parallel_block else ''}, "
          f"QK-norm {cfg.qk_norm}, MLP {'SwiGLU' if cfg.mlp_activation == 'silu' else 'GeGLU'}, "
          f"soft-capping {caps}, embedding scale {cfg.embedding_scale:g}")
    print(f"parameters: {graph.param_count():,}")
    context = cfg.max_position_embeddings
    ring = ring_length(cfg.sliding_window or 0, context)
    local = sum(1 for i in range(cfg.num_layers) if cfg.layer_window(i)) if ring else 0
    for kv in FORMATS.values():
        per_token = kv.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        held = row_bytes(cfg, kv, context, ring)
        rings = f" ({held / 2**30:.2f} GiB with the {local} windowed layers' rings of {ring})" if ring else ""
        print(f"KV cache ({kv.name}): {per_token:,} bytes/token, "
              f"{per_token * context / 2**30:.2f} GiB at {context} tokens{rings}")
    print(f"ops ({len(graph.nodes)} nodes):")
    for op, n in sorted(graph.op_counts().items()):
        print(f"  {op:<18}{n}")


def cmd_export(args) -> None:
    from llgraph.export import export_model
    from llgraph.outdir import check_writable_target

    check_writable_target(Path(args.output), args.force)  # a refused -o is the first thing said, before any work
    if args.checkpoint is None:
        _confirm_random(args)
    out = export_model(args.config or args.checkpoint, args.checkpoint, args.output, target=args.target,
                       weights=weights_of(args), max_seq_len=args.max_seq_len, force=args.force, progress=True,
                       seed=args.seed)
    print(f"wrote {out}/ ({', '.join(sorted(p.name for p in out.iterdir()))})")


ASK_ABOVE = 10 * 10**9  # random weights past this many bytes are written only when confirmed (or --yes)


def _confirm_random(args) -> None:
    """Without --checkpoint, export writes seeded random weights: said up front with their size, and past ASK_ABOVE
    asked first (a terminal), else refused without --yes (a script)."""
    from llgraph.builder import build_graph

    cfg = load_config(args.config)  # a bad config is the one line said, before the notice below
    weights = weights_of(args)
    bits = {"int4": 4.5, "int8": 8.5}.get(weights.quantize or "", 8 * (2 if weights.dtype != "float32" else 4))
    size = build_graph(cfg, weights.dtype).param_count() * bits / 8
    large = f", about {size / 1e9:.1f} GB," if size > ASK_ABOVE else ""  # (else the export's own line says it)
    print(f"no --checkpoint: exporting seeded random weights (seed {args.seed}){large} into {args.output} — give "
          "--checkpoint for a model's own weights", file=sys.stderr, flush=True)
    if size <= ASK_ABOVE or args.yes:
        return
    if not sys.stdin.isatty():
        raise LlgraphError(f"{size / 1e9:.0f} GB of random weights would be written to {args.output}; pass --yes to "
                           "write them, or --checkpoint for a model's own weights")
    if input(f"write {size / 1e9:.0f} GB of random weights? [y/N] ").strip().lower() not in ("y", "yes"):
        raise LlgraphError("nothing written (answered no); pass --checkpoint for a model's own weights")


def cmd_cache(args) -> None:
    from llgraph.runtime.backends.export_cache import cache_dir, clean, entries, kernel_builds, verify

    root = cache_dir(args.cache_dir)
    if args.action == "list":
        found = entries(root)
        builds, size = kernel_builds(root)
        print(f"{root}: {len(found)} entries, {sum(e.bytes for e in found) / 2**20:,.0f} MiB; CPU kernel builds and "
              f"headers: {builds} folders, {size / 2**20:,.1f} MiB")
        width = max((len(e.name) for e in found), default=0) + 2  # a long name never runs into its size
        for e in found:
            print(f"  {e.name:<{width}}{e.bytes / 2**20:>9,.0f} MiB  {e.source}")
        cut = _cut_downloads()
        if cut:
            print(f"Hub downloads cut short: {len(cut)} files, {sum(p.stat().st_size for p in cut) / 2**20:,.0f} MiB "
                  "(`llgraph cache clean` removes them)")
        return
    if args.action == "verify":
        results = verify(root, args.names)
        width = max((len(e.name) for e, _ in results), default=0) + 2
        for e, why in results:
            print(f"  {e.name:<{width}}{'ok' if why is None else 'DAMAGED: ' + why}")
        bad = [e.name for e, why in results if why is not None]
        if bad:
            raise LlgraphError(f"{len(bad)} damaged cache entr{'y' if len(bad) == 1 else 'ies'}: `llgraph cache "
                               f"clean {' '.join(bad)}` removes them (the next generate exports them again)")
        print(f"{len(results)} entries verified in {root}")
        return
    removed, freed = clean(root, args.names)
    print(f"removed {len(removed)} entries from {root}, freed {freed / 2**20:,.0f} MiB")
    if not args.names and _cut_downloads():
        from llgraph.hub import remove_cut_downloads

        files, size = remove_cut_downloads()
        print(f"removed {files} files Hub downloads cut short left, freed {size / 2**20:,.0f} MiB")


def _cut_downloads() -> list:
    """Files killed Hub downloads left (llgraph.hub.cut_downloads), or none without huggingface_hub."""
    try:
        from llgraph.hub import cut_downloads

        return cut_downloads()
    except ImportError:
        return []


def cmd_convert(args) -> None:
    from llgraph.export.convert import convert_gguf

    print(f"converting {args.gguf} into an HF folder (float32) ...", file=sys.stderr, flush=True)
    out = convert_gguf(args.gguf, args.output, args.force)
    print(f"wrote {out}/ ({', '.join(sorted(p.name for p in out.iterdir()))})")


def cmd_build(args) -> None:
    from llgraph.export.trt_build import build_engine
    from llgraph.export_folder import ENGINE_META

    engine = build_engine(args.folder, args.output, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                          opt_prefill=args.opt_prefill, plugins=args.plugins, tensorrt=args.tensorrt)
    meta = json.loads((Path(args.folder) / ENGINE_META).read_text())
    print(f"wrote {engine} ({engine.stat().st_size / 2**20:.1f} MiB, {meta['flavor']} {meta['tensorrt']}, "
          f"plugins {meta['plugins']}, built in {meta['build_seconds']:.1f} s; runs on {meta['runs_on']})")
