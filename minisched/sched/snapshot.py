"""What the scheduler tells the outside about itself: `SchedulerSnapshot` (gauges and counters, read
after a step for /metrics, progress lines and benchmarks), `Records` (its events, step stats and journal) and
`CacheFlush` (what `Scheduler.flush_cache` freed). Frozen values: a reader never holds the
scheduler's own lists. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from minisched.sched.events import Event, StepStats
from minisched.sched.host_tier import TierStats
from minisched.sched.spec import SpecStats


@dataclass(frozen=True, kw_only=True)
class SchedulerSnapshot:
    step: int  # batches built so far
    running: int  # in the decode batch
    waiting: int  # queued for prefill, the carried chunked prefill included
    live: int  # live requests (also those being admitted or held at their length limit)
    pages_total: int
    pages_free: int
    pages_cached: int  # held by the radix cache (evictable + protected)
    pages_evictable: int
    new_token_ratio: float
    retractions: int  # requests retracted for decode room so far (StepStats.num_retracted summed)
    preemptions: int  # requests retracted for a more urgent one so far (priority scheduling)
    host_pages_total: int = 0  # the host KV tier (0 pages: off)
    host_pages_used: int = 0
    host: TierStats | None = None  # a copy of the host tier's counters
    spec: SpecStats | None = None  # a copy of the speculative decoding counters (None: no drafter)


@dataclass(frozen=True, kw_only=True)
class Records:
    events: tuple[Event, ...]  # one per request state change, in order
    step_stats: tuple[StepStats, ...]  # one per built batch, in order
    journal: tuple[dict, ...] = ()  # inputs and decisions, in call order (journal.py)


@dataclass(frozen=True, kw_only=True)
class CacheFlush:
    device_pages: int  # device pages given back to the pool
    host_pages: int  # host-tier pages dropped
