"""Fidelity to SGLang: in-batch prefix deferral, the decode gap under arrivals, mixed
batches within the chunk budget, new_token_ratio re-estimated after a retraction,
max_new_tokens = 0. Counted in tokens and steps with the fake runner."""

from __future__ import annotations

import random

import pytest

from helpers.fake_runner import FakeRunner, check_lifecycles, greedy_reference, run
from minisched.sched.batch import ForwardMode
from minisched.sched.req import FinishReason, ReqStatus
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig

VOCAB = 50


def make(**kw) -> tuple[Scheduler, FakeRunner]:
    cfg = SchedulerConfig(**kw)
    return Scheduler(cfg), FakeRunner(cfg.num_pages, cfg.page_size, VOCAB)


def prefill_tokens(sched: Scheduler) -> int:
    return sum(s.num_prefill_tokens for s in sched.step_stats)


# -- in-batch prefix deferral ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "n, shared, own, chunk, want", [(64, 512, 64, 8192, 512 + 64 * 64), (16, 1024, 32, None, 1024 + 16 * 32)]
)
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_in_batch_prefix_deferral(n, shared, own, chunk, want, policy):
    """The measured numbers: 11,776 -> 4,608 and 16,896 -> 1,536 prefill tokens."""
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(shared)]
    reqs = [(f"r{i}", system + [rng.randrange(VOCAB) for _ in range(own)]) for i in range(n)]
    results = {}
    for defer in (None, 32):
        sched, runner = make(
            page_size=16,
            num_pages=8192,
            max_context_len=4096,
            chunk_size=chunk,
            max_prefill_tokens=32768,
            policy=policy,
            in_batch_prefix_defer_tokens=defer,
        )
        for rid, p in reqs:
            sched.add_request(rid, p, SamplingParams(max_new_tokens=3, ignore_eos=True))
        done = run(sched, runner)
        results[defer] = prefill_tokens(sched)
        assert {rid: r.output_ids for rid, r in done.items()} == {rid: greedy_reference(p, 3, VOCAB) for rid, p in reqs}
    assert results[32] == want and results[None] > 2 * want


def test_deferral_waits_for_a_chunked_sharer_and_skips_unrelated_requests():
    sched, runner = make(page_size=4, num_pages=512, chunk_size=64, max_prefill_tokens=64)
    shared = list(range(1, 41)) * 4  # 160 tokens: three chunks
    sched.add_request("first", shared + [1], SamplingParams(max_new_tokens=2))
    sched.add_request("second", shared + [2], SamplingParams(max_new_tokens=2))
    sched.add_request("other", [7] * 10, SamplingParams(max_new_tokens=2))
    batches = []
    while sched.has_work():
        batch = sched.get_next_batch()
        batches.append({r.rid: e for r, e in zip(batch.reqs, batch.extend_lens)})
        sched.process_batch_result(batch, runner.forward(batch))
        sched.check_invariants()
    # first's chunks: 64, 64, 33; in the last round "second" (128 cached, 32 more shared with
    # first) is deferred and "other" takes the rest of the chunk; then "second" hits 160 tokens
    assert batches[:3] == [{"first": 64}, {"first": 64}, {"first": 33, "other": 10}]
    assert batches[3] == {"second": 1}


