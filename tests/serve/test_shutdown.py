"""`minisched serve` as a process: SIGTERM with requests in flight. The listener closes, a short
request finishes within the grace period, a long one is aborted when it ends (its stream still
ends with finish_reason "abort" and [DONE]), and the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

# the subcommand through its own module, so the test does not depend on the CLI's wiring
LAUNCH = (
    "import argparse, sys\n"
    "from minisched.cli.serve import add_parser, cmd_serve\n"
    "p = argparse.ArgumentParser(); add_parser(p.add_subparsers(dest='command'))\n"
    "sys.exit(cmd_serve(p.parse_args(sys.argv[1:])))\n"
)


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(url: str, max_tokens: int, out: dict, started: threading.Event) -> None:
    body = {
        "model": "m",
        "prompt": "shutdown",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    reasons, events = [], []
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if line != "data: [DONE]":
                reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])
            started.set()
    out.update(reasons=reasons, last=events[-1] if events else None, chunks=len(reasons))


def test_sigterm_drains_then_aborts_and_exits_0():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # a 135M-parameter random model on one thread: ~0.1 s per token, so the long request outlives the grace
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCH,
            "serve",
            "--model",
            "dummy:smollm2-135m",
            "--served-model-name",
            "m",
            "--num-pages",
            "128",
            "--threads",
            "1",
            "--port",
            str(port),
            "--grace-period",
            "4",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_until_healthy(proc, url, 90)
        short, long_ = {}, {}
        s1, s2 = threading.Event(), threading.Event()
        threads = [
            threading.Thread(target=stream, args=(url, 6, short, s1)),
            threading.Thread(target=stream, args=(url, 2000, long_, s2)),
        ]
        for t in threads:
            t.start()
        assert s1.wait(60) and s2.wait(60), "the streams did not start"
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:  # the listener is closed: new connections are refused
            refused = httpx.get(url + "/health", timeout=2).status_code == 503
        except httpx.TransportError:
            refused = True
        assert refused
        for t in threads:
            t.join(30)
        rc = proc.wait(30)
        took = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stdout.read()
    assert rc == 0, log
    assert short["reasons"][-1] == "length" and short["last"] == "data: [DONE]"
    assert long_["reasons"][-1] == "abort" and long_["last"] == "data: [DONE]", long_
    assert long_["chunks"] < 2000
    assert 3.5 < took < 20, took


def test_ctrl_c_with_a_stream_in_flight_exits_0():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCH,
            "serve",
            "--model",
            "dummy:tiny",
            "--served-model-name",
            "m",
            "--num-pages",
            "64",
            "--port",
            str(port),
            "--grace-period",
            "0",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until_healthy(proc, url, 60)
        out, started = {}, threading.Event()
        t = threading.Thread(target=stream, args=(url, 1000, out, started))
        t.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        t.join(30)
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, proc.stdout.read()
    assert out["last"] == "data: [DONE]" and out["reasons"][-1] in ("abort", "length")
