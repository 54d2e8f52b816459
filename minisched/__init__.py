"""minisched: paged-attention and KV-cache kernels with a compact SGLang-style scheduler.

Layers, lowest first (a lower layer never imports an upper one):
  minisched.ops       the kernels' Python faces: wrappers + backend choice, checks, reference, page tables
  minisched.sched     the scheduler: requests, batches, KV pool, radix cache, policies (no torch)
  minisched.model     the Llama model, its weights, tokenizer and sampling
  minisched.engine    scheduler batch -> model inputs, and the engine loop (generate / stream)
  minisched.observe   workloads, run records, traces and reports
  minisched.cli       the `minisched` command

`from minisched import Engine, SamplingParams` works, but nothing heavy (torch, the model) is
imported until one of them is first used, so `import minisched` stays cheap.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

# OpenMP wait policy -- the one environment setting minisched makes, and why it lives here:
# torch's CPU kernels and MKL run on libgomp, which reads OMP_WAIT_POLICY once, when torch is
# first imported, and by default spins on every fork/join barrier. On a machine whose cores are
# shared (another busy process, a laptop), a spinning thread holds a core that the descheduled
# thread it waits for needs, and each parallel region waits a scheduler tick: SmolLM2 decode fell
# tenfold (27 -> 1.9 tok/s) when its kernels still ran on OpenMP. PASSIVE makes idle threads sleep.
# It must be in the environment before torch loads, so it is set on importing this package
# (every entry point -- the CLI, the server, `from minisched import Engine` -- passes here) and
# never overrides a value the user set. If torch was imported before minisched, it has no
# effect; `CPU_WAIT_POLICY_APPLIED` says whether it did. Thread counts are an Engine option
# (`num_threads`), not an environment variable. minisched's own kernels do not use OpenMP's threads:
# their pool (csrc/cpu/thread_pool.h) spins briefly before sleeping and never waits for a thread
# that has not started its share, which is what a decode step's ~150 back-to-back ops need.
CPU_WAIT_POLICY_APPLIED = "torch" not in sys.modules or "OMP_WAIT_POLICY" in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


if TYPE_CHECKING:  # for type checkers and IDEs only; at run time these resolve lazily
    from minisched.engine.engine import Engine, Output, StreamChunk
    from minisched.sched.sampling_params import SamplingParams

__all__ = ["Engine", "Output", "SamplingParams", "StreamChunk", "__version__"]

_LAZY = {
    "Engine": "minisched.engine.engine",
    "Output": "minisched.engine.engine",
    "StreamChunk": "minisched.engine.engine",
    "SamplingParams": "minisched.sched.sampling_params",
}


def __getattr__(name: str):
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("minisched")
        except PackageNotFoundError:  # a source tree that was never installed
            return "0+unknown"
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'minisched' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY) + ["__version__"])
