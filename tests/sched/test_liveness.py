"""Liveness: the scheduler never hangs and never lets one request serialize the rest.

Every loop here has a step bound, so a livelock fails the test instead of hanging it.
"""

from __future__ import annotations

import itertools

import pytest

from helpers.fake_runner import FakeRunner, check_lifecycles, greedy_reference, run
from minisched.sched.req import FinishReason, ReqStatus
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig

VOCAB = 50


def make(**kw) -> tuple[Scheduler, FakeRunner]:
    cfg = SchedulerConfig(**kw)
    return Scheduler(cfg), FakeRunner(cfg.num_pages, cfg.page_size, VOCAB)


# -- 1. livelock: a request whose next step needs more than the whole pool ----------------------
def test_continuation_prompt_in_pool_smaller_than_context_terminates():
    """The reported repro: page_size 1, a 20-page pool, B = [1..5] then A = [1..20] (A continues
    B's prompt). A used to be retracted with seq_len 21 > pool and wait forever."""
    sched, runner = make(page_size=1, num_pages=20, chunk_size=8)
    sched.add_request("B", list(range(1, 6)), SamplingParams(max_new_tokens=2, ignore_eos=True))
    sched.add_request("A", list(range(1, 21)), SamplingParams(max_new_tokens=2, ignore_eos=True))
    done = run(sched, runner, max_steps=200)
    assert done["B"].output_ids == greedy_reference(list(range(1, 6)), 2, VOCAB)
    # A's KV for a second token would need 21 pages: clipped to one token, finish reason LENGTH
    assert done["A"].output_ids == greedy_reference(list(range(1, 21)), 1, VOCAB)
    assert done["A"].finish_reason is FinishReason.LENGTH
    assert sched.pool.num_free + sched.tree.total_pages == 20 and sched.tree.protected_pages == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_continuation_sweep_terminates(page_size):
    """The repro's neighbourhood: arrival gap, output lengths, chunking, reservation ratio."""
    pool = 20
    for gap, mn_b, mn_a, chunk, ratio in itertools.product(
        [0, 1, 3], [1, 2, 8, 128], [1, 2, 128], [None, 8], [0.7, 0.05]
    ):
        sched, runner = make(
            page_size=page_size,
            num_pages=pool // page_size,
            chunk_size=chunk,
            init_new_token_ratio=ratio,
            min_new_token_ratio=min(ratio, 0.05),
        )
        sched.add_request("B", list(range(1, 6)), SamplingParams(max_new_tokens=mn_b, ignore_eos=True))
        early = [r.rid for _ in range(gap) for r in sched.step(runner)]
        sched.add_request("A", list(range(1, 21)), SamplingParams(max_new_tokens=mn_a, ignore_eos=True))
        done = run(sched, runner, max_steps=400)
        assert sorted(early + list(done)) == ["A", "B"]
        check_lifecycles(sched.events)


