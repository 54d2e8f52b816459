"""`--dp 2` end to end: two engine processes (dummy:tiny) behind one HTTP server on 127.0.0.1.

Greedy outputs equal one engine's; shared prefixes stay on one replica (cache hits); a replica
killed with SIGKILL under load fails its own requests cleanly and fast while the other keeps
serving; a replica that cannot start fails the start with a one-line reason.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import time

import httpx
import openai
import pytest

from helpers.serve import pool_server
from minisched.engine import Engine
from minisched.sched.sampling_params import SamplingParams
from minisched.serve.pool import EnginePool
from minisched.serve.replica import ReplicaStartError
from minisched.serve.router import RouterConfig

TINY = functools.partial(Engine, "dummy:tiny", num_pages=256)
SYS_A = "You are a careful assistant. Answer in one short sentence. "  # 59 byte tokens: 3 whole pages
SYS_B = "Translate the following text into French, keeping the tone. "


def dp_server(n: int = 2, router: RouterConfig = RouterConfig()):
    return pool_server([TINY] * n, router=router)


@pytest.fixture(scope="module")
def dp2():
    with dp_server(2) as live:
        yield live


def test_greedy_outputs_equal_one_engine_and_prefixes_stick(dp2):
    url, pool = dp2
    prompts = [SYS_A + q for q in ("What is a cache?", "Why route by prefix?", "Name a prime.")] + [
        SYS_B + q for q in ("Good morning.", "The cat sleeps.", "See you soon.")
    ]
    ref = Engine("dummy:tiny", num_pages=256).generate(prompts, SamplingParams(max_new_tokens=10))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

    async def run():
        # one of each prefix first (they land on different replicas: the empty one takes a new prefix) ...
        first = [
            await client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0)
            for p in (prompts[0], prompts[3])
        ]
        rest = await asyncio.gather(
            *(
                client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0)
                for p in prompts[1:3] + prompts[4:]
            )
        )
        return first[:1] + list(rest[:2]) + first[1:] + list(rest[2:])

    out = asyncio.run(asyncio.wait_for(run(), 120))
    assert [o.choices[0].text for o in out] == [r.text for r in ref]
    # ... and then every request of a prefix follows it there, reusing its 3 cached pages
    assert [o.usage.prompt_tokens_details.cached_tokens for o in out] == [0, 48, 48, 0, 48, 48]
    health = httpx.get(url + "/health", timeout=10).json()
    assert health["status"] == "ok"
    assert sorted(r["routed"] for r in health["replicas"]) == [3, 3]
    assert all(r["cached_tokens"] == 96 for r in health["replicas"])


def test_streaming_and_metrics_over_replicas(dp2):
    url, pool = dp2
    body = {
        "model": "tiny",
        "prompt": "stream across replicas",
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line]
        metrics = c.get("/metrics").text
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 12
    total = [line for line in metrics.splitlines() if line.startswith("minisched_kv_pages_total ")]
    assert float(total[0].split()[1]) == 2 * 256  # the replicas' pools, summed
    assert (
        'minisched_dp_replica_up{replica="0"} 1.0' in metrics and 'minisched_dp_replica_up{replica="1"} 1.0' in metrics
    )
    assert 'minisched_dp_replica_cache_hit_rate{replica="1"}' in metrics


async def _stream(c: httpx.AsyncClient, prompt: str, started: asyncio.Event, stop: asyncio.Event) -> dict:
    out = {"rid": None, "error": None, "error_at": None, "finish": None, "chunk_times": [], "done": False}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        out["rid"] = r.headers["x-request-id"]
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out["done"] = True
                break
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                out["error"], out["error_at"] = ev["error"], time.monotonic()
            elif ev["choices"]:
                out["chunk_times"].append(time.monotonic())
                out["finish"] = ev["choices"][0]["finish_reason"]
                started.set()
            if stop.is_set():
                break  # the client goes away: the server aborts the request
    return out


def test_killed_replica_fails_its_requests_and_the_other_keeps_serving():
    with dp_server(2) as (url, pool):

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                started = [asyncio.Event() for _ in range(4)]
                stop = asyncio.Event()
                tasks = [
                    asyncio.create_task(_stream(c, f"long request number {i}: " + "abc" * 10, started[i], stop))
                    for i in range(4)
                ]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                victim, survivor = pool.replicas[1], pool.replicas[0]
                doomed = {rid.rsplit("-", 1)[0] for rid in victim.live_rids()}  # engine ids: <response id>-<choice>
                assert doomed and survivor.in_flight > 0, "the requests did not spread over both replicas"
                killed_at = time.monotonic()
                os.kill(victim.process.pid, signal.SIGKILL)
                results = {}
                for t in asyncio.as_completed(tasks, timeout=30):
                    res = await t
                    results[res["rid"]] = res
                    if len(results) == len(doomed):
                        break
                assert set(results) == doomed  # the killed replica's requests end first, with an error
                for res in results.values():
                    assert res["done"] and "SIGKILL" in res["error"]["message"]
                    assert res["error"]["type"] == "server_error"
                    assert res["error_at"] - killed_at < 5.0
                health = await c.get("/health")
                assert health.status_code == 200 and health.json()["status"] == "degraded"
                assert [r["alive"] for r in health.json()["replicas"]] == [True, False]
                fresh = await c.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": "still there?", "max_tokens": 4, "temperature": 0},
                )
                assert fresh.status_code == 200 and fresh.json()["choices"][0]["finish_reason"] == "length"
                stop.set()
                rest = await asyncio.wait_for(asyncio.gather(*(t for t in tasks if not t.done())), 60)
                for res in rest:  # the survivor's streams ran on after the kill, without an error
                    assert res["error"] is None and res["chunk_times"][-1] > killed_at
                deadline = time.monotonic() + 10
                while survivor.in_flight and time.monotonic() < deadline:  # the disconnects were aborted
                    await asyncio.sleep(0.05)
                assert survivor.in_flight == 0
                os.kill(survivor.process.pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while pool.is_alive() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert (await c.get("/health")).status_code == 503
                down = await c.post("/v1/completions", json={"model": "tiny", "prompt": "anyone?", "max_tokens": 4})
                assert down.status_code == 503 and down.json()["error"]["code"] == "engine_stopped"

        asyncio.run(asyncio.wait_for(run(), 150))


def test_a_replica_that_cannot_start_fails_the_start_cleanly():
    pool = EnginePool([TINY, functools.partial(Engine, "dummy:nope")], start_timeout=120)
    with pytest.raises(ReplicaStartError, match=r"replica 1 failed to start: ValueError: unknown model preset 'nope'"):
        pool.start()
    assert not any(r.process.is_alive() for r in pool.replicas)
