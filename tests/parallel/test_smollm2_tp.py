"""SmolLM2-135M (9 query / 3 KV heads) at TP=3 -- three query heads and one KV head per rank -- gives
the one-process engine's greedy tokens, with a shared system prompt so that the radix cache hits.

The partial sums after O and down are added by an all-reduce instead of inside one GEMM, so the
logits differ in the last bits; greedy tokens stay the same unless two logits tie to ~1e-5."""

from __future__ import annotations

import pytest
import torch

from minisched.model import weights
from minisched.sched.sampling_params import SamplingParams

SYSTEM = "You are a concise assistant. Answer in one short sentence."
QUESTIONS = ["What is the capital of France?", "Name three fruits.", "Write a haiku about the sea."]


@pytest.mark.slow
def test_smollm2_tp3_equals_tp1():
    try:
        weights.default_gguf_path()
    except weights.ModelNotFound as exc:
        pytest.skip(str(exc))
    from minisched.engine import Engine

    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    sampling = SamplingParams(max_new_tokens=20)
    kw = dict(page_size=16, chunk_size=64)
    threads = torch.get_num_threads()
    try:
        with Engine("smollm2", tp=3, tp_timeout=60, **kw) as engine:  # starts ranks 1 and 2, closes them
            session = engine.tp_session
            assert engine.kv_cache.shape[-2] == 1  # one KV head per rank
            first = engine.generate(chats[:1], sampling)  # warms the cache with the system prompt
            outs = first + engine.generate(chats[1:], sampling)
    finally:
        torch.set_num_threads(threads)
    assert [p.exitcode for p in session.procs] == [0, 0]
    ref_engine = Engine("smollm2", num_threads=threads, **kw)
    refs = ref_engine.generate(chats[:1], sampling) + ref_engine.generate(chats[1:], sampling)
    for o, r in zip(outs, refs):
        assert o.error is None, o.error
        assert o.token_ids == r.token_ids, (o.text, r.text)
        assert o.cached_tokens == r.cached_tokens
    assert all(o.cached_tokens > 0 for o in outs[1:])
