"""Issue 22, "a server one client cannot hurt": a bad or hostile request is answered alone, quickly and truthfully,
and its neighbours keep their solo greedy answers. Real server processes, driven with httpx."""

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import need

httpx = need("httpx")
need("openai")
need("fastapi")

from serving import Server  # noqa: E402

NEIGHBOURS = ["The capital of France is", "Once upon a time there was a little"]


@pytest.fixture(scope="module")
def server(serve_export):
    s = Server(str(serve_export), "--name", "m", "--slots", "4", "--max-queue", "8", "--max-seq-len", "256")
    yield s
    assert s.stop() == 0, "".join(s.lines)


@pytest.fixture(scope="module")
def solo(serve_export):
    from llgraph.runtime import ORTRunner

    runner = ORTRunner(serve_export, max_seq_len=256)
    return {p: runner.generate(p, 40).text for p in NEIGHBOURS}


def _stream(url, prompt, max_tokens, gaps=None):
    """A greedy streaming completion's text; `gaps` collects the seconds between chunks."""
    text, last = [], time.monotonic()
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if gaps is not None:
                gaps.append(time.monotonic() - last)
                last = time.monotonic()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
    return "".join(text)


DEGENERATE = [{"temperature": 1e-40}, {"temperature": 1e-39}, {"temperature": 5e-324},
              {"temperature": 1, "top_p": 1e-300},
              # issue 38: a negative seed raised in numpy inside the step, failing every neighbour
              {"temperature": 1, "seed": -5, "ignore_eos": True},
              {"temperature": 1, "seed": (1 << 63) - 1, "n": 2, "ignore_eos": True},
              {"temperature": 1, "seed": -(1 << 63), "ignore_eos": True}]


def test_a_degenerate_sampling_value_harms_no_neighbour(server, solo):
    """Defect 1: temperature 1e-40 (or top_p 1e-300) made softmax NaN; the failure ended every request decoding
    beside it (streams got an error event, a whole request a 500). Now those values mean greedy, and the
    neighbours keep their solo answers."""
    def bad(params):
        time.sleep(0.3)  # the neighbours are decoding by then
        return httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **params})

    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(_stream, server.url, p, 40) for p in NEIGHBOURS]
        whole = pool.submit(server.client.completions.create, model="m", prompt=NEIGHBOURS[0], max_tokens=40,
                            temperature=0)
        answers = [pool.submit(bad, params) for params in DEGENERATE]
        texts = []
        for params, a in zip(DEGENERATE, answers):
            r = a.result(60)
            print(params, r.status_code, repr(r.json()["choices"][0]["message"]["content"]))
            assert r.status_code == 200 and all(c["message"]["content"] for c in r.json()["choices"]), r.text
            texts.append([c["message"]["content"] for c in r.json()["choices"]])
        assert texts[-2][1] == texts[-1][0]  # choice 1 of seed 2**63 - 1 is seeded 2**63, i.e. -2**63 (mod 2**64)
        assert [s.result(60) for s in streams] == [solo[p] for p in NEIGHBOURS]
        assert whole.result(60).choices[0].text == solo[NEIGHBOURS[0]]


def _post_huge(url, body: bytes, chunked: bool):
    content = (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)) if chunked else body
    start = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/completions", content=content, timeout=60,
                       headers={"content-type": "application/json"})
        return r.status_code, r.json(), time.monotonic() - start
    except httpx.TransportError as e:  # the server may close before the client has sent everything
        return type(e).__name__, None, time.monotonic() - start


