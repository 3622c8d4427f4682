"""A GGUF file's own tokenizer as a `tokenizers` object, tokenizing as llama.cpp does (the reference: tests hold the
ids to llama.cpp's on a corpus of hard text, tests/data/gguf_tokenizers/).

    tk, bos, eos = build(reader)        # reader: gguf.GGUFReader of the file

Two kinds of `tokenizer.ggml.model`:
- `gpt2`, byte-level BPE: the text split by the regexes of `tokenizer.ggml.pre` (each regex in turn splits every
  piece into its matches and the text between them, as llama.cpp's `unicode_regex_split`), then GPT-2's byte
  alphabet and the merges. The regexes are the models' own (their tokenizer.json pre-tokenizers); a pre-type whose
  regexes llgraph does not carry is refused in one line naming it, before anything is exported.
- `llama`, SentencePiece BPE: spaces as `▁` (one prepended to every text between special tokens where
  `add_space_prefix`, as llama.cpp), merges in the order of the merged piece's score, bytes without a piece as
  `<0xNN>`.
Control, user-defined and unknown tokens are split out of the text first; on decode a user-defined piece is text as
written (Gemma's `\n\n` and runs of spaces, Qwen's `<think>`) and control and unknown ones are skipped, as llama.cpp
renders them. `add_bos_token`/`add_eos_token` are honoured by the post-processor.
"""

from __future__ import annotations

from llgraph.errors import LlgraphError
from llgraph.gguf_config import EOG_TEXTS, FIM_TEXTS, SPECIAL_TYPES, end_is_text
from llgraph.gguf_source import metadata

# the regexes of each pre-tokenizer (byte-level BPE), in the order they split
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_CASED = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{s}"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{s}"
          r"|\p{N}{n}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = _CASED.replace("{s}", "").replace("{n}", "")
_GPT4O = _CASED.replace("{s}", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?").replace("{n}", "{1,3}")
# DeepSeek LLM's letters (its tokenizer.json's class), by code point: some of them change under Unicode normalization
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b"
    "\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
# contractions, case-insensitive as llama.cpp spells them (its regex engine has no inline flags)
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_QWEN2_LIKE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
               r"|\s+")
_GPT2_NO_TAIL = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"
_DEEPSEEK3 = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
              "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
