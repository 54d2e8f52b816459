"""The scheduler's journal: every input it was given and every decision it made, in call order.

One JSON-ready dict per entry, `op` first:

    init        the SchedulerConfig (as a dict), host tier (capacity, write_through) or None, drafter?
    add         rid, prompt (token ids), sampling (the SamplingParams fields scheduling reads), after (rid of
                the request it waits for, n > 1), gated (it waits for a grammar), t (arrival)
    abort       rid, t
    build       step, opened (the gated requests whose grammar was found compiled at its start), the
                batch (mode, rids, prefix, extend, drafts; or none) and its reasons (why: decisions.StepWhy), t
    launch      t
    resolve     tokens (one per row), more (a verify step's accepted tokens per row, or absent), secs (the
                measured forward of a decode or verify step, when the runner timed it and the speculator
                has a cost model: that model's input, spec_cost.py), idle (no work was left after it: the time to the
                next build was not the step's), t
    stop        rid, n: the stop checker ended it after n output tokens (raised: it raised, message)
    fail        message: a step failed (fail_in_flight)
    fail_waiting rid, message: a waiting request failed (its grammar did not compile)
    flush       the radix cache was emptied

The inputs (add, abort, launch, resolve with its tokens and timing, stop, fail, fail_waiting, flush, and which
gated requests were ready at each build) determine every decision: the scheduler's rules read no
clock (a step's measured seconds reach it as an input) and no randomness (the radix cache's LRU runs on a logical clock). So `replay.py` re-drives a
fresh Scheduler from a journal and checks that every entry it writes equals the recorded one. Times
(`t`, time.monotonic()) are for the what-if model and the explanations, never compared.

Memory: the journal grows with the run; `Scheduler.drain_records` hands it over with the events (a
server drains every few hundred steps and writes it to its record file, or drops it). Pure Python.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from minisched.sched.batch import Batch
from minisched.sched.config import SchedulerConfig
from minisched.sched.decisions import StepWhy
from minisched.sched.sampling_params import SamplingParams

NOT_COMPARED = ("t", "message")  # fields a replay does not compare (times, exception texts)


# the SamplingParams fields the scheduler reads (the rest shape sampling and text, not decisions)
SCHEDULING_FIELDS = (
    "max_new_tokens",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
    "prompt_logprob_start",
    "priority",
)


def sampling_dict(sp: SamplingParams) -> dict[str, Any]:
    """The fields that matter to scheduling and replay, JSON-ready."""
    d = {k: getattr(sp, k) for k in SCHEDULING_FIELDS}
    d["stop_token_ids"] = list(sp.stop_token_ids)
    return d


class Journal:
    def __init__(self, config: SchedulerConfig, host: tuple[int, bool] | None, drafter: bool) -> None:
        self.entries: list[dict] = []
        self.append(
            {
                "op": "init",
                "config": dataclasses.asdict(config),
                "host": None if host is None else list(host),
                "drafter": drafter,
            }
        )

    def append(self, entry: dict) -> None:
        self.entries.append(entry)

    def drain(self) -> list[dict]:
        out, self.entries = self.entries, []
        return out

    def add(self, rid: str, prompt: list[int], sp: SamplingParams, after: str | None, gated: bool, t: float) -> None:
        self.append(
            {
                "op": "add",
                "rid": rid,
                "prompt": list(prompt),
                "sampling": sampling_dict(sp),
                "after": after,
                "gated": gated,
                "t": t,
            }
        )

    def build(self, step: int, batch: Batch | None, why: StepWhy, opened: list[str]) -> None:
        entry: dict[str, Any] = {"op": "build", "step": step, "t": time.monotonic()}
        if opened:
            entry["opened"] = opened
        if batch is not None:
            entry["mode"] = batch.mode.value
            entry["rids"] = [r.rid for r in batch.reqs]
            entry["prefix"] = list(batch.prefix_lens)
            entry["extend"] = list(batch.extend_lens)
            if batch.drafts:
                entry["drafts"] = [list(d) for d in batch.drafts]
        why_d = why.to_dict()
        if why_d:
            entry["why"] = why_d
        self.append(entry)

    def resolve(self, tokens: list[int], more: list[list[int]] | None, seconds: float | None = None) -> dict:
        """The entry, which the scheduler marks `idle` if no work is left after it."""
        entry: dict[str, Any] = {"op": "resolve", "tokens": tokens, "t": time.monotonic()}
        if more is not None:
            entry["more"] = more
        if seconds is not None:
            entry["secs"] = seconds
        self.append(entry)
        return entry


def same(a: dict, b: dict) -> bool:
    """Do two entries record the same input or decision (times aside)?"""
    return {k: v for k, v in a.items() if k not in NOT_COMPARED} == {
        k: v for k, v in b.items() if k not in NOT_COMPARED
    }
