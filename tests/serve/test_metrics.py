"""/metrics tells the truth on an idle server: every state change the engine makes -- an abort handled
between steps included -- is in the next snapshot (regression: a client that hung up in the middle of a
chunked prefill left `num_requests_waiting 1` and its prefix pages locked until the next request's step)."""

from __future__ import annotations

import re
import threading
import time

import httpx

from helpers.serve import TINY, running_server
from minisched.engine import Engine


def gauge(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_abort_mid_chunked_prefill_shows_in_metrics_without_another_step():
    engine = Engine(TINY, num_pages=512, chunk_size=8, page_size=4)
    with running_server(engine) as live, httpx.Client(base_url=live.url, timeout=30) as c:
        stop = threading.Event()

        def client():  # streams a long prompt and hangs up mid-prefill
            body = {"model": "tiny", "prompt": [5 + i % 200 for i in range(1800)], "max_tokens": 4, "stream": True}
            with httpx.stream("POST", live.v1 + "/completions", json=body, timeout=30) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break
                stop.wait(30)

        t = threading.Thread(target=client, daemon=True)
        t.start()
        deadline = time.monotonic() + 20
        while gauge(c.get("/metrics").text, "minisched_num_requests_waiting") < 1:  # its chunks are running
            assert time.monotonic() < deadline, "the prefill never showed in /metrics"
            time.sleep(0.005)
        stop.set()  # the client goes away: the server aborts the request between two chunks
        t.join(10)
        time.sleep(1.0)  # no other request: no further step runs
        text = c.get("/metrics").text
        assert gauge(text, "minisched_num_requests_waiting") == 0
        assert gauge(text, "minisched_num_requests_running") == 0
        cached, evictable = gauge(text, "minisched_kv_pages_cached"), gauge(text, "minisched_kv_pages_evictable")
        assert cached > 0 and evictable == cached  # its prefix pages stay cached, and nothing locks them
        steps = gauge(text, "minisched_engine_steps_total")
        time.sleep(0.5)
        assert gauge(c.get("/metrics").text, "minisched_engine_steps_total") == steps  # idle: truly no step


def counter(text: str, name: str) -> float:
    return float(re.search(rf"^{name}_total (\S+)$", text, re.M).group(1))


def test_priority_preemptions_spec_and_grammar_counters_are_in_metrics():
    """A more urgent request preempting a running one is counted (minisched_retractions_total counts
    memory retractions only); grammar compiles and their seconds too."""
    engine = Engine(TINY, num_pages=256, max_running_requests=1, priority_scheduling=True)
    with running_server(engine) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        text = c.get("/metrics").text
        assert counter(text, "minisched_num_preemptions") == 0
        assert counter(text, "minisched_spec_decode_num_draft_tokens") == 0
        started = threading.Event()

        def low():
            body = {"model": "tiny", "prompt": "slow", "max_tokens": 1500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", live.v1 + "/completions", json={**body, "priority": 1000}, timeout=60) as r:
                for _ in r.iter_lines():
                    started.set()

        t = threading.Thread(target=low)
        t.start()
        assert started.wait(30)
        urgent = {"model": "tiny", "prompt": "now", "max_tokens": 2, "priority": -1000}
        assert c.post("/v1/completions", json=urgent).status_code == 200
        t.join(60)
        grammar = {"model": "tiny", "prompt": "g", "max_tokens": 3, "regex": "(a|b)c"}
        assert c.post("/v1/completions", json=grammar).status_code == 200
        text = c.get("/metrics").text
        assert counter(text, "minisched_num_preemptions") >= 1, text
        assert counter(text, "minisched_grammar_compiles") == 1
        assert counter(text, "minisched_grammar_compile_seconds") > 0
        assert counter(text, "minisched_grammar_compile_timeouts") == 0
