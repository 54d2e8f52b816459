"""What the real sglang-router (0.3.2) in PD mode sends a prefill and a decode worker, and what it
makes of their answers: two logging fakes (tests/helpers/pd_fake.py) behind
`--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL`, all on 127.0.0.1.

docs/fleet.md ("Prefill and decode on different workers") is the prose of what these tests prove.
The tests run in file order on one router (module fixture); the one that kills the prefill fake is last.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from helpers.fleet import router_python, router_workers, wait_healthy, wait_registered
from helpers.pd_fake import DECODE_MARK, PROMPT_TOKENS, start_fake, start_pd_router

ROUTER_PY = router_python()
pytestmark = [
    pytest.mark.skipif(
        ROUTER_PY is None, reason="sglang-router not installed (make router-env, or MINISCHED_SGLANG_ROUTER)"
    ),
    pytest.mark.timeout(60),
]
BOOTSTRAP_PORT = 18998  # never opened: the router only passes it on
ROUTER_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
PREFILL_ROWS = [[-0.5, t, None] for t in range(1, PROMPT_TOKENS + 1)]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    procs = []
    try:
        prefill, decode = start_fake("prefill", tmp), start_fake("decode", tmp)
        procs += [prefill, decode]
        for w in (prefill, decode):
            wait_healthy(w, 30)
        router = start_pd_router(ROUTER_PY, prefill, BOOTSTRAP_PORT, decode, tmp)
        # health checks once an hour: a dead worker stays in its rotation (the last test)
        blind = start_pd_router(
            ROUTER_PY, prefill, BOOTSTRAP_PORT, decode, tmp, "--health-check-interval-secs", "3600", name="blind"
        )
        procs += [router, blind]
        for r in (router, blind):
            wait_healthy(r, 30, "/liveness")
            wait_registered(r, [prefill.url, decode.url], 30)
        yield {"prefill": prefill, "decode": decode, "router": router, "blind": blind}
    finally:
        for p in procs:
            p.kill()
    assert not any(p.alive() for p in procs)


def recorded(worker, path_prefix: str = "/") -> list[dict]:
    """The requests the fake got since the last call (then forgotten), health checks and controls left out."""
    got = httpx.get(worker.url + "/_recorded", timeout=5).json()
    httpx.delete(worker.url + "/_recorded", timeout=5)
    return [r for r in got if r["path"].startswith(path_prefix) and r["path"] not in ("/health", "/_control")]


def control(worker, **settings) -> None:
    assert httpx.post(worker.url + "/_control", json=settings, timeout=5).status_code == 200


def sse_events(text: str) -> list:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", text
    return [json.loads(d) for d in data[:-1]]


def both_sides(pd, path: str) -> tuple[dict, dict]:
    """The one request each side got on `path`: the same body on both, the three bootstrap fields added."""
    (p,), (d,) = recorded(pd["prefill"], path), recorded(pd["decode"], path)
    assert p["path"] == d["path"] == path and p["method"] == d["method"] == "POST"
    assert p["body"] == d["body"]
    return p["body"], d["body"]


def assert_bootstrap(body: dict, n: int | None = None) -> None:
    """One prompt: scalars; a batch of n: a list per field, one room per prompt."""
    host, port, room = (body[k] for k in ROUTER_FIELDS)
    if n is None:
        assert (host, port) == ("127.0.0.1", BOOTSTRAP_PORT)
        assert isinstance(room, int) and 0 <= room < 2**63
    else:
        assert host == ["127.0.0.1"] * n and port == [BOOTSTRAP_PORT] * n
        assert len(set(room)) == n and all(isinstance(r, int) and 0 <= r < 2**63 for r in room)


def test_startup_probes_and_registration(pd):
    """Each worker is asked /health, /server_info and /model_info at registration (health checks after)."""
    rows = router_workers(pd["router"])
    assert rows[pd["prefill"].url]["worker_type"] == "prefill"
    assert rows[pd["prefill"].url]["bootstrap_port"] == BOOTSTRAP_PORT
    assert rows[pd["decode"].url]["worker_type"] == "decode" and "bootstrap_port" not in rows[pd["decode"].url]
    assert {row["model_id"] for row in rows.values()} == {"tiny"}  # from /server_info's served_model_name
    for side in ("prefill", "decode"):
        got = httpx.get(pd[side].url + "/_recorded", timeout=5).json()
        gets = {r["path"] for r in got if r["method"] == "GET"}
        assert {"/health", "/server_info", "/model_info"} <= gets, gets
        recorded(pd[side])


@pytest.mark.parametrize("stream", [False, True])
def test_generate_goes_to_both_and_the_decode_side_answers(pd, stream):
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "stream": stream}
    r = httpx.post(pd["router"].url + "/generate", json=body, timeout=20)
    assert r.status_code == 200, r.text
    out = sse_events(r.text)[-1] if stream else r.json()
    assert out["text"] == "decode:0" and out["output_ids"] == [200, 0]
    sent, _ = both_sides(pd, "/generate")
    assert_bootstrap(sent)
    assert sent["text"] == "hi" and sent["sampling_params"] == {"max_new_tokens": 4, "temperature": 0.0}
    assert sent["stream"] is stream
    # the router re-serializes its own parse of the body: SGLang's defaults appear, `model` null
    assert sent["model"] is None and sent["return_hidden_states"] is False and sent["log_metrics"] is True


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_routes_go_to_both_and_the_decode_side_answers(pd, route, stream):
    chat = route.endswith("chat/completions")
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0, "stream": stream}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    r = httpx.post(pd["router"].url + route, json=body, timeout=20)
    assert r.status_code == 200, r.text
    if stream:
        pieces = [c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in sse_events(r.text)]
        text = "".join(pieces)
    else:
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
    assert text == "decode:0"
    sent, _ = both_sides(pd, route)
    assert_bootstrap(sent)
    assert sent["stream"] is stream and sent["model"] == "tiny"
    # chat: the router sends max_tokens as max_completion_tokens (OpenAI's newer name)
    assert (sent["max_completion_tokens"] if chat else sent["max_tokens"]) == 3 and ("max_tokens" not in sent) is chat


@pytest.mark.parametrize(
    "route,body,n",
    [
        ("/generate", {"input_ids": [[1, 2], [3, 4], [5, 6]], "sampling_params": {"max_new_tokens": 2}}, 3),
        ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2}, 2),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 2),
    ],
)
def test_a_batch_gets_one_room_per_prompt(pd, route, body, n):
    """A batch of input_ids, a list of prompts, chat's n > 1: every bootstrap field becomes a list of n."""
    r = httpx.post(pd["router"].url + route, json=body, timeout=20)
    assert r.status_code == 200, r.text
    sent, _ = both_sides(pd, route)
    assert_bootstrap(sent, n)


