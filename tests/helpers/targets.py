"""The (backend, device, dtype) targets every op test runs over, and small tensor helpers.

`targets(family)` imports the Triton kernels (ops.triton_launchers; to skip what cannot run): call it from test
modules only, which load after tests/conftest.py has set TRITON_INTERPRET on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from minisched import ops

HAS_CUDA = torch.cuda.is_available()
CPU_ISAS: list[str] = ops.supported_cpu_isas() if ops.native_available() else []


@dataclass(frozen=True)
class Target:
    backend: str
    device: str
    dtype: torch.dtype
    isa: str | None = None  # native CPU kernels: the ISA variant (ops.use_cpu_isa; None: the default)

    @property
    def id(self) -> str:
        isa = f"-{self.isa}" if self.isa else ""
        return f"{self.backend}-{self.device}{isa}-{str(self.dtype).removeprefix('torch.')}"

    @property
    def interpreted(self) -> bool:
        """Triton on the CPU runs in the (slow) interpreter: tests keep its shapes small."""
        return self.backend == "triton" and self.device == "cpu"

    @property
    def tol(self) -> dict:
        return {
            torch.float32: dict(atol=3e-5, rtol=3e-5),
            torch.float16: dict(atol=3e-3, rtol=3e-3),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
            torch.float64: dict(atol=1e-10, rtol=1e-10),
        }[self.dtype]


def _triton_ready(family: str) -> str | None:
    try:
        ops.triton_launchers()
    except ImportError as exc:
        return f"triton kernels for {family} not importable: {exc}"
    return None


# The families whose CPU kernels have ISA variants (csrc/cpu/*_avx512.cpp): their native CPU targets
# run once per variant this machine supports, so the AVX2 path stays tested on an AVX-512 machine.
CPU_ISA_FAMILIES = {
    "paged_decode_attention": ("avx2", "avx512"),
    "paged_prefill_attention": ("avx2", "avx512"),
    "shared_prefix_attention": ("avx2", "avx512"),
}


def targets(family: str, *, float64: bool = False) -> list:
    """pytest params over every backend × device (× CPU ISA variant) × dtype; what cannot run here is skipped."""
    out = [Target("torch", "cpu", torch.float64 if float64 else torch.float32)]
    isas = [i for i in CPU_ISAS if i in CPU_ISA_FAMILIES.get(family, ())] or [None]
    out += [Target("native", "cpu", dt, isa) for isa in isas for dt in (torch.float32, torch.bfloat16)]
    out += [Target("triton", "cpu", torch.float32), Target("triton", "cpu", torch.float16)]
    out += [Target(b, "cuda", dt) for b in ("native", "triton") for dt in (torch.bfloat16, torch.float16)]
    params = []
    for t in out:
        skip = None
        if t.device == "cuda" and not HAS_CUDA:
            skip = "no CUDA device"
        elif t.device == "cpu" and t.backend == "triton" and HAS_CUDA:
            skip = "the Triton interpreter is only used on machines without a GPU"
        elif t.backend == "native" and not ops.native_available():
            skip = ops.NATIVE_ERROR
        elif t.backend == "triton":
            skip = _triton_ready(family)
        marks = [pytest.mark.skip(reason=skip)] if skip else []
        if t.isa:
            marks.append(pytest.mark.cpu_isa(t.isa))  # tests/conftest.py runs the test as that variant
        params.append(pytest.param(t, id=t.id, marks=marks))
    return params


def cpu_backends() -> list:
    """The backends of a CPU-only op (packed_linear, int8_linear, rms_norm): the torch reference, and
    the native kernels once per ISA variant this machine runs (`native-cpu-avx2`, `native-cpu-avx512`,
    ...; the `cpu_isa` mark makes tests/conftest.py run the test under `ops.use_cpu_isa`), so the AVX2
    path stays tested on an AVX-512 machine."""
    params = [pytest.param("torch", id="torch-cpu")]
    if not ops.native_available():
        return params + [pytest.param("native", id="native-cpu", marks=pytest.mark.skip(reason=str(ops.NATIVE_ERROR)))]
    return params + [pytest.param("native", id=f"native-cpu-{isa}", marks=pytest.mark.cpu_isa(isa)) for isa in CPU_ISAS]


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (or a sentinel for integers) so unwritten rows are caught."""
    return t.fill_(float("nan") if t.is_floating_point() else -7)


def randn(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def to_ref(*tensors):
    """The oracle's inputs: float64 copies on the CPU."""
    return [t.detach().cpu().double() if t.is_floating_point() else t.detach().cpu() for t in tensors]
