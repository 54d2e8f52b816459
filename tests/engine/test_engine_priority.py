"""Priority scheduling through the Engine and the CLI on the tiny random model: an urgent request
overtakes (and preempts) batch work, every output still equals the dense greedy reference, and a
priority without `priority_scheduling` is refused (sched/preemption.py has the rules)."""

from __future__ import annotations

import json

import pytest

from helpers.engines import assert_pool_whole, byte_engine, prompts, reference, tiny_model
from minisched.cli import main
from minisched.sched.req import ReqStatus
from minisched.sched.sampling_params import InvalidRequest, SamplingParams


@pytest.mark.parametrize("overlap", [False, True])
def test_urgent_request_preempts_batch_work_and_outputs_stay_greedy(overlap):
    model = tiny_model()
    engine = byte_engine(model, num_pages=64, max_running_requests=2, priority_scheduling=True, overlap=overlap)
    batch = prompts([20, 24, 28], seed=1)
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=24, ignore_eos=True), priority=5) for p in batch]
    for _ in range(4):
        engine.step()
    assert sum(r.status is ReqStatus.RUNNING for r in reqs) == 2
    urgent_prompt = prompts([12], seed=2)[0]
    urgent = engine.add_request(urgent_prompt, SamplingParams(max_new_tokens=4, ignore_eos=True), priority=-1)
    done = []
    while engine.has_work():
        done += engine.step()
    assert done.index(urgent) < min(done.index(r) for r in reqs)
    assert sum(r.num_retractions for r in reqs) >= 1  # a running batch request made room for it
    for r, p in zip([*reqs, urgent], [*batch, urgent_prompt]):
        assert r.output_ids == reference(model, p, r.sampling.max_new_tokens)
    assert_pool_whole(engine)


def test_priority_needs_priority_scheduling():
    engine = byte_engine(tiny_model(), num_pages=32)
    with pytest.raises(InvalidRequest, match="priority scheduling is not enabled"):
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2), priority=3)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, priority=1))[0]
    assert out.finish_reason == "error" and "priority" in out.error


def test_cli_jsonl_priority(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": [5, 6, 7], "priority": 3, "id": "late"}\n{"prompt": [8, 9], "priority": -2, "id": "now"}\n'
    )
    argv = ["generate", "--file", str(f), "--json", "--max-new-tokens", "3", "--model", "dummy:tiny"]
    assert main([*argv, "--priority-scheduling", "--max-running-requests", "1"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in recs] == ["late", "now"] and all(len(r["token_ids"]) == 3 for r in recs)
    assert recs[1]["ttft_s"] < recs[0]["ttft_s"]  # the urgent one went first
    assert main(argv) == 1  # without --priority-scheduling the priorities are refused
    assert "priority scheduling is not enabled" in capsys.readouterr().err
