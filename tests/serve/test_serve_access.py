"""Access control (runtime/serve/access.py): with a key (--api-key, --api-key-file or $LLGRAPH_API_KEY) every route
but /health wants it — the `openai` client with the wrong key gets its AuthenticationError, with the right one an
answer; tokenize, the chat template, the docs and /metrics included (issue 52: they answered without it); a server
bound to loopback answers no Host but loopback's (DNS rebinding); CORS only for the origins given; a key no header can
carry is refused at startup; a body that is not application/json is a 415 whatever the key (a web page's CORS-simple
text/plain POST); a server listening beyond loopback without a key warns at startup."""

import asyncio
import subprocess
import sys

import pytest
from conftest import need

openai = need("openai")
httpx = need("httpx")
need("fastapi")

from serving import Server  # noqa: E402

from llgraph.runtime.serve.access import Guard, host_name, warning  # noqa: E402

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
        # a page elsewhere: its CORS-simple text/plain POST (no preflight) is refused, key or not
        r = httpx.post(f"{s.url}/v1/completions", content='{"prompt": "Hi", "max_tokens": 2}',
                       headers={"content-type": "text/plain", "authorization": f"Bearer {KEY}",
                                "origin": "http://evil.example"})
        print(r.status_code, r.text)
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin_refused"
    finally:
        assert s.stop() == 0, "".join(s.lines)


