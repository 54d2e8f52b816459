"""Overlap scheduling at the scheduler level (launch / resolve in minisched/sched/scheduler.py), with the fake runner.

The engine's forward worker is emulated: a launched batch is computed at once (the worker runs
steps in launch order), its inputs' placeholders swapped for the tokens earlier steps sampled,
while the scheduler applies the tokens one step late. The fake runner reads every request's
KV back through the page table, so a page handed out too early, a wrong placeholder or a bad
radix entry trips an assertion or changes the outputs. The hypothesis machine is the one
test_scheduler_stateful.py runs (tests/helpers/scheduler_machine.py: arrivals, tiny pools, chunking,
policies, mixed, aborts, stop tokens, max_new_tokens 0), driven in overlap mode: outputs equal the
unconstrained greedy reference, invariants hold after every rule, the pool is whole at the end.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from helpers.fake_runner import FakeRunner, greedy_reference, poison_freed
from helpers.scheduler_machine import VOCAB, SchedulerMachine
from minisched.sched.batch import Batch
from minisched.sched.req import FinishReason, Req
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig
from minisched.sched.step_output import StepOutput


class _Resolved:
    """A request as the worker sees it: placeholders of computed steps replaced by their tokens."""

    def __init__(self, req: Req, tokens: dict[int, int]) -> None:
        self._req, self._tokens = req, tokens

    def __getattr__(self, name):
        return getattr(self._req, name)

    def token_at(self, pos: int) -> int:
        t = self._req.token_at(pos)
        return self._tokens.get(t, t) if t < 0 else t

    @property
    def fill_ids(self) -> list[int]:
        return [self._tokens.get(t, t) if t < 0 else t for t in self._req.fill_ids]


class FutureFakeRunner(FakeRunner):
    """FakeRunner that resolves placeholder inputs, as the engine's forward worker does."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.tokens: dict[int, int] = {}

    def forward(self, batch: Batch) -> list[int]:
        view = dataclasses.replace(batch, reqs=[_Resolved(r, self.tokens) for r in batch.reqs])
        out = super().forward(view)
        assert min(view.input_ids(), default=0) >= 0, "an input placeholder whose step has not run"
        for fid, tok in zip(batch.future_ids, out.tokens if isinstance(out, StepOutput) else out):
            if fid < 0:
                self.tokens[fid] = tok
        return out


def overlap_step(sched: Scheduler, runner: FutureFakeRunner, launched: deque) -> list[Req]:
    """The engine's overlap step: build and launch N+1, then apply N's tokens."""
    batch = sched.get_next_batch()
    if batch is not None:
        sched.launch(batch)
        launched.append((batch, runner.forward(batch)))
    if launched and (batch is None or len(launched) > 1):
        b, out = launched.popleft()
        return sched.resolve(b, out)
    return sched.take_finished()


def run_overlap(sched: Scheduler, runner: FutureFakeRunner, launched: deque, max_steps: int = 10_000) -> dict:
    done = {}
    for _ in range(max_steps):
        if not sched.has_work() and not launched:
            break
        for req in overlap_step(sched, runner, launched):
            assert req.rid not in done, f"{req.rid} finished twice"
            done[req.rid] = req
        sched.check_invariants()
    else:
        raise AssertionError(f"no progress after {max_steps} steps")
    return done


