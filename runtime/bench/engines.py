"""Decode benchmark: ORTRunner vs onnxruntime-genai (its fp32 CPU build of the same HF folder) vs transformers
eager, same prompt, same greedy tokens, one invocation, the same thread count.

    python -m llgraph.runtime.bench.engines [--hf-dir DIR] [--work DIR] [--threads 2] [--new-tokens 64] [--repeats 3]
    python -m llgraph.runtime.bench.engines --int4     # 4-bit: llgraph on the GGUF's own Q4_1 blocks (accuracy level 4
                                                   # and 0, and on llgraph's own CPU kernels) and on genai's
                                                   # scheme vs onnxruntime-genai int4 vs
                                                   # llama.cpp on the same GGUF, then each one's mean KL from the
                                                   # exact computation
    python -m llgraph.runtime.bench.engines --quality  # RTN int4/int8: mean KL of next-token distributions vs fp32

Prefill tok/s = prompt tokens / time to the first token's logits; decode tok/s = (new tokens - 1) / the time of
the decode steps after it. Each engine is loaded once, then the engines run in turn `repeats` times (interleaved,
so drift in the machine's speed hits each alike); each engine's best run counts. Each engine runs in a process of
its own, whose peak RSS is reported above that of a bare process.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import numpy as np

from llgraph.runtime.engine.logprobs import log_softmax
from llgraph.weight_request import Weights

PROMPT = ("Write a short story about a lighthouse keeper who discovers a message in a bottle. "
          "Describe the weather, the sea, and what the message says.")


def llgraph_engine(folder: Path, prompt: list[int], n: int, threads: int):
    from llgraph.runtime import ORTRunner

    runner = ORTRunner(folder, max_seq_len=len(prompt) + n + 1, threads=threads)
    stamps = []
    forward = runner.backend.forward

    def timed(ids, pos, **kw):
        out = forward(ids, pos, **kw)
        stamps.append(time.perf_counter())
        return out

    runner.backend.forward = timed

    def run():
        stamps.clear()
        start = time.perf_counter()
        tokens = runner.generate(prompt, n, eos_token_ids=[]).token_ids
        end = time.perf_counter()
        return tokens, len(prompt) / (stamps[0] - start), (n - 1) / (end - stamps[0])
    return run


def genai_engine(folder: Path, prompt: list[int], n: int, threads: int):
    import onnxruntime_genai as og

    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    (folder / "genai_config.json").write_text(json.dumps(config, indent=2))
    model = og.Model(str(folder))

    def run():
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + n, do_sample=False, top_k=1, min_length=len(prompt) + n)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(prompt)
        first = time.perf_counter()
        tokens = []
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        end = time.perf_counter()
        return tokens, len(prompt) / (first - start), (n - 1) / (end - first)
    return run


def transformers_engine(hf_dir: Path, prompt: list[int], n: int, threads: int):
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()

    def run():
        cache = DynamicCache(config=model.config)
        tokens = []
        with torch.inference_mode():
            start = time.perf_counter()
            logits = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[:, -1]
            first = time.perf_counter()
            for i in range(n):
                tokens.append(int(logits.argmax(-1)))
                if i < n - 1:
                    logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits[:, -1]
            end = time.perf_counter()
        return tokens, len(prompt) / (first - start), (n - 1) / (end - first)
    return run


def llama_cpp_engine(gguf: Path, prompt: list[int], n: int, threads: int):
    """llama.cpp through llama-cpp-python (build it for this CPU: an AVX2 build; AVX-512 builds crashed here)."""
    from llama_cpp import Llama

    model = Llama(str(gguf), n_ctx=len(prompt) + n + 8, n_threads=threads, n_batch=len(prompt), verbose=False)

    def run():
        model.reset()
        start = time.perf_counter()
        model.eval(prompt)
        first = time.perf_counter()
        tokens = []
        for i in range(n):
            tokens.append(int(model.sample(top_k=1, temp=0.0)))
            if i < n - 1:
                model.eval([tokens[-1]])
        end = time.perf_counter()
        return tokens, len(prompt) / (first - start), (n - 1) / (end - first)
    return run


def peak_rss_mb() -> float:
    """This process's peak RSS: Linux's VmHWM, which an exec resets (getrusage's ru_maxrss keeps the peak of the
    process that forked a spawned child), else ru_maxrss."""
    import resource

    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _serve(conn, factory, args) -> None:
    """A child process holding one engine: `factory(*args)` loads it, each "run" runs it, "stop" answers the
    process's peak RSS."""
    run = factory(*args) if factory is not None else None
    while conn.recv() == "run":
        assert run is not None  # a "run" is sent to an engine that was loaded
        conn.send(run())
    conn.send(peak_rss_mb())


