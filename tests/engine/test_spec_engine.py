"""Speculative decoding through the Engine on the tiny random model (sched/spec.py, runner VERIFY steps).

Greedy output with drafting equals the output without it and the dense reference: with the n-gram
drafter, and with an oracle drafter (the dense reference's continuation, some tokens wrong, so
every acceptance length occurs) -- overlap on and off, page sizes 1 and 16, chunked prefill, radix
hits, retraction in a tiny pool, both backends. Also: stop tokens and strings inside an accepted
run, logprobs of accepted tokens equal to a plain run's, an undrafted request (penalties) beside
drafted ones, seeded sampling that runs whole, the pool whole afterwards, the options and the CLI
flags. A draft model (engine/draft.py): the model drafting for itself is always accepted (the tiny
model here; SmolLM2 in a slow test), another one changes nothing but the acceptance.
"""

from __future__ import annotations

import json

import pytest

from helpers.engines import assert_pool_whole, byte_engine, prompts, reference, tiny_model
from minisched import ops
from minisched.cli import main
from minisched.sched.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
BACKENDS = ["torch"] + (["native"] if ops.native_available() else [])


class DenseOracle:
    """Drafts the dense reference's greedy continuation; the draft at sequence length L is wrong when
    L % wrong_every == 0 (0: never)."""

    def __init__(self, model, wrong_every: int) -> None:
        self.model, self.wrong_every = model, wrong_every

    def propose(self, reqs, ks):
        out = []
        for r, k in zip(reqs, ks):
            seq = list(r.prompt_ids) + list(r.output_ids)
            d = reference(self.model, seq, k)
            if self.wrong_every:
                d = [(t + 1) % 256 if (len(seq) + i) % self.wrong_every == 0 else t for i, t in enumerate(d)]
            out.append(d)
        return out


def spec_engine(drafter=None, **opts):
    engine = byte_engine(tiny_model(), speculative="ngram", **opts)
    if drafter is not None:
        engine.scheduler.speculator.drafter = drafter
    return engine


def check(engine, ps, sampling=GREEDY):
    outs = engine.generate(ps, sampling)
    for o, p in zip(outs, ps):
        assert o.error is None, o.error
        assert o.token_ids == reference(tiny_model(), p, sampling.max_new_tokens), f"prompt {o.index}"
    assert_pool_whole(engine)
    return outs


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("wrong_every", [0, 3])
def test_greedy_with_oracle_drafts_equals_the_reference(overlap, page_size, wrong_every):
    model = tiny_model()
    engine = spec_engine(DenseOracle(model, wrong_every), overlap=overlap, page_size=page_size, num_draft_tokens=5)
    check(engine, prompts([3, 17, 30], seed=11))
    st = engine.scheduler.snapshot().spec
    assert st.verify_steps > 0 and st.accepted_tokens > 0
    if wrong_every == 0:
        assert st.accepted_tokens == st.draft_tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_ngram_greedy_equals_no_drafting_chunked_radix_and_retraction(backend):
    system = prompts([40], seed=1)[0]
    ps = [system + p for p in prompts([5, 12, 2], seed=2)]
    ps += [[7, 8, 9, 10] * 6]  # a repetitive prompt: prompt lookup drafts hit
    for opts in (
        dict(chunk_size=7),
        dict(num_pages=40, page_size=4, init_new_token_ratio=0.01, min_new_token_ratio=0.0),
    ):
        engine = spec_engine(backend=backend, check=True, **opts)
        outs = check(engine, ps)
        if "chunk_size" in opts:
            assert sum(o.cached_tokens for o in outs) > 0
        else:
            assert sum(o.num_retractions for o in outs) >= 1
        assert engine.scheduler.snapshot().spec.verify_steps > 0


def test_stop_token_and_string_inside_an_accepted_run():
    model = tiny_model()
    p = prompts([9], seed=7)[0]
    want = reference(model, p, 24)
    engine = spec_engine(DenseOracle(model, 0), num_draft_tokens=6)
    stop = want[5]
    out = engine.generate([p], SamplingParams(max_new_tokens=24, stop_token_ids=(stop,)))[0]
    assert out.token_ids == want[: want.index(stop) + 1] and out.finish_reason == "stop_token"
    full = engine.tokenizer.decode(want)
    s = engine.tokenizer.decode(want[7:9])
    if s and full.find(s) > 0:
        out = engine.generate([p], SamplingParams(max_new_tokens=24, stop=(s,), ignore_eos=True))[0]
        assert out.finish_reason == "stop_str" and out.text == full[: full.find(s)]
    assert_pool_whole(engine)


