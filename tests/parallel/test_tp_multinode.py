"""Tensor parallelism across "nodes": two torchrun agents on one host, `--nnodes 2
--nproc-per-node 1 --node-rank {0,1}`, meeting at a real rendezvous (torchrun's static one: a
TCPStore at --master-addr:--master-port that agent 0 hosts). The greedy tokens equal one
process's (and so `--tp 2` on one node's: test_tp_cli.py); one agent killed mid-run -> the other
ends with the clear error, no hang, no process left."""

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

from minisched.cli import main

TINY = ["--model", "dummy:tiny", "--threads", "1"]
GEN = ["generate", *TINY, "--ignore-eos", "--json", "--no-progress", "--max-new-tokens", "12", "--page-size", "4"]
PROMPTS = ["Hello there", "A longer prompt, over a few pages", "x"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(node_rank: int, port: int, argv: list[str], **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    cmd += ["--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmd += ["--max-restarts", "0", "-m", "minisched", *argv, "--tp", "2"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, **kw)


def descendants(pid: int) -> list[int]:
    out, stack = [], [pid]
    while stack:
        cur = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{cur}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{cur}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                kids = []
            out += kids
            stack += kids
    return out


def kill_node(p: subprocess.Popen) -> None:
    """The agent and every process under it (torchrun starts its ranks in sessions of their own,
    so killing the agent's group alone leaves its rank running: a lost node takes both)."""
    for pid in [p.pid, *descendants(p.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(10)


def tokens(stdout: str) -> list:
    return [json.loads(line)["token_ids"] for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_agents_give_the_tokens_of_one_process(capsys):
    assert main([*GEN, *PROMPTS]) == 0
    want = tokens(capsys.readouterr().out)
    port = free_port()
    agents = [agent(r, port, [*GEN, *PROMPTS], text=True) for r in (0, 1)]
    try:
        outs = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            kill_node(a)
    for a, (_, err) in zip(agents, outs):
        assert a.returncode == 0, err[-3000:]
    assert tokens(outs[0][0]) == want and len(want) == 3
    assert tokens(outs[1][0]) == []  # node 1's rank ran the worker loop: it printed nothing


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_agent_killed_ends_the_other_with_a_clear_error():
    argv = ["generate", *TINY, "--tp-timeout", "5", "--max-new-tokens", "1900", "--ignore-eos", "--stream"]
    port = free_port()
    agents = [agent(r, port, [*argv, "Once upon a time"]) for r in (0, 1)]
    try:
        ready, _, _ = select.select([agents[0].stdout], [], [], 180)
        assert ready and os.read(agents[0].stdout.fileno(), 1), "no token within 180 s"
        rank1 = descendants(agents[1].pid)
        assert rank1, "node 1's rank is not running"
        kill_node(agents[1])  # node 1 gone: its agent and its rank
        t0 = time.monotonic()
        _, err = agents[0].communicate(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        for a in agents:
            kill_node(a)
    err = err.decode(errors="replace")
    assert agents[0].returncode != 0
    assert "tensor parallelism failed" in err, err[-3000:]
    assert elapsed < 5 + 30, elapsed
    assert not any(os.path.exists(f"/proc/{pid}") and _running(pid) for pid in rank1)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
