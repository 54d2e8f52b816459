"""Overlap scheduling, the engine's half: forwards on one worker thread, scheduling one step ahead.

SGLang's "zero-overhead" event loop (`event_loop_overlap`), on one worker thread instead of a
CUDA stream: each `step()`

1. builds batch N+1 (`get_next_batch`), advances the scheduler's state with placeholder tokens
   for what batch N is still computing (`Scheduler.launch`), builds its inputs (`runner.prepare`)
   and queues its forward on the worker, which runs it as soon as N's is done;
2. waits for batch N's tokens and applies them (`Scheduler.resolve`): finish checks, stop
   strings and releases happen there, one step late (sched/scheduler.py says what that costs).

So the worker never waits for the scheduler while there is work: step N+1's inputs are ready
when step N's forward ends, and the scheduling of N+2 and the bookkeeping of N run during
N+1's forward (torch kernels release the GIL). When no batch can be built (nothing to run, or a
decode that would need a retraction), the step waits for the launched batch and resolves it.

A failure anywhere (the forward, sampling or a stop checker raising, Ctrl-C while waiting) ends
the requests of every launched batch with an error, after the worker has finished what it was
running, and propagates; the worker skips the jobs queued behind a failed one (their inputs
would name tokens that were never sampled).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from minisched.engine.runner import ForwardJob, ModelRunner
from minisched.sched.batch import Batch
from minisched.sched.req import Req
from minisched.sched.scheduler import Scheduler
from minisched.sched.step_output import StepOutput


class SkippedStep(RuntimeError):
    """A queued step not run because a step before it failed."""


class OverlapLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self._pool: Optional[ThreadPoolExecutor] = None  # started on the first step
        self._launched: deque[tuple[Batch, Future]] = deque()
        self._broken = False  # a job failed: the jobs queued behind it are skipped until `step` cleans up
        self.forward_times: list[tuple[float, float]] = []  # (start, end) of each forward on the worker

    def _run(self, job: ForwardJob) -> StepOutput:
        if self._broken:
            raise SkippedStep("a step before this one failed")
        t0 = time.perf_counter()
        try:
            return self.runner.execute(job)
        except BaseException:
            self._broken = True
            raise
        finally:
            self.forward_times.append((t0, time.perf_counter()))

    def step(self) -> list[Req]:
        sched = self.scheduler
        try:
            batch = sched.get_next_batch()
            if batch is not None:
                sched.launch(batch)
                job = self.runner.prepare(batch)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="minisched-forward")
                self._launched.append((batch, self._pool.submit(self._run, job)))
            if self._launched and (batch is None or len(self._launched) > 1):
                oldest, future = self._launched[0]
                tokens = future.result()
                self._launched.popleft()
                return sched.resolve(oldest, tokens)
            return sched.take_finished()
        except BaseException as exc:
            self._drain()
            sched.fail_in_flight(f"{type(exc).__name__}: {exc}")
            raise

    def _drain(self) -> None:
        """Let the worker finish (a running forward cannot be stopped); drop what it computed."""
        for _, future in self._launched:
            try:
                future.result()
            except BaseException:
                pass
        self._launched.clear()
        self._broken = False

    def close(self) -> None:
        if self._pool is not None:
            self._drain()
            self._pool.shutdown(wait=True)
            self._pool = None
