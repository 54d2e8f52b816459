"""minisched/observe/fleet.py's process handling without a router: CPU pinning at start and after,
a whole process tree killed, a process that exits reported with its output."""

from __future__ import annotations

import os
import sys
import time

import pytest

from minisched.observe import fleet

CPUS = sorted(os.sched_getaffinity(0))


def allowed(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


@pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 usable CPUs")
def test_pinned_at_start_and_repinned_with_every_thread(tmp_path):
    code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"
    p = fleet.spawn("pinned", [sys.executable, "-c", code], 0, tmp_path, cpus=[CPUS[1]])
    try:
        assert allowed(p.popen.pid) == {CPUS[1]}
        while len(os.listdir(f"/proc/{p.popen.pid}/task")) < 2:  # the second thread has started
            assert p.alive(), p.text()
            time.sleep(0.01)
        fleet.pin_process(p.popen.pid, [CPUS[0]])
        tasks = [int(t) for t in os.listdir(f"/proc/{p.popen.pid}/task")]
        assert len(tasks) == 2 and all(allowed(t) == {CPUS[0]} for t in tasks)
    finally:
        p.kill()
    assert not p.alive()


def test_kill_ends_the_process_group_and_bad_cpus_are_refused(tmp_path):
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    p = fleet.spawn("tree", [sys.executable, "-c", code], 0, tmp_path)
    try:
        while not fleet.descendants(p.popen.pid):
            assert p.alive(), p.text()
            time.sleep(0.01)
        (child,) = fleet.descendants(p.popen.pid)
    finally:
        p.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the child was SIGKILLed with its group (then reaped by init)
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.01)
    else:
        pytest.fail(f"child {child} outlived its group")
    with pytest.raises(fleet.FleetError, match="not all usable"):
        fleet.spawn("nope", [sys.executable, "-c", "pass"], 0, tmp_path, cpus=[max(CPUS) + 1000])


def test_a_worker_that_exits_is_reported_with_its_output(tmp_path):
    p = fleet.spawn("dies", [sys.executable, "-c", "print('the reason'); raise SystemExit(3)"], 1, tmp_path)
    with pytest.raises(fleet.FleetError, match="(?s)dies exited.*the reason"):
        fleet.wait_healthy(p, 30)
