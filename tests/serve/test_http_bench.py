"""The HTTP benchmark client (minisched.observe.http_bench) against a live server: every request
measured, the same summary keys and run-file layout as the in-process bench, failures counted."""

from __future__ import annotations

import pytest

from helpers.serve import TINY, running_server
from minisched.engine import Engine
from minisched.observe.http_bench import run_http_bench, run_http_conversations
from minisched.observe.run_record import load_runs, save_runs
from minisched.observe.workloads import make_conversations, make_workload, run_workload, summarize


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


def test_generate_api_with_a_bound_on_streams():
    """SGLang's /generate (token ids, the route through sglang-router), at most 3 requests in flight."""
    workload = make_workload("shared-prefix", 9, 0.0, vocab=512, seed=2, scale=0.1)
    with running_server(Engine(TINY, num_pages=512)) as live:
        summary, record = run_http_bench(live.url, workload, api="generate", concurrency=3)
        peak = max_in_flight(record.requests)
    assert summary["completed"] == 9 and summary["failed"] == 0, summary["errors"]
    assert summary["output_tokens"] == sum(r.max_new_tokens for r in workload)
    assert summary["cached_tokens"] > 0  # meta_info.cached_tokens reached the summary
    assert peak == 3  # closed loop: never more than 3 streams, and 3 while requests wait
    assert all(0 < r["ttft"] <= r["e2e_latency"] for r in record.requests)


def max_in_flight(requests: list[dict]) -> int:
    """The most requests between arrival (sent) and finish at any time, from a run file's rows."""
    edges = sorted([(r["arrival"], 1) for r in requests] + [(r["arrival"] + r["e2e_latency"], -1) for r in requests])
    peak = now = 0
    for _, d in sorted(edges, key=lambda e: (e[0], e[1])):
        now += d
        peak = max(peak, now)
    return peak


def test_conversations_carry_their_replies_and_hit_the_cache():
    convs = make_conversations(3, 3, vocab=512, seed=0, scale=0.3)
    with running_server(Engine(TINY, num_pages=512)) as live:
        summary, record = run_http_conversations(live.url, convs)
    assert summary["completed"] == 9 and summary["failed"] == 0, summary["errors"]
    rows = {r["rid"]: r for r in record.requests}
    for c in convs:  # turn t's prompt: every earlier turn's tokens and reply + its own
        want = 0
        for t, (user, out) in enumerate(c.turns):
            want += len(user)
            assert rows[f"{c.cid}-t{t}"]["prompt_tokens"] == want
            want += out
    assert summary["later_turn_hit_rate"] > 0.5  # the conversation so far came from the radix cache
    with pytest.raises(ValueError, match="generate"):
        run_http_conversations("http://127.0.0.1:9", convs, api="completions")
