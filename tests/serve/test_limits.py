"""The server's bounds on one request (serve/limits.py, serve/request_body.py): a body over the
limit is a 413 before it is read whole, prompts x n is bounded and counted by the queue, a
disconnect aborts every choice (also a shared prefill), token ids outside the vocabulary, long
stop strings, many logit_bias entries, messages or a large grammar are a 400 naming the option,
and a lone surrogate in a string is no 500. Each error is OpenAI's body (SGLang's on /generate); the
server serves on. Every bound holds on every generation route: /v1/completions, /v1/chat/completions and
SGLang's /generate share one entry (serve/entry.py)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from helpers.serve import PATHS, ROUTES, route_body, route_cases, route_error, route_param, running_server
from minisched.engine import Engine
from minisched.sched.req import ReqStatus
from minisched.serve.limits import ServerLimits

SMALL = ServerLimits(
    max_request_body_bytes=64 * 1024,
    max_choices_per_request=8,
    max_stop_chars=16,
    max_logit_bias=4,
    max_messages=4,
    max_grammar_bytes=2048,
)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in r.text
    return body["error"]


@pytest.fixture(scope="module")
def small_server():
    with running_server(Engine("dummy:tiny", num_pages=128), limits=SMALL) as live:
        yield live
    assert not live.loop.invariant_errors


def completion(**kw) -> dict:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 2, **kw}


def test_body_over_the_limit_is_413_before_it_is_read(small_server):
    with httpx.Client(base_url=small_server.url, timeout=10) as c:
        big = completion(prompt="x" * (70 * 1024))
        err = error_of(c.post("/v1/completions", json=big), 413)
        assert "--max-request-body-bytes" in err["message"] and err["code"] == "request_too_large"
        assert c.post("/v1/completions", json=completion()).status_code == 200
        r = c.post("/generate", json=route_body("generate", big))  # the bound is the server's, on every route
        assert r.status_code == 413 and "--max-request-body-bytes" in r.text, r.text
    # A chunked body never says its size: the answer must come at the first bytes past the limit,
    # while the client is still sending (it never sends the last chunk here).
    host, port = small_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"a" * 4096
        for _ in range(40):  # 160 KiB, more than twice the limit
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # the server answered and closed: what we want
                break
        s.settimeout(10)
        got = b""
        while b"request_too_large" not in got:
            part = s.recv(4096)
            if not part:
                break
            got += part
    assert got.startswith(b"HTTP/1.1 413") and b"--max-request-body-bytes" in got, got[:400]
    assert httpx.get(small_server.url + "/health", timeout=5).status_code == 200


BOUNDS = [  # (id, patch of a completion body, param, option)
    ("prompts-x-n", {"prompt": ["a", "b", "c", "d", "e"], "n": 2}, "n", "--max-choices-per-request"),
    ("token-prompts", {"prompt": [[5, 6]] * 9}, "n", "--max-choices-per-request"),
    ("n", {"n": 9}, "n", "--max-choices-per-request"),
    ("stop-chars", {"stop": ["x" * 17]}, "stop", "--max-stop-chars"),
    ("logit-bias", {"logit_bias": {str(i): 1.0 for i in range(5)}}, "logit_bias", "--max-logit-bias"),
    ("regex", {"regex": "a" * 3000}, "regex", "--max-grammar-bytes"),
    ("ebnf", {"ebnf": 'root ::= "' + "a" * 3000 + '"'}, "ebnf", "--max-grammar-bytes"),
    (
        "json-schema",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": ["a" * 3000]}}}},
        "response_format",
        "--max-grammar-bytes",
    ),
]
BASE = completion()


def check_bound(err: dict, route: str, param: str, option: str, body: dict) -> None:
    assert option in err["message"], err
    if route == "generate":
        assert route_param(route, param, body) in err["message"], err
    else:
        assert err["param"] == param and err["code"] == "limit_exceeded", err


@pytest.mark.parametrize("route,patch,param,option", route_cases(BOUNDS, BASE))
def test_bounds_are_a_400_naming_the_option(small_server, route, patch, param, option):
    full = {**BASE, **patch}
    with httpx.Client(base_url=small_server.url, timeout=10) as c:
        err = route_error(c.post(PATHS[route], json=route_body(route, full)), 400, route)
        check_bound(err, route, param, option, full)
        at = {"n": 4, "stop": ["x" * 16], "logit_bias": {str(i): 1.0 for i in range(4)}}
        ok = completion(**({"prompt": ["a", "b"]} if route != "chat" else {}), **at)
        r = c.post(PATHS[route], json=route_body(route, ok))
        assert r.status_code == 200, r.text  # at the bounds: served


def test_messages_are_bounded(small_server):
    msgs = [{"role": "user", "content": "hi"}] * 5
    with httpx.Client(base_url=small_server.url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 2})
        err = error_of(r, 400)
        assert err["param"] == "messages" and "--max-messages" in err["message"]
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs[:4], "max_tokens": 2})
        assert r.status_code == 200


OUT_OF_VOCABULARY = [
    ("bias-huge-id", {"logit_bias": {"99999999": 5.0}}, "logit_bias"),
    ("bias-vocab-size", {"logit_bias": {"512": 5.0}}, "logit_bias"),  # dummy:tiny's vocabulary is 512
    ("bias-superscript", {"logit_bias": {"²": 5.0}}, "logit_bias"),  # a digit to str.isdigit, not to int()
    ("stop-id-huge", {"stop_token_ids": [1000000000]}, "stop_token_ids"),
    ("stop-id-vocab-size", {"stop_token_ids": [3, 512]}, "stop_token_ids"),
]


@pytest.mark.parametrize("route,patch,param", route_cases(OUT_OF_VOCABULARY, BASE))
def test_token_ids_outside_the_vocabulary_are_a_400(tiny_server, route, patch, param):
    full = completion(**patch)
    with httpx.Client(base_url=tiny_server.url, timeout=10) as c:
        err = route_error(c.post(PATHS[route], json=route_body(route, full)), 400, route)
        if route == "generate":
            assert route_param(route, param, full) in err["message"], err
        else:
            assert err["param"] == param


@pytest.mark.parametrize("route", ROUTES)
def test_many_logit_bias_entries_are_a_400(tiny_server, route):
    body = route_body(route, completion(logit_bias={str(i): 1.0 for i in range(200_000)}))
    with httpx.Client(base_url=tiny_server.url, timeout=30) as c:
        err = route_error(c.post(PATHS[route], json=body), 400, route)
        assert "logit_bias" in err["message"] and "--max-logit-bias" in err["message"]


@pytest.mark.parametrize("route", ROUTES)
def test_a_long_stop_string_is_a_400_at_the_default_bound(tiny_server, route):
    """10,000 characters against the default --max-stop-chars (256)."""
    body = route_body(route, completion(stop=["y" * 10_000]))
    with httpx.Client(base_url=tiny_server.url, timeout=10) as c:
        err = route_error(c.post(PATHS[route], json=body), 400, route)
        assert "--max-stop-chars" in err["message"], err


def test_a_lone_surrogate_is_no_500(tiny_server):
    """`"\\ud800"` is legal JSON but no UTF-8: it becomes U+FFFD (as tiktoken does), everywhere."""
    h = {"content-type": "application/json"}
    with httpx.Client(base_url=tiny_server.url, timeout=10) as c:
        raw = b'{"model": "tiny", "prompt": "ab\\ud800cd", "max_tokens": 2, "echo": true}'
        r = c.post("/v1/completions", content=raw, headers=h)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].startswith("ab\ufffdcd")
        pair = b'{"model": "tiny", "prompt": "\\ud83d\\udc4d", "max_tokens": 1, "echo": true}'  # a valid pair: kept
        assert c.post("/v1/completions", content=pair, headers=h).json()["choices"][0]["text"].startswith("\U0001f44d")
        chat = b'{"model": "tiny", "messages": [{"role": "user", "content": "x\\udfffy"}], "max_tokens": 2}'
        assert c.post("/v1/chat/completions", content=chat, headers=h).status_code == 200
        err = error_of(c.post("/v1/completions", content=b'{"model": "\\ud800", "prompt": "a"}', headers=h), 404)
        assert "\ufffd" in err["message"]
        stop = b'{"model": "tiny", "prompt": "a", "max_tokens": 2, "stop": ["\\udc00"]}'
        assert c.post("/v1/completions", content=stop, headers=h).status_code == 200


def hold_engine(live) -> tuple[threading.Event, object]:
    gate = threading.Event()
    return gate, live.loop.call(lambda e: gate.wait(30))  # the engine thread waits: requests stay queued


def test_the_queue_limit_counts_choices():
    with running_server(Engine("dummy:tiny", num_pages=128), limits=ServerLimits(max_queued_requests=4)) as live:
        gate, blocked = hold_engine(live)
        try:
            with httpx.Client(base_url=live.url, timeout=10) as c:
                # 6 choices > the queue of 4: never admissible, so the choice bound (following the queue) says so
                for route in ("completions", "generate"):
                    body = route_body(route, completion(prompt=["a", "b", "c"], n=2))
                    err = route_error(c.post(PATHS[route], json=body), 400, route)
                    assert "--max-choices-per-request" in err["message"] and "at most 4" in err["message"], err
                assert live.state.queued == 0 and not live.state.live
                done = []
                t = threading.Thread(target=lambda: done.append(c.post("/v1/completions", json=completion(n=3))))
                t.start()
                deadline = time.monotonic() + 10
                while live.state.queued < 3 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert live.state.queued == 3
                with httpx.Client(base_url=live.url, timeout=10) as c2:
                    error_of(c2.post("/v1/completions", json=completion(n=2)), 429)  # 3 + 2 > 4
                    r = c2.post("/generate", json=route_body("generate", completion(n=2)))
                    assert "too many queued requests" in route_error(r, 429, "generate")["message"]
                    gate.set()
                    blocked.result(10)
                    t.join(30)
                    assert done[0].status_code == 200 and len(done[0].json()["choices"]) == 3
                    assert c2.post("/v1/completions", json=completion(n=4)).status_code == 200
        finally:
            gate.set()


def test_a_disconnect_aborts_every_choice_and_their_shared_prefill():
    engine = Engine("dummy:tiny", num_pages=512, chunk_size=8, page_size=4)
    with running_server(engine) as live:
        gate, blocked = hold_engine(live)
        long_prompt = [5 + i % 200 for i in range(1200)]
        body = completion(prompt=[long_prompt, long_prompt[::-1]], n=3, max_tokens=50)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
        time.sleep(0.2)  # the server sees the disconnect and queues the aborts behind the held call
        gate.set()
        blocked.result(10)
        deadline = time.monotonic() + 10
        while live.state.live and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not live.state.live

        def ends(e):
            last = {}
            for ev in e.scheduler.events:
                last[ev.rid] = ev.dst
            return last, e.has_work()

        last, busy = live.call(ends)
        assert not busy
        leads = {rid: st for rid, st in last.items() if rid.endswith("#prompt")}
        assert len(leads) == 2 and set(leads.values()) == {ReqStatus.ABORTED}, leads  # not prefilled for nobody
        assert sum(st is ReqStatus.ABORTED for st in last.values()) == 2 + 6


def refused_quickly(live, route: str, prompt) -> None:
    """Under the byte limit, over the choices one: a 400 naming it, before anything is tokenized or queued."""
    body = json.dumps(route_body(route, completion(prompt=prompt))).encode()
    t0 = time.monotonic()
    r = httpx.post(live.url + PATHS[route], content=body, headers={"content-type": "application/json"})
    err = route_error(r, 400, route)
    assert "--max-choices-per-request" in err["message"] and time.monotonic() - t0 < 5, err
    assert live.state.queued == 0 and not live.state.live


@pytest.mark.parametrize("route", ["completions", "generate"])
def test_a_json_body_of_many_prompts_is_answered_quickly_when_refused(small_server, route):
    refused_quickly(small_server, route, [[5]] * 5000)


@pytest.mark.parametrize("route", ["completions", "generate"])
def test_twenty_thousand_texts_are_a_400_at_the_default_bounds(tiny_server, route):
    refused_quickly(tiny_server, route, ["a"] * 20_000)  # 256 choices at most, by default


def test_a_slow_grammar_is_a_400_and_does_not_stall_the_others():
    """xgrammar compiles this 56 kB schema for half a minute or more: bounded by the compile timeout
    (its worker process killed), while a trivial grammar beside it compiles on the other worker."""
    engine = Engine("dummy:tiny", num_pages=128, grammar_compile_timeout=3.0)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    slow = completion(response_format={"type": "json_schema", "json_schema": {"schema": schema}}, max_tokens=4)
    quick = completion(regex="(cat|dog)", max_tokens=4, temperature=0)
    quick2 = completion(regex="(cow|pig)", max_tokens=4, temperature=0)  # not in the cache
    with running_server(engine, limits=ServerLimits(max_grammar_bytes=1 << 20)) as live:
        warm = httpx.post(live.url + "/v1/completions", json=quick, timeout=60)  # starts both compile workers
        assert warm.status_code == 200, warm.text
        deadline = time.monotonic() + 30
        while engine.grammars.idle_workers() < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        out = {}

        def post_slow():
            t0 = time.monotonic()
            out["slow"] = httpx.post(live.url + "/v1/completions", json=slow, timeout=120)
            out["slow_s"] = time.monotonic() - t0

        t = threading.Thread(target=post_slow)
        t.start()
        time.sleep(0.5)  # the slow one compiles
        t0 = time.monotonic()
        r = httpx.post(live.url + "/v1/completions", json=quick2, timeout=60)
        quick_s = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("cow", "pig"), r.text
        assert quick_s < 2.5, quick_s  # not behind the slow one
        t.join(60)
        err = error_of(out["slow"], 400)
        assert "did not compile within 3 s (the engine's --grammar-compile-timeout)" in err["message"], err
        assert out["slow_s"] < 3.0 + 5.0
        again = completion(regex="(ant|bee)", max_tokens=4, temperature=0)  # compiled again, by the workers left
        r = httpx.post(live.url + "/v1/completions", json=again, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("ant", "bee")
    print(f"\nquick grammar beside a slow one: {quick_s:.2f} s; slow one refused after {out['slow_s']:.2f} s")


def test_a_tiny_compile_timeout_is_a_400_naming_the_option_and_the_compiler_serves_on():
    """`grammar_compile_timeout` (the engine's --grammar-compile-timeout): a grammar past it is a 400
    that names the option, counted in /metrics; the next grammar compiles at once."""
    engine = Engine("dummy:tiny", num_pages=128, grammar_compile_timeout=0.5)
    assert engine.grammars.timeout == 0.5
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}  # ~30 s
    slow = completion(response_format={"type": "json_schema", "json_schema": {"schema": schema}}, max_tokens=4)
    with running_server(engine) as live, httpx.Client(base_url=live.url, timeout=60) as c:
        warm = c.post("/v1/completions", json=completion(regex="(cat|dog)", max_tokens=4, temperature=0))
        assert warm.status_code == 200, warm.text  # the workers are up: the timeout bounds the compile only
        t0 = time.monotonic()
        err = error_of(c.post("/v1/completions", json=slow), 400)
        assert "--grammar-compile-timeout" in err["message"] and "0.5 s" in err["message"], err
        assert time.monotonic() - t0 < 0.5 + 5.0
        r = c.post("/v1/completions", json=completion(regex="(cow|pig)", max_tokens=4, temperature=0))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("cow", "pig"), r.text
        text = c.get("/metrics").text
        assert "minisched_grammar_compile_timeouts_total 1.0" in text, text