def test_logprobs_and_sampled_requests_beside_drafted_ones():
    model = tiny_model()
    ps = prompts([6, 11], seed=3)
    plain = byte_engine(model)
    lp = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=2)
    ref = plain.generate(ps, lp)
    engine = spec_engine(DenseOracle(model, 2))
    pen = SamplingParams(max_new_tokens=12, ignore_eos=True, repetition_penalty=1.3)  # not drafted: decodes beside
    outs = engine.generate(ps * 2, [GREEDY, lp, lp, pen])
    assert outs[0].token_ids == reference(model, ps[0], 24)
    assert outs[3].token_ids == plain.generate(ps[1:], pen)[0].token_ids
    for o, r in ((outs[1], ref[1]), (outs[2], ref[0])):  # logprobs of drafted, accepted tokens: the target's
        assert o.token_ids == r.token_ids and [x.token_id for x in o.logprobs] == r.token_ids
        assert [x.logprob for x in o.logprobs] == pytest.approx([x.logprob for x in r.logprobs], abs=1e-4)
        assert [[t for t, _ in x.top] for x in o.logprobs] == [[t for t, _ in x.top] for x in r.logprobs]
    assert engine.scheduler.snapshot().spec.accepted_tokens > 0
    sp = SamplingParams(temperature=30.0, top_k=50, seed=5, max_new_tokens=16, ignore_eos=True)
    a = engine.generate(ps, sp)
    assert all(len(o.token_ids) == 16 for o in a)
    assert engine.generate(ps, sp)[0].token_ids == a[0].token_ids  # seeded: reproducible with drafting too
    assert_pool_whole(engine)


def test_options_are_checked():
    with pytest.raises(ValueError, match="speculative"):
        byte_engine(tiny_model(), speculative="medusa")
    with pytest.raises(ValueError, match="ngram_min_match"):
        byte_engine(tiny_model(), speculative="ngram", ngram_min_match=3, ngram_max_match=2)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        byte_engine(tiny_model(), speculative="ngram", num_draft_tokens=0)


def test_cli_speculative_flags(capsys):
    argv = ["generate", "abcabcabcabc", "--max-new-tokens", "8", "--json", "--model", "dummy:tiny"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--speculative", "ngram", "--num-draft-tokens", "3", "--spec-max-batch-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    assert main([*argv, "--speculative", "draft", "--draft-model", "self"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
    assert main([*argv, "--speculative", "draft"]) == 2
    assert "--draft-model" in capsys.readouterr().err  # the flag, not the field


# -- a draft model (engine/draft.py) -------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_model_drafting_for_itself_is_always_accepted(overlap, page_size):
    engine = byte_engine(
        tiny_model(), speculative="draft", draft_model="self", overlap=overlap, page_size=page_size, num_draft_tokens=4
    )
    check(engine, prompts([3, 17, 30, 9], seed=12))
    st = engine.scheduler.snapshot().spec
    assert st.draft_tokens > 0 and st.accepted_tokens == st.draft_tokens


def test_another_draft_model_keeps_outputs_through_chunks_radix_hits_and_retraction():
    from minisched.engine.draft import ModelDrafter

    system = prompts([40], seed=1)[0]
    shared = [system + p for p in prompts([5, 12, 2], seed=2)]
    tight = dict(num_pages=12, page_size=4, init_new_token_ratio=0.01, min_new_token_ratio=0.0)
    retracting = prompts([5, 17, 1, 10], seed=4)
    for opts, ps in ((dict(chunk_size=7), shared), (tight, retracting)):
        engine = byte_engine(tiny_model(), speculative="draft", draft_model="self", **opts)
        sched = engine.scheduler
        other = ModelDrafter(tiny_model(1), sched.config.num_pages, sched.config.page_size, engine.backend)
        sched.speculator.drafter = other  # random weights of another seed: drafts mostly wrong, never harmful
        outs = check(engine, ps)
        assert other.num_forwards > 0
        if ps is shared:
            assert sum(o.cached_tokens for o in outs) > 0
        else:
            assert sum(o.num_retractions for o in outs) >= 1
    # a model drafting for itself: everything accepted, after retractions too
    engine = byte_engine(tiny_model(), speculative="draft", draft_model="self", **tight)
    outs = check(engine, retracting)
    st = engine.scheduler.snapshot().spec
    assert sum(o.num_retractions for o in outs) >= 1 and st.accepted_tokens == st.draft_tokens > 0


def test_draft_options_are_checked():
    with pytest.raises(ValueError, match="draft_model"):
        byte_engine(tiny_model(), speculative="draft")
    with pytest.raises(ValueError, match="draft_model"):
        byte_engine(tiny_model(), draft_model="self")
    with pytest.raises(ValueError, match="vocabulary"):
        byte_engine(tiny_model(), speculative="draft", draft_model="dummy:smollm2-135m")


@pytest.mark.slow
def test_smollm2_drafting_for_itself_accepts_everything():
    from minisched.engine import Engine

    engine = Engine("smollm2", speculative="draft", draft_model="smollm2", num_draft_tokens=4)
    msgs = [[{"role": "user", "content": "Name three colours of the rainbow."}]]
    plain = Engine("smollm2").generate(msgs, SamplingParams(max_new_tokens=40))[0]
    out = engine.generate(msgs, SamplingParams(max_new_tokens=40))[0]
    st = engine.scheduler.snapshot().spec
    assert out.token_ids == plain.token_ids
    assert st.draft_tokens > 0 and st.accepted_tokens == st.draft_tokens


def test_seeded_sampling_is_reproducible_with_the_cost_model_on():
    """The step-cost model (sched/spec_cost.py) decides drafts from measured timings; a seeded sampled request's
    drafts shape its random stream, so the model must leave them alone (this failed when it did not)."""
    model = tiny_model()
    ps = prompts([6, 11], seed=3)
    engine = spec_engine(DenseOracle(model, 2), spec_cost_model=True)
    sp = SamplingParams(temperature=30.0, top_k=50, seed=5, max_new_tokens=16, ignore_eos=True)
    runs = [[o.token_ids for o in engine.generate(ps, sp)] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert engine.scheduler.snapshot().spec.verify_steps > 0
