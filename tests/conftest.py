"""Runs before any test module: the Triton interpreter switch, and the fixtures shared by every test directory.

Without a GPU, Triton kernels run under the interpreter; TRITON_INTERPRET must be set before
minisched.triton_kernels (triton_kernels/) is imported (decorated), so it is set here, before any test module (and so
any of tests/helpers/) loads. Shared code that is not a fixture lives in tests/helpers/.
"""

from __future__ import annotations

import os

import pytest
import torch

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
