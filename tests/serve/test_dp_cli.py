"""`minisched serve --dp 2` as a process: it starts two replicas, serves, and on SIGTERM to its whole
process group (as `timeout` or a terminal sends) drains, stops the replicas and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from minisched.cli import main

LAUNCH = (
    "import argparse, sys\n"
    "from minisched.cli.serve import add_parser, cmd_serve\n"
    "p = argparse.ArgumentParser(); add_parser(p.add_subparsers(dest='command'))\n"
    "sys.exit(cmd_serve(p.parse_args(sys.argv[1:])))\n"
)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dp", "0"], "--dp must be >= 1"),
        (["--dp", "2", "--router-cache-threshold", "2"], "--router-cache-threshold must be in [0, 1]"),
        (["--dp", "2", "--tp", "2"], "--dp with --tp"),
    ],
)
def test_bad_dp_options_are_one_line_errors(argv, message, capsys):
    assert main(["serve", "--model", "dummy:tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("minisched: error:") and message in err and "\n" not in err


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


@pytest.mark.slow  # three Python processes importing torch: ~20 s on a busy 2-core machine
def test_dp_server_process_serves_and_stops_its_replicas_on_sigterm():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCH,
            "serve",
            "--dp",
            "2",
            "--router",
            "round-robin",
            "--model",
            "dummy:tiny",
            "--num-pages",
            "64",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        start_new_session=True,
    )
    replicas = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        health = httpx.get(url + "/health", timeout=10).json()
        replicas = [r["pid"] for r in health["replicas"]]
        assert health["status"] == "ok" and len(replicas) == 2 and set(replicas) <= set(_children(proc.pid))
        for _ in range(2):  # round-robin: one request on each replica
            r = httpx.post(
                url + "/v1/completions",
                timeout=30,
                json={"model": "dummy:tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0},
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert [x["finished"] for x in httpx.get(url + "/health", timeout=10).json()["replicas"]] == [1, 1]
        os.killpg(proc.pid, signal.SIGTERM)  # the replicas get it too, and ignore it: the server stops them
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{p}") and _alive(p) for p in replicas) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{p}") and _alive(p) for p in replicas)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for p in replicas:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False
