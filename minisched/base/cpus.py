"""The cores this process may use (layer 0: the engine and the tensor-parallel ranks both size threads by it)."""

from __future__ import annotations

import os

from minisched.base.values import cdiv


def default_num_threads() -> int:
    """CPU threads for the model: the cores this process may run on (its affinity mask, e.g. from
    `taskset` or a cpuset), capped by a cgroup CPU quota (`docker --cpus`) when one is set.
    Not more: with the OpenMP fork/join of torch's kernels, a thread without a core of its own
    stalls every barrier."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, cdiv(int(quota), int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def loadavg() -> str:
    """/proc/loadavg's 1/5/15-minute figures: every benchmark result carries them (machines are shared)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"