class Isolated:
    """An engine in a process of its own, so that each engine's peak RSS is its own: `Isolated(None)` is the
    baseline, a process that imported what every engine's process imports (Python, numpy, this module)."""

    def __init__(self, factory, *args):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, factory, args), daemon=True)
        self.process.start()

    def __call__(self):
        self.conn.send("run")
        return self.conn.recv()

    def peak_rss(self) -> float:
        self.conn.send("stop")
        rss = self.conn.recv()
        self.process.join()
        return rss


def int4_engines(args, hf_dir: Path, prompt: list[int]) -> tuple[dict, dict]:
    """(engines, llgraph's export folders by engine name): llgraph int4 from the bundled GGUF's Q4_1 blocks at
    accuracy level 4 and 0 (exact fp32 compute, the default), the same blocks on llgraph's own CPU kernels (exact
    and level 4), llgraph int4 on genai's scheme (level 4), onnxruntime-genai's int4 build of the same model (its
    builder re-rounds the HF weights; it cannot read a quantized GGUF), llama.cpp on the GGUF itself where
    llama-cpp-python is installed."""
    import subprocess
    import sys

    from llgraph.bundled import bundled_model
    from llgraph.export import export_model

    gguf = bundled_model("smollm2")
    engines, folders = {}, {}
    for name, weights in (("llgraph int4 (MatMulNBits, level 4)", Weights(accuracy_level=4, kernels="standard")),
                          ("llgraph int4 (MatMulNBits, exact)", Weights(accuracy_level=0, kernels="standard")),
                          ("llgraph int4 (llgraph's kernels, exact: default)", Weights(kernels="llgraph")),
                          ("llgraph int4 (llgraph's kernels, level 4)", Weights(kernels="llgraph", accuracy_level=4))):
        folders[name] = export_model(gguf, checkpoint=gguf, out=args.work / name.replace(" ", "-"), target="ort",
                                     force=True, weights=weights)
        engines[name] = Isolated(llgraph_engine, folders[name], prompt, args.new_tokens, args.threads)
    # genai's own scheme (symmetric int4, block 32, the tied lm head and embedding int4 too), rounded by llgraph
    # from the same HF folder genai's builder reads: the same weights' bytes, so the graphs and runtimes compare
    name = "llgraph int4 genai's scheme (kernels, level 4)"
    folders[name] = export_model(hf_dir, checkpoint=hf_dir, out=args.work / "llgraph-int4-rtn", target="ort",
                                 force=True, weights=Weights(quantize="int4", symmetric=True, lm_head="int4",
                                                             accuracy_level=4))
    engines[name] = Isolated(llgraph_engine, folders[name], prompt, args.new_tokens, args.threads)
    genai_dir = args.work / "genai-int4"
    if not (genai_dir / "genai_config.json").exists():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o",
                        str(genai_dir), "-p", "int4", "-e", "cpu"], check=True, capture_output=True)
    engines["onnxruntime-genai int4"] = Isolated(genai_engine, genai_dir, prompt, args.new_tokens, args.threads)
    if importlib.util.find_spec("llama_cpp") is not None:
        engines["llama.cpp Q4_1"] = Isolated(llama_cpp_engine, gguf, prompt, args.new_tokens, args.threads)
    else:
        print("llama-cpp-python is not installed: no llama.cpp row (pip install llama-cpp-python, built for AVX2)")
    return engines, folders


