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
