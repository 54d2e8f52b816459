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
    cached_tokens: int = 0
    num_retractions: int = 0


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
