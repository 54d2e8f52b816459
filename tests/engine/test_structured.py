"""Structured outputs through the engine (tiny random model, byte-level vocabulary): whatever the
weights, the output matches its grammar -- with overlap scheduling, chunked prefill, the radix cache
and retraction -- and a grammar that fails to compile ends its request with an error, not with
unconstrained text."""

from __future__ import annotations

import json
import re

import pytest

from helpers.engines import byte_engine, prompts, tiny_model
from minisched.sched.sampling_params import Grammar, SamplingParams

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["color", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_follow_their_grammars(tiny, overlap):
    engine = byte_engine(tiny, overlap=overlap, page_size=4, chunk_size=8)
    system = prompts([12], seed=3)[0]
    ps = [system + p for p in prompts([3, 9, 20], seed=4)]
    regex = SamplingParams(max_new_tokens=40, grammar=Grammar("regex", "(cat|dog)-[0-9]{2}"))
    schema = SamplingParams(max_new_tokens=80, grammar=Grammar("json_schema", json.dumps(SCHEMA)))
    plain = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outs = engine.generate(ps + ps[:1], [regex, schema, plain, schema])
    assert re.fullmatch(r"(cat|dog)-[0-9]{2}", outs[0].text) and outs[0].finish_reason == "stop_token"
    for o in (outs[1], outs[3]):
        obj = json.loads(o.text)
        assert set(obj) == {"color", "n"} and obj["color"] in ("red", "green", "blue") and 0 <= obj["n"] <= 99
        assert o.finish_reason == "stop_token"
    assert outs[2].error is None and len(outs[2].token_ids) == 8  # unconstrained neighbours are untouched
    engine.scheduler.check_invariants()


def test_grammar_survives_retraction(tiny):
    """A tiny pool retracts requests mid-output; the matcher keeps what they generated."""
    engine = byte_engine(tiny, page_size=2, num_pages=30, init_new_token_ratio=0.01, min_new_token_ratio=0.0)
    sp = SamplingParams(max_new_tokens=40, grammar=Grammar("regex", "[a-z]{10,30}"))
    outs = engine.generate(prompts([5, 9, 7, 11], seed=5), sp)
    assert sum(s.num_retracted for s in engine.scheduler.records().step_stats) >= 1
    assert all(re.fullmatch("[a-z]{10,30}", o.text) for o in outs), [o.text for o in outs]


def test_a_grammar_that_fails_to_compile_is_an_error(tiny):
    engine = byte_engine(tiny)
    bad = SamplingParams(max_new_tokens=5, grammar=Grammar("regex", "[a-"))
    outs = engine.generate(prompts([4, 4], seed=6), [bad, SamplingParams(max_new_tokens=3, ignore_eos=True)])
    assert outs[0].finish_reason == "error" and "grammar" in outs[0].error and outs[0].token_ids == []
    assert outs[1].error is None and len(outs[1].token_ids) == 3
    engine.scheduler.check_invariants()
