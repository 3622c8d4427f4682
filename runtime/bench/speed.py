"""`llgraph bench`: llama-bench for llgraph. Prompt processing (pp) and token generation (tg) speed of one model on one
backend, the weight bytes a decode step reads and the bandwidth that implies beside the machine's own read bandwidth
(measured in the same invocation), and optionally a peer timed in the same run, so every ratio holds whatever the
machine's load.

    llgraph bench MODEL [--backend ort|torch] [-p 512] [-n 128] [-d 0] [--repeats 3] [--threads N]
                        [--kv-cache f32,f16,int8] [--accuracy-level 0,4] [--peer 'llama-bench=PATH [FLAGS]']
                        [--peer transformers] [--device cuda] [--dtype D]

MODEL is what `llgraph generate` takes (an export folder, a checkpoint such as a GGUF, 'smollm2'), or, for --backend
torch, a config preset (`llama-3.2-1b`, `8b`, ...) on seeded random weights: speed does not depend on the values.
pp: one forward of `-p` random prompt tokens into an empty cache (tok/s = p / its time); tg: `-n` one-token steps
into an empty cache, or after `-d` tokens of context (tok/s = n / their time) — llama-bench's definitions, with no
sampling or text. `--kv-cache` names the KV cache format(s) and `--accuracy-level` the quantized weights' compute
(0 exact, 4 int8 activations): one llgraph row each (default: the backend's, the model's).
The engines run in turn `--repeats` times (so drift in the machine's speed hits each alike), each
figure the best of its runs, after a warm-up run. Peers: `llama-bench=PATH` runs
llama.cpp's (or ik_llama.cpp's) llama-bench on the same GGUF with the same -p/-n/-d/-t; `transformers` times HF
transformers' LlamaForCausalLM of the same config (random weights, same dtype and device).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time
from pathlib import Path

import numpy as np

from llgraph.errors import LlgraphError

DEPTH_CHUNK = 2048  # tg's context (-d) is written this many tokens a forward


class Timed:
    """pp and tg of a model behind `forward(ids, positions)` (one step on the cache `allocate()` empties), as
    llama-bench measures them: pp, one forward of `p` prompt tokens into an empty cache; tg, `n` one-token steps
    into an empty one (after `depth` tokens of context when given, like llama-bench's -d). `run()` is one
    measurement of each (seconds); the first call warms up."""

    def __init__(self, forward, allocate, vocab: int, p: int, n: int, sync=lambda: None, depth: int = 0):
        rng = np.random.default_rng(0)
        self.prompt = rng.integers(0, vocab, (1, max(p, depth, 1)), dtype=np.int64)
        self.steps = rng.integers(0, vocab, (n, 1, 1), dtype=np.int64)
        self.forward, self.allocate, self.p, self.n, self.sync, self.depth = forward, allocate, p, n, sync, depth
        self.run()

    def run(self) -> dict:
        times = {"pp": float("inf"), "tg": float("inf")}
        if self.p:
            self.allocate()
            self.sync()
            t0 = time.perf_counter()
            self.forward(self.prompt[:, :self.p], np.arange(self.p, dtype=np.int64)[None])
            self.sync()
            times["pp"] = time.perf_counter() - t0
        if self.n:
            self.allocate()
            for start in range(0, self.depth, DEPTH_CHUNK):  # the context, a chunk at a time (bounded activations)
                end = min(self.depth, start + DEPTH_CHUNK)
                self.forward(self.prompt[:, start:end], np.arange(start, end, dtype=np.int64)[None])
            self.sync()
            t0 = time.perf_counter()
            for i in range(self.n):
                self.forward(self.steps[i], np.array([[self.depth + i]], np.int64))
            self.sync()
            times["tg"] = time.perf_counter() - t0
        return times


def read_bandwidth(threads: int, size: int = 1 << 30, repeats: int = 3) -> float:
    """GB/s of reading `size` bytes with `threads` threads (numpy's OR-reduction, which releases the GIL and streams
    at memory speed), best of `repeats`: the ceiling a memory-bound decode step meets on this machine now."""
    a = np.ones(size // 8, np.uint64)
    parts = np.array_split(a, threads)
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.bitwise_or.reduce, args=(part,)) for part in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def onnx_bytes_per_token(folder: Path) -> int:
    """Bytes of an export's initializers a one-token step reads: all of them but an embedding table the head does
    not share (a gather reads one row of it), and of a routed mixture's experts (llgraph's MoE, ONNX Runtime's, the
    standard lowering's gathered branch, which one token takes: export/onnx_moe.py, the trt export's ExpertMatMul)
    the token's k of them."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    sizes = {}
    for i in graph.initializer:
        length = next((int(e.value) for e in i.external_data if e.key == "length"), None)
        sizes[i.name] = length if length is not None else len(i.raw_data)
    dims = {i.name: list(i.dims) for i in graph.initializer}
    topk = {n.output[1]: n.input[1] for n in graph.node if n.op_type == "TopK"}  # chosen experts -> its K
    ks = {i.name: int(numpy_helper.to_array(i).reshape(-1)[0]) for i in graph.initializer if i.name in topk.values()}
    nodes: list = []
    elsewhere: set[str] = set()
    for n in graph.node:
        branches = {a.name: a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH}
        if n.op_type == "If" and set(branches) == {"then_branch", "else_branch"}:  # few tokens: the gathered way
            nodes += branches["then_branch"].node
            elsewhere.update(x for m in branches["else_branch"].node for x in m.input)
        else:
            nodes.append(n)
    gathered: set[str] = set()
    read: set[str] = set()
    share: dict[str, float] = {}
    for n in nodes:
        tables = n.input[1:] if n.op_type in ("QEmbedding", "GatherBlockQuantized") else \
            n.input[:1] if n.op_type == "Gather" and n.input[1] not in topk else ()
        if n.op_type == "MoE":  # stacked experts [experts, ...]: k of them a token
            k = next(a.i for a in n.attribute if a.name == "k")
            share.update({x: k / dims[x][0] for x in n.input[2:] if x in dims})
        if n.op_type == "Gather" and n.input[1] in topk and n.input[0] in dims:  # a token's k experts' rows
            share[n.input[0]] = ks[topk[n.input[1]]] / dims[n.input[0]][0]
        if n.op_type == "ExpertMatMul" and n.input[2] in topk and n.input[1] in dims:  # the trt export's products
            share[n.input[1]] = ks[topk[n.input[2]]] / dims[n.input[1]][0]
        gathered.update(tables)
        read.update(x for x in n.input if x not in tables)
    return int(sum(v * share.get(k, 1.0) for k, v in sizes.items()
                   if k in read or (k not in gathered and k not in elsewhere)))


