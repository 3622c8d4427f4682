"""Tokenizer and chat template: `tokenizers` from tokenizer.json, or built from a GGUF file's own vocabulary; the
chat template (jinja2) from tokenizer_config.json / chat_template.jinja or the GGUF metadata."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from llgraph.gguf_tokenizer import TokenizerError  # noqa: F401 (its one error type, re-exported)

GGUF_KEY = "llgraph_gguf_vocabulary"  # tokenizer_config.json's mark of a tokenizer llgraph built from a GGUF
LONG_DECODE = 4096  # ids past which decode runs through decode_batch (it releases the GIL)


class Tokenizer:
    def __init__(self, tokenizer, chat_template: str | None = None, bos_token: str = "", eos_token: str = "",
                 gguf: bool = False):
        """`gguf`: built from a GGUF's vocabulary (here or at export: its tokenizer_config.json says so), so decoded
        as llama.cpp decodes (`decode`)."""
        self.tk, self.chat_template = tokenizer, chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.gguf = gguf

    # -- loading --------------------------------------------------------------------------------------------------
    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as TK

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(f"{folder} has no tokenizer.json; pass token ids, or a folder/GGUF with a tokenizer")
        config = json.loads((folder / "tokenizer_config.json").read_text()) \
            if (folder / "tokenizer_config.json").exists() else {}
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        return cls(TK.from_file(str(path)), template, _token_text(config.get("bos_token")),
                   _token_text(config.get("eos_token")), gguf=config.get(GGUF_KEY) is True)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The GGUF's own tokenizer, tokenizing as llama.cpp does (llgraph/gguf_tokenizer.py)."""
        from llgraph.gguf_source import gguf_reader, metadata
        from llgraph.gguf_tokenizer import build

        reader = gguf_reader(path)
        tk, bos, eos = build(reader)
        return cls(tk, metadata(reader, "tokenizer.chat_template"), bos, eos, gguf=True)

    @classmethod
    def find(cls, ref: str | Path | None) -> Tokenizer | None:
        """The tokenizer a model reference carries (a GGUF's vocabulary, a folder's tokenizer.json), or None."""
        if ref is None:
            return None
        ref = Path(ref)
        if ref.suffix == ".gguf" or (ref.is_dir() and (ref / "tokenizer.json").exists()):
            return cls.load(ref)
        return None

    @classmethod
    def load(cls, ref: str | Path) -> Tokenizer:
        ref = Path(ref)
        return cls.from_gguf(ref) if ref.suffix == ".gguf" else cls.from_folder(ref if ref.is_dir() else ref.parent)

    # -- use ------------------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works and encode does not (a 1M-character text held every other
        # thread, a server's event loop included, for 0.6 s): the same pipeline, the same ids. Its _fast form skips
        # the offsets: 2.4x faster on a 7 MB text, and the result's list and its freeing hold the GIL 0.1 s, not 0.6
        encode = getattr(self.tk, "encode_batch_fast", self.tk.encode_batch)
        if add_special_tokens and self.bos_token and text.startswith(self.bos_token):
            add_special_tokens = False  # a chat template's text starts with its BOS: not a second one
        return encode([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (a byte-level vocabulary's strings hold a character per byte,
        so this is >= the true figure): a text longer than n times this cannot fit in n tokens."""
        return max(map(len, self.tk.get_vocab(with_added_tokens=True)), default=1)

    def token_id(self, text: str) -> int | None:
        return self.tk.token_to_id(text) if text else None

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, control tokens skipped. A GGUF's vocabulary decodes as llama.cpp's detokenize
        (llama-cpp-python's `Llama.detokenize`): every piece as written, user-defined ones too, and the one space
        right after a leading BOS dropped (the space SentencePiece's prefix put before a text's first word); an
        answer's first word keeps its space, as llama-server streams it."""
        # a long list through decode_batch, which lets go of the GIL while it works (decode holds it: 1.6M ids held
        # the server's event loop 0.19 s, where this gives it back every few ms); the same text
        text = (self.tk.decode_batch([ids], skip_special_tokens=True)[0] if len(ids) > LONG_DECODE else
                self.tk.decode(ids, skip_special_tokens=True))
        if self.gguf and text.startswith(" ") and len(ids) and ids[0] == self.token_id(self.bos_token):
            return text[1:]
        return text

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for, whole even where they are part of a character (a byte-level vocabulary's
        string, a byte-fallback `<0xNN>` piece; else its decoded text)."""
        piece = self.tk.id_to_token(token)
        if piece is None:
            return b""
        if type(self.tk.decoder).__name__ == "ByteLevel" and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return self.tk.decode([token], skip_special_tokens=False).encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **variables) -> str:
        """The template's text for `messages` (and `tools`, OpenAI's function objects, as transformers passes them:
        a template that does not read `tools` ignores them); `variables`: more names the template may read
        (gpt-oss's `reasoning_effort`)."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; drop --chat or give a model that has one")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TokenizerError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama 3.x's date line
        # as transformers renders: JSON in the keys' own order, no HTML escapes (jinja's own tojson sorts, escapes)
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                eos_token=self.eos_token, tools=tools, **variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte as a printable character (printable bytes as themselves, the rest
    shifted past 255), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()


def _token_text(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else (value or "")
