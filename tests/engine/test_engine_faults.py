"""The engine survives whatever a user does: exceptions and Ctrl-C inside a step, abandoned
streams, interrupted `generate` calls, and bad arguments. After each fault the batch's
requests have ended with an error, their pages are back (pool whole once the radix cache
is evicted), and the next `generate` gives the right greedy tokens.

Every engine test here runs twice, with overlap scheduling off and on (`make_engine`)."""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest
import torch

from helpers.engines import assert_pool_whole, byte_engine, reference, tiny_model
from minisched import Engine, SamplingParams
from minisched.model.llama import LlamaModel
from minisched.model.tokenizer import MiniTokenizer
from minisched.sched.sampling_params import InvalidRequest

NEW = 6
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return tiny_model()


@pytest.fixture(params=[False, True], ids=["plain", "overlap"])
def make_engine(request):
    """Engines with overlap scheduling off, then on; the overlap ones must have used their worker."""
    made = []

    def make(model: LlamaModel, **kw) -> Engine:
        made.append(byte_engine(model, page_size=4, overlap=request.param, **kw))
        return made[-1]

    yield make
    if request.param:
        assert all(e._overlap.forward_times for e in made if e.step_times), "an overlap engine ran no forward"


def greedy(model: LlamaModel, prompt: list[int], n: int = NEW) -> list[int]:
    return reference(model, prompt, n)


PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27, 28, 29]]


def assert_usable(engine: Engine, model: LlamaModel) -> None:
    outs = engine.generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in outs] == [greedy(model, p) for p in PROMPTS[:2]]
    assert_pool_whole(engine)


class Boom(RuntimeError):
    pass


def fail_on_call(monkeypatch, obj, name: str, exc: BaseException, on_call: int = 1) -> None:
    """Make obj.name raise `exc` on its `on_call`-th call (then behave normally again)."""
    real, calls = getattr(obj, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == on_call:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)


@pytest.mark.parametrize("where", ["model", "sampling", "stop_checker"])
@pytest.mark.parametrize("on_call", [1, 3])  # during the prefill / during a decode step
def test_exception_in_step_fails_the_batch_and_keeps_the_engine(tiny, monkeypatch, where, on_call, make_engine):
    engine = make_engine(tiny)
    if where == "model":
        fail_on_call(monkeypatch, engine.runner, "model", Boom("model exploded"), on_call)
    elif where == "sampling":
        import minisched.engine.runner as runner_mod

        fail_on_call(monkeypatch, runner_mod, "sample", Boom("sampling exploded"), on_call)
    else:
        fail_on_call(monkeypatch, engine.scheduler, "stop_checker", Boom("checker exploded"), on_call)
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop=("zz",))
    outs = engine.generate(PROMPTS, sp)
    errors = [o for o in outs if o.finish_reason == "error"]
    assert errors, "the fault must surface as request errors"
    assert all("exploded" in o.error for o in errors)
    if where == "stop_checker":  # a broken checker ends only the request it was checking
        assert len(errors) == 1
    for o, p in zip(outs, PROMPTS):
        if o.finish_reason != "error":
            assert o.token_ids == greedy(tiny, p)
    assert_pool_whole(engine)
    monkeypatch.undo()
    assert_usable(engine, tiny)


@pytest.mark.parametrize("on_call", [1, 2])
def test_keyboard_interrupt_in_step_propagates_and_leaves_engine_usable(tiny, monkeypatch, on_call, make_engine):
    engine = make_engine(tiny)
    fail_on_call(monkeypatch, engine.runner, "model", KeyboardInterrupt(), on_call)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS, GREEDY)
    assert_pool_whole(engine)  # the interrupted call aborted its own requests
    assert_usable(engine, tiny)


def test_huge_seed_is_rejected_up_front_and_engine_stays_usable(tiny, make_engine):
    engine = make_engine(tiny)
    outs = engine.generate(PROMPTS[:2], [{"temperature": 1.0, "seed": 2**70}, GREEDY])
    assert outs[0].finish_reason == "error" and "seed" in outs[0].error
    assert outs[1].token_ids == greedy(tiny, PROMPTS[1])
    assert_usable(engine, tiny)


@pytest.mark.parametrize("how", ["break", "close", "gc"])
def test_abandoned_stream_aborts_its_requests(tiny, how, make_engine):
    engine = make_engine(tiny)
    it = engine.stream(PROMPTS, SamplingParams(max_new_tokens=50, ignore_eos=True))
    first = next(it)
    assert not first.finished
    assert engine.scheduler.snapshot().live  # live while the stream is open
    if how == "close":
        it.close()
    elif how == "gc":
        del it
        gc.collect()
    else:
        for _ in it:
            break
        it.close()
    assert_pool_whole(engine)
    assert_usable(engine, tiny)


def test_interrupted_generate_aborts_its_own_requests_only(tiny, make_engine):
    engine = make_engine(tiny)
    other = engine.add_request(PROMPTS[2], GREEDY)  # someone else's request, queued before

    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=50, ignore_eos=True), progress=interrupt)
    assert list(engine.scheduler.reqs) == [other.rid]  # only the interrupted call's requests were aborted
    done = []
    while engine.has_work():
        done += engine.step()
    assert [r.rid for r in done] == [other.rid] and other.output_ids == greedy(tiny, PROMPTS[2])
    assert_pool_whole(engine)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(top_p=math.nan), "top_p"),
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(top_k=True), "top_k"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-1), "seed"),
        (dict(seed=True), "seed"),
        (dict(ignore_eos=1), "ignore_eos"),
    ],
)
def test_bad_sampling_params_are_rejected(kw, match):
    with pytest.raises(InvalidRequest, match=match):
        SamplingParams(**kw)


def test_engine_argument_checks(tiny, make_engine):
    with pytest.raises(ValueError, match="needs tokenizer"):
        Engine(tiny)
    with pytest.raises(ValueError, match="not both"):
        make_engine(tiny, num_pages=64, mem_fraction=0.1)
    with pytest.raises(ValueError, match="max_context_len"):
        make_engine(tiny, max_context_len=tiny.cfg.max_position + 1)
    with pytest.raises(ValueError, match="max_context_len"):
        make_engine(tiny, max_context_len=True)
    with pytest.raises(ValueError, match="page_size"):
        Engine(tiny, tokenizer=MiniTokenizer.byte_level(tiny.cfg.vocab_size), page_size=True)


def test_numpy_and_torch_token_prompts(tiny, make_engine):
    engine = make_engine(tiny)
    p = PROMPTS[0]
    outs = engine.generate(
        [np.array(p, dtype=np.int64), torch.tensor(p, dtype=torch.int32), [np.int32(t) for t in p], p], GREEDY
    )
    assert all(o.error is None for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 1
    bad = engine.generate([np.array([[1, 2]]), np.array([1.5, 2.0]), [5, 6, 10**6]], GREEDY)
    assert "1-D integers" in bad[0].error and "1-D integers" in bad[1].error
    assert "token 1000000 at position 2" in bad[2].error
    with pytest.raises(TypeError, match="list of prompts"):
        engine.generate(np.array(p), GREEDY)
    assert_pool_whole(engine)
