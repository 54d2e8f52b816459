"""Output and prompt logprobs, n > 1 choices and penalties through the engine (tiny random model), against a
dense full-recompute reference: the same numbers with chunked prefill, a warm radix cache, overlap on/off."""

from __future__ import annotations

import pytest
import torch

from helpers.engines import byte_engine, prompts, reference, tiny_model
from minisched.model.llama import dense_forward
from minisched.model.sampling import RowHistory, process_logits
from minisched.sched.sampling_params import SamplingParams

NEW = 6


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def dense_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(dense_forward(model, torch.tensor(ids)).double(), -1)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size, chunk_size", [(1, None), (4, 7)])
def test_output_logprobs_match_dense(tiny, overlap, page_size, chunk_size):
    engine = byte_engine(tiny, overlap=overlap, page_size=page_size, chunk_size=chunk_size)
    ps = prompts([5, 11, 17], seed=3)
    outs = engine.generate(ps, SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=3))
    for o, p in zip(outs, ps):
        assert o.token_ids == reference(tiny, p, NEW) and len(o.logprobs) == NEW
        lp = dense_logprobs(tiny, p + o.token_ids)
        for k, (tok, entry) in enumerate(zip(o.token_ids, o.logprobs)):
            row = lp[len(p) + k - 1]
            assert entry.token_id == tok and entry.logprob == pytest.approx(float(row[tok]), abs=1e-4)
            assert [t for t, _ in entry.top] == torch.topk(row, 3).indices.tolist()
            assert entry.top[0][0] == tok  # greedy: the chosen token is the most likely one


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("start", [0, 6])
def test_prompt_logprobs_chunked_and_cached(tiny, overlap, start):
    """Chunks of 7 over a 4-token page: the logits at each chunk's last row predict the next chunk's first
    token; a second identical request finds the prompt in the radix cache and still gets every logprob."""
    engine = byte_engine(tiny, overlap=overlap, page_size=4, chunk_size=7)
    p = prompts([23], seed=5)[0]
    sp = SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=2, prompt_logprob_start=start)
    lp = dense_logprobs(tiny, p)
    for attempt in range(2):
        out = engine.generate([p], sp)[0]
        assert out.token_ids == reference(tiny, p, 2)
        got = out.prompt_logprobs
        assert len(got) == len(p) - start
        if start == 0:
            assert got[0] is None
        for pos in range(max(start, 1), len(p)):
            e = got[pos - start]
            assert e.token_id == p[pos] and e.logprob == pytest.approx(float(lp[pos - 1, p[pos]]), abs=1e-4)
            assert [t for t, _ in e.top] == torch.topk(lp[pos - 1], 2).indices.tolist()
        if attempt == 1:  # reused what it could: the pages before the first position it needs logits of
            assert 0 < out.cached_tokens <= max(start - 1, 0) or (start <= 1 and out.cached_tokens == 0)
    engine.scheduler.check_invariants()


def test_prefill_only_with_prompt_logprobs(tiny):
    """lm-eval's loglikelihood request: echo the prompt's logprobs, generate nothing."""
    engine = byte_engine(tiny)
    p = prompts([9], seed=1)[0]
    out = engine.generate([p], SamplingParams(max_new_tokens=0, prompt_logprobs=0))[0]
    lp = dense_logprobs(tiny, p)
    assert out.token_ids == [] and out.finish_reason == "length"
    assert [e.logprob for e in out.prompt_logprobs[1:]] == pytest.approx(
        [float(lp[i - 1, p[i]]) for i in range(1, len(p))], abs=1e-4
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_n_choices_prefill_the_prompt_once(tiny, overlap):
    engine = byte_engine(tiny, overlap=overlap, page_size=4)
    p = prompts([30], seed=2)[0]
    outs = engine.generate([p], SamplingParams(max_new_tokens=NEW, ignore_eos=True), n=3)
    assert [o.choice for o in outs] == [0, 1, 2] and all(o.index == 0 for o in outs)
    assert all(o.token_ids == reference(tiny, p, NEW) for o in outs)
    prefill = sum(s.num_prefill_tokens for s in engine.scheduler.records().step_stats)
    # once in full; then each choice copies the partial last page (30 = 7 pages + 2 tokens) and computes
    # the last token only, whose logits sample its first token
    assert prefill == 30 + 3 * 1, prefill
    assert engine.scheduler.forks.copied == 3 and not engine.scheduler.forks.pages()
    assert all(o.cached_tokens == 29 for o in outs)  # 7 pages from the cache + 1 copied page (2 tokens)
    engine.scheduler.check_invariants()


def test_n_choices_derive_their_seeds(tiny):
    engine = byte_engine(tiny)
    p = prompts([8], seed=4)[0]
    hot = SamplingParams(temperature=50.0, seed=11, max_new_tokens=NEW, ignore_eos=True)
    outs = engine.generate([p], hot, n=3)
    singles = [
        engine.generate([p], SamplingParams(temperature=50.0, seed=11 + j, max_new_tokens=NEW, ignore_eos=True))[0]
        for j in range(3)
    ]
    assert [o.token_ids for o in outs] == [s.token_ids for s in singles]
    assert len({tuple(o.token_ids) for o in outs}) > 1


@pytest.mark.parametrize("overlap", [False, True])
def test_penalties_match_the_reference_loop(tiny, overlap):
    """Greedy with every penalty: each step's history holds the token the previous step sampled, which
    under overlap is still a placeholder when the step is prepared."""
    sp = SamplingParams(
        max_new_tokens=8,
        ignore_eos=True,
        repetition_penalty=1.5,
        frequency_penalty=0.7,
        presence_penalty=0.4,
        logit_bias={7: 3.0},
        min_tokens=3,
        stop_token_ids=(9,),
    )
    engine = byte_engine(tiny, overlap=overlap, page_size=4)
    ps = prompts([6, 13], seed=7)
    outs = engine.generate(ps, sp)
    for o, p in zip(outs, ps):
        ids = list(p)
        while len(ids) - len(p) < sp.max_new_tokens:
            with torch.no_grad():
                last = dense_forward(tiny, torch.tensor(ids))[-1:]
            x = process_logits(last, [sp], [RowHistory(p, ids[len(p) :])], None)
            ids.append(int(x.argmax()))
            if ids[-1] == 9:
                break
        assert o.token_ids == ids[len(p) :]
