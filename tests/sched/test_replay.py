"""Exact replay of the scheduler's journal (minisched/sched/replay.py).

A run with chunked prefill, radix hits, a host tier, retraction, priorities with preemption, an n > 1
prompt, speculative decoding, a compiling grammar, a stop checker and an abort replays identically after
a JSON round trip (the state machines of test_scheduler_stateful.py and test_scheduler_overlap.py check
the same for every random run they make, overlapped or not). A changed rule -- the retraction victim --
is caught at the first step it decides differently, with both entries; so is a changed setting; a
journal that does not start at the scheduler's birth is refused with a clear error."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from helpers.fake_runner import FakeRunner, OracleDrafter, run
from minisched.sched import retraction
from minisched.sched.host_tier import HostTier
from minisched.sched.replay import JournalError, replay
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig

VOCAB = 50


def rich_run() -> tuple[Scheduler, list[dict], dict]:
    cfg = SchedulerConfig(
        page_size=4,
        num_pages=24,
        max_context_len=256,
        chunk_size=16,
        max_prefill_tokens=64,
        priority_scheduling=True,
        priority_preemption_threshold=0,
        init_new_token_ratio=0.05,
        min_new_token_ratio=0.05,
    )
    runner = FakeRunner(cfg.num_pages, cfg.page_size, VOCAB)
    sched = Scheduler(
        cfg,
        stop_checker=lambda r: len(r.output_ids) == 5 and r.rid.endswith("s"),
        host_tier=HostTier(64, runner.mover),
        drafter=OracleDrafter(VOCAB, wrong_every=3),
    )
    shared = [(i * 7) % VOCAB for i in range(24)]
    gate: concurrent.futures.Future = concurrent.futures.Future()
    reqs = {}
    for step in range(400):
        if step < 30 and step % 2 == 0:
            i = step // 2
            sp = SamplingParams(max_new_tokens=20 + (i * 7) % 40, priority=i % 5 // 4, stop_token_ids=(3,))
            rid = f"r{i}" + ("s" if i % 4 == 1 else "")
            reqs[rid] = sched.add_request(rid, shared[: 8 + i % 16] + [i, i + 1, i + 2] * (1 + i % 5), sp)
        if step == 3:
            lead = reqs["n#prompt"] = sched.add_request("n#prompt", shared + [9, 9], SamplingParams(max_new_tokens=0))
            for j in range(2):
                reqs[f"n-{j}"] = sched.add_request(
                    f"n-{j}", shared + [9, 9], SamplingParams(max_new_tokens=7), after=lead
                )
            reqs["g"] = sched.add_request("g", shared[:10], SamplingParams(max_new_tokens=4), gate=gate)
        if step == 9:
            gate.set_result(None)
        if step == 12:
            sched.abort("r4")
        sched.step(runner)
        if not sched.has_work() and step > 40:
            break
    run(sched, runner)
    assert not sched.has_work()
    return sched, json.loads(json.dumps(list(sched.records().journal))), reqs


def test_a_rich_run_replays_identically():
    sched, journal, recorded = rich_run()
    ops = [e["op"] for e in journal]
    whys = [e.get("why", {}) for e in journal if e["op"] == "build"]
    # the run exercised what it claims to
    assert "abort" in ops and "stop" in ops
    assert any(e.get("drafts") for e in journal if e["op"] == "build")
    rules = {r[1].split(":")[0] for w in whys for r in w.get("retracted", ())}
    assert rules == {"decode_pages", "preempted_for"}  # memory retractions and priority preemptions
    assert any(a[3] for w in whys for a in w.get("admitted", ()))  # a chunk
    assert any(a[1] > 0 for w in whys for a in w.get("admitted", ()))  # a radix hit
    assert any(e.get("opened") == ["g"] for e in journal if e["op"] == "build")
    result = replay(journal)
    assert result.identical, result.divergence
    assert result.steps == sched.step_count
    # the replayed requests end as the recorded ones did, with the same tokens
    assert {rid: r.output_ids for rid, r in result.requests.items()} == {
        rid: r.output_ids for rid, r in recorded.items()
    }


def test_a_changed_rule_is_caught_at_its_first_decision(monkeypatch):
    _, journal, _ = rich_run()
    first = next(
        e
        for e in journal
        if e["op"] == "build" and any(r[1] == "decode_pages" for r in e.get("why", {}).get("retracted", ()))
    )
    # most decoded tokens first instead of fewest: the same inputs, another victim
    monkeypatch.setattr(
        retraction, "pick_victim", lambda running, *a, **k: max(running, key=lambda r: len(r.output_ids))
    )
    result = replay(journal)
    d = result.divergence
    assert d is not None and d.step <= first["step"]
    assert d.recorded is not None and d.replayed is not None and d.recorded != d.replayed
    assert "running" in d.state and "pages free" in d.state


def test_another_setting_diverges_and_says_where():
    _, journal, _ = rich_run()
    result = replay(journal, {"chunk_size": 64})
    assert not result.identical
    d = result.divergence
    assert d is not None and d.recorded is not None and d.recorded["op"] == "build"


def test_a_journal_without_its_beginning_is_refused():
    _, journal, _ = rich_run()
    with pytest.raises(JournalError, match="init entry"):
        replay(journal[5:])
    with pytest.raises(JournalError, match="unknown op"):
        replay([journal[0], {"op": "teleport"}])


def test_the_sglang_profile_replays_identically_and_records_its_decisions():
    cfg = SchedulerConfig.preset("sglang", page_size=4, num_pages=24, max_context_len=256, chunk_size=16)
    runner = FakeRunner(cfg.num_pages, cfg.page_size, VOCAB)
    sched = Scheduler(cfg)
    shared = [(i * 7) % VOCAB for i in range(24)]
    for step in range(300):
        if step < 30 and step % 2 == 0:
            i = step // 2
            sp = SamplingParams(max_new_tokens=20 + (i * 7) % 40, stop_token_ids=(3,))
            sched.add_request(f"r{i}", shared[: 8 + i % 16] + [i, i + 1, i + 2] * (1 + i % 5), sp)
        sched.step(runner)
    run(sched, runner)
    journal = json.loads(json.dumps(list(sched.records().journal)))
    whys = [e.get("why", {}) for e in journal if e["op"] == "build"]
    assert any(w.get("admitted") for w in whys) and any(w.get("stopped") for w in whys)
    result = replay(journal)
    assert result.identical, result.divergence
