"""The engine on a tiny random-weights model: greedy output == a dense full-recompute forward.

Covered: page sizes 1 and 16, backends torch and native, chunked prefill, mixed chunks,
radix-cache prefix hits, cascade decode on/off, retraction under a tiny pool, bad input,
streaming, stop strings, seeded sampling and abort. Tests that are not about the backend
use the default ("auto": native when built, else the torch reference).
"""

from __future__ import annotations

import pytest

from helpers.engines import byte_engine, prompts, tiny_model
from helpers.engines import reference as _reference
from minisched import ops
from minisched.engine import Engine
from minisched.model.llama import LlamaModel
from minisched.sched.sampling_params import InvalidRequest, SamplingParams

NEW = 8
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
BACKENDS = [
    pytest.param("torch"),
    pytest.param("native", marks=pytest.mark.skipif(not ops.native_available(), reason="extension not built")),
]


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return tiny_model()


def make_engine(model: LlamaModel, **kw) -> Engine:
    return byte_engine(model, **kw)


def reference(model: LlamaModel, prompt: list[int], n: int = NEW) -> list[int]:
    return _reference(model, prompt, n)


def check_greedy(model, engine, ps, sampling=GREEDY):
    outs = engine.generate(ps, sampling)
    for o, p in zip(outs, ps):
        assert o.error is None, o.error
        assert o.token_ids == reference(model, p, sampling.max_new_tokens), f"prompt {o.index} ({len(p)} tokens)"
    engine.scheduler.check_invariants()
    return outs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_greedy_matches_dense(tiny, backend, page_size, chunk_size):
    engine = make_engine(tiny, backend=backend, page_size=page_size, chunk_size=chunk_size, check=True)
    check_greedy(tiny, engine, prompts([1, 5, 16, 17, 40]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_cache_hits_and_cascade(tiny, backend, page_size):
    system = prompts([37], seed=1)[0]
    ps = [system + p for p in prompts([3, 9, 20, 1], seed=2)]
    results = {}
    for cascade in (False, True):
        engine = make_engine(tiny, backend=backend, page_size=page_size, cascade=cascade, check=True)
        check_greedy(tiny, engine, ps[:1])  # warms the radix cache with the system prompt
        outs = check_greedy(tiny, engine, ps[1:])
        assert all(o.cached_tokens >= 37 // page_size * page_size for o in outs)
        assert (engine.runner.num_cascade_steps > 0) == cascade
        results[cascade] = [o.token_ids for o in outs]
    assert results[False] == results[True]


def test_mixed_chunks_and_lpm(tiny):
    engine = make_engine(tiny, page_size=4, chunk_size=6, enable_mixed_chunk=True, policy="lpm")
    check_greedy(tiny, engine, prompts([30, 2, 11, 25, 4], seed=3))
    assert any(s.mode == "mixed" for s in engine.scheduler.records().step_stats)


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_keeps_output(tiny, page_size):
    engine = make_engine(
        tiny, page_size=page_size, num_pages=48 // page_size, init_new_token_ratio=0.01, min_new_token_ratio=0.0
    )
    ps = prompts([5, 17, 1, 10], seed=4)
    outs = check_greedy(tiny, engine, ps, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert sum(o.num_retractions for o in outs) >= 1


def test_bad_requests_do_not_disturb_others(tiny):
    engine = make_engine(tiny, num_pages=8, page_size=16)  # 128-token pool
    good = prompts([6, 9], seed=5)
    batch = [good[0], [], list(range(3, 203)), good[1], [3, 4, 99999]]
    outs = engine.generate(batch, GREEDY)
    assert outs[0].token_ids == reference(tiny, good[0]) and outs[3].token_ids == reference(tiny, good[1])
    assert "empty prompt" in outs[1].error
    assert "max_context_len" in outs[2].error or "KV pool" in outs[2].error
    assert "out of range" in outs[4].error
    for i in (1, 2, 4):
        assert outs[i].finish_reason == "error" and outs[i].token_ids == []
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.add_request(good[0], SamplingParams(temperature=-1.0))
    with pytest.raises(InvalidRequest, match="top_p"):
        engine.generate([good[0]], SamplingParams(top_p=0.0))
    assert [o.error is not None for o in engine.generate([good[0], good[1]], [GREEDY, {"top_k": 0}])] == [False, True]
    engine.scheduler.check_invariants()


def test_bad_engine_args(tiny):
    with pytest.raises(ValueError, match="GiB"):
        make_engine(tiny, num_pages=10**9)
    with pytest.raises(ValueError, match="at least 2 pages"):
        make_engine(tiny, num_pages=1)
    with pytest.raises(ValueError, match="backend"):
        make_engine(tiny, backend="cuda-magic")
    with pytest.raises(ValueError, match="policy"):
        make_engine(tiny, policy="random")
    with pytest.raises(FileNotFoundError, match="not found"):
        Engine("/no/such/model.gguf")


def test_stream_equals_generate(tiny):
    ps = prompts([4, 12], seed=6)
    engine = make_engine(tiny)
    chunks = list(engine.stream(ps, GREEDY))
    assert sum(c.finished for c in chunks) == 2
    for i, p in enumerate(ps):
        mine = [c for c in chunks if c.index == i]
        assert sum((c.token_ids for c in mine), []) == reference(tiny, p)
        assert "".join(c.delta for c in mine) == mine[-1].output.text


def test_stop_tokens_and_strings(tiny):
    p = prompts([9], seed=7)[0]
    want = reference(tiny, p)
    engine = make_engine(tiny)
    out = engine.generate([p], SamplingParams(max_new_tokens=NEW, stop_token_ids=(want[2],), ignore_eos=False))[0]
    assert out.token_ids == want[: want.index(want[2]) + 1] and out.finish_reason == "stop_token"
    full = engine.tokenizer.decode(want)
    stop = engine.tokenizer.decode(want[3:5])
    if stop and full.find(stop) > 0:
        out = engine.generate([p], SamplingParams(max_new_tokens=NEW, stop=(stop,), ignore_eos=True))[0]
        assert out.finish_reason == "stop_str" and out.text == full[: full.find(stop)]


def test_seeded_sampling_is_reproducible(tiny):
    ps = prompts([5, 8, 13], seed=8)
    engine = make_engine(tiny)
    # the tiny model's logits are very peaked (tied N(0,1) embeddings): a high temperature spreads them
    sp = SamplingParams(temperature=30.0, top_k=50, top_p=0.9, seed=123, max_new_tokens=NEW, ignore_eos=True)
    a = engine.generate(ps, sp)
    b = engine.generate(ps[:1], sp)  # alone in its batch, from a warm cache
    assert a[0].token_ids == b[0].token_ids
    c = engine.generate(ps[:1], SamplingParams(temperature=30.0, seed=124, max_new_tokens=NEW, ignore_eos=True))
    assert c[0].token_ids != a[0].token_ids  # different seeds diverge


def test_abort(tiny):
    engine = make_engine(tiny)
    ps = prompts([6, 7, 8], seed=9)
    reqs = [engine.add_request(p, GREEDY) for p in ps]
    engine.step()
    assert engine.abort(reqs[1].rid)
    done = []
    while engine.has_work():
        done += engine.step()
    assert sorted(r.rid for r in done) == sorted([reqs[0].rid, reqs[2].rid])
    assert reqs[1].finish_reason.value == "abort"
    engine.scheduler.check_invariants()


def test_cpu_pool_sizing_counts_reclaimable_memory(tmp_path):
    """Regression: the CPU pool check read only free pages (SC_AVPHYS_PAGES), so after model loads filled
    the page cache a restarted engine refused a 0.7 GiB pool with 12 GiB available."""
    import torch

    from minisched.engine.options import available_bytes

    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24000000 kB\nMemFree:          350000 kB\nMemAvailable:   12000000 kB\n")
    assert available_bytes(torch.device("cpu"), str(info)) == 12000000 * 1024
    assert available_bytes(torch.device("cpu"), str(tmp_path / "missing")) > 0  # no /proc: the free pages