def test_a_batch_of_texts_is_refused_by_the_router(pd):
    """The router's /generate parse takes `text` as one string: a list is a 422 from the router itself."""
    r = httpx.post(pd["router"].url + "/generate", json={"text": ["a", "b"]}, timeout=20)
    assert r.status_code == 422
    assert recorded(pd["prefill"]) == [] and recorded(pd["decode"]) == []


def test_generate_logprobs_prefill_rows_first(pd):
    """return_logprob: the answer is the decode side's with input_token_logprobs = prefill's rows + decode's."""
    body = {"text": "hi", "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(pd["router"].url + "/generate", json=body, timeout=20)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["input_token_logprobs"] == PREFILL_ROWS + [DECODE_MARK]
    assert r.headers["content-type"] == "application/octet-stream"  # the merged body loses its JSON type
    assert meta["output_token_logprobs"] == [[-0.25, 200, None]]  # the decode side's, untouched
    sent, _ = both_sides(pd, "/generate")
    assert sent["return_logprob"] is True


def test_streamed_logprobs_merge_only_when_the_prefill_answers_json(pd):
    """Streaming: the router reads the prefill side's answer whole and parses it as JSON. An SSE answer
    does not parse, so nothing is merged; one JSON body is merged into every decode event."""
    body = {"text": "hi", "return_logprob": True, "stream": True, "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(pd["router"].url + "/generate", json=body, timeout=20)
    assert [e["meta_info"]["input_token_logprobs"] for e in sse_events(r.text)] == [[DECODE_MARK]]
    both_sides(pd, "/generate")
    control(pd["prefill"], stream_as_json=True)
    try:
        r = httpx.post(pd["router"].url + "/generate", json=body, timeout=20)
    finally:
        control(pd["prefill"], stream_as_json=False)
    events = sse_events(r.text)
    assert [e["meta_info"]["input_token_logprobs"] for e in events] == [PREFILL_ROWS + [DECODE_MARK]]
    assert events[0]["text"] == "decode:0"
    both_sides(pd, "/generate")


def test_openai_logprobs_are_not_merged(pd):
    """The merge reads meta_info.input_token_logprobs, which OpenAI bodies lack: echo + logprobs on
    /v1/completions come back as the decode side wrote them."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": 1, "echo": True}
    r = httpx.post(pd["router"].url + "/v1/completions", json=body, timeout=20)
    assert r.status_code == 200
    assert r.json()["choices"][0] == {"index": 0, "text": "decode:0", "finish_reason": "length", "logprobs": None}
    sent, _ = both_sides(pd, "/v1/completions")
    assert sent["logprobs"] == 1 and sent["echo"] is True


def test_the_router_waits_for_both_answers(pd):
    """It sends both requests at once and reads both answers before it answers: a non-streamed request
    ends no sooner than the decode side's answer, even when the prefill side failed at once; a streamed
    one starts no sooner than the prefill side's whole answer."""
    control(pd["decode"], delay=1.0)
    control(pd["prefill"], fail_status=400, fail_count=1)
    t0 = time.monotonic()
    r = httpx.post(pd["router"].url + "/generate", json={"text": "slow decode"}, timeout=20)
    waited = time.monotonic() - t0
    control(pd["decode"], delay=0.0)
    assert r.status_code == 400 and waited >= 1.0, (r.status_code, waited)
    control(pd["prefill"], delay=1.0)
    try:
        body = {"model": "tiny", "prompt": "slow prefill", "max_tokens": 2, "stream": True}
        t0 = time.monotonic()
        with httpx.stream("POST", pd["router"].url + "/v1/completions", json=body, timeout=20) as s:
            first = next(line for line in s.iter_lines() if line.startswith("data: "))
            waited = time.monotonic() - t0
    finally:
        control(pd["prefill"], delay=0.0)
    assert "decode:" in first and waited >= 1.0, (first, waited)
    recorded(pd["prefill"])
    recorded(pd["decode"])


def test_a_failed_prefill_is_retried_with_a_new_room_on_both_sides(pd):
    """A retryable status (here 503) from the prefill side: the router sends the whole pair again, new
    room; the first room's decode request was already sent (and answered) and is dropped."""
    control(pd["prefill"], fail_status=503, fail_count=1)
    r = httpx.post(pd["router"].url + "/generate", json={"text": "retry me"}, timeout=20)
    assert r.status_code == 200 and r.json()["text"] == "decode:0"
    p, d = recorded(pd["prefill"], "/generate"), recorded(pd["decode"], "/generate")
    rooms = [x["body"]["bootstrap_room"] for x in p]
    assert len(p) == len(d) == 2 and rooms == [x["body"]["bootstrap_room"] for x in d] and rooms[0] != rooms[1]


def test_a_client_error_from_the_prefill_side_is_the_answer(pd):
    control(pd["prefill"], fail_status=400, fail_count=1)
    r = httpx.post(pd["router"].url + "/generate", json={"text": "bad"}, timeout=20)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prefill_bad_request"
    assert "prefill fails on purpose" in r.json()["error"]["message"]
    assert len(recorded(pd["prefill"], "/generate")) == len(recorded(pd["decode"], "/generate")) == 1  # no retry


def test_a_failed_decode_is_retried_too(pd):
    control(pd["decode"], fail_status=500, fail_count=1)
    r = httpx.post(pd["router"].url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True})
    assert "".join(c["choices"][0]["text"] for c in sse_events(r.text)) == "decode:0"
    assert len(recorded(pd["prefill"], "/v1")) == len(recorded(pd["decode"], "/v1")) == 2


def test_what_the_router_answers_itself(pd):
    """/v1/models from its registry, /get_model_info from the first prefill worker, /health_generate
    and /get_server_info on its own (no worker asked)."""
    assert [m["id"] for m in httpx.get(pd["router"].url + "/v1/models", timeout=5).json()["data"]] == ["tiny"]
    info = httpx.get(pd["router"].url + "/get_model_info", timeout=5).json()
    assert info["model_type"] == "llama"
    assert [r["path"] for r in recorded(pd["prefill"])] == ["/get_model_info"] and recorded(pd["decode"]) == []
    assert httpx.get(pd["router"].url + "/health_generate", timeout=5).status_code == 200
    assert "workers_count" in httpx.get(pd["router"].url + "/get_server_info", timeout=5).json()
    assert recorded(pd["prefill"]) == [] and recorded(pd["decode"]) == []


def test_a_dead_prefill_worker(pd):
    """Killed: the router's sends fail (502, retried on the same pair: the decode side gets every try's
    room) until its health check drops the prefill worker; then requests fail fast with 503."""
    pd["prefill"].kill()
    r = httpx.post(pd["blind"].url + "/generate", json={"text": "anyone?"}, timeout=20)
    assert r.status_code == 502 and r.json()["error"]["code"] == "prefill_server_error"
    tries = recorded(pd["decode"], "/generate")
    assert len(tries) >= 2 and len({t["body"]["bootstrap_room"] for t in tries}) == len(tries)
    wait_registered(pd["router"], [pd["prefill"].url], 15, healthy=False)
    r = httpx.post(pd["router"].url + "/generate", json={"text": "anyone?"}, timeout=20)
    assert r.status_code == 503 and "No available prefill workers" in r.json()["error"]["message"]
    assert recorded(pd["decode"]) == []
