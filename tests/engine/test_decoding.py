"""Incremental detokenization (runtime/engine/decoding.py): on SmolLM2's byte-level tokenizer, over text with
multi-byte characters (CJK, emoji split across tokens, accents) and stop strings, the streamed pieces concatenate to
the whole text decoded at once, a stop string ends the text exactly where the whole decode would cut it, and each step
decodes a window of a few tokens — the same at token 4,000 as at token 4 (before: the whole output every step)."""

import pytest

TEXT = ("Hello, wörld! 東京は大きい都市です。 🤖🦙 emoji; café, naïve — done.\n" * 3) + "The END. after"


@pytest.fixture(scope="module")
def tokenizer(smollm2_export):
    from llgraph.runtime import open_runner

    return open_runner(str(smollm2_export("ort", quantized=True)), "ort", max_seq_len=64).tokenizer


@pytest.mark.parametrize("stop", [(), ("END",), ("東京", "never")])
def test_pieces_concatenate_to_the_whole_decode_and_stop_where_it_cuts(tokenizer, stop):
    from llgraph.runtime.engine.decoding import Decoding

    ids = tokenizer.encode(TEXT, False)
    windows = []

    def text_of(tokens):
        windows.append(len(tokens))
        return tokenizer.decode(tokens)

    d = Decoding(text_of, stop)
    pieces = []
    for i, token in enumerate(ids):  # the engine's own rule ends it at its length
        reason = d.push(token, "length" if i == len(ids) - 1 else None)
        pieces.append(d.new_text())
        if reason:
            break
    whole = tokenizer.decode(d.tokens)
    want = whole[:min(whole.index(s) for s in stop if s in whole)] if any(s in whole for s in stop) else whole
    print(f"stop {stop}: {len(d.tokens)} tokens, widest window {max(windows[:-1])} tokens, reason {d.finish_reason}")
    assert "".join(pieces) == d.text() == want
    assert d.finish_reason == ("stop" if any(s in TEXT for s in stop) else "length")
    assert not any("\ufffd" in p for p in pieces)
    assert max(windows[:-1]) <= 8  # the last call decodes the whole, once


def test_a_step_decodes_a_window_however_long_the_output(tokenizer):
    from llgraph.runtime.engine.decoding import Decoding

    ids = tokenizer.encode("word " * 4000, False)
    decoded = []
    d = Decoding(lambda tokens: decoded.append(len(tokens)) or tokenizer.decode(tokens))
    for token in ids:
        d.push(token)
        d.new_text()
    print(f"{len(ids)} tokens: {sum(decoded):,} tokens decoded in all ({sum(decoded) / len(ids):.1f} a step)")
    assert sum(decoded) <= 4 * len(ids)  # O(n): the whole output each step would be ~n^2 / 2
