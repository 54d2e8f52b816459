"""Priority scheduling with preemption (minisched/sched/preemption.py), with the fake runner.

Lower `SamplingParams.priority` is more urgent (vLLM's convention). Checked: the waiting order,
which running requests a more urgent arrival preempts (least urgent, then newest) and when it
may not (the threshold, room that retracting would not make), the aging bound (no request that
arrives (p - q + 1) * aging steps after a request is admitted before it; without aging the same
load starves it), pages and locks when the preempted request shares its prefix with one that
keeps running (invariants after every step, the fake runner reading every KV back, freed pages
poisoned), a preempted chunked prefill, and the greedy outputs equal to an unconstrained run.
"""

from __future__ import annotations

import pytest

from helpers.fake_runner import FakeRunner, check_lifecycles, greedy_reference, poison_freed, run
from minisched.sched.events import transitions
from minisched.sched.preemption import effective
from minisched.sched.req import ReqStatus
from minisched.sched.sampling_params import InvalidRequest, SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig

S = ReqStatus
VOCAB = 50


def make(**kw) -> tuple[Scheduler, FakeRunner]:
    cfg = SchedulerConfig(
        **{
            "page_size": 4,
            "num_pages": 256,
            "max_context_len": 512,
            "chunk_size": 64,
            "max_prefill_tokens": 256,
            "priority_scheduling": True,
            **kw,
        }
    )
    sched, runner = Scheduler(cfg), FakeRunner(cfg.num_pages, cfg.page_size, VOCAB)
    poison_freed(sched, runner)
    return sched, runner


def sp(priority: int, max_new: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, ignore_eos=True, priority=priority)


def prompt(i: int, n: int = 10) -> list[int]:
    return [(7 * i + 3 * j + 1) % VOCAB for j in range(n)]


def admitted_step(sched: Scheduler, rid: str) -> int:
    return next(e.step for e in sched.events if e.rid == rid and e.dst is S.PREFILLING)


def preempted(sched: Scheduler) -> list[str]:
    return [e.rid for e in sched.events if e.dst is S.RETRACTED and e.note == "preempted"]


def check_outputs(sched: Scheduler, done: dict, added: dict) -> None:
    for rid, (p, s) in added.items():
        assert done[rid].output_ids == greedy_reference(p, s.max_new_tokens, VOCAB), rid
    check_lifecycles(sched.events)
    sched.pool.free(sched.tree.evict(sched.tree.total_pages))
    assert sched.pool.num_free == sched.config.num_pages


def steps(sched, runner, n):
    done = {}
    for _ in range(n):
        for r in sched.step(runner):
            done[r.rid] = r
        sched.check_invariants()
    return done


def test_priority_values_are_checked_and_need_priority_scheduling():
    with pytest.raises(InvalidRequest, match="priority"):
        SamplingParams(priority=1.5)
    with pytest.raises(InvalidRequest, match="priority"):
        SamplingParams(priority=True)
    sched, _ = make(priority_scheduling=False)
    sched.add_request("zero", [1, 2, 3], SamplingParams(priority=0))  # the default is always fine
    with pytest.raises(InvalidRequest, match="priority scheduling is not enabled"):
        sched.add_request("a", [1, 2, 3], SamplingParams(priority=-1))
    with pytest.raises(ValueError, match="priority_aging_steps"):
        SchedulerConfig(priority_aging_steps=0)
    with pytest.raises(ValueError, match="priority_preemption_threshold"):
        SchedulerConfig(priority_preemption_threshold=-1)


def test_waiting_queue_orders_by_priority_then_policy():
    sched, runner = make(max_running_requests=1, priority_preemption_threshold=None)
    added = {}
    for rid, pr in [("low", 5), ("mid", 2), ("high", -1), ("mid2", 2)]:
        added[rid] = (prompt(len(added)), sp(pr, 3))
        sched.add_request(rid, *added[rid])
    done = run(sched, runner)
    order = sorted(added, key=lambda rid: admitted_step(sched, rid))
    assert order == ["high", "mid", "mid2", "low"]  # mid before mid2: FCFS among equals
    assert not preempted(sched)
    check_outputs(sched, done, added)


