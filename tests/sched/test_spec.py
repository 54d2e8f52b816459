"""Speculative decoding through the scheduler (minisched/sched/spec.py) with the fake runner.

The fake runner checks every verify row's KV (its tokens, then its drafts) and answers with its
greedy accepted run; `OracleDrafter` drafts the fake model's true continuation with chosen tokens
wrong. Checked: greedy outputs identical to no drafting (page sizes, chunked prefill, radix hits,
retraction, stop tokens and strings inside an accepted run, length limits), draft pages whole and
returned past the accepted length, no unverified token in the radix cache, acceptance statistics,
adaptive draft length and the batch-size cutoff, the n-gram drafter against a brute-force search,
and a launched verify batch resolved before the next one is built (overlap), abort included.
"""

from __future__ import annotations

import random

import pytest

from helpers.fake_runner import FakeRunner, OracleDrafter, greedy_reference, poison_freed, run
from minisched.base.values import cdiv
from minisched.sched.batch import ForwardMode
from minisched.sched.req import FinishReason, ReqStatus
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig
from minisched.sched.spec import NgramDrafter, accept_greedy

VOCAB = 50


def make(drafter=None, **kw) -> tuple[Scheduler, FakeRunner]:
    cfg = SchedulerConfig(
        **{"page_size": 4, "num_pages": 256, "max_context_len": 256, "chunk_size": 32, "max_prefill_tokens": 256, **kw}
    )
    sched, runner = Scheduler(cfg, drafter=drafter), FakeRunner(cfg.num_pages, cfg.page_size, VOCAB)
    poison_freed(sched, runner)
    return sched, runner


def workload(n: int, seed: int = 0, shared: int = 0):
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(shared)]
    out = {}
    for i in range(n):
        p = base + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        stop = (rng.randrange(VOCAB),) if i % 3 == 0 else ()
        out[f"r{i}"] = (p, SamplingParams(max_new_tokens=rng.randint(1, 40), stop_token_ids=stop))
    return out


def run_all(sched, runner, reqs) -> dict:
    for rid, (p, sp) in reqs.items():
        sched.add_request(rid, p, sp)
    return run(sched, runner)


def expect(reqs, max_len=256) -> dict:
    return {
        rid: greedy_reference(p, sp.max_new_tokens, VOCAB, sp.stop_token_ids, max_len) for rid, (p, sp) in reqs.items()
    }


