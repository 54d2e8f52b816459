"""Tensor parallelism over real processes (gloo on the CPU): this test process is rank 0 and spawns rank 1.

Greedy output at TP=2 equals the one-process engine on the same random weights -- under chunked
prefill, mixed chunks, radix-cache hits (plain and cascade decode), retraction and overlap
scheduling -- for a model whose KV heads split over the ranks (4 query / 2 KV heads) and one
whose KV head is replicated (2 / 1). The weights are scaled (ModelSource.weight_scale) so that
greedy tokens depend on attention and MLP, not just on the last token's embedding.
"""

from __future__ import annotations

import pytest
import torch

from minisched.engine import Engine
from minisched.model.config import preset
from minisched.model.tokenizer import MiniTokenizer
from minisched.parallel import ModelSource, ShardPlan, TPError, TPSession, protocol
from minisched.sched.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
MODELS = {"split-kv": preset("tiny", num_heads=4, num_kv_heads=2), "replicated-kv": preset("tiny")}


@pytest.fixture(scope="module", params=list(MODELS))
def tp(request):
    source = ModelSource(config=MODELS[request.param], seed=0, weight_scale=10.0)
    threads = torch.get_num_threads()
    session = TPSession.start(2, source, timeout=30, startup_timeout=300)
    try:
        yield session, source.load()
    finally:
        session.close()
        torch.set_num_threads(threads)
    assert [p.exitcode for p in session.procs] == [0]  # STOP ended the worker cleanly


def engines(tp, **kw):
    """The TP=2 engine and the one-process engine on the full model, with the same options."""
    session, full = tp
    ref = Engine(full, tokenizer=MiniTokenizer.byte_level(full.cfg.vocab_size), num_threads=1, **kw)
    return Engine(tp_session=session, **kw), ref


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def same_output(tp, ps, sampling=GREEDY, **kw):
    eng, ref = engines(tp, **kw)
    outs, refs = eng.generate(ps, sampling), ref.generate(ps, sampling)
    for o, r in zip(outs, refs):
        assert o.error is None, o.error
        assert o.token_ids == r.token_ids, f"prompt {o.index} ({len(o.prompt_ids)} tokens)"
        assert (o.cached_tokens, o.num_retractions) == (r.cached_tokens, r.num_retractions)
    eng.scheduler.check_invariants()
    return outs, eng, ref


@pytest.mark.parametrize(
    "kw",
    [
        dict(page_size=4, chunk_size=7),
        dict(page_size=1, chunk_size=None),
        dict(page_size=4, chunk_size=6, enable_mixed_chunk=True, policy="lpm"),
    ],
    ids=["chunked", "ps1", "mixed"],
)
def test_greedy_equals_one_process(tp, kw):
    outs, eng, _ = same_output(tp, prompts([1, 5, 16, 17, 40, 3]), **kw)
    kv0, kv1 = ShardPlan.of(tp[1].cfg, 0, 2).kv_heads
    assert eng.kv_cache.shape[-2] == kv1 - kv0 == max(1, tp[1].cfg.num_kv_heads // 2)  # rank 0's pool: its heads
    if kw.get("enable_mixed_chunk"):
        assert any(s.mode == "mixed" for s in eng.scheduler.step_stats)


@pytest.mark.parametrize("cascade", [False, True])
def test_radix_hits_and_cascade(tp, cascade):
    system = prompts([37], seed=1)[0]
    ps = [system + p for p in prompts([3, 9, 20, 1], seed=2)]
    eng, ref = engines(tp, page_size=4, cascade=cascade)
    for batch in (ps[:1], ps[1:]):  # the first warms the radix cache with the system prompt
        outs, refs = eng.generate(batch, GREEDY), ref.generate(batch, GREEDY)
        assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert all(o.cached_tokens >= 36 for o in outs)
    assert (eng.runner.num_cascade_steps > 0) == cascade


def test_retraction(tp):
    outs, _, _ = same_output(
        tp,
        prompts([5, 17, 1, 10], seed=4),
        SamplingParams(max_new_tokens=12, ignore_eos=True),
        page_size=4,
        num_pages=12,
        init_new_token_ratio=0.01,
        min_new_token_ratio=0.0,
    )
    assert sum(o.num_retractions for o in outs) >= 1


def test_overlap_scheduling(tp):
    same_output(tp, prompts([4, 30, 11], seed=5), page_size=4, chunk_size=8, overlap=True)


def test_seeded_sampling(tp):
    sampling = [
        SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=50, seed=s, ignore_eos=True)
        for s in range(4)
    ]
    same_output(tp, prompts([6, 2, 19, 8], seed=6), sampling, page_size=4)


def test_step_messages_and_bytes(tp):
    """A decode step of B requests: one header + one packed payload broadcast, all-reduces of
    B x hidden float32 for the embedding and after O and down in every layer, one logits gather."""
    session, full = tp
    cfg, stats = full.cfg, session.group.stats  # 5-token prompts, page size 4: 6 tokens in 2 pages at decode
    eng, _ = engines(tp, page_size=4)
    for n in (1, 3):
        for p in prompts([5] * n, seed=7 + n):
            eng.add_request(p, SamplingParams(max_new_tokens=3, ignore_eos=True))
        eng.step()  # their prefill
        before = stats.snapshot()
        eng.step()
        step = eng.scheduler.step_stats[-1]
        assert (step.mode, step.batch_size) == ("decode", n)
        d = stats.delta(stats.snapshot(), before)
        assert d["broadcast"]["calls"] == 2
        # ids, positions, slots, logits rows, last page lens: n each; qo and kv indptr: n + 1; 2 pages each
        assert d["broadcast"]["bytes"] == 8 * protocol.HEADER_LEN + 4 * (9 * n + 2)
        assert d["all_reduce"]["calls"] == 1 + 2 * cfg.num_layers
        assert d["all_reduce"]["bytes"] == n * cfg.hidden_size * 4 * (1 + 2 * cfg.num_layers)
        assert d["gather"]["calls"] == 1
        assert d["gather"]["bytes"] == n * -(-cfg.vocab_size // 2) * 4
        while eng.has_work():
            eng.step()


def test_a_replaced_engine_fails_clearly_and_the_session_goes_on(tp):
    old, _ = engines(tp, page_size=4)
    same_output(tp, prompts([5], seed=10), page_size=4)
    out = old.generate(prompts([5], seed=10), GREEDY)[0]
    assert out.finish_reason == "error" and "replaced by a newer engine" in out.error
    same_output(tp, prompts([6], seed=11), page_size=4)
    session, _ = tp
    assert session.failure is None
    with pytest.raises(TPError, match="replaced"):
        session.run_step(old.kv_cache, torch.zeros(1, dtype=torch.int32), None, backend=old.backend, check=False)
    assert protocol.HEADER_LEN == 1 + protocol.NUM_ARGS + len(protocol.FIELDS)
