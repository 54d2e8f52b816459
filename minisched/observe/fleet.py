"""Processes of a fleet on one host: `minisched serve` workers and sglang-router, on 127.0.0.1.

Used by benchmarks/serving/bench_fleet.py and tests/serve/test_fleet.py (through tests/helpers/fleet.py).

sglang-router lives in a venv of its own (the project's rule for peers): `make router-env` makes
it at ~/.cache/minisched/sglang-router-venv; `MINISCHED_SGLANG_ROUTER` names another venv's python.
`router_python()` is None when it is not installed.

Every process is started in its own session (`Proc.kill` ends its whole process group), optionally
pinned to a set of CPUs (`cpus`: the process and everything it starts inherit the affinity).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

DEFAULT_ROUTER_VENV = os.path.expanduser("~/.cache/minisched/sglang-router-venv")


class FleetError(RuntimeError):
    """A fleet process did not start, exited, or did not reach the state waited for."""


def router_python() -> Optional[str]:
    py = os.environ.get("MINISCHED_SGLANG_ROUTER") or f"{DEFAULT_ROUTER_VENV}/bin/python"
    if not Path(py).is_file():
        return None
    ok = subprocess.run([py, "-c", "import sglang_router.sglang_router_rs"], capture_output=True, timeout=60)
    return py if ok.returncode == 0 else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen
    log: Path
    cpus: Optional[frozenset[int]] = None
    extra: dict = field(default_factory=dict)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(10)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def spawn(name: str, argv: list[str], port: int, logdir: Path, cpus: Optional[Iterable[int]] = None) -> Proc:
    """Start `argv` in a session of its own, output to logdir/name.log, pinned to `cpus` if given."""
    log = logdir / f"{name}.log"
    pinned = None if cpus is None else frozenset(cpus)
    if pinned is not None and not pinned <= os.sched_getaffinity(0):
        raise FleetError(f"{name}: CPUs {sorted(pinned)} are not all usable here ({sorted(os.sched_getaffinity(0))})")

    def pin() -> None:  # in the child, before exec: what it starts inherits the mask
        if pinned is not None:
            os.sched_setaffinity(0, pinned)

    with open(log, "wb") as out:
        popen = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin if pinned else None
        )
    return Proc(name, f"http://127.0.0.1:{port}", popen, log, pinned)


def start_worker(
    name: str,
    logdir: Path,
    *extra: str,
    model: str = "dummy:tiny",
    served_model_name: str = "tiny",
    cpus: Optional[Iterable[int]] = None,
) -> Proc:
    """`minisched serve` on 127.0.0.1 and a free port; `extra`: more `serve` options."""
    port = free_port()
    argv = [sys.executable, "-m", "minisched", "serve", "--model", model, "--served-model-name", served_model_name]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--grace-period", "1", *extra]
    return spawn(name, argv, port, logdir, cpus)


def start_router(
    py: str,
    worker_urls: list[str],
    policy: str,
    logdir: Path,
    *extra: str,
    name: Optional[str] = None,
    cpus: Optional[Iterable[int]] = None,
) -> Proc:
    """sglang-router with fast health checks: a dead worker is out after ~1-2 s."""
    port = free_port()
    argv = [py, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--worker-urls", *worker_urls, "--policy", policy]
    argv += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
    argv += ["--health-success-threshold", "1", "--health-check-timeout-secs", "1"]
    argv += ["--worker-startup-timeout-secs", "60", "--worker-startup-check-interval", "1", "--log-level", "warn"]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # default 29000: one router only
    return spawn(name or f"router-{policy}", [*argv, *extra], port, logdir, cpus)


def wait_healthy(proc: Proc, timeout: float, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise FleetError(f"{proc.name} exited:\n{proc.text()[-2000:]}")
        if time.monotonic() > deadline:
            raise FleetError(f"{proc.name} did not come up in {timeout:.0f} s:\n{proc.text()[-2000:]}")
        try:
            if httpx.get(proc.url + path, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def router_workers(router: Proc) -> dict[str, dict]:
    """The router's registry: worker url -> its row (`is_healthy`, `model_id`, ...)."""
    rows = httpx.get(router.url + "/workers", timeout=5).json()["workers"]
    return {row["url"]: row for row in rows}


def wait_registered(router: Proc, urls: list[str], timeout: float, healthy: bool = True) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        if not router.alive():
            raise FleetError(f"{router.name} exited:\n{router.text()[-2000:]}")
        try:
            rows = router_workers(router)
        except (httpx.TransportError, KeyError, ValueError):
            rows = {}
        if all(u in rows and rows[u]["is_healthy"] == healthy for u in urls):
            return rows
        if time.monotonic() > deadline:
            raise FleetError(f"workers {urls} not {'healthy' if healthy else 'unhealthy'}: {rows}")
        time.sleep(0.2)


def descendants(pid: int) -> list[int]:
    """pid's children, grandchildren, ... (from /proc; [] where a process is gone)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def pin_process(pid: int, cpus: Iterable[int]) -> None:
    """Move every thread of `pid` (and the threads it starts later) onto `cpus` (`taskset -a -p`)."""
    mask = set(cpus)
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), mask)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def metric_sum(url: str, name: str) -> float:
    """The sum over labels of Prometheus metric `name` at url/metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
