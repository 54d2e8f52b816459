"""`Queues`: the Scheduler's state and public methods as its collaborators see them.

batch_builder.py, retraction.py, preemption.py and invariants.py are functions over a `Queues`; the
Scheduler implements it (scheduler.py). They read the queues; they move a request between them (and
change its status) only through the methods below, which keep `Req.place` and the status in step.
Pure Python.
"""

from __future__ import annotations

from typing import Protocol

from minisched.sched.batch import Batch
from minisched.sched.config import SchedulerConfig
from minisched.sched.decisions import StepWhy
from minisched.sched.forks import ForkPages
from minisched.sched.in_flight import InFlight
from minisched.sched.kv_pool import KVPool
from minisched.sched.policy import SchedulePolicy
from minisched.sched.radix_cache import RadixCache
from minisched.sched.req import FinishReason, Req, ReqStatus
from minisched.sched.spec import Speculator


class Queues(Protocol):
    config: SchedulerConfig
    max_context_len: int  # config.max_context_len, set (the Scheduler requires it)
    pool: KVPool
    tree: RadixCache
    policy: SchedulePolicy
    waiting: list[Req]
    running: list[Req]
    chunked_req: Req | None
    reqs: dict[str, Req]
    in_flight: InFlight
    new_token_ratio: float
    prefill_rounds: int
    stalled: int
    forks: ForkPages
    step_count: int
    speculator: Speculator | None
    why: StepWhy  # the decisions of the batch being built (decisions.py)
    batch_is_full: bool
    last_batch: Batch | None

    def reorder_waiting(self, ordered: list[Req]) -> None: ...

    def admit(self, admitted: list[Req], aging: bool) -> None: ...

    def take_carried(self) -> Req | None: ...

    def carry(self, req: Req | None) -> None: ...

    def end(self, req: Req, kv_len: int, status: ReqStatus, reason: FinishReason) -> None: ...

    def retract(self, req: Req, note: str = "", at: int | None = 0, cache: bool = True) -> None: ...

    def reorder_running(self, ordered: list[Req]) -> None: ...

    def finished_early(self, req: Req) -> None: ...
