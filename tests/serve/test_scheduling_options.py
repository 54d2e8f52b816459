"""Scheduling options through the server: the `priority` body field (vLLM's: lower = more urgent) with
and without `--priority-scheduling`; a speculative (n-gram) engine answers as the plain one, streamed
and not."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.serve import PATHS, ROUTES, TINY, route_body, running_server
from minisched.engine import Engine


def complete(live, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(live.v1 + "/completions", json=body, timeout=30)


@pytest.mark.parametrize("route", ROUTES)
def test_priority_field_is_refused_without_priority_scheduling(tiny_server, route):
    def post(priority) -> httpx.Response:
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "temperature": 0, "priority": priority}
        return httpx.post(tiny_server.url + PATHS[route], json=route_body(route, body), timeout=30)

    assert post(0).status_code == 200
    r = post(2)
    assert r.status_code == 400 and "priority scheduling is not enabled" in r.json()["error"]["message"]
    assert post(1.5).status_code == 400


@pytest.fixture(scope="module")
def priority_server():
    engine = Engine(TINY, num_pages=128, priority_scheduling=True)
    with running_server(engine) as live:
        yield live
    assert not live.loop.invariant_errors, live.loop.invariant_errors


def test_priority_requests_run_and_equal_the_default(priority_server, tiny_server):
    ref = complete(tiny_server).json()["choices"][0]["text"]
    for p in (-3, 0, 7):
        r = complete(priority_server, priority=p)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref


def test_speculative_server_returns_the_same_greedy_text(tiny_server):
    engine = Engine(TINY, num_pages=128, speculative="ngram", num_draft_tokens=3)
    with running_server(engine) as live:
        for prompt in ("abcabcabcabc", "hello"):
            want = complete(tiny_server, prompt=prompt, max_tokens=12).json()["choices"][0]["text"]
            r = complete(live, prompt=prompt, max_tokens=12)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
            with httpx.stream("POST", live.v1 + "/completions", json=body, timeout=30) as s:
                text = "".join(
                    json.loads(line[6:])["choices"][0]["text"]
                    for line in s.iter_lines()
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]
                )
            assert text == want
    assert not live.loop.invariant_errors, live.loop.invariant_errors
