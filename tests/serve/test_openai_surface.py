"""The OpenAI surface real clients use, through the `openai` SDK (sync and async) against a live server
on dummy:tiny: logprobs and echo, n > 1, batched prompts, the sampling fields vLLM and SGLang accept,
unknown vendor fields, structured outputs. Numbers are checked against the in-process Engine."""

from __future__ import annotations

import asyncio
import json
import math
import re

import httpx
import openai
import pytest

from minisched.sched.sampling_params import SamplingParams


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="none", max_retries=0, timeout=30)


def test_completion_logprobs_and_echo_match_the_engine(tiny_server, tiny_engine):
    prompt = [5, 17, 99, 200, 31, 8, 64]
    r = client(tiny_server).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        echo=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ch = r.choices[0]
    ref = tiny_server.call(
        lambda e: e.generate(
            [prompt], SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=3)
        )[0]
    )
    lp = ch.logprobs
    assert ch.token_ids == ref.token_ids and len(lp.tokens) == len(prompt) + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    want = [e.logprob for e in ref.prompt_logprobs[1:]] + [e.logprob for e in ref.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert all(len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    prompt_text = tiny_engine.tokenizer.decode(prompt, skip_special_tokens=False)
    assert ch.text == prompt_text + ref.text
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 5


def test_echo_with_max_tokens_zero_is_a_loglikelihood_request(tiny_server):
    """lm-evaluation-harness scores choices this way: echo the prompt's logprobs, generate nothing."""
    r = client(tiny_server).completions.create(
        model="tiny", prompt="the cat sat", max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    ch = r.choices[0]
    assert ch.text == "the cat sat" and ch.finish_reason == "length"
    assert ch.logprobs.token_logprobs[0] is None and all(x <= 0 for x in ch.logprobs.token_logprobs[1:])
    assert r.usage.completion_tokens == 0


def test_streamed_completion_logprobs_equal_the_whole(tiny_server):
    c = client(tiny_server)
    args = dict(
        model="tiny", prompt="stream me", max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    whole = c.completions.create(**args).choices[0]
    tokens, lps, text = [], [], ""
    for chunk in c.completions.create(stream=True, **args):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                lps += ch.logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert lps == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)


def test_chat_logprobs_format(tiny_server):
    r = client(tiny_server).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 5 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token or e.token == "\ufffd"
        assert e.top_logprobs[0].token == e.token  # greedy
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == r.choices[0].message.content


def test_n_choices_and_batched_prompts(tiny_server):
    c = client(tiny_server)
    r = c.completions.create(
        model="tiny",
        prompt=["one prompt", "abc"],
        n=2,
        max_tokens=4,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    # choice j of a seeded prompt samples with seed + j: choice 1 == a single request with seed 4
    single = c.completions.create(
        model="tiny", prompt="one prompt", max_tokens=4, temperature=1.0, seed=4, extra_body={"ignore_eos": True}
    )
    assert r.choices[1].text == single.choices[0].text
    ids = len(tiny_server.state.tokenizer.encode("one prompt"))
    assert r.usage.prompt_tokens == ids + 3 and r.usage.completion_tokens == 16  # each prompt counted once
    by_ids = c.completions.create(
        model="tiny", prompt=[[9, 8, 7], [5]], max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [ch.index for ch in by_ids.choices] == [0, 1] and by_ids.usage.prompt_tokens == 4
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        n=3,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [ch.index for ch in chat.choices] == [0, 1, 2]
    assert len({ch.message.content for ch in chat.choices}) == 1  # greedy: all the same


def test_async_streams_interleave_choices_and_the_role_comes_with_the_first_token(tiny_server):
    async def run():
        c = openai.AsyncOpenAI(base_url=tiny_server.v1, api_key="none", max_retries=0, timeout=30)
        texts, first = {}, {}
        stream = await c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "go"}],
            n=2,
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            for ch in chunk.choices:
                if ch.index not in first:
                    first[ch.index] = ch.delta
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
        await c.close()
        return texts, first

    texts, first = asyncio.run(run())
    assert set(texts) == {0, 1} and texts[0] == texts[1]
    for d in first.values():  # no role-only chunk at admission
        assert d.role == "assistant" and d.content


def test_sampling_fields_and_vendor_extras(tiny_server, caplog):
    c = client(tiny_server)
    ref = tiny_server.call(lambda e: e.generate(["bias"], SamplingParams(max_new_tokens=1, logprobs=5))[0])
    top = ref.logprobs[0].top  # (id, logprob), best first (ids: token strings of random weights collide)
    best = top[0][0]
    other = next(t for t, v in top[1:] if top[0][1] - v < 90)  # a bias of 100 must overtake the best
    forced = c.completions.create(
        model="tiny",
        prompt="bias",
        max_tokens=1,
        temperature=0,
        logit_bias={str(other): 100},
        extra_body={"return_token_ids": True},
    )
    assert forced.choices[0].token_ids == [other]
    stopped = c.completions.create(
        model="tiny",
        prompt="bias",
        max_tokens=5,
        temperature=0,
        extra_body={"stop_token_ids": [best], "return_token_ids": True},
    )
    assert stopped.choices[0].token_ids == [best] and stopped.choices[0].finish_reason == "stop"
    held = c.completions.create(
        model="tiny",
        prompt="bias",
        max_tokens=3,
        temperature=0,
        extra_body={"stop_token_ids": [best], "min_tokens": 3, "return_token_ids": True},
    )
    assert best not in held.choices[0].token_ids and len(held.choices[0].token_ids) == 3
    # every penalty and filter at once: the same tokens as the in-process engine with the same settings
    fields = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4, min_p=0.05, top_k=8, seed=7)
    served = c.completions.create(
        model="tiny",
        prompt=[7, 8, 9],
        max_tokens=6,
        temperature=0.9,
        frequency_penalty=0.5,
        presence_penalty=0.4,
        seed=7,
        extra_body={"repetition_penalty": 1.3, "min_p": 0.05, "top_k": 8, "ignore_eos": True, "return_token_ids": True},
    )
    ref = tiny_server.call(
        lambda e: e.generate([[7, 8, 9]], SamplingParams(max_new_tokens=6, temperature=0.9, ignore_eos=True, **fields))[
            0
        ]
    )
    assert served.choices[0].token_ids == ref.token_ids
    with caplog.at_level("WARNING", logger="minisched.serve"):
        ok = httpx.post(
            tiny_server.v1 + "/completions",
            timeout=10,
            json={
                "model": "tiny",
                "prompt": "x",
                "max_tokens": 2,
                "guided_decoding_backend": "auto",
                "best_of": 1,
                "use_beam_search": False,
                "spaces_between_special_tokens": True,
            },
        )
        again = httpx.post(
            tiny_server.v1 + "/completions",
            timeout=10,
            json={"model": "tiny", "prompt": "x", "max_tokens": 2, "use_beam_search": False},
        )
    assert ok.status_code == 200 and again.status_code == 200, ok.text
    logged = [r.getMessage() for r in caplog.records if "ignoring request fields" in r.getMessage()]
    assert sum("use_beam_search" in m for m in logged) <= 1  # logged once per name, then silently ignored


def test_structured_outputs(tiny_server):
    c = client(tiny_server)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    r = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=30,
        temperature=0.8,
        seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
    )
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    rx = c.completions.create(
        model="tiny", prompt="id:", max_tokens=20, temperature=1.0, seed=2, extra_body={"regex": "[A-Z]{3}-[0-9]{3}"}
    )
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", rx.choices[0].text)
    any_json = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "{"}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = any_json.choices[0].message.content
    assert any_json.choices[0].finish_reason == "length" or json.loads(text) is not None
    with pytest.raises(openai.BadRequestError, match="invalid regex"):
        c.completions.create(model="tiny", prompt="x", max_tokens=3, extra_body={"regex": "(unclosed"})


def test_logprobs_are_normalized(tiny_server):
    """The top alternatives of one position are a distribution's head: their probabilities sum to <= 1."""
    r = client(tiny_server).completions.create(
        model="tiny", prompt="sum", max_tokens=3, temperature=0, logprobs=5, extra_body={"ignore_eos": True}
    )
    for top in r.choices[0].logprobs.top_logprobs:
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-5
