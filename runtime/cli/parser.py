"""`llgraph`'s argument parser: every command and its flags (the flags shared by several commands, and what they are
made into, are in args.py; the commands themselves in commands.py and artifacts.py). Its errors are one line."""

from __future__ import annotations

import argparse

from llgraph.checkpoint import presets
from llgraph.runtime.backends import BACKENDS
from llgraph.runtime.cli.args import (
    CACHE_HELP,
    RUN_FLAVOR_HELP,
    RUN_FLAVORS,
    _speculative,
    add_draft_max,
    add_runner_flags,
    add_sampling_flags,
    add_weight_flags,
    dtype_name,
)


class Version(argparse.Action):
    """--version: llgraph's on stdout (what scripts read), and on stderr whether its CPU kernels are built here."""

    def __call__(self, parser, namespace, values, option_string=None):
        import sys

        from llgraph import __version__
        from llgraph.plugins import cpu

        print(f"llgraph {__version__}")
        print(cpu.status(), file=sys.stderr)
        parser.exit()


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, as every other failure of the command line is, naming the nearest flag
    when one is mistyped (instead of the whole usage text)."""

    def error(self, message: str):
        import difflib
        import sys

        command = self._command(sys.argv[1:])
        hint = ""
        if "unrecognized arguments" in message:
            flags = [f for a in (command or self)._actions for f in a.option_strings]
            wrong = [w.split("=")[0] for w in message.split(":", 1)[1].split() if w.startswith("-")]
            near = [m[0] for w in wrong if (m := difflib.get_close_matches(w, flags, n=1, cutoff=0.6))]
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
        where = command.prog if command is not None else self.prog
        self.exit(2, f"llgraph: error: {message}{hint} (`{where} --help` lists every flag)\n")

    def _command(self, argv):
        """The subcommand's parser named on the command line, if any."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for word in argv:
                    if word in action.choices:
                        return action.choices[word]
        return None


