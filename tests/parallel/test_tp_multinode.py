"""Multi-node tensor parallelism, proven on one host: two `torchrun` agents, one per "node"
(`--nnodes 2 --nproc-per-node 1 --node-rank {0,1}`), meeting through a real rendezvous (node 0's
agent hosts the TCP store on a loopback port; node 1 connects to it as a remote node would).

The two-node run gives the same greedy tokens as one process and as `--tp 2` on one node; killing
one node's agent (and its worker, as losing a machine would) ends the other with a clear error
within a bounded time, never a hang. Every wait here is bounded; every process is killed at the end."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

GEN = [
    "generate",
    "--model",
    "dummy:tiny",
    "--threads",
    "1",
    "--ignore-eos",
    "--json",
    "--no-progress",
    "--max-new-tokens",
    "12",
    "--page-size",
    "4",
    "--chunk-size",
    "5",
    "Hello there",
    "A longer prompt, chunked over a few steps",
    "x",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokens(stdout: str) -> list:
    return [json.loads(line)["token_ids"] for line in stdout.splitlines() if line.startswith("{")]


def agent(node_rank: int, port: int, argv: list[str], log=None) -> subprocess.Popen:
    """One node's torchrun agent, in a session of its own (so that the whole node can be killed);
    its output to pipes, or to the file `log` (a server that runs a while must not fill a pipe)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--node-rank",
        str(node_rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--max-restarts",
        "0",
        "-m",
        "minisched",
        *argv,
    ]
    if log is not None:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def one_process(argv: list[str], capsys) -> list:
    """The token ids `minisched generate --json` prints, run in this process (one process, no --tp: nothing is
    spawned, and no interpreter start to wait for); torch's thread count is put back afterwards."""
    import torch

    from minisched.cli import main

    threads = torch.get_num_threads()
    try:
        rc = main(argv)
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    assert rc == 0, err
    return tokens(out)


def descendants(pid: int) -> list[int]:
    """pid's children, grandchildren, ... (torchrun starts its workers in sessions of their own)."""
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


def kill_node(p: subprocess.Popen) -> None:
    """SIGKILL to the agent and everything it started, as losing the machine would."""
    for pid in [p.pid, *descendants(p.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(10)


@pytest.mark.slow
def test_two_nodes_equal_one_process_and_one_node(capsys):
    one = one_process(GEN, capsys)
    node = subprocess.run(
        [sys.executable, "-m", "minisched", *GEN, "--tp", "2"], capture_output=True, text=True, timeout=240
    )
    assert node.returncode == 0, node.stderr
    port = free_port()
    nodes = [agent(r, port, [*GEN, "--tp", "2"]) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=300) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                kill_node(p)
    assert [p.returncode for p in nodes] == [0, 0], [e.decode()[-2000:] for _, e in outs]
    assert tokens(outs[0][0].decode()) == one == tokens(node.stdout)
    assert len(one) == 3
    assert tokens(outs[1][0].decode()) == []  # node 1's rank ran the worker loop, printed nothing


@pytest.mark.slow
def test_losing_a_node_ends_the_other_with_a_clear_error():
    argv = [
        "generate",
        "--model",
        "dummy:tiny",
        "--threads",
        "1",
        "--tp",
        "2",
        "--tp-timeout",
        "5",
        "--max-new-tokens",
        "1900",
        "--ignore-eos",
        "--stream",
        "Once upon a time",
    ]
    port = free_port()
    head, other = agent(0, port, argv), agent(1, port, argv)
    try:
        ready, _, _ = select.select([head.stdout], [], [], 240)
        assert ready and os.read(head.stdout.fileno(), 1), "no token within 240 s"
        kill_node(other)  # the machine of node 1 is gone: its agent and its rank
        t0 = time.monotonic()
        _, err = head.communicate(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        for p in (head, other):
            if p.poll() is None:
                kill_node(p)
    err = err.decode()
    assert head.returncode != 0, err
    assert "minisched: request prompt 0: TPError: tensor parallelism failed" in err, err[-3000:]
    assert elapsed < 60, elapsed


def wait_for(cond, timeout: float, what: str, procs=(), logs=()):
    """Poll `cond()` (a value, or None / False to go on) until `timeout`; a process of `procs` that exits fails."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: an agent exited ({p.returncode}):\n{tails(logs)}")
        try:
            got = cond()
        except httpx.TransportError:
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s\n{tails(logs)}"
        time.sleep(0.2)


def tails(logs) -> str:
    return "\n".join(f"--- {p.name}:\n{p.read_text(errors='replace')[-2500:]}" for p in logs)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_serve_on_two_nodes_then_losing_one(tmp_path, capsys):
    """`minisched serve --tp 2` on two torchrun agents: rank 0 serves HTTP, its greedy completion equals one
    process's; node 1 lost -> the server says why and ends (exit status 1), within seconds."""
    prompt, n = "Hello there", 12
    gen = ["generate", "--model", "dummy:tiny", "--threads", "1", "--ignore-eos", "--json", "--no-progress"]
    (want,) = one_process([*gen, "--max-new-tokens", str(n), prompt], capsys)
    http = free_port()
    argv = ["serve", "--model", "dummy:tiny", "--served-model-name", "tiny", "--threads", "1", "--tp", "2"]
    argv += ["--tp-timeout", "5", "--port", str(http), "--grace-period", "1", "--log-level", "warning"]
    url = f"http://127.0.0.1:{http}"
    port = free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    files = [open(f, "wb") for f in logs]
    head, other = agent(0, port, argv, files[0]), agent(1, port, argv, files[1])
    try:
        ok = lambda: httpx.get(url + "/health", timeout=2).status_code == 200  # noqa: E731
        wait_for(ok, 60, "/health 200", (head, other), logs)
        body = {"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        got = httpx.post(url + "/generate", json=body, timeout=30)
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == want  # the two nodes' answer is one process's
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n, r.text

        kill_node(other)  # node 1's machine is gone: the idle server's heartbeat finds it out
        t0 = time.monotonic()
        head.wait(45)  # rank 0 ends on its own, and its agent with it
        elapsed = time.monotonic() - t0
    finally:
        for p in (head, other):
            if p.poll() is None:
                kill_node(p)
        for f in files:
            f.close()
    log = logs[0].read_text(errors="replace")
    assert head.returncode not in (None, 0), tails(logs)
    assert "minisched serve: error: tensor parallelism failed" in log, tails(logs)
    assert elapsed < 30, elapsed