# llama.cpp's regexes of each pre-tokenizer (byte-level BPE; src/llama-vocab.cpp), in the order they split
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "tekken": (_TEKKEN,),
    "gpt4o": (_GPT4O,),
    "smollm": (r"\p{N}", _GPT2),  # every digit alone, then GPT-2's (StarCoder's)
    "deepseek-llm": (r"[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f"
                     "\u3000-\u3002]+", r"\s+$", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}+"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"),
    "deepseek-v3": (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _DEEPSEEK3),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_NO_TAIL, r"[0-9][0-9][0-9]"),
    "gpt2-no-tail": (_GPT2_NO_TAIL,),  # trillion, granite-docling
    "poro": (_PORO,),  # poro-chat, bloom, gpt3-finnish
    "viking": (_PORO, r"\p{N}"),
    "chatglm4": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
                 r"|\s+",),
    "chameleon": (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
                  r"[\p{P}!-/:-@\[-`{-~]", _GPT2_NO_TAIL),
    "superbpe": (r"\p{N}+", r"(?=(\d{3})+(?!\d))"),
    "bailingmoe": (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                   r"[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",),
    "seed-coder": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)"
                   r"|\s+",),
    "qwen2-like": (_QWEN2_LIKE,),  # grok-2, solar-open: Qwen2's regex as llama.cpp spells it
    "qwen35": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+",),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "minicpm5": (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "laguna": (r"[^\n]+|[\n]+", _QWEN2_LIKE),
    "exaone-moe": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",),
    "tiny-aya": (r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O),
    "jais-2": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + r"|\s{1,2}(?!\S)|\s{1}",),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),  # llama.cpp's for an unnamed one
}
# tokenizer.ggml.pre as llama.cpp's converter writes it -> its splits (llama.cpp's llama-vocab.cpp groups them so)
PRE_NAMES = {
    **{n: "llama3" for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx",
                             "smaug-bpe", "lfm2", "midm-2.0")},
    **{n: "qwen2" for n in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "kormo", "f2llmv2")},
    **{n: "gpt2" for n in ("gpt-2", "gpt2", "phi-2", "olmo", "mpt", "jais", "roberta-bpe", "exaone4", "jina-es",
                           "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum", "modern-bert")},
    **{n: "smollm" for n in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
                             "mellum2")},
    **{n: "gpt4o" for n in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")},
    **{n: "poro" for n in ("poro-chat", "bloom", "gpt3-finnish")},
    **{n: "gpt2-no-tail" for n in ("trillion", "granite-docling")},
    **{n: "deepseek-v3" for n in ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4")},
    **{n: "chatglm4" for n in ("chatglm-bpe", "glm4", "glm5")},
    **{n: "bailingmoe" for n in ("bailingmoe", "bailingmoe2", "llada-moe")},
    **{n: "qwen2-like" for n in ("grok-2", "solar-open")},
    **{n: "tiny-aya" for n in ("tiny_aya", "cohere2moe")},
    **{n: n for n in ("tekken", "deepseek-llm", "deepseek-coder", "falcon", "viking", "chameleon", "superbpe",
                      "seed-coder", "qwen35", "ufakzeka", "minicpm5", "laguna", "exaone-moe", "jais-2", "default")},
}
# pre-types llama.cpp splits with code of its own, not regexes: refused, saying so
UNCARRIED = {"kimi-k2": "Kimi K2's Han-aware splitter", "afmoe": "AFMoE's digit grouping",
             "gemma4": "SentencePiece-style BPE on raw UTF-8", "sarvam-moe": "SentencePiece-style BPE on raw UTF-8",
             "whitespace": "whitespace splitting without byte encoding"}
# a piece that is a vocabulary token is that token, whatever the merges say (by tokenizer.ggml.pre, as llama.cpp)
_LLAMA3_GROUP = {n for n, s in PRE_NAMES.items() if s == "llama3"} - {"dbrx", "smaug-bpe"}
IGNORE_MERGES = {*_LLAMA3_GROUP, "tekken", "glm4", "glm5", "minicpm5"}
ADD_BOS = {*_LLAMA3_GROUP, "tekken", "chameleon"}  # llama.cpp adds a BOS for these unless the file says otherwise
USER_DEFINED, BYTE = 4, 6  # token types: a piece rendered as written; a byte-fallback piece <0xNN>
# gpt-oss's harmony marks, control tokens that llama.cpp always renders (its "quick hack for gpt-oss"), and <|end|>
# where it is no end of turn (gguf_config.end_is_text): an answer's text holds its channels, which the server splits
# into reasoning and content (runtime/engine/harmony.py)
HARMONY_TEXT = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


class TokenizerError(LlgraphError):
    pass


def check(reader) -> None:
    """Refuses, in one line, a GGUF tokenizer llgraph cannot build (before any export starts)."""
    kind, pre = metadata(reader, "tokenizer.ggml.model"), metadata(reader, "tokenizer.ggml.pre", "default")
    if kind is None:  # a GGUF without a vocabulary: token ids only
        return
    if kind == "gpt2" and pre in UNCARRIED:
        raise TokenizerError(f"GGUF pre-tokenizer '{pre}' is not supported: llama.cpp splits it with code of its own "
                             f"({UNCARRIED[pre]}); export from an HF folder with tokenizer.json")
    if kind == "gpt2" and pre not in PRE_NAMES:
        raise TokenizerError(f"GGUF pre-tokenizer '{pre}' is not one llama.cpp names (llgraph builds all "
                             f"{len(PRE_NAMES)} it splits by regexes: llama-bpe, qwen2, tekken, gpt-4o, ... in "
                             "llgraph/gguf_tokenizer.py); export from an HF folder with tokenizer.json")
    if kind not in ("gpt2", "llama"):
        raise TokenizerError(f"GGUF tokenizer model '{kind}' is not supported (llgraph builds 'gpt2' byte-level BPE "
                             "and 'llama' SentencePiece); export from an HF folder with tokenizer.json")


def build(reader):
    """-> (tokenizers.Tokenizer, bos text, eos text) from the GGUF's `tokenizer.ggml.*` fields."""
    from tokenizers import AddedToken, processors
    from tokenizers import Tokenizer as TK

    check(reader)
    tokens, types = metadata(reader, "tokenizer.ggml.tokens"), metadata(reader, "tokenizer.ggml.token_type")
    types = list(types) if types is not None else [1] * len(tokens)
    if metadata(reader, "tokenizer.ggml.model") == "gpt2":
        pre = metadata(reader, "tokenizer.ggml.pre", "default")
        tk = TK(_byte_level_bpe(reader, tokens, pre in IGNORE_MERGES))
        _byte_level_pipeline(tk, pre)
        add_bos = bool(metadata(reader, "tokenizer.ggml.add_bos_token", pre in ADD_BOS))
    else:
        tk = TK(_sentencepiece_bpe(reader, tokens, types))
        _sentencepiece_pipeline(tk, bool(metadata(reader, "tokenizer.ggml.add_space_prefix", True)))
        add_bos = bool(metadata(reader, "tokenizer.ggml.add_bos_token", True))
    name = str(metadata(reader, "general.name", "")).lower()
    rstrip = "phi-3" in name or "phi3" in name  # llama.cpp strips the space after Phi-3's special tokens
    # split out of the text before the model's own splitting (llama.cpp's tokenizer_st_partition); a user-defined
    # piece (type 4: Gemma's newlines and runs of spaces, Qwen's <think>) is text on decode, the others are not, nor
    # is a user-defined one that looks like an end of turn or a fill-in-the-middle mark (llama.cpp makes it control)
    control = set(EOG_TEXTS) | set(FIM_TEXTS)
    rendered = set(HARMONY_TEXT) | ({"<|end|>"} if end_is_text({t for t, k in zip(tokens, types)
                                                                if t in EOG_TEXTS and k in SPECIAL_TYPES}) else set())
    tk.add_tokens([AddedToken(t, special=(kind != USER_DEFINED or t in control) and t not in rendered,
                              normalized=False,
                              rstrip=rstrip and t not in ("<unk>", "<s>", "<|endoftext|>"))
                   for t, kind in zip(tokens, types) if kind in SPECIAL_TYPES])
    bos, eos = metadata(reader, "tokenizer.ggml.bos_token_id"), metadata(reader, "tokenizer.ggml.eos_token_id")
    bos_text = tokens[bos] if bos is not None and bos < len(tokens) else ""
    add_eos = bool(metadata(reader, "tokenizer.ggml.add_eos_token", False))
    eos_text = tokens[eos] if eos is not None and eos < len(tokens) else ""
    single = ([bos_text] if add_bos and bos_text else []) + ["$A"] + ([eos_text] if add_eos and eos_text else [])
    if len(single) > 1:
        specials = [(t, tokens.index(t)) for t in {bos_text, eos_text} if t and t in single]
        tk.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=specials)
    return tk, bos_text, eos_text