@pytest.mark.parametrize("threshold, victim", [(0, "b"), (4, "b"), (5, None)])
def test_urgent_arrival_preempts_the_least_urgent_newest_running_request(threshold, victim):
    sched, runner = make(max_running_requests=3, priority_preemption_threshold=threshold, priority_aging_steps=None)
    added = {"a": (prompt(0), sp(5, 30)), "c": (prompt(1), sp(3, 30)), "b": (prompt(2), sp(5, 30))}
    for rid in ("a", "c", "b"):
        sched.add_request(rid, *added[rid])
    steps(sched, runner, 3)
    assert sorted(r.rid for r in sched.running) == ["a", "b", "c"]
    added["h"] = (prompt(3), sp(0, 4))
    sched.add_request("h", *added["h"])
    steps(sched, runner, 2)
    if victim is None:  # the gap (3 to c, 5 to a and b) does not exceed the threshold: h waits
        assert not preempted(sched) and sched.reqs["h"].status is S.WAITING
    else:
        assert preempted(sched) == [victim]  # least urgent (a, b at 5), then the newest arrival (b)
        assert sched.reqs["h"].status is S.RUNNING
        assert transitions(sched.events, victim)[-2:] == [(S.RUNNING, S.RETRACTED), (S.RETRACTED, S.WAITING)]
    done = run(sched, runner)
    check_outputs(sched, done, added)
    if victim is not None:  # the victim came back after h, and before nothing less urgent
        assert (
            admitted_step(sched, "h") < [e.step for e in sched.events if e.rid == victim and e.dst is S.PREFILLING][1]
        )


def test_preemption_for_kv_room_only_when_the_victims_make_enough():
    # 24 pages of 4 tokens: `keep` (as urgent as the arrivals: never a victim), a and b hold most of them
    sched, runner = make(
        num_pages=24, chunk_size=None, max_prefill_tokens=512, priority_aging_steps=None, init_new_token_ratio=0.1
    )
    added = {"keep": (prompt(0, 20), sp(0, 40)), "a": (prompt(1, 20), sp(3, 40)), "b": (prompt(2, 20), sp(3, 40))}
    for rid in added:
        sched.add_request(rid, *added[rid])
    steps(sched, runner, 4)
    assert len(sched.running) == 3
    sched.add_request("huge", prompt(3, 80), sp(0, 4))  # a and b together do not make room for it
    steps(sched, runner, 2)
    assert not preempted(sched) and sched.reqs["huge"].status is S.WAITING
    assert sched.abort("huge")
    added["h"] = (prompt(4, 30), sp(0, 4))
    sched.add_request("h", *added["h"])
    steps(sched, runner, 1)
    assert preempted(sched) == ["b"] and sched.reqs["h"].status is S.RUNNING  # one victim is enough
    assert sched.reqs["a"].status is S.RUNNING
    done = run(sched, runner)
    check_outputs(sched, done, added)


def test_preempting_a_request_whose_prefix_others_share_keeps_locks_and_pages_right():
    shared = [(5 * j + 2) % VOCAB for j in range(32)]
    sched, runner = make(num_pages=40, max_running_requests=3, priority_aging_steps=None)
    added = {
        "a": (shared + [1, 2, 3], sp(4, 40)),
        "b": (shared + [4, 5, 6, 7], sp(4, 40)),
    }
    sched.add_request("a", *added["a"])
    steps(sched, runner, 2)  # a's prompt is in the cache: b hits its 32 tokens
    sched.add_request("b", *added["b"])
    steps(sched, runner, 2)
    a, b = sched.reqs["a"], sched.reqs["b"]
    assert b.status is S.RUNNING and b.cache_hit_tokens == 32
    shared_node = a.last_node  # the 32 shared tokens' 8 pages; b's own full page hangs below it
    assert b.last_node.parent is shared_node and shared_node.lock_ref == 2  # a and b
    added["h"] = ([9] * 60, sp(-2, 3))
    sched.add_request("h", *added["h"])
    steps(sched, runner, 1)
    assert preempted(sched) == ["b"]
    assert shared_node.lock_ref == 1 and a.last_node is shared_node  # a still holds the prefix
    assert b.page_ids == [] and b.kv_len == 0 and b.status is S.WAITING
    done = run(sched, runner)  # the fake runner reads a's (and later b's) KV back every step
    assert done["b"].num_retractions == 1 and done["b"].cache_hit_tokens >= 32
    check_outputs(sched, done, added)


