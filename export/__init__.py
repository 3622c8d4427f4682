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
                 max_seq_len: int | None = None, force: bool = False, progress: bool = False, seed: int = 0) -> Path:
    """Config (+ checkpoint, else seeded random weights) -> an ONNX folder: model.onnx, model.onnx.data,
    manifest.json, and the checkpoint's tokenizer files."""
    from llgraph.bundled import resolve
    from llgraph.config import load_config
    from llgraph.export.lower import export
    from llgraph.outdir import check_writable_target
    from llgraph.passes import model_graph
    from llgraph.weights import open_checkpoint

    checkpoint = resolve(checkpoint)
    config = resolve(config)
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype '{dtype}'; use one of fp32, fp16, bf16")
    tgt = get_target(target)
    if dtype == "bfloat16" and target == "ort":
        raise ExportError("--dtype bf16 cannot run on the ort target (ONNX Runtime's CPU kernels have no bf16 "
                          "MatMul); use --dtype fp32 or fp16 for ONNX Runtime, or --target trt / onnx for a GPU "
                          "runtime with bf16")
    if checkpoint is not None and not Path(checkpoint).exists():
        raise ExportError(f"--checkpoint {checkpoint} does not exist; pass an HF folder, a .safetensors or .gguf "
                          "file, or 'smollm2'")
    cfg = load_config(config)
    if max_seq_len is not None and not 0 < max_seq_len:
        raise ExportError(f"--max-seq-len ({max_seq_len}) must be a positive number of tokens")
    check_writable_target(Path(out), force)  # before any loading: a refused -o costs nothing
    source = open_checkpoint(checkpoint, cfg, seed)
    graph = model_graph(cfg, dtype)
    return export(graph, source, tgt, out, max_positions=max_seq_len or cfg.max_position_embeddings, force=force,
                  progress=progress, extra_files=source.tokenizer_files(),
                  write_extras=_gguf_tokenizer(checkpoint) if str(checkpoint).endswith(".gguf") else None)


def _gguf_tokenizer(gguf_path):
    """Writes tokenizer.json + tokenizer_config.json built from the GGUF's own vocabulary and chat template."""
    import json

    def write(folder: Path):
        from llgraph.runtime.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(gguf_path)
        tok.tk.save(str(folder / "tokenizer.json"))
        config = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return write