@pytest.mark.skipif(sys.platform != "linux", reason="reads the server's RSS from /proc")
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_20_mb_body_is_a_fast_413_and_nobody_waits(server, solo, chunked):
    """Defect 2: a 20 MB prompt was tokenized on the event loop for 14-19 s (/health and every stream waited) and
    RSS rose by ~3 GB. Now a body past --max-request-bytes (8 MiB) is a 413 before it is read."""
    before = server.rss_mb()
    body = json.dumps({"model": "m", "prompt": "x" * 20_000_000, "max_tokens": 8}).encode()
    gaps, health = [], []
    with ThreadPoolExecutor(2) as pool:
        stream = pool.submit(_stream, server.url, NEIGHBOURS[1], 40, gaps)
        time.sleep(0.3)
        huge = pool.submit(_post_huge, server.url, body, chunked)
        while not huge.done():
            t = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            health.append(time.monotonic() - t)
        status, answer, seconds = huge.result()
        text = stream.result(60)
    after = server.rss_mb()
    print(f"20 MB body: {status} in {seconds:.2f} s; /health at most {max(health):.3f} s; the stream's longest "
          f"pause {max(gaps[1:]):.3f} s; RSS {before:.0f} -> {after:.0f} MB")
    if answer is not None:
        assert status == 413 and answer["error"]["code"] == "request_too_large", answer
    assert seconds <= 1.0 and max(health) <= 1.0 and max(gaps[1:]) <= 1.0
    assert text == solo[NEIGHBOURS[1]]
    assert after - before <= 100


def test_a_7_mb_tokenize_stalls_nobody(server, serve_export):
    """Issue 38, item 13: a 7 MB /tokenize body held /health for 0.8-1.8 s (the ids' JSON answer was built on the
    event loop). /health is polled while it runs; the answer is checked against the tokenizer itself. Twice: a stall
    the server makes shows in both, where a 2-core host's own noise (once 0.72 s in six suite runs) seldom does."""
    from llgraph.runtime import ORTRunner

    text = "the quick brown fox jumps over the lazy dog. " * 155_000  # 7 MB
    stalls = []
    for _ in range(2):
        health = []
        with ThreadPoolExecutor(1) as pool:
            start = time.monotonic()
            big = pool.submit(httpx.post, f"{server.url}/tokenize", json={"model": "m", "prompt": text}, timeout=120)
            while not big.done():
                t = time.monotonic()
                assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
                health.append(time.monotonic() - t)
            r = big.result()
            seconds = time.monotonic() - start
        assert r.status_code == 200, r.text
        count = r.json()["count"]
        print(f"7 MB /tokenize: {count:,} tokens in {seconds:.2f} s; /health polled {len(health)} times, at most "
              f"{max(health):.3f} s")
        stalls.append(max(health))
    assert count == len(ORTRunner(serve_export).tokenizer.encode(text)) == len(r.json()["tokens"])
    assert min(stalls) <= 0.5, stalls


@pytest.mark.parametrize("route, body", [
    ("/v1/embeddings", {"model": "m", "input": [5] * 1_900_000}),
    ("/detokenize", {"model": "m", "tokens": [100, 101, 102, 103] * 400_000}),  # 1.6M ids: 8.0 MB of body
])
def test_millions_of_token_ids_stall_nobody(server, route, body):
    """Issue 64: /v1/embeddings given 1.9M token ids (checked id by id in the handler) and a 2.5M-token /detokenize
    held the event loop 0.3-0.7 s; now their checks, decoding and answer run off the loop, and the decode lets go of
    the GIL (Tokenizer.decode). /health is held to the sibling tests' 0.5 s (a shared host's noise; measured 0.040-
    0.049 s on a 2-core host, the issue's 0.1 s; 0.14-0.21 s before, of which the client's own json.dumps of the
    body, in this process, was most)."""
    health = []
    data = json.dumps(body).encode()  # encoded here, not in the sending thread: json.dumps of 1.9M ids holds this
    with ThreadPoolExecutor(1) as pool:  # process's GIL ~0.15 s, which the polls below would count as the server's
        start = time.monotonic()
        big = pool.submit(httpx.post, f"{server.url}{route}", content=data, timeout=120,
                          headers={"content-type": "application/json"})
        while not big.done():
            t = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            health.append(time.monotonic() - t)
        r = big.result()
    print(f"{route}: {r.status_code} in {time.monotonic() - start:.2f} s; /health polled {len(health)} times, at "
          f"most {max(health):.3f} s")
    assert r.status_code == (400 if route == "/v1/embeddings" else 200), r.text[:200]  # 1.9M ids: past the context
    if route == "/detokenize":
        assert len(r.json()["content"]) >= 1_600_000
    assert max(health) <= 0.5


