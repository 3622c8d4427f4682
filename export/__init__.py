"""IR -> ONNX. One module per target, all on the shared mechanism in `lower.py`:
`onnx` (standard ops only), `ort` (ONNX Runtime contrib fusions, the CPU default), `trt` (TensorRT plugin nodes
with their reference decompositions as model-local functions)."""

from __future__ import annotations

import sys
from pathlib import Path

from llgraph.errors import ExportError
from llgraph.export.lower import Target
from llgraph.weight_request import Weights

TARGETS = ("ort", "onnx", "trt")


def get_target(name: str) -> Target:
    if name == "ort":
        from llgraph.export.ort import TARGET
    elif name == "onnx":
        from llgraph.export.onnx import TARGET
    elif name == "trt":
        from llgraph.export.trt import TARGET
    else:
        raise ExportError(f"unknown target '{name}'; use one of {', '.join(TARGETS)}")
    return TARGET


def export_model(config, checkpoint=None, out="out", *, target: str = "ort", weights: Weights = Weights(),
                 max_seq_len: int | None = None, force: bool = False, progress: bool = False, seed: int = 0) -> Path:
    """Config (+ checkpoint, else seeded random weights) -> an ONNX folder: model.onnx, model.onnx.data,
    manifest.json, and the checkpoint's tokenizer files. `weights` (llgraph.weight_request.Weights) says how:
    a GGUF's Q4_0/Q4_1/Q8_0/K-quant Linears are carried block for block (QLinear) unless dequantized, a
    float checkpoint's can be rounded to int4/int8, the lm head too; its accuracy level is MatMulNBits' (ort)."""
    from llgraph.checkpoint import checkpoint_path, open_model
    from llgraph.export.lower import export
    from llgraph.outdir import check_writable_target

    tgt = get_target(target)
    weights.check(target, tgt.bf16, tgt.accuracy_level, tgt.kernels)
    checkpoint = checkpoint_path(checkpoint)  # before the output folder's check, as before any loading
    if str(checkpoint).endswith(".gguf"):  # a tokenizer llgraph cannot build is refused before anything else
        from llgraph.gguf_source import gguf_reader
        from llgraph.gguf_tokenizer import check

        check(gguf_reader(checkpoint))
    weights = resolve_kernels(weights, target, checkpoint, progress)
    if max_seq_len is not None and not 0 < max_seq_len:
        raise ExportError(f"--max-seq-len ({max_seq_len}) must be a positive number of tokens")
    check_writable_target(Path(out), force)  # before any loading: a refused -o costs nothing
    # GGUF super-blocks as stored for llgraph's CPU kernels; widened to the blocked form for ONNX Runtime's own ops,
    # ONNX and TensorRT, which have no super-block kernel
    model = open_model(config, checkpoint, weights, seed, superblocks=target == "ort" and weights.kernels == "llgraph")
    options: dict[str, int | str] = {} if weights.accuracy_level is None else {"accuracy_level": weights.accuracy_level}
    if weights.kernels == "llgraph":  # their QLinear, and GroupedAttention, which every model has
        from llgraph.plugins import cpu

        if cpu.library(progress) is None:
            raise ExportError(f"--kernels llgraph: {cpu.why_not()}")
        options["kernels"] = "llgraph"
    return export(model.graph, model.source, tgt, out,
                  max_positions=max_seq_len or model.config.max_position_embeddings, force=force, progress=progress,
                  extra_files=model.source.tokenizer_files(),
                  write_extras=_gguf_tokenizer(checkpoint) if str(checkpoint).endswith(".gguf") else None,
                  options=options)


def resolve_kernels(weights: Weights, target: str, checkpoint, progress: bool = True) -> Weights:
    """--kernels auto made concrete: llgraph's CPU kernels where the target runs them (ort, float32) on quantized
    blocks (a GGUF's, or --quantize/--lm-head rounding) and they build here (once, with a progress line), else ONNX
    Runtime's own ops; when the kernels would serve but cannot be had, one line says why and how to get them."""
    if weights.kernels != "auto":
        return weights
    quantized = weights.rounds or (str(checkpoint).endswith(".gguf") and not weights.dequantize)
    if not (quantized and get_target(target).kernels and weights.dtype == "float32"):
        return weights.replace(kernels="standard")
    from llgraph.plugins import cpu

    if cpu.library(progress) is None:
        print(f"llgraph: running the quantized Linears on ONNX Runtime's own ops, not llgraph's faster CPU kernels: "
              f"{cpu.why_not()}", file=sys.stderr)
        return weights.replace(kernels="standard")
    return weights.replace(kernels="llgraph")


def _gguf_tokenizer(gguf_path):
    """Writes tokenizer.json + tokenizer_config.json built from the GGUF's own vocabulary and chat template (none
    for a GGUF that carries no vocabulary), and generation_config.json from its recommended sampling
    (general.sampling.*) where it names any."""
    import json

    from llgraph import generation_config
    from llgraph.gguf_source import gguf_reader
    from llgraph.tokenizer import GGUF_KEY, Tokenizer

    reader = gguf_reader(gguf_path)
    # built before any weight is written: one that cannot be is refused first
    tok = Tokenizer.from_gguf(gguf_path) if "tokenizer.ggml.tokens" in reader.fields else None
    sampling = generation_config.of_gguf(reader)

    def write(folder: Path):
        if tok is not None:
            tok.tk.save(str(folder / "tokenizer.json"))
            config = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template,
                      GGUF_KEY: True}
            (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        if sampling:
            (folder / generation_config.FILE).write_text(json.dumps(sampling, indent=2))
    return write
