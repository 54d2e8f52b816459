"""The messages between the engine and the HTTP side: per-request `Update`s, the `Sink` that
receives them, and the engine `Stats` snapshot behind /metrics."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol


@dataclass
class Update:
    """What the engine thread tells a request after a step."""

    token_ids: list[int]
    finish_reason: Optional[str] = None  # a FinishReason value; None while the request runs
    error: Optional[str] = None
    error_type: Optional[str] = None  # "invalid_request_error" (rejected at add) or "server_error"
    cached_tokens: int = 0  # prompt tokens the radix cache had (n > 1: the shared prefill's)
    num_retractions: int = 0
    logprobs: Optional[list] = None  # TokenLogprob per new token, when the request asked for them
    prompt_logprobs: Optional[list] = None  # once, on the first update, when asked for (echo)

    def merged(self, nxt: Update) -> Update:
        """This update followed by `nxt` (still running): one update (the HTTP side coalesces a backlog)."""
        nxt.token_ids = self.token_ids + nxt.token_ids
        if self.logprobs is not None:
            nxt.logprobs = self.logprobs + (nxt.logprobs or [])
        if self.prompt_logprobs is not None:
            nxt.prompt_logprobs = self.prompt_logprobs
        return nxt


class Sink(Protocol):
    loop: asyncio.AbstractEventLoop

    def deliver(self, update: Update) -> None: ...


@dataclass
class Stats:
    """A snapshot of the engine's state, replaced (never mutated) after every step: the HTTP side
    reads it for /metrics without touching the engine."""

    time: float = field(default_factory=time.monotonic)
    steps: int = 0
    running: int = 0
    waiting: int = 0  # in the scheduler's queue (incl. a carried chunked prefill) + held for static batching
    pages_total: int = 0
    pages_free: int = 0
    pages_cached: int = 0
    pages_evictable: int = 0
    retractions: int = 0
    step_errors: int = 0
    host_pages_total: int = 0  # the host KV tier (0 pages: off)
    host_pages_used: int = 0
    host_loads: int = 0  # host-only cache nodes brought back to the device
    host_load_pages: int = 0
    host_hit_tokens: int = 0  # prompt tokens found on the host (also in the cached tokens)
    host_write_back_pages: int = 0
    host_write_backs: int = 0  # device evictions copied to the host
    host_dropped_pages: int = 0  # host-tier evictions and pages refused for want of host room
    preemptions: int = 0  # requests retracted for a more urgent one (priority scheduling)
    spec_draft_tokens: int = 0  # speculative decoding: drafts verified ...
    spec_accepted_tokens: int = 0  # ... and accepted
    grammar_compiles: int = 0  # grammars compiled (cache hits not counted)
    grammar_compile_timeouts: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_compile_time_counts: tuple[int, ...] = ()  # per engine/structured.py's COMPILE_TIME_BUCKETS bound