def test_no_key_beyond_loopback_warns_and_a_page_elsewhere_is_refused(serve_export):
    s = Server(str(serve_export), "--name", "m", "--slots", "2", "--max-seq-len", "128", "--host", "0.0.0.0")
    try:
        said = [line for line in s.lines if "without an API key" in line]
        assert len(said) == 1 and "--api-key" in said[0], s.lines
        body = '{"prompt": "Hi", "max_tokens": 2}'
        r = httpx.post(f"{s.url}/v1/completions", content=body, headers={"content-type": "text/plain",
                                                                          "origin": "https://evil.example"})
        assert r.status_code == 403, r.text  # a page elsewhere
        r = httpx.post(f"{s.url}/v1/completions", content=body, headers={"content-type": "text/plain",
                                                                          "origin": s.url})
        assert r.status_code == 415, r.text  # a page of the server's own origin sends JSON as JSON
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        # curl -d: no Origin (no browser), form-typed by curl: read as the JSON it is, as llama-server does
        r = httpx.post(f"{s.url}/v1/completions", content=body,
                       headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text
    finally:
        assert s.stop() == 0, "".join(s.lines)


def test_the_warning_is_for_addresses_beyond_this_machine():
    assert warning("127.0.0.1", None) is None and warning("::1", None) is None and warning("localhost", None) is None
    assert warning("0.0.0.0", KEY) is None
    assert "LLGRAPH_API_KEY" in warning("0.0.0.0", None) and warning("192.168.1.5", None)
    assert "tokenize, read the chat template and the metrics" in warning("::", None)
    from llgraph.runtime.serve.run import _url

    assert _url("::", 8000) == "http://[::]:8000" and _url("127.0.0.1", 80) == "http://127.0.0.1:80"  # was http://:::


ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("POST", "/v1/embeddings"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
          ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"), ("GET", "/metrics"), ("GET", "/no-such")]


def test_the_key_covers_every_route_but_health_and_loopback_answers_only_its_names(serve_export, tmp_path):
    keyfile = tmp_path / "key"
    keyfile.write_text(KEY + "\n")
    s = Server(str(serve_export), "--name", "m", "--slots", "2", "--max-seq-len", "128", "--api-key-file",
               str(keyfile), "--cors-origins", "https://app.example")
    try:
        assert KEY not in open(f"/proc/{s.proc.pid}/cmdline").read()  # not shown by ps
        for method, path in ROUTES:
            r = httpx.request(method, s.url + path, json={"prompt": "Hi", "tokens": [1]})
            print(method, path, r.status_code)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        assert httpx.get(f"{s.url}/health").status_code == 200 and httpx.get(f"{s.url}/").status_code == 200
        for header in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
            r = httpx.post(f"{s.url}/tokenize", json={"prompt": "Hi there"}, headers=header)
            assert r.status_code == 200 and r.json()["count"] >= 2, r.text
            assert httpx.get(f"{s.url}/metrics", headers=header).status_code == 200
        # a rebound name (attacker.example resolving to 127.0.0.1): same-origin for the page, refused here
        rebound = {"host": f"attacker.example:{s.port}", "origin": f"http://attacker.example:{s.port}",
                   "authorization": f"Bearer {KEY}"}
        for method, path in [*ROUTES, ("GET", "/health")]:
            r = httpx.request(method, s.url + path, json={"prompt": "Hi", "max_tokens": 2}, headers=rebound)
            assert r.status_code == 421 and r.json()["error"]["code"] == "misdirected_request", (path, r.text)
        for host in (f"localhost:{s.port}", f"127.0.0.1:{s.port}", "localhost"):
            r = httpx.get(f"{s.url}/v1/models", headers={"host": host, "authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, (host, r.text)
        # CORS: the origin given is answered (preflight without a key, as browsers send it), no other
        pre = {"origin": "https://app.example", "access-control-request-method": "POST",
               "access-control-request-headers": "authorization,content-type"}
        r = httpx.options(f"{s.url}/v1/chat/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example", r.text
        r = httpx.options(f"{s.url}/v1/chat/completions", headers={**pre, "origin": "https://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = httpx.get(f"{s.url}/v1/models", headers={"origin": "https://evil.example",
                                                       "authorization": f"Bearer {KEY}"})
        assert "access-control-allow-origin" not in r.headers
    finally:
        assert s.stop() == 0, "".join(s.lines)


def _asgi(guard: Guard, path: str, headers: dict) -> int:
    """The status the Guard answers for one GET (200: passed to the app behind it)."""
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path,
             "headers": [(k.encode(), v.encode("latin-1")) for k, v in headers.items()]}
    guard.app = app
    asyncio.run(guard(scope, None, send))
    return sent[0]["status"]


@pytest.mark.parametrize("bound, allowed, host, status", [
    ("127.0.0.1", (), "127.0.0.1:8000", 200), ("127.0.0.1", (), "[::1]:8000", 200), ("::1", (), "LOCALHOST", 200),
    ("127.0.0.1", (), "attacker.example:8000", 421), ("127.0.0.1", (), "localhost.attacker.example", 421),
    ("127.0.0.1", (), "127.0.0.1.nip.io:8000", 421), ("127.0.0.1", (), "", 421),
    ("127.0.0.1", ("my.lan",), "my.lan:8000", 200), ("127.0.0.1", ("*",), "anything:1", 200),
    ("0.0.0.0", (), "192.168.1.5:8000", 200), ("0.0.0.0", ("my.lan",), "other.lan", 421),
    # what a hostile probe sent: no host[:port] at all, so no allowed name
    ("127.0.0.1", (), "localhost:evil", 421), ("127.0.0.1", (), "[::1]evil:8000", 421),
    ("127.0.0.1", (), "127.0.0.1:8000 evil", 421), ("127.0.0.1", (), "127.0.0.1:", 421),
])
def test_host_names_answered(bound, allowed, host, status):
    assert _asgi(Guard(None, key=None, bound=bound, allowed_hosts=allowed), "/v1/models", {"host": host}) == status


def test_keys_by_either_header_and_open_metrics():
    g = Guard(None, key=KEY, bound="127.0.0.1")
    ok = {"host": "localhost"}
    assert _asgi(g, "/health", ok) == 200 and _asgi(g, "/metrics", ok) == 401 and _asgi(g, "/tokenize", ok) == 401
    assert _asgi(g, "/tokenize", {**ok, "authorization": f"Bearer {KEY}"}) == 200
    assert _asgi(g, "/tokenize", {**ok, "authorization": f"bearer  {KEY} "}) == 200
    assert _asgi(g, "/tokenize", {**ok, "x-api-key": KEY}) == 200
    assert _asgi(g, "/tokenize", {**ok, "authorization": f"Basic {KEY}"}) == 401
    assert _asgi(g, "/tokenize", {**ok, "x-api-key": KEY[:-1]}) == 401
    assert _asgi(g, "/tokenize", {**ok, "authorization": f"Bearer {KEY}\xa0"}) == 401  # NBSP: not HTTP's whitespace
    assert _asgi(g, "/tokenize", {**ok, "x-api-key": f"\xa0{KEY}"}) == 401
    page = {"host": "127.0.0.1:8000", "origin": "http://127.0.0.1:8000"}
    assert _asgi(Guard(None, key=None, bound="127.0.0.1"), "/v1/models", page) == 200  # the chat page itself
    for scheme in ("evil", "file", "chrome-extension"):
        assert _asgi(Guard(None, key=None, bound="127.0.0.1"), "/v1/models",
                     {**page, "origin": f"{scheme}://127.0.0.1:8000"}) == 403, scheme
    assert _asgi(Guard(None, key=KEY, bound="127.0.0.1", open_metrics=True), "/metrics", ok) == 200
    assert host_name("[::1]:80") == "[::1]" and host_name("a.b:1") == "a.b" and host_name("::1") == "::1"


@pytest.mark.parametrize("args, words", [
    (["--api-key", " abc"], ["surrounding whitespace", "--api-key"]),
    (["--api-key", "ключ-123"], ["outside printable ASCII"]),
    (["--api-key", "abc", "--api-key-file", "/nonexistent"], ["not both"]),
    (["--api-key-file", "/nonexistent/key"], ["--api-key-file /nonexistent/key", "readable"]),
    (["--port", "70000"], ["--port (70000) must be at most 65535"]),
    (["--grace", "-5"], ["--grace (-5.0) must be at least 0"]),
])
def test_flags_that_could_never_work_are_one_line_at_startup(args, words):
    r = subprocess.run([sys.executable, "-m", "llgraph", "serve", "smollm2", *args], capture_output=True, text=True,
                       timeout=120)
    errors = [line for line in r.stderr.splitlines() if line.startswith("llgraph: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(w in errors[0] for w in words), errors[0]
    assert "loading" not in r.stdout  # refused before the model loads