def build_parser() -> argparse.ArgumentParser:

    p = Parser(prog="llgraph", description="`llgraph` command line. Every expected failure is one "
                                "line on stderr and exit status 2.")
    p.add_argument("--version", action=Version, nargs=0, help="show llgraph's version, and its CPU kernels' state")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="summarize the graph a config builds: ops, parameters, KV-cache size")
    i.add_argument("model", nargs="?", help="a checkpoint, an export folder or 'smollm2' (or give --config)")
    i.add_argument("--config", help=f"a config file (llgraph JSON, HF config.json, .gguf), a checkpoint or export "
                   f"folder, 'smollm2', or a preset: {', '.join(presets())}")
    i.add_argument("--dtype", default="fp32", type=dtype_name, help="fp32, fp16 or bf16 (as for export)")
    i.add_argument("--passes", action="store_true", help="show the graph after QKV and gate/up packing")
    i.set_defaults(func="inspect")
    e = sub.add_parser("export", help="export a model to an ONNX folder (model.onnx + external data + manifest)")
    e.add_argument("--config", help="config file or preset; defaults to the checkpoint's own (config.json / GGUF)")
    e.add_argument("--checkpoint", help="HF folder, .safetensors, .gguf, or 'smollm2' (the bundled SmolLM2-135M "
                   "GGUF); without it, seeded random weights (their size said first; past 10 GB asked, or --yes)")
    e.add_argument("--yes", action="store_true", help="write random weights past 10 GB without asking")
    e.add_argument("--target", default="ort", help="ort (ONNX Runtime, default), onnx (standard ops only) or trt "
                   "(TensorRT plugin nodes; ONNX Runtime runs it too)")
    add_weight_flags(e)
    e.add_argument("--max-seq-len", type=int, help="longest position the RoPE tables cover (default: the config's)")
    e.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    e.add_argument("--force", action="store_true", help="replace an earlier llgraph export at -o (never a folder "
                   "holding anything llgraph did not write)")
    e.add_argument("-o", "--output", required=True, help="output folder")
    e.set_defaults(func="export")
    v = sub.add_parser("convert", help="a GGUF file as an HF folder (config.json, float32 safetensors, tokenizer): "
                       "for --lora, transformers, fine-tuning (needs torch and transformers)")
    v.add_argument("gguf", help="the .gguf file")
    v.add_argument("-o", "--output", required=True, help="the new folder")
    v.add_argument("--force", action="store_true", help="replace OUTPUT if llgraph wrote it")
    v.set_defaults(func="convert")
    b = sub.add_parser("build", help="build a TensorRT engine from a --target trt export folder (TensorRT-RTX builds "
                       "without a GPU; standard TensorRT needs one; the engine runs on a GPU)")
    b.add_argument("folder", help="an export folder made with --target trt")
    b.add_argument("-o", "--output", help="engine path (default FOLDER/model.engine)")
    b.add_argument("--max-batch", type=int, default=8, help="most prompts in one batch (default 8)")
    b.add_argument("--max-seq-len", type=int, help="KV-cache length, fixed in the engine (default min(2048, the "
                   "export's RoPE range))")
    b.add_argument("--opt-prefill", type=int, default=128, help="prompt length the prefill profile is tuned for")
    b.add_argument("--plugins", choices=("aot", "jit", "none"), help="aot: llgraph's Triton plugins as PTX inside "
                   "the engine (TensorRT's default); jit: the same plugins called from Python; none: TensorRT's "
                   "native layers from the function bodies (TensorRT-RTX's default and only choice)")
    b.add_argument("--tensorrt", choices=("auto", "tensorrt", "rtx"), default="auto", help="which TensorRT builds "
                   "when both are installed: tensorrt (10.15+/11) or rtx (TensorRT-RTX; builds without a GPU)")
    b.set_defaults(func="build")
    g = sub.add_parser("generate", help="stream a completion from an export folder or a checkpoint")
    add_runner_flags(g, "ort: ONNX Runtime CPU (default); torch: the PyTorch executor; trt: a built TensorRT engine",
                     "KV-cache length: prompt + new tokens (default min(2048, the model's range))")
    g.add_argument("--prompt", help="the prompt text; - reads it from stdin")
    g.add_argument("--prompt-file", help="the prompt text, from this file")
    g.add_argument("--tokens", help="the prompt as comma-separated token ids (e.g. for a random-weight export)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (the default "
                   "for a text prompt to a model that has one, as llama.cpp's CLI does)")
    g.add_argument("--raw", action="store_true", help="plain completion: the prompt as it is, no chat template")
    g.add_argument("--system", help="a system message before the prompt (implies --chat)")
    g.add_argument("--stats", action="store_true", help="after the answer, one line on stderr: the prompt's tokens "
                   "and prefill speed, the generated tokens and decode speed")
    add_sampling_flags(g, 128, "most tokens to generate")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.set_defaults(func="generate")
    c = sub.add_parser("chat", help="an interactive conversation in the terminal (/reset, /system TEXT, Ctrl-D)")
    add_runner_flags(c, "ort (default), torch or trt", "KV-cache length: the conversation kept within it (default "
                     "min(2048, the model's range))")
    c.add_argument("--system", help="the system message")
    add_sampling_flags(c, 256, "most tokens a reply takes")
    c.set_defaults(func="chat")
    d = sub.add_parser("diff", help="compare every IR value between two backends, step by step")
    d.add_argument("model", help="checkpoint (HF folder, .gguf, 'smollm2') or a config (random weights)")
    d.add_argument("--a", default="torch", help="reference side (torch, ort, onnx)")
    d.add_argument("--b", help="side under test (torch, ort, onnx, trt); omit with --save to only record side a")
    d.add_argument("--engine", help="for trt: the export folder holding the built engine (its dtype is the engine's)")
    d.add_argument("--tensorrt", choices=RUN_FLAVORS, default="auto", help=RUN_FLAVOR_HELP)
    prompt = d.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="The quick brown fox", help="prompt text (needs a checkpoint's "
                        "tokenizer)")
    prompt.add_argument("--tokens", help="comma-separated token ids")
    d.add_argument("--steps", type=int, default=4, help="decode steps after the prefill")
    d.add_argument("--dtype", default="float32", help="side b's dtype (fp32, fp16, bf16)")
    d.add_argument("--a-dtype", default="float32", help="side a's dtype")
    d.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance (default 1e-4)")
    d.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance (default 1e-3)")
    d.add_argument("--max-seq-len", type=int, help="KV-cache length of both sides (default 256; with --b trt, the "
                   "engine's)")
    d.add_argument("--save", help="write side a's inputs and values to this .npz (compressed)")
    d.add_argument("--save-values", choices=("outputs", "layers", "all"), default="layers",
                   help="what --save keeps: final outputs; those + each layer's output (default); every value")
    d.add_argument("--load", help="use a saved run as side a (its inputs drive side b)")
    d.add_argument("--all", action="store_true", help="print every value, not only failures and layer outputs")
    d.set_defaults(func="diff")
    v = sub.add_parser("eval", help="multiple-choice accuracy or perplexity of a model on any backend")
    add_runner_flags(v, "the backend scored (default ort)", "KV-cache length (default min(2048, the model's range))")
    v.add_argument("--task", required=True, choices=("mc", "perplexity"), help="mc: JSONL items with context, "
                   "choices, answer; perplexity: a text file")
    v.add_argument("--data", help="the items (.jsonl) or the text (.txt); default: llgraph's own (20 everyday "
                   "knowledge items for mc, the opening of A Tale of Two Cities for perplexity)")
    v.add_argument("--compare", choices=tuple(BACKENDS), help="score the same data on this backend too and "
                   "print the per-item differences")
    v.add_argument("--context", type=int, help="perplexity: tokens per window (default: the cache length)")
    v.add_argument("--stride", type=int, help="perplexity: tokens a window advances (default: the window)")
    v.add_argument("--batch-size", type=int, default=8, help="mc: pairs scored per forward pass (default 8)")
    v.add_argument("--output", help="also write the numbers to this JSON file")
    v.set_defaults(func="eval")
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching (llgraph[serve])")
    add_runner_flags(s, "the runner (default ort)", "KV-cache length per slot (default: planned, the longest whose "
                     "caches for every slot fit 60%% of the memory free after loading, up to the model's context)")
    s.add_argument("--name", help="the model id clients send, or several comma-separated (aliases: a client's fixed "
                   "'gpt-4o-mini' too); default: MODEL's file or folder name")
    s.add_argument("--any-model", action="store_true", help="answer a request naming any model with this one "
                   "(llama-server's behaviour; tools with a hard-coded model name need no change); default: an "
                   "unknown name is OpenAI's 404")
    s.add_argument("--slots", type=int, default=8, help="requests decoded together: cache rows (default 8)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429 (default 64)")
    s.add_argument("--timeout", type=float, help="seconds a request may take before it is ended (default none)")
    s.add_argument("--max-request-bytes", type=int, default=8 << 20, help="a larger request body is refused with "
                   "413 before it is read (default 8 MiB)")
    s.add_argument("--speculative", type=_speculative, default="off", metavar="off|ngram|draft=MODEL",
                   help="requests' default speculative decoding; draft=MODEL opens a draft model beside the model (a "
                   "cache row per slot) and requests may ask for \"draft\" (a request's \"speculative\" field "
                   "overrides the default; default off: in a busy batch on ONNX Runtime each drafting request costs "
                   "a forward of its own)")
    add_draft_max(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--api-key", help="every request but /health must send `Authorization: Bearer KEY` or `X-Api-Key: "
                   "KEY` (default: $LLGRAPH_API_KEY, else none; a warning when listening beyond loopback without one)")
    s.add_argument("--api-key-file", metavar="PATH", help="the API key, read from this file's first line (not shown "
                   "by `ps`, unlike --api-key)")
    s.add_argument("--allowed-hosts", nargs="+", default=(), metavar="NAME", help="Host header names answered "
                   "besides localhost, 127.0.0.1 and [::1] ('*': any); bound to loopback, any other Host is a 421 "
                   "(DNS rebinding)")
    s.add_argument("--cors-origins", nargs="+", default=(), metavar="ORIGIN", help="browser origins allowed to call "
                   "the API (CORS, preflights answered), e.g. https://app.example; default none")
    s.add_argument("--open-metrics", action="store_true", help="/metrics answers without the API key (for a "
                   "scraper without credentials)")
    s.add_argument("--pooling", choices=("last", "mean"), default="last", help="/v1/embeddings: pool the last "
                   "hidden states by the last token's (default) or their mean")
    s.add_argument("--prefill-chunk", type=int, default=128, help="the prompt tokens a step writes beside the "
                   "running requests' next tokens (on llgraph's CPU kernels one forward holds both, the admitted "
                   "prompts sharing the budget; elsewhere a chunk of one prompt between two decode steps); "
                   "default 128, measured: against 256 it halves the running streams' longest pause while a long "
                   "prompt arrives, its first token within 2%% (runtime/bench/chunked.py); 0: every prompt whole")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--grace", type=float, default=10.0, help="on SIGTERM: seconds running requests get to finish "
                   "(default 10)")
    s.add_argument("--ray", action="store_true", help="deploy on Ray Serve (local Ray unless --ray-address)")
    s.add_argument("--replicas", type=int, default=1, help="--ray: replicas, each with its own runner (default 1)")
    s.add_argument("--ray-address", help="--ray: join this cluster ('auto': the one `ray start` made here)")
    s.set_defaults(func="serve")
    h = sub.add_parser("lm-eval", add_help=False, help="lm-evaluation-harness's command line with the model "
                       "'llgraph' registered: llgraph lm-eval --model llgraph --model_args model=smollm2 --tasks T")
    h.add_argument("harness_args", nargs=argparse.REMAINDER, help="lm_eval's arguments (see llgraph lm-eval --help)")
    h.set_defaults(func="lm_eval")
    r = sub.add_parser("bench", add_help=False, help="prompt and generation speed as llama-bench measures them, peers "
                       "in the same run: llgraph bench MODEL [-p 512] [-n 128] [--peer 'llama-bench=PATH [FLAGS]']")
    r.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's arguments (see llgraph bench --help)")
    r.set_defaults(func="bench")
    c = sub.add_parser("cache", help="list, verify or clean the checkpoints `generate` exported for ONNX Runtime")
    c.add_argument("action", choices=("list", "verify", "clean"), help="list: entries with size and source; verify: "
                   "every file against the entry's integrity record; clean: remove")
    c.add_argument("names", nargs="*", help="for verify and clean: the entries (default: all)")
    c.add_argument("--cache-dir", help=CACHE_HELP)
    c.set_defaults(func="cache")
    return p
