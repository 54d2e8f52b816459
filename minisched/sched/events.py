"""Lifecycle events and per-step statistics recorded by the scheduler.

`Event`: one per request state change (time.monotonic(), rid, from -> to, token counts,
an optional note such as the finish reason). `StepStats`: one per scheduled batch.
Together they are the source for metrics, the lifecycle picture and traces.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisched.sched.req import ReqStatus


@dataclass(frozen=True, kw_only=True)
class Event:
    time: float
    step: int
    rid: str
    src: ReqStatus | None  # None: the request just arrived
    dst: ReqStatus
    prompt_len: int
    output_len: int  # tokens sampled, or being sampled by a launched step
    kv_len: int
    cached_len: int  # prefix tokens reused from the radix cache at (last) admission
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class StepStats:
    step: int
    time: float
    mode: str  # ForwardMode value
    batch_size: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int  # decode batch after this step's admissions / retractions
    num_waiting: int
    free_pages: int
    cached_pages: int  # pages held by the radix cache (evictable + protected)
    evictable_pages: int
    token_usage: float  # 1 - (free + evictable) / total
    cache_hit_tokens: int  # prefix tokens reused by requests admitted this step
    num_retracted: int
    new_token_ratio: float
    num_draft_tokens: int = 0  # VERIFY: the draft tokens verified (besides one decode token per row)


def transitions(events: list[Event], rid: str) -> list[tuple[ReqStatus | None, ReqStatus]]:
    """The (from, to) sequence of one request, in order."""
    return [(e.src, e.dst) for e in events if e.rid == rid]
