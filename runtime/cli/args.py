"""`llgraph`'s command line: the flags several commands share, and the flags made into what the commands take (the
parser of every command is parser.py; the commands themselves are in commands.py and artifacts.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llgraph.errors import LlgraphError
from llgraph.runtime.backends import BACKENDS
from llgraph.weight_request import DTYPE_ALIASES, KERNELS, Weights

CACHE_HELP = "where checkpoints are exported for ONNX Runtime (default $LLGRAPH_CACHE_DIR, else ~/.cache/llgraph)"


def dtype_name(text: str) -> str:
    """fp32/fp16/bf16 or float32/float16/bfloat16 -> the canonical name."""
    names = DTYPE_ALIASES
    if text not in names and text not in names.values():
        raise argparse.ArgumentTypeError(f"unknown dtype '{text}'; use fp32, fp16 or bf16")
    return names.get(text, text)


def add_weight_flags(p: argparse.ArgumentParser, whose: str = "") -> None:
    """How weights are run, the same flags for export, generate, eval and serve (weight_request.Weights)."""
    p.add_argument("--dtype", default="fp32", help=f"{whose}dtype: fp32 (default), fp16 or bf16 "
                   "(bf16: trt and onnx targets only; ONNX Runtime's CPU kernels have none)")
    p.add_argument("--quantize", choices=("int4", "int8"), help=f"round {whose}float decoder-layer Linears to "
                   "nearest (a GGUF's Q4_0/Q4_1/Q8_0 blocks are carried as stored without it)")
    p.add_argument("--block-size", type=int, default=32, help="--quantize: codes per scale (32, 64, 128)")
    p.add_argument("--symmetric", action="store_true", help="--quantize: no per-block mins (zero point 2^(bits-1))")
    p.add_argument("--lm-head", choices=("int4", "int8"), help="round the lm head (and an embedding table tied to "
                   "it) to nearest, with --block-size and --symmetric (default: float; a GGUF's as stored)")
    p.add_argument("--dequantize", action="store_true", help=f"run {whose}quantized GGUF blocks (e.g. the bundled "
                   "Q4_1) in float instead of as stored")
    p.add_argument("--accuracy-level", type=int, help="quantized weights' compute (MatMulNBits' accuracy_level): 0 = "
                   "exact fp32; 4 = int8 activations, faster, approximate (default: by format — 4 for GGUF K-quant "
                   "super-blocks on llgraph's kernels, else 0)")
    p.add_argument("--lora", action="append", default=[], metavar="DIR[:SCALE]", help="merge a PEFT LoRA adapter "
                   "(adapter_config.json + adapter_model.safetensors) into a float checkpoint's weights, scaled by "
                   "SCALE (default 1); repeat to add several")
    p.add_argument("--revision", help="a Hub id's branch, tag or commit (MODEL or --checkpoint as org/name, "
                   "org/name:Q4_K_M or org/name:FILE.gguf; default: main)")
    p.add_argument("--kernels", choices=KERNELS, default="auto", help="quantized Linears on ONNX Runtime: "
                   "llgraph's CPU kernels (the stored blocks, exact fp32 or level 4's int8; built once per machine) "
                   "where they build, else ONNX Runtime's own ops (auto, the default), or either by name")


RUN_FLAVORS = ("auto", "tensorrt", "rtx", "twin")
RUN_FLAVOR_HELP = ("for --backend trt: the TensorRT to run with (default: the one the engine was built with); twin: "
                   "TensorRT's CPU twin, which checks the engine's execution contract and computes with ONNX Runtime")


def add_runner_flags(p: argparse.ArgumentParser, backend_help: str, max_seq_len_help: str) -> None:
    """What generate, eval and serve share: MODEL, the backend, the cache length, the TensorRT, the export cache and
    the weight flags (runtime.backends.open_runner takes them)."""
    p.add_argument("model", help="export folder, checkpoint (HF folder, .safetensors, .gguf), 'smollm2', or a Hub id "
                   "(org/name, org/name:Q4_K_M, org/name:FILE.gguf)")
    p.add_argument("--backend", default="ort", choices=tuple(BACKENDS), help=backend_help)
    p.add_argument("--max-seq-len", type=int, help=max_seq_len_help)
    p.add_argument("--tensorrt", choices=RUN_FLAVORS, default="auto", help=RUN_FLAVOR_HELP)
    p.add_argument("--cache-dir", help=CACHE_HELP)
    p.add_argument("--threads", type=int, help="CPU threads: ONNX Runtime's intra-op threads, which llgraph's "
                   "kernels run on (default: every core), or torch's for --backend torch")
    p.add_argument("--kv-cache", type=_kv_cache, metavar="f32|f16|int8",
                   help="the KV cache's format: f16 (half f32's bytes; the default on llgraph's CPU kernels), "
                        "int8 (a float32 scale per position and head: 0.27 of f32's bytes, for long contexts and "
                        "many slots), or f32 (exact; torch's default); a TensorRT engine keeps its own floats")
    add_weight_flags(p, "a checkpoint's ")


def add_sampling_flags(p: argparse.ArgumentParser, max_new_tokens: int, what: str) -> None:
    """What generate and chat share: how many tokens, and how they are sampled (runtime.engine.sampling.Sampling)."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=f"{what} (default {max_new_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 disables")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 disables")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this fraction as likely as the most likely one; 0 disables")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats; 1 disables")
    p.add_argument("--seed", type=int, help="seed for sampling (same seed, same tokens)")
    p.add_argument("--speculative", type=_speculative, default=SPECULATIVE_DEFAULT, metavar="off|ngram|draft=MODEL",
                   help="draft tokens and verify them in one step (the same greedy output and sampling distribution): "
                        "ngram by prompt lookup (faster where the answer repeats its context), draft=MODEL by a "
                        f"smaller model sharing the tokenizer (default {SPECULATIVE_DEFAULT})")
    add_draft_max(p)


