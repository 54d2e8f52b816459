"""The host KV tier through the engine (tiny random model, real gather_kv_pages / scatter_kv_pages): greedy
outputs are the dense reference's with the tier on and off -- page sizes 1 and 16, chunked prefill, overlap
on and off, pools from tiny to ample -- the evicted prefixes come back from the host, and a step that fails
after a load-back leaves the cache right."""

from __future__ import annotations

import pytest

from helpers.engines import byte_engine, prompts, reference, tiny_model
from minisched.sched.sampling_params import SamplingParams

NEW = 5
SP = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def turns(n_conv: int, n_turns: int, seed: int = 0):
    """Multi-turn chats: each turn's prompt is the previous one plus new tokens."""
    base = prompts([24] * n_conv, seed=seed)
    ext = prompts([12] * (n_conv * n_turns), seed=seed + 1)
    out, cur = [], [list(b) for b in base]
    for t in range(n_turns):
        for i in range(n_conv):
            cur[i] = cur[i] + ext[t * n_conv + i]
        out.append([list(c) for c in cur])
    return out


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size, num_pages, chunk", [(1, 70, 16), (16, 5, 32), (16, 8, None)])
def test_greedy_same_with_the_tier_on_and_off(tiny, overlap, page_size, num_pages, chunk):
    rounds = turns(3, 3)
    computed = {}
    for host in (0, 400 // page_size + 8):
        engine = byte_engine(
            tiny, overlap=overlap, page_size=page_size, num_pages=num_pages, chunk_size=chunk, host_kv_pages=host
        )
        for ps in rounds:
            outs = engine.generate(ps, SP)
            assert [o.token_ids for o in outs] == [reference(tiny, p, NEW) for p in ps]
            engine.scheduler.check_invariants()
        computed[host] = sum(s.num_prefill_tokens for s in engine.scheduler.records().step_stats)
        if host:
            st = engine.host_tier.stats
            assert st.write_backs > 0 and st.loads > 0, "the pool was meant to be too small for the chats"
            assert computed[host] < computed[0]


def test_a_failed_step_after_a_load_back_leaves_the_cache_right(tiny, monkeypatch):
    engine = byte_engine(tiny, page_size=4, num_pages=20, chunk_size=16, host_kv_pages=200)
    a, others = prompts([30], seed=5)[0], prompts([30, 30, 30], seed=6)
    engine.generate([a], SP)
    engine.generate(others, SP)  # a's prefix goes to the host
    assert engine.host_tier.stats.write_backs > 0
    calls = [0]
    real = engine.runner.run_model

    def boom(*args):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("boom")
        return real(*args)

    monkeypatch.setattr(engine.runner, "run_model", boom)
    failed = engine.generate([a + [9, 9, 9]], SP)[0]
    assert failed.finish_reason == "error"
    loads = engine.host_tier.stats.loads
    assert loads > 0  # the failed step had loaded a's prefix back (its forward raised after the loads)
    again = engine.generate([a + [9, 9, 9]], SP)[0]
    assert again.token_ids == reference(tiny, a + [9, 9, 9], NEW) and again.cached_tokens > 0
    engine.scheduler.check_invariants()


def test_the_tier_needs_the_plain_runner():
    from minisched.engine.config import EngineConfig

    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(host_kv_pages=10, tp=2)
    with pytest.raises(ValueError, match="host_kv_pages"):
        EngineConfig(host_kv_pages=-1)
