"""Vocabulary-only GGUFs for the tokenizer tests, and the reference ids llama.cpp gives for them.

    relabelled(path, pre)            SmolLM2's byte-level BPE vocabulary (the bundled GGUF's) under another
                                     `tokenizer.ggml.pre`: enough to check each pre-type's splitting
    SENTENCEPIECE                    a real SentencePiece BPE model (trained here, 800 pieces, byte fallback) as
                                     llama.cpp's converter writes one: tests/data/gguf_tokenizers/*.gguf; and one
                                     trained as Gemma's is (`spm-gemma`: newlines, runs of spaces, tabs and HTML tags
                                     as user-defined pieces, no space prefix, digits split)

    python tests/gguf_vocab.py       regenerates tests/data/gguf_tokenizers/llama_cpp_ids.json with llama.cpp
                                     (llama-cpp-python, `Llama(path, vocab_only=True).tokenize`) and
                                     llama_cpp_text.json, its text of those ids (`detokenize`, special=False)
"""

import functools
import json
import sys
from pathlib import Path

import gguf

DATA = Path(__file__).resolve().parent / "data" / "gguf_tokenizers"
CORPUS = json.loads((DATA / "corpus.json").read_text())
PRE_TYPES = ("llama-bpe", "qwen2", "tekken", "dbrx", "olmo", "deepseek-llm", "gpt-4o", "default", "gpt-2", "smollm",
             # one name of every other split llama.cpp makes by regexes
             "deepseek-coder", "seed-coder", "superbpe", "trillion", "poro-chat", "viking", "falcon", "bloom",
             "gpt3-finnish", "chameleon", "chatglm-bpe", "glm4", "bailingmoe", "deepseek-v3", "qwen35", "ufakzeka",
             "minicpm5", "laguna", "exaone-moe", "tiny_aya", "jais-2", "grok-2")
SENTENCEPIECE = {"spm": DATA / "sentencepiece-bpe-800.gguf", "spm-no-prefix": DATA / "sentencepiece-bpe-800-np.gguf",
                 "spm-gemma": DATA / "sentencepiece-gemma-800.gguf"}
# Gemma's user-defined pieces, as its tokenizer.model holds them (spaces as ▁): whitespace runs and HTML tags
GEMMA_USER_DEFINED = ["\n", "\n\n", "\n\n\n", "▁▁", "▁▁▁", "▁▁▁▁", "▁▁▁▁▁▁▁▁", "\t", "\t\t", "<b>", "</b>", "<h1>",
                      "</h1>", "<br>"]
BOS_PRE = {"llama-bpe", "dbrx"}  # Llama 3's GGUFs add a BOS


def _hparams(w: gguf.GGUFWriter, vocab: int) -> None:
    """What llama.cpp reads of a llama model before its vocabulary (no tensors: vocab_only)."""
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    w.add_vocab_size(vocab)


def _write(path: Path, fill) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@functools.cache
def smollm2_vocabulary() -> tuple[list, list, list]:
    """SmolLM2's tokens, token types and merges, read once (a read of the file takes seconds: the relabelled
    vocabularies were ~80 s of the suite)."""
    from llgraph.bundled import bundled_model
    from llgraph.gguf_source import gguf_reader

    r = gguf_reader(bundled_model("smollm2"))
    return tuple(r.fields[f"tokenizer.ggml.{key}"].contents() for key in ("tokens", "token_type", "merges"))


def relabelled(path: Path, pre: str) -> Path:
    """SmolLM2's vocabulary, merges and token types under `tokenizer.ggml.pre` = `pre`."""
    tokens, types, merges = smollm2_vocabulary()

    def fill(w):
        _hparams(w, len(tokens))
        w.add_name(f"smollm2 vocabulary as {pre}")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(pre in BOS_PRE)
    return _write(path, fill)


