"""Processes for the fleet tests: `minisched serve` workers and sglang-router, on 127.0.0.1.

The process handling lives in minisched/observe/fleet.py (the fleet benchmark uses it too);
`router_python()` is None when sglang-router is not installed (the tests skip with that reason).
Every process is started in its own session and killed with its process group at the end.
"""

from __future__ import annotations

from pathlib import Path

from minisched.observe import fleet
from minisched.observe.fleet import Proc, router_python, router_workers, wait_healthy, wait_registered

__all__ = [
    "Proc",
    "finished_requests",
    "router_python",
    "router_workers",
    "start_router",
    "start_worker",
    "wait_healthy",
    "wait_registered",
]


def start_worker(name: str, tmp: Path, *extra: str) -> Proc:
    """`minisched serve` on dummy:tiny, the engine on a thread of the server (one process to kill)."""
    return fleet.start_worker(name, tmp, "--num-pages", "512", "--engine-in-process", "--log-level", "info", *extra)


def start_router(py: str, workers: list[Proc], policy: str, tmp: Path, *extra: str) -> Proc:
    """sglang-router with fast health checks: a dead worker is out after ~1-2 s."""
    return fleet.start_router(py, [w.url for w in workers], policy, tmp, *extra)


def finished_requests(worker: Proc) -> int:
    """Requests the worker finished, from its /metrics."""
    return int(fleet.metric_sum(worker.url, "minisched_requests_finished_total"))