def pool_whole(sched):
    assert sched.tree.protected_pages == 0
    sched.pool.free(sched.tree.evict(sched.tree.total_pages))
    assert sched.pool.num_free == sched.config.num_pages


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("wrong_every", [0, 2, 5])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_output_is_identical_to_no_drafting(page_size, wrong_every, k):
    reqs = workload(12, seed=page_size + k, shared=20)
    plain, runner = make(page_size=page_size, num_pages=1024 // page_size)
    ref = run_all(plain, runner, reqs)
    assert {rid: r.output_ids for rid, r in ref.items()} == expect(reqs)
    drafter = OracleDrafter(VOCAB, wrong_every)
    sched, runner = make(drafter, page_size=page_size, num_pages=1024 // page_size, num_draft_tokens=k)
    got = run_all(sched, runner, reqs)
    assert {rid: (r.output_ids, r.finish_reason) for rid, r in got.items()} == {
        rid: (r.output_ids, r.finish_reason) for rid, r in ref.items()
    }
    st = sched.speculator.stats
    assert st.verify_steps > 0 and st.accepted_tokens <= st.draft_tokens
    assert sum(s.num_draft_tokens for s in sched.step_stats) == st.draft_tokens
    if wrong_every == 0:  # perfect drafts: everything accepted, far fewer steps
        assert st.accepted_tokens == st.draft_tokens and len(sched.step_stats) < len(plain.step_stats)
    pool_whole(sched)


@pytest.mark.parametrize("pool_pages", [12, 20])
def test_retraction_and_radix_hits_with_drafts(pool_pages):
    """A pool too small for the batch: retractions; shared prefixes: radix hits. Outputs equal the reference."""
    reqs = workload(10, seed=3, shared=12)
    opts = dict(num_pages=pool_pages, chunk_size=8, num_draft_tokens=5)
    ref = run_all(*make(**opts), reqs)
    sched, runner = make(OracleDrafter(VOCAB, 4), **opts)
    done = run_all(sched, runner, reqs)
    assert {rid: r.output_ids for rid, r in done.items()} == {rid: r.output_ids for rid, r in ref.items()}
    want = expect(reqs)
    for rid, r in done.items():  # (a prompt that nearly fills the pool is clipped: a prefix, ending with length)
        assert r.output_ids == want[rid] or (
            r.finish_reason is FinishReason.LENGTH and want[rid][: len(r.output_ids)] == r.output_ids
        )
    assert sum(r.cache_hit_tokens for r in done.values()) > 0
    if pool_pages == 12:
        assert any(s.num_retracted for s in sched.step_stats)
    pool_whole(sched)


def test_draft_pages_are_whole_pages_and_returned_past_the_accepted_length():
    sched, runner = make(OracleDrafter(VOCAB, 3), page_size=4, num_draft_tokens=7)
    prompt = [1, 2, 3, 4, 5, 6]
    req = sched.add_request("a", prompt, SamplingParams(max_new_tokens=60))
    seen = 0
    while sched.has_work():
        batch = sched.get_next_batch()
        if batch is None:
            continue
        if batch.mode is ForwardMode.VERIFY:
            seen += 1
            (d,) = batch.drafts
            assert len(req.page_ids) == cdiv(req.kv_len + 1 + len(d), 4)  # pages for the drafts too, whole
        out = runner.forward(batch)
        sched.process_batch_result(batch, out)
        if req.status is ReqStatus.RUNNING:
            assert len(req.page_ids) == cdiv(req.kv_len, 4) and req.kv_len == req.seq_len - 1
        sched.check_invariants()
    assert seen and req.output_ids == greedy_reference(prompt, 60, VOCAB)
    pool_whole(sched)


def test_the_radix_cache_never_holds_an_unverified_token():
    reqs = workload(8, seed=5, shared=16)
    sched, runner = make(OracleDrafter(VOCAB, 2), page_size=1, num_pages=2048, num_draft_tokens=6)
    done = run_all(sched, runner, reqs)
    truth = [list(p) + done[rid].output_ids for rid, (p, _) in reqs.items()]
    stack = [(sched.tree.root, [])]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            key = path + list(child.key)
            assert any(t[: len(key)] == key for t in truth), "a cached prefix no request produced"
            stack.append((child, key))
    assert sched.tree.total_pages > 0


@pytest.mark.parametrize("how", ["token", "string"])
def test_a_stop_inside_the_accepted_run_ends_the_request_there(how):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = greedy_reference(prompt, 40, VOCAB)
    stop = ref[6]
    cut = ref.index(stop) + 1
    checker = None
    if how == "token":
        sp = SamplingParams(max_new_tokens=40, stop_token_ids=(stop,))
    else:
        sp = SamplingParams(max_new_tokens=40)
        checker = lambda r: stop in r.output_ids  # noqa: E731 -- the engine's stop strings, in token form
    cfg = SchedulerConfig(page_size=4, num_pages=64, max_context_len=256, num_draft_tokens=7)
    sched = Scheduler(cfg, stop_checker=checker, drafter=OracleDrafter(VOCAB, 0))
    runner = FakeRunner(64, 4, VOCAB)
    req = sched.add_request("a", prompt, sp)
    run(sched, runner)
    assert req.output_ids == ref[:cut]
    assert req.finish_reason is (FinishReason.STOP_TOKEN if how == "token" else FinishReason.STOP_STR)
    assert sched.speculator.stats.accepted_tokens > cut - 2  # the stop token came inside a run
    pool_whole(sched)


def test_length_limits_are_never_overshot():
    sched, runner = make(OracleDrafter(VOCAB, 0), num_draft_tokens=7, max_context_len=40)
    a = sched.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=5))
    b = sched.add_request("b", [4, 5, 6, 7] * 8, SamplingParams(max_new_tokens=100))  # the context limit: 40
    run(sched, runner)
    assert a.output_ids == greedy_reference([1, 2, 3], 5, VOCAB) and a.finish_reason is FinishReason.MAX_NEW_TOKENS
    assert len(b.prompt_ids) + len(b.output_ids) == 40 and b.finish_reason is FinishReason.LENGTH
    pool_whole(sched)