# gpt-oss's harmony: its marks as control tokens after SmolLM2's pieces, and a template in its shape (an assistant's
# earlier answers in the final channel; the answer opens after <|start|>assistant)
HARMONY_MARKS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
HARMONY_TEMPLATE = (
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")


def harmony(path: Path) -> Path:
    """SmolLM2's vocabulary as gpt-4o's pre-type with gpt-oss's harmony marks (control tokens; <|return|> the eos,
    <|end|> among the end-of-turn texts) and a harmony chat template."""
    smol_tokens, smol_types, merges = smollm2_vocabulary()

    def fill(w):
        tokens = [*smol_tokens, *HARMONY_MARKS]
        types = [*smol_types, *[gguf.TokenType.CONTROL] * len(HARMONY_MARKS)]
        _hparams(w, len(tokens))
        w.add_name("smollm2 vocabulary with harmony")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-4o")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(tokens.index("<|return|>"))
        w.add_eot_token_id(tokens.index("<|end|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(HARMONY_TEMPLATE)
    return _write(path, fill)


def with_weights(path: Path, vocab: Path, sampling: dict | None = None) -> Path:
    """A tiny random-weight llama GGUF (Q8_0) carrying `vocab`'s tokenizer fields: a model `llgraph generate` runs.
    `sampling`: general.sampling.* fields to write, by gguf's writer's names ({"temp": 0.7, "top_k": 20})."""
    import gguf.quants  # noqa: F401
    from reference import tiny, write_gguf

    from llgraph.checkpoint import random_weights
    from llgraph.gguf_source import gguf_reader

    r = gguf_reader(vocab)  # llgraph's: gguf's own takes 3 s a 49k-token vocabulary, 9 of them in the suite
    keys = [k for k in r.fields if k.startswith("tokenizer.")]
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    cfg = tiny(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, head_dim=16)

    def copy(w):
        for key in keys:
            f = r.fields[key]
            kind = f.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                w.add_array(key, f.contents())
            else:
                w.add_key_value(key, f.contents(), kind)
        for name, value in (sampling or {}).items():
            getattr(w, f"add_sampling_{name}")(value)
    write_gguf(path, cfg, random_weights(cfg, seed=3, std=0.25),
               lambda i, name, x: gguf.GGMLQuantizationType.Q8_0 if x.ndim == 2 else gguf.GGMLQuantizationType.F32,
               fields=copy)
    return path


def train_gemma_like(model_prefix: Path) -> Path:
    """A SentencePiece BPE model trained as Gemma's was (user-defined whitespace and tag pieces, byte fallback, no
    dummy prefix, digits split, text taken as written) on the corpus, the bundled tale and some of llgraph's source."""
    import sentencepiece as spm

    root = Path(__file__).resolve().parents[1]
    text = "\n".join([*CORPUS, (root / "llgraph/data/tale-of-two-cities.txt").read_text(),
                      *(p.read_text() for p in sorted((root / "llgraph").glob("*.py"))[:6])])
    corpus = model_prefix.with_suffix(".txt")
    corpus.write_text(text)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(model_prefix), vocab_size=800, model_type="bpe", byte_fallback=True,
        user_defined_symbols=GEMMA_USER_DEFINED, control_symbols=["<start_of_turn>", "<end_of_turn>"],
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        split_digits=True, allow_whitespace_only_pieces=True, num_threads=1, max_sentence_length=100000,
        minloglevel=2)
    return model_prefix.with_suffix(".model")


def sentencepiece(model_file: Path, path: Path, add_space_prefix: bool) -> Path:
    """A SentencePiece model written as llama.cpp's convert_hf_to_gguf.py writes one (tokens, scores, types). A
    user-defined piece is written as the converter writes Gemma's added tokens (`_create_vocab_sentencepiece`: its
    ▁ pre-normalized to a space, score -1000, type USER_DEFINED)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    proto = pb.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    kinds = {pb.ModelProto.SentencePiece.NORMAL: 1, pb.ModelProto.SentencePiece.UNKNOWN: 2,
             pb.ModelProto.SentencePiece.CONTROL: 3, pb.ModelProto.SentencePiece.USER_DEFINED: 4,
             pb.ModelProto.SentencePiece.UNUSED: 5, pb.ModelProto.SentencePiece.BYTE: 6}

    def fill(w):
        _hparams(w, sp.vocab_size())
        w.add_name(f"sentencepiece bpe {model_file.stem}")
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        user = pb.ModelProto.SentencePiece.USER_DEFINED
        w.add_token_list([p.piece.replace("▁", " ") if p.type == user else p.piece for p in proto.pieces])
        w.add_token_scores([-1000.0 if p.type == user else p.score for p in proto.pieces])
        w.add_token_types([kinds[p.type] for p in proto.pieces])
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(add_space_prefix)
    return _write(path, fill)


def reference(tmp: Path) -> tuple[dict, dict]:
    """{gguf name: [llama.cpp's ids of each corpus text, BOS as the file says, special tokens parsed]} and
    {gguf name: [llama.cpp's text of those ids, control tokens skipped]}."""
    from llama_cpp import Llama

    files = {pre: relabelled(tmp / f"{pre}.gguf", pre) for pre in PRE_TYPES}
    files.update(SENTENCEPIECE)
    ids, texts = {}, {}
    for name, path in files.items():
        llm = Llama(str(path), vocab_only=True, verbose=False)
        ids[name] = [llm.tokenize(text.encode(), add_bos=True, special=True) for text in CORPUS]
        texts[name] = [llm.detokenize(t, special=False).decode("utf-8", errors="replace") for t in ids[name]]
    return ids, texts


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    model = DATA / "sentencepiece-bpe-800.model"
    if model.exists():  # the trained model, turned into the committed GGUFs once
        sentencepiece(model, SENTENCEPIECE["spm"], True)
        sentencepiece(model, SENTENCEPIECE["spm-no-prefix"], False)
    with tempfile.TemporaryDirectory() as tmp:
        if not SENTENCEPIECE["spm-gemma"].exists():
            sentencepiece(train_gemma_like(Path(tmp) / "gemma-800"), SENTENCEPIECE["spm-gemma"], False)
        ids, texts = reference(Path(tmp))
    (DATA / "llama_cpp_ids.json").write_text(json.dumps(ids, separators=(",", ":")) + "\n")
    (DATA / "llama_cpp_text.json").write_text(json.dumps(texts, ensure_ascii=False, indent=0) + "\n")
    print(f"wrote {DATA / 'llama_cpp_ids.json'} and llama_cpp_text.json: {len(ids)} tokenizers x {len(CORPUS)} texts")
