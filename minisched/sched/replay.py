"""Exact replay: re-drive a fresh Scheduler from a recorded journal and check every decision.

`replay(entries)` builds a Scheduler from the journal's `init` entry and feeds it the recorded inputs
in their order -- arrivals (token-id prompts, the sampling fields scheduling reads, n > 1 leaders,
grammar gates), aborts, builds, launches, resolves with the sampled tokens, failures, cache flushes
-- with stand-ins for what the engine provided: a gate per gated request that opens at the build
the journal says it opened at, a stop checker that answers as the recorded one did, a drafter that
proposes the recorded drafts, and a host-tier mover that copies nothing. After each input it
compares the entries the replayed scheduler journals with the recorded ones (times and exception
texts aside) and stops at the first that differs, with both entries and the replayed scheduler's
state then. Nothing here reads a clock; a replay of a correct journal is identical by construction
of the scheduler (journal.py says why), so a difference is a rule that changed or a journal that
does not start at the scheduler's birth.

`overrides` (SchedulerConfig fields) replay the same inputs under other settings: the decisions then
differ at some step, which is the point of `minisched replay --check-rule` style tests; for a
prediction of the traffic under other settings see observe/whatif.py. Pure Python.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minisched.sched.batch import Batch
from minisched.sched.config import SchedulerConfig
from minisched.sched.host_tier import HostTier
from minisched.sched.journal import same
from minisched.sched.req import Req
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler
from minisched.sched.step_output import StepOutput

INPUTS = ("add", "abort", "build", "launch", "resolve", "fail", "fail_waiting", "flush")


class JournalError(ValueError):
    """The journal cannot be replayed (no init entry, an unknown op, an input the scheduler refuses)."""


class JournalGate:
    """A grammar future whose completion the journal decides."""

    def __init__(self) -> None:
        self.ready = False

    def done(self) -> bool:
        return self.ready

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> None:
        return None


class NullMover:
    """Host-tier copies without data: the scheduler only needs handles."""

    def to_host(self, pages: list[int]) -> Any:
        return object()

    def to_device(self, handle: Any, pages: list[int]) -> None:
        return None

    def split(self, handle: Any, n_pages: int) -> tuple[Any, Any]:
        return object(), object()

    def free(self, handle: Any) -> None:
        return None


class JournalDrafter:
    """Proposes the drafts the recorded build held, by request (set before each build)."""

    def __init__(self) -> None:
        self.next: dict[str, list[int]] = {}

    def propose(self, reqs: Sequence[Req], ks: Sequence[int]) -> list[list[int]]:
        return [list(self.next.get(r.rid, [])[:k]) for r, k in zip(reqs, ks)]


@dataclass(frozen=True, kw_only=True)
class Divergence:
    index: int  # the recorded entry that differs (or the input the replay could not apply)
    step: int  # the scheduler's step then
    recorded: dict | None
    replayed: dict | None
    state: str  # the replayed scheduler's queues and pool then


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    steps: int  # builds replayed
    entries: int  # recorded entries compared
    divergence: Divergence | None = None
    scheduler: Scheduler | None = None  # the replayed scheduler at the end (its requests' outcomes: `reqs`)
    requests: dict[str, Req] = dataclasses.field(default_factory=dict)  # every request replayed, by rid

    @property
    def identical(self) -> bool:
        return self.divergence is None


def config_of(entries: Sequence[dict], overrides: dict | None = None) -> SchedulerConfig:
    if not entries or entries[0].get("op") != "init":
        raise JournalError("the journal does not start with its init entry (it must cover the scheduler's whole life)")
    fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    d = {k: v for k, v in entries[0]["config"].items() if k in fields}
    for k in ("stop_token_ids",):
        if isinstance(d.get(k), list):
            d[k] = tuple(d[k])
    d.update(overrides or {})
    try:
        return SchedulerConfig(**d)
    except (TypeError, ValueError) as exc:
        raise JournalError(f"the journal's scheduler config is not valid here: {exc}") from exc


def state_line(sched: Scheduler) -> str:
    snap = sched.snapshot()
    return (
        f"step {snap.step}: {snap.running} running, {snap.waiting} waiting, "
        f"{snap.pages_free}/{snap.pages_total} pages free, {snap.pages_evictable} evictable, "
        f"new_token_ratio {snap.new_token_ratio:.4f}"
    )


def replay(entries: Sequence[dict], overrides: dict | None = None) -> ReplayResult:
    """Re-drive the recorded inputs; identical if every journal entry the replay writes equals the record."""
    entries = list(entries)
    config = config_of(entries, overrides)
    init = entries[0]
    hits: dict[tuple[str, int], str | None] = {
        (e["rid"], int(e["n"])): (e.get("message", "stop checker raised") if e.get("raised") else None)
        for e in entries
        if e.get("op") == "stop"
    }

    def checker(req: Req) -> bool:
        key = (req.rid, len(req.output_ids))
        if key not in hits:
            return False
        message = hits[key]
        if message is not None:
            raise RuntimeError(message)
        return True

    host = init.get("host")
    tier = None if host is None else HostTier(int(host[0]), NullMover(), write_through=bool(host[1]))
    drafter = JournalDrafter() if init.get("drafter") else None
    sched = Scheduler(config, stop_checker=checker, host_tier=tier, drafter=drafter)
    gates: dict[str, JournalGate] = {}
    everyone: dict[str, Req] = {}
    built: Batch | None = None
    launched: deque[Batch] = deque()
    mine = sched.journal.entries
    seen = len(mine)  # its own init entry is not compared: the config came from the record
    i, steps = 1, 0
    while i < len(entries):
        e = entries[i]
        op = e.get("op")
        if op not in INPUTS:
            if op == "stop":  # an output of a resolve that the replay did not write
                return _diverged(sched, i, e, None, everyone)
            raise JournalError(f"journal entry {i}: unknown op {op!r}")
        try:
            if op == "add":
                sp = SamplingParams(**{**e["sampling"], "stop_token_ids": tuple(e["sampling"]["stop_token_ids"])})
                after = everyone.get(e["after"]) if e.get("after") else None
                gate = gates.setdefault(e["rid"], JournalGate()) if e.get("gated") else None
                everyone[e["rid"]] = sched.add_request(e["rid"], e["prompt"], sp, after=after, gate=gate)
            elif op == "abort":
                sched.abort(e["rid"])
            elif op == "build":
                for rid in e.get("opened", ()):
                    gates.setdefault(rid, JournalGate()).ready = True
                if drafter is not None:
                    drafter.next = dict(zip(e.get("rids", ()), e.get("drafts", ())))
                built = sched.get_next_batch()
                steps += 1
            elif op == "launch":
                if built is None:
                    return _diverged(sched, i, e, None, everyone)
                sched.launch(built)
                launched.append(built)
                built = None
            elif op == "resolve":
                if not launched:
                    return _diverged(sched, i, e, None, everyone)
                more, secs = e.get("more"), e.get("secs")
                out = (
                    StepOutput(tokens=list(e["tokens"]), more_tokens=more, seconds=secs)
                    if more is not None or secs is not None
                    else list(e["tokens"])
                )
                sched.resolve(launched.popleft(), out)
            elif op == "fail":
                sched.fail_in_flight(e.get("message", ""))
                built, launched = None, deque()
            elif op == "fail_waiting":
                req = sched.get(e["rid"])
                if req is None:
                    return _diverged(sched, i, e, None, everyone)
                sched.fail_waiting(req, e.get("message", ""))
            elif op == "flush":
                sched.flush_cache()
        except (ValueError, RuntimeError, AssertionError) as exc:  # the replayed state refused the input
            return _diverged(sched, i, e, {"op": "error", "error": f"{type(exc).__name__}: {exc}"}, everyone)
        new = mine[seen:]
        seen = len(mine)
        for k, got in enumerate(new):
            want = entries[i + k] if i + k < len(entries) else None
            if want is None or not same(want, got):
                return _diverged(sched, i + k, want, got, everyone)
        i += max(1, len(new))
    return ReplayResult(steps=steps, entries=len(entries), scheduler=sched, requests=everyone)


def _diverged(
    sched: Scheduler, index: int, recorded: dict | None, replayed: dict | None, everyone: dict
) -> ReplayResult:
    return ReplayResult(
        steps=sched.step_count,
        entries=index,
        divergence=Divergence(
            index=index, step=sched.step_count, recorded=recorded, replayed=replayed, state=state_line(sched)
        ),
        scheduler=sched,
        requests=everyone,
    )
