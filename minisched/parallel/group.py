"""`TPGroup`: one rank's view of the tensor-parallel process group, with bounded waits and accounting.

Two `torch.distributed` groups over the same ranks: the default one, created with the long
`startup_timeout` (ranks load their weights at different speeds), and the step group, created
with the collective `timeout`, that carries everything a step sends. gloo enforces the timeout
on every collective; NCCL's watchdog aborts the communicator after it. A wait that ends in an
error raises from the collective -- nothing here waits without a bound.

Every collective of the step group counts its calls, bytes and (on the CPU, where gloo
collectives are synchronous) seconds in `stats`: the benchmark reads them.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class CommStats:
    """Per collective kind ("all_reduce", "broadcast", "gather"): calls, payload bytes, seconds inside."""

    ops: dict[str, OpStats] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        s = self.ops.setdefault(kind, OpStats())
        s.calls += 1
        s.bytes += nbytes
        s.seconds += seconds

    def snapshot(self) -> dict[str, tuple[int, int, float]]:
        return {k: (v.calls, v.bytes, v.seconds) for k, v in self.ops.items()}

    @staticmethod
    def delta(after: dict, before: dict) -> dict[str, dict]:
        out = {}
        for k, (c, b, s) in after.items():
            c0, b0, s0 = before.get(k, (0, 0, 0.0))
            out[k] = {"calls": c - c0, "bytes": b - b0, "seconds": s - s0}
        return out


class TPError(RuntimeError):
    """Tensor parallelism cannot go on: a rank died, hung past the collective timeout, or fell out of
    step. The message says which and why; every later step raises it again."""


def seconds(td: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(td))


class TPGroup:
    """Collectives for one rank. `lock` serializes whole exchanges (a step, a heartbeat) on rank 0,
    where two threads may talk to the group; the ranks then see them in the same order."""

    def __init__(
        self,
        rank: int,
        world: int,
        device: torch.device | str,
        *,
        store: dist.Store,
        timeout: float,
        startup_timeout: float,
    ):
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.timeout = timeout
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            self.backend, store=store, rank=rank, world_size=world, timeout=seconds(startup_timeout)
        )
        # every rank creates the step group, in the same order: it is itself a collective
        group = dist.new_group(list(range(world)), timeout=seconds(timeout), backend=self.backend)
        if not isinstance(group, dist.ProcessGroup):  # new_group's "not a member" marker: every rank is one
            raise TPError(f"rank {rank} is not a member of its own step group")
        self.group = group
        self.stats = CommStats()
        self.timed = self.device.type == "cpu"
        self.lock = threading.RLock()
        self.closed = False

    # -- collectives of the step group --------------------------------------------------------------
    def _account(self, kind: str, t: torch.Tensor, t0: float) -> None:
        self.stats.add(kind, t.numel() * t.element_size(), time.perf_counter() - t0 if self.timed else 0.0)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns t."""
        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.group)
        self._account("all_reduce", t, t0)
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        t0 = time.perf_counter()
        dist.broadcast(t, src, group=self.group)
        self._account("broadcast", t, t0)
        return t

    def gather(self, t: torch.Tensor, dst: int = 0) -> Optional[list[torch.Tensor]]:
        """Every rank's t (same shape) on rank dst, None elsewhere."""
        t0 = time.perf_counter()
        bufs = [torch.empty_like(t) for _ in range(self.world)] if self.rank == dst else None
        dist.gather(t, bufs, dst=dst, group=self.group)
        self._account("gather", t, t0)
        return bufs

    def startup_barrier(self) -> None:
        """Every rank, once loaded: on the default group, whose timeout is the startup one (a worker
        that is ready first must not time out waiting for rank 0 to finish loading)."""
        dist.barrier()

    def close(self) -> None:
        """Leave the process group (idempotent). After a failed collective the group may be
        unusable: a rank that is about to exit skips this."""
        if self.closed:
            return
        self.closed = True
        if dist.is_initialized():
            dist.destroy_process_group()
