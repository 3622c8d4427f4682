"""IR -> ONNX. One module per target, all on the shared mechanism in `lower.py`:
`onnx` (standard ops only), `ort` (ONNX Runtime contrib fusions, the CPU default), `trt` (TensorRT plugin nodes
with their reference decompositions as model-local functions)."""

from __future__ import annotations

from pathlib import Path

from llgraph.export.lower import ExportError, Target

TARGETS = ("ort", "onnx", "trt")
DTYPES = ("float32", "float16", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


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


def export_model(config, checkpoint=None, out="out", target: str = "ort", dtype: str = "float32",
                 max_seq_len: int | None = None, force: bool = False, progress: bool = False, seed: int = 0,
                 quantize: str | None = None, block_size: int = 32, symmetric: bool = False,
                 dequantize: bool = False, accuracy_level: int | None = None, lm_head: str | None = None) -> Path:
    """Config (+ checkpoint, else seeded random weights) -> an ONNX folder: model.onnx, model.onnx.data,
    manifest.json, and the checkpoint's tokenizer files.

    Quantized weights: a GGUF's Q4_0/Q4_1/Q8_0 decoder-layer Linears are carried block for block (QLinear) unless
    `dequantize`; `quantize` ("int4"/"int8") rounds a float checkpoint's to nearest, `block_size` codes per scale,
    `symmetric` or with per-block mins; `lm_head` ("int4"/"int8") rounds the lm head (and an embedding table tied
    to it) the same way. `accuracy_level` is MatMulNBits' (ort target)."""
    from llgraph.bundled import resolve
    from llgraph.config import load_config
    from llgraph.export.lower import export
    from llgraph.outdir import check_writable_target
    from llgraph.passes import model_graph
    from llgraph.source_views import rtn_view
    from llgraph.weights import open_checkpoint

    checkpoint = resolve(checkpoint)
    config = resolve(config)
    tgt = get_target(target)
    dtype = check_weight_request(dtype, target, quantize, block_size, dequantize, accuracy_level, lm_head)
    if checkpoint is not None and not Path(checkpoint).exists():
        raise ExportError(f"--checkpoint {checkpoint} does not exist; pass an HF folder, a .safetensors or .gguf "
                          "file, or 'smollm2'")
    cfg = load_config(config)
    if max_seq_len is not None and not 0 < max_seq_len:
        raise ExportError(f"--max-seq-len ({max_seq_len}) must be a positive number of tokens")
    check_writable_target(Path(out), force)  # before any loading: a refused -o costs nothing
    source = open_checkpoint(checkpoint, cfg, seed)
    if not (quantize or dequantize):
        _check_stored_formats(source)
    source = rtn_view(source, cfg, quantize, block_size, symmetric, lm_head)
    graph = model_graph(cfg, dtype, None if dequantize else source.quant_format)
    options = {} if accuracy_level is None else {"accuracy_level": accuracy_level}
    return export(graph, source, tgt, out, max_positions=max_seq_len or cfg.max_position_embeddings, force=force,
                  progress=progress, extra_files=source.tokenizer_files(),
                  write_extras=_gguf_tokenizer(checkpoint) if str(checkpoint).endswith(".gguf") else None,
                  options=options)


def check_weight_request(dtype: str, target: str, quantize: str | None = None, block_size: int = 32,
                         dequantize: bool = False, accuracy_level: int | None = None,
                         lm_head: str | None = None) -> str:
    """Every weight flag checked before anything is loaded -> the canonical dtype."""
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype '{dtype}'; use one of fp32, fp16, bf16")
    if dtype == "bfloat16" and target == "ort":
        raise ExportError("--dtype bf16 cannot run on the ort target (ONNX Runtime's CPU kernels have no bf16 "
                          "MatMul); use --dtype fp32 or fp16 for ONNX Runtime, or --target trt / onnx for a GPU "
                          "runtime with bf16")
    for flag, value in (("quantize", quantize), ("lm-head", lm_head)):
        if value not in (None, "int4", "int8"):
            raise ExportError(f"unknown --{flag} '{value}'; use int4 or int8")
        if value and dequantize:
            raise ExportError(f"--{flag} and --dequantize contradict each other; pass one")
    from llgraph.quant import QuantFormat

    try:  # the format's own rule, said as the flag's
        QuantFormat(4, block_size, 0, False)
    except ValueError as e:
        raise ExportError(f"--{e} (32, 64 or 128)") from None
    if accuracy_level is not None and (accuracy_level not in (0, 1, 2, 3, 4) or target != "ort"):
        raise ExportError(f"--accuracy-level ({accuracy_level}) is MatMulNBits' (0..4) and only for --target ort")
    return dtype


def _check_stored_formats(source) -> None:
    """A GGUF Linear stored in a block type llgraph cannot carry exactly: one line naming it (or --dequantize)."""
    from llgraph.gguf_source import GGUFSource
    from llgraph.quant import GGUF_FORMATS
    from llgraph.weights import _QUANTIZABLE

    if not isinstance(source, GGUFSource):
        return
    for name in source.names():
        kind = source.tensor_type(name)
        if _QUANTIZABLE.fullmatch(name) and kind not in GGUF_FORMATS and kind not in ("F32", "F16", "BF16"):
            raise ExportError(f"{name} is stored as GGUF {kind}; llgraph carries {', '.join(GGUF_FORMATS)} "
                              "blocks exactly — pass --dequantize to export it in float (or --quantize int4 to "
                              "re-round it)")


def _gguf_tokenizer(gguf_path):
    """Writes tokenizer.json + tokenizer_config.json built from the GGUF's own vocabulary and chat template (None
    for a GGUF that carries no vocabulary)."""
    import json

    from llgraph.gguf_source import gguf_reader

    if "tokenizer.ggml.tokens" not in gguf_reader(gguf_path).fields:
        return None

    def write(folder: Path):
        from llgraph.runtime.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(gguf_path)
        tok.tk.save(str(folder / "tokenizer.json"))
        config = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return write
