"""The host tier under the radix cache, with the fake runner (its KV pages hold (token, position) slots and
every freed page is poisoned, so a missing or misplaced load fails its check):
evicted prefixes come back instead of being recomputed, the host's LRU drops for good, aborts and failed
steps during a load-back leave the cache right, write-through copies at insert, and the invariants hold
after every step. The stateful machines (tests/helpers/scheduler_machine.py) also draw host tiers."""

from __future__ import annotations

import pytest

from helpers.fake_runner import FakeRunner, greedy_reference, poison_freed, run
from minisched.sched.host_tier import HostTier
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig

VOCAB = 50
SP = SamplingParams(max_new_tokens=6, ignore_eos=True)


def make(host_pages: int, num_pages: int = 24, page_size: int = 4, write_through: bool = False, **kw):
    cfg = SchedulerConfig(
        page_size=page_size, num_pages=num_pages, max_context_len=256, chunk_size=16, max_prefill_tokens=64, **kw
    )
    runner = FakeRunner(num_pages, page_size, VOCAB)
    tier = HostTier(host_pages, runner.mover, write_through=write_through) if host_pages else None
    sched = Scheduler(cfg, host_tier=tier)
    poison_freed(sched, runner)
    return sched, runner


def conversation(i: int, turns: int) -> list[int]:
    return [(7 * i + 3 * j) % VOCAB for j in range(20 * turns)]


def chat_rounds(sched, runner, n_conv: int = 4, turns: int = 3) -> int:
    """Conversations taking turns, each turn's prompt extending the last; returns the prefill tokens computed."""
    for t in range(1, turns + 1):
        for i in range(n_conv):
            sched.add_request(f"c{i}t{t}", conversation(i, t), SP)
        done = run(sched, runner)  # invariants after every step
        for i in range(n_conv):
            assert done[f"c{i}t{t}"].output_ids == greedy_reference(conversation(i, t), 6, VOCAB)
    return sum(s.num_prefill_tokens for s in sched.step_stats)


@pytest.mark.parametrize("page_size", [1, 4])
def test_evicted_prefixes_come_back_from_the_host(page_size):
    num = 96 // page_size  # room for about one conversation at a time
    off = chat_rounds(*make(0, num, page_size))
    sched, runner = make(400 // page_size, num, page_size)
    on = chat_rounds(sched, runner)
    st = sched.tree.host.stats
    assert st.write_backs > 0 and st.loads > 0 and st.host_hit_tokens > 0
    assert runner.mover.to_device_calls == st.loads
    assert on < off, (on, off)  # prefixes loaded, not recomputed
    sched.tree.check()


def test_the_host_lru_drops_for_good():
    sched, runner = make(host_pages=3, num_pages=24)  # far too small: most evictions drop
    chat_rounds(sched, runner, n_conv=4, turns=3)
    st = sched.tree.host.stats
    assert st.dropped_pages > 0 and sched.tree.host.used <= 3
    sched.tree.check()


def _warm_then_evict(sched, runner, prompt):
    sched.add_request("warm", prompt, SP)
    run(sched, runner)
    for j in range(4):  # push it out of the device pool
        sched.add_request(f"other{j}", [(11 * j + k) % VOCAB + 1 for k in range(40)], SP)
        run(sched, runner)
    assert sched.tree.host.stats.write_backs > 0


def test_abort_during_a_load_back():
    sched, runner = make(host_pages=200, num_pages=24)
    prompt = conversation(9, 2)
    _warm_then_evict(sched, runner, prompt)
    sched.add_request("victim", prompt, SP)
    batch = sched.get_next_batch()
    assert batch.loads, "the match should reach the host"
    assert sched.abort("victim")  # in the built batch: released when it resolves
    sched.process_batch_result(batch, runner.forward(batch))  # the forward runs the loads first
    sched.check_invariants()
    sched.add_request("after", prompt, SP)
    done = run(sched, runner)
    assert done["after"].output_ids == greedy_reference(prompt, 6, VOCAB) and done["after"].cache_hit_tokens > 0


def test_a_failed_step_hands_back_its_loads():
    sched, runner = make(host_pages=200, num_pages=24)
    prompt = conversation(8, 2)
    _warm_then_evict(sched, runner, prompt)
    sched.add_request("doomed", prompt, SP)
    batch = sched.get_next_batch()
    assert batch.loads
    failed = sched.fail_in_flight("boom")  # the forward never ran: neither did its loads
    assert [r.rid for r in failed] == ["doomed"] and sched.unrun_loads == batch.loads
    for handle, pages in sched.unrun_loads:  # what the engine does after a failed step
        runner.mover.to_device(handle, pages)
    sched.unrun_loads.clear()
    sched.check_invariants()
    sched.add_request("again", prompt, SP)
    done = run(sched, runner)
    assert done["again"].output_ids == greedy_reference(prompt, 6, VOCAB)


def test_write_through_copies_at_insert_and_evicts_without_a_copy():
    sched, runner = make(host_pages=400, num_pages=24, write_through=True)
    chat_rounds(sched, runner, n_conv=3, turns=2)
    st = sched.tree.host.stats
    assert st.write_backs > 0 and st.kept > 0  # evicted nodes were on the host already
    sched.tree.check()


def test_retraction_keeps_full_pages_through_the_host():
    """Swap-out: a retracted request's full pages go into the cache; under pressure to the host; re-admitted,
    it loads them back instead of recomputing them."""
    off_sched, off_runner = make(0, num_pages=20, page_size=2, init_new_token_ratio=0.01, min_new_token_ratio=0.0)
    on_sched, on_runner = make(200, num_pages=20, page_size=2, init_new_token_ratio=0.01, min_new_token_ratio=0.0)
    for sched, runner in ((off_sched, off_runner), (on_sched, on_runner)):
        for i in range(5):
            sched.add_request(
                f"r{i}",
                [(5 * i + k) % VOCAB for k in range(6 + 3 * i)],
                SamplingParams(max_new_tokens=14, ignore_eos=True),
            )
        done = run(sched, runner)
        for i in range(5):
            assert done[f"r{i}"].output_ids == greedy_reference(
                [(5 * i + k) % VOCAB for k in range(6 + 3 * i)], 14, VOCAB
            )
    retracted = sum(s.num_retracted for s in on_sched.step_stats)
    assert retracted >= 1
    computed = [sum(s.num_prefill_tokens for s in sch.step_stats) for sch in (off_sched, on_sched)]
    assert computed[1] <= computed[0]
    assert on_sched.tree.host.stats.write_backs > 0
