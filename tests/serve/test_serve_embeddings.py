"""/v1/embeddings on `llgraph serve`, driven by the official `openai` client (which asks for base64 by default):
vectors equal to Runner.embed on the same export, a batch in order, float and base64 alike, mean pooling by flag,
embeddings served beside running completions, and 400s for `dimensions` and bad input."""

import numpy as np
import pytest
from conftest import need

openai = need("openai")
need("fastapi")

from serving import Server  # noqa: E402

TEXTS = ["The capital of France is Paris.", "A cat sat on the mat.", "Embeddings map text to vectors."]
TOL = 1e-5


@pytest.fixture(scope="module")
def runner(serve_export):
    from llgraph.runtime import ORTRunner

    return ORTRunner(serve_export, max_seq_len=256)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_runner_embed(serve_export, runner, pooling):
    s = Server(str(serve_export), "--name", "m", "--slots", "2", "--max-seq-len", "256", "--pooling", pooling)
    try:
        r = s.client.embeddings.create(model="m", input=TEXTS)
        got = np.array([d.embedding for d in r.data], np.float32)
        want = runner.embed(TEXTS, pooling=pooling)
        print(f"{pooling}: served vs Runner.embed max |diff| {np.abs(got - want).max():.2e}")
        assert [d.index for d in r.data] == [0, 1, 2] and np.abs(got - want).max() <= TOL
        assert r.usage.prompt_tokens == sum(len(runner.encode(t)) for t in TEXTS)
        floats = s.client.embeddings.create(model="m", input=TEXTS[0], encoding_format="float")
        assert np.abs(np.array(floats.data[0].embedding) - want[0]).max() <= TOL
        ids = s.client.embeddings.create(model="m", input=[runner.encode(t) for t in TEXTS[:2]])
        assert np.abs(np.array([d.embedding for d in ids.data]) - want[:2]).max() <= TOL
        # beside a running completion: both answers are whole and exact
        stream = s.client.completions.create(model="m", prompt="Once upon a time", max_tokens=30, temperature=0,
                                             stream=True)
        beside = s.client.embeddings.create(model="m", input=TEXTS[2])
        text = "".join(c.choices[0].text for c in stream)
        assert np.abs(np.array(beside.data[0].embedding) - want[2]).max() <= TOL
        assert text == runner.generate("Once upon a time", 30).text
    finally:
        assert s.stop() == 0, "".join(s.lines)


def test_bad_embedding_requests_are_a_400_naming_the_field(serve_export):
    s = Server(str(serve_export), "--name", "m", "--slots", "1", "--max-seq-len", "64")
    try:
        for kwargs, says in [({"input": "hi", "dimensions": 64}, "'dimensions' \\(64\\) cannot be honoured"),
                             ({"input": ""}, "'input' must be a non-empty string"),
                             ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
                             ({"input": [[1, 999999]]}, "outside the vocabulary"),
                             ({"input": "word " * 200}, "context")]:
            with pytest.raises(openai.BadRequestError, match=says):
                s.client.embeddings.create(model="m", **kwargs)
    finally:
        assert s.stop() == 0, "".join(s.lines)
