"""The scheduler's public surface (scheduler.py, snapshot.py): what collaborators outside sched/ read and
call instead of its queues, pool and tree -- a snapshot that agrees with the state it summarizes, records
that are copied or handed over once, and `flush_cache`, which empties the radix cache on the device and
the host tier but never takes what a live request holds."""

from __future__ import annotations

from helpers.fake_runner import FakeRunner, greedy_reference, poison_freed, run
from minisched.sched.host_tier import HostTier
from minisched.sched.req import ReqStatus
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig

VOCAB = 50
SP = SamplingParams(max_new_tokens=6, ignore_eos=True)


def make(host_pages: int = 0, num_pages: int = 24, page_size: int = 4, **kw):
    kw = {"chunk_size": 16, "max_prefill_tokens": 64, **kw}
    cfg = SchedulerConfig(page_size=page_size, num_pages=num_pages, max_context_len=256, **kw)
    runner = FakeRunner(num_pages, page_size, VOCAB)
    tier = HostTier(host_pages, runner.mover) if host_pages else None
    sched = Scheduler(cfg, host_tier=tier)
    poison_freed(sched, runner)
    return sched, runner


def prompt(i: int, n: int = 20) -> list[int]:
    return [(7 * i + 3 * j) % VOCAB for j in range(n)]


def test_the_snapshot_agrees_with_the_state():
    sched, runner = make(num_pages=40)
    sched.add_request("long", prompt(0, 40), SP)  # 40 tokens, chunks of 16: carried over three rounds
    sched.add_request("a", prompt(1), SP)
    sched.step(runner)
    snap = sched.snapshot()
    assert sched.chunked_req is not None and sched.chunked_req.rid == "long"
    assert snap.waiting == len(sched.waiting) + 1 == 2  # the carried chunk counts as waiting
    assert snap.running == len(sched.running) == 0 and snap.live == 2 and snap.step == sched.step_count == 1
    assert (snap.pages_total, snap.pages_free) == (40, sched.pool.num_free)
    assert (snap.pages_cached, snap.pages_evictable) == (sched.tree.total_pages, sched.tree.evictable_pages)
    assert snap.pages_free < 40 and snap.pages_cached > 0  # the chunk's full pages are shared already
    assert snap.host is None and snap.host_pages_total == 0 and snap.spec is None
    run(sched, runner)
    done = sched.snapshot()
    assert (done.running, done.waiting, done.live) == (0, 0, 0)
    assert done.pages_free + done.pages_cached == 40


def test_records_are_copied_or_handed_over_once():
    sched, runner = make(page_size=1, num_pages=100, chunk_size=None)
    for i, n in enumerate((4, 9, 6)):
        sched.add_request(f"r{i}", prompt(i, n), SamplingParams(max_new_tokens=30, ignore_eos=True))
    sched.step(runner)
    stolen = sched.pool.alloc(sched.pool.num_free - 1)  # squeeze: the next decode retracts
    sched.step(runner)
    sched.pool.free(stolen)
    seen = sched.records()
    assert list(seen.events) == sched.events and list(seen.step_stats) == sched.step_stats
    assert seen.events[0].src is None and seen.events[0].dst is ReqStatus.WAITING
    drained = sched.drain_records()
    assert drained == seen and not sched.events and not sched.step_stats
    assert sched.records().events == () and sched.records().step_stats == ()
    run(sched, runner)
    later = sched.drain_records()
    assert later.step_stats and later.step_stats[0].step == seen.step_stats[-1].step + 1  # nothing twice
    retracted = sum(s.num_retracted for s in seen.step_stats + later.step_stats)
    assert retracted > 0 and sched.snapshot().retractions == retracted  # the counter outlives the drains


def test_flush_cache_empties_the_device_and_the_host_tier():
    sched, runner = make(host_pages=40, num_pages=16)
    for t in range(3):  # more prompts than the device holds: the evicted ones go to the host
        sched.add_request(f"c{t}", prompt(t, 24), SP)
        run(sched, runner)
    before = sched.snapshot()
    assert before.pages_cached > 0 and before.host_pages_used > 0 and before.host.write_backs > 0
    flushed = sched.flush_cache()
    after = sched.snapshot()
    assert flushed.device_pages == before.pages_cached and flushed.host_pages == before.host_pages_used
    assert (after.pages_free, after.pages_cached, after.pages_evictable, after.host_pages_used) == (16, 0, 0, 0)
    assert after.host.write_backs == before.host.write_backs  # dropped, not written back first
    sched.check_invariants()
    sched.add_request("again", prompt(0, 24), SP)  # recomputed from scratch, and right
    again = run(sched, runner)["again"]
    assert again.output_ids == greedy_reference(prompt(0, 24), 6, VOCAB) and again.cache_hit_tokens == 0


def test_flush_cache_keeps_what_live_requests_hold():
    sched, runner = make(num_pages=24)
    sched.add_request("done", prompt(0, 24), SP)
    run(sched, runner)
    sched.add_request("live", prompt(0, 24) + [1, 2, 3], SP)  # shares "done"'s cached prefix
    sched.step(runner)
    live = sched.get("live")
    assert live.status is ReqStatus.RUNNING and live.n_cached_pages > 0
    held = sched.tree.total_pages - sched.tree.evictable_pages
    flushed = sched.flush_cache()
    assert sched.tree.total_pages == held > 0 and sched.tree.evictable_pages == 0  # its locked prefix stays
    assert flushed.device_pages > 0 and flushed.host_pages == 0
    sched.check_invariants()
    out = run(sched, runner)["live"].output_ids
    assert out == greedy_reference(prompt(0, 24) + [1, 2, 3], 6, VOCAB)
    assert sched.get("live") is None


def test_arrival_time_dates_the_request_and_its_event_back():
    sched, runner = make()
    req = sched.add_request("r", prompt(0), SP, arrival_time=12.5)
    assert req.arrival_time == 12.5
    ev = sched.records().events[-1]
    assert (ev.rid, ev.src, ev.dst, ev.time) == ("r", None, ReqStatus.WAITING, 12.5)
    other = sched.add_request("s", prompt(1), SP)
    assert other.arrival_time > 12.5 and sched.records().events[-1].time > 12.5  # now, when not given
