"""How far an engine's next-token distributions are from the exact ones: mean KL(exact || engine) over a text, with
llama.cpp's own `llama-perplexity --kl-divergence` as a peer on the same tokens and the same reference.

    python -m llgraph.runtime.bench.kl MODEL.gguf --text FILE [--ctx 512] [--chunks 2] [--threads 2]
                                 [--llama-perplexity PATH] [--levels auto,0]

The reference is llgraph's PyTorch executor in float64 on the GGUF's weights dequantized by ggml's definitions (so
it is the exact product of the stored weights, not another quantization). The text is tokenized by the GGUF's own
tokenizer and cut into `--chunks` windows of `--ctx` tokens; as llama-perplexity does, a chunk's first token is the
BOS where the vocabulary adds one, and the KL is taken over the second half of each window (every position sees at
least ctx/2 tokens). llgraph's exports (one per accuracy level in `--levels`: `auto` is the default, by format)
are compared here; llama.cpp reads the reference from a file in its `--kl-divergence-base` format (log-probabilities
within 16 nats of the top, in 16 bits) and reports its own mean KLD. With `--llama-perplexity` the windows are
llama.cpp's own (the tokens of the base file it writes for the GGUF), and llgraph's distributions are also held to
llama.cpp's directly: mean KL(llama.cpp || llgraph) on the same file.

Measured (mean KL from the float64 reference, `--llama-perplexity PATH`): On the real SmolLM2 made Q4_K_M by
`llama-quantize` from F16 (Q4_K, Q6_K and 181 Q5_0/Q8_0 fallbacks of 272 tensors), 4 windows of 512 tokens of English
prose: llgraph 0.0032 from the exact product of the file's weights (0.00053 with the fallbacks exact, at half the
prefill speed of a Gemma 3 file), llama.cpp 0.0051, llgraph from llama.cpp's own distribution 0.0062 — a tenth of what
the quantization itself costs (llama.cpp's Q4_K_M from its F16: 0.060). The same made Q2_K / Q3_K_M / IQ4_XS
(Q2_K/Q3_K/IQ4_XS tensors where rows are whole super-blocks, Q4_0/IQ4_NL fallbacks elsewhere), 4 windows of 512 tokens
of the GPL-3's text: llgraph 0.0034 / 0.0037 / 0.0032, llama.cpp 0.0054 / 0.0061 / 0.0050, llgraph from llama.cpp's own
0.0073 / 0.0078 / 0.0067; the quantization from F16 costs 0.40 / 0.16 / 0.18 (llama.cpp's own KLD) — and greedy answers
equal llama.cpp's on the same files (`tests/llama_cpp_answers.py DIR Q3_K_M Q2_K IQ4_XS`: 7 of 9 questions; the other
two first differ where llama.cpp gives its token 0.27 and llgraph's 0.17, and 0.28 against 0.24 — a 135M model's flat
distributions at 3 bits). Made IQ3_S / IQ3_XXS (from the bundled Q4_1, with an imatrix; their IQ3 tensors run exactly as
Q5_K / Q6_K: llgraph/grid_superblocks.py), 2 windows of 512 tokens of README.md: llgraph level 0 KL 0 / 0 (top-1
0.998 / 1.000: the repacked weights are the file's), the default level (int8 activations) 0.0043 / 0.0044, llama.cpp
0.0061 / 0.0068 (`--llama-perplexity`, built here 2026-11-30, IQ3_XXS now carried with the file's own d and exponent
-1), llgraph's default from llama.cpp's own 0.0081 / 0.0091. On a file
of blocked formats alone (a Q8_0 or Q4_0 file, no K-quant tensor) the exact default is a choice you can reverse: level 4
is llama.cpp's own arithmetic there (SmolLM2 Q8_0 / Q4_0 from F16, same text: level 4 0.0039 / 0.0043, llama.cpp 0.0040
/ 0.0042, exact 0) and on a 1B Q8_0, one thread, prefills 2.4x and decodes 1.6x faster than exact — exact prefill is
0.69x llama.cpp's, level 4 1.63x (`llgraph bench 1b-q8_0.gguf -p 128 -n 32 --threads 1 --accuracy-level 0,4 --peer
llama-bench=PATH`: a row per level in one run).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np


def windows(gguf: Path, text: str, ctx: int, chunks: int) -> np.ndarray:
    """[chunks, ctx] token ids of `text` by the GGUF's tokenizer, each window starting with BOS where it adds one."""
    from llgraph.gguf_source import gguf_reader
    from llgraph.tokenizer import Tokenizer

    ids = Tokenizer.load(gguf).encode(text)
    if len(ids) < ctx * chunks:
        raise SystemExit(f"the text holds {len(ids)} tokens; --ctx {ctx} x --chunks {chunks} needs {ctx * chunks}")
    out = np.array(ids[:ctx * chunks], np.int64).reshape(chunks, ctx)
    fields = gguf_reader(gguf).fields
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    if add_bos is not None and bool(add_bos.contents()):
        out[:, 0] = int(fields["tokenizer.ggml.bos_token_id"].contents())
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def reference(gguf: Path, tokens: np.ndarray, threads: int) -> np.ndarray:
    """[chunks, ctx, vocab] float64 log-probabilities of the float64 executor on the GGUF's dequantized weights."""
    import torch

    from llgraph.checkpoint import load_config, open_checkpoint
    from llgraph.runtime.backends.pytorch import TorchBackend
    from llgraph.runtime.engine.packed import step_logits

    torch.set_num_threads(threads)
    config = load_config(gguf)  # the GGUF as a checkpoint opens (Phi-3's fused projections seen split)
    backend = TorchBackend(config, open_checkpoint(gguf, config, 0), tokens.shape[1], "float64", progress=True)
    out = []
    for row in tokens:
        backend.allocate(1, zeroed=True)
        out.append(log_softmax(step_logits(backend, row, kept=len(row))))
    return np.stack(out)


