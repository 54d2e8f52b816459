"""`ThreadTuner`: picks the model's CPU thread count while serving, by measuring (the Engine's default,
`num_threads=None`); it starts at the usable cores (base/cpus.py)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Optional

import torch


def size_class(tokens: int) -> int:
    """The step-size class of a step of `tokens` tokens: steps whose counts share a power of two (1, 2-3,
    4-7, ..., 512-1023) share a thread count."""
    return max(1, tokens).bit_length()


@dataclass
class Probe:
    """A probe of `candidate` threads: its steps come in pairs with steps at the current count (`base`),
    so both see the same neighbours on the machine (ThreadTuner). Which comes first in a pair is drawn
    (`candidate_first`; the first pair's candidate leads): a strict alternation would put every
    candidate step in the same phase of a neighbour that itself alternates step by step."""

    candidate: int
    candidate_first: list[bool]  # per pair
    got: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) at the candidate
    base: list[tuple[int, float]] = field(default_factory=list)  # the paired steps at the current count

    @property
    def candidate_next(self) -> bool:
        done = len(self.got) + len(self.base)
        return self.candidate_first[done // 2] == (done % 2 == 0)


class _SizeClass:
    """One step-size class's thread count and probe state (ThreadTuner)."""

    def __init__(self, max_threads: int, next_probe: float):
        self.current = max_threads
        self.recent: list[tuple[int, float]] = []  # (tokens, seconds) of the last steps at `current`
        self.probe: Optional[Probe] = None
        self.next_probe = next_probe
        self.go_down = True
        self.backoff = 1  # probe interval multiplier: doubles while probes lose, back to 1 on a switch


class ThreadTuner:
    """Picks the CPU thread count while serving, by measuring (the Engine's default, num_threads=None).

    Each step-size class (size_class: token counts within a power of two) has its own count, since the
    best one depends on the step: a 1-token decode step is a few hundred small kernels, each a fork/join
    that costs more than its work on a busy machine, a 512-token prefill is long matmuls that want every
    core. (One shared count let a probe won by a run of decode steps carry over to the prefill that
    followed: the same command prefilled at half speed in one run and full speed in the next.)

    Within a class, every `interval` seconds, when the last steps and the next one are of a similar
    size, it runs `probe_steps` steps at a candidate count -- half or double the current one,
    alternately, within [1, max_threads] -- each followed by a step at the current count, and keeps
    the candidate if its steps were `margin` faster than those paired steps (token counts within
    1.5x; otherwise the probe is void). Pairing is what makes the comparison fair when the machine's
    load changes by the second: served, the HTTP process beside the engine works in bursts, and a
    probe compared with the steps before it (as this tuner first did) could win only because the
    burst had ended, leaving the server at 1 thread and 0.83-0.85x offline speed. While probes lose, the interval doubles, up to 8x, and the next
    probe waits at least `cost_factor` times as long as the last one took, so probing costs at most
    ~1/cost_factor of the time even when steps are long (three 1-second 512-token prefills at the wrong
    count every 3 s cost a third of prefill throughput); a probe step 1.5x slower than the current
    count's mean ends the probe at once. Steps that take longer than `max_probe_seconds` (a long
    prefill) are never probed: one probe step at half the threads would be a whole request's
    prefill at half speed, and long matmuls lose little to a busy core (each barrier waits once per
    kernel, not once per microsecond of work). On a quiet machine all cores win; when other processes take
    cores, fork/join barriers wait for descheduled threads and fewer threads win -- 3x at batch 8 with
    one busy process on 2 cores (benchmarks/RESULTS.md, "CPU threads"). Thread counts do not change the
    model's numbers (the kernels split work by rows, not by sums; tests/engine checks it)."""

    def __init__(
        self,
        max_threads: int,
        interval: float = 3.0,
        probe_steps: int = 3,
        margin: float = 0.1,
        cost_factor: float = 20.0,
        max_probe_seconds: float = 0.25,
    ):
        self.max_threads = max_threads
        self.interval, self.probe_steps, self.margin = interval, probe_steps, margin
        self.cost_factor, self.max_probe_seconds = cost_factor, max_probe_seconds
        self.classes: dict[int, _SizeClass] = {}
        self.switches = 0
        self.rng = random.Random(0)  # the pairs' order (thread counts never change the model's numbers)
        self.threads = max_threads  # the count set now
        torch.set_num_threads(max_threads)

    def state(self, tokens: int) -> _SizeClass:
        """The class of a `tokens`-token step (a new class starts at max_threads)."""
        key = size_class(tokens)
        if key not in self.classes:
            self.classes[key] = _SizeClass(self.max_threads, time.monotonic() + self.interval)
        return self.classes[key]

    def _use(self, n: int) -> None:
        if n != self.threads:
            torch.set_num_threads(n)
            self.threads = n

    def before_step(self, tokens: int) -> None:
        c = self.state(tokens)
        sizes = [t for t, _ in c.recent]
        if (
            c.probe is None
            and time.monotonic() >= c.next_probe
            and len(c.recent) >= self.probe_steps
            and max(sizes + [tokens]) <= 1.5 * max(1, min(sizes + [tokens]))
            and sum(sec for _, sec in c.recent) <= self.max_probe_seconds * len(c.recent)
        ):  # steady, short steps only
            cand = max(1, c.current // 2) if c.go_down else min(self.max_threads, c.current * 2)
            if cand == c.current:  # at a bound: try the other way
                c.go_down = not c.go_down
                cand = max(1, c.current // 2) if c.go_down else min(self.max_threads, c.current * 2)
            if cand != c.current:
                first = [True] + [self.rng.random() < 0.5 for _ in range(self.probe_steps - 1)]
                c.probe = Probe(cand, first)
        self._use(c.probe.candidate if c.probe is not None and c.probe.candidate_next else c.current)

    def after_step(self, tokens: int, seconds: float) -> None:
        c = self.state(tokens)
        if c.probe is None:
            c.recent = (c.recent + [(tokens, seconds)])[-self.probe_steps :]
            return
        probe = c.probe
        clear_loss = False
        if probe.candidate_next:
            probe.got.append((tokens, seconds))
            # a clearly losing probe ends after one step (1.5x slower than the current count's mean)
            clear_loss = seconds > 1.5 * sum(s for _, s in c.recent) / max(1, len(c.recent))
        else:
            probe.base.append((tokens, seconds))
            c.recent = (c.recent + [(tokens, seconds)])[-self.probe_steps :]
        if len(probe.got) + len(probe.base) < 2 * self.probe_steps and not clear_loss:
            return
        c.probe = None
        c.go_down = not c.go_down
        got, base = probe.got, probe.base or c.recent
        sizes = [t for t, _ in got + base]
        similar = max(sizes) <= 1.5 * max(1, min(sizes))
        mean = lambda steps: sum(s for _, s in steps) / len(steps)
        if similar and not clear_loss and mean(got) < (1 - self.margin) * mean(base):
            c.current = probe.candidate
            c.recent = got
            self.switches += 1
            c.backoff = 1
        elif similar:  # the current count held: probe less often (up to 8x the interval)
            c.backoff = min(8, c.backoff * 2)
        probe_time = sum(s for _, s in got)
        c.next_probe = time.monotonic() + max(self.interval * c.backoff, self.cost_factor * probe_time)
        self._use(c.current)
