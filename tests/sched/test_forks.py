"""Copy-on-write of a forked prompt's last page (n > 1), with the fake runner (which checks every KV slot a
step reads against the request's tokens, and poisons reallocated pages): the choices copy the leader's partial
last page -- or the radix cache's last page when the prompt fills it -- and compute the last token only;
the kept page is freed when the last choice has copied it or ended."""

from __future__ import annotations

import pytest

from helpers.fake_runner import FakeRunner, greedy_reference, poison_freed, run
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig

VOCAB = 50


def fork(prompt_len: int, n: int, page_size: int = 4, abort: int = 0):
    sched = Scheduler(SchedulerConfig(page_size=page_size, num_pages=64, max_context_len=200, chunk_size=None))
    runner = FakeRunner(64, page_size, VOCAB)
    poison_freed(sched, runner)
    prompt = [(3 * i + 1) % VOCAB for i in range(prompt_len)]
    lead = sched.add_request("lead", prompt, SamplingParams(max_new_tokens=0))
    choices = [
        sched.add_request(f"c{j}", prompt, SamplingParams(max_new_tokens=5, ignore_eos=True), after=lead)
        for j in range(n)
    ]
    for j in range(abort):
        sched.abort(f"c{j}")
    done = run(sched, runner)  # invariants (the kept page counted) after every step
    for c in choices[abort:]:
        assert done[c.rid].output_ids == greedy_reference(prompt, 5, VOCAB)
    prefill = sum(s.num_prefill_tokens for s in sched.step_stats)
    return sched, prefill


@pytest.mark.parametrize("prompt_len", [10, 11, 12, 13])
def test_choices_copy_the_last_page_and_compute_one_token(prompt_len):
    sched, prefill = fork(prompt_len, 3)
    copied = prompt_len % 4 != 1  # a last page holding only the last token saves nothing: not copied
    assert prefill == prompt_len + 3 * 1, prefill  # either way each choice computes the last token only
    assert sched.forks.copied == (3 if copied else 0)
    assert not sched.forks.pages()  # the kept page went back to the pool


def test_without_a_copy_each_choice_recomputes_the_partial_page():
    sched, prefill = fork(13, 3, page_size=1)  # page size 1: nothing partial, nothing to copy
    assert sched.forks.copied == 0 and prefill == 13 + 3


def test_choices_that_end_first_release_the_kept_page():
    sched, prefill = fork(11, 3, abort=2)
    assert sched.forks.copied == 1 and not sched.forks.pages()
    sched.pool.free(sched.tree.evict(64))
    assert sched.pool.num_free == 64


@pytest.mark.parametrize("radix", [False, True])
def test_a_kept_page_never_stalls_a_tight_pool(radix):
    """Found by the state machine: 25-token prompts, two choices each, a 7-page pool of 4 tokens, one running
    at a time: the kept page must give way (or not be kept: no radix cache to copy onto) instead of leaving
    the choices 6 free pages for 7."""
    cfg = SchedulerConfig(
        page_size=4,
        num_pages=7,
        max_context_len=96,
        chunk_size=None,
        max_running_requests=1,
        max_prefill_tokens=16,
        enable_radix_cache=radix,
        in_batch_prefix_defer_tokens=None,
    )
    sched = Scheduler(cfg)
    runner = FakeRunner(7, 4, VOCAB)
    poison_freed(sched, runner)
    prompts = [[(7 * k + j) % VOCAB for j in range(25)] for k in range(2)]
    for k, prompt in enumerate(prompts):
        lead = sched.add_request(f"lead{k}", prompt, SamplingParams(max_new_tokens=0))
        for j in range(2):
            sched.add_request(f"c{k}{j}", prompt, SamplingParams(max_new_tokens=1), after=lead)
    done = run(sched, runner)
    for k, prompt in enumerate(prompts):
        for j in range(2):
            r = done[f"c{k}{j}"]
            assert r.error is None and r.output_ids == greedy_reference(prompt, 1, VOCAB), r.error
    assert not sched.forks.pages()


@pytest.mark.parametrize("prompt_len,pages", [(25, 2), (26, 2), (32, 2), (48, 3), (50, 4)])
def test_a_copy_source_is_never_reclaimed_or_evicted_for_its_own_copy(prompt_len, pages):
    """Found by the state machine: pages of 16, a pool of `pages`, one running at a time. The choice's own
    allocation had reclaimed the kept page (or evicted the radix cache's last page, a prompt filling it) and
    got it back as the copy's destination -- a copy onto itself of poisoned KV. The source is protected now;
    a choice whose copy does not fit beside its source recomputes the page instead."""
    cfg = SchedulerConfig(
        page_size=16,
        num_pages=pages,
        max_context_len=200,
        chunk_size=None,
        max_running_requests=1,
        max_prefill_tokens=16,
        in_batch_prefix_defer_tokens=None,
    )
    sched = Scheduler(cfg)
    runner = FakeRunner(pages, 16, VOCAB)
    poison_freed(sched, runner)
    prompt = [(5 * j + 2) % VOCAB for j in range(prompt_len)]
    lead = sched.add_request("lead", prompt, SamplingParams(max_new_tokens=0))
    for j in range(2):
        sched.add_request(f"c{j}", prompt, SamplingParams(max_new_tokens=1), after=lead)
    done = run(sched, runner, max_steps=500)
    for j in range(2):
        r = done[f"c{j}"]
        assert r.error is None and r.output_ids == greedy_reference(prompt, 1, VOCAB), r.error
    assert not sched.forks.pages()
