"""Which variant the CPU kernels run (the ISA dispatch of the native extension, csrc/cpu/cpu_isa.h), and
how their thread pool waits (csrc/cpu/thread_pool.h).

The extension is built for x86-64-v3 (AVX2 + FMA); its hot kernels also have variants for newer
instruction sets, chosen once at load from cpuid and the OS's XSAVE state (the best the machine
supports) and reported by `cpu_features()` and `minisched --version`. `set_cpu_isa` / `use_cpu_isa`
override the choice for the whole process -- for tests (every supported variant against the float64
reference) and benchmarks (an AVX2 machine's speed on an AVX-512 one); nothing else reads it.

Variants (CPU_ISAS, each using more of the machine than the one before):
  "avx2"       AVX2 + FMA: every machine the extension runs on
  "avx2-vnni"  + AVX-VNNI: int16 dot products on ymm for the int8 weights
  "avx512"     AVX-512 F/BW/VL/DQ + AVX512-VNNI: 16 floats per instruction, 32 registers
  "amx"        + AMX tiles (and Linux's permission for them): the int8 and bf16 linears from 16 rows on

The kernels split their work over a pool of minisched's own threads (as many as torch.get_num_threads()).
An idle worker spins `cpu_spin_us()` microseconds before it sleeps, so the next op of a decode step finds
it awake; `set_cpu_spin_us(0)` makes it sleep at once (the setting for benchmarks that compare the two).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

CPU_ISAS: tuple[str, ...] = ("avx2", "avx2-vnni", "avx512", "amx")


try:  # the same module minisched.ops imports (it registers the ops)
    from minisched.ops import _C as _ext  # type: ignore[attr-defined]  # compiled extension: no stub

    _ERROR: Optional[str] = None
except ImportError as exc:  # a source tree that was never built
    _ext = None
    _ERROR = f"the minisched.ops._C extension is not built ({exc})"


def cpu_features() -> dict:
    """{"isa": the active variant, "best": the detected one, "supported": [variants], "flags":
    {cpuid/XCR0 feature: bool}, "vendor", "model", "amx_error"}; {"isa": None, "error": ...} without
    the extension."""
    if _ext is None:
        return {"isa": None, "supported": [], "error": _ERROR}
    return _ext.cpu_features()


def supported_cpu_isas() -> list[str]:
    return list(cpu_features()["supported"])


def cpu_isa() -> Optional[str]:
    """The variant the CPU kernels use now (None without the extension)."""
    return cpu_features()["isa"]


def set_cpu_isa(isa: Optional[str]) -> Optional[str]:
    """Run the CPU kernels as variant `isa` (None: the best this machine supports); returns the
    previous one. ValueError for a name not in CPU_ISAS or one this machine cannot run."""
    if _ext is None:
        raise RuntimeError(_ERROR)
    if isa is not None and isa not in CPU_ISAS:
        raise ValueError(f"unknown CPU ISA {isa!r}; expected one of {CPU_ISAS} or None")
    before = _ext.cpu_features()["isa"]
    _ext.set_cpu_isa(isa)
    return before


@contextlib.contextmanager
def use_cpu_isa(isa: Optional[str]) -> Iterator[None]:
    """`with use_cpu_isa("avx2"): ...` runs the block's CPU kernels as that variant."""
    before = set_cpu_isa(isa)
    try:
        yield
    finally:
        set_cpu_isa(before)


def cpu_spin_us() -> int:
    """How long an idle thread-pool worker spins before it sleeps, in microseconds."""
    if _ext is None:
        raise RuntimeError(_ERROR)
    return int(_ext.cpu_pool()["spin_us"])


def set_cpu_spin_us(us: int) -> int:
    """Let idle pool workers spin `us` microseconds before they sleep (0: at once), process-wide;
    returns the previous value. ValueError for a negative or non-integer value."""
    if _ext is None:
        raise RuntimeError(_ERROR)
    if isinstance(us, bool) or not isinstance(us, int) or us < 0:
        raise ValueError(f"spin must be a non-negative number of microseconds, got {us!r}")
    before = cpu_spin_us()
    _ext.set_cpu_spin_us(us)
    return before


def describe() -> str:
    """One line for `minisched --version`: the active variant, the supported ones, the CPU."""
    f = cpu_features()
    if f["isa"] is None:
        return "CPU kernels: not built"
    amx = f["flags"].get("amx_tile")
    extra = [n for n in ("avx512_bf16", "avx512_fp16") if f["flags"].get(n)]
    if amx and "amx" not in f["supported"]:
        extra.append(f"amx tiles (unusable: {f['amx_error'] or 'no AMX-INT8/BF16 or AVX-512 BF16'})")
    more = f"; also {', '.join(extra)}" if extra else ""
    return f"CPU kernels: {f['isa']} (supported: {', '.join(f['supported'])}{more}) on {f['model'] or f['vendor']}"