def llgraph_engine(args, kv_cache: str | None = None, level: int | None = None) -> tuple[Timed, int | None, str, dict]:
    """(its timer, weight bytes a decode step reads or None, a description, extras) of MODEL on llgraph's
    --backend, its KV cache in format `kv_cache` (None: the backend's default), its quantized weights at accuracy
    level `level` (None: the model's default)."""
    from llgraph.runtime.backends import open_runner
    from llgraph.runtime.engine.packed import step_logits
    from llgraph.weight_request import Weights

    start = time.perf_counter()
    weight_bytes: int | None
    if args.backend == "torch":
        runner, sync = _torch_runner(args, kv_cache)
        b = runner.backend
        weight_bytes = _read_per_token({k: v.numel() * v.element_size() for k, v in b.executor.params.items()},
                                       b.config.tie_word_embeddings)
        allocate = lambda: b.allocate(1, zeroed=True)  # noqa: E731
    else:
        runner = open_runner(args.model, args.backend, max_seq_len=max(args.p, args.depth + args.n) + 1,
                             threads=args.threads, kv_cache=kv_cache, weights=Weights(accuracy_level=level))
        b, sync = runner.backend, (lambda: None)
        weight_bytes = onnx_bytes_per_token(Path(b.folder)) if b.folder is not None else None
        allocate = lambda: b.allocate(1)  # noqa: E731
    opened = time.perf_counter() - start
    timed = Timed(lambda ids, pos: step_logits(b, ids, int(pos[0, 0])), allocate, b.vocab_size, args.p, args.n, sync,
                  args.depth)
    device = f" on {args.device}" if args.backend == "torch" else ""
    kv = f", KV {b.kv_format().name}" if kv_cache or args.depth else ""
    kv += f", accuracy level {level}" if level is not None else ""
    return timed, weight_bytes, f"llgraph {args.backend}{device}{kv}", {"load s": f"{opened:.2f}"}