def _byte_level_bpe(reader, tokens, ignore_merges: bool):
    from tokenizers import models

    merges = [tuple(m.split(" ", 1)) for m in metadata(reader, "tokenizer.ggml.merges") or []]
    return models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False, ignore_merges=ignore_merges)


def _byte_level_pipeline(tk, pre: str) -> None:
    from tokenizers import Regex, decoders, pre_tokenizers

    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[PRE_NAMES[pre]]]
    tk.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)])
    tk.decoder = decoders.ByteLevel()


def _sentencepiece_bpe(reader, tokens, types):
    """SentencePiece BPE as tokenizers' BPE: a merge for every split of a normal piece into two pieces, ranked by
    the merged piece's score (llama.cpp merges the adjacent pair whose union scores highest, leftmost first)."""
    from tokenizers import models

    scores = metadata(reader, "tokenizer.ggml.scores")
    scores = list(scores) if scores is not None else [-float(i) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for i, piece in enumerate(tokens):
        if types[i] not in (1, 4) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], i, vocab[left], (left, right)))
    merges.sort()
    unk = metadata(reader, "tokenizer.ggml.unknown_token_id", 0)
    return models.BPE(vocab, [m[-1] for m in merges], unk_token=tokens[unk] if unk is not None else None,
                      fuse_unk=True, byte_fallback=any(t == BYTE for t in types))


def _sentencepiece_pipeline(tk, add_space_prefix: bool) -> None:
    from tokenizers import decoders, normalizers

    replace = normalizers.Replace(" ", "▁")
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if add_space_prefix else replace
    # each piece as llama.cpp's token_to_piece renders it, concatenated (the space a prefix put before a text's first
    # word is dropped by Tokenizer.decode after a BOS, as llama.cpp's detokenize: not before every answer's first word)
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
