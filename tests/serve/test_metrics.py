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


def histogram_count(text: str, name: str, le: str = "+Inf") -> float:
    return float(re.search(rf'^{name}_bucket{{le="{re.escape(le)}"}} (\S+)$', text, re.M).group(1))


def test_grammar_compile_times_are_a_histogram():
    """SGLang's grammar_compilation_time_seconds: one observation per compile (a cached grammar
    is none), its sum the compile seconds."""
    with running_server(Engine(TINY, num_pages=128)) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        assert histogram_count(c.get("/metrics").text, "minisched_grammar_compilation_time_seconds") == 0
        for regex in ("(a|b)c", "(d|e)f", "(a|b)c"):  # the third is the first's, from the cache
            body = {"model": "tiny", "prompt": "g", "max_tokens": 3, "regex": regex}
            assert c.post("/v1/completions", json=body).status_code == 200
        text = c.get("/metrics").text
    assert histogram_count(text, "minisched_grammar_compilation_time_seconds") == 2, text
    assert histogram_count(text, "minisched_grammar_compilation_time_seconds", "0.01") <= 2
    total = gauge(text, "minisched_grammar_compilation_time_seconds_sum")
    assert total > 0 and total == counter(text, "minisched_grammar_compile_seconds")


def test_speculative_drafted_and_accepted_tokens_are_counted():
    """vLLM's spec_decode_num_draft_tokens / num_accepted_tokens move with ngram drafting (a prompt
    that repeats itself drafts from the first step)."""
    engine = Engine(TINY, num_pages=128, speculative="ngram", num_draft_tokens=3)
    with running_server(engine) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        assert counter(c.get("/metrics").text, "minisched_spec_decode_num_draft_tokens") == 0
        for prompt in ([5, 6, 7, 8] * 8, [9, 10, 11] * 10):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            assert c.post("/v1/completions", json=body).status_code == 200
        text = c.get("/metrics").text
    drafted = counter(text, "minisched_spec_decode_num_draft_tokens")
    accepted = counter(text, "minisched_spec_decode_num_accepted_tokens")
    assert drafted > 0 and 0 < accepted <= drafted, (drafted, accepted)
    snap = engine.scheduler.snapshot().spec
    assert (snap.draft_tokens, snap.accepted_tokens) == (drafted, accepted)


def test_host_tier_write_backs_loads_and_drops_are_counted():
    """A pool too small for the prompts: the radix cache's evicted prefixes go to the host tier
    (write-backs), a prompt seen before comes back from it (loads); a host tier of a prompt and a half
    drops the older ones."""
    engine = Engine(TINY, num_pages=24, page_size=4, chunk_size=16, host_kv_pages=12)
    prompts = [[10 + 40 * k + i for i in range(32)] for k in range(6)]  # 8 pages each, the pool holds 2.5
    with running_server(engine) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        text = c.get("/metrics").text
        assert (
            counter(text, "minisched_host_kv_write_backs") == 0 and gauge(text, "minisched_host_kv_pages_total") == 12
        )
        for prompt in [prompts[0], prompts[1], prompts[2], prompts[0], *prompts[3:]]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            assert c.post("/v1/completions", json=body).status_code == 200
        text = c.get("/metrics").text
    host = engine.host_tier.stats
    for name, value in (
        ("minisched_host_kv_write_backs", host.write_backs),
        ("minisched_host_kv_write_back_pages", host.write_back_pages),
        ("minisched_host_kv_loads", host.loads),
        ("minisched_host_kv_load_pages", host.load_pages),
        ("minisched_host_kv_dropped_pages", host.dropped_pages),
    ):
        assert counter(text, name) == value > 0, (name, value, text)