def int4_fidelity(args, folders: dict, gguf: Path) -> None:
    """How far each int4 engine's next-token distributions are from the exact ones (llgraph at accuracy level 0
    on the same GGUF blocks): mean KL and top-1 agreement over TEXT, teacher-forced in one prefill."""
    from llgraph.tokenizer import Tokenizer

    ids = Tokenizer.load(gguf).encode(TEXT)
    logp = {name: teacher_forced(folder, ids, args.threads) for name, folder in folders.items()}
    if importlib.util.find_spec("llama_cpp") is not None:
        from llama_cpp import Llama

        model = Llama(str(gguf), n_ctx=len(ids), n_threads=args.threads, n_batch=1, logits_all=True, verbose=False)
        model.eval(ids)
        logp["llama.cpp Q4_1"] = log_softmax(np.array(model.scores[:len(ids)]))
    print(f"\nvs the exact computation (llgraph, MatMulNBits exact) over {len(ids)} tokens of A Tale of Two Cities:")
    kl_table(logp.pop("llgraph int4 (MatMulNBits, exact)"), logp, "engine")


# the opening of A Tale of Two Cities (Dickens, 1859; public domain): the fixed text of --quality
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
        "was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything "
        "before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the "
        "other way - in short, the period was so far like the present period, that some of its noisiest "
        "authorities insisted on its being received, for good or for evil, in the superlative degree of comparison "
        "only. There were a king with a large jaw and a queen with a plain face, on the throne of England; there "
        "were a king with a large jaw and a queen with a fair face, on the throne of France.")


def quality(args, hf_dir: Path) -> None:
    """Round-to-nearest's cost: per variant, the mean KL divergence KL(fp32 || variant) of the next-token
    distributions over TEXT (teacher-forced, one prefill) and the top-1 agreement with fp32, all in ORT."""
    from llgraph.export import export_model
    from llgraph.tokenizer import Tokenizer

    ids = Tokenizer.from_folder(hf_dir).encode(TEXT)
    variants: dict[str, dict] = {"fp32": {}, "RTN int8 (symmetric, block 32)": dict(quantize="int8", symmetric=True),
                "RTN int4 (min + scale, block 32)": dict(quantize="int4"),
                "RTN int4 (symmetric, block 32)": dict(quantize="int4", symmetric=True),
                "RTN int4 (min + scale, 32), lm head int4": dict(quantize="int4", lm_head="int4"),
                "RTN int4 (symmetric, 32), lm head int4": dict(quantize="int4", symmetric=True, lm_head="int4"),
                "RTN int4 (min + scale, block 64)": dict(quantize="int4", block_size=64)}
    logp: dict[str, np.ndarray] = {}
    for name, kw in variants.items():
        folder = export_model(hf_dir, checkpoint=hf_dir, out=args.work / f"quality-{len(logp)}", force=True,
                              max_seq_len=512, weights=Weights(**kw))
        logp[name] = teacher_forced(folder, ids, args.threads)
    print(f"\nSmolLM2-135M, {len(ids)} tokens of A Tale of Two Cities, vs fp32 (ONNX Runtime, accuracy level 0)")
    kl_table(logp.pop("fp32"), logp, "weights")


def teacher_forced(folder: Path, ids: list[int], threads: int):
    """Next-token log-probabilities [len(ids), vocab] of an export folder over `ids`, in one ORT prefill."""
    from llgraph.runtime.backends.ort import OrtBackend
    from llgraph.runtime.engine.packed import step_logits

    backend = OrtBackend(folder, len(ids), threads)
    backend.allocate(1)
    return log_softmax(step_logits(backend, ids, kept=len(ids)))


