"""Access control (issue 41 item 5): with a key (--api-key or $LLGRAPH_API_KEY) every /v1/* route wants it — the
`openai` client with the wrong key gets its AuthenticationError, with the right one an answer; /health stays open; a
body that is not application/json is a 415 whatever the key (a web page's CORS-simple text/plain POST); a server
listening beyond loopback without a key warns at startup."""

import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client (pip install 'llgraph[serve]')")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="llgraph serve needs its extra (pip install 'llgraph[serve]')")

from serving import Server  # noqa: E402

from llgraph.runtime.serve.access import warning  # noqa: E402

KEY = "sk-llgraph-test-0123456789"


def test_a_key_guards_every_v1_route_and_json_is_required(serve_export, monkeypatch):
    monkeypatch.setenv("LLGRAPH_API_KEY", KEY)
    s = Server(str(serve_export), "--name", "m", "--slots", "2", "--max-seq-len", "128", "--host", "0.0.0.0")
    try:
        assert not any("without an API key" in line for line in s.lines), s.lines
        wrong = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.completions.create(model="m", prompt="Hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        for path in ("/v1/models", "/v1/chat/completions"):
            r = httpx.request("GET" if path.endswith("models") else "POST", s.url + path, json={})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        right = openai.OpenAI(base_url=f"{s.url}/v1", api_key=KEY, max_retries=0)
        text = right.completions.create(model="m", prompt="The capital of France is", max_tokens=4, temperature=0)
        assert text.choices[0].text and right.models.list().data[0].id == "m"
        assert httpx.get(f"{s.url}/health").status_code == 200  # probes need no key
        r = httpx.post(f"{s.url}/v1/completions", content='{"prompt": "Hi", "max_tokens": 2}',
                       headers={"content-type": "text/plain", "authorization": f"Bearer {KEY}"})
        print(r.status_code, r.text)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    finally:
        assert s.stop() == 0, "".join(s.lines)


def test_no_key_beyond_loopback_warns_and_a_text_plain_post_is_refused(serve_export):
    s = Server(str(serve_export), "--name", "m", "--slots", "2", "--max-seq-len", "128", "--host", "0.0.0.0")
    try:
        said = [line for line in s.lines if "without an API key" in line]
        assert len(said) == 1 and "--api-key" in said[0], s.lines
        r = httpx.post(f"{s.url}/v1/completions", content='{"prompt": "Hi", "max_tokens": 2}',
                       headers={"content-type": "text/plain"})
        assert r.status_code == 415, r.text
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        assert s.stop() == 0, "".join(s.lines)


def test_the_warning_is_for_addresses_beyond_this_machine():
    assert warning("127.0.0.1", None) is None and warning("::1", None) is None and warning("localhost", None) is None
    assert warning("0.0.0.0", KEY) is None
    assert "LLGRAPH_API_KEY" in warning("0.0.0.0", None) and warning("192.168.1.5", None)
