"""`--tp N` from the command line: validation, the same output as one process (spawned ranks and
torchrun), and failures -- a worker killed or frozen mid-generation makes rank 0 exit with a
clear error within a bounded time, and no process is left behind.

Runs of the CLI with --tp > 1 are subprocesses (they spawn ranks and stop them at exit); every
wait here is bounded."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from minisched.cli import main

TINY = ["--model", "dummy:tiny", "--threads", "1"]
GEN = [
    "generate",
    *TINY,
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


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--tp", "0"], "--tp must be an int >= 1, got 0"),
        (["--tp", "3"], "--tp 3 must divide the model's 2 query heads"),
        (["--tp", "2", "--tp-timeout", "0"], "--tp-timeout must be > 0"),
    ],
)
def test_bad_tp_options_are_one_line_errors(capsys, argv, needle):
    rc, out, err = run(["generate", *TINY, *argv, "x"], capsys)
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def tokens(stdout: str) -> list:
    return [json.loads(line)["token_ids"] for line in stdout.splitlines() if line.startswith("{")]


def minisched(*argv, timeout=240, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=timeout, **kw)


def test_generate_tp2_equals_tp1(capsys):
    rc, out, _ = run(GEN, capsys)
    assert rc == 0
    tp2 = minisched("minisched", *GEN, "--tp", "2")
    assert tp2.returncode == 0, tp2.stderr
    assert tokens(tp2.stdout) == tokens(out) and len(tokens(out)) == 3


@pytest.mark.slow
def test_torchrun_runs_the_same_entry_point(capsys):
    rc, out, _ = run(GEN, capsys)
    tr = minisched(
        "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "minisched", *GEN, "--tp", "2"
    )
    assert tr.returncode == 0, tr.stderr
    assert tokens(tr.stdout) == tokens(out)  # rank 1 printed nothing: it ran the worker loop


def workers_of(pid: int) -> list[int]:
    """The spawned ranks among pid's children (not multiprocessing's resource tracker)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                try:
                    with open(f"/proc/{child}/cmdline", "rb") as c:
                        if b"spawn_main" in c.read():
                            out.append(int(child))
                except OSError:
                    pass
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_dead_or_frozen_worker_ends_rank_0_with_a_clear_error(how):
    """SIGKILL: the peer's socket closes, rank 0 fails at once (the monitor names the signal).
    SIGSTOP: the next collective times out after --tp-timeout seconds."""
    argv = [
        "generate",
        *TINY,
        "--tp",
        "2",
        "--tp-timeout",
        "3",
        "--max-new-tokens",
        "1900",
        "--ignore-eos",
        "--stream",
        "Once upon a time",
    ]
    p = subprocess.Popen([sys.executable, "-m", "minisched", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    worker = None
    try:
        ready, _, _ = select.select([p.stdout], [], [], 180)
        assert ready and os.read(p.stdout.fileno(), 1), "no token within 180 s"
        workers = workers_of(p.pid)
        assert len(workers) == 1, workers
        worker = workers[0]
        os.kill(worker, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        if worker is not None and alive(worker):
            os.kill(worker, signal.SIGKILL)
    err = err.decode()
    assert p.returncode == 1, err
    if how == "kill":
        assert f"tensor parallelism failed: worker rank 1 (pid {worker}) was killed by signal SIGKILL" in err, err
        assert elapsed < 15
    else:
        assert "tensor parallelism failed: a collective did not complete within 3 s" in err, err
        assert elapsed < 3 + 15
    assert "Traceback" not in err, err
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:  # rank 0 killed the frozen worker on its way out
        time.sleep(0.1)
    assert not alive(worker)