def test_an_urgent_request_preempts_a_long_chunked_prefill():
    sched, runner = make(chunk_size=16, max_prefill_tokens=16, priority_aging_steps=None)
    added = {"long": (prompt(0, 200), sp(3, 4))}
    sched.add_request("long", *added["long"])
    steps(sched, runner, 3)
    assert sched.chunked_req is sched.reqs["long"] and sched.reqs["long"].kv_len == 48
    added["h"] = (prompt(1, 8), sp(0, 4))
    sched.add_request("h", *added["h"])
    steps(sched, runner, 1)
    assert preempted(sched) == ["long"] and sched.reqs["h"].status is S.RUNNING
    done = run(sched, runner)
    assert done["long"].cache_hit_tokens == 48  # its computed chunks stayed in the radix cache
    assert done["h"].first_token_time < done["long"].first_token_time
    check_outputs(sched, done, added)


@pytest.mark.parametrize("threshold", [None, 0])
def test_aging_bounds_how_long_a_low_priority_request_is_overtaken(threshold):
    aging, p_low, p_high = 4, 3, 0
    window = (p_low - p_high + 1) * aging
    sched, runner = make(max_running_requests=1, priority_preemption_threshold=threshold, priority_aging_steps=aging)
    added = {"low": (prompt(0), sp(p_low, 6))}
    sched.add_request("low", *added["low"])
    done = {}
    for i in range(120):  # more urgent arrivals than the batch can serve, for ever
        rid = f"h{i}"
        added[rid] = (prompt(i + 1), sp(p_high, 3))
        sched.add_request(rid, *added[rid])
        for r in sched.step(runner):
            done[r.rid] = r
        sched.check_invariants()
    assert "low" in done  # it did not starve
    arrival = {e.rid: e.step for e in sched.events if e.src is None}
    low = None
    for e in sched.events:  # no request arriving `window` steps after it is admitted while it waits
        if e.rid == "low":
            low = e.dst
        elif e.dst is S.PREFILLING and arrival[e.rid] >= arrival["low"] + window:
            assert low is not S.WAITING, f"{e.rid} (arrived at {arrival[e.rid]}) overtook low at step {e.step}"
    assert len(preempted(sched)) <= window and set(preempted(sched)) <= {"low"}
    done.update(run(sched, runner))
    check_outputs(sched, done, added)


def test_without_aging_the_same_load_starves_the_low_priority_request():
    sched, runner = make(max_running_requests=1, priority_preemption_threshold=None, priority_aging_steps=None)
    sched.add_request("low", prompt(0), sp(3, 6))
    for i in range(120):
        sched.add_request(f"h{i}", prompt(i + 1), sp(0, 3))
        sched.step(runner)
    assert sched.reqs["low"].status is S.WAITING


def test_effective_priority_ages_by_steps_since_arrival():
    sched, _ = make(priority_aging_steps=10)
    req = sched.add_request("a", [1, 2], sp(3))
    assert effective(req, 0, 10) == 3 and effective(req, 9, 10) == 3 and effective(req, 10, 10) == 2
    assert effective(req, 35, 10) == 0 and effective(req, 35, None) == 3


def test_memory_retraction_takes_the_least_urgent_first():
    sched, runner = make(
        num_pages=12,
        chunk_size=None,
        priority_preemption_threshold=None,
        priority_aging_steps=None,
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.05,
    )
    added = {"urgent": (prompt(0, 8), sp(-1, 30)), "lazy": (prompt(1, 8), sp(2, 30))}
    for rid in added:
        sched.add_request(rid, *added[rid])
    done = run(sched, runner)
    retracted = [e.rid for e in sched.events if e.dst is S.RETRACTED]
    assert retracted and set(retracted) == {"lazy"}
    check_outputs(sched, done, added)