# -- 2. max_new_tokens clipped on arrival; the reservation estimate capped --------------------------
def test_huge_max_new_tokens_is_clipped_and_does_not_block_admission():
    """A client's "no limit" (100,000 tokens) with a 512-token context and a 4,096-token pool:
    the short request behind it used to be admitted at step 481."""
    sched, runner = make(page_size=16, num_pages=256, max_context_len=512)
    big = sched.add_request("big", list(range(1, 17)), SamplingParams(max_new_tokens=100_000, ignore_eos=True))
    assert big.max_new_tokens == 512 - 16 and big.sampling.max_new_tokens == 100_000
    sched.step(runner)
    sched.add_request("short", [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    sched.step(runner)
    assert sched.reqs["short"].status is not ReqStatus.WAITING
    done = run(sched, runner, max_steps=1000)
    assert done["big"].finish_reason is FinishReason.LENGTH and done["big"].seq_len == 512


def test_max_new_tokens_clipped_to_the_pool():
    sched, _ = make(page_size=4, num_pages=8, max_context_len=1000)  # 32-token pool
    req = sched.add_request("a", list(range(1, 11)), SamplingParams(max_new_tokens=500))
    assert req.max_new_tokens == 32 + 1 - 10  # its last token is sampled, never stored
    req = sched.add_request("b", list(range(1, 11)), SamplingParams(max_new_tokens=5))
    assert req.max_new_tokens == 5


def test_reservation_estimate_is_capped_per_request():
    """One request with a huge (but admissible) max_new_tokens reserved its whole budget and kept
    admission to a trickle; SGLang caps the estimate at CLIP_MAX_NEW_TOKENS (4096)."""
    sched, runner = make(page_size=16, num_pages=512, max_context_len=100_000, chunk_size=None)  # 8,192 tokens
    sched.add_request("big", list(range(1, 17)), SamplingParams(max_new_tokens=1_000_000, ignore_eos=True))
    for i in range(3):
        sched.add_request(f"m{i}", [i + 1] * 1000, SamplingParams(max_new_tokens=100, ignore_eos=True))
    batch = sched.get_next_batch()
    assert [r.rid for r in batch.reqs] == ["big", "m0", "m1", "m2"]
    sched.process_batch_result(batch, runner.forward(batch))


# -- 3. the documented get_next_batch / process_batch_result loop reports every request -----------
def documented_loop(sched: Scheduler, runner: FakeRunner, max_steps: int) -> dict:
    """The loop in scheduler.py's docstring, verbatim in spirit (no `step()`)."""
    done: dict = {}
    for _ in range(max_steps):
        if not sched.has_work():
            return done
        batch = sched.get_next_batch()
        if batch is None:
            finished = sched.take_finished()
        else:
            finished = sched.process_batch_result(batch, runner.forward(batch))
        for r in finished:
            assert r.rid not in done, f"{r.rid} reported twice"
            done[r.rid] = r
    raise AssertionError(f"still working after {max_steps} steps")


def test_documented_loop_reports_request_finished_inside_get_next_batch():
    sched, runner = make(page_size=4, num_pages=16, max_context_len=1000)
    sched.add_request("a", list(range(1, 13)), SamplingParams(max_new_tokens=20, ignore_eos=True))
    batch = sched.get_next_batch()
    sched.process_batch_result(batch, runner.forward(batch))
    stolen = sched.pool.alloc(sched.pool.num_free)  # pages leak elsewhere: a's next page cannot exist
    batch = sched.get_next_batch()
    assert batch is None and not sched.has_work()
    (a,) = sched.take_finished()
    assert a.rid == "a" and a.finish_reason is FinishReason.LENGTH and sched.take_finished() == []
    sched.pool.free(stolen)
    sched.check_invariants()


def test_documented_loop_equals_step():
    reqs = [
        (
            f"r{i}",
            [(i * 7 + k) % VOCAB for k in range(3 + i % 9)],
            SamplingParams(max_new_tokens=1 + i % 13, ignore_eos=True),
        )
        for i in range(20)
    ]
    results = []
    for use_step in (False, True):
        sched, runner = make(page_size=2, num_pages=24, max_context_len=40, chunk_size=8)
        for rid, p, sp in reqs:
            sched.add_request(rid, p, sp)
        done = run(sched, runner, max_steps=2000) if use_step else documented_loop(sched, runner, 2000)
        results.append({rid: (r.output_ids, r.finish_reason) for rid, r in done.items()})
    assert results[0] == results[1] and len(results[0]) == 20


# -- 4. defence in depth: no batch for many steps while nothing runs -> fail, never spin ----------
def test_stalled_scheduler_fails_the_stuck_requests():
    sched, runner = make(page_size=4, num_pages=16)  # the default max_stalled_steps (32)
    stolen = sched.pool.alloc(14)  # e.g. an engine bug holds pages: nothing can be admitted
    sched.add_request("a", list(range(1, 13)), SamplingParams(max_new_tokens=2))
    sched.add_request("b", [1, 2], SamplingParams(max_new_tokens=2))
    ended = {}
    for step in range(100):
        if not sched.has_work():
            break
        for r in sched.step(runner):
            ended[r.rid] = (r, step)
    assert not sched.has_work(), "the scheduler spins on requests it can never run"
    assert set(ended) == {"a", "b"} and all(step == 31 for _, step in ended.values())
    for r, _ in ended.values():
        assert r.finish_reason is FinishReason.ERROR and "no batch" in r.error and r.status is ReqStatus.FINISHED
    sched.pool.free(stolen)
    sched.check_invariants()
    check_lifecycles(sched.events)
    assert sched.pool.num_free + sched.tree.total_pages == 16


def test_stall_counter_resets_when_a_batch_forms():
    sched, runner = make(page_size=4, num_pages=16, max_stalled_steps=3)
    stolen = sched.pool.alloc(16)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=2))
    assert sched.step(runner) == [] and sched.step(runner) == []
    sched.pool.free(stolen)  # the pages come back before the bound: a runs normally
    done = run(sched, runner, max_steps=20)
    assert done["a"].finish_reason is FinishReason.MAX_NEW_TOKENS