def add_draft_max(p: argparse.ArgumentParser) -> None:
    from llgraph.runtime.engine.speculative import MAX_DRAFT

    p.add_argument("--draft-max", type=_draft_max, default=MAX_DRAFT, metavar="N",
                   help=f"the most tokens speculation drafts a step; the draft length adapts below it (default "
                        f"{MAX_DRAFT})")


def _kv_cache(value: str) -> str:
    from llgraph.kv_cache import kv_format

    try:
        return kv_format(value).name
    except LlgraphError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _draft_max(value: str) -> int:
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise argparse.ArgumentTypeError(f"{value!r} is not an integer >= 1 (the most tokens drafted a step)")


SPECULATIVE_DEFAULT = "ngram"  # measured: 1.6x on quoting a passage, ~1.0x on open chat (README, "Speculative")


def _speculative(value: str) -> str:
    if value in ("off", "ngram") or value.startswith("draft=") and len(value) > len("draft="):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not off, ngram or draft=MODEL")


def share_threads_for_a_draft(args) -> None:
    """Before any runner opens: a model and its draft model share one thread pool (registry)."""
    if args.speculative.startswith("draft="):
        from llgraph.runtime.backends import share_threads_with_a_draft

        share_threads_with_a_draft(args.backend, args.threads)


def runner_of(args, backend: str | None = None):
    """The runner the model flags name (MODEL, --backend or `backend`, --max-seq-len, --cache-dir, --tensorrt, the
    weight flags, --threads)."""
    from llgraph.runtime.backends import open_runner

    return open_runner(args.model, backend or args.backend, max_seq_len=args.max_seq_len, cache_dir=args.cache_dir,
                       tensorrt=args.tensorrt, weights=weights_of(args), threads=args.threads,
                       kv_cache=args.kv_cache)


def fetch_hub_models(args) -> None:
    """A Hub id given as MODEL, --checkpoint or --config is fetched first (at --revision), its progress shown, and
    the command then runs on the local copy."""
    from llgraph.hub import fetch, is_hub_id

    for name in ("model", "checkpoint", "config"):
        if is_hub_id(getattr(args, name, None)):
            setattr(args, name, str(fetch(getattr(args, name), getattr(args, "revision", None))))


def parse_tokens(text: str, flag: str = "--tokens") -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise LlgraphError(f"{flag} '{text}' must be comma-separated token ids, e.g. {flag} 1,2,3") from None
    if not ids or min(ids) < 0:
        raise LlgraphError(f"{flag} '{text}' must be one or more non-negative token ids, e.g. {flag} 1,2,3")
    return ids


def read_prompt(text: str | None, file: str | None) -> str:
    """--prompt TEXT, --prompt - (stdin) or --prompt-file FILE; an unreadable file is one line. Text read from a
    file or a pipe loses its one final newline (the text file's line end, `echo`'s), not part of the prompt."""
    if file is not None:
        try:
            text = Path(file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise LlgraphError(f"cannot read --prompt-file {file}: {getattr(e, 'strerror', None) or e}") from None
    elif text == "-":
        text = sys.stdin.read()
    elif text is None:
        raise LlgraphError("give --prompt TEXT (- for stdin) or --prompt-file FILE")
    else:
        return text
    return text[:-1] if text.endswith("\n") else text


def check_sampling_flags(args) -> None:
    """The sampling flags checked before anything loads, the error naming the flag (`--top-p`), not the field."""
    from llgraph.errors import LlgraphError, RequestError
    from llgraph.runtime.engine.sampling import Sampling

    try:
        Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed, min_p=args.min_p)
    except RequestError as e:
        field, _, rest = str(e).partition(" ")
        raise LlgraphError(f"--{field.replace('_', '-')} {rest}") from None


def sampling_of(args, runner) -> dict:
    """The sampling flags (add_sampling_flags) as Runner.generate/stream keywords for `runner`; --speculative
    draft=MODEL opens the draft model (on the same backend, with the same cache length)."""
    speculative = args.speculative
    if speculative.startswith("draft="):  # checked before anything is generated
        from llgraph.runtime.backends import open_draft

        speculative = open_draft(speculative[len("draft="):], runner, args.backend, cache_dir=args.cache_dir,
                                 tensorrt=args.tensorrt, threads=args.threads)
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repetition_penalty=args.repetition_penalty, seed=args.seed, speculative=speculative,
                draft_max=args.draft_max)


def weights_of(args) -> Weights:
    """The weight flags (add_weight_flags) as the one request export and the runners take."""
    from llgraph.lora import Adapter

    return Weights(args.dtype, args.quantize, args.block_size, args.symmetric, args.dequantize, args.accuracy_level,
                   args.lm_head, args.kernels, tuple(Adapter.parse(spec) for spec in args.lora))
