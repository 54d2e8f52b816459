"""Benchmark workloads step the Engine (minisched.observe.workloads): its overlap, grammar and load handling
run as in serving, and a request's latencies and arrival event count from its scheduled arrival."""

from __future__ import annotations

import pytest

from minisched.engine import Engine
from minisched.observe.workloads import make_workload, run_record, run_workload
from minisched.sched.req import ReqStatus

TINY = "dummy:tiny"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_workload_runs_through_engine_step(overlap):
    engine = Engine(TINY, num_pages=256, overlap=overlap)
    workload = make_workload("poisson", 6, 200.0, vocab=512, seed=3, scale=0.1)
    result = run_workload(engine, workload)
    assert [r.output_tokens for r in result.requests] == [w.max_new_tokens for w in workload]
    assert len(engine.step_times) > 0  # Engine.step ran (it used to call the scheduler's step directly)
    assert 0 <= result.scheduler_time <= result.step_time and engine.runner.forward_time > 0
    arrivals = {e.rid: e.time for e in engine.scheduler.records().events if e.src is None}
    assert arrivals == {w.rid: pytest.approx(result.start + w.arrival) for w in workload}
    rec = run_record(engine, result)
    assert [r["status"] for r in rec.requests] == ["finished"] * 6
    assert all(e["dst"] != ReqStatus.ABORTED.value for e in rec.events)