def llgraph_logp(gguf: Path, tokens: np.ndarray, threads: int, level, work: Path) -> np.ndarray:
    """The same from an ort export of the GGUF at accuracy level `level` (None: the default, by format)."""
    from llgraph.export import export_model
    from llgraph.runtime.backends.ort import OrtBackend
    from llgraph.runtime.engine.packed import step_logits
    from llgraph.weight_request import Weights

    folder = export_model(gguf, checkpoint=gguf, out=work / f"l{level}", max_seq_len=tokens.shape[1], force=True,
                          weights=Weights(accuracy_level=level))
    backend = OrtBackend(folder, tokens.shape[1], threads)
    out = []
    for row in tokens:
        backend.allocate(1)
        out.append(log_softmax(step_logits(backend, row, kept=len(row))))
    return np.stack(out)


def mean_kl(ref: np.ndarray, logp: np.ndarray, scored_only: bool = False) -> tuple[float, float]:
    """(mean KL(ref || logp), top-1 agreement) over the second half of each window, positions ctx/2 .. ctx-2 (those
    llama-perplexity scores); `scored_only`: `ref` holds those positions only and is read from a base file, whose
    entries more than 16 nats below the top are floored, so the sum is over log-probabilities above -16, as
    llama-perplexity sums it."""
    ctx = logp.shape[1]
    r, p = (ref if scored_only else ref[:, ctx // 2:ctx - 1]), logp[:, ctx // 2:ctx - 1]
    terms = np.exp(r) * (r - p)
    kl = np.where(r > -16, terms, 0.0).sum(-1) if scored_only else terms.sum(-1)
    return float(kl.mean()), float((r.argmax(-1) == p.argmax(-1)).mean())


def write_base(path: Path, tokens: np.ndarray, ref: np.ndarray) -> None:
    """The reference in llama-perplexity's --kl-divergence-base file format (tools/perplexity/perplexity.cpp):
    "_logits_", n_ctx, n_vocab, n_chunk, the tokens, then per chunk and scored position a float scale and minimum
    and the log-probabilities as uint16 steps above that minimum (floored at 16 nats below the top)."""
    chunks, ctx, vocab = ref.shape
    nv = 2 * ((vocab + 1) // 2) + 4
    with open(path, "wb") as f:
        f.write(b"_logits_")
        np.array([ctx], np.uint32).tofile(f)
        np.array([vocab, chunks], np.int32).tofile(f)
        tokens.astype(np.int32).tofile(f)
        for c in range(chunks):
            lp = ref[c, ctx // 2:ctx - 1]  # log-probabilities (max - logsumexp shift does not change them)
            top = lp.max(-1, keepdims=True)
            low = np.maximum(lp.min(-1, keepdims=True), top - 16)
            scale = ((top - low) / 65535).astype(np.float32)
            q = np.where(lp > low, np.rint((lp - low) / np.where(scale > 0, scale, 1)), 0).astype(np.uint16)
            rows = np.zeros((len(lp), nv), np.uint16)
            header = np.concatenate([scale, low.astype(np.float32)], -1).view(np.uint16)  # two floats
            rows[:, :4] = header
            rows[:, 4:4 + vocab] = q
            rows.tofile(f)


def read_base(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A --kl-divergence-base file (write_base's format, as llama-perplexity writes it from a model): its tokens
    [chunks, ctx] and its log-probabilities [chunks, ctx - 1 - ctx/2, vocab] of the scored positions (those floored
    at 16 nats below the top read as that floor)."""
    raw = path.read_bytes()
    if raw[:8] != b"_logits_":
        raise SystemExit(f"{path} is not a llama-perplexity --kl-divergence-base file")
    ctx = int(np.frombuffer(raw, np.uint32, 1, 8)[0])
    vocab, chunks = (int(v) for v in np.frombuffer(raw, np.int32, 2, 12))
    tokens = np.frombuffer(raw, np.int32, ctx * chunks, 20).reshape(chunks, ctx).astype(np.int64)
    nv, scored = 2 * ((vocab + 1) // 2) + 4, ctx - 1 - ctx // 2
    rows = np.frombuffer(raw, np.uint16, chunks * scored * nv, 20 + 4 * ctx * chunks).reshape(chunks, scored, nv)
    scale, low = (np.ascontiguousarray(rows[..., i:i + 2]).view(np.float32)[..., 0].astype(np.float64)
                  for i in (0, 2))
    return tokens, low[..., None] + scale[..., None] * rows[..., 4:4 + vocab].astype(np.float64)


def llama_cpp_logp(binary: str, gguf: Path, text: Path, ctx: int, chunks: int, threads: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's own windows of `text` and its log-probabilities on them (read_base), from llama-perplexity
    writing its --kl-divergence-base file for the GGUF."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "llama.kld"
        _perplexity(binary, gguf, ctx, threads, "-f", str(text), "--chunks", str(chunks), "--kl-divergence-base",
                    str(out))
        return read_base(out)


def _perplexity(binary: str, gguf: Path, ctx: int, threads: int, *flags: str) -> str:
    """llama-perplexity on the GGUF with these flags -> its output; a failure is one line naming its last words."""
    r = subprocess.run([binary, "-m", str(gguf), "-c", str(ctx), "-b", str(ctx), "-t", str(threads), *flags],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{binary} failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    return r.stdout + r.stderr


def llama_cpp_kl(binary: str, gguf: Path, tokens: np.ndarray, ref: np.ndarray, threads: int) -> float:
    """llama-perplexity's mean KLD of the GGUF against the reference written as its base file."""
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "reference.kld"
        write_base(base, tokens, ref)
        said = _perplexity(binary, gguf, tokens.shape[1], threads, "--kl-divergence-base", str(base),
                           "--kl-divergence")
    m = re.search(r"Mean\s+KLD:\s+([-0-9.e]+)", said)
    if m is None:
        raise SystemExit(f"{binary} printed no mean KLD: {(said.strip().splitlines() or ['no output'])[-1]}")
    return float(m[1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--text", type=Path, required=True, help="a text file (e.g. a public-domain book)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--levels", default="auto,0", help="llgraph accuracy levels to compare (auto: the default)")
    p.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity binary: its KL too")
    args = p.parse_args(argv)
    theirs = None
    if args.llama_perplexity:  # llama.cpp's windows of the text, so every engine meets the same tokens
        tokens, theirs = llama_cpp_logp(args.llama_perplexity, args.model, args.text, args.ctx, args.chunks,
                                        args.threads)
    else:
        tokens = windows(args.model, args.text.read_text(), args.ctx, args.chunks)
    ref = reference(args.model, tokens, args.threads)
    rows, direct = {}, {}
    with tempfile.TemporaryDirectory() as work:
        for level in args.levels.split(","):
            lv = None if level == "auto" else int(level)
            name = f"llgraph, accuracy level {level}"
            ours = llgraph_logp(args.model, tokens, args.threads, lv, Path(work))
            rows[name] = mean_kl(ref, ours)
            if theirs is not None:
                direct[name] = mean_kl(theirs, ours, scored_only=True)
    if args.llama_perplexity:
        rows["llama.cpp (llama-perplexity --kl-divergence)"] = (
            llama_cpp_kl(args.llama_perplexity, args.model, tokens, ref, args.threads), float("nan"))
    scored = args.chunks * (args.ctx - 1 - args.ctx // 2)
    print(f"\n{args.model.name}: mean KL(float64 reference || engine) over {scored} positions of {args.text.name}")
    print("| engine | mean KL | top-1 agreement |\n|---|---|---|")
    for name, (kl, top1) in rows.items():
        print(f"| {name} | {kl:.5f} | {'-' if top1 != top1 else f'{top1:.3f}'} |")
    if direct:
        print(f"\nmean KL(llama.cpp's own distribution || llgraph's), the same {scored} positions")
        print("| engine | mean KL | top-1 agreement with llama.cpp |\n|---|---|---|")
        for name, (kl, top1) in direct.items():
            print(f"| {name} | {kl:.5f} | {top1:.3f} |")


if __name__ == "__main__":
    main()