def test_a_long_text_under_the_limit_is_refused_without_tokenizing_it(server):
    """A 6 MB prompt passes the size limit but cannot fit 256 tokens whatever it tokenizes to: a 400 at once."""
    start = time.monotonic()
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": "m", "prompt": "word " * 1_200_000, "max_tokens": 8})
    seconds = time.monotonic() - start
    print(f"6 MB prompt: {r.status_code} in {seconds:.2f} s: {r.json()['error']['message']}")
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert seconds <= 1.0


def test_the_server_still_answers_after_the_faults(server, solo):
    assert server.client.completions.create(model="m", prompt=NEIGHBOURS[0], max_tokens=40,
                                            temperature=0).choices[0].text == solo[NEIGHBOURS[0]]


def _health(url) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def test_abandoned_queued_requests_leave_the_queue(smollm2_export):
    """Defect 3: with the slot busy, clients that submitted and left (a stream closed before its first chunk, a
    whole request timed out) kept their queue places, and the next client got a 429. On the float32 export (the
    slowest decoding here: the busy request's 250 tokens outlast the clients' comings and goings)."""
    s = Server(str(smollm2_export("ort", max_seq_len=512)), "--name", "m", "--slots", "1", "--max-queue", "2",
               "--max-seq-len", "256")
    try:
        stop = {"model": "m", "prompt": "Once upon a time", "max_tokens": 250, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=60) as busy, busy.stream("POST", f"{s.url}/v1/completions", json=stop) as r:
            lines = r.iter_lines()  # kept: a dropped line iterator closes the stream, and the client leaves
            next(lines)  # the slot is taken
            for stream in (True, False):
                try:
                    with httpx.Client(timeout=0.5) as c, c.stream("POST", f"{s.url}/v1/completions", json={
                            "model": "m", "prompt": "Hi", "max_tokens": 4, "stream": stream}) as q:
                        next(q.iter_lines())
                except httpx.TimeoutException:
                    pass  # the client gives up and leaves
            deadline = time.monotonic() + 1.5  # the server looks for departed clients every 0.5 s
            while _health(s.url)["queue"] and time.monotonic() < deadline:
                time.sleep(0.1)
            health = _health(s.url)
            print("1.5 s after two queued clients left:", health)
            assert health["active"] == 1, "the busy request ended too soon to tell"
            assert health["queue"] == 0
            with ThreadPoolExecutor(2) as pool:  # both places are free again: neither is a 429
                waiting = [pool.submit(httpx.post, f"{s.url}/v1/completions", timeout=60, json={
                    "model": "m", "prompt": "Hi", "max_tokens": 4, "temperature": 0}) for _ in range(2)]
                time.sleep(0.5)
                r.close()  # the busy client leaves too: the two queued ones run
                assert [w.result(60).status_code for w in waiting] == [200, 200]
    finally:
        assert s.stop() == 0, "".join(s.lines)


def _events_of(url, body):
    """(status, [parsed data events]) of a streaming request."""
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        return 200, [json.loads(line[6:]) for line in r.iter_lines()
                     if line.startswith("data: ") and line != "data: [DONE]"]


