"""A fleet: `minisched serve` workers behind the real sglang-router (0.3.2, its own venv: `make
router-env`), all on 127.0.0.1. Registration under the served name, the OpenAI routes and
/generate through the router, cache-aware routing against round-robin (the workers'
cached_tokens), /flush_cache fanned out, request ids joining router and worker logs, a worker
killed mid-run, a worker added at runtime.

The tests run in file order on one fleet (module fixture): the kill comes after everything that
needs both workers, the added worker last.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from helpers.fleet import (
    finished_requests,
    router_python,
    router_workers,
    start_router,
    start_worker,
    wait_healthy,
    wait_registered,
)

ROUTER_PY = router_python()
pytestmark = [
    pytest.mark.skipif(
        ROUTER_PY is None, reason="sglang-router not installed (make router-env, or MINISCHED_SGLANG_ROUTER)"
    ),
    pytest.mark.timeout(120),
]
PAGE = 16


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp: Path = tmp_path_factory.mktemp("fleet")
    procs = []
    try:
        a, b, c = (start_worker(n, tmp) for n in ("worker-a", "worker-b", "worker-c"))
        procs += [a, b, c]
        for w in (a, b, c):
            wait_healthy(w, 90)
        ca = start_router(ROUTER_PY, [a, b], "cache_aware", tmp)
        rr = start_router(ROUTER_PY, [a, b], "round_robin", tmp)
        procs += [ca, rr]
        for r in (ca, rr):
            wait_healthy(r, 30, "/liveness")
            wait_registered(r, [a.url, b.url], 30)
        yield {"a": a, "b": b, "c": c, "ca": ca, "rr": rr}
    finally:
        for p in procs:
            p.kill()
    assert not any(p.alive() for p in procs)


def oai(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_registration_under_the_served_name(fleet):
    rows = router_workers(fleet["ca"])
    assert {row["model_id"] for row in rows.values()} == {"tiny"}  # not "unknown"
    assert all(row["metadata"]["served_model_name"] == "tiny" for row in rows.values())
    assert [m.id for m in oai(fleet["ca"]).models.list().data] == ["tiny"]
    loads = httpx.get(fleet["ca"].url + "/get_loads", timeout=10).json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted([fleet["a"].url, fleet["b"].url])
    assert all(w["load"] >= 0 for w in loads)  # /get_load answered (-1: it failed)


def test_chat_completions_and_generate_through_the_router(fleet):
    direct, routed = oai(fleet["a"]), oai(fleet["ca"])
    msgs = [{"role": "user", "content": "Name a fruit."}]
    want = direct.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    got = routed.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    want = direct.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0)
    got = routed.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0)
    assert got.choices[0].text == want.choices[0].text and got.usage.completion_tokens == 8
    streamed = routed.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == want.choices[0].text
    body = {"input_ids": [40, 41, 42, 43], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    want = httpx.post(fleet["a"].url + "/generate", json=body, timeout=30).json()
    got = httpx.post(fleet["ca"].url + "/generate", json=body, timeout=30)  # token ids: only /generate takes them
    assert got.status_code == 200 and got.json()["output_ids"] == want["output_ids"]
    events = []
    with httpx.stream("POST", fleet["ca"].url + "/generate", json={**body, "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]" and json.loads(events[-2])["output_ids"] == want["output_ids"]


def conversations(router, n_conv: int = 3, turns: int = 3) -> list[list[tuple[int, int]]]:
    """n_conv multi-turn conversations, turn by turn across them; (prompt_tokens, cached_tokens) per turn."""
    client = oai(router)
    history = [f"[conversation {c}] " + f"topic {c} " * 12 for c in range(n_conv)]
    seen: list[list[tuple[int, int]]] = [[] for _ in range(n_conv)]
    for t in range(turns):
        for c in range(n_conv):
            history[c] += f"\nUser: question {t} about topic {c}, please answer.\nAssistant:"
            r = client.completions.create(model="tiny", prompt=history[c], max_tokens=8, temperature=0)
            history[c] += r.choices[0].text
            seen[c].append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
    return seen


def hit_rate(seen) -> float:
    later = [turn for conv in seen for turn in conv[1:]]
    return sum(c for _, c in later) / sum(p for p, _ in later)


def test_cache_aware_keeps_each_conversation_on_one_worker(fleet):
    assert httpx.post(fleet["ca"].url + "/flush_cache", timeout=30).status_code == 200
    aware = conversations(fleet["ca"])
    for conv in aware:  # every later turn finds the whole previous prompt (page-aligned) cached
        for (prev, _), (_, cached) in zip(conv, conv[1:]):
            assert cached >= prev // PAGE * PAGE, aware
    assert httpx.post(fleet["rr"].url + "/flush_cache", timeout=30).status_code == 200
    rr = conversations(fleet["rr"])  # 3 conversations on 2 workers: each turn lands on the other worker
    assert all(conv[1][1] == 0 for conv in rr), rr
    assert hit_rate(rr) < 0.6 * hit_rate(aware), (aware, rr)  # measured: 0.37 vs 0.77


def test_flush_cache_through_the_router_reaches_every_worker(fleet):
    prompt = "flush me " * 8
    for w in (fleet["a"], fleet["b"]):
        for _ in range(2):
            r = oai(w).completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens >= PAGE
    r = httpx.post(fleet["ca"].url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "success" and r.json()["workers_flushed"] == 2
    for w in (fleet["a"], fleet["b"]):
        r = oai(w).completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_request_ids_join_router_and_worker_logs(fleet):
    r = httpx.post(
        fleet["ca"].url + "/v1/completions",
        json={"model": "tiny", "prompt": "join the logs", "max_tokens": 2},
        headers={"X-Request-Id": "fleet-req-1"},
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "fleet-req-1"
    g = httpx.post(fleet["ca"].url + "/generate", json={"text": "join", "rid": "fleet-rid-2"}, timeout=30)
    assert g.json()["meta_info"]["id"] == "fleet-rid-2"
    time.sleep(0.2)
    logs = fleet["a"].text() + fleet["b"].text()
    for rid in ("fleet-req-1", "fleet-rid-2"):
        assert f"[{rid}] admitted" in logs and f"[{rid}] finished" in logs, rid


def _stream(url: str, prompt: str, out: dict, started: threading.Event) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1200, "temperature": 0, "ignore_eos": True, "stream": True}
    n, done = 0, False
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        out["error"] = ev["error"]
                    elif ev.get("choices"):
                        n += 1
                        started.set()
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out.update(chunks=n, done=done and "error" not in out)


def test_a_worker_killed_mid_run(fleet):
    rr, a, b = fleet["rr"], fleet["a"], fleet["b"]
    outs = [{} for _ in range(6)]
    starts = [threading.Event() for _ in outs]
    threads = [
        threading.Thread(target=_stream, args=(rr.url, f"stream {i} ", outs[i], starts[i]), daemon=True)
        for i in range(6)
    ]
    for t in threads:
        t.start()
    for s in starts:
        assert s.wait(30), outs
    b.kill()  # mid-run: round-robin put three of the six streams on it
    t0 = time.monotonic()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a stream hung after its worker died"
    done = [o for o in outs if o["done"]]
    failed = [o for o in outs if not o["done"]]
    assert len(done) == 3 and len(failed) == 3, outs  # those on the dead worker end early, cleanly
    assert all(o["chunks"] >= 1 for o in outs)
    wait_registered(rr, [b.url], 15, healthy=False)  # its health checks fail: out of rotation
    assert time.monotonic() - t0 < 60
    before = finished_requests(a)
    client = oai(rr)
    for i in range(6):
        r = client.completions.create(model="tiny", prompt=f"after {i}", max_tokens=2, temperature=0)
        assert r.choices[0].finish_reason == "length"
    assert finished_requests(a) == before + 6  # every one of them on the surviving worker


def test_a_worker_added_at_runtime_receives_traffic(fleet):
    rr, c = fleet["rr"], fleet["c"]
    r = httpx.post(rr.url + "/workers", json={"url": c.url}, timeout=10)
    assert r.status_code in (200, 202), r.text
    rows = wait_registered(rr, [c.url], 30)
    assert rows[c.url]["model_id"] == "tiny"
    before = finished_requests(c)
    client = oai(rr)
    for i in range(4):
        client.completions.create(model="tiny", prompt=f"new worker {i}", max_tokens=2, temperature=0)
    assert finished_requests(c) - before >= 1
