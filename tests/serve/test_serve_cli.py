"""`minisched serve` as a process, with the options' defaults following the options they depend on:
`--max-queued-requests 6` alone (a valid command line before the request bounds existed, refused once they
did: "--max-choices-per-request must be <= --max-queued-requests") serves, with 6 choices per request."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx

from helpers.serve import wait_for

LAUNCH = "import sys\nfrom minisched.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(proc: subprocess.Popen, url: str) -> bool:
    assert proc.poll() is None, f"the server exited with {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}"
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_max_queued_requests_alone_serves_and_bounds_choices_by_it():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["serve", "--max-queued-requests", "6", "--model", "dummy:tiny", "--served-model-name", "tiny"]
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, *argv, "--port", str(port), "--log-level", "warning", "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_for(lambda: healthy(proc, url), 120, "the server to serve")
        assert httpx.get(url + "/server_info", timeout=10).json()["max_queued_requests"] == 6
        body = {"model": "tiny", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200  # 6 choices: fit
        r = httpx.post(url + "/v1/completions", json={**body, "n": 3}, timeout=60)  # 9 choices > the queue
        assert r.status_code == 400 and "--max-choices-per-request" in r.json()["error"]["message"], r.text
        r = httpx.post(url + "/generate", json={"text": ["a"] * 7, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400 and "at most 6" in r.json()["error"]["message"], r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