def _torch_runner(args, kv_cache):
    import torch

    from llgraph.bundled import resolve
    from llgraph.checkpoint import _preset_path
    from llgraph.runtime.backends.pytorch import TorchRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    preset = not Path(resolve(args.model)).exists() and _preset_path(args.model).exists()
    runner = TorchRunner(None if preset else args.model, config=args.model if preset else None,
                         max_seq_len=max(args.p, args.depth + args.n) + 1, dtype=args.dtype, device=args.device,
                         progress=True, kv_cache=kv_cache)
    return runner, torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)


def _read_per_token(sizes: dict[str, int], tied: bool) -> int:
    """Bytes of weights one decode step reads: every tensor but the embedding table (one row of it is read), which
    is read whole when the head shares it."""
    return sum(v for k, v in sizes.items() if tied or "embed" not in k)


def transformers_engine(args, config) -> tuple[Timed, int, str, dict]:
    """HF transformers' eager LlamaForCausalLM of the same config (random init), timed like llgraph."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = config
    hf = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                     num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                     tie_word_embeddings=c.tie_word_embeddings, rope_theta=c.rope.theta,
                     max_position_embeddings=c.max_position_embeddings)
    dtype = getattr(torch, args.dtype)
    with torch.device(args.device):
        model = LlamaForCausalLM(hf).to(dtype).eval()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    state: dict = {}

    @torch.inference_mode()
    def forward(ids, pos):
        out = model(input_ids=torch.from_numpy(ids).to(args.device), past_key_values=state.get("past"),
                    use_cache=True, logits_to_keep=1)
        state["past"] = out.past_key_values
        return out.logits[:, -1].float().cpu()

    timed = Timed(forward, state.clear, c.vocab_size, args.p, args.n, sync, args.depth)
    sizes = {k: v.numel() * v.element_size() for k, v in model.named_parameters()}  # tied: once
    return timed, _read_per_token(sizes, c.tie_word_embeddings), f"transformers on {args.device}", {}


class LlamaBench:
    """A llama-bench binary (llama.cpp's or ik_llama.cpp's) on the same GGUF with the same -p/-n/-d/-t and its own
    `flags`: `run()` is one run of each test (-r 1), its tok/s as seconds."""

    def __init__(self, args, path: str, gguf: Path, flags: list[str]):
        self.args, self.path, self.gguf, self.flags = args, path, gguf, flags

    def run(self) -> dict:
        a, times = self.args, {}
        for test, shape in (("pp", ["-p", str(a.p), "-n", "0"]), ("tg", ["-p", "0", "-n", str(a.n)])):
            count = a.p if test == "pp" else a.n
            if not count:
                times[test] = float("inf")
                continue
            cmd = [self.path, "-m", str(self.gguf), "-t", str(a.threads or 2), "-r", "1", "-o", "json", *shape]
            if a.depth and test == "tg":
                cmd += ["-d", str(a.depth)]
            r = subprocess.run(cmd + self.flags, capture_output=True, text=True)
            if r.returncode != 0:
                raise LlgraphError(f"{self.path} failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}")
            want = (a.p, 0) if test == "pp" else (0, a.n)  # the row of this test (some versions add others)
            row = next(x for x in json.loads(r.stdout) if (x["n_prompt"], x["n_gen"]) == want)
            times[test] = count / row["avg_ts"]
        return times


def llama_bench_engine(args, path: str, gguf: Path, flags: list[str]) -> tuple[LlamaBench, int, str, dict]:
    """A llama-bench peer; its weight bytes a token: the GGUF's tensors (read as stored), less an untied table, and
    of a mixture's experts the token's k of them."""
    from llgraph.gguf_source import gguf_reader, metadata

    reader = gguf_reader(gguf)
    embed = next((t.n_bytes for t in reader.tensors if t.name == "token_embd.weight"), 0)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    arch = metadata(reader, "general.architecture")
    experts, used = metadata(reader, f"{arch}.expert_count"), metadata(reader, f"{arch}.expert_used_count")
    weight_bytes = int(sum(t.n_bytes * (used / experts if experts and "_exps." in t.name else 1)
                           for t in reader.tensors)) - (0 if tied else embed)
    name = Path(path).absolute().parent.parent.parent.name or "llama-bench"  # llama.cpp/build/bin/llama-bench, as given
    return LlamaBench(args, path, gguf, flags), weight_bytes, " ".join([f"{name} llama-bench", *flags]), {}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="llgraph bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--backend", default="ort", choices=["ort", "torch"])
    p.add_argument("--device", default="cpu", help="torch's device (cuda: a GPU)")
    p.add_argument("--dtype", default="float32", help="torch's dtype (float32, float16, bfloat16)")
    p.add_argument("-p", type=int, default=512, help="prompt tokens (pp; 0: none)")
    p.add_argument("-n", type=int, default=128, help="generated tokens (tg; 0: none)")
    p.add_argument("-d", "--depth", type=int, default=0, help="tokens of context before tg's steps (llama-bench's -d)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core)")
    p.add_argument("--kv-cache", help="llgraph's KV cache format, or several (f32,f16,int8: a row each)")
    p.add_argument("--accuracy-level", help="quantized weights' compute on ONNX Runtime, or several (0,4: a row each; "
                                            "default: the model's)")
    p.add_argument("--peer", action="append", default=[],
                   help="'llama-bench=PATH [FLAGS]' (a llama-bench binary on the same GGUF, with its own flags, e.g. "
                        "'-rtr 1') or transformers; repeatable")
    args = p.parse_args(argv)
    from llgraph.bundled import resolve
    from llgraph.checkpoint import load_config

    threads = args.threads or __import__("os").cpu_count()
    bandwidth = read_bandwidth(threads)
    probes = {t: read_bandwidth(t) for t in (1, 2) if t != threads}  # the 1- and 2-thread probes beside every run
    levels = args.accuracy_level.split(",") if args.accuracy_level else [None]
    if any(v is not None and not v.isdigit() for v in levels):
        raise LlgraphError(f"--accuracy-level {args.accuracy_level}: give levels 0-4, comma-separated (e.g. 0,4)")
    levels = [None if v is None else int(v) for v in levels]
    if args.backend != "ort" and levels != [None]:
        raise LlgraphError("--accuracy-level is ONNX Runtime's (--backend ort); the torch executor computes exactly")
    engines: list[tuple[Timed | LlamaBench, int | None, str, dict]]
    engines = [llgraph_engine(args, kv, level) for kv in (args.kv_cache.split(",") if args.kv_cache else [None])
               for level in levels]
    for peer in args.peer:
        if peer == "transformers":
            engines.append(transformers_engine(args, load_config(args.model)))
        elif peer.startswith("llama-bench="):
            gguf = Path(resolve(args.model))
            if gguf.suffix != ".gguf":
                raise LlgraphError("--peer llama-bench needs MODEL to be a GGUF file (the one both engines run)")
            path, *flags = peer.split("=", 1)[1].split()
            engines.append(llama_bench_engine(args, path, gguf, flags))
        else:
            raise LlgraphError(f"--peer {peer}: use llama-bench=PATH or transformers")
    best: list[dict[str, float]] = [{"pp": float("inf"), "tg": float("inf")} for _ in engines]
    for _ in range(args.repeats):  # the engines in turn, so the machine's drifting speed hits each alike
        for b, (engine, *_) in zip(best, engines):
            for k, v in engine.run().items():
                b[k] = min(b[k], v)
    rows: list[tuple[dict[str, float], int | None, str, dict]] = [
        (b, weight_bytes, what, extra) for b, (_, weight_bytes, what, extra) in zip(best, engines)]
    tg = f"tg{args.n}" + (f" @ d{args.depth}" if args.depth else "")
    others = "".join(f", {v:.1f} GB/s at {t} thread{'s' if t > 1 else ''}" for t, v in probes.items())
    print(f"\n{args.model}, {threads} threads; read bandwidth of this machine now: {bandwidth:.1f} GB/s at {threads} "
          f"thread{'s' if threads > 1 else ''}{others}")
    print(f"| engine | pp{args.p} tok/s | {tg} tok/s | weights read / token | GB/s in tg | llgraph × this, pp | "
          "llgraph × this, tg | load s |\n|---|---|---|---|---|---|---|---|")
    first = rows[0][0]
    for times, weight_bytes, what, extra in rows:
        pp = args.p / times["pp"] if times["pp"] < float("inf") else 0.0
        tgs = args.n / times["tg"] if times["tg"] < float("inf") else 0.0
        gbs = f"{weight_bytes * tgs / 1e9:.1f}" if weight_bytes and tgs else "-"
        read = f"{weight_bytes / 1e9:.3f} GB" if weight_bytes else "-"
        ratio = [f"{times[k] / first[k]:.2f}" if times[k] < float("inf") else "-" for k in ("pp", "tg")]
        print(f"| {what} | {pp:.1f} | {tgs:.1f} | {read} | {gbs} | {ratio[0]} | {ratio[1]} | "
              f"{extra.get('load s', '-')} |", flush=True)


if __name__ == "__main__":
    main()
