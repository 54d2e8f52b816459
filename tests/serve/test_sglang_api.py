"""SGLang's native API on a minisched server (dummy:tiny): /generate with the request bodies of
SGLang's own docs, and the worker endpoints sglang-router reads (/server_info, /model_info,
/get_load, /flush_cache, /health_generate). Request ids end to end (X-Request-Id, `rid`).

The /generate bodies are SGLang's documented examples, verbatim: sgl-project/sglang
docs/basic_usage/sampling_params.md ("Normal", "Streaming", "Structured Outputs") and
docs/basic_usage/native_api.ipynb ("Generate").
"""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest

from helpers.serve import TINY, running_server
from minisched.engine import Engine


def post(live, body, **kw) -> httpx.Response:
    return httpx.post(live.url + "/generate", json=body, timeout=60, **kw)


def completion_ids(live, prompt: str, max_tokens: int, **extra) -> dict:
    """The same prompt through /v1/completions (greedy): the reference for /generate."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    r = httpx.post(live.v1 + "/completions", json={**body, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(live, body) -> list[dict]:
    """SGLang's documented streaming client loop (sampling_params.md, "Streaming")."""
    events = []
    with httpx.stream("POST", live.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_lines():
            if chunk and chunk.startswith("data:"):
                if chunk == "data: [DONE]":
                    events.append("[DONE]")
                    break
                events.append(json.loads(chunk[5:].strip("\n")))
    return events


# -- /generate: SGLang's documented bodies -----------------------------------------------------------
def test_normal_example_matches_the_openai_route(tiny_server):
    body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 32}}
    r = post(tiny_server, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    ref = completion_ids(tiny_server, body["text"], 32)
    choice = ref["choices"][0]
    assert out["output_ids"] == choice["token_ids"] and out["text"] == choice["text"]
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == ref["usage"]["prompt_tokens"] == len(body["text"])
    assert meta["completion_tokens"] == len(out["output_ids"]) == ref["usage"]["completion_tokens"]
    assert meta["id"] and r.headers["x-request-id"] == meta["id"].rsplit("-", 1)[0]
    assert meta["e2e_latency"] > 0 and meta["cached_tokens"] >= 0
    reason = meta["finish_reason"]
    assert reason["type"] in ("stop", "length")
    if reason["type"] == "length":
        assert reason["length"] == 32 == len(out["output_ids"])
    else:
        assert reason["matched"] == out["output_ids"][-1]  # the model's EOS


def test_native_api_example_default_max_new_tokens(tiny_server):
    body = {"text": "What is the capital of France?"}  # native_api.ipynb, "Generate"
    out = post(tiny_server, {**body, "sampling_params": {"ignore_eos": True}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 128}  # SGLang's default
    assert post(tiny_server, body).status_code == 200


def test_streaming_example_is_cumulative_and_ends_with_done(tiny_server):
    body = {
        "text": "The capital of France is",
        "sampling_params": {"temperature": 0, "max_new_tokens": 32},
        "stream": True,
    }
    events = stream_events(tiny_server, body)
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = events[:-1]
    whole = post(tiny_server, {**body, "stream": False}).json()
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        assert a["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert last["meta_info"]["completion_tokens"] == len(last["output_ids"])
    assert "index" not in last  # one prompt, n = 1


def test_structured_output_examples(tiny_server):
    regex = post(
        tiny_server,
        {
            "text": "Paris is the capital of",
            "sampling_params": {"temperature": 0, "max_new_tokens": 64, "regex": "(France|England)"},
        },
    ).json()
    assert regex["text"] in ("France", "England"), regex
    ebnf = post(
        tiny_server,
        {
            "text": "Write a greeting.",
            "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ebnf": 'root ::= "Hello" | "Hi" | "Hey"'},
        },
    ).json()
    assert ebnf["text"] in ("Hello", "Hi", "Hey"), ebnf
    json_schema = json.dumps(
        {
            "type": "object",
            "properties": {"name": {"type": "string", "pattern": "^[\\w]+$"}, "population": {"type": "integer"}},
            "required": ["name", "population"],
        }
    )
    out = post(
        tiny_server,
        {
            "text": "Here is the information of the capital of France in the JSON format.\n",
            "sampling_params": {"temperature": 0, "max_new_tokens": 64, "json_schema": json_schema},
        },
    ).json()
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        data = json.loads(out["text"])
        assert set(data) == {"name", "population"} and isinstance(data["population"], int)
    else:  # random weights may run out of tokens inside a string: the text is still the schema's prefix
        assert out["text"].startswith("{")


# -- batches, token ids, n, logprobs, stops -----------------------------------------------------------
def test_batch_text_input_ids_and_n(tiny_server, tiny_engine):
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    texts = ["The capital of France is", "Paged attention"]
    singles = [post(tiny_server, {"text": t, "sampling_params": sp}).json() for t in texts]
    batch = post(tiny_server, {"text": texts, "sampling_params": sp}).json()
    assert isinstance(batch, list) and [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]
    ids = [tiny_engine.tokenizer.encode(t) for t in texts]
    by_ids = post(tiny_server, {"input_ids": ids, "sampling_params": sp}).json()
    assert [b["text"] for b in by_ids] == [s["text"] for s in singles]
    one = post(tiny_server, {"input_ids": ids[0], "sampling_params": sp}).json()
    assert isinstance(one, dict) and one["output_ids"] == singles[0]["output_ids"]
    two = post(tiny_server, {"text": texts[0], "sampling_params": {**sp, "n": 2}}).json()
    assert [t["output_ids"] for t in two] == [singles[0]["output_ids"]] * 2
    per_prompt = post(
        tiny_server, {"text": texts, "sampling_params": [sp, {**sp, "max_new_tokens": 3}], "rid": ["a", "b"]}
    ).json()
    assert [p["meta_info"]["completion_tokens"] for p in per_prompt] == [8, 3]
    assert [p["meta_info"]["id"] for p in per_prompt] == ["a", "b"]
    events = stream_events(tiny_server, {"text": texts, "sampling_params": sp, "stream": True})
    finals = {e["index"]: e for e in events[:-1] if e["meta_info"]["finish_reason"] is not None}
    assert {i: f["output_ids"] for i, f in finals.items()} == {0: singles[0]["output_ids"], 1: singles[1]["output_ids"]}


def test_logprobs_match_the_openai_route(tiny_server, tiny_engine):
    prompt = "The capital of France is"
    prompt_ids = tiny_engine.tokenizer.encode(prompt)
    body = {
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
    }
    meta = post(tiny_server, body).json()["meta_info"]
    ref = completion_ids(tiny_server, prompt, 6, logprobs=2, echo=True, ignore_eos=True)["choices"][0]["logprobs"]
    n = len(prompt)
    out = meta["output_token_logprobs"]
    assert [e[0] for e in out] == pytest.approx(ref["token_logprobs"][n:], abs=1e-5)
    assert [e[2] for e in out] == ref["tokens"][n:]
    inp = meta["input_token_logprobs"]
    assert len(inp) == n and inp[0][0] is None and [e[1] for e in inp] == prompt_ids
    assert [e[0] for e in inp[1:]] == pytest.approx(ref["token_logprobs"][1:n], abs=1e-5)
    assert all(len(t) == 2 for t in meta["output_top_logprobs"]) and meta["input_top_logprobs"][0] is None
    # logprob_start_len -1 (SGLang's default): output tokens only; no text unless asked
    meta = post(tiny_server, {**body, "logprob_start_len": -1, "return_text_in_logprobs": False}).json()["meta_info"]
    assert "input_token_logprobs" not in meta and meta["output_token_logprobs"][0][2] is None
    meta = post(tiny_server, {**body, "logprob_start_len": 3}).json()["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt_ids[3:]


def test_finish_reasons_in_sglang_shape(tiny_server):
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    base = post(tiny_server, {"text": "Stops here", "sampling_params": sp}).json()
    assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    text = base["text"]
    plain = {"temperature": 0, "max_new_tokens": 12}  # ignore_eos would switch stop_token_ids off too
    first = post(tiny_server, {"text": "Stops here", "sampling_params": plain}).json()["output_ids"]
    assert len(first) >= 2  # the seeded random model does not stop at once on this prompt
    stop_id = first[len(first) // 2]
    out = post(tiny_server, {"text": "Stops here", "sampling_params": {**plain, "stop_token_ids": [stop_id]}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == first[: first.index(stop_id) + 1]
    stop = next((c for c in text[2:] if c.isprintable() and c.strip()), None)
    if stop is None:
        pytest.skip("the random model's text has no printable character to stop on")
    out = post(tiny_server, {"text": "Stops here", "sampling_params": {**sp, "stop": stop}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]
    kept = post(tiny_server, {"text": "Stops here", "sampling_params": {**sp, "stop": stop, "no_stop_trim": True}})
    assert kept.json()["text"] == text[: text.index(stop) + 1]


def test_the_routers_resent_body_is_accepted(tiny_server):
    """sglang-router 0.3.2 re-serializes a /generate body with fields of its own (seen on the wire)."""
    body = {
        "text": "hello",
        "model": None,
        "sampling_params": {"max_new_tokens": 3},
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
    }
    r = post(tiny_server, body)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] <= 3


@pytest.mark.parametrize(
    "body, words",
    [
        ({"sampling_params": {"max_new_tokens": 3}}, "text or input_ids"),
        ({"text": "a", "input_ids": [1], "sampling_params": {}}, "text or input_ids"),
        ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"text": "a", "sampling_params": {"top_k": 0}}, "top_k"),
        ({"text": "a", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "Only one of"),
        ({"text": "a", "sampling_params": {"regex": "(unclosed"}}, "regex"),
        ({"input_ids": [1, 10**9]}, "out of range"),
        ({"text": "abc", "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
        ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
        ({"text": []}, "empty"),
    ],
)
def test_bad_requests_get_sglangs_error_body(tiny_server, body, words):
    r = post(tiny_server, body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert set(err) == {"error"} and set(err["error"]) == {"message"} and words in err["error"]["message"]


def test_unparseable_body(tiny_server):
    r = httpx.post(tiny_server.url + "/generate", content=b"{nope", timeout=10)
    assert r.status_code == 400 and "parse" in r.json()["error"]["message"]


# -- the worker endpoints -----------------------------------------------------------------------------
def test_server_info_and_model_info(tiny_server):
    info = httpx.get(tiny_server.url + "/server_info", timeout=10).json()
    assert info == httpx.get(tiny_server.url + "/get_server_info", timeout=10).json()
    assert info["served_model_name"] == "tiny" and info["dp_size"] == 1 and info["version"]
    assert "model_path" not in info and "tokenizer_path" not in info  # the router would load a tokenizer
    assert info["max_running_requests"] == 64 and info["max_total_num_tokens"] == 256 * 16
    assert info["context_length"] == 2048 and info["max_queued_requests"] == 512
    model = httpx.get(tiny_server.url + "/model_info", timeout=10).json()
    assert model == httpx.get(tiny_server.url + "/get_model_info", timeout=10).json()
    assert model["is_generation"] is True and model["model_path"] == "tiny" and model["tokenizer_path"] is None


def test_get_load_counts_running_requests(tiny_server):
    idle = httpx.get(tiny_server.url + "/get_load", timeout=10).json()
    assert idle == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    body = {"text": "a long one", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    seen = []
    with httpx.stream("POST", tiny_server.url + "/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and len(seen) < 1:
                seen.append(httpx.get(tiny_server.url + "/get_load", timeout=10).json())
                break
    row = seen[0][0]
    assert row["num_reqs"] == 1 and row["num_tokens"] >= 16  # at least the prompt's page


def test_flush_cache_empties_the_radix_cache(tiny_server):
    post(tiny_server, {"text": "x" * 64, "sampling_params": {"max_new_tokens": 2}})
    cached = tiny_server.call(lambda e: e.scheduler.tree.total_pages)
    assert cached >= 4
    r = httpx.post(tiny_server.url + "/flush_cache", timeout=30)
    assert r.status_code == 200 and f"{cached} KV pages freed" in r.text
    assert tiny_server.call(lambda e: e.scheduler.tree.total_pages) == 0
    assert httpx.get(tiny_server.url + "/flush_cache", timeout=30).status_code == 200  # SGLang takes GET too
    again = post(tiny_server, {"text": "x" * 64, "sampling_params": {"max_new_tokens": 2}}).json()
    assert again["meta_info"]["cached_tokens"] == 0  # nothing left to hit


def test_health_generate(tiny_server):
    r = httpx.get(tiny_server.url + "/health_generate", timeout=30)
    assert r.status_code == 200


def test_health_generate_503_when_draining(tiny_server):
    tiny_server.state.draining = True
    try:
        assert httpx.get(tiny_server.url + "/health_generate", timeout=30).status_code == 503
    finally:
        tiny_server.state.draining = False


def test_api_key_covers_generate_and_flush_not_probes():
    engine = Engine(TINY, num_pages=64)
    with running_server(engine, api_key="sekrit") as live:
        assert httpx.post(live.url + "/generate", json={"text": "a"}, timeout=10).status_code == 401
        assert httpx.post(live.url + "/flush_cache", timeout=10).status_code == 401
        assert httpx.get(live.url + "/server_info", timeout=10).status_code == 200
        ok = httpx.post(
            live.url + "/generate",
            json={"text": "a", "sampling_params": {"max_new_tokens": 2}},
            headers={"Authorization": "Bearer sekrit"},
            timeout=30,
        )
        assert ok.status_code == 200


# -- request ids ---------------------------------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []  # emit runs under the handler's own lock

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def serve_records():
    from minisched.serve.request_id import RequestIdFilter

    logger = logging.getLogger("minisched.serve")
    handler = _Records()
    handler.addFilter(RequestIdFilter())
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(old)


def test_request_id_header_is_echoed_and_on_every_log_line(tiny_server, serve_records):
    rid = "client-req-42"
    r = httpx.post(
        tiny_server.v1 + "/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "n": 2},
        headers={"X-Request-Id": rid},
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    assert r.json()["id"].startswith("cmpl-")  # the call keeps its own id in the body
    mine = [rec for rec in serve_records if rec.request_id == rid]
    messages = [rec.getMessage() for rec in mine]
    assert any(m.startswith("admitted cmpl-") for m in messages), messages
    assert sum(m.startswith("finished cmpl-") for m in messages) == 2, messages  # one per choice
    streamed = httpx.post(
        tiny_server.v1 + "/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True},
        headers={"X-Request-Id": "chat-7"},
        timeout=30,
    )
    assert streamed.headers["x-request-id"] == "chat-7"
    # a 4xx echoes it too
    bad = httpx.post(
        tiny_server.v1 + "/completions", json={"model": "nope", "prompt": "x"}, headers={"X-Request-Id": "e1"}
    )
    assert bad.status_code == 404 and bad.headers["x-request-id"] == "e1"


def test_sglang_rid_names_the_request_unless_a_header_does(tiny_server, serve_records):
    r = post(tiny_server, {"text": "hi", "rid": "my-rid", "sampling_params": {"max_new_tokens": 2}})
    assert r.headers["x-request-id"] == "my-rid" and r.json()["meta_info"]["id"] == "my-rid"
    assert any(rec.request_id == "my-rid" and rec.getMessage().startswith("finished") for rec in serve_records)
    r = post(
        tiny_server,
        {"text": "hi", "rid": "my-rid", "sampling_params": {"max_new_tokens": 2}},
        headers={"X-Request-Id": "hdr"},
    )
    assert r.headers["x-request-id"] == "hdr" and r.json()["meta_info"]["id"] == "my-rid"


def test_without_an_id_the_call_id_is_used(tiny_server):
    r = httpx.post(tiny_server.v1 + "/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.headers["x-request-id"] == r.json()["id"]
    bad_id = "x" * 500  # too long to be a log token: ignored
    r = httpx.post(
        tiny_server.v1 + "/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
        headers={"X-Request-Id": bad_id},
        timeout=30,
    )
    assert r.headers["x-request-id"] == r.json()["id"]
    assert re.fullmatch(r"cmpl-[0-9a-f]+", r.headers["x-request-id"])


# -- --dp 2: a row per replica, every replica flushed --------------------------------------------------
def test_dp_get_load_rows_and_flush_every_replica():
    import functools

    from helpers.serve import pool_server

    factory = functools.partial(Engine, TINY, num_pages=128)
    with pool_server([factory, factory]) as (url, pool):
        info = httpx.get(url + "/server_info", timeout=10).json()
        assert info["dp_size"] == 2
        rows = httpx.get(url + "/get_load", timeout=10).json()
        assert [r["dp_rank"] for r in rows] == [0, 1]
        prompts = ["first prefix " * 5, "other prefix " * 5, "third prefix " * 5, "fourth one " * 6]
        for p in prompts:  # cache-aware: different prefixes spread over both replicas
            httpx.post(url + "/generate", json={"text": p, "sampling_params": {"max_new_tokens": 2}}, timeout=30)
        assert all(t.num_tokens > 0 for t in pool.router.trees)
        cached = [f.result(30) for f in pool.call_all(_cached_pages)]
        assert sum(cached) >= 4 * 3
        r = httpx.post(url + "/flush_cache", timeout=30)
        assert r.status_code == 200 and f"{sum(cached)} KV pages freed" in r.text
        assert [f.result(30) for f in pool.call_all(_cached_pages)] == [0, 0]
        assert [t.num_tokens for t in pool.router.trees] == [0, 0]  # the in-process router forgot them too


def _cached_pages(engine) -> int:  # module level: sent to the replica processes by pickle
    return engine.scheduler.tree.total_pages
