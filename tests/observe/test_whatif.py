"""What-if prediction (minisched/observe/whatif.py) and request stories (minisched/observe/explain.py) on runs
with a synthetic clock: each step costs a known linear function of its batch, so the fitted cost model must
recover it (R^2 ~ 1) and the prediction for a changed setting must match actually running that setting on
the same clock. The same traffic runs under three settings (policy, chunk size, pool size)."""

from __future__ import annotations

import random

import pytest

from helpers.fake_runner import FakeRunner
from minisched.observe.explain import request_story, stories
from minisched.observe.run_record import RunRecord
from minisched.observe.whatif import predict, recorded
from minisched.sched import journal as journal_mod
from minisched.sched import scheduler as scheduler_mod
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig

VOCAB = 50


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def cost(batch) -> float:
    """Seconds: 2 ms a step, 20 us a prefill token, 1 ms a decode row."""
    decode = batch.num_decode
    prefill = sum(batch.extend_lens[: batch.batch_size - decode])
    return 0.002 + 2e-5 * prefill + 1e-3 * decode


def traffic(seed: int = 0) -> list[tuple[float, str, list[int], int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(64)]
    t, out = 0.0, []
    for i in range(40):
        t += rng.expovariate(40.0)
        prompt = shared[: rng.choice([0, 32, 64])] + [rng.randrange(VOCAB) for _ in range(rng.randint(8, 120))]
        out.append((t, f"r{i}", prompt, rng.randint(4, 40)))
    return out


def simulate_run(monkeypatch, **settings) -> RunRecord:
    clock = Clock()
    monkeypatch.setattr(journal_mod, "time", clock)
    monkeypatch.setattr(scheduler_mod, "time", clock)
    cfg = SchedulerConfig(
        **{"page_size": 4, "num_pages": 400, "max_context_len": 512, "chunk_size": 64, "policy": "lpm", **settings}
    )
    sched, runner = Scheduler(cfg), FakeRunner(cfg.num_pages, cfg.page_size, VOCAB)
    pending = traffic()
    start = clock.now
    while pending or sched.has_work():
        while pending and start + pending[0][0] <= clock.now:
            t, rid, prompt, n = pending.pop(0)
            sched.add_request(rid, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), arrival_time=start + t)
        batch = sched.get_next_batch()
        if batch is None:
            sched.take_finished()
            if pending:
                clock.now = max(clock.now, start + pending[0][0])
            continue
        clock.now += cost(batch)
        sched.process_batch_result(batch, runner.forward(batch))
    return RunRecord.from_scheduler("synthetic", sched, start_time=start)


SETTINGS = [{"policy": "fcfs"}, {"chunk_size": 16}, {"num_pages": 90}]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: next(iter(s)))
def test_prediction_matches_running_the_setting(monkeypatch, setting):
    base = simulate_run(monkeypatch)
    pred = predict(base, setting)
    assert pred.model.r2 > 0.99 and pred.model.mean_abs_err < 0.02, pred.model.describe()
    actual = recorded(simulate_run(monkeypatch, **setting))
    for key, tol in (("ttft_p50", 0.15), ("output_tok_s", 0.15), ("ttft_p99", 0.25)):
        want, got = getattr(actual, key), getattr(pred.predicted, key)
        assert want is not None and got is not None
        assert abs(got - want) <= tol * want + 1e-3, f"{key}: predicted {got:.4f}, ran {want:.4f}\n{pred.table()}"
    assert pred.predicted.cache_hit_rate == pytest.approx(actual.cache_hit_rate, abs=0.05)
    text = pred.table()
    assert "predicted" in text and "R^2" in text


def test_a_smaller_pool_predicts_worse_latency(monkeypatch):
    base = simulate_run(monkeypatch)
    pred = predict(base, {"num_pages": 90})
    assert pred.predicted.ttft_p99 > pred.baseline.ttft_p99


def test_stories_explain_waits_chunks_and_endings(monkeypatch):
    run = simulate_run(monkeypatch, num_pages=90, chunk_size=32)
    text = "\n\n".join(stories(run))
    assert "waited" in text and "chunk 1 of" in text and "finished" in text
    assert "KV pages did not fit" in text or "chunk budget was spent" in text
    slow = stories(run, slowest=2)
    assert len(slow) == 2 and all(s.splitlines()[0].split(":")[0] in {m["rid"] for m in run.requests} for s in slow)
    segs = request_story(run, "r0")
    assert segs and segs[0][2] == "arrived" and all(a <= b for a, b, _ in segs)
    with pytest.raises(ValueError, match="no request"):
        stories(run, rids=["nope"])


def test_the_trace_and_the_html_report_carry_the_stories(monkeypatch, tmp_path):
    from minisched.observe.report import render_report
    from minisched.observe.trace import chrome_trace

    run = simulate_run(monkeypatch, num_pages=90, chunk_size=32)
    events = chrome_trace(run)["traceEvents"]
    decisions = [e for e in events if e.get("cat") == "decision"]
    assert {"why: arrived", "why: finished"} <= {e["name"] for e in decisions}
    assert any("did not fit" in e["args"]["why"] or "budget" in e["args"]["why"] for e in decisions)
    html = tmp_path / "r.html"
    render_report([run], tmp_path / "r.png", html=html)
    page = html.read_text()
    assert page.count("<details>") == len(run.requests) and "waited" in page
