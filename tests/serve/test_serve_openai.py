"""OpenAI's conventions as clients rely on them (issue 53, items 1-4 and 8): every route also without `/v1` (clients
given a base URL without it); `GET /v1/models/{id}` (`models.retrieve`); `model` absent or null is the served model,
an unknown one OpenAI's 404 `model_not_found`, and `--name` takes aliases; `usage.prompt_tokens_details.cached_tokens`
counts the reused prefix; errors name the field at fault (`messages`, `prompt`, `input`) and the model's context;
`logit_bias`, `frequency_penalty` and `presence_penalty` are honoured (they were 400s)."""

import pytest

openai = pytest.importorskip("openai", reason="the serve tests need the openai client (pip install 'llgraph[serve]')")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="llgraph serve needs its extra (pip install 'llgraph[serve]')")

from serving import Server  # noqa: E402


@pytest.fixture(scope="module")
def server(serve_export):
    s = Server(str(serve_export), "--name", "smol,gpt-4o-mini", "--slots", "2", "--max-seq-len", "128")
    yield s
    assert s.stop() == 0, "".join(s.lines)


def test_routes_without_v1_and_models_retrieve(server):
    bare = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)  # no /v1
    assert [m.id for m in bare.models.list().data] == ["smol", "gpt-4o-mini"]
    chat = bare.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.choices[0].message.content is not None and chat.model == "smol"
    assert bare.completions.create(model="smol", prompt="The", max_tokens=2).choices[0].text is not None
    assert len(bare.embeddings.create(model="smol", input="Hi").data[0].embedding) > 0
    assert server.client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    with pytest.raises(openai.NotFoundError) as e:
        server.client.models.retrieve("gpt-3.5-turbo")
    assert e.value.code == "model_not_found"


def test_model_null_absent_alias_and_unknown(server):
    for model in (None, "gpt-4o-mini"):
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "smol", r.text
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})  # no model at all
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as e:  # before: a 400
        server.client.chat.completions.create(model="gpt-3.5-turbo", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.code == "model_not_found" and e.value.body["param"] == "model"


def test_cached_tokens_count_the_reused_prefix(server):
    messages = [{"role": "system", "content": "You are a terse assistant who answers in one word. " * 3},
                {"role": "user", "content": "Name a colour."}]
    first = server.client.chat.completions.create(model="smol", messages=messages, max_tokens=2, temperature=0)
    again = server.client.chat.completions.create(model="smol", messages=messages, max_tokens=2, temperature=0)
    print("cached tokens:", first.usage.prompt_tokens_details.cached_tokens,
          again.usage.prompt_tokens_details.cached_tokens, "of", again.usage.prompt_tokens)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens


def test_errors_name_the_field_at_fault_and_the_context(server):
    long = "word " * 400  # beyond the 128-token context
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and err["code"] == "context_length_exceeded", err
    assert "context is 128 tokens" in err["message"], err  # max_tokens was not sent: it is not named
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": long})
    assert r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": [1, 2, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input" and "'prompt'" not in r.text, r.text
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": list(range(1, 200))})
    err = r.json()["error"]
    assert err["param"] == "input" and "context of 128 tokens" in err["message"], err  # said 129 before


def test_logit_bias_and_penalties_are_honoured(server):
    ask = {"model": "smol", "prompt": "One two three one two three one two", "max_tokens": 6, "temperature": 0}
    plain = server.client.completions.create(**ask).choices[0].text
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": plain, "add_special_tokens": False}).json()["tokens"]
    banned = server.client.completions.create(**ask, logit_bias={str(t): -100 for t in ids}).choices[0].text
    ids_banned = httpx.post(f"{server.url}/tokenize", json={"prompt": banned, "add_special_tokens": False}).json()
    print(repr(plain), ids, "->", repr(banned))
    assert banned != plain and not set(ids) & set(ids_banned["tokens"][:1])
    penalized = server.client.completions.create(**ask, frequency_penalty=2, presence_penalty=2).choices[0].text
    assert penalized != plain, (plain, penalized)
