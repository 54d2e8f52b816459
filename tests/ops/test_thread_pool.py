"""The CPU kernels' thread pool (csrc/cpu/thread_pool.h): its spin setting, the ops' bits under every wait
policy and thread count, ops called from several Python threads at once, and a C++ stress program for
the paths no kernel reaches (an exception inside a chunk, nested calls, racing callers, fork)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import pytest
import torch

from minisched import ops
from minisched.ops import reference

pytestmark = pytest.mark.skipif(not ops.native_available(), reason=str(ops.NATIVE_ERROR))

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def spin():
    before = ops.cpu_spin_us()
    yield
    ops.set_cpu_spin_us(before)


def test_spin_setting(spin):
    assert ops.cpu_spin_us() == 50  # the default (kDefaultSpinUs)
    assert ops.set_cpu_spin_us(0) == 50 and ops.cpu_spin_us() == 0
    assert ops.set_cpu_spin_us(200) == 0 and ops.cpu_spin_us() == 200
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="non-negative number of microseconds"):
            ops.set_cpu_spin_us(bad)
    assert ops.cpu_spin_us() == 200


@pytest.mark.parametrize("spin_us", [0, 50])
def test_bits_do_not_depend_on_threads_or_spin(spin, spin_us, gen):
    """Chunks go to whichever thread is free, so the same call is run by different threads each time:
    the outputs must not move by a bit (each output is computed whole by one chunk)."""
    ops.set_cpu_spin_us(spin_us)
    x = torch.randn(37, 96, generator=gen)
    w = ops.pack_linear_weight(torch.randn(200, 96, generator=gen))
    q = torch.randn(64, 96, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want_lin = ops.packed_linear(x, w, 200)
        want_norm = ops.rms_norm(q, torch.ones(96), 1e-6)
        for threads in (2, 3, 4, 2):
            torch.set_num_threads(threads)
            for _ in range(20):
                assert torch.equal(ops.packed_linear(x, w, 200), want_lin)
                assert torch.equal(ops.rms_norm(q, torch.ones(96), 1e-6), want_norm)
    finally:
        torch.set_num_threads(before)
    expected = torch.empty(37, 200)
    reference.packed_linear(x, w, expected)
    torch.testing.assert_close(want_lin, expected, rtol=1e-5, atol=1e-5)


def test_ops_from_several_python_threads(gen):
    """One caller gets the pool and the others run serially on their own thread; every result is right."""
    x = torch.randn(64, 128, generator=gen)
    ws = [ops.pack_linear_weight(torch.randn(256, 128, generator=gen)) for _ in range(4)]
    wants = [ops.packed_linear(x, w, 256) for w in ws]
    errors: list[str] = []

    def call(i: int) -> None:
        for _ in range(50):
            if not torch.equal(ops.packed_linear(x, ws[i], 256), wants[i]):
                errors.append(f"thread {i}")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and errors == []


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the stress program")
def test_stress_program(tmp_path):
    tdir = os.path.dirname(torch.__file__)
    exe = tmp_path / "thread_pool_stress"
    build = [
        "g++", "-O2", "-std=c++20", "-fopenmp",
        f"-I{ROOT}/csrc", f"-I{tdir}/include", f"-I{tdir}/include/torch/csrc/api/include",
        f"{ROOT}/tests/ops/thread_pool_stress.cpp", f"{ROOT}/csrc/cpu/thread_pool.cpp",
        f"-L{tdir}/lib", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{tdir}/lib", "-o", str(exe),
    ]  # fmt: skip
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
