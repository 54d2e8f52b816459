"""Why each step's batch is what it is: the scheduler's decisions with their reasons (`StepWhy`).

At every batch build the scheduler fills one `StepWhy`: for every request it considered and did not
admit, the first rule that stopped it (`Reason`) and what used the resource (request ids); for each
admitted request its prefix hit, new tokens and pages (chunk k of n follows from consecutive
admissions of a carried request); for each retraction or preemption the victim, the rule and the
requests it was chosen over. A request in the waiting queue that is in none of the lists was offered
after the one that stopped the batch (`stopped`): it waits behind it, for the same reason.

The record is compact (tuples of ids and ints, only the requests that were skipped or stopped, at
most `MAX_BY` ids per resource) and cheap: its cost is measured against a decode and a prefill step
(benchmarks/sched/bench_decisions.py). It travels in the journal (journal.py), which the run record
keeps and `minisched explain` reads. Pure Python.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from minisched.sched.prefill_adder import AddResult, PrefillAdder
from minisched.sched.req import Req

MAX_BY = 4  # request ids named per used resource (the largest users first)


class Reason(enum.Enum):
    RUNNING_CAP = "running_cap"  # max_running_requests: the decode batch is full
    TOKEN_BUDGET = "token_budget"  # max_prefill_tokens: this batch's new tokens are spent
    CHUNK_BUDGET = "chunk_budget"  # chunk_size: this batch's chunk is spent
    KV_PAGES = "kv_pages"  # its pages (and reserved decode tokens) do not fit the pool
    PREFIX_DEFER = "prefix_defer"  # shares an uncached prefix with a request admitted this round
    GRAMMAR = "grammar"  # its grammar is still compiling
    FORK_WAIT = "fork_wait"  # an n > 1 choice: its prompt's shared prefill has not ended
    BUSY = "busy"  # preempted while its row is in a launched batch: waits for that batch
    DECODE_TURN = "decode_turn"  # prefill/decode alternation: this step decodes
    VERIFY_PENDING = "verify_pending"  # a launched VERIFY batch decides the next step: nothing is built
    CARRIED_FIRST = "carried_first"  # the carried chunked request goes first and its pages do not fit


TEXT = {
    Reason.RUNNING_CAP: "the running-request cap was reached",
    Reason.TOKEN_BUDGET: "the prefill token budget was spent",
    Reason.CHUNK_BUDGET: "the chunk budget was spent",
    Reason.KV_PAGES: "its KV pages did not fit",
    Reason.PREFIX_DEFER: "it shares an uncached prefix with a request in the batch",
    Reason.GRAMMAR: "its grammar was compiling",
    Reason.FORK_WAIT: "its prompt's shared prefill had not ended",
    Reason.BUSY: "its preempted row was still in a launched batch",
    Reason.DECODE_TURN: "the step was decode's turn",
    Reason.VERIFY_PENDING: "a verify step was being resolved",
    Reason.CARRIED_FIRST: "the carried chunked prefill's pages did not fit",
}


@dataclass
class StepWhy:
    """One build's decisions. Tuples, in the order they were made:

    admitted: (rid, prefix tokens, new tokens, truncated?, pages held, host-tier tokens loaded);
    skipped: (rid, reason, by) -- passed over, the next request was still offered;
    stopped: (rid, reason, by) or None -- the request the batch stopped at (the rest wait behind it);
    retracted: (rid, rule, passed over) -- rule "decode_pages" (memory) or "preempted_for:<rid>";
    no_prefill: why no prefill round was tried or formed, or None;
    evicted: radix-cache pages evicted while the batch was built."""

    step: int
    admitted: list[tuple[str, int, int, bool, int, int]] = field(default_factory=list)
    skipped: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)
    stopped: tuple[str, str, tuple[str, ...]] | None = None
    retracted: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)
    no_prefill: str | None = None
    evicted: int = 0

    def skip(self, req: Req, reason: Reason, by: tuple[str, ...] = ()) -> None:
        self.skipped.append((req.rid, reason.value, by))

    def stop(self, req: Req, reason: Reason, by: tuple[str, ...] = ()) -> None:
        if self.stopped is None:
            self.stopped = (req.rid, reason.value, by)

    def admit(self, req: Req, prefix: int, extend: int, truncated: bool) -> None:
        self.admitted.append((req.rid, prefix, extend, truncated, len(req.page_ids), req.host_hit_tokens))

    def retract(self, req: Req, rule: str, passed_over: list[Req]) -> None:
        self.retracted.append((req.rid, rule, tuple(r.rid for r in passed_over[:MAX_BY])))

    def to_dict(self) -> dict:
        """JSON-ready, empty parts left out."""
        d: dict = {}
        if self.admitted:
            d["admitted"] = [list(a) for a in self.admitted]
        if self.skipped:
            d["skipped"] = [[r, why, list(by)] for r, why, by in self.skipped]
        if self.stopped is not None:
            d["stopped"] = [self.stopped[0], self.stopped[1], list(self.stopped[2])]
        if self.retracted:
            d["retracted"] = [[r, rule, list(by)] for r, rule, by in self.retracted]
        if self.no_prefill is not None:
            d["no_prefill"] = self.no_prefill
        if self.evicted:
            d["evicted"] = self.evicted
        return d


def not_ready(req: Req) -> Reason:
    """Why a waiting request that is not `ready` waits (its shared prefill, else its grammar)."""
    if req.after is not None and not req.after.is_finished:
        return Reason.FORK_WAIT
    return Reason.GRAMMAR


def stop_reason(adder: PrefillAdder, result: AddResult | None) -> Reason:
    """The first budget that stopped `adder` (its state is unchanged since the refused request)."""
    if result is AddResult.NO_TOKEN:
        return Reason.KV_PAGES
    if len(adder.can_run) >= adder.max_new_reqs:
        return Reason.RUNNING_CAP
    if adder.rem_chunk_tokens is not None and adder.rem_chunk_tokens <= 0:
        return Reason.CHUNK_BUDGET
    if adder.new_chunked_req is not None:  # a truncated admission ends the batch: the chunk is spent
        return Reason.CHUNK_BUDGET
    return Reason.TOKEN_BUDGET


def users(reason: Reason, adder: PrefillAdder, running: list[Req]) -> tuple[str, ...]:
    """The requests that used the resource `reason` names: this batch's admissions for the token and
    chunk budgets, the largest page holders among running and admitted requests for KV pages."""
    if reason in (Reason.TOKEN_BUDGET, Reason.CHUNK_BUDGET):
        return tuple(r.rid for r in adder.can_run[:MAX_BY])
    if reason is Reason.KV_PAGES:
        holders = sorted(list(running) + adder.can_run, key=lambda r: -len(r.page_ids))
        return tuple(r.rid for r in holders[:MAX_BY])
    return ()


def sharer(req: Req, admitted: list[Req]) -> tuple[str, ...]:
    """The admitted request sharing the longest prefix with `req` (whose computation it waits for)."""
    key = req.fill_ids if req.output_ids else req.prompt_ids
    best, best_len = None, 0
    for other in admitted:
        okey = other.fill_ids if other.output_ids else other.prompt_ids
        n = 0
        for a, b in zip(key, okey):
            if a != b:
                break
            n += 1
        if n > best_len:
            best, best_len = other, n
    return () if best is None else (best.rid,)
