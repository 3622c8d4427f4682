"""Every GGUF tokenizer llama.cpp's converter writes for the families llgraph runs: byte-level BPE of each pre-type
(SmolLM2's vocabulary relabelled: the splitting is what differs) and SentencePiece BPE (a real model trained with
`sentencepiece`, with and without the space prefix), token for token equal to llama.cpp's ids on a corpus of hard
text (digits, runs of spaces and newlines, code, CJK, emoji, accents, special-token text, a leading space), kept as
test data (`python tests/gguf_vocab.py` regenerates it with llama-cpp-python). The text of llama.cpp's ids equals
llama.cpp's own `detokenize` (user-defined pieces — a Gemma-like vocabulary's newlines, runs of spaces and tags — are
text, control tokens are not), whole and streamed; decoding round-trips; a pre-type llgraph does not carry is refused
in one line before any export; `llgraph generate` answers on a model of each."""

import json

import pytest
from gguf_vocab import CORPUS, DATA, PRE_TYPES, SENTENCEPIECE, relabelled, with_weights
from test_quant import llgraph

from llgraph.gguf_config import end_of_generation
from llgraph.gguf_source import gguf_reader
from llgraph.tokenizer import Tokenizer

LLAMA_CPP = json.loads((DATA / "llama_cpp_ids.json").read_text())
LLAMA_CPP_TEXT = json.loads((DATA / "llama_cpp_text.json").read_text())
NAMES = [*PRE_TYPES, *SENTENCEPIECE]


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    return {**{pre: relabelled(root / f"{pre}.gguf", pre) for pre in PRE_TYPES}, **SENTENCEPIECE}


@pytest.fixture(scope="module")
def tokenizers(vocabularies):
    """Each vocabulary's Tokenizer, loaded once for the module's tests (a load reads the GGUF: about a second)."""
    loaded: dict[str, Tokenizer] = {}

    def load(name: str) -> Tokenizer:
        if name not in loaded:
            loaded[name] = Tokenizer.load(vocabularies[name])
        return loaded[name]
    return load


@pytest.mark.parametrize("name", NAMES)
def test_ids_equal_llama_cpp_s_on_the_corpus(tokenizers, name):
    tok = tokenizers(name)
    got = [tok.tk.encode(text).ids for text in CORPUS]  # as llama.cpp's tokenize(add_bos=True, special=True)
    differing = [(text, want, ids) for text, want, ids in zip(CORPUS, LLAMA_CPP[name], got) if ids != want]
    print(f"{name}: {len(CORPUS) - len(differing)} of {len(CORPUS)} texts tokenized as llama.cpp does "
          f"({sum(map(len, got))} tokens)")
    assert not differing, differing[0]


@pytest.mark.parametrize("name", NAMES)
def test_text_of_llama_cpp_s_ids_equals_llama_cpp_s(tokenizers, name):
    """What a user reads: llama.cpp's ids decoded (control tokens skipped, user-defined pieces kept) as its own
    `detokenize(ids, special=False)` renders them."""
    tok = tokenizers(name)
    got = [tok.decode(ids) for ids in LLAMA_CPP[name]]
    differing = [(want, text) for want, text in zip(LLAMA_CPP_TEXT[name], got) if text != want]
    print(f"{name}: {len(CORPUS) - len(differing)} of {len(CORPUS)} texts decoded as llama.cpp decodes them")
    assert not differing, differing[0]


def test_a_gemma_like_vocabulary_keeps_its_whitespace_pieces(tokenizers):
    """Newlines, runs of spaces and tags are single user-defined pieces in Gemma's vocabulary: they are text."""
    tok = tokenizers("spm-gemma")
    text = "def quicksort(arr):\n    if len(arr) < 2:\n\n<b>x</b>"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = {tok.tk.id_to_token(i) for i in ids}
    assert {"\n", "\n\n", "    ", "<b>", "</b>"} <= pieces, pieces
    assert tok.decode(ids) == text
    assert tok.decode([tok.token_id("<start_of_turn>"), *ids]) == text  # a control token is not text


@pytest.mark.parametrize("name", ["spm-gemma", "llama-bpe"])
def test_streamed_text_is_the_whole_text(tokenizers, name):
    """The pieces a stream gives, one token at a time, join to llama.cpp's text of the same ids."""
    from llgraph.runtime.engine.decoding import Decoding

    tok = tokenizers(name)
    for ids, want in zip(LLAMA_CPP[name], LLAMA_CPP_TEXT[name]):
        body = ids[1:] if ids and ids[0] == tok.token_id(tok.bos_token) else ids  # an answer holds no BOS
        d = Decoding(tok.decode)
        pieces = []
        for t in body:
            d.push(t)
            pieces.append(d.new_text())
        assert "".join(pieces) == d.text() == tok.decode(body), (ids, pieces)
        if body == ids:
            assert d.text() == want


@pytest.mark.parametrize("name", NAMES)
def test_decoding_round_trips(tokenizers, name):
    tok = tokenizers(name)
    plain = [t for t in CORPUS if "<" not in t]  # special tokens are left out of decoded text
    # SentencePiece's space prefix is the text's own only after a BOS: without one, an answer's first word keeps it
    lead = [tok.token_id(tok.bos_token)] if name == "spm" else []
    for text in plain:
        assert tok.decode([*lead, *tok.encode(text, add_special_tokens=False)]) == text, text


