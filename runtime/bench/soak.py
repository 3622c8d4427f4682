"""A memory soak of `llgraph serve`: thousands of mixed requests from concurrent clients, the server's resident
memory sampled as they go, to show whether it levels off.

    python -m llgraph.runtime.bench.soak [MODEL] [--backend ort|torch] [--requests 3000] [--clients 8] [--every 250]

The mix, in turn: greedy and sampled completions (whole and streamed), chat, n=2 with a seed, logprobs with echo,
a JSON-schema response_format, stop strings, /tokenize, requests refused with a 400, streams the client drops
halfway, embeddings, scored prompts (echo, max_tokens 0: lm-eval's loglikelihood requests) and forced tool calls.
Each sample is VmRSS of the server process (Linux /proc) after that many requests; the last lines compare the second
half's growth with the first's and give the largest gap between two events any stream saw.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from llgraph.runtime.bench.serve import PROMPTS, start_server

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
KINDS = 13


def _mix(i: int) -> tuple[str, dict, bool]:
    """Request i of the mix: (path, body, drop the stream halfway)."""
    prompt = PROMPTS[i % len(PROMPTS)]
    kind = i % KINDS
    base = {"model": "soak", "max_tokens": 8 + i % 24}
    if kind == 0:
        return "/v1/completions", {**base, "prompt": prompt, "temperature": 0}, False
    if kind == 1:
        return "/v1/completions", {**base, "prompt": prompt, "temperature": 0.8, "seed": i, "stream": True}, False
    if kind == 2:
        return "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": prompt}]}, False
    if kind == 3:
        return "/v1/completions", {**base, "prompt": prompt, "n": 2, "temperature": 1.0, "seed": -i}, False
    if kind == 4:
        return "/v1/completions", {**base, "prompt": prompt, "logprobs": 3, "echo": True, "temperature": 0}, False
    if kind == 5:
        return "/v1/chat/completions", {**base, "max_tokens": 40, "messages": [{"role": "user", "content":
                                        "Give a person as JSON."}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}, False
    if kind == 6:
        return "/v1/completions", {**base, "prompt": prompt, "stop": [".", "\n"], "temperature": 0}, False
    if kind == 7:
        return "/tokenize", {"model": "soak", "prompt": prompt * (1 + i % 50)}, False
    if kind == 8:
        return "/v1/completions", {**base, "prompt": prompt, "max_tokens": -1}, False  # a 400
    if kind == 9:
        return "/v1/completions", {**base, "prompt": prompt, "max_tokens": 64, "stream": True}, True
    if kind == 10:
        return "/v1/embeddings", {"model": "soak", "input": [prompt, prompt * (1 + i % 8), "a"]}, False
    if kind == 11:
        return "/v1/completions", {**base, "prompt": prompt * (1 + i % 6), "max_tokens": 0, "echo": True,
                                   "logprobs": 1}, False
    return "/v1/chat/completions", {**base, "max_tokens": 48, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}, "messages": [
            {"role": "user", "content": f"What is the weather in {prompt.split()[0]}?"}]}, False


def _send(port: int, i: int) -> tuple[int, float]:
    """-> (the HTTP status, the largest gap in seconds between two events of a stream it read whole, else 0)."""
    path, body, drop = _mix(i)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    gap = 0.0
    if drop:
        response.fp.readline()  # the first event, then the client goes away
    elif body.get("stream") and response.status == 200:
        response.fp.readline()  # the first event: the gaps are counted from there (not the time to first token)
        last = time.perf_counter()
        while line := response.fp.readline():
            if line.startswith(b"data: "):
                gap, last = max(gap, time.perf_counter() - last), time.perf_counter()
    else:
        response.read()
    conn.close()
    return response.status, gap


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="smollm2")
    p.add_argument("--backend", default="ort", choices=("ort", "torch"))
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--every", type=int, default=250, help="requests between RSS samples")
    args = p.parse_args(argv)
    server, port = start_server(args.model, args.backend, name="soak", slots=8, max_seq_len=512)
    if server is None:
        return 1
    statuses: dict[int, int] = {}
    samples, counter, worst_gap = [(0, rss_mb(server.pid))], itertools.count(), 0.0
    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(args.clients) as pool:
            for chunk in range(0, args.requests, args.every):
                for status, gap in pool.map(lambda _: _send(port, next(counter)), range(min(args.every,
                                                                                          args.requests - chunk))):
                    statuses[status] = statuses.get(status, 0) + 1
                    worst_gap = max(worst_gap, gap)
                samples.append((chunk + args.every, rss_mb(server.pid)))
                print(f"{samples[-1][0]:>6} requests  RSS {samples[-1][1]:7.0f} MB  "
                      f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        server.wait(60)
    half = len(samples) // 2
    first, second = samples[half][1] - samples[1][1], samples[-1][1] - samples[half][1]
    print(f"llgraph serve {args.model} --backend {args.backend}: {sum(statuses.values())} mixed requests from "
          f"{args.clients} clients (HTTP statuses {dict(sorted(statuses.items()))}) in "
          f"{time.perf_counter() - start:.0f} s")
    print("requests  " + "  ".join(f"{n:>6}" for n, _ in samples))
    print("RSS MB    " + "  ".join(f"{m:>6.0f}" for _, m in samples))
    print(f"growth after the first {samples[1][0]} requests: {first:+.0f} MB over the next "
          f"{samples[half][0] - samples[1][0]}, {second:+.0f} MB over the last {samples[-1][0] - samples[half][0]}")
    print(f"the largest gap between two events of a stream: {worst_gap:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
