"""The real model (SmolLM2-135M-Instruct) through the server: greedy output equals `Engine.generate`
token for token (completions, sync and async, streaming and not), chat uses the model's template,
and a stop string is cut the same way streaming and not, never leaking into the stream."""

from __future__ import annotations

import asyncio

import openai
import pytest

from helpers.serve import running_server
from minisched.engine import Engine
from minisched.sched.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name three fruits."}]
N = 12
pytestmark = pytest.mark.slow  # ~3 s to load, then a few hundred tokens on the CPU (much longer on a busy machine)


@pytest.fixture(scope="module")
def smol():
    try:
        engine = Engine("smollm2", num_pages=256)
    except Exception as exc:  # the model package is part of the dev setup (make test installs it)
        pytest.skip(f"SmolLM2 not available: {exc}")
    refs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=N))
    chat_ref = engine.generate([CHAT], SamplingParams(max_new_tokens=N))[0]
    # the reference ran before the server: from here on only the engine thread touches the engine
    with running_server(engine, model_name="smollm2") as live:
        yield live, refs, chat_ref
    assert not live.loop.invariant_errors


def test_greedy_completions_equal_engine_generate(smol):
    live, refs, _ = smol
    c = openai.OpenAI(base_url=live.v1, api_key="none", max_retries=0, timeout=60)
    for prompt, ref in zip(PROMPTS, refs):
        r = c.completions.create(
            model="smollm2", prompt=prompt, max_tokens=N, temperature=0, extra_body={"return_token_ids": True}
        )
        assert r.choices[0].model_extra["token_ids"] == ref.token_ids
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ("stop" if ref.finish_reason == "stop_token" else "length")
        assert r.usage.prompt_tokens == len(ref.prompt_ids)
        assert r.usage.prompt_tokens_details.cached_tokens == len(ref.prompt_ids) // 16 * 16  # the reference's KV

    async def streamed(prompt):
        ac = openai.AsyncOpenAI(base_url=live.v1, api_key="none", max_retries=0, timeout=60)
        async with ac:
            s = await ac.completions.create(
                model="smollm2",
                prompt=prompt,
                max_tokens=N,
                temperature=0,
                stream=True,
                extra_body={"return_token_ids": True},
            )
            ids, text = [], ""
            async for ch in s:
                ids += ch.choices[0].model_extra["token_ids"]
                text += ch.choices[0].text
            return ids, text

    async def both():
        return await asyncio.gather(*(streamed(p) for p in PROMPTS))

    for (ids, text), ref in zip(asyncio.run(both()), refs):  # concurrently: batched on the server
        assert ids == ref.token_ids and text == ref.text


def test_chat_uses_the_template(smol):
    live, _, chat_ref = smol
    c = openai.OpenAI(base_url=live.v1, api_key="none", max_retries=0, timeout=60)
    r = c.chat.completions.create(model="smollm2", messages=CHAT, max_completion_tokens=N, temperature=0)
    assert r.choices[0].message.content == chat_ref.text
    assert r.usage.prompt_tokens == len(chat_ref.prompt_ids) and r.usage.completion_tokens == len(chat_ref.token_ids)
    parts = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model="smollm2", messages=CHAT, max_completion_tokens=N, temperature=0, stream=True
        )
        if ch.choices
    ]
    assert "".join(parts) == chat_ref.text


def test_stop_string_cut_alike_streaming_and_not(smol):
    live, _, chat_ref = smol
    text = chat_ref.text
    assert len(text) >= 12, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # three characters in the middle of the greedy answer
    want = text[: text.find(stop)]
    c = openai.OpenAI(base_url=live.v1, api_key="none", max_retries=0, timeout=60)
    r = c.chat.completions.create(model="smollm2", messages=CHAT, max_completion_tokens=N, temperature=0, stop=[stop])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(
        c.chat.completions.create(
            model="smollm2", messages=CHAT, max_completion_tokens=N, temperature=0, stop=[stop], stream=True
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
