"""Incremental detokenization: deltas join to the full text, never split a UTF-8 character, and
never send any part of a stop string (byte tokenizer: one token per byte, the hardest case)."""

from __future__ import annotations

import pytest

from minisched.model.detokenize import IncrementalDetokenizer
from minisched.model.tokenizer import MiniTokenizer

TOK = MiniTokenizer.byte_level(512)
TEXT = "héllo wörld 😀 ok"


def test_deltas_join_to_the_text_and_never_split_a_character():
    d = IncrementalDetokenizer(TOK)
    deltas = [d.add([t]) for t in TOK.encode(TEXT)]
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) + d.finish("max_new_tokens") == TEXT
    assert "".join(deltas) == TEXT  # nothing was held back without stop strings


@pytest.mark.parametrize("stop", ["wör", "ö", "😀 o", "k", "lo w"])
def test_stop_string_is_held_back_and_cut(stop):
    ids = TOK.encode(TEXT)
    full = TOK.decode(ids)
    end = full.find(stop) + len(stop)  # the engine stops at the token that completes the stop string
    n = len(TOK.encode(full[:end]))
    d = IncrementalDetokenizer(TOK, [stop, "never-seen"])
    sent = "".join(d.add([t]) for t in ids[: n - 1])
    assert full.startswith(sent) and len(sent) <= full.find(stop)  # nothing of the stop string went out
    final = sent + d.finish("stop_str", ids[n - 1 : n])
    assert final == full[: full.find(stop)]


def test_finish_without_stop_reason_keeps_the_text():
    d = IncrementalDetokenizer(TOK, ["ok"])
    ids = TOK.encode(TEXT)
    sent = "".join(d.add([t]) for t in ids[:-1])
    assert sent + d.finish("max_new_tokens", ids[-1:]) == TEXT
