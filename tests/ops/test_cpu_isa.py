"""The CPU kernels' ISA dispatch (csrc/cpu/cpu_isa.h, minisched/ops/cpu.py): what is reported, the
override and its errors, and that no code outside an ISA variant's own files uses its registers
(an inline function compiled for AVX-512 and picked by the linker would fault on an AVX2 machine)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from minisched import ops
from minisched.ops import cpu

pytestmark = pytest.mark.skipif(not ops.native_available(), reason=str(ops.NATIVE_ERROR))


def test_features_report_the_machine():
    f = ops.cpu_features()
    assert f["supported"][0] == "avx2" and set(f["supported"]) <= set(ops.CPU_ISAS)
    assert f["best"] == f["supported"][-1] and f["isa"] in f["supported"]
    flags = f["flags"]
    if "avx512" in f["supported"]:
        assert flags["avx512f"] and flags["avx512bw"] and flags["avx512vl"] and flags["avx512_vnni"] and flags["os_zmm"]
    if "avx2-vnni" in f["supported"]:
        assert flags["avx_vnni"]
    if not flags["amx_tile"]:
        assert not flags["os_amx"]
    if "amx" in f["supported"]:
        assert (
            flags["amx_tile"] and flags["amx_int8"] and flags["amx_bf16"] and flags["os_amx"] and flags["avx512_bf16"]
        )
    with open("/proc/cpuinfo") as fh:
        cpuinfo = set(re.search(r"^flags\s*:(.*)$", fh.read(), re.M).group(1).split())
    for ours, linux in (
        ("avx2", "avx2"),
        ("avx512f", "avx512f"),
        ("avx512_vnni", "avx512_vnni"),
        ("avx_vnni", "avx_vnni"),
        ("amx_tile", "amx_tile"),
        ("amx_int8", "amx_int8"),
        ("amx_bf16", "amx_bf16"),
    ):
        assert flags[ours] == (linux in cpuinfo), ours  # cpuid agrees with what the kernel saw
    assert "CPU kernels: " + f["isa"] in cpu.describe()


def test_override_and_restore():
    best = ops.cpu_isa()
    with ops.use_cpu_isa("avx2"):
        assert ops.cpu_isa() == "avx2"
        with ops.use_cpu_isa(None):
            assert ops.cpu_isa() == ops.cpu_features()["best"]
        assert ops.cpu_isa() == "avx2"
    assert ops.cpu_isa() == best
    with pytest.raises(ValueError, match="unknown CPU ISA"):
        ops.set_cpu_isa("avx1024")
    for isa in set(ops.CPU_ISAS) - set(ops.supported_cpu_isas()):
        with pytest.raises(ValueError, match="cannot run"):
            ops.set_cpu_isa(isa)
    assert ops.cpu_isa() == best


def test_version_names_the_isa(capsys):
    from minisched.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith("minisched ") and f"CPU kernels: {ops.cpu_isa()} (supported: " in out


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump")
def test_wide_registers_only_in_the_variants_own_code():
    """Every function of the extension whose code touches zmm, opmask or tile registers belongs to an
    AVX-512 or AMX variant (namespaces minisched::cpu::avx512 / ::amx); the rest is x86-64-v3 code."""
    from minisched.ops import _C

    dis = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", _C.__file__], capture_output=True, text=True, check=True
    ).stdout
    offenders, wide, current = set(), set(), None
    for line in dis.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            current = head.group(1)
        elif current and re.search(r"%zmm|%k[1-7]\b|%tmm|tilerelease|ldtilecfg", line):
            (wide if "avx512::" in current or "amx::" in current else offenders).add(current)
    assert not offenders, sorted(offenders)[:10]
    assert any("packed_panel_rows" in name or "micro" in name for name in wide)  # the check sees the variants
    assert any("amx::int8_panels" in name for name in wide) and any("amx::bf16_panels" in name for name in wide)


@pytest.mark.cpu_isa("avx2")
def test_the_cpu_isa_mark_runs_the_test_as_that_variant():
    assert ops.cpu_isa() == "avx2"


def test_op_targets_carry_their_variant():
    from helpers.targets import CPU_ISAS, targets

    params = [
        p for p in targets("paged_prefill_attention") if p.values[0].backend == "native" and p.values[0].device == "cpu"
    ]
    assert sorted({p.values[0].isa for p in params}) == sorted(i for i in CPU_ISAS if i in ("avx2", "avx512"))
    for p in params:
        assert any(m.name == "cpu_isa" and m.args == (p.values[0].isa,) for m in p.marks), p.id
