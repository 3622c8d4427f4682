"""The shared decode loop on every CPU backend: greedy agreement with transformers, batch invariance, streaming
across multi-byte characters, stop strings, bad requests, and recovery from an interrupted stream."""

import numpy as np
import pytest
import torch
from reference import hf_model

from llgraph.runtime import RequestError, Runner
from llgraph.runtime.backends.pytorch import TorchBackend
from llgraph.runtime.engine.backend import Backend

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [60, 61, 62, 63, 64], [7]]


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_greedy_equals_transformers_on_every_backend(tiny_runners):
    cfg, source, runners = tiny_runners
    model = hf_model(cfg, source)
    for prompt in PROMPTS:
        want = hf_greedy(model, prompt, 16)
        for name, runner in runners.items():
            got = runner.generate(prompt, 16).token_ids
            assert got == want, (name, prompt, got, want)


@pytest.mark.parametrize("backend", ["torch", "ort", "ort-llgraph", "onnx", "trt"])
def test_batch_of_different_lengths_equals_each_alone(tiny_runners, backend):
    runner = tiny_runners[2][backend]
    batched = runner.generate(PROMPTS, 12)
    assert [g.token_ids for g in batched] == [runner.generate(p, 12).token_ids for p in PROMPTS]


def test_top_k_1_equals_greedy_and_seeds_reproduce(tiny_runners):
    runner = tiny_runners[2]["ort"]
    greedy = runner.generate(PROMPTS[0], 10).token_ids
    assert runner.generate(PROMPTS[0], 10, temperature=0.8, top_k=1, seed=3).token_ids == greedy
    a = runner.generate(PROMPTS[0], 10, temperature=1.5, top_p=0.9, seed=5).token_ids
    assert runner.generate(PROMPTS[0], 10, temperature=1.5, top_p=0.9, seed=5).token_ids == a


def test_numpy_token_ids_are_one_prompt(tiny_runners):
    import numpy as np

    runner = tiny_runners[2]["torch"]
    assert runner.generate(np.array(PROMPTS[0], np.int32), 5).token_ids == runner.generate(PROMPTS[0], 5).token_ids


def test_eos_ends_a_row(tiny_runners):
    runner = tiny_runners[2]["torch"]
    tokens = runner.generate(PROMPTS[0], 10).token_ids
    g = runner.generate(PROMPTS[0], 10, eos_token_ids=[tokens[3]])
    assert g.finish_reason == "eos" and g.token_ids == tokens[:3]


@pytest.mark.parametrize("prompt, kwargs, message", [
    ([], {}, "the prompt is empty"),
    ([1, 2, 300], {}, r"token ids \[300\] are outside the vocabulary \(0..96\)"),
    ([-1], {}, r"token ids \[-1\] are outside the vocabulary"),
    (list(range(60)), {"max_new_tokens": 10}, r"prompt \(60 tokens\) \+ max_new_tokens \(10\) exceeds the cache \(64"),
    ([1, 2], {"max_new_tokens": 0}, r"max_new_tokens \(0\) must be a positive integer"),
    ([1, 2], {"temperature": -1.0}, r"temperature \(-1.0\) must be >= 0"),
    ([1, 2], {"top_p": 2.0}, r"top_p \(2.0\) must be in"),
    ("text", {}, "this runner has no tokenizer"),
])
def test_bad_requests_get_one_line_errors(tiny_runners, prompt, kwargs, message):
    with pytest.raises(RequestError, match=message) as e:
        tiny_runners[2]["ort"].generate(prompt, **{"max_new_tokens": 4, **kwargs})
    assert "\n" not in str(e.value)


class ScriptedBackend(Backend):
    """Emits a fixed token script: the logits at position p put all mass on script[p + 1 - prompt_len]."""

    def __init__(self, script, prompt_len, vocab_size, max_seq_len=256):
        self.script, self.prompt_len, self.vocab_size, self.max_seq_len = script, prompt_len, vocab_size, max_seq_len

    def allocate(self, batch):
        pass

    def forward(self, input_ids, position_ids, rows=None, keep=0):
        out = np.zeros((*input_ids.shape, self.vocab_size), np.float32)
        k = np.clip(position_ids + 1 - self.prompt_len, 0, len(self.script) - 1)
        np.put_along_axis(out, np.array(self.script)[k][..., None], 1.0, -1)
        return out


@pytest.fixture(scope="module")
def smol_tokenizer():
    from llgraph.bundled import bundled_model
    from llgraph.tokenizer import Tokenizer

    return Tokenizer.from_gguf(bundled_model("smollm2"))