def test_adaptive_draft_length_and_batch_cutoff():
    # always-wrong drafts: drafting pauses itself, so most steps are plain decodes
    sched, runner = make(OracleDrafter(VOCAB, 1), num_draft_tokens=4)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=120))
    run(sched, runner)
    modes = [s.mode for s in sched.step_stats]
    assert modes.count("verify") < modes.count("decode") / 3
    assert sched.speculator.stats.accepted_tokens == 0
    # perfect drafts: the length grows to num_draft_tokens
    sched, runner = make(OracleDrafter(VOCAB, 0), num_draft_tokens=6)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=80))
    run(sched, runner)
    assert max(s.num_draft_tokens for s in sched.step_stats) == 6
    # the cutoff: no drafting while more than 2 requests run
    sched, runner = make(OracleDrafter(VOCAB, 0), num_draft_tokens=4, spec_max_batch_size=2)
    for i in range(4):
        sched.add_request(f"r{i}", [i + 1, 2, 3], SamplingParams(max_new_tokens=10 + 10 * i))
    run(sched, runner)
    assert all(s.num_running <= 2 for s in sched.step_stats if s.mode == "verify")
    assert any(s.mode == "verify" for s in sched.step_stats)


def test_a_launched_verify_batch_is_resolved_before_the_next_build_and_abort_keeps_committed_kv():
    sched, runner = make(OracleDrafter(VOCAB, 0), num_draft_tokens=4)
    a = sched.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=30))
    sched.add_request("b", [6, 7, 8], SamplingParams(max_new_tokens=30))
    sched.step(runner)
    batch = sched.get_next_batch()
    assert batch.mode is ForwardMode.VERIFY
    sched.launch(batch)
    out = runner.forward(batch)
    sched.check_invariants()  # placeholders for every draft: the launched state is consistent
    assert sched.get_next_batch() is None  # nothing is built on top of a verify in flight
    committed = batch.prefix_lens[0]
    assert sched.abort("a") and a.kv_len == 0 and a.status is ReqStatus.ABORTED
    sched.check_invariants()
    assert sched.tree.total_pages == committed // 4  # only K/V written by resolved steps is cached
    sched.resolve(batch, out)
    done = run(sched, runner)
    assert done["b"].output_ids == greedy_reference([6, 7, 8], 30, VOCAB)
    pool_whole(sched)


def test_accept_greedy():
    assert accept_greedy([], [7]) == [7]
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accept_greedy([1, 2, 3], [1, 9, 3, 4]) == [1, 9]
    assert accept_greedy([1, 2, 3], [5, 2, 3, 4]) == [5]


def brute_force(seq, k, lo, hi):
    for n in range(min(hi, len(seq) - 1), lo - 1, -1):
        suffix = seq[len(seq) - n :]
        for i in range(len(seq) - 1, n - 1, -1):  # the most recent earlier occurrence followed by a token
            if seq[i - n : i] == suffix:
                return seq[i : i + k]
    return []


def test_ngram_drafter_equals_brute_force_as_the_sequence_grows():
    rng = random.Random(0)
    drafter = NgramDrafter(2, 4)
    sched, _ = make(max_context_len=2048)
    for trial in range(20):
        prompt = [rng.randrange(6) for _ in range(rng.randint(1, 30))]
        req = sched.add_request(f"t{trial}", prompt, SamplingParams(max_new_tokens=500))
        for _ in range(60):
            k = rng.randint(1, 5)
            seq = req.prompt_ids + req.output_ids
            assert drafter.propose([req], [k]) == [brute_force(seq, k, 2, 4)]
            req.output_ids.extend(rng.randrange(6) for _ in range(rng.randint(0, 3)))
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    req = sched.add_request("x", text, SamplingParams())
    assert drafter.propose([req], [3]) == [[8, 9, 1]]  # the longest match (5 6 7) wins


def test_ngram_drafts_repeated_text_and_greedy_stays_identical():
    """The fake model's outputs rarely repeat, so drafts mostly fail: outputs stay right, drafting pauses."""
    reqs = workload(6, seed=9)
    sched, runner = make(NgramDrafter(1, 3), num_draft_tokens=4)
    done = run_all(sched, runner, reqs)
    assert {rid: r.output_ids for rid, r in done.items()} == expect(reqs)
    pool_whole(sched)
