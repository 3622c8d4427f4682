"""`llgraph` command line. Every expected failure is one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llgraph.errors import LlgraphError, MissingExtra
from llgraph.outdir import Terminated, signals_raise
from llgraph.runtime.cli.args import (
    fetch_hub_models,
    parse_tokens,
    read_prompt,
    runner_of,
    sampling_of,
    share_threads_for_a_draft,
    weights_of,
)
from llgraph.runtime.cli.artifacts import cmd_build, cmd_cache, cmd_convert, cmd_export, cmd_inspect
from llgraph.runtime.cli.parser import build_parser
from llgraph.weight_request import Weights

USER_ERRORS = (LlgraphError, FileNotFoundError, PermissionError)


def cmd_serve(args) -> int:
    from llgraph.runtime.serve.access import api_key
    from llgraph.runtime.serve.app import ServeOptions  # without the serve extra: one line saying so
    from llgraph.runtime.serve.run import serve, serve_on_ray

    for flag, value, low in (("--slots", args.slots, 1), ("--max-queue", args.max_queue, 0),
                             ("--prefill-chunk", args.prefill_chunk, 0),
                             ("--replicas", args.replicas, 1), ("--port", args.port, 0), ("--grace", args.grace, 0),
                             ("--max-request-bytes", args.max_request_bytes, 1024)):
        if value < low:
            raise LlgraphError(f"{flag} ({value}) must be at least {low}")
    if args.port > 65535:
        raise LlgraphError(f"--port ({args.port}) must be at most 65535")
    if args.timeout is not None and args.timeout <= 0:
        raise LlgraphError(f"--timeout ({args.timeout}) must be a positive number of seconds")
    from llgraph.runtime.backends import check_weights

    weights = check_weights(args.backend, weights_of(args))
    draft = args.speculative[len("draft="):] if args.speculative.startswith("draft=") else None
    options = ServeOptions(model=args.model, backend=args.backend, name=args.name, slots=args.slots,
                           max_queue=args.max_queue, max_seq_len=args.max_seq_len, timeout=args.timeout,
                           cache_dir=args.cache_dir, tensorrt=args.tensorrt, weights=weights,
                           max_request_bytes=args.max_request_bytes, threads=args.threads,
                           speculative="draft" if draft else args.speculative, draft_max=args.draft_max, draft=draft,
                           api_key=api_key(args.api_key, args.api_key_file), pooling=args.pooling,
                           prefill_chunk=args.prefill_chunk, kv_cache=args.kv_cache, host=args.host,
                           allowed_hosts=tuple(args.allowed_hosts), cors_origins=tuple(args.cors_origins),
                           open_metrics=args.open_metrics, any_model=args.any_model)
    if args.ray:
        serve_on_ray(options, args.replicas, host=args.host, port=args.port, address=args.ray_address)
    else:
        serve(options, host=args.host, port=args.port, grace=args.grace)
    return 0


def cmd_generate(args) -> None:
    from llgraph.runtime.cli.args import check_sampling_flags

    check_sampling_flags(args)  # every flag is checked before anything is loaded or exported
    if args.max_new_tokens < 1:
        raise LlgraphError(f"--max-new-tokens ({args.max_new_tokens}) must be at least 1")
    if args.max_seq_len is not None and args.max_seq_len < 2:
        raise LlgraphError(f"--max-seq-len ({args.max_seq_len}) must be at least 2 tokens")
    if args.max_seq_len is not None and args.max_new_tokens >= args.max_seq_len:
        raise LlgraphError(f"--max-new-tokens ({args.max_new_tokens}) leaves no room for the prompt in "
                           f"--max-seq-len ({args.max_seq_len}); raise --max-seq-len or lower --max-new-tokens")
    if [args.prompt, args.prompt_file, args.tokens].count(None) != 2:
        raise LlgraphError("give exactly one of --prompt TEXT (- for stdin), --prompt-file FILE or --tokens 1,2,3")
    chat = args.chat or args.system is not None
    if chat and args.tokens is not None:
        raise LlgraphError("--chat and --system wrap a text prompt; drop them with --tokens")
    if chat and args.raw:
        raise LlgraphError("--raw is plain completion, --chat and --system use the chat template; pass one")
    prompt = parse_tokens(args.tokens) if args.tokens is not None else read_prompt(args.prompt, args.prompt_file)

    share_threads_for_a_draft(args)
    runner = runner_of(args)
    # a chat model answers a text prompt through its template unless asked for plain completion (an instruct model
    # given raw text often ends at once: an empty answer)
    chat = chat or (not args.raw and args.tokens is None and runner.tokenizer is not None
                    and bool(runner.tokenizer.chat_template))
    if not chat and not args.raw and args.tokens is None and runner.tokenizer is not None:
        print("llgraph: this model has no chat template (a base model): it continues the prompt's text rather than "
              "answering it; --raw says that is what you want", file=sys.stderr)
    if runner.tokenizer is None and args.tokens is None:
        raise LlgraphError(f"{args.model} has no tokenizer (exported without one), so it reads no text; give the "
                           "prompt as token ids with --tokens 1,2,3, or export from a checkpoint that has one")
    if chat:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompt = runner.render_chat([*system, {"role": "user", "content": prompt}])
    if runner.tokenizer is None:  # token ids in, token ids out
        result = runner.generate([prompt], args.max_new_tokens, **sampling_of(args, runner))[0]
        if result.error:  # a batch's row ends alone with its error; here the batch is this one prompt
            raise LlgraphError(result.error)
        print(",".join(str(t) for t in result.token_ids))
        return
    stats: dict = {}
    pieces = runner.stream(prompt, args.max_new_tokens, stop=args.stop or (), stats=stats,
                           **sampling_of(args, runner))
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        print(format_stats(stats), file=sys.stderr)


def format_stats(s: dict) -> str:
    """generate --stats: the prompt's and the generation's token counts and speeds (llama.cpp's timing summary)."""
    decode = s["new_tokens"] - 1  # the first new token comes with the prefill
    speed = f"{decode / s['decode_s']:.1f} tok/s" if decode > 0 and s["decode_s"] > 0 else "-"
    drafts = f"; speculative: {s['accepted']} of {s['drafted']} drafted tokens accepted" if "drafted" in s else ""
    return (f"prompt: {s['prompt_tokens']} tokens in {s['prefill_s'] * 1e3:.0f} ms "
            f"({s['prompt_tokens'] / s['prefill_s']:.1f} tok/s); generated: {s['new_tokens']} tokens, decode "
            f"{speed}{drafts}")


def cmd_eval(args) -> int:
    from llgraph.runtime.backends import backend as backend_spec
    from llgraph.runtime.eval import evaluate

    if args.batch_size < 1:
        raise LlgraphError(f"--batch-size ({args.batch_size}) must be at least 1")
    from llgraph.bundled import MC_BASICS, PASSAGE

    path = args.data or (MC_BASICS if args.task == "mc" else PASSAGE)
    data = evaluate.load_mc(path) if args.task == "mc" else evaluate.load_text(path)  # before loading
    backends = [args.backend] + ([args.compare] if args.compare else [])
    results = {}
    for backend in backends:
        runner = runner_of(args, backend)
        kv = runner.backend.kv_format().name
        if args.kv_cache is None and args.compare and kv in backend_spec(args.compare).kv_formats:
            args.kv_cache = kv  # a comparison keeps its caches in one format: the first backend's (its default)
        if args.task == "mc":
            results[backend] = evaluate.evaluate_mc(runner, data, args.batch_size, progress=True)
        else:
            results[backend] = evaluate.evaluate_perplexity(runner, data, args.context, args.stride)
    table = evaluate.format_results(args.task, results, data)
    print(table)
    if args.output:
        from llgraph.outdir import write_atomic

        write_atomic(Path(args.output), json.dumps(evaluate.as_json(args.task, results), indent=2))
    return 0


def cmd_lm_eval(args) -> int:  # lm-evaluation-harness's own command line, llgraph registered
    from llgraph.runtime.eval.harness import main

    return main(args.harness_args) or 0


def cmd_bench(args) -> int:  # runtime/bench/speed.py's command line
    from llgraph.runtime.bench.speed import main

    return main(args.bench_args) or 0


def _diff_cache_length(args) -> int:
    """Both sides' cache length: --max-seq-len, else the engine's fixed one (the caches are compared whole), else
    256."""
    if "trt" not in (args.a, args.b):
        return args.max_seq_len or 256
    from llgraph.export_folder import ENGINE_META

    meta = Path(args.engine) / ENGINE_META
    if not meta.exists():
        raise LlgraphError(f"--engine {args.engine} holds no built engine ({ENGINE_META}); run `llgraph build "
                           f"{args.engine}` first")
    engine = json.loads(meta.read_text())["max_seq_len"]
    if args.max_seq_len not in (None, engine):
        raise LlgraphError(f"--max-seq-len ({args.max_seq_len}) differs from the engine's cache ({engine} positions); "
                           "drop it, or rebuild the engine with that length")
    return engine


def cmd_diff(args) -> int:
    from llgraph.bundled import resolve
    from llgraph.checkpoint import open_model
    from llgraph.ir import value_order
    from llgraph.runtime.backends import SideRequest, diff_sides
    from llgraph.runtime.eval import diff
    from llgraph.weight_request import DTYPE_ALIASES

    if args.b is None and not args.save:  # else it would run side a and report nothing
        raise LlgraphError("diff compares two sides: give --b (torch, ort, onnx or trt), or --save FILE to record "
                           "side a for a later --load")
    model = resolve(args.model)
    from llgraph.export_folder import Manifest

    exported = Manifest.find(Path(model))
    if exported is not None:
        raise LlgraphError(f"{args.model} is an export folder; diff builds every side from the checkpoint or config "
                           f"it came from ({exported.weights}): pass that, with --b {exported.target}")
    is_checkpoint = Path(model).exists() and not str(model).endswith(".json")
    # every side computes in float from the same tensors (a GGUF's blocks dequantized)
    opened = open_model(model, model if is_checkpoint else None, Weights(dequantize=True))
    cfg, source, graph = opened.config, opened.source, opened.graph
    dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)
    try:
        makers = diff_sides((args.a, args.b))  # every backend's sides: torch, ort, onnx, trt
    except MissingExtra as e:
        if args.a != "torch":
            raise
        raise LlgraphError(f"llgraph diff compares against the PyTorch executor (--a torch, its default reference), "
                           f"which needs torch: {str(e).split(': ', 1)[-1]}; or compare ONNX Runtime's two targets "
                           "without it: --a ort --b onnx") from None

    def sides(name: str, dtype: str):
        return makers[name](SideRequest(cfg, source, dtype, args.max_seq_len, args.engine, args.tensorrt))

    for side in (args.a, args.b):
        if side is not None and side not in makers:
            raise LlgraphError(f"unknown backend '{side}'; use {', '.join(makers)}")
    if "trt" in (args.a, args.b) and not args.engine:
        raise LlgraphError("--b trt needs --engine FOLDER (a --target trt export with `llgraph build` run on it); "
                           "to compare across machines, --save here and --load on the GPU machine")
    args.max_seq_len = _diff_cache_length(args)
    if args.load:
        name, inputs, capture_a = diff.load_run(args.load)
        print(f"loaded {len(inputs)} steps of '{name}' from {args.load}")
    else:
        if args.tokens:
            prompt = parse_tokens(args.tokens)
        else:
            from llgraph.tokenizer import Tokenizer
            if not is_checkpoint:
                raise LlgraphError("--prompt needs a checkpoint with a tokenizer; pass --tokens 1,2,3 instead")
            prompt = Tokenizer.load(model).encode(args.prompt)
        name = args.a
        inputs, capture_a = diff.greedy_steps(sides(args.a, args.a_dtype), prompt, args.steps)
    if args.save:
        size = diff.save_run(args.save, name, inputs, capture_a,
                             diff.keep_values(args.save_values, [v.name for v in graph.outputs]))
        print(f"saved {len(inputs)} steps of '{name}' ({args.save_values}) to {args.save}: {size / 2**20:.1f} MiB")
    if args.b is None:
        return 0
    report = diff.compare(capture_a, diff.run_steps(sides(args.b, dtype), inputs), value_order(graph),
                          [v.name for v in graph.outputs], args.atol, args.rtol)
    print(diff.format_report(report, name, f"{args.b} ({dtype})", args.atol, args.rtol, args.all))
    if dtype != args.a_dtype:
        print(f"\nerror growth through the layers at prefill ({args.b} {dtype} vs {name} {args.a_dtype}):")
        print(diff.layer_growth(report, cfg.num_layers))
    return 0 if report.passed else 1


