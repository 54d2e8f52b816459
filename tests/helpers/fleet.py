"""Processes for the fleet tests: `minisched serve` workers and sglang-router, on 127.0.0.1.

sglang-router lives in a venv of its own (the project's rule for peers): `make router-env` makes
it at ~/.cache/minisched/sglang-router-venv; `MINISCHED_SGLANG_ROUTER` names another venv's python.
`router_python()` is None when it is not installed (the tests skip with that reason).

Every process is started in its own session and killed with its process group at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

DEFAULT_ROUTER_VENV = os.path.expanduser("~/.cache/minisched/sglang-router-venv")


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


def _spawn(name: str, argv: list[str], port: int, tmp: Path) -> Proc:
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Proc(name, f"http://127.0.0.1:{port}", popen, log)


def start_worker(name: str, tmp: Path, *extra: str) -> Proc:
    """`minisched serve` on dummy:tiny, the engine on a thread of the server (one process to kill)."""
    port = free_port()
    argv = [sys.executable, "-m", "minisched", "serve", "--model", "dummy:tiny", "--served-model-name", "tiny"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--num-pages", "512", "--engine-in-process"]
    argv += ["--grace-period", "1", "--log-level", "info", *extra]
    return _spawn(name, argv, port, tmp)


def start_router(py: str, workers: list[Proc], policy: str, tmp: Path, *extra: str) -> Proc:
    """sglang-router with fast health checks: a dead worker is out after ~1-2 s."""
    port = free_port()
    argv = [py, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--worker-urls", *[w.url for w in workers], "--policy", policy]
    argv += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
    argv += ["--health-success-threshold", "1", "--health-check-timeout-secs", "1"]
    argv += ["--worker-startup-timeout-secs", "60", "--worker-startup-check-interval", "1", "--log-level", "warn"]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # default 29000: one router only
    return _spawn(f"router-{policy}", [*argv, *extra], port, tmp)


def wait_healthy(proc: Proc, timeout: float, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.alive(), f"{proc.name} exited:\n{proc.text()[-2000:]}"
        assert time.monotonic() < deadline, f"{proc.name} did not come up in {timeout:.0f} s:\n{proc.text()[-2000:]}"
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
        assert router.alive(), f"{router.name} exited:\n{router.text()[-2000:]}"
        try:
            rows = router_workers(router)
        except (httpx.TransportError, KeyError, ValueError):
            rows = {}
        if all(u in rows and rows[u]["is_healthy"] == healthy for u in urls):
            return rows
        assert time.monotonic() < deadline, f"workers {urls} not {'healthy' if healthy else 'unhealthy'}: {rows}"
        time.sleep(0.2)


def finished_requests(worker: Proc) -> int:
    """Requests the worker finished, from its /metrics."""
    total = 0.0
    for line in httpx.get(worker.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("minisched_requests_finished_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def gauge(worker: Proc, name: str) -> float:
    for line in httpx.get(worker.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ", 1)[1])
    raise KeyError(name)
