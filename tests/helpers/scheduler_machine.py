"""The scheduler's hypothesis state machine: tests/sched/test_scheduler_stateful.py runs it (its docstring says
what is checked), tests/sched/test_scheduler_overlap.py drives it in overlap mode."""

from __future__ import annotations

import json

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers.fake_runner import FakeRunner, OracleDrafter, check_lifecycles, greedy_reference, poison_freed, run
from minisched.sched.host_tier import HostTier
from minisched.sched.replay import replay
from minisched.sched.req import FinishReason, ReqStatus
from minisched.sched.sampling_params import InvalidRequest, SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig
from minisched.sched.spec import NgramDrafter

VOCAB = 40
BASES = [[(7 * i + 3 * j) % VOCAB for j in range(48)] for i in range(3)]
DOC = [(5 * j + j * j) % VOCAB for j in range(120)]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 4, 16]),
        pool_tokens=st.integers(16, 768),
        chunk=st.sampled_from([None, 8, 16, 48]),
        policy=st.sampled_from(["fcfs", "lpm", "dfs-weight", "lof"]),
        radix=st.booleans(),
        mixed=st.booleans(),
        guard=st.sampled_from([None, 1, 3]),
        max_running=st.integers(1, 8),
        max_prefill=st.sampled_from([16, 64, 512]),
        ratio=st.sampled_from([0.7, 0.2, 0.05]),
        defer=st.sampled_from([None, 4, 32]),
        host=st.sampled_from([0, 0, 3, 64]),  # host-tier pages (0: off)
        priority=st.sampled_from([None, (0, None), (0, 2), (1, 5), (None, 3), (0, 40)]),  # (threshold, aging) or off
        spec=st.sampled_from([None, None, ("oracle", 5), ("oracle", 0), ("oracle", 2), ("ngram", 1)]),
        draft=st.tuples(st.integers(1, 6), st.sampled_from([1, 3, 8]), st.booleans()),  # k, max batch, adaptive
    )
    def setup(
        self,
        page_size,
        pool_tokens,
        chunk,
        policy,
        radix,
        mixed,
        guard,
        max_running,
        max_prefill,
        ratio,
        defer,
        host,
        priority,
        spec,
        draft,
    ):
        self.cfg = SchedulerConfig(
            page_size=page_size,
            num_pages=max(1, pool_tokens // page_size),
            max_context_len=96,
            chunk_size=chunk,
            max_prefill_tokens=max_prefill,
            max_running_requests=max_running,
            policy=policy,
            enable_radix_cache=radix,
            enable_mixed_chunk=mixed,
            max_prefill_rounds_between_decodes=guard,
            aging_rounds=3,
            init_new_token_ratio=ratio,
            min_new_token_ratio=min(ratio, 0.05),
            new_token_ratio_decay_steps=10,
            in_batch_prefix_defer_tokens=defer,
            clip_max_new_tokens_estimation=64,
            priority_scheduling=priority is not None,
            priority_preemption_threshold=priority[0] if priority else 0,
            priority_aging_steps=priority[1] if priority else 256,
            num_draft_tokens=draft[0],
            spec_max_batch_size=draft[1],
            spec_adaptive=draft[2],
        )
        self.runner = FakeRunner(self.cfg.num_pages, page_size, VOCAB)
        drafter = None
        if spec is not None:  # speculative decoding: drafts of every accuracy, or prompt lookup
            drafter = OracleDrafter(VOCAB, spec[1]) if spec[0] == "oracle" else NgramDrafter(spec[1], 3)
        self.sched = Scheduler(self.cfg, host_tier=HostTier(host, self.runner.mover) if host else None, drafter=drafter)
        poison_freed(self.sched, self.runner)
        self.added: dict[str, tuple[list[int], SamplingParams]] = {}
        self.ended: dict[str, object] = {}
        self.n = 0

    def _finished(self, reqs):
        for r in reqs:
            assert r.rid not in self.ended, f"{r.rid} ended twice"
            self.ended[r.rid] = r

    @rule(
        base=st.integers(0, 2),
        shared=st.integers(0, 48),
        own=st.integers(0, 40),
        max_new=st.one_of(st.integers(0, 30), st.just(100_000)),
        stop=st.booleans(),
        copies=st.integers(1, 4),
        priority=st.integers(-3, 3),
    )
    def add(self, base, shared, own, max_new, stop, copies, priority):
        for _ in range(copies):
            self._add(BASES[base][:shared] + [(self.n * 11 + k) % VOCAB for k in range(own)], max_new, stop, priority)

    @rule(
        lens=st.lists(st.integers(1, 120), min_size=1, max_size=4),
        max_new=st.one_of(st.integers(0, 30), st.just(100_000)),
    )
    def add_continuations(self, lens, max_new):
        """Turns of one conversation: each prompt continues the previous ones."""
        for n in sorted(lens):
            self._add(DOC[:n], max_new, False)

    @rule(base=st.integers(0, 2), own=st.integers(1, 30), n=st.integers(2, 4), max_new=st.integers(1, 20))
    def add_fork(self, base, own, n, max_new):
        """n > 1: a prefill-only leader and n choices that wait for it, then copy its last page (forks.py)."""
        prompt = BASES[base][:24] + [(self.n * 13 + k) % VOCAB for k in range(own)]
        if len(prompt) >= self.cfg.max_context_len or len(prompt) > self.cfg.num_pages * self.cfg.page_size:
            return
        lead = self.sched.add_request(f"r{self.n}", prompt, SamplingParams(max_new_tokens=0))
        self.added[lead.rid] = (prompt, lead.sampling)
        self.n += 1
        sp = SamplingParams(max_new_tokens=max_new)
        for _ in range(n):
            self.sched.add_request(f"r{self.n}", prompt, sp, after=lead)
            self.added[f"r{self.n}"] = (prompt, sp)
            self.n += 1

    def _add(self, prompt, max_new, stop, priority=0):
        rid = f"r{self.n}"
        self.n += 1
        priority = priority if self.cfg.priority_scheduling else 0
        sp = SamplingParams(max_new_tokens=max_new, stop_token_ids=(5,) if stop else (), priority=priority)
        too_long = len(prompt) >= self.cfg.max_context_len or len(prompt) > self.cfg.num_pages * self.cfg.page_size
        if not prompt or too_long:
            try:
                self.sched.add_request(rid, prompt, sp)
            except InvalidRequest:
                return
            raise AssertionError("bad request accepted")
        self.sched.add_request(rid, prompt, sp)
        self.added[rid] = (prompt, sp)

    @rule()
    def duplicate(self):
        live = list(self.sched.reqs)
        if live:
            try:
                self.sched.add_request(live[0], [1, 2], SamplingParams())
            except InvalidRequest:
                return
            raise AssertionError("duplicate id accepted")

    @rule(n=st.integers(1, 6))
    def step(self, n):
        for _ in range(n):
            self._finished(self.sched.step(self.runner))
            self.sched.check_invariants()

    @precondition(lambda self: self.added)
    @rule(i=st.integers(0, 10_000))
    def abort(self, i):
        rid = sorted(self.added)[i % len(self.added)]
        live = rid in self.sched.reqs
        assert self.sched.abort(rid) == live
        if live:
            self.ended[rid] = "aborted"

    @precondition(lambda self: self.sched.has_work())
    @rule(i=st.integers(0, 10_000))
    def abort_in_flight(self, i):
        batch = self.sched.get_next_batch()
        if batch is None:
            return
        out = self.runner.forward(batch)
        victim = batch.reqs[i % len(batch.reqs)]
        if self.sched.abort(victim.rid):
            self.ended[victim.rid] = "aborted"
        self._finished([r for r in self.sched.process_batch_result(batch, out) if r.rid != victim.rid])

    @invariant()
    def invariants(self):
        if hasattr(self, "sched"):
            self.sched.check_invariants()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        self._finished(run(self.sched, self.runner, max_steps=5000).values())
        self.check_drained()

    def check_drained(self):
        """Every request ended with the fake model's greedy output and no placeholder left; the pool and tree are
        empty; the journal (through JSON) replays identically."""
        journal = json.loads(json.dumps(list(self.sched.records().journal)))
        result = replay(journal)
        assert result.identical, f"replay differs: {result.divergence}"
        assert result.steps == self.sched.step_count
        assert set(self.ended) == set(self.added), "a request was lost"
        for rid, (prompt, sp) in self.added.items():
            r = self.ended[rid]
            if r == "aborted":
                continue
            assert r.finish_reason is not FinishReason.ERROR, r.error
            assert not r.pending_ids
            if sp.max_new_tokens == 0:
                assert r.output_ids == [] and r.finish_reason is FinishReason.LENGTH
                continue
            ref = greedy_reference(
                prompt, min(sp.max_new_tokens, 500), VOCAB, sp.stop_token_ids, self.cfg.max_context_len
            )
            if r.finish_reason is FinishReason.LENGTH:
                assert r.output_ids == ref[: len(r.output_ids)]
            else:
                assert r.output_ids == ref, f"{rid}: {r.output_ids} != {ref}"
            assert r.status is ReqStatus.FINISHED
        check_lifecycles(self.sched.events)
        tree, pool = self.sched.tree, self.sched.pool
        assert tree.protected_pages == 0
        pool.free(tree.evict(tree.total_pages))
        assert pool.num_free == self.cfg.num_pages and tree.total_pages == 0