def kl_table(ref, logp: dict, what: str) -> None:
    """Per entry, the mean KL(ref || entry) of the next-token distributions (float64 log-probabilities) and the
    top-1 agreement with ref."""
    print(f"{what:<44}{'mean KL':>10}{'top-1 agreement':>18}")
    for name, lp in logp.items():
        kl = float((np.exp(ref) * (ref - lp)).sum(-1).mean())
        print(f"{name:<44}{kl:>10.4f}{float((ref.argmax(-1) == lp.argmax(-1)).mean()):>18.3f}")


def main(argv=None) -> None:
    from llgraph.export import export_model
    from llgraph.runtime.bench.export_speed import make_hf_folder
    from llgraph.tokenizer import Tokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", type=Path, help="HF checkpoint folder (default: SmolLM2 written from the GGUF)")
    p.add_argument("--work", type=Path, default=Path("bench-decode"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--int4", action="store_true", help="the 4-bit comparison instead of fp32")
    p.add_argument("--quality", action="store_true", help="RTN int4/int8 KL divergence vs fp32 instead of speed")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    hf_dir = args.hf_dir or (args.work / "hf" if (args.work / "hf" / "config.json").exists()
                             else make_hf_folder(args.work / "hf"))
    prompt = Tokenizer.from_folder(hf_dir).encode(PROMPT)
    if args.quality:
        return quality(args, hf_dir)
    if args.int4:
        from llgraph.bundled import bundled_model

        engines, folders = int4_engines(args, hf_dir, prompt)
        report(engines, args, prompt, "SmolLM2-135M 4-bit", "onnxruntime-genai int4",
               "llgraph int4 (MatMulNBits, exact)")
        return int4_fidelity(args, folders, bundled_model("smollm2"))
    ours = export_model(hf_dir, checkpoint=hf_dir, out=args.work / "llgraph-ort", target="ort", force=True)
    genai_dir = args.work / "genai"
    if not (genai_dir / "genai_config.json").exists():
        import subprocess
        import sys
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o",
                        str(genai_dir), "-p", "fp32", "-e", "cpu"], check=True, capture_output=True)
    engines = {"llgraph ORTRunner": Isolated(llgraph_engine, ours, prompt, args.new_tokens, args.threads),
               "onnxruntime-genai": Isolated(genai_engine, genai_dir, prompt, args.new_tokens, args.threads),
               "transformers eager": Isolated(transformers_engine, hf_dir, prompt, args.new_tokens, args.threads)}
    report(engines, args, prompt, "SmolLM2-135M fp32", "onnxruntime-genai", "transformers eager")


def report(engines: dict, args, prompt: list[int], title: str, peer: str, reference: str) -> None:
    """Run the engines (each `Isolated`) in turn `repeats` times (interleaved, so drift in the machine's speed hits
    each alike) and print each one's best prefill and decode rates, its ratio to `peer`, whether its greedy tokens
    equal `reference`'s, and its process's peak RSS above a bare process's."""
    baseline = Isolated(None)
    runs: dict[str, list] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, run in engines.items():
            runs[name].append(run())
    results = {}
    for name, rs in runs.items():
        assert all(r[0] == rs[0][0] for r in rs)
        results[name] = (rs[0][0], max(r[1] for r in rs), max(r[2] for r in rs))
    rss = {name: engine.peak_rss() for name, engine in engines.items()}
    bare = baseline.peak_rss()
    want = results[reference][0]
    print(f"\n{title}, prompt {len(prompt)} tokens, {args.new_tokens} new tokens, {args.threads} threads, best of "
          f"{args.repeats}; each engine in its own process, peak RSS above a bare one's ({bare:.0f} MB: Python, numpy)")
    width = max(len("engine"), *map(len, results)) + 2
    print(f"{'engine':<{width}}{'prefill tok/s':>15}{'decode tok/s':>14}{f'x {peer}':>28}{'peak RSS MB':>13}  "
          f"tokens == {reference}")
    for name, (tokens, prefill, decode) in results.items():
        print(f"{name:<{width}}{prefill:>15.1f}{decode:>14.1f}{decode / results[peer][2]:>28.2f}"
              f"{rss[name] - bare:>13.0f}  {tokens == want}")


if __name__ == "__main__":
    main()
