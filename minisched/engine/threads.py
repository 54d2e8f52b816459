"""CPU threads for the model: how many the process may use, and `ThreadTuner`, which picks the count
while serving by measuring (the Engine's default, `num_threads=None`)."""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

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


class ThreadTuner:
    """Picks the CPU thread count while serving, by measuring (the Engine's default, num_threads=None).

    Every `interval` seconds, when the last steps and the next one are of a similar size, it runs
    `probe_steps` steps at a candidate count -- half or double
    the current one, alternately, within [1, max_threads] -- and keeps the candidate if those
    steps were `margin` faster than the current count's last `probe_steps` steps of a similar
    size (token counts within 1.5x; otherwise the probe is void); while probes lose, the interval
    doubles, up to 8x, and the next probe waits at least `cost_factor` times as long as the last
    one took, so probing costs at most ~1/cost_factor of the time even when steps are long (three
    1-second 512-token prefills at the wrong count every 3 s cost a third of prefill throughput);
    a probe step 1.5x slower than the current count's mean ends the probe at once. On a quiet machine all cores win; when other processes take cores,
    fork/join barriers wait for descheduled threads and fewer threads win -- 3x at batch 8 with
    one busy process on 2 cores (benchmarks/RESULTS.md, "CPU threads"). Thread counts do not change the model's numbers
    (the kernels split work by rows, not by sums; tests/engine checks it)."""

    def __init__(
        self,
        max_threads: int,
        interval: float = 3.0,
        probe_steps: int = 3,
        margin: float = 0.1,
        cost_factor: float = 20.0,
    ):
        self.max_threads = max_threads
        self.current = max_threads
        self.interval, self.probe_steps, self.margin = interval, probe_steps, margin
        self.cost_factor = cost_factor
        self.recent: list[tuple[int, float]] = []  # (tokens, seconds) of the last steps at `current`
        self.probe: Optional[tuple[int, list[tuple[int, float]]]] = None
        self.next_probe = time.monotonic() + interval
        self.go_down = True
        self.backoff = 1  # probe interval multiplier: doubles while probes lose, back to 1 on a switch
        self.switches = 0
        torch.set_num_threads(self.current)

    def before_step(self, tokens: int) -> None:
        sizes = [t for t, _ in self.recent]
        if (
            self.probe is None
            and time.monotonic() >= self.next_probe
            and len(self.recent) >= self.probe_steps
            and max(sizes + [tokens]) <= 1.5 * max(1, min(sizes + [tokens]))
        ):  # steady steps only
            cand = max(1, self.current // 2) if self.go_down else min(self.max_threads, self.current * 2)
            if cand == self.current:  # at a bound: try the other way
                self.go_down = not self.go_down
                cand = max(1, self.current // 2) if self.go_down else min(self.max_threads, self.current * 2)
            if cand != self.current:
                self.probe = (cand, [])
                torch.set_num_threads(cand)

    def after_step(self, tokens: int, seconds: float) -> None:
        if self.probe is None:
            self.recent = (self.recent + [(tokens, seconds)])[-self.probe_steps :]
            return
        cand, got = self.probe
        got.append((tokens, seconds))
        # a clearly losing probe ends after one step (1.5x slower than the current count's mean)
        clear_loss = seconds > 1.5 * sum(s for _, s in self.recent) / max(1, len(self.recent))
        if len(got) < self.probe_steps and not clear_loss:
            return
        self.probe = None
        self.go_down = not self.go_down
        sizes = [t for t, _ in got + self.recent]
        similar = max(sizes) <= 1.5 * max(1, min(sizes))
        mean = lambda steps: sum(s for _, s in steps) / len(steps)
        if similar and mean(got) < (1 - self.margin) * mean(self.recent):
            self.current = cand
            self.recent = got
            self.switches += 1
            self.backoff = 1
        elif similar:  # the current count held: probe less often (up to 8x the interval)
            self.backoff = min(8, self.backoff * 2)
        probe_time = sum(s for _, s in got)
        self.next_probe = time.monotonic() + max(self.interval * self.backoff, self.cost_factor * probe_time)
        torch.set_num_threads(self.current)