# -- decode under sustained arrivals: prefill first (the default) or alternating rounds ----------------------------
@pytest.mark.parametrize("rounds", [None, 1])
def test_decode_gap_under_sustained_arrivals(rounds):
    """One arrival per step. Prefill first (the default, SGLang's and the founding design's rule: alternating
    rounds showed no net win, benchmarks/RESULTS.md "Rules: minisched's vs SGLang's") keeps a running request
    waiting as long as arrivals are admitted; `max_prefill_rounds_between_decodes=1` bounds its gap at 2 steps."""
    kw = {} if rounds is None else {"max_prefill_rounds_between_decodes": rounds}
    sched, runner = make(page_size=16, num_pages=4096, **kw)
    sched.add_request("d", [1, 2, 3], SamplingParams(max_new_tokens=60, ignore_eos=True))
    token_steps, step = [], 0
    d = sched.reqs["d"]
    for i in range(80):
        sched.add_request(f"a{i}", [(i + k) % VOCAB for k in range(200)], SamplingParams(max_new_tokens=2))
        n = len(d.output_ids)
        sched.step(runner)
        step += 1
        if len(d.output_ids) > n:
            token_steps.append(step)
        if d.status is ReqStatus.FINISHED:
            break
    gaps = [b - a for a, b in zip(token_steps, token_steps[1:])]
    if rounds is None:
        assert sched.config.max_prefill_rounds_between_decodes is None
        # its first token with its prefill; the next only when the running-request cap (64) stops admissions
        assert token_steps[:2] == [1, 64]
    else:
        assert len(token_steps) >= 30 and max(gaps) <= 2
    run(sched, runner)
    assert len(d.output_ids) == 60


def test_mixed_batch_counts_decode_rows_against_the_chunk_budget():
    sched, runner = make(page_size=4, num_pages=1024, chunk_size=32, max_prefill_tokens=64, enable_mixed_chunk=True)
    for i in range(10):
        sched.add_request(f"d{i}", [i + 1, 2, 3], SamplingParams(max_new_tokens=30, ignore_eos=True))
    sched.step(runner)
    sched.add_request("long", list(range(1, 200)), SamplingParams(max_new_tokens=2))
    mixed = 0
    while sched.has_work():
        batch = sched.get_next_batch()
        if batch.mode is ForwardMode.MIXED:
            mixed += 1
            assert batch.num_tokens <= 32, f"mixed batch of {batch.num_tokens} tokens > chunk 32"
        sched.process_batch_result(batch, runner.forward(batch))
        sched.check_invariants()
    assert mixed >= 5


# -- new_token_ratio after a retraction --------------------------------------------------------------
def test_ratio_reestimated_after_retraction():
    sched, runner = make(page_size=1, num_pages=200, chunk_size=None, max_prefill_rounds_between_decodes=None)
    for rid, n, mn in [("a", 5, 40), ("b", 9, 100), ("c", 6, 60)]:
        sched.add_request(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=mn, ignore_eos=True))
    for _ in range(4):
        sched.step(runner)
    stolen = sched.pool.alloc(sched.pool.num_free - 1)
    batch = sched.get_next_batch()
    assert [r.rid for r in sched.waiting] == ["b"]  # equal outputs: the longest prompt goes
    # SGLang: min(1, (decoded + 20 * batch) / sum(max_new)) over a and c, each 4 tokens decoded
    assert sched.new_token_ratio == pytest.approx((4 + 4 + 20 * 2) / (40 + 60))
    assert sched.step_stats[-1].new_token_ratio == sched.new_token_ratio
    sched.process_batch_result(batch, runner.forward(batch))
    sched.pool.free(stolen)
    done = run(sched, runner)
    assert done["b"].output_ids == greedy_reference(list(range(1, 10)), 100, VOCAB)


# -- max_new_tokens = 0 -----------------------------------------------------------------------------
def test_max_new_tokens_zero_prefills_into_the_cache():
    sched, runner = make(page_size=4, num_pages=64, chunk_size=8)
    prompt = list(range(1, 22))  # 21 tokens: 5 full pages, three chunks
    req = sched.add_request("warm", prompt, SamplingParams(max_new_tokens=0))
    done = run(sched, runner)
    assert done["warm"] is req and req.output_ids == [] and req.finish_reason is FinishReason.LENGTH
    assert req.first_token_time is None and req.status is ReqStatus.FINISHED
    assert len(sched.tree.match_prefix(prompt)[0]) == 5  # its full pages stay cached
    b = sched.add_request("b", prompt + [9], SamplingParams(max_new_tokens=3))
    run(sched, runner)
    assert b.cache_hit_tokens == 20 and b.output_ids == greedy_reference(prompt + [9], 3, VOCAB)
    check_lifecycles(sched.events)
    assert sched.pool.num_free + sched.tree.total_pages == 64
