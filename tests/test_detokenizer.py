"""Incremental detokenisation: no partial UTF-8, no text a stop string later removes."""

from __future__ import annotations

import pytest

from tokenloom.core.detokenizer import IncrementalDetokenizer
from tokenloom.core.tokenizer import Tokenizer

from conftest import _byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(_byte_tokenizer(), bos_token_id=None, eos_token_ids=[256], chat_template=None)


def _feed(tok, text, stop=None):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], stop)
    deltas = []
    for t in ids:
        stopped = d.add(t)
        deltas.append(d.take_delta(final=False))
        if stopped:
            break
    deltas.append(d.take_delta(final=True))
    return d, deltas


def test_multibyte_characters_are_never_split(tok):
    text = "héllo wörld ✓ 日本語 🙂!"
    assert len(tok.encode(text)) > len(text)  # really one token per byte
    d, deltas = _feed(tok, text)
    assert "".join(deltas) == text == d.text
    for delta in deltas:
        assert "\ufffd" not in delta
        delta.encode("utf-8")  # each delta is whole characters


def test_stop_string_is_cut_and_never_emitted(tok):
    d, deltas = _feed(tok, "one two STOP three", stop=["STOP", "xyzzy"])
    assert d.stopped and d.text == "one two "
    assert "".join(deltas) == "one two "
    assert all("S" not in delta for delta in deltas)


def test_partial_stop_prefix_is_released_when_it_cannot_match(tok):
    d, deltas = _feed(tok, "a STOx STOP", stop=["STOP"])
    assert "".join(deltas) == "a STOx " == d.text
    emitted = ""
    for delta in deltas:  # what was emitted is always a prefix of the final text
        emitted += delta
        assert d.text.startswith(emitted)


def test_stop_string_across_tokens_in_multibyte_text(tok):
    d, deltas = _feed(tok, "naïve→end", stop=["→"])
    assert "".join(deltas) == "naïve" and d.stopped


def test_token_bytes_spell_out_the_text_byte_for_byte(tok):
    text = "Ünïcödé — 東京 🚀 plain <|im_end|> tail"
    ids = tok.encode(text, parse_special_tokens=True)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert any(len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80 for i in ids)  # parts of a character


@pytest.mark.slow
def test_token_bytes_of_the_embedded_model():
    from tokenloom.core.loader.gguf_file import read_metadata
    from tokenloom.core.loader.gguf_reader import GGUFFile
    from tokenloom.core.loader.resolve import resolve_model_path

    tok = Tokenizer.from_gguf_metadata(read_metadata(GGUFFile(resolve_model_path("smollm2-135m"))))
    text = "The capital of France is Paris. Ünïcödé — 東京 🚀\n\tindented"
    assert b"".join(tok.token_bytes(i) for i in tok.encode(text)) == text.encode()