def test_shutdown_says_only_true_things(smollm2_export):
    """Defect 4: on SIGTERM, streams cut at the grace deadline ended with finish_reason 'stop', queued ones got
    200 with no content, and new requests were refused connections instead of the promised 503. On the float32
    export on ONNX Runtime's own ops: the slowest decoding here, so 248 tokens outlast the 2 s grace."""
    s = Server(str(smollm2_export("ort", max_seq_len=512)), "--name", "m", "--slots", "2", "--max-queue", "4",
               "--max-seq-len", "256", "--grace", "2")
    long = {"model": "m", "prompt": "Once upon a time", "max_tokens": 248, "temperature": 0, "stream": True,
            "ignore_eos": True}
    try:
        with ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(_events_of, s.url, long) for _ in range(3)]  # 2 running, 1 queued
            deadline = time.monotonic() + 30
            while _health(s.url).get("active", 0) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)
            s.proc.send_signal(15)
            time.sleep(0.5)
            late = httpx.post(f"{s.url}/v1/completions", json={"model": "m", "prompt": "Hi"}, timeout=10)
            print("a request during the drain:", late.status_code, late.json())
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            results = sorted((st.result(60) for st in streams), key=lambda x: x[0])
        (s1, cut1), (s2, cut2), (s3, queued) = results
        for events in (cut1, cut2):
            reasons = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
            print(f"a cut stream: {len(events) - 1} chunks, then {events[-1]}")
            assert 0 < len(events) - 1 < 248 and not any(reasons)
            assert events[-1]["error"]["code"] == "shutting_down"
        print("the queued stream:", s3, queued)
        assert (s1, s2, s3) == (200, 200, 503) and queued[0]["error"]["code"] == "shutting_down"
        assert s.proc.wait(30) == 0, "".join(s.lines)
    finally:
        s.stop()


HOSTILE = {
    "text part not a string": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    "text part null": {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
    "an image part": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "stream_options a string": {"prompt": "hi", "stream": True, "stream_options": "x"},
    "stream_options a list": {"prompt": "hi", "stream": True, "stream_options": [1]},
    "include_usage a string": {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
    "lone surrogate in the prompt": {"prompt": "x\ud800y"},
    "lone surrogate in content": {"messages": [{"role": "user", "content": "x\ud800y"}]},
    "lone surrogate in the role": {"messages": [{"role": "us\udc00er", "content": "hi"}]},
    "lone surrogate as the model": {"model": "\ud800", "prompt": "hi"},
    "unknown role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "stream a string": {"prompt": "hi", "stream": "yes"},
    "ignore_eos a number": {"prompt": "hi", "ignore_eos": 1},
    "model a list": {"model": [1, 2], "prompt": "hi"},
    "messages a dict": {"messages": {"role": "user", "content": "hi"}},
    "message not an object": {"messages": ["hi"]},
    "max_tokens a string": {"prompt": "hi", "max_tokens": "5"},
    "NaN temperature": {"prompt": "hi", "temperature": float("nan")},
    "prompt of floats": {"prompt": [1.5, 2.0]},
}
RAW = {"100,000 nested lists": b"[" * 100_000, "100,000 nested objects": b'{"a":' * 100_000,
       "a JSON array": b"[1, 2]", "invalid UTF-8": b'{"model": "m", "prompt": "\xff\xfe"}'}


@pytest.mark.parametrize("name", [*HOSTILE, *RAW, "GET /v1/nope", "GET /v1/completions"])
def test_hostile_input_is_a_4xx_error_object_and_the_server_serves_on(server, name):
    """Defects 5-6: each was a plain-text 500 (with a traceback in the log), or accepted without complaint, or a
    404/405 as {"detail": ...}; each is now a 4xx in OpenAI's error shape."""
    if name.startswith("GET "):
        r = httpx.get(server.url + name[4:], timeout=10)
    else:
        body = RAW.get(name) or json.dumps({"model": "m", **HOSTILE[name]}).encode()
        path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
    print(f"{name}: {r.status_code} {r.text[:160]}")
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and error["type"] == "invalid_request_error"
    ok = server.client.completions.create(model="m", prompt="Hello", max_tokens=2, temperature=0)
    assert ok.choices[0].text
