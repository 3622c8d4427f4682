"""Serving throughput: one `llgraph serve` process, N concurrent streaming clients, aggregate tokens/s and time to
first token, for N = 1, 4, 8, 16 in one run (each row is a ratio against the single-stream row of the same run).

    python -m llgraph.runtime.bench.serve [MODEL] [--backend ort] [--slots 16] [--concurrency 1 4 8 16]
                                              [--max-tokens 64] [--rounds 2] [--threads 2]
                                              [--peer llama-server=/path/to/llama-server]

`--peer llama-server=PATH`: the same clients, prompts and slots against llama.cpp's own server on the same GGUF
(`-np SLOTS -c SLOTS*MAX_SEQ_LEN -t THREADS`, continuous batching), run after llgraph's server has stopped; each row
then shows llgraph's tokens/s over llama-server's.

Each client sends `rounds` streaming completions one after another (greedy, a prompt of its own, run to
max_tokens with `ignore_eos`); a row's tokens/s is
every completion token of the row (the usage the server reports) over the row's wall time, prefill included.
Clients are plain http.client connections in threads, so the numbers do not depend on a client library.

Measured (2 cores of an AMD EPYC with AVX-512 VNNI, `--threads 2 --peer llama-server=PATH`), llgraph / llama-server
tok/s = ratio:
- SmolLM2 (bundled), `smollm2 --concurrency 1 8 16` (probes 30.8 / 33.9 GB/s): 8 streams 324 / 179 = 1.81, 16: 398 /
  230 = 1.73; again 2026-11-30 (probes 32.9 / 34.3 GB/s; llama-server rebuilt from the same source), 8 streams in
  eight runs (`--concurrency 8`, and two of them `--rounds 4 --max-tokens 128`): 2.03, 1.94, 2.37, 1.66, 2.10, 2.07,
  2.01, 2.23 (median 2.05; llgraph ~335-376 tok/s each run, llama-server 152-191: its spread is most of the ratio's);
  16 streams 1.81, 1.59;
- 1B Q4_K_M, `1b.gguf --concurrency 8 16`: 93.0 / 46.8 = 1.99, 121.0 / 73.7 = 1.64;
- 8B Q4_K_M, `8b.gguf --concurrency 8 16 --rounds 1 --max-tokens 32`: 18.4 / 8.8 = 2.09, 22.3 / 14.6 = 1.53;
- OLMoE-1B-7B shapes Q4_K_M, `olmoe.gguf --concurrency 1 8 16 --slots 16 --rounds 2 --max-tokens 32`: 33.0 / 29.6 =
  1.12, 49.8 / 36.0 = 1.38, 73.2 / 47.4 = 1.54;
  again 2026-11-30 (probes 30.2 / 35.4 GB/s; llama-server rebuilt from the same source), three runs: 8 streams 63.1 /
  40.9 = 1.54, 59.5 / 39.8 = 1.50, 61.4 / 39.3 = 1.56; 16 streams 1.55, 1.54, 1.47; one stream 1.11, 1.09, 1.02;
- gpt-oss-20b shapes (8 layers, MXFP4 experts), `gpt-oss-8l.gguf --concurrency 1 8 --slots 8 --rounds 1
  --max-tokens 32`: 22.2 / 20.0 = 1.11, 54.7 / 31.0 = 1.76.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

PROMPTS = ["Write a short story about a robot who learns to paint.", "Explain how rainbows form.",
           "List five uses of a paperclip.", "What makes a good cup of tea?", "Describe the water cycle.",
           "Why do cats purr?", "Give advice to someone learning to cook.", "Summarize the plot of Hamlet.",
           "What is the tallest mountain on Earth?", "How do airplanes stay in the air?",
           "Describe a walk through a forest in autumn.", "What are prime numbers?", "Tell me about the Moon.",
           "How does a bicycle work?", "Why is the sky blue?", "Write a haiku about the sea."]


def _stream(port: int, prompt: str, max_tokens: int) -> tuple[float, int]:
    """One streaming completion -> (seconds to the first text, completion tokens)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    first, tokens, pieces = None, 0, 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
            first = time.perf_counter() - start
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        elif chunk["choices"] and chunk["choices"][0].get("text"):
            pieces += 1
    conn.close()
    tokens = tokens or pieces  # a server that reports no usage in the stream: one piece a token
    return first if first is not None else time.perf_counter() - start, tokens


