"""Scheduler lifecycle scenarios on the CPU with a deterministic fake model runner.

Every test checks the scheduler's invariants after every step (`fake_runner.run`) and
compares outputs with an unconstrained greedy reference.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from helpers.fake_runner import FakeRunner, check_lifecycles, greedy_reference, run
from minisched.sched.batch import ForwardMode
from minisched.sched.events import transitions
from minisched.sched.req import FinishReason, ReqStatus
from minisched.sched.sampling_params import InvalidRequest, SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig

S = ReqStatus
VOCAB = 50


def make(**kw) -> tuple[Scheduler, FakeRunner]:
    cfg = SchedulerConfig(
        **{"page_size": 4, "num_pages": 256, "max_context_len": 512, "chunk_size": 64, "max_prefill_tokens": 256, **kw}
    )
    return Scheduler(cfg), FakeRunner(cfg.num_pages, cfg.page_size, VOCAB)


def workload(n: int, seed: int = 0, max_prompt: int = 40, max_new: int = 20):
    rng = random.Random(seed)
    bases = [[rng.randrange(VOCAB) for _ in range(30)] for _ in range(3)]
    out = []
    for i in range(n):
        prefix = rng.choice(bases)[: rng.randint(0, 30)]
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))]
        out.append((f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randint(1, max_new), ignore_eos=True)))
    return out


def submit_all(sched, reqs):
    for rid, prompt, sp in reqs:
        sched.add_request(rid, prompt, sp)


def expect(reqs, max_len=512):
    return {
        rid: greedy_reference(p, sp.max_new_tokens, VOCAB, () if sp.ignore_eos else sp.stop_token_ids, max_len)
        for rid, p, sp in reqs
    }


def outputs(done):
    return {rid: r.output_ids for rid, r in done.items()}


def test_one_request():
    sched, runner = make()
    req = sched.add_request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=5))
    done = run(sched, runner)
    assert done["a"] is req and req.output_ids == greedy_reference([1, 2, 3, 4, 5, 6], 5, VOCAB)
    assert req.finish_reason is FinishReason.MAX_NEW_TOKENS and req.status is S.FINISHED
    assert transitions(sched.events, "a") == [
        (None, S.WAITING),
        (S.WAITING, S.PREFILLING),
        (S.PREFILLING, S.RUNNING),
        (S.RUNNING, S.FINISHED),
    ]
    assert req.arrival_time <= req.first_scheduled_time <= req.first_token_time <= req.finish_time
    assert [s.mode for s in sched.step_stats] == ["prefill"] + ["decode"] * 4
    assert not sched.has_work() and sched.get_next_batch() is None
    assert sched.tree.total_pages + sched.pool.num_free == 256  # KV went into the radix cache


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "lof"])
def test_many_requests_every_policy(policy, page_size):
    reqs = workload(30, seed=page_size)
    sched, runner = make(page_size=page_size, num_pages=4096 // page_size, policy=policy, max_running_requests=8)
    submit_all(sched, reqs)
    assert outputs(run(sched, runner)) == expect(reqs)
    check_lifecycles(sched.events)
    assert max(s.num_running for s in sched.step_stats) <= 8


def test_chunked_prompt():
    sched, runner = make(chunk_size=16, page_size=4)
    prompt = list(range(1, 51))  # 50 tokens: chunks of 16, 16, 16, 2
    sched.add_request("long", prompt, SamplingParams(max_new_tokens=3))
    batches = []
    while sched.has_work():
        batch = sched.get_next_batch()
        batches.append((batch.mode, batch.prefix_lens[0], batch.extend_lens[0], batch.sample_mask()[0]))
        sched.process_batch_result(batch, runner.forward(batch))
        sched.check_invariants()
        if sched.chunked_req is not None:
            assert sched.chunked_req.status is S.PREFILLING and sched.chunked_req.kv_len % 4 == 0
    P = ForwardMode.PREFILL
    assert batches[:4] == [(P, 0, 16, False), (P, 16, 16, False), (P, 32, 16, False), (P, 48, 2, True)]
    assert [m for m, *_ in batches[4:]] == [ForwardMode.DECODE] * 2


def test_chunked_request_goes_first_and_others_wait():
    sched, runner = make(chunk_size=8, max_prefill_tokens=8)
    sched.add_request("long", list(range(1, 30)), SamplingParams(max_new_tokens=2))
    sched.add_request("short", [5, 6, 7], SamplingParams(max_new_tokens=2))
    order = []
    while sched.has_work():
        batch = sched.get_next_batch()
        order.append([r.rid for r in batch.reqs])
        sched.process_batch_result(batch, runner.forward(batch))
        sched.check_invariants()
    assert order[:4] == [["long"]] * 3 + [["long", "short"]]  # 29 = 8 + 8 + 8 + 5; short fills the rest


def test_prefix_hit_after_finish():
    sched, runner = make(page_size=4)
    prompt = list(range(1, 21))  # 20 tokens = 5 pages
    a = sched.add_request("a", prompt, SamplingParams(max_new_tokens=3))
    run(sched, runner)
    b = sched.add_request("b", prompt + [7, 7], SamplingParams(max_new_tokens=3))
    batch = sched.get_next_batch()
    assert batch.prefix_lens == [20] and batch.extend_lens == [2]
    cached = sched.tree.match_prefix(prompt)[0]
    assert b.page_ids[:5] == cached and b.cache_hit_tokens == 20
    assert sched.step_stats[-1].cache_hit_tokens == 20
    sched.process_batch_result(batch, runner.forward(batch))
    run(sched, runner)
    assert b.output_ids == greedy_reference(prompt + [7, 7], 3, VOCAB) and a.status is S.FINISHED


def test_prefix_shared_between_live_requests():
    sched, runner = make(page_size=4, max_prefill_tokens=16, chunk_size=None)
    prompt = list(range(1, 17))
    sched.add_request("a", prompt + [1], SamplingParams(max_new_tokens=8))
    sched.add_request("b", prompt + [2], SamplingParams(max_new_tokens=8))
    sched.step(runner)  # only a fits the 16-token input budget
    sched.check_invariants()
    sched.step(runner)  # b reuses a's 4 prompt pages while a is still running
    a, b = sched.reqs["a"], sched.reqs["b"]
    assert b.cache_hit_tokens == 16 and a.page_ids[:4] == b.page_ids[:4]
    run(sched, runner)
    assert b.output_ids == greedy_reference(prompt + [2], 8, VOCAB)


def _admission_order(policy: str) -> list[str]:
    sched, runner = make(policy=policy, max_prefill_tokens=8, chunk_size=None)
    hot = list(range(1, 25))
    sched.add_request("warm", hot, SamplingParams(max_new_tokens=1))
    run(sched, runner)
    sched.add_request("cold", [40] * 20, SamplingParams(max_new_tokens=1))
    sched.add_request("hot", hot + [3], SamplingParams(max_new_tokens=1))
    run(sched, runner)
    return [e.rid for e in sched.events if e.dst is S.PREFILLING and e.rid != "warm"]


def test_lpm_order_vs_fcfs():
    assert _admission_order("fcfs") == ["cold", "hot"]
    assert _admission_order("lpm") == ["hot", "cold"]


@pytest.mark.parametrize("aging_rounds, bounded", [(5, True), (10_000, False)])
def test_lpm_aging_bounds_wait(aging_rounds, bounded):
    sched, runner = make(
        policy="lpm",
        max_prefill_tokens=4,
        chunk_size=None,
        aging_rounds=aging_rounds,
        max_running_requests=1000,
        num_pages=2048,
    )
    hot = list(range(1, 33))
    sched.add_request("warm", hot, SamplingParams(max_new_tokens=1))
    run(sched, runner)
    sched.add_request("cold", [45] * 30, SamplingParams(max_new_tokens=1))
    admitted_at = None
    for i in range(40):  # a hot request arrives every step; one prefill fits per step
        sched.add_request(f"hot{i}", hot + [i % VOCAB], SamplingParams(max_new_tokens=1))
        sched.step(runner)
        sched.check_invariants()
        if admitted_at is None and "cold" not in [r.rid for r in sched.waiting]:
            admitted_at = i
    assert (admitted_at is not None and admitted_at <= aging_rounds + 1) if bounded else admitted_at is None


def test_retraction_victim_order_and_ratio():
    sched, runner = make(page_size=1, num_pages=100, chunk_size=None, retract_decode_steps=1)
    for rid, n in [("short", 4), ("long", 9), ("mid", 6)]:
        sched.add_request(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=30, ignore_eos=True))
    sched.step(runner)
    assert len(sched.running) == 3
    stolen = sched.pool.alloc(sched.pool.num_free - 1)  # squeeze: one page left, three needed
    batch = sched.get_next_batch()
    # equal decoded tokens, so the longest prompt goes first; its KV, now evictable, makes room
    assert [r.rid for r in sched.waiting] == ["long"] and [r.rid for r in batch.reqs] == ["short", "mid"]
    # re-estimated as SGLang: (decoded + steps * batch) / sum(max_new) over the two that stay
    assert sched.new_token_ratio == pytest.approx((1 + 1 + 1 * 2) / 60)
    assert sched.step_stats[-1].num_retracted == 1
    assert transitions(sched.events, "long")[-2:] == [(S.RUNNING, S.RETRACTED), (S.RETRACTED, S.WAITING)]
    sched.process_batch_result(batch, runner.forward(batch))
    sched.pool.free(stolen)
    done = run(sched, runner)
    assert done["long"].output_ids == greedy_reference(list(range(1, 10)), 30, VOCAB)
    assert done["long"].num_retractions == 1


def test_ratio_decays_to_floor():
    sched, runner = make(new_token_ratio_decay_steps=10)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=30, ignore_eos=True))
    run(sched, runner)
    ratios = [s.new_token_ratio for s in sched.step_stats if s.mode == "decode"]
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] == pytest.approx(0.098)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mixed", [False, True])
def test_determinism_under_pressure(page_size, mixed):
    reqs = workload(24, seed=7, max_prompt=60, max_new=40)
    ample, r1 = make(page_size=page_size, num_pages=8192 // page_size, chunk_size=None, max_prefill_tokens=4096)
    submit_all(ample, reqs)
    ref = outputs(run(ample, r1))
    assert ref == expect(reqs)
    tiny_pages = 2 * (-(-(90 + 40) // page_size))  # room for about two requests
    tight, r2 = make(
        page_size=page_size,
        num_pages=tiny_pages,
        chunk_size=2 * page_size if page_size > 1 else 8,
        max_prefill_tokens=32,
        enable_mixed_chunk=mixed,
    )
    submit_all(tight, reqs)
    assert outputs(run(tight, r2)) == ref
    if not mixed:  # (mixed mode skips the ride-along instead of retracting)
        assert sum(s.num_retracted for s in tight.step_stats) > 0
    assert sum(1 for e in tight.events if e.dst is S.PREFILLING) >= len(reqs)
    assert any(s.mode == "prefill" and s.num_prefill_tokens == tight.config.chunk_size for s in tight.step_stats)
    if mixed:
        assert any(s.mode == "mixed" for s in tight.step_stats)
    check_lifecycles(tight.events)


def test_radix_disabled():
    reqs = workload(12, seed=3)
    sched, runner = make(enable_radix_cache=False)
    submit_all(sched, reqs)
    assert outputs(run(sched, runner)) == expect(reqs)
    assert sched.tree.total_pages == 0 and sched.pool.num_free == 256
    assert all(s.cache_hit_tokens == 0 for s in sched.step_stats)


def test_prefill_guard_lets_decode_run():
    sched, runner = make(max_prefill_tokens=8, chunk_size=8, max_prefill_rounds_between_decodes=2)
    sched.add_request("d", [1, 2], SamplingParams(max_new_tokens=20, ignore_eos=True))
    sched.step(runner)
    for i in range(10):
        sched.add_request(f"p{i}", list(range(1, 30)), SamplingParams(max_new_tokens=1))
    run(sched, runner)
    d_end = next(e.step for e in sched.events if e.rid == "d" and e.dst is S.FINISHED)
    modes = "".join("p" if s.mode == "prefill" else "d" for s in sched.step_stats[1:d_end])
    assert "p" in modes and max(len(x) for x in modes.split("d")) <= 2


def test_finish_reasons():
    sched, runner = make(max_context_len=12)
    prompt = [1, 2, 3]
    ref = greedy_reference(prompt, 50, VOCAB)
    stop = ref[3]
    sched.add_request("stop", prompt, SamplingParams(max_new_tokens=50, stop_token_ids=(stop,)))
    sched.add_request("ignore", prompt, SamplingParams(max_new_tokens=5, stop_token_ids=(stop,), ignore_eos=True))
    sched.add_request("ctx", prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))
    done = run(sched, runner)
    assert (
        done["stop"].finish_reason is FinishReason.STOP_TOKEN and done["stop"].output_ids == ref[: ref.index(stop) + 1]
    )
    assert done["ignore"].finish_reason is FinishReason.MAX_NEW_TOKENS and len(done["ignore"].output_ids) == 5
    assert done["ctx"].finish_reason is FinishReason.LENGTH and done["ctx"].seq_len == 12


def test_stop_checker():
    cfg = SchedulerConfig(page_size=4, num_pages=64, max_context_len=256)
    sched = Scheduler(cfg, stop_checker=lambda r: len(r.output_ids) == 3)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=10, ignore_eos=True))
    done = run(sched, FakeRunner(64, 4, VOCAB))
    assert done["a"].finish_reason is FinishReason.STOP_STR and len(done["a"].output_ids) == 3


def test_lone_request_outgrowing_pool_finishes_with_length():
    sched, runner = make(page_size=4, num_pages=4, max_context_len=1000)
    sched.add_request("big", list(range(1, 13)), SamplingParams(max_new_tokens=100, ignore_eos=True))
    done = run(sched, runner)
    assert done["big"].finish_reason is FinishReason.LENGTH and done["big"].seq_len == 17


def _abort_scenario(state: str):
    """Abort "x" in `state` while "y" keeps running; returns the scheduler after the run."""
    sched, runner = make(chunk_size=8, max_prefill_tokens=8)
    y_prompt = [9, 8, 7]
    x = sched.add_request("x", list(range(1, 21)), SamplingParams(max_new_tokens=10, ignore_eos=True))
    sched.add_request("y", y_prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    if state == "waiting":
        assert x.status is S.WAITING and sched.abort("x")
    elif state == "prefilling":  # carried chunk, between steps
        sched.step(runner)
        assert x is sched.chunked_req and x.status is S.PREFILLING and x.page_ids
        assert sched.abort("x")
    elif state == "prefilling-in-flight":
        batch = sched.get_next_batch()
        assert sched.abort("x")
        sched.process_batch_result(batch, runner.forward(batch))
    elif state in ("running", "running-in-flight"):
        while x.status is not S.RUNNING:
            sched.step(runner)
        if state == "running":
            assert sched.abort("x")
        else:
            batch = sched.get_next_batch()
            assert x in batch.reqs
            out = runner.forward(batch)
            assert sched.abort("x")
            sched.process_batch_result(batch, out)
    sched.check_invariants()
    assert not sched.abort("x") and not sched.abort("nope")
    done = run(sched, runner)
    assert "x" not in done and done["y"].output_ids == greedy_reference(y_prompt, 12, VOCAB)
    assert x.status is S.ABORTED and x.finish_reason is FinishReason.ABORT and x.page_ids == []
    check_lifecycles(sched.events)
    assert sched.pool.num_free + sched.tree.total_pages == sched.pool.num_pages and sched.tree.protected_pages == 0
    return sched


@pytest.mark.parametrize("state", ["waiting", "prefilling", "prefilling-in-flight", "running", "running-in-flight"])
def test_abort_in_every_state(state):
    _abort_scenario(state)


def test_invalid_requests_are_rejected_alone():
    sched, runner = make(page_size=4, num_pages=8, max_context_len=64)
    sched.add_request("ok", [1, 2, 3], SamplingParams(max_new_tokens=4))
    bad = [
        ("empty", [], None),
        ("ctx", [1] * 64, None),
        ("pool", [1] * 40, None),
        ("ok", [1], None),
        ("neg", [1, -2], None),
        (None, [1], None),
        ("samp", [1], "greedy"),
    ]
    for rid, prompt, sp in bad:
        with pytest.raises(InvalidRequest):
            sched.add_request(rid, prompt, sp if sp is not None else SamplingParams())
        sched.check_invariants()
    for kw in [{"max_new_tokens": -1}, {"temperature": -1}, {"top_k": 0}, {"top_p": 0}, {"top_p": 1.5}, {"seed": 1.5}]:
        with pytest.raises(InvalidRequest):
            SamplingParams(**kw)
    assert issubclass(InvalidRequest, ValueError)
    assert list(sched.reqs) == ["ok"]
    done = run(sched, runner)
    assert done["ok"].output_ids == greedy_reference([1, 2, 3], 4, VOCAB)


def test_config_validation():
    for kw in [
        {"policy": "random"},
        {"page_size": 0},
        {"chunk_size": 0},
        {"max_prefill_rounds_between_decodes": 0},
        {"min_new_token_ratio": 0.9},
        {"max_context_len": 1},
    ]:
        with pytest.raises(ValueError):
            SchedulerConfig(**kw)
    cfg = SchedulerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 8  # frozen


def test_rid_reusable_after_finish_and_events_stats():
    sched, runner = make()
    sched.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=2))
    run(sched, runner)
    sched.add_request("a", [1, 2, 3, 4], SamplingParams(max_new_tokens=2))
    run(sched, runner)
    check_lifecycles(sched.events)
    times = [e.time for e in sched.events]
    assert times == sorted(times)
    fin = [e for e in sched.events if e.dst is S.FINISHED]
    assert [(e.prompt_len, e.output_len, e.note) for e in fin] == [(3, 2, "max_new_tokens"), (4, 2, "max_new_tokens")]
    st = sched.step_stats
    assert [s.step for s in st] == sorted(s.step for s in st)
    assert all(0 <= s.token_usage <= 1 and s.free_pages + s.cached_pages <= 256 for s in st)
    assert st[-2].mode == "prefill" and st[-2].cache_hit_tokens == 0  # [1, 2, 3] is under one page
    with pytest.raises(RuntimeError):
        sched.add_request("b", [1], SamplingParams())
        sched.get_next_batch()
        sched.get_next_batch()  # previous batch still in flight


def test_policy_orders():
    from minisched.sched.policy import SchedulePolicy
    from minisched.sched.radix_cache import RadixCache
    from minisched.sched.req import Req

    tree = RadixCache(1)
    tree.insert([1, 1, 1, 1], [0, 1, 2, 3])
    tree.insert([2, 2], [4, 5])

    def req(rid, prompt, max_new=5):
        return Req(rid=rid, prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=max_new))

    waiting = [
        req("b1", [2, 2, 9], 1),
        req("cold", [7, 7], 9),
        req("a1", [1, 1, 1, 1, 5], 3),
        req("a2", [1, 1, 1, 8], 2),
    ]
    ids = lambda rs: [r.rid for r in rs]  # noqa: E731
    for i, r in enumerate(waiting):
        r.arrival_seq = i
    assert ids(SchedulePolicy("fcfs", tree).order(waiting)) == ["b1", "cold", "a1", "a2"]
    assert ids(SchedulePolicy("lpm", tree).order(waiting)) == ["a1", "a2", "b1", "cold"]
    assert ids(SchedulePolicy("dfs-weight", tree).order(waiting)) == ["a1", "a2", "b1", "cold"]
    assert ids(SchedulePolicy("lof", tree).order(waiting)) == ["cold", "a1", "a2", "b1"]
    # aging: "cold" was overtaken aging_rounds times, so it goes first under LPM
    waiting[1].overtaken = 3
    assert ids(SchedulePolicy("lpm", tree, aging_rounds=3).order(waiting)) == ["cold", "a1", "a2", "b1"]
    assert ids(SchedulePolicy("lpm", tree, aging_rounds=4).order(waiting)) == ["a1", "a2", "b1", "cold"]
    assert SchedulePolicy("lpm", tree).active(129) == "fcfs" and SchedulePolicy("lpm", tree).active(128) == "lpm"
    assert SchedulePolicy("lpm", RadixCache(1, disable=True)).active(1) == "fcfs"


def test_cached_tokens_count_prompt_tokens_only_after_a_retraction():
    """Regression: a retracted request's re-prefill hits the radix cache on its own decoded tokens too;
    `cache_hit_tokens` (the API's cached_tokens) must count prompt tokens only (it read 64 for a 60-token
    prompt)."""
    sched, runner = make(page_size=1, num_pages=100, chunk_size=None, retract_decode_steps=1)
    sched.add_request("a", list(range(1, 5)), SamplingParams(max_new_tokens=30, ignore_eos=True))
    sched.add_request("b", list(range(1, 10)), SamplingParams(max_new_tokens=30, ignore_eos=True))
    for _ in range(6):
        sched.step(runner)
    assert {r.rid for r in sched.running} == {"a", "b"} and len(sched.reqs["b"].output_ids) >= 4
    stolen = sched.pool.alloc(sched.pool.num_free - 1)
    sched.step(runner)  # b (longest prompt, as many tokens decoded) is retracted; its pages stay cached
    assert [r.rid for r in sched.waiting] == ["b"]
    sched.pool.free(stolen)
    done = run(sched, runner)
    assert done["b"].num_retractions == 1 and done["b"].cache_hit_tokens == 9
    assert done["b"].output_ids == greedy_reference(list(range(1, 10)), 30, VOCAB)
