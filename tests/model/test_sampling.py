"""The sampler's logits processing (penalties, bias, min_tokens, masks), min-p and logprobs, against a
per-row reference written from the definitions (SamplingParams' docstring), on fresh random logits."""

from __future__ import annotations

import math

import pytest
import torch

from minisched.model.sampling import (
    RowHistory,
    logprobs_of,
    make_generator,
    process_logits,
    sample,
    target_probs,
    verify_drafts,
)
from minisched.sched.sampling_params import SamplingParams

V = 64


def reference_row(logits: torch.Tensor, sp: SamplingParams, hist: RowHistory, mask=None) -> torch.Tensor:
    x = logits.double().clone()
    if len(hist.output) < sp.min_tokens:
        for t in sp.stop_token_ids:
            x[t] = -math.inf
    for t, b in sp.logit_bias:
        x[t] += b
    for t in range(V):
        c = list(hist.output).count(t)
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty * (c > 0)
        if sp.repetition_penalty != 1 and (c > 0 or t in hist.prompt):
            x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    if mask is not None:
        x[~mask] = -math.inf
    return x


CASES = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5),
    SamplingParams(logit_bias={3: 5.0, 10: -100.0, 63: 2.5}),
    SamplingParams(min_tokens=4, stop_token_ids=(2, 7)),
    SamplingParams(
        min_tokens=2, stop_token_ids=(2,), repetition_penalty=1.3, frequency_penalty=0.3, logit_bias={2: 1.0}
    ),
]


@pytest.mark.parametrize("seed", [0, 1])
def test_processing_matches_the_per_row_reference(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(CASES), V, generator=g) * 3
    hist = [
        RowHistory(
            torch.randint(0, V, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist(),
            torch.randint(0, V, (int(torch.randint(0, 8, (1,), generator=g)),), generator=g).tolist(),
        )
        for _ in CASES
    ]
    masks = torch.rand(len(CASES), V, generator=g) > 0.3
    masks[:, 0] = True  # never an empty row
    for use_mask in (False, True):
        got = process_logits(logits, CASES, hist, masks if use_mask else None)
        for i, sp in enumerate(CASES):
            want = reference_row(logits[i], sp, hist[i], masks[i] if use_mask else None)
            torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-5)
    # greedy rows take the processed argmax; the raw logits are not modified
    before = logits.clone()
    picked = sample(logits, CASES, [None] * len(CASES), hist)
    assert torch.equal(logits, before)
    assert picked == process_logits(logits, CASES, hist, None).argmax(-1).tolist()


def test_min_tokens_counts_the_output_before_this_token():
    sp = SamplingParams(min_tokens=2, stop_token_ids=(5,), logit_bias={5: 50.0})
    logits = torch.zeros(1, V)
    assert sample(logits, [sp], [None], [RowHistory([1], [9])]) != [5]  # one token so far: not yet
    assert sample(logits, [sp], [None], [RowHistory([1], [9, 9])]) == [5]


def test_penalties_without_history_is_a_clear_error():
    with pytest.raises(ValueError, match="history"):
        sample(torch.zeros(1, V), [SamplingParams(repetition_penalty=2.0)], [None])


def test_min_p_keeps_only_likely_tokens():
    logits = torch.full((1, V), -10.0)
    logits[0, 4], logits[0, 9], logits[0, 20] = 5.0, 4.5, 2.0  # p(20) / p(4) = e^-3 ~ 0.05
    sp = SamplingParams(temperature=1.0, min_p=0.1, seed=1)
    gen = make_generator(1)
    draws = {sample(logits, [sp], [gen])[0] for _ in range(200)}
    assert draws == {4, 9}
    loose = SamplingParams(temperature=1.0, min_p=0.01)
    assert 20 in {sample(logits, [loose], [make_generator(i)])[0] for i in range(400)}


def test_logprobs_are_the_raw_log_softmax():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, V, generator=g) * 4
    tokens = [0, 5, 63, 7, 7]
    chosen, top = logprobs_of(logits, tokens, 4)
    ref = torch.log_softmax(logits.double(), -1)
    for r, t in enumerate(tokens):
        assert chosen[r] == pytest.approx(float(ref[r, t]), abs=1e-5)
        want = torch.topk(ref[r], 4)
        assert [i for i, _ in top[r]] == want.indices.tolist()
        assert [v for _, v in top[r]] == pytest.approx(want.values.tolist(), abs=1e-5)
    assert logprobs_of(logits, tokens, 0)[1] == [[]] * 5


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(logit_bias={"a": 1.0}), "logit_bias"),
        (dict(logit_bias={3: 200.0}), "logit_bias"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
        (dict(grammar="json"), "grammar"),
    ],
)
def test_bad_fields_are_rejected(kw, match):
    from minisched.sched.sampling_params import InvalidRequest

    with pytest.raises(InvalidRequest, match=match):
        SamplingParams(**kw)


# -- speculative decoding's acceptance (verify_drafts) ---------------------------------------------------


def test_target_probs_is_the_distribution_sample_draws_from():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 8, generator=g) * 2
    sp = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    p = target_probs(logits, [sp])[0]
    assert abs(float(p.sum()) - 1) < 1e-6 and int((p > 0).sum()) <= 5
    n = 10000
    drawn = sample(logits.expand(n, 8), [sp] * n, [make_generator(s) for s in range(n)])
    freq = torch.bincount(torch.tensor(drawn), minlength=8).double() / n
    assert (freq - p.double()).abs().max() < 0.02