class OverlapMachine(SchedulerMachine):
    def _ready(self) -> None:
        """The base setup's runner is never used here: swap in the resolving one before the first step."""
        if not hasattr(self, "launched"):
            self.runner = FutureFakeRunner(self.cfg.num_pages, self.cfg.page_size, VOCAB)
            self.launched: deque = deque()
            if self.sched.tree.host is not None:  # the host tier copies the fake KV of the runner in use
                self.sched.tree.host.mover = self.runner.mover
            self.sched.pool.alloc = self.sched.pool.__class__.alloc.__get__(self.sched.pool)  # the old runner's
            poison_freed(self.sched, self.runner)

    @rule(n=st.integers(1, 6))
    def step(self, n):
        self._ready()
        for _ in range(n):
            self._finished(overlap_step(self.sched, self.runner, self.launched))
            self.sched.check_invariants()

    @precondition(lambda self: self.sched.has_work())
    @rule(i=st.integers(0, 10_000))
    def abort_in_flight(self, i):
        """Abort a request of the launched batch (its forward computing, its token pending)."""
        self._ready()
        self._finished(overlap_step(self.sched, self.runner, self.launched))
        if not self.launched:
            return
        batch = self.launched[-1][0]
        victim = batch.reqs[i % len(batch.reqs)]
        if self.sched.abort(victim.rid):
            self.ended[victim.rid] = "aborted"
        self.sched.check_invariants()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        self._ready()
        self._finished(run_overlap(self.sched, self.runner, self.launched, max_steps=5000).values())
        self.check_drained()


OverlapMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestOverlapScheduler = OverlapMachine.TestCase


def _sched(**kw) -> Scheduler:
    base = dict(
        page_size=4, num_pages=64, max_context_len=200, chunk_size=None, max_prefill_tokens=512, max_running_requests=8
    )
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def test_stop_token_found_one_step_late_drops_the_extra_token():
    prompt = [3, 1, 4, 1, 5, 9, 2]
    ref = greedy_reference(prompt, 20, VOCAB)
    stop = ref[4]
    want = ref[: ref.index(stop) + 1]
    sched, launched = _sched(), deque()
    runner = FutureFakeRunner(64, 4, VOCAB)
    req = sched.add_request("a", prompt, SamplingParams(max_new_tokens=20, stop_token_ids=(stop,)))
    done = run_overlap(sched, runner, launched)
    assert done["a"].output_ids == want and req.finish_reason is FinishReason.STOP_TOKEN
    assert runner.num_forward == len(want) + 1  # one step computed past the stop token, then dropped
    assert not launched and not sched.reqs
    sched.pool.free(sched.tree.evict(64))
    assert sched.pool.num_free == 64


def test_length_limit_is_never_scheduled_past():
    sched, launched = _sched(), deque()
    runner = FutureFakeRunner(64, 4, VOCAB)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=5))
    sched.add_request("b", [4, 5], SamplingParams(max_new_tokens=1))
    done = run_overlap(sched, runner, launched)
    assert len(done["a"].output_ids) == 5 and len(done["b"].output_ids) == 1
    assert runner.num_forward == 5  # no forward for a token past max_new_tokens


def test_fail_in_flight_releases_only_written_kv():
    sched, launched = _sched(page_size=2), deque()
    runner = FutureFakeRunner(64, 2, VOCAB)
    a = sched.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=30))
    for _ in range(4):
        overlap_step(sched, runner, launched)
    assert len(launched) == 1 and a.pending_ids
    committed = launched[0][0].prefix_lens[0]
    failed = sched.fail_in_flight("boom")
    assert failed == [a] and a.finish_reason is FinishReason.ERROR and a.error == "boom"
    assert sched.take_finished() == [a] and not sched.has_work() and not a.pending_ids
    sched.check_invariants()
    assert sched.tree.total_pages == committed // 2  # only pages written by resolved steps are cached


@pytest.mark.parametrize("bad", ["get_next_batch", "resolve"])
def test_misuse_is_a_clear_error(bad):
    sched = _sched()
    sched.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=3))
    batch = sched.get_next_batch()
    if bad == "get_next_batch":
        with pytest.raises(RuntimeError, match="before the previous batch was launched"):
            sched.get_next_batch()
    else:
        with pytest.raises(RuntimeError, match="oldest launched"):
            sched.resolve(batch, [0])