def _one_line_warnings() -> None:
    import warnings

    from llgraph.hf_config import ConfigWarning

    show = warnings.showwarning

    def showwarning(message, category, *rest, **kw):
        if issubclass(category, ConfigWarning):
            print(f"llgraph: warning: {message}", file=sys.stderr)
        else:
            show(message, category, *rest, **kw)
    warnings.showwarning = showwarning


def cmd_chat(args) -> int:
    from llgraph.runtime.cli.chat import cmd_chat as chat

    return chat(args)


COMMANDS = {"inspect": cmd_inspect, "export": cmd_export, "build": cmd_build, "generate": cmd_generate,
            "chat": cmd_chat, "diff": cmd_diff, "eval": cmd_eval, "serve": cmd_serve, "lm_eval": cmd_lm_eval,
            "bench": cmd_bench, "cache": cmd_cache, "convert": cmd_convert}


def _options_first(argv: list[str]) -> list[str]:
    """`cache verify --cache-dir D a b` as `cache --cache-dir D verify a b`: argparse ends a positional list at the
    first option, so names given after one were refused."""
    options: list[str] = []
    names: list[str] = []
    rest = argv[1:]
    while rest:
        token = rest.pop(0)
        if token == "--cache-dir" and rest:
            options += [token, rest.pop(0)]
        else:
            (options if token.startswith("-") else names).append(token)
    return [argv[0], *options, *names]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:  # the harness's own parser reads the rest, --help included
        args = argparse.Namespace(command="lm-eval", func="lm_eval", harness_args=argv[1:])
    elif argv[:1] == ["bench"]:  # so is the benchmark's
        args = argparse.Namespace(command="bench", func="bench", bench_args=argv[1:])
    else:
        args = build_parser().parse_args(_options_first(argv) if argv[:1] == ["cache"] else argv)
    args.func = COMMANDS[args.func]  # the parser names the command; its function is here
    _one_line_warnings()
    if getattr(args, "command", None) == "export" and not (args.config or args.checkpoint):
        print("llgraph: error: export needs --config or --checkpoint", file=sys.stderr)
        return 2
    status = 0
    try:
        with signals_raise():  # SIGTERM/SIGHUP clean up like Ctrl-C: no partial output is left behind
            fetch_hub_models(args)
            status = args.func(args)
    except Terminated as e:
        print(f"llgraph: {e}", file=sys.stderr)
        return 128 + e.signum
    except USER_ERRORS as e:
        print(f"llgraph: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `llgraph inspect ... | head`
        sys.stdout = None
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
