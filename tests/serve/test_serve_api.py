"""`llgraph serve`'s OpenAI API in depth, driven by the official `openai` client: batched prompts, n, echo and
log-probabilities (checked against Runner.score, computed apart from the server), the tokenizer endpoints, and the
400s for fields it cannot honour."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import need

openai = need("openai")
need("fastapi")

from serving import Server  # noqa: E402

TOL = 1e-4  # float32 logits of two forward passes (a slot's prefill, a batch's scoring), float64 log-softmax


@pytest.fixture(scope="module")
def server(serve_export):
    s = Server(str(serve_export), "--name", "smollm2", "--slots", "4", "--max-queue", "12", "--max-seq-len", "256")
    yield s
    assert s.stop() == 0, "".join(s.lines)


@pytest.fixture(scope="module")
def runner(serve_export):
    from llgraph.runtime import ORTRunner

    return ORTRunner(serve_export, max_seq_len=256)


def _per_token(runner, ids):
    """log p(ids[k] | ids[:k]) for k >= 1, each scored on its own by Runner.score_batch."""
    return [s.logprob for s in runner.score_batch([(ids[:k], [ids[k]]) for k in range(1, len(ids))])]


def test_echoed_prompt_and_generated_logprobs_equal_runner_score(server, runner):
    prompt = "The capital of France is"
    r = server.client.completions.create(model="smollm2", prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                         logprobs=3)
    choice, lp = r.choices[0], r.choices[0].logprobs
    ids = runner.tokenizer.encode(prompt)
    generated = runner.generate(prompt, 6)
    whole = ids + generated.token_ids
    assert choice.text == prompt + generated.text
    assert len(lp.tokens) == len(whole) and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    reference = _per_token(runner, whole)
    worst = max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], reference))
    print(f"echoed + generated logprobs vs Runner.score: max |diff| {worst:.2e} over {len(reference)} tokens")
    assert worst <= TOL
    for text, offset, top, logprob in zip(lp.tokens, lp.text_offset, lp.top_logprobs, lp.token_logprobs):
        assert choice.text[offset:].startswith(text)
        if top is not None:
            assert 3 <= len(top) <= 4 and max(top.values()) >= logprob  # the 3 most likely, and the chosen one
    for k in range(len(ids), len(whole)):  # greedy: each generated token is the most likely one
        assert max(lp.top_logprobs[k], key=lp.top_logprobs[k].get) == lp.tokens[k]

    # max_tokens 0 with echo scores the prompt alone (lm-eval's loglikelihood form); the sum equals Runner.score
    r = server.client.completions.create(model="smollm2", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    score = runner.score(ids[:1], ids[1:]).logprob
    total = sum(r.choices[0].logprobs.token_logprobs[1:])
    print(f"scored prompt: {total:.6f} vs Runner.score {score:.6f}")
    assert r.choices[0].text == prompt and r.usage.completion_tokens == 0 and abs(total - score) <= TOL


def test_logprobs_without_echo_offset_into_prompt_plus_completion(server):
    r = server.client.completions.create(model="smollm2", prompt="Roses are red, violets are", max_tokens=5,
                                         temperature=0, logprobs=1)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and None not in lp.token_logprobs
    assert lp.text_offset[0] == len("Roses are red, violets are")


def test_batched_prompts_and_n_choices_equal_their_solo_requests(server):
    c = server.client
    prompts = ["Once upon a time", "def fibonacci(n):", "Water is made of"]
    r = c.completions.create(model="smollm2", prompt=prompts, n=2, max_tokens=8, temperature=1.0, seed=11)
    assert [ch.index for ch in r.choices] == list(range(6))
    for ch in r.choices:
        i, j = divmod(ch.index, 2)
        solo = c.completions.create(model="smollm2", prompt=prompts[i], max_tokens=8, temperature=1.0,
                                    seed=11 + j)
        assert ch.text == solo.choices[0].text, (i, j)
    assert r.choices[0].text != r.choices[1].text  # two samples of one prompt, each its own seed
    assert r.usage.completion_tokens == 6 * 8

    ids = [[504, 3575, 282, 4649, 314], [19556]]  # token-id prompts, as lm-eval sends them
    r = c.completions.create(model="smollm2", prompt=ids, max_tokens=6, temperature=0)
    for ch, p in zip(r.choices, ids):
        assert ch.text == c.completions.create(model="smollm2", prompt=p, max_tokens=6, temperature=0).choices[0].text
    assert r.usage.prompt_tokens == 6

    streamed = {}
    for chunk in c.completions.create(model="smollm2", prompt=prompts[:2], n=2, max_tokens=8, temperature=1.0,
                                      seed=11, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    whole = c.completions.create(model="smollm2", prompt=prompts[:2], n=2, max_tokens=8, temperature=1.0, seed=11)
    assert streamed == {ch.index: ch.text for ch in whole.choices}


def test_chat_logprobs_and_n(server, runner):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = server.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    assert all(bytes(e.bytes).decode() == e.token and len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].token == e.token for e in content)  # greedy
    ids = runner.tokenizer.encode(runner.render_chat(messages))
    generated = runner.generate(messages, 8).token_ids
    reference = _per_token(runner, ids + generated)[len(ids) - 1:]
    worst = max(abs(e.logprob - ref) for e, ref in zip(content, reference))
    print(f"chat logprobs vs Runner.score: max |diff| {worst:.2e}")
    assert len(content) == len(generated) and worst <= TOL
    chunks = list(server.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8,
                                                        temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]  # (its prompt came from the prefix cache)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) <= TOL

    r = server.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=6, temperature=0.9,
                                              seed=3, n=3)
    solo = [server.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=6,
                                                  temperature=0.9, seed=3 + j).choices[0].message.content
            for j in range(3)]
    assert [ch.message.content for ch in r.choices] == solo


def test_tokenize_and_detokenize_speak_vllms_shapes(server, runner):
    text = "Hello world, naïve café"
    r = httpx.post(f"{server.url}/tokenize", json={"model": "smollm2", "prompt": text}).json()
    assert r["tokens"] == runner.tokenizer.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == text
    messages = [{"role": "user", "content": "Hi"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == runner.tokenizer.encode(runner.render_chat(messages), add_special_tokens=False)
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] == runner.tokenizer.eos_token and info["chat_template"]


def test_json_schema_output_validates_for_20_seeds_through_the_openai_client(server):
    jsonschema = need("jsonschema")
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "age": {"type": "integer"}, "city": {"type": "string", "maxLength": 40}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Give me a JSON object describing a person with name, age and city."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}

    def ask(seed):
        return server.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=120,
                                                     temperature=1.0, seed=seed, response_format=response_format)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(20)))
    for a in answers:
        assert a.choices[0].finish_reason == "stop", a.choices[0].message.content
        jsonschema.validate(json.loads(a.choices[0].message.content), schema)
    print(f"20/20 valid, e.g. {answers[0].choices[0].message.content!r}")
    streamed = "".join(ch.choices[0].delta.content or "" for ch in server.client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=120, temperature=1.0, seed=3, response_format=response_format,
        stream=True) if ch.choices)
    assert streamed == answers[3].choices[0].message.content
    r = server.client.completions.create(model="smollm2", prompt="A JSON object:", max_tokens=60, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict), r.choices[0].text


def test_16_concurrent_speculating_requests_equal_plain_solo_answers(server, runner):
    """Speculative decoding in the scheduler (the request's "speculative" field): 16 greedy requests through 4 slots,
    half of them quoting their prompt, each equals plain solo decoding; /metrics reports the drafts."""
    passage = __import__("llgraph.bundled").bundled.PASSAGE.read_text()
    quotes = [f"Repeat this passage exactly:\n\n{passage[i * 300:i * 300 + 300]}" for i in range(8)]
    prompts = [[{"role": "user", "content": q}] for q in quotes] + \
              [[{"role": "user", "content": t}] for t in ("Hi", "What is 2+2?", "Name a colour.", "Tell a joke.",
                                                          "What is the moon?", "Say hello.", "Count to five.",
                                                          "Who are you?")]
    solo = [runner.generate(m, 40).text for m in prompts]

    def ask(m):
        return server.client.chat.completions.create(model="smollm2", messages=m, max_tokens=40, temperature=0,
                                                     extra_body={"speculative": "ngram"}).choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        served = list(pool.map(ask, prompts))
    assert served == solo
    metrics = httpx.get(f"{server.url}/metrics").text
    rate = float(next(line.split()[-1] for line in metrics.splitlines()
                      if line.startswith("llgraph_speculative_acceptance_rate")))
    per_step = float(next(line.split()[-1] for line in metrics.splitlines()
                          if line.startswith("llgraph_speculative_tokens_per_step")))
    print(f"16 speculating requests == solo; acceptance {rate:.2f}, {per_step:.2f} tokens per verify step")
    assert rate > 0.3 and per_step > 1.05  # half the requests are open chat, which rarely drafts


def test_a_server_with_a_draft_model_drafts_with_it_and_answers_as_alone(serve_export, runner):
    """`llgraph serve --speculative draft=MODEL`: the model (SmolLM2 int4) with a draft model beside it (here its own
    export again, so its drafts are nearly always kept): requests speculate with it by default, or ask for "ngram"
    or "off"; 6 concurrent greedy requests through 3 slots each equal plain solo decoding; /metrics reports the
    drafts."""
    prompts = [[{"role": "user", "content": t}] for t in ("Hi", "What is 2+2?", "Name a colour.", "Tell a joke.",
                                                          "What is the moon?", "Count to five.")]
    modes = [None, "ngram", None, "off", None, None]
    solo = [runner.generate(m, 24).text for m in prompts]
    s = Server(str(serve_export), "--name", "smollm2", "--slots", "3", "--max-seq-len", "256",
               "--speculative", f"draft={serve_export}")
    try:
        assert any(f"{serve_export} drafting" in line for line in s.lines), "".join(s.lines)

        def ask(m, mode):
            extra = {} if mode is None else {"speculative": mode}
            return s.client.chat.completions.create(model="smollm2", messages=m, max_tokens=24, temperature=0,
                                                    extra_body=extra).choices[0].message.content

        with ThreadPoolExecutor(6) as pool:
            served = list(pool.map(ask, prompts, modes))
        metrics = httpx.get(f"{s.url}/metrics").text
    finally:
        assert s.stop() == 0, "".join(s.lines)
    assert served == solo
    rate = float(next(line.split()[-1] for line in metrics.splitlines()
                      if line.startswith("llgraph_speculative_acceptance_rate")))
    print(f"the draft model's acceptance: {rate:.2f}")
    assert rate > 0.8


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "n": 5}, "n"),  # the server has 4 slots
    ("/v1/completions", {"prompt": ["a", "b", "c", "d", "e"], "n": 4}, "prompt"),  # 20 choices > 4 slots + 12 queued
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),  # without echo there is nothing to do
    ("/v1/completions", {"prompt": ["Hi", [1, 2]]}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"five": 10}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"²": 1}}, "logit_bias"),  # a digit to isdigit(), not int()
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"٣": 1}}, "logit_bias"),  # Arabic-Indic 3: not a token id
    ("/v1/completions", {"prompt": "Hi", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "Hi", "suffix": " end"}, "suffix"),
    ("/v1/completions", {"prompt": "Hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "Hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "Hi", "frequency_penalty": "much"}, "frequency_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]},
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ("/v1/completions", {"prompt": "Hi", "response_format": {"type": "json_object"}, "ignore_eos": True},
     "ignore_eos"),
    ("/v1/completions", {"prompt": "Hi", "speculative": "always"}, "speculative"),
    ("/v1/completions", {"prompt": "Hi", "speculative": "draft"}, "speculative"),  # this server has no draft model
    ("/v1/completions", {"prompt": "Hi", "speculative": "ngram", "speculative.n_max": 0}, "speculative.n_max"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
])
def test_unsupported_or_bad_fields_are_400s_naming_them(server, path, body, param):
    r = httpx.post(f"{server.url}{path}", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    print(r.json()["error"]["message"])
    ok = server.client.completions.create(model="smollm2", prompt="Hello", max_tokens=2, temperature=0)
    assert ok.choices[0].text


def test_unset_sampling_fields_take_the_model_s_recommended_values(server, runner):
    """SmolLM2's GGUF names no sampling: /props gives llama-server's defaults, and a seeded request that sets no
    field samples exactly as one that sets them to those values (and as Runner.generate with them); min_p is taken."""
    props = httpx.get(f"{server.url}/props").json()
    params = props["default_generation_settings"]["params"]
    print(props)
    assert params == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}
    assert set(props["sampling_sources"].values()) == {"llama-server"}
    prompt = "Once upon a time"
    explicit = dict(temperature=0.8, top_p=0.95, extra_body={"top_k": 40, "min_p": 0.05})
    for seed in (1, 2, 3):
        unset = server.client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, seed=seed).choices[0]
        given = server.client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, seed=seed,
                                                 **explicit).choices[0]
        local = runner.generate(prompt, 12, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
        assert unset.text == given.text == local.text, (seed, unset.text, given.text, local.text)
    greedy = server.client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
    only_top = server.client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=1.0,
                                                seed=7, extra_body={"min_p": 1.0})
    assert only_top.choices[0].text == greedy.choices[0].text


def test_head_health_answers_as_get_does(server):
    """A load balancer's or `curl -I`'s probe: 200 with no body (it was a 405)."""
    r = httpx.head(f"{server.url}/health")
    assert r.status_code == 200 and r.content == b"", (r.status_code, r.text)


def test_every_answer_carries_a_system_fingerprint(server):
    """OpenAI's system_fingerprint, whole and streamed, completions and chat: llgraph's version and backend."""
    from llgraph import __version__

    want = f"llgraph-{__version__}-ort"
    whole = server.client.completions.create(model="smollm2", prompt="Hi", max_tokens=2, temperature=0)
    chat = server.client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2, temperature=0)
    chunks = list(server.client.chat.completions.create(model="smollm2", max_tokens=2, temperature=0, stream=True,
                                                        messages=[{"role": "user", "content": "Hi"}]))
    assert whole.system_fingerprint == chat.system_fingerprint == want
    assert chunks and all(c.system_fingerprint == want for c in chunks)
