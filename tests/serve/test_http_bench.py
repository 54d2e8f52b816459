"""The HTTP benchmark client (minisched.observe.http_bench) against a live server: every request
measured, the same summary keys and run-file layout as the in-process bench, failures counted."""

from __future__ import annotations

from helpers.serve import TINY, running_server
from minisched.engine import Engine
from minisched.observe.http_bench import run_http_bench
from minisched.observe.run_record import load_runs, save_runs
from minisched.observe.workloads import make_workload, run_workload, summarize


def test_http_bench_measures_every_request(tmp_path):
    workload = make_workload("shared-prefix", 12, 40.0, vocab=512, seed=1, scale=0.1)
    engine = Engine(TINY, num_pages=512)
    in_process = summarize(run_workload(Engine(TINY, num_pages=512), workload))
    seen = []
    with running_server(engine, api_key="k") as live:
        summary, record = run_http_bench(live.url + "/v1", workload, api_key="k", progress=seen.append)
        bad, _ = run_http_bench(live.url, workload[:3], model="tiny", api_key="wrong")
    assert summary["completed"] == 12 and summary["failed"] == 0 and summary["model"] == "tiny"
    assert summary["output_tokens"] == sum(r.max_new_tokens for r in workload)
    assert summary["input_tokens"] == sum(len(r.prompt_ids) for r in workload)
    assert summary["cached_tokens"] > 0  # the shared prefixes hit the radix cache
    assert set(in_process) <= set(summary) and summary["itl_s"]["p50"] is not None
    assert 0 < summary["ttft_s"]["p50"] <= summary["e2e_latency_s"]["p50"]
    assert seen and seen[-1]["done"] == 12
    assert [r["status"] for r in record.requests] == ["finished"] * 12
    assert all(r["ttft"] is not None and r["ttft"] <= r["e2e_latency"] for r in record.requests)
    save_runs(tmp_path / "run.json", [record])
    assert load_runs(tmp_path / "run.json")[0].summary["completed"] == 12
    assert bad["failed"] == 3 and bad["completed"] == 0 and "HTTP 401" in bad["errors"][0]