def test_a_chunk_preempted_while_launched_waits_for_its_batch():
    """Priority preemption of the carried chunk whose chunk is computing: it must not be admitted again
    before that batch resolves (its stale row would apply to the new admission)."""
    sched, launched = _sched(chunk_size=8, priority_scheduling=True), deque()
    runner = FutureFakeRunner(64, 4, VOCAB)
    poison_freed(sched, runner)
    long = list(range(1, 40))
    sched.add_request("long", long, SamplingParams(max_new_tokens=4, priority=2))
    overlap_step(sched, runner, launched)
    assert sched.chunked_req is not None and launched
    sched.add_request("urgent", [7, 8, 9], SamplingParams(max_new_tokens=3))
    overlap_step(sched, runner, launched)
    sched.check_invariants()
    done = run_overlap(sched, runner, launched)
    assert done["long"].output_ids == greedy_reference(long, 4, VOCAB) and done["long"].num_retractions == 1
    assert done["urgent"].output_ids == greedy_reference([7, 8, 9], 3, VOCAB)
    sched.pool.free(sched.tree.evict(64))
    assert sched.pool.num_free == 64


def test_drafting_that_finds_nothing_does_not_keep_draining_the_pipeline():
    """Overlap with a drafter: a launched plain decode is resolved before building only while drafting pays
    (or to probe, every 32 steps) -- prompt lookup that finds no match must not serialize every step."""
    from minisched.sched.spec import NgramDrafter

    cfg = SchedulerConfig(page_size=4, num_pages=256, max_context_len=512, max_running_requests=8)
    sched, launched = Scheduler(cfg, drafter=NgramDrafter(4, 4)), deque()  # 4-grams: the fake model never repeats
    runner = FutureFakeRunner(256, 4, VOCAB)
    prompts = {f"r{i}": [(5 * i + 7 * j + j * j) % VOCAB for j in range(12)] for i in range(4)}
    for rid, p in prompts.items():
        sched.add_request(rid, p, SamplingParams(max_new_tokens=50))  # (the fake model's outputs cycle after 60)
    calls = 0
    while sched.has_work() or launched:
        overlap_step(sched, runner, launched)
        calls += 1
        sched.check_invariants()
    built = len(sched.step_stats)
    assert calls - built <= 8  # steps that built nothing (drains): the first tries, the probes, the last resolve
    assert built <= 52


def test_a_fork_copy_source_stays_locked_while_decode_rows_join_its_batch():
    """Found by this machine: a prompt filling its 2 pages, its choices admitted one per batch (a 1-token
    prefill budget), a running request `d` and the first choice both crossing into a new page in the second
    choice's mixed batch. The first choice's pages were not in the radix cache yet (its batch unresolved), so
    the second's copy source -- the cache's last page -- was locked by nobody once the prefill part was
    built: the decode rows mixed in after it evicted the page and took it, and the copy read a freed
    (poisoned) page. Sources now stay locked until the whole batch is built."""
    cfg = dict(num_pages=7, max_prefill_tokens=1, enable_mixed_chunk=True)
    sched, launched = _sched(**cfg, init_new_token_ratio=0.05, min_new_token_ratio=0.0), deque()
    runner = FutureFakeRunner(7, 4, VOCAB)
    poison_freed(sched, runner)
    d = [(5 * j + 1) % VOCAB for j in range(5)]
    sched.add_request("d", d, SamplingParams(max_new_tokens=12, ignore_eos=True))
    prompt = [(7 * j + 3) % VOCAB for j in range(8)]
    lead = sched.add_request("lead", prompt, SamplingParams(max_new_tokens=0))
    for j in range(2):
        sched.add_request(f"c{j}", prompt, SamplingParams(max_new_tokens=3, ignore_eos=True), after=lead)
    done = run_overlap(sched, runner, launched, max_steps=200)
    assert done["d"].output_ids == greedy_reference(d, 12, VOCAB)
    for j in range(2):
        assert done[f"c{j}"].output_ids == greedy_reference(prompt, 3, VOCAB)
    assert sched.forks.copied == 2  # both copied: the case the fix is about
