"""Helpers for the serve tests. Servers: uvicorn on 127.0.0.1, a free port, in a background thread, stopped by the test.

`running_server(engine, **create_app_kwargs)` is a context manager yielding a `LiveServer`
(base URL, the app's ServerState, the EngineLoop). The engine loop checks the scheduler's
invariants after every step (`check_invariants=True`); tests read `loop.invariant_errors`.
Anything that must touch the engine while the server runs goes through `live.call(fn)`,
which runs `fn(engine)` on the engine thread between steps.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass

from minisched.serve import EngineLoop, create_app, make_server

TINY = "dummy:tiny"


def wait_for(pred, timeout: float, what: str, every: float = 0.05):
    """Poll `pred` until it returns something truthy (returned), or fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class LiveServer:
    url: str
    state: object
    loop: EngineLoop
    server: object

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def call(self, fn, timeout: float = 30.0):
        return self.loop.call(fn).result(timeout)


@contextlib.contextmanager
def running_server(
    engine, *, model_name: str = "tiny", check_invariants: bool = True, grace_period: float = 5.0, **kwargs
):
    loop = EngineLoop(engine, check_invariants=check_invariants)
    app = create_app(engine, model_name=model_name, engine_loop=loop, **kwargs)
    server = make_server(app, grace_period=grace_period, log_level="warning")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app.state.server, loop, server)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "the test server did not stop"
        assert not loop.is_alive(), "the engine loop did not stop"


def pool_whole(engine) -> tuple[int, int, int]:
    """On the engine thread: check the invariants, empty the radix cache, and return
    (free pages, cached pages, total pages) -- a leak-free pool has free == total."""
    sched = engine.scheduler
    sched.check_invariants()
    sched.flush_cache()
    snap = sched.snapshot()
    return snap.pages_free, snap.pages_cached, snap.pages_total


@contextlib.contextmanager
def pool_server(factories, *, router=None, supervision=None, start_timeout: float = 120.0, recorder=None):
    """An EnginePool (engine processes) behind a live server; yields (base URL, pool). At the end every
    replica process must be gone and none may have broken the scheduler's invariants."""
    from minisched.serve.pool import EnginePool, Supervision
    from minisched.serve.router import RouterConfig

    pool = EnginePool(
        factories,
        router or RouterConfig(),
        check_invariants=True,
        start_timeout=start_timeout,
        supervision=supervision or Supervision(),
        recorder=recorder,
    ).start()
    server = None
    try:
        app = create_app(pool.info, model_name="tiny", engine_loop=pool)
        server = make_server(app, grace_period=2.0, log_level="warning")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", pool
    finally:
        if server is not None:
            server.should_exit = True
            thread.join(30)
            sock.close()
        pool.stop()
        pool.join(20)
        assert not any(r.process.is_alive() for r in pool.replicas), "a replica process outlived the server"
    assert all(r.invariant_errors == 0 for r in pool.replicas)


# -- one body, every generation route ------------------------------------------------------------------
# The bound tests are written as /v1/completions bodies; `route_body` says the same thing to another route
# (or None where that route has no such field), `route_error` reads its error body.
ROUTES = ("completions", "chat", "generate")
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}
# /v1/completions field -> SGLang's name inside `sampling_params` where it differs
SGLANG_SAMPLING = {"seed": "sampling_seed", "min_tokens": "min_new_tokens", "max_tokens": "max_new_tokens"}
SGLANG_SAMPLING_FIELDS = {
    "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "n", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "skip_special_tokens", "regex", "ebnf",
}  # fmt: skip
OPENAI_ONLY = {"best_of", "suffix", "echo", "return_token_ids", "stream_options"}


def route_body(route: str, body: dict):
    """`body` (a /v1/completions body) as `route`'s body, or None where the route cannot say it."""
    if route == "completions":
        return body
    if any(k in body for k in OPENAI_ONLY):
        return None
    rest = dict(body)
    prompt = rest.pop("prompt", "hello")
    if route == "chat":
        if not isinstance(prompt, str):
            return None
        rest["messages"] = [{"role": "user", "content": prompt}]
        if "logprobs" in rest:
            rest["top_logprobs"], rest["logprobs"] = rest["logprobs"], True
        return rest
    if rest.pop("model", None) != "tiny":
        return None  # /generate serves whatever model it is asked for: a case about the model is not its
    rf = rest.pop("response_format", None)
    out: dict = {}
    sp: dict = {}
    if rf is not None:
        if rf.get("type") != "json_schema" or "json_schema" not in rf:
            return None
        sp["json_schema"] = rf["json_schema"]["schema"]
    text_like = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str))
    out["text" if text_like else "input_ids"] = prompt
    for k in ("stream", "priority"):
        if k in rest:
            out[k] = rest.pop(k)
    if "logprobs" in rest:
        out["return_logprob"], out["top_logprobs_num"] = True, rest.pop("logprobs")
    for k, v in rest.items():
        if k not in SGLANG_SAMPLING_FIELDS and k not in SGLANG_SAMPLING:
            raise KeyError(f"route_body: no /generate spelling for {k!r}")
        sp[SGLANG_SAMPLING.get(k, k)] = v
    out["sampling_params"] = sp
    return out


def route_param(route: str, param: str, body: dict) -> str:
    """The name `route`'s error message gives to the /v1/completions field `param`."""
    if route != "generate":
        return param
    if param == "prompt":
        return "input_ids" if "input_ids" in route_body(route, body) else "text"
    if param == "response_format":
        return "json_schema"
    if param == "logprobs":
        return "top_logprobs_num"
    if param in ("stream", "priority"):
        return param
    return "sampling_params." + SGLANG_SAMPLING.get(param, param)


def route_error(r, status: int, route: str) -> dict:
    """The error of a response that must be `status`: OpenAI's body ({message, type, param, code}) on the
    OpenAI routes, SGLang's ({message}) on /generate; never a traceback."""
    assert r.status_code == status, r.text
    body = r.json()
    assert "Traceback" not in r.text
    if route == "generate":
        assert set(body) == {"error"} and set(body["error"]) == {"message"}, body
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]


def route_cases(cases, base: dict, routes=ROUTES, only: dict | None = None):
    """pytest params (route, *case[1:]) with ids "<route>-<case id>" for every route that can say the case:
    case[1] is a patch of the /v1/completions body `base` (a chat has no prompt to patch); `only` (case id ->
    routes) keeps a bound one route has alone to those routes."""
    import pytest

    return [
        pytest.param(route, *case[1:], id=f"{route}-{case[0]}")
        for route in routes
        for case in cases
        if route in (only or {}).get(case[0], routes)
        and not (route == "chat" and "prompt" in case[1])
        and route_body(route, {**base, **case[1]}) is not None
    ]
