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


def agent(node_rank: int, port: int, argv: list[str], **kw) -> subprocess.Popen:
    """One node's torchrun agent, in a session of its own (so that the whole node can be killed)."""
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
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, **kw)


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
def test_two_nodes_equal_one_process_and_one_node():
    one = subprocess.run([sys.executable, "-m", "minisched", *GEN], capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr
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
    assert tokens(outs[0][0].decode()) == tokens(one.stdout) == tokens(node.stdout)
    assert len(tokens(one.stdout)) == 3
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
