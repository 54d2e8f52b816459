"""The decisions the scheduler journals with their reasons (minisched/sched/decisions.py), one scenario per
rule: the prefill token budget, the chunk budget, the running-request cap, KV pages, the in-batch prefix
deferral, decode's turn, a compiling grammar, an n > 1 choice waiting for its prompt, a memory retraction
(victim and the requests passed over) and a priority preemption, plus what each admission records."""

from __future__ import annotations

import concurrent.futures

from helpers.fake_runner import FakeRunner, run
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig

VOCAB = 50


def make(**kw) -> tuple[Scheduler, FakeRunner]:
    cfg = SchedulerConfig(**{"page_size": 4, "num_pages": 256, "max_context_len": 512, **kw})
    return Scheduler(cfg), FakeRunner(cfg.num_pages, cfg.page_size, VOCAB)


def builds(sched: Scheduler) -> list[dict]:
    return [e for e in sched.records().journal if e["op"] == "build"]


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7 + i * 3) % VOCAB for i in range(n)]


def test_token_budget_names_the_requests_that_spent_it():
    sched, runner = make(chunk_size=None, max_prefill_tokens=64)
    sched.add_request("r0", prompt(50, 1), SamplingParams(max_new_tokens=2))
    sched.add_request("r1", prompt(50, 2), SamplingParams(max_new_tokens=2))
    sched.step(runner)
    why = builds(sched)[0]["why"]
    assert [a[0] for a in why["admitted"]] == ["r0"]
    assert why["admitted"][0][1:4] == [0, 50, False]  # no prefix, 50 new tokens, not truncated
    assert why["stopped"] == ["r1", "token_budget", ["r0"]]


def test_a_truncated_chunk_spends_the_chunk_budget():
    sched, runner = make(chunk_size=32)
    sched.add_request("r0", prompt(40, 1), SamplingParams(max_new_tokens=2))
    sched.add_request("r1", prompt(10, 2), SamplingParams(max_new_tokens=2))
    sched.step(runner)
    why = builds(sched)[0]["why"]
    assert why["admitted"][0][:4] == ["r0", 0, 32, True]
    assert why["stopped"] == ["r1", "chunk_budget", ["r0"]]
    sched.step(runner)  # the carried request goes first; r1 rides along in what is left of the chunk
    why = builds(sched)[1]["why"]
    assert [a[:4] for a in why["admitted"]] == [["r0", 32, 8, False], ["r1", 0, 10, False]]


def test_running_cap_stops_admission_and_then_the_prefill_round():
    sched, runner = make(max_running_requests=1)
    sched.add_request("r0", prompt(8, 1), SamplingParams(max_new_tokens=4))
    sched.add_request("r1", prompt(8, 2), SamplingParams(max_new_tokens=4))
    sched.step(runner)
    sched.step(runner)
    first, second = builds(sched)[:2]
    assert first["why"]["stopped"] == ["r1", "running_cap", []]
    assert second["why"]["no_prefill"] == "running_cap" and second["mode"] == "decode"


def test_kv_pages_names_the_largest_holders():
    sched, runner = make(num_pages=12, chunk_size=None)
    sched.add_request("r0", prompt(36, 1), SamplingParams(max_new_tokens=8))
    sched.step(runner)
    sched.add_request("r1", prompt(20, 2), SamplingParams(max_new_tokens=8))
    sched.step(runner)
    why = builds(sched)[1]["why"]
    assert why["stopped"][:2] == ["r1", "kv_pages"] and "r0" in why["stopped"][2]


def test_in_batch_prefix_deferral_names_the_request_computing_the_prefix():
    sched, runner = make(in_batch_prefix_defer_tokens=16, policy="lpm")
    shared = prompt(40, 3)
    sched.add_request("r0", shared + [1, 2], SamplingParams(max_new_tokens=2))
    sched.add_request("r1", shared + [3, 4], SamplingParams(max_new_tokens=2))
    sched.step(runner)
    why = builds(sched)[0]["why"]
    assert why["skipped"] == [["r1", "prefix_defer", ["r0"]]]
    sched.step(runner)
    admitted = {a[0]: a for e in builds(sched) for a in e.get("why", {}).get("admitted", ())}
    assert admitted["r1"][1] == 40  # next round: it hits the prefix r0 computed


def test_decode_turn_is_recorded_when_a_request_waits_for_it():
    sched, runner = make(max_prefill_rounds_between_decodes=1)
    for i in range(3):
        sched.add_request(f"r{i}", prompt(8, i), SamplingParams(max_new_tokens=8))
        sched.step(runner)
    turns = [e for e in builds(sched) if e.get("why", {}).get("no_prefill") == "decode_turn"]
    assert turns and turns[0]["mode"] == "decode"


def test_a_compiling_grammar_waits_and_its_gate_opens_at_a_build():
    sched, runner = make()
    gate: concurrent.futures.Future = concurrent.futures.Future()
    sched.add_request("g", prompt(8, 1), SamplingParams(max_new_tokens=2), gate=gate)
    sched.add_request("r", prompt(8, 2), SamplingParams(max_new_tokens=2))
    sched.step(runner)
    first = builds(sched)[0]
    assert ["g", "grammar", []] in first["why"]["skipped"] and [a[0] for a in first["why"]["admitted"]] == ["r"]
    gate.set_result(None)
    sched.step(runner)
    second = builds(sched)[1]
    assert second["opened"] == ["g"] and "g" in [a[0] for a in second["why"]["admitted"]]


def test_an_n_choice_waits_for_its_prompts_prefill():
    sched, runner = make()
    lead = sched.add_request("p#prompt", prompt(10, 1), SamplingParams(max_new_tokens=0))
    sched.add_request("p-0", prompt(10, 1), SamplingParams(max_new_tokens=3), after=lead)
    sched.step(runner)
    assert ["p-0", "fork_wait", []] in builds(sched)[0]["why"]["skipped"]
    run(sched, runner)


def test_a_retraction_names_its_victim_and_the_requests_it_passed_over():
    sched, runner = make(
        num_pages=16,
        chunk_size=None,
        init_new_token_ratio=0.01,
        min_new_token_ratio=0.01,
        new_token_ratio_decay_steps=1,
    )
    for i in range(3):
        sched.add_request(f"r{i}", prompt(8, i), SamplingParams(max_new_tokens=40, ignore_eos=True))
    run(sched, runner)
    retracted = [r for e in builds(sched) for r in e.get("why", {}).get("retracted", ())]
    assert retracted, "the pool was meant to run out"
    victim, rule, passed = retracted[0]
    assert rule == "decode_pages" and victim not in passed and passed
    assert sched.snapshot().retractions >= 1


def test_a_preemption_names_the_more_urgent_request():
    sched, runner = make(
        priority_scheduling=True, priority_preemption_threshold=0, max_running_requests=1, priority_aging_steps=None
    )
    sched.add_request("low", prompt(8, 1), SamplingParams(max_new_tokens=30, priority=5, ignore_eos=True))
    sched.step(runner)
    sched.add_request("high", prompt(8, 2), SamplingParams(max_new_tokens=3, priority=0, ignore_eos=True))
    sched.step(runner)
    why = builds(sched)[1]["why"]
    assert why["retracted"][0][:2] == ["low", "preempted_for:high"]
    assert [a[0] for a in why["admitted"]] == ["high"]
    assert sched.snapshot().preemptions == 1