def test_streamed_pieces_concatenate_across_multibyte_characters(smol_tokenizer):
    text = "héllo 🙂 世界, naïve café — ok"
    script = smol_tokenizer.encode(text)
    assert len(script) > len(text.split())  # the emoji and CJK really are split into byte-level tokens
    runner = Runner(ScriptedBackend(script, 1, 49152), smol_tokenizer)
    pieces = list(runner.stream([1], len(script)))
    print(pieces)
    assert "".join(pieces) == text == runner.generate([1], len(script)).text
    assert not any("\ufffd" in p for p in pieces) and len(pieces) > 5


def test_stop_strings_end_generation_and_are_not_emitted(smol_tokenizer):
    script = smol_tokenizer.encode("Answer: 42. END of story")
    runner = Runner(ScriptedBackend(script, 1, 49152), smol_tokenizer)
    g = runner.generate([1], len(script), stop=["END"])
    assert g.text == "Answer: 42. " and g.finish_reason == "stop"
    assert "".join(runner.stream([1], len(script), stop=["END"])) == "Answer: 42. "


def test_a_stop_string_its_reader_finds_ends_a_scheduled_request(smol_tokenizer):
    """The scheduler's engine returns token ids; the reader of a request's events makes its text and finds the stop
    string (runtime/engine/decoding.py), then tells the scheduler, which frees the slot: the answer equals Runner's
    (whose own loop stops at once), the row ended "stop" well before its length, and the slot serves again."""
    import time

    from llgraph.runtime.engine.scheduler import Scheduler

    script = smol_tokenizer.encode("Answer: 42. END of story")

    class Paced(ScriptedBackend):  # a step takes a few ms, as a model's would
        def forward(self, input_ids, position_ids, rows=None, keep=0):
            time.sleep(0.005)
            return super().forward(input_ids, position_ids, rows, keep)

    runner = Runner(Paced(script, 1, 49152), smol_tokenizer)
    want = runner.generate([1], 200, stop=["END"])
    scheduler = Scheduler(runner, slots=1).start()
    try:
        handle = scheduler.submit([1], 200, stop=["END"])
        got = handle.result(timeout=60)
        assert (got.text(), got.tokens, got.finish_reason) == (want.text, want.token_ids, "stop") == \
            ("Answer: 42. ", got.tokens, "stop")
        again = scheduler.submit([1], 3).result(timeout=60)
        row = handle._request.row
        print(f"answer {len(got.tokens)} tokens; the engine took {row.steps} before it heard of the stop")
        assert row.finish_reason == "stop" and row.steps < 100
        assert again.tokens == script[:3]
    finally:
        scheduler.stop()


def test_a_bug_in_a_row_s_work_is_raised_as_itself_alone_and_logged_in_a_batch(smol_tokenizer, monkeypatch, capfd):
    """errors.py's rule: a bug keeps its traceback. One prompt's generate raises the bug itself (not a one-line
    RequestError, which the CLI would answer with exit 2 as if the user were at fault); in a batch the failing row
    ends with its error and the bug's traceback is on stderr."""
    from llgraph.runtime.engine import speculative

    script = smol_tokenizer.encode("Answer: 42.")
    runner = Runner(ScriptedBackend(script, 1, 49152), smol_tokenizer)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(speculative, "accept", broken)
    with pytest.raises(ZeroDivisionError, match="a bug"):
        runner.generate([1], 4)
    with pytest.raises(ZeroDivisionError):
        list(runner.stream([1], 4))
    assert "Traceback" not in capfd.readouterr().err  # raised, not printed twice
    batch = runner.generate([[1], [1, 2]], 4)
    assert [g.finish_reason for g in batch] == ["error", "error"] and "ZeroDivisionError" in batch[0].error
    assert capfd.readouterr().err.count("Traceback") == 2


def test_interrupted_stream_leaves_the_runner_usable(tiny_runners):
    cfg, source, runners = tiny_runners
    backend = TorchBackend(cfg, source, max_seq_len=64)
    calls = {"n": 0}
    forward = backend.forward

    def flaky(ids, pos, **kw):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return forward(ids, pos, **kw)

    backend.forward = flaky
    runner = Runner(backend)
    with pytest.raises(KeyboardInterrupt):
        for _ in runner.stream(PROMPTS[0], 10):
            pass
    assert runner.generate(PROMPTS[0], 10).token_ids == runners["torch"].generate(PROMPTS[0], 10).token_ids
    stream = runner.stream(PROMPTS[1], 10)
    next(stream, None)
    stream.close()  # a consumer that stops reading midway
    assert runner.generate(PROMPTS[1], 10).token_ids == runners["torch"].generate(PROMPTS[1], 10).token_ids