def test_bos_as_the_gguf_says_and_never_twice(tokenizers):
    llama3 = tokenizers("llama-bpe")  # add_bos_token true, as Llama 3's GGUFs
    bos = llama3.token_id(llama3.bos_token)
    assert llama3.encode("Hi")[0] == bos and llama3.encode("Hi", add_special_tokens=False)[0] != bos
    templated = llama3.bos_token + "Hi"  # a chat template's text already starts with it
    assert llama3.encode(templated).count(bos) == 1
    assert tokenizers("qwen2").encode("Hi")[0] != bos  # add_bos_token false


def test_every_end_of_turn_id_stops(tokenizers, vocabularies):
    """eos, and the control tokens llama.cpp ends a turn on (SmolLM2's <|endoftext|> and <|im_end|>)."""
    tok = tokenizers("qwen2")
    ids = end_of_generation(gguf_reader(vocabularies["qwen2"]))
    assert {tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")} <= set(ids), ids


def test_an_unknown_pre_type_is_refused_in_one_line_before_export(tmp_path):
    model = with_weights(tmp_path / "m.gguf", relabelled(tmp_path / "v.gguf", "made-up-pre"))
    r = llgraph("export", "--checkpoint", str(model), "-o", str(tmp_path / "out"))
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    print(lines)
    assert r.returncode == 2 and len(lines) == 1 and "'made-up-pre'" in lines[0] and "llama-bpe" in lines[0]
    assert not (tmp_path / "out").exists()


def test_an_uncarried_pre_type_is_refused_saying_why(tmp_path):
    model = with_weights(tmp_path / "m.gguf", relabelled(tmp_path / "v.gguf", "kimi-k2"))
    r = llgraph("generate", str(model), "--prompt", "Hi", "--max-new-tokens", "2")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "'kimi-k2'" in lines[0] and "code of its own" in lines[0], lines
    assert not r.stdout


def test_generate_on_a_model_without_a_chat_template_says_so(vocabularies, tmp_path):
    model = with_weights(tmp_path / "base.gguf", vocabularies["spm"])  # no tokenizer.chat_template: a base model
    r = llgraph("generate", str(model), "--prompt", "Write one sentence about the sea.", "--max-new-tokens", "2")
    notes = [line for line in r.stderr.splitlines() if "chat template" in line]
    assert r.returncode == 0 and len(notes) == 1 and "--raw" in notes[0], r.stderr
    r = llgraph("generate", str(model), "--prompt", "Write", "--max-new-tokens", "2", "--raw")
    assert r.returncode == 0 and "chat template" not in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2", "tekken", "gpt-4o", "deepseek-llm", "spm", "spm-gemma",
                                  "seed-coder", "viking"])
def test_generate_answers_on_a_gguf_of_each_tokenizer(vocabularies, name, tmp_path, capsys):
    """`llgraph generate` in this process (the refusals above hold the command's own process and exit code)."""
    from llgraph.runtime.cli import main

    model = with_weights(tmp_path / f"{name}.gguf", vocabularies[name])
    status = main(["generate", str(model), "--prompt", "Once upon a time", "--max-new-tokens", "4", "--raw"])
    out = capsys.readouterr()
    print(name, repr(out.out))
    assert status == 0 and out.out.strip(), out.err


def test_generate_streams_user_defined_pieces_as_text(vocabularies, tmp_path):
    """Through an export (its tokenizer.json written from the GGUF and read back) and Runner.stream, as `llgraph
    generate` streams: a Gemma-like model pushed onto its newline and indent pieces writes them, and with a space
    prefix (SentencePiece as Llama 2's) an answer's first word keeps its space, as llama-server streams it."""
    from llgraph.runtime import open_runner

    model = with_weights(tmp_path / "gemma-like.gguf", vocabularies["spm-gemma"])
    runner = open_runner(str(model), "ort", max_seq_len=64, cache_dir=tmp_path / "cache")
    tok = runner.tokenizer
    pieces = list(runner.stream("def f(x):", 4, logit_bias={tok.token_id("\n\n"): 100.0}))
    print(repr("".join(pieces)))
    assert "".join(pieces) == "\n\n" * 4
    assert runner.generate("def f(x):", 4, logit_bias={tok.token_id("    "): 100.0}).text == "    " * 4
    model = with_weights(tmp_path / "prefixed.gguf", vocabularies["spm"])
    runner = open_runner(str(model), "ort", max_seq_len=64, cache_dir=tmp_path / "cache")
    word = next(i for i in range(runner.backend.vocab_size) if runner.tokenizer.tk.id_to_token(i).startswith("▁")
                and runner.tokenizer.tk.id_to_token(i)[1:].isalpha())
    text = "".join(runner.stream("Once upon a time", 2, logit_bias={word: 100.0}))
    assert text == runner.tokenizer.tk.id_to_token(word).replace("▁", " ") * 2, text


@pytest.mark.parametrize("name", ["llama-bpe", "spm-gemma"])
def test_a_long_decode_is_the_same_text(tokenizers, name):
    """Past LONG_DECODE ids, decode goes through decode_batch (which releases the GIL): the text is decode's."""
    from llgraph.tokenizer import LONG_DECODE

    tok = tokenizers(name)
    ids = tok.encode(" ".join(CORPUS) * 40, add_special_tokens=False)
    assert len(ids) > LONG_DECODE
    assert tok.decode(ids) == tok.tk.decode(ids, skip_special_tokens=True)
