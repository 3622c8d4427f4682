"""The client libraries people put in front of OpenAI-compatible servers, unchanged, against `llgraph serve`:
langchain-openai (chat, `bind_tools`, `with_structured_output`, embeddings), litellm (completion, streamed), and the
openai client's `chat.completions.parse` with a pydantic model. (instructor is left out: its pin jiter<0.15 forces
openai back to 3.3.0 beside the rest of the test extra.)"""

from conftest import need

need("fastapi")
pydantic = need("pydantic")

from test_serve_openai import server  # noqa: E402,F401 (the fixture: one server for the OpenAI-convention tests)


class Weather(pydantic.BaseModel):
    city: str
    celsius: int


def test_openai_parse_with_a_pydantic_model(server):  # noqa: F811
    done = server.client.chat.completions.parse(
        model="smol", messages=[{"role": "user", "content": "The weather in Oslo: 7 degrees."}],
        response_format=Weather, max_tokens=40, temperature=0)
    parsed = done.choices[0].message.parsed
    print(parsed)
    assert isinstance(parsed, Weather)


def test_langchain_openai(server):  # noqa: F811
    lc = need("langchain_openai")
    llm = lc.ChatOpenAI(model="smol", base_url=f"{server.url}/v1", api_key="unused", max_tokens=16, temperature=0)
    assert llm.invoke("Say hello.").content
    weather = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}},
                                                               "required": ["city"]}}}
    longer = lc.ChatOpenAI(model="smol", base_url=f"{server.url}/v1", api_key="unused", max_tokens=64, temperature=0)
    called = longer.bind_tools([weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather", called
    structured = longer.with_structured_output(Weather, method="json_schema").invoke("Oslo is 7 degrees today.")
    assert isinstance(structured, Weather)
    vectors = lc.OpenAIEmbeddings(model="smol", base_url=f"{server.url}/v1", api_key="unused",
                                  check_embedding_ctx_length=False).embed_documents(["a cat", "a dog"])
    assert len(vectors) == 2 and len(vectors[0]) > 100


def test_litellm(server, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price list, not fetched from GitHub
    litellm = need("litellm")
    base = {"model": "openai/smol", "api_base": f"{server.url}/v1", "api_key": "unused", "max_tokens": 8,
            "temperature": 0, "messages": [{"role": "user", "content": "Say hello."}]}
    whole = litellm.completion(**base)
    text = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**base, stream=True))
    print(repr(whole.choices[0].message.content), repr(text))
    assert whole.choices[0].message.content and text == whole.choices[0].message.content
