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
            mover = engine.runner.kv_mover
            assert len(mover.free_slots) == host - engine.host_tier.used  # the slots follow the accounting
            engine.scheduler.flush_cache()
            assert engine.host_tier.used == 0 and sorted(mover.free_slots) == list(range(host))


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


def test_the_host_pool_is_allocated_whole_and_its_slots_round_trip():
    """The pool is resident from the start (zero-filled, not grown as the tier fills: a server's RSS does
    not creep by the tier's size); a copy lands in free slots and comes back bit-exact into other pages;
    split and free give the slots back; more pages than slots is a clear error."""
    import torch

    from minisched.engine.kv_tier import HostKVMover

    torch.manual_seed(0)
    kv = torch.randn(2, 2, 10, 4, 3, 8)  # [L, 2, pages, page_size, Hkv, D]
    mover = HostKVMover(kv, "native", 6)
    assert mover.pool.shape == (2, 2, 6, 4, 3, 8) and mover.pool.is_contiguous()
    assert torch.count_nonzero(mover.pool) == 0
    want = kv[:, :, [7, 2, 5]].clone()
    handle = mover.to_host([7, 2, 5])
    assert len(handle) == 3 and len(mover.free_slots) == 3
    kv[:, :, [7, 2, 5]] = float("nan")  # the device pages are reused
    first, rest = mover.split(handle, 1)
    mover.to_device(first, [0])
    mover.to_device(rest, [8, 9])
    assert torch.equal(kv[:, :, [0, 8, 9]], want)
    mover.free(first)
    mover.free(rest)
    assert sorted(mover.free_slots) == list(range(6))
    mover.to_host([1, 2, 3, 4])
    with pytest.raises(RuntimeError, match="host KV pool: 3 pages do not fit"):
        mover.to_host([5, 6, 7])
    with pytest.raises(ValueError, match="capacity_pages >= 1"):
        HostKVMover(kv, "native", 0)
