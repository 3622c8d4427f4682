"""Issue 48 on a real server: a client that leaves an embeddings request frees its slots at once; a body of tens of
thousands of tools or messages is refused in one line without stalling /health; a client that leaves a non-streamed
completion leaves no traceback in the log."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import need

httpx = need("httpx")
need("fastapi")

from serving import Server  # noqa: E402


@pytest.fixture(scope="module")
def server(serve_export):
    s = Server(str(serve_export), "--name", "m", "--slots", "4", "--max-queue", "8", "--max-seq-len", "512",
               "--prefill-chunk", "32")
    yield s
    assert s.stop() == 0, "".join(s.lines)


def _health(url) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def test_an_abandoned_embeddings_request_frees_its_slots_within_a_second(server):
    inputs = [[5 + (i + k) % 90 for i in range(480)] for k in range(10)]  # ~7 s of prefill on 2 cores
    try:
        httpx.post(f"{server.url}/v1/embeddings", json={"model": "m", "input": inputs}, timeout=1.0)
    except httpx.TimeoutException:
        pass  # the client gives up and leaves
    left = time.monotonic()
    busy = _health(server.url)
    while (busy["active"] or busy["queue"]) and time.monotonic() - left < 10:
        time.sleep(0.05)
        busy = _health(server.url)
    seconds = time.monotonic() - left
    print(f"10 x 480-token embedding inputs abandoned after 1 s: slots and queue free {seconds:.2f} s later")
    assert not busy["active"] and not busy["queue"] and seconds <= 1.0


def _refused_while_health_is_polled(url, body: bytes) -> tuple[dict, float, float]:
    """POSTs `body` to the chat route while /health is polled -> (the answer, its seconds, /health's slowest)."""
    health = []
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        answer = pool.submit(httpx.post, f"{url}/v1/chat/completions", content=body, timeout=60,
                             headers={"content-type": "application/json"})
        while not answer.done():
            t = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            health.append(time.monotonic() - t)
        r = answer.result()
    return r, time.monotonic() - start, max(health, default=0.0)


@pytest.mark.parametrize("what", ["36,000 tools", "150,000 messages", "60,000 tool calls"])
def test_an_absurd_chat_body_is_one_line_and_stalls_nobody(server, what):
    fn = {"type": "function", "function": {"name": "f", "description": "what the weather is",  # ~5.5 MB for 36,000
                                          "parameters": {"type": "object", "properties": {"city": {}}}}}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    hi = [{"role": "user", "content": "Hi"}]
    body = {"36,000 tools": {"messages": hi, "tools": [dict(fn, function=dict(fn["function"], name=f"f{i}"))
                                                       for i in range(36_000)]},
            "150,000 messages": {"messages": [{"role": "user", "content": "hi"}] * 150_000},
            "60,000 tool calls": {"messages": hi + [{"role": "assistant", "content": None,
                                                     "tool_calls": [call] * 60_000}]}}[what]
    data = json.dumps({"model": "m", "max_tokens": 4, **body}).encode()
    r, seconds, health = _refused_while_health_is_polled(server.url, data)
    message = r.json()["error"]["message"]
    print(f"{what} ({len(data) / 1e6:.1f} MB): {r.status_code} in {seconds:.2f} s, /health at most {health:.3f} s: "
          f"{message}")
    assert r.status_code == 400 and "\n" not in message
    assert health <= 0.1


def test_a_client_leaving_a_non_streamed_completion_leaves_no_traceback(server):
    try:
        httpx.post(f"{server.url}/v1/completions", timeout=0.5, json={
            "model": "m", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True})
    except httpx.TimeoutException:
        pass
    time.sleep(1.5)  # the server looks for departed clients every 0.5 s
    log = "".join(server.lines)
    assert "Traceback" not in log and "aclose()" not in log, log[-3000:]
    assert server.client.completions.create(model="m", prompt="Hi", max_tokens=2).choices


def test_served_loglikelihoods_equal_llgraph_lm_eval_s_whatever_the_order(smollm2_export):
    """lm-eval's `local-completions` requests (token ids, echo, logprobs 1, max_tokens 0), several at once in two
    orders, on the default server (SmolLM2's blocks on llgraph's kernels, f16 KV cache, chunked prefill): each
    continuation's summed log-probability equals Runner.score_batch's (what `llgraph lm-eval` computes: right-padded
    batches of 8 in one forward) on the same export and cache format."""
    from llgraph.runtime import ORTRunner

    folder = smollm2_export("ort", quantized=True)
    runner = ORTRunner(folder, max_seq_len=256)
    assert runner.backend.kv.name == "float16"
    pairs = [([5 + (3 * i + k) % 90 for i in range(20 + 9 * k)], [7 + (5 * k + i) % 80 for i in range(1 + k % 3)])
             for k in range(8)]
    want = [s.logprob for s in runner.score_batch(pairs)]
    s = Server(str(folder), "--name", "m", "--slots", "4", "--max-seq-len", "256", "--prefill-chunk", "32")
    try:
        def served(k):
            context, continuation = pairs[k]
            r = httpx.post(f"{s.url}/v1/completions", timeout=120, json={
                "model": "m", "prompt": context + continuation, "max_tokens": 0, "echo": True, "logprobs": 1})
            assert r.status_code == 200, r.text
            scores = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            return sum(scores[len(context):])
        worst = 0.0
        for order in (list(range(8)), [7, 2, 5, 0, 3, 6, 1, 4]):
            with ThreadPoolExecutor(4) as pool:
                got = dict(zip(order, pool.map(served, order)))
            worst = max(worst, max(abs(got[k] - want[k]) for k in range(8)))
    finally:
        assert s.stop() == 0, "".join(s.lines)
    print(f"served loglikelihoods vs Runner.score_batch (f16 KV cache), two orders: max|diff| = {worst:.3e}")
    assert worst <= 1e-5
