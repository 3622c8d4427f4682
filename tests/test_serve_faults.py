"""Issue 22, "a server one client cannot hurt": a bad or hostile request is answered alone, quickly and truthfully,
and its neighbours keep their solo greedy answers. Real server processes, driven with httpx."""

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai", reason="the serve tests need the openai client (pip install 'llgraph[serve]')")
pytest.importorskip("fastapi", reason="llgraph serve needs its extra (pip install 'llgraph[serve]')")

from serving import Server  # noqa: E402

NEIGHBOURS = ["The capital of France is", "Once upon a time there was a little"]


@pytest.fixture(scope="module")
def export_folder(smollm2_export):
    return smollm2_export("ort", max_seq_len=256)


@pytest.fixture(scope="module")
def server(export_folder):
    s = Server(str(export_folder), "--name", "m", "--slots", "4", "--max-queue", "8", "--max-seq-len", "256")
    yield s
    assert s.stop() == 0, "".join(s.lines)


@pytest.fixture(scope="module")
def solo(export_folder):
    from llgraph.runtime import ORTRunner

    runner = ORTRunner(export_folder, max_seq_len=256)
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
              {"temperature": 1, "top_p": 1e-300}]


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
        for params, a in zip(DEGENERATE, answers):
            r = a.result(60)
            print(params, r.status_code, repr(r.json()["choices"][0]["message"]["content"]))
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
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