def test_verify_drafts_greedy_accepts_the_argmax_prefix():
    logits = torch.full((4, V), -1.0)
    for j, t in enumerate([5, 6, 9, 11]):
        logits[j, t] = 3.0
    gp = SamplingParams()
    runs = verify_drafts([logits, logits, logits[:1]], [[5, 6, 7], [5, 6, 9], []], [gp] * 3, [None] * 3)
    assert runs == [[5, 6, 9], [5, 6, 9, 11], [5]]


@pytest.mark.parametrize("with_q", [False, True])
def test_verify_drafts_keeps_the_target_distribution(with_q):
    """Rejection sampling: the first token is distributed as p0 whatever was drafted, and the second,
    given the first was the draft, as p1 -- with a deterministic draft (n-gram) and a draft model's q."""
    vocab, n = 6, 8000
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, vocab, generator=g)
    sp = SamplingParams(temperature=1.0)
    p = target_probs(logits, [sp] * 3).double()
    gens = [make_generator(1000 + s) for s in range(n)]
    if with_q:  # a draft model: its own distribution, drafts drawn from it
        q = torch.softmax(torch.randn(2, vocab, generator=g), -1)
        dg = torch.Generator().manual_seed(2)
        drafts = [[int(torch.multinomial(q[j], 1, generator=dg)) for j in range(2)] for _ in range(n)]
        qs = [q] * n
    else:
        drafts, qs = [[int(p[0].argmax()), int(p[1].argmax())]] * n, None
    runs = verify_drafts([logits] * n, drafts, [sp] * n, gens, qs)
    assert all(1 <= len(r) <= 3 for r in runs)
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=vocab).double() / n
    assert (first - p[0]).abs().max() < 0.02
    second = [r[1] for r, d in zip(runs, drafts) if r[0] == d[0] and len(r) > 1]
    freq = torch.bincount(torch.tensor(second), minlength=vocab).double() / len(second)
    assert len(second) > 800 and (freq - p[1]).abs().max() < 0.04
    rate = sum(len(r) - 1 for r in runs) / (2 * n)
    assert 0 < rate < 1


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=40),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.9),  # Zipf logits: the second round of candidates
    SamplingParams(temperature=1.0, top_p=0.999),  # a long tail: past the candidates, the full sort
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=1e-6),  # survivors past the candidates: the full sort
    SamplingParams(temperature=0.8, top_k=300, top_p=0.95, min_p=0.01),
    SamplingParams(temperature=2.0, top_k=1),
]


@pytest.mark.parametrize("vocab", [49152, 300, 100])
def test_the_kept_distribution_is_the_full_sorts(vocab):
    """Regression (the sampler sorted the whole vocabulary for every sampled row: ~4 ms a row, 244 ms a
    step at 64 rows with temperature 1): temperature-only rows take the CDF in vocabulary order, top-k
    rows torch.topk, top-p / min-p rows the 256 most likely tokens when the kept set ends there -- the
    same distribution as the full sort (`_sorted_probs`, the fallback) on fresh random logits, including
    the rows that fall back."""
    from minisched.model.sampling import _sorted_probs

    g = torch.Generator().manual_seed(vocab)
    # flat to peaked, and Zipf-like (p ~ rank^-1.2, as a language model's: top-p 0.9 keeps ~2,000 of 49,152,
    # past the first 256 candidates and inside the 4,096 of the second round)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    zipf = torch.stack([(-1.2 * ranks.log())[torch.randperm(vocab, generator=g)] for _ in SETTINGS])
    for logits in [torch.randn(len(SETTINGS), vocab, generator=g) * scale for scale in (0.5, 3.0, 8.0)] + [zipf]:
        got = target_probs(logits, SETTINGS)
        t = torch.tensor([p.temperature for p in SETTINGS])[:, None]
        probs, order = _sorted_probs(logits / t, SETTINGS, vocab)
        want = torch.zeros_like(probs).scatter_(1, order, probs)
        want = want / want.sum(-1, keepdim=True)
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4), (got - want).abs().max()
        assert torch.equal(got > 0, want > 0) or (got - want).abs().max() < 1e-6


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(len(SETTINGS), 49152, generator=g) * 3
    seeded = [SamplingParams(**{**vars_of(p), "seed": 100 + i}) for i, p in enumerate(SETTINGS)]
    together = sample(logits, seeded, [make_generator(p.seed) for p in seeded])
    alone = [sample(logits[i : i + 1], [p], [make_generator(p.seed)])[0] for i, p in enumerate(seeded)]
    assert together == alone
    for tok, p, row in zip(together, SETTINGS, logits):
        assert target_probs(row[None], [p])[0, tok] > 0  # a kept token


def vars_of(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in ("temperature", "top_k", "top_p", "min_p")}


def test_rows_whose_kept_set_is_short_never_sort_the_vocabulary(monkeypatch):
    """Regression: every sampled row sorted all 49,152 logits (torch.sort), the most of a CPU decode step
    at 64 rows. Now only a top-p / min-p row whose kept set runs past the candidates does."""

    def no_sort(*a, **k):
        raise AssertionError("sorted the vocabulary")

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 49152, generator=g) * 4
    common = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=50),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.8, min_p=0.1),
    ]
    monkeypatch.setattr(torch, "sort", no_sort)
    drawn = sample(logits, common, [make_generator(i) for i in range(4)])
    assert len(drawn) == 4
    monkeypatch.undo()
    flat = torch.zeros(1, 49152)  # every token equally likely: top-p 0.9 keeps 44k of them
    called = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: called.append(1) or real_sort(*a, **k))
    sample(flat, [SamplingParams(temperature=1.0, top_p=0.9)], [make_generator(0)])
    assert called  # the exact fallback
