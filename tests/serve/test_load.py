"""64 concurrent streaming clients, a quarter of them disconnecting at random points: every
disconnected request is aborted in the engine, the others complete with the right tokens, no KV
page leaks (scheduler invariants after every step; the pool whole after evicting the cache), and
the server still answers."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest

from helpers.serve import TINY, pool_whole, running_server
from minisched.engine import Engine
from minisched.sched.sampling_params import SamplingParams

N_CLIENTS, N_DISCONNECT, MAX_TOKENS, LONG = 64, 16, 24, 1500


def prompts(n: int) -> list[str]:
    shared = "A shared system prompt that fills a page or two. "  # 50 bytes: radix-cache hits
    return [(shared if i % 2 else "") + f"client {i}: " + "abcdefghij"[i % 10] * (i % 7 + 1) for i in range(n)]


async def completer(ac: openai.AsyncOpenAI, prompt: str) -> dict:
    stream = await ac.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids, text, reasons, usage = [], "", [], None
    async for ch in stream:
        if ch.choices:
            ids += ch.choices[0].model_extra.get("token_ids", [])
            text += ch.choices[0].text
            reasons.append(ch.choices[0].finish_reason)
        usage = ch.usage or usage
    return {
        "rid": stream.response.headers["x-request-id"],
        "ids": ids,
        "text": text,
        "reason": reasons[-1],
        "usage": usage,
    }


async def disconnecter(ac: openai.AsyncOpenAI, prompt: str, after_chunks: int) -> str:
    stream = await ac.completions.create(
        model="tiny", prompt=prompt, max_tokens=LONG, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    rid = stream.response.headers["x-request-id"]
    n = 0
    if after_chunks:
        async for _ in stream:
            n += 1
            if n >= after_chunks:
                break
    await stream.close()  # drops the connection mid-stream
    return rid


def test_64_streaming_clients_with_disconnects():
    texts = prompts(N_CLIENTS)
    rng = random.Random(12)
    leavers = set(rng.sample(range(N_CLIENTS), N_DISCONNECT))
    stay = [i for i in range(N_CLIENTS) if i not in leavers]
    ref_engine = Engine(TINY, num_pages=256)
    refs = ref_engine.generate([texts[i] for i in stay], SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True))
    engine = Engine(TINY, num_pages=1024, max_running_requests=64)

    with running_server(engine) as live:

        async def run():
            ac = openai.AsyncOpenAI(base_url=live.v1, api_key="none", max_retries=0, timeout=60)
            async with ac:
                jobs = [
                    disconnecter(ac, texts[i], rng.randint(0, 8)) if i in leavers else completer(ac, texts[i])
                    for i in range(N_CLIENTS)
                ]
                return await asyncio.gather(*jobs)

        t0 = time.monotonic()
        results = asyncio.run(asyncio.wait_for(run(), 90))
        deadline = time.monotonic() + 20
        while live.state.live and time.monotonic() < deadline:  # the last aborts are on their way
            time.sleep(0.02)
        assert not live.state.live and live.state.queued == 0

        done = {i: r for i, r in zip(range(N_CLIENTS), results) if i not in leavers}
        for i, ref in zip(stay, refs):
            r = done[i]
            assert r["reason"] == "length" and r["usage"].completion_tokens == MAX_TOKENS
            assert r["ids"] == ref.token_ids and r["text"] == ref.text, f"client {i}"
        left = {results[i] for i in leavers}

        def final_states(e):
            last = {}
            for ev in e.scheduler.events:
                last[ev.rid] = (ev.dst.value, ev.note, ev.output_len)
            return last, dict(e.scheduler.reqs)

        last, still_live = live.call(final_states)
        assert not still_live
        for rid in left:  # the engine's request id is <response id>-<choice index>
            state, note, out_len = last[f"{rid}-0"]
            assert (state, note) == ("aborted", "abort") and out_len < LONG, (rid, last[rid])
        for r in done.values():
            assert last[f"{r['rid']}-0"][:2] == ("finished", "max_new_tokens")
        assert not live.loop.invariant_errors, live.loop.invariant_errors
        free, cached, total = live.call(pool_whole)
        assert (free, cached) == (total, 0), "KV pages leaked"
        # the server still answers
        again = openai.OpenAI(base_url=live.v1, api_key="none", max_retries=0).completions.create(
            model="tiny", prompt=texts[stay[0]], max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert again.choices[0].text == refs[0].text
        metrics = httpx.get(live.url + "/metrics").text
        assert f'minisched_requests_finished_total{{finish_reason="abort"}} {float(N_DISCONNECT)}' in metrics
        assert time.monotonic() - t0 < 120


def test_non_streaming_client_that_gives_up_is_aborted(tiny_server):
    body = {"model": "tiny", "prompt": "patience", "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=tiny_server.url, timeout=0.3) as c:
        try:
            c.post("/v1/completions", json=body)
            finished_first = True
        except httpx.ReadTimeout:  # the client closes the connection
            finished_first = False
    if finished_first:
        pytest.skip("the server answered 2,000 tokens within the client's 0.3 s timeout")
    deadline = time.monotonic() + 10
    while tiny_server.state.live and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not tiny_server.state.live

    def last_request(e):
        ev = [x for x in e.scheduler.events if x.prompt_len == len("patience")]
        return ev[-1].dst.value, ev[-1].note, ev[-1].output_len

    state, note, out_len = tiny_server.call(last_request)
    assert (state, note) == ("aborted", "abort") and out_len < 2000
