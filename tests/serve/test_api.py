"""The OpenAI API on a random-weight model (dummy:tiny, byte tokenizer): the real `openai` client,
sync and async, streaming and not; usage and finish reasons; /health, /metrics, /v1/models."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai

from minisched.engine import Engine
from minisched.sched.sampling_params import SamplingParams


def client(live, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key=kw.pop("api_key", "none"), max_retries=0, timeout=30, **kw)


def test_health_is_503_after_a_tensor_parallel_failure(tiny_server, tiny_engine, monkeypatch):
    """--tp: once a rank has died every step fails, so the probe must say so (not "ok")."""
    why = "tensor parallelism failed: rank 1 (pid 123) was killed by SIGKILL"
    monkeypatch.setattr(tiny_engine.runner, "health", lambda: why)  # what TPModelRunner.health reports then
    r = httpx.get(tiny_server.url + "/health", timeout=10)
    assert r.status_code == 503 and r.json() == {"status": why}


def test_health_models_metrics(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=10) as c:
        assert c.get("/health").json() == {"status": "ok"}
        models = client(tiny_server).models.list()
        assert [m.id for m in models.data] == ["tiny"]
        assert c.get("/v1/models/tiny").json()["max_model_len"] == 2048
        assert c.get("/v1/models/other").status_code == 404
        client(tiny_server).completions.create(model="tiny", prompt="metrics", max_tokens=3, temperature=0)
        text = c.get("/metrics").text
    for name in (
        "minisched_num_requests_running",
        "minisched_num_requests_waiting",
        "minisched_kv_pages_used",
        "minisched_kv_pages_cached",
        "minisched_kv_pages_free",
        "minisched_cache_hit_rate",
        "minisched_retractions_total",
        "minisched_time_to_first_token_seconds_bucket",
        "minisched_time_per_output_token_seconds_bucket",
        "minisched_e2e_request_latency_seconds_count",
        "minisched_prompt_tokens_total",
        "minisched_generation_tokens_total",
    ):
        assert name in text, name
    assert 'minisched_requests_finished_total{finish_reason="length"}' in text


def test_completion_matches_engine_and_reports_cache(tiny_server):
    prompt = "The radix cache shares this prompt across requests."  # 51 byte tokens: 3 full pages
    ref = Engine("dummy:tiny", num_pages=64).generate([prompt], SamplingParams(max_new_tokens=12))[0]
    c = client(tiny_server)
    first = c.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    assert first.choices[0].text == ref.text
    assert first.choices[0].model_extra["token_ids"] == ref.token_ids
    assert first.choices[0].finish_reason == "length"
    u = first.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(prompt), 12, len(prompt) + 12)
    second = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert second.choices[0].text == ref.text
    assert second.usage.prompt_tokens_details.cached_tokens == 48  # three 16-token pages from the radix cache
    ids = c.completions.create(model="tiny", prompt=list(ref.prompt_ids), max_tokens=12, temperature=0)
    assert ids.choices[0].text == ref.text


def test_streaming_completion_ends_with_done(tiny_server):
    body = {
        "model": "tiny",
        "prompt": "stream me",
        "max_tokens": 20,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=tiny_server.url, timeout=30) as c:
        full = c.post("/v1/completions", json={**body, "stream": False, "stream_options": None}).json()
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
    assert text == full["choices"][0]["text"]
    finals = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20


def test_openai_streaming_sync_and_async(tiny_server):
    c = client(tiny_server)
    whole = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi there"}], max_tokens=16, temperature=0
    )
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 16
    assert whole.choices[0].message.role == "assistant"
    parts = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi there"}], max_tokens=16, temperature=0, stream=True
        )
    ]
    assert "".join(parts) == whole.choices[0].message.content

    async def run():
        ac = openai.AsyncOpenAI(base_url=tiny_server.v1, api_key="none", max_retries=0, timeout=30)
        async with ac:
            stream = await ac.completions.create(
                model="tiny",
                prompt="async",
                max_tokens=10,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, usage, reasons = "", None, []
            async for ch in stream:
                if ch.choices:
                    text += ch.choices[0].text
                    reasons.append(ch.choices[0].finish_reason)
                usage = ch.usage or usage
            chat = await ac.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_completion_tokens=5, temperature=0
            )
            return text, usage, reasons, chat

    text, usage, reasons, chat = asyncio.run(run())
    assert len(text) == 10 and usage.completion_tokens == 10 and reasons[-1] == "length"
    assert chat.usage.completion_tokens == 5


def test_stop_string_finish_reason_stop(tiny_server):
    # the random model repeats the prompt's last byte: "hello" -> "oooo..."
    c = client(tiny_server)
    r = c.completions.create(model="tiny", prompt="hello", max_tokens=30, temperature=0, stop=["ooo"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ""
    assert r.usage.completion_tokens == 3
    chunks = list(
        c.completions.create(model="tiny", prompt="hello", max_tokens=30, temperature=0, stop="ooo", stream=True)
    )
    assert "".join(ch.choices[0].text for ch in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(tiny_server):
    c = client(tiny_server)
    a, b = (
        c.completions.create(
            model="tiny",
            prompt="seed",
            max_tokens=16,
            temperature=1.0,
            seed=7,
            extra_body={"top_k": 50, "return_token_ids": True},
        )
        for _ in range(2)
    )
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]


def test_max_tokens_beyond_context_is_clipped(tiny_server):
    prompt = "x" * 2000  # context 2048: 48 tokens of room
    r = client(tiny_server).completions.create(
        model="tiny", prompt=prompt, max_tokens=100000, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 48 and r.usage.total_tokens == 2048
