"""Bad input, the API key, overload and a failing engine step: each gets OpenAI's error body with
the right status, and the server (and the other requests) carry on. Every bad body is tried on every
generation route that can say it (/v1/completions, /v1/chat/completions, SGLang's /generate with SGLang's
error body): one request entry, one set of bounds (serve/entry.py)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from helpers.serve import PATHS, route_body, route_cases, route_error, route_param, running_server
from minisched.engine import Engine
from minisched.sched.sampling_params import SamplingParams
from minisched.serve.engine_loop import EngineLoop
from minisched.serve.limits import ServerLimits

CHAT = [{"role": "user", "content": "hi"}]


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and "Traceback" not in r.text
    return body["error"]


BAD_COMPLETIONS = [  # (id, body, status, param)
    ("wrong-type-temperature", {"temperature": "0.5"}, 400, "temperature"),
    ("wrong-type-max-tokens-bool", {"max_tokens": True}, 400, "max_tokens"),
    ("wrong-type-prompt", {"prompt": 5}, 400, "prompt"),
    ("wrong-type-stream", {"stream": "yes"}, 400, "stream"),
    ("missing-model", {"model": None}, 400, "model"),
    ("temperature-too-high", {"temperature": 2.5}, 400, "temperature"),
    ("temperature-negative", {"temperature": -1}, 400, "temperature"),
    ("top-p-zero", {"top_p": 0}, 400, "top_p"),
    ("top-p-above-one", {"top_p": 1.5}, 400, "top_p"),
    ("top-k-zero", {"top_k": 0}, 400, "top_k"),
    ("seed-negative", {"seed": -1}, 400, "seed"),
    ("seed-too-big", {"seed": 2**64}, 400, "seed"),
    ("too-many-stops", {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("ten-thousand-stops", {"stop": [f"s{i}" for i in range(10_000)]}, 400, "stop"),
    ("empty-stop", {"stop": [""]}, 400, "stop"),
    ("empty-prompt", {"prompt": ""}, 400, "prompt"),
    ("empty-token-prompt", {"prompt": []}, 400, "prompt"),
    ("token-out-of-vocab", {"prompt": [5, 512]}, 400, "prompt"),
    ("negative-token", {"prompt": [5, -1]}, 400, "prompt"),
    ("prompt-longer-than-context", {"prompt": "x" * 2048}, 400, "prompt"),
    ("max-tokens-negative", {"max_tokens": -1}, 400, "max_tokens"),
    ("n-zero", {"n": 0}, 400, "n"),
    ("n-too-many", {"n": 65}, 400, "n"),
    ("logprobs-above-five", {"logprobs": 6}, 400, "logprobs"),
    ("penalty-out-of-range", {"presence_penalty": 2.5}, 400, "presence_penalty"),
    ("repetition-penalty-zero", {"repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min-p-above-one", {"min_p": 1.5}, 400, "min_p"),
    ("min-tokens-negative", {"min_tokens": -1}, 400, "min_tokens"),
    ("logit-bias-not-an-id", {"logit_bias": {"abc": 1.0}}, 400, "logit_bias"),
    ("logit-bias-too-big", {"logit_bias": {"5": 101.0}}, 400, "logit_bias"),
    ("stop-token-negative", {"stop_token_ids": [-3]}, 400, "stop_token_ids"),
    ("best-of-above-n", {"best_of": 3}, 400, "best_of"),
    ("suffix", {"suffix": "x"}, 400, "suffix"),
    ("batched-prompt-empty", {"prompt": ["a", ""]}, 400, "prompt"),
    ("invalid-regex", {"regex": "[a-"}, 400, "regex"),
    ("invalid-ebnf", {"ebnf": "root ::= "}, 400, "ebnf"),
    (
        "invalid-json-schema",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
        400,
        "response_format",
    ),
    ("json-schema-missing", {"response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("two-grammars", {"regex": "a+", "ebnf": 'root ::= "a"'}, 400, "response_format"),
    ("unknown-model", {"model": "gpt-4"}, 404, "model"),
]


BASE = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
COMPLETIONS_ONLY = {"logprobs-above-five": ("completions",)}  # chat's top_logprobs and SGLang's go to 20


@pytest.mark.parametrize("route,patch,status,param", route_cases(BAD_COMPLETIONS, BASE, only=COMPLETIONS_ONLY))
def test_bad_requests_on_every_route(tiny_server, route, patch, status, param):
    full = {k: v for k, v in {**BASE, **patch}.items() if v is not None}
    body = route_body(route, full)
    with httpx.Client(base_url=tiny_server.url, timeout=10) as c:
        err = route_error(c.post(PATHS[route], json=body), status, route)
    if route == "generate":  # SGLang's body has no param: the message names the field as the client spelled it
        want = "context length" if patch.get("prompt") == "x" * 2048 else route_param(route, param, full)
        assert want in err["message"], err
        return
    assert err["param"] == ("messages" if route == "chat" and param == "prompt" else param)
    assert err["type"] == "invalid_request_error"
    if patch.get("prompt") == "x" * 2048:
        assert err["code"] == "context_length_exceeded"


BAD_CHATS = [
    ("empty-messages", {"messages": []}, "messages"),
    ("no-messages", {"messages": None}, "messages"),
    ("bad-role", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("content-wrong-type", {"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
    ("tools", {"tools": [{"type": "function"}]}, "tools"),
    ("top-logprobs-without-logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("top-logprobs-above-twenty", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("response-format-unknown-type", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("chat-too-long", {"messages": [{"role": "user", "content": "y" * 2100}]}, "messages"),
]


@pytest.mark.parametrize("patch,param", [c[1:] for c in BAD_CHATS], ids=[c[0] for c in BAD_CHATS])
def test_bad_chat_requests(tiny_server, patch, param):
    body = {k: v for k, v in {"model": "tiny", "messages": CHAT, "max_tokens": 4, **patch}.items() if v is not None}
    with httpx.Client(base_url=tiny_server.url, timeout=10) as c:
        err = error_of(c.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param


def test_malformed_bodies_and_routes(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=10) as c:
        json_h = {"content-type": "application/json"}
        assert (
            "parse the JSON"
            in error_of(c.post("/v1/completions", content=b'{"model": "tiny", ', headers=json_h), 400)["message"]
        )
        assert (
            "JSON object" in error_of(c.post("/v1/chat/completions", content=b"[1, 2]", headers=json_h), 400)["message"]
        )
        error_of(c.post("/v1/completions", content=b"\xff\xfe", headers=json_h), 400)
        error_of(c.post("/v1/completions"), 400)
        error_of(c.get("/v1/nothing-here"), 404)
        error_of(c.get("/v1/completions"), 405)
        # the server still answers normally
        ok = c.post("/v1/completions", json={"model": "tiny", "prompt": "fine", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_api_key():
    engine = Engine("dummy:tiny", num_pages=64)
    with running_server(engine, api_key="sekrit") as live:
        with httpx.Client(base_url=live.url, timeout=10) as c:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            assert error_of(c.post("/v1/completions", json=body), 401)["code"] == "invalid_api_key"
            error_of(c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
            error_of(c.post("/v1/completions", content=b"{bad", headers={"Authorization": "sekrit"}), 401)
            error_of(c.get("/v1/models"), 401)
            # the stated rule: /health and /metrics need no key
            assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        ok = openai.OpenAI(base_url=live.v1, api_key="sekrit", max_retries=0).completions.create(
            model="tiny", prompt="hi", max_tokens=2
        )
        assert ok.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.v1, api_key="nope", max_retries=0).models.list()


def test_queue_limit_gives_429_with_retry_after():
    engine = Engine("dummy:tiny", num_pages=64)
    with running_server(engine, limits=ServerLimits(max_queued_requests=2)) as live:
        gate = threading.Event()
        blocked = live.loop.call(lambda e: gate.wait(30))  # hold the engine thread: requests stay queued
        results = []

        def post():
            with httpx.Client(base_url=live.url, timeout=30) as c:
                results.append(c.post("/v1/completions", json={"model": "tiny", "prompt": "q", "max_tokens": 2}))

        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        with httpx.Client(base_url=live.url, timeout=10) as c:
            for _ in range(200):  # until both are admitted (queued) on the server
                if live.state.queued == 2:
                    break
                threading.Event().wait(0.01)
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "q", "max_tokens": 2})
            err = error_of(r, 429)
            assert err["type"] == "rate_limit_error" and int(r.headers["Retry-After"]) >= 1
            assert c.get("/health").status_code == 200  # overload is not ill health
        gate.set()
        blocked.result(10)
        for t in threads:
            t.join(30)
        assert [x.status_code for x in results] == [200, 200]
        assert live.state.queued == 0
        assert 'minisched_requests_rejected_total{reason="queue_full"} 1.0' in httpx.get(live.url + "/metrics").text


def test_failing_step_is_an_error_for_its_requests_only():
    engine = Engine("dummy:tiny", num_pages=64)
    with running_server(engine) as live:

        def break_next_forward(e):
            real = e.runner.forward

            def forward(batch):
                e.runner.forward = real  # fail once
                raise RuntimeError("injected fault")

            e.runner.forward = forward

        live.call(break_next_forward)
        with httpx.Client(base_url=live.url, timeout=30) as c:
            err = error_of(c.post("/v1/completions", json={"model": "tiny", "prompt": "boom", "max_tokens": 4}), 500)
            assert err["type"] == "server_error" and "injected fault" in err["message"]
            ok = c.post("/v1/completions", json={"model": "tiny", "prompt": "fine", "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
            live.call(break_next_forward)
            with c.stream(
                "POST", "/v1/completions", json={"model": "tiny", "prompt": "boom", "max_tokens": 4, "stream": True}
            ) as r:
                lines = [x for x in r.iter_lines() if x]
            assert '"server_error"' in lines[-2] and lines[-1] == "data: [DONE]"
        assert "minisched_engine_loop_errors_total 2.0" in httpx.get(live.url + "/metrics").text
        free, cached, total = live.call(
            lambda e: (e.scheduler.pool.num_free, e.scheduler.tree.total_pages, e.sched_config.num_pages)
        )
        assert free + cached == total


def test_requests_after_the_engine_loop_stopped_are_answered():
    class Sink:
        def __init__(self, loop):
            self.loop, self.got = loop, []

        def deliver(self, upd):
            self.got.append(upd)

    async def run():
        loop = EngineLoop(Engine("dummy:tiny", num_pages=64)).start()
        sinks = [Sink(asyncio.get_running_loop()) for _ in range(3)]
        loop.submit(["a"], [5, 6, 7], SamplingParams(max_new_tokens=500, ignore_eos=True), [sinks[0]])
        loop.stop()
        loop.submit(["b"], [5, 6, 7], SamplingParams(max_new_tokens=5), [sinks[1]])  # after the stop
        late_call = loop.call(lambda e: 1)
        await asyncio.to_thread(loop.join, 10)
        loop.submit(["c"], [5], SamplingParams(max_new_tokens=5), [sinks[2]])  # after the thread ended
        await asyncio.sleep(0.05)  # the published updates run on this loop
        return sinks, late_call

    sinks, late_call = asyncio.run(run())
    assert [u.finish_reason for u in sinks[0].got][-1] == "abort"
    assert [u.finish_reason for u in sinks[1].got] == ["abort"]
    assert [u.finish_reason for u in sinks[2].got] == ["abort"]
    with pytest.raises(RuntimeError, match="stopped"):
        late_call.result(1)
