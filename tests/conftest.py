"""Runs before any test module: the OpenMP wait policy, the Triton interpreter switch, and the fixtures shared by
every test directory.

minisched sets OMP_WAIT_POLICY=PASSIVE when it is imported, which works only before torch loads (minisched/__init__.py:
spinning OpenMP threads on shared cores made SmolLM2 decode tenfold slower). Every entry point of minisched passes
there first; the test process must too, so minisched is imported here before torch. (Imported after it, the test
process alone spun: on this 2-core machine, beside the suite's own servers and engine processes or anyone else's
load, small-op tests ran 20-40x slower: test_verify_drafts_keeps_the_target_distribution 64 s instead of 1.3 s.)

Without a GPU, Triton kernels run under the interpreter; TRITON_INTERPRET must be set before
minisched.triton_kernels (triton_kernels/) is imported (decorated), so it is set here, before any test module (and so
any of tests/helpers/) loads. Shared code that is not a fixture lives in tests/helpers/.
"""

from __future__ import annotations

import os
import warnings

import pytest

import minisched

if not minisched.CPU_WAIT_POLICY_APPLIED:  # a plugin loaded torch first: the tests still run, slower on busy cores
    warnings.warn("torch was imported before minisched: OMP_WAIT_POLICY=PASSIVE came too late", stacklevel=1)

import torch  # noqa: E402  (after minisched: see above)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _cpu_isa(request):
    """A test marked `cpu_isa(name)` (helpers.targets.cpu_backends) runs the CPU kernels as that variant."""
    mark = request.node.get_closest_marker("cpu_isa")
    if mark is None:
        yield
        return
    from minisched import ops

    with ops.use_cpu_isa(mark.args[0]):
        yield


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
