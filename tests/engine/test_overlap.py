"""Overlap scheduling on the tiny random-weights model: the same outputs with and without it.

Each case runs one workload on two engines (overlap off / on) and compares every request's
tokens, finish reason and text -- greedy and seeded sampling, stop tokens and strings,
max_new_tokens, chunked prefill with radix hits, retraction under a tiny pool, aborts -- then
checks the scheduler's invariants and that no page leaked. The fault tests
(test_engine_faults.py) run with overlap off and on themselves.
"""

from __future__ import annotations

import pytest

from helpers.engines import prompts, tiny_model
from helpers.engines import reference as _reference
from minisched.engine import Engine
from minisched.model.llama import LlamaModel
from minisched.model.tokenizer import MiniTokenizer
from minisched.sched.sampling_params import SamplingParams

NEW = 8


def reference(model, prompt, n=NEW):
    return _reference(model, prompt, n)


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return tiny_model()


def make(model: LlamaModel, overlap: bool, **kw) -> Engine:
    return Engine(model, tokenizer=MiniTokenizer.byte_level(model.cfg.vocab_size), overlap=overlap, **kw)


def assert_clean(engine: Engine) -> None:
    """Nothing live, invariants hold, every page is back once the radix cache is flushed."""
    sched = engine.scheduler
    assert sched.snapshot().live == 0 and not sched.has_work()
    sched.check_invariants()
    sched.flush_cache()
    assert sched.snapshot().pages_free == sched.config.num_pages


def both(model, ps, sampling, **kw):
    """Run the workload without and with overlap; the outputs must be the same."""
    runs = []
    for overlap in (False, True):
        engine = make(model, overlap, **kw)
        outs = engine.generate(ps, sampling)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        assert_clean(engine)
        runs.append((engine, [(o.token_ids, o.finish_reason, o.text, o.num_retractions > 0) for o in outs]))
    (plain, a), (over, b) = runs
    assert [x[:3] for x in a] == [x[:3] for x in b]
    assert over.overlap and over._overlap.forward_times, "the overlap engine did not use its worker"
    return plain, over, b


@pytest.mark.parametrize("page_size, chunk_size", [(1, None), (4, 7), (16, 512)])
def test_greedy_same_as_without_overlap_and_as_dense(tiny, page_size, chunk_size):
    ps = prompts([1, 5, 16, 17, 40])
    _, _, outs = both(
        tiny,
        ps,
        SamplingParams(max_new_tokens=8, ignore_eos=True),
        page_size=page_size,
        chunk_size=chunk_size,
        check=True,
    )
    assert [o[0] for o in outs] == [reference(tiny, p) for p in ps]


def test_seeded_sampling_mixed_lengths(tiny):
    ps = prompts([5, 8, 13, 2], seed=8)
    sp = [
        SamplingParams(temperature=30.0, top_k=50, top_p=0.9, seed=100 + i, max_new_tokens=n, ignore_eos=True)
        for i, n in enumerate([1, 4, 9, 6])
    ]
    both(tiny, ps, sp, page_size=4)


def test_stop_tokens_strings_and_limits(tiny):
    """Stops found one step late: the extra token of the step already launched is dropped."""
    ps = prompts([9, 4, 12, 6, 30], seed=7)
    refs = [reference(tiny, p, 8) for p in ps]
    tok = MiniTokenizer.byte_level(tiny.cfg.vocab_size)
    stop_str = tok.decode(refs[1][3:5]) or "zz"
    sp = [
        SamplingParams(max_new_tokens=8, stop_token_ids=(refs[0][2],)),  # stop token at the third token
        SamplingParams(max_new_tokens=8, stop=(stop_str,), ignore_eos=True),
        SamplingParams(max_new_tokens=1, ignore_eos=True),
        SamplingParams(max_new_tokens=0),  # prefill only
        SamplingParams(max_new_tokens=8, stop_token_ids=(refs[4][0],)),
    ]  # stops at its first token
    plain, over, outs = both(tiny, ps, sp, page_size=4, max_context_len=36)
    reasons = [o[1] for o in outs]
    assert reasons[0] == "stop_token" and outs[0][0] == refs[0][: refs[0].index(refs[0][2]) + 1]
    assert reasons[2] == "max_new_tokens" and len(outs[2][0]) == 1
    assert reasons[3] == "length" and outs[3][0] == []
    assert reasons[4] == "stop_token" and len(outs[4][0]) == 1
    assert over.runner.num_forwards >= plain.runner.num_forwards  # overlap may compute a dropped step


def test_chunked_prefill_radix_hits_and_mixed(tiny):
    system = prompts([37], seed=1)[0]
    ps = [system + p for p in prompts([3, 9, 20, 1, 14], seed=2)]
    for mixed in (False, True):
        plain, over, _ = both(
            tiny,
            ps,
            SamplingParams(max_new_tokens=6, ignore_eos=True),
            page_size=4,
            chunk_size=16,
            enable_mixed_chunk=mixed,
            policy="lpm",
        )
        assert sum(s.cache_hit_tokens for s in over.scheduler.records().step_stats) > 0


def test_retraction_under_kv_pressure(tiny):
    ps = prompts([5, 17, 1, 10, 3], seed=4)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain, over, outs = both(
        tiny, ps, sp, page_size=2, num_pages=24, init_new_token_ratio=0.01, min_new_token_ratio=0.0
    )
    assert [o[0] for o in outs] == [reference(tiny, p, 12) for p in ps]
    assert sum(s.num_retracted for s in over.scheduler.records().step_stats) >= 1


@pytest.mark.parametrize("when", [1, 2, 4])
def test_abort_while_a_step_is_launched(tiny, when):
    ps = prompts([6, 7, 8], seed=9)
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    engine = make(tiny, True, page_size=4)
    reqs = [engine.add_request(p, sp) for p in ps]
    for _ in range(when):
        engine.step()
    assert engine.abort(reqs[1].rid)
    engine.scheduler.check_invariants()
    done = []
    while engine.has_work():
        done += engine.step()
        engine.scheduler.check_invariants()
    assert sorted(r.rid for r in done) == sorted([reqs[0].rid, reqs[2].rid])
    assert reqs[1].finish_reason.value == "abort" and not reqs[1].pending_ids
    assert reqs[1].output_ids == reference(tiny, ps[1], 10)[: len(reqs[1].output_ids)]
    for r, p in ((reqs[0], ps[0]), (reqs[2], ps[2])):
        assert r.output_ids == reference(tiny, p, 10)
    assert_clean(engine)


def test_stream_with_overlap(tiny):
    ps = prompts([4, 12], seed=6)
    engine = make(tiny, True)
    chunks = list(engine.stream(ps, SamplingParams(max_new_tokens=8, ignore_eos=True)))
    for i, p in enumerate(ps):
        mine = [c for c in chunks if c.index == i]
        assert sum((c.token_ids for c in mine), []) == reference(tiny, p)
        assert all(t >= 0 for c in mine for t in c.token_ids)  # placeholders never leak out
    assert_clean(engine)


def test_overlap_argument_is_checked(tiny):
    with pytest.raises(ValueError, match="overlap"):
        make(tiny, "yes")
    assert make(tiny, None).overlap is False  # None: the device's default (off on CPU)