def _row(port: int, clients: int, rounds: int, max_tokens: int) -> dict:
    def client(i):
        return [_stream(port, PROMPTS[(i + r * clients) % len(PROMPTS)], max_tokens) for r in range(rounds)]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [x for per_client in pool.map(client, range(clients)) for x in per_client]
    wall = time.perf_counter() - start
    ttfts = sorted(t for t, _ in results)
    tokens = sum(n for _, n in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "seconds": wall,
            "tokens_per_second": tokens / wall, "ttft_p50": statistics.median(ttfts),
            "ttft_p95": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, backend: str, *, name: str, slots: int, max_seq_len: int,
                 threads: int | None = None) -> tuple[subprocess.Popen | None, int | None]:
    """`llgraph serve MODEL` on a free port, once it listens -> (process, port); (None, None) if it exited first."""
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "llgraph", "serve", model, "--backend", backend, "--name", name,
                               "--slots", str(slots), "--port", str(port), "--max-seq-len", str(max_seq_len),
                               "--max-queue", "256", *(["--threads", str(threads)] if threads else [])],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = threading.Event()

    def watch():
        assert server.stdout is not None  # a pipe (stdout=PIPE)
        for line in server.stdout:
            if "listening at" in line:
                print(line.strip(), file=sys.stderr)
                ready.set()

    threading.Thread(target=watch, daemon=True).start()
    while not ready.wait(0.5):
        if server.poll() is not None:
            print(f"the server exited ({server.returncode}) before it was ready", file=sys.stderr)
            return None, None
    return server, port


def start_llama_server(path: str, gguf: str, slots: int, max_seq_len: int,
                       threads: int) -> tuple[subprocess.Popen | None, int | None]:
    """llama.cpp's server on a free port, once /health answers 200 -> (process, port); (None, None) if it exited."""
    port = _free_port()
    server = subprocess.Popen([path, "-m", gguf, "--port", str(port), "-np", str(slots), "-c", str(slots * max_seq_len),
                               "-t", str(threads), "-tb", str(threads), "--no-webui"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while server.poll() is None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return server, port
        except OSError:
            pass
        time.sleep(0.5)
    print(f"llama-server exited ({server.returncode}) before it was ready", file=sys.stderr)
    return None, None


def _rows(server, port, args) -> list[dict] | None:
    if server is None:
        return None
    try:
        _stream(port, "Hello", 4)  # warm up
        return [_row(port, c, args.rounds, args.max_tokens) for c in args.concurrency]
    finally:
        server.terminate()
        server.wait(60)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="smollm2", help="what `llgraph serve` serves (default smollm2)")
    p.add_argument("--backend", default="ort", choices=("ort", "torch", "trt"))
    p.add_argument("--slots", type=int, default=16, help="the server's slots (default 16)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="requests each client sends in turn (default 2)")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="both servers' CPU threads (default: llgraph's own "
                   "default, every core; llama-server then gets every core too)")
    p.add_argument("--peer", default=None, help="llama-server=PATH: the same load against llama.cpp's server")
    args = p.parse_args(argv)
    if args.peer is not None and not args.peer.startswith("llama-server="):
        p.error("--peer takes llama-server=PATH")

    rows = _rows(*start_server(args.model, args.backend, name="bench", slots=args.slots,
                               max_seq_len=args.max_seq_len, threads=args.threads), args)
    if rows is None:
        return 1
    peer = None
    if args.peer is not None:
        import os

        from llgraph.bundled import BUNDLED, bundled_model

        gguf = str(bundled_model(args.model)) if args.model in BUNDLED else args.model
        peer = _rows(*start_llama_server(args.peer.split("=", 1)[1], gguf, args.slots, args.max_seq_len,
                                         args.threads or os.cpu_count() or 1), args)
        if peer is None:
            return 1
    base = rows[0]["tokens_per_second"]
    print(f"llgraph serve {args.model} --backend {args.backend} --slots {args.slots}: streaming completions of "
          f"{args.max_tokens} tokens (greedy), {args.rounds} per client")
    print(f"{'clients':>8}{'requests':>10}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'x 1st row':>10}"
          f"{'TTFT p50':>10}{'TTFT p95':>10}" + (f"{'llama-server tok/s':>20}{'llgraph x':>11}" if peer else ""))
    for i, r in enumerate(rows):
        line = (f"{r['clients']:>8}{r['requests']:>10}{r['tokens']:>8}{r['seconds']:>9.2f}"
                f"{r['tokens_per_second']:>10.1f}{r['tokens_per_second'] / base:>10.2f}{r['ttft_p50']:>9.3f}s"
                f"{r['ttft_p95']:>9.3f}s")
        if peer:
            theirs = peer[i]["tokens_per_second"]
            line += f"{theirs:>20.1f}{r['tokens_per_second'] / theirs:>11.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
