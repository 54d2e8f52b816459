"""The CUDA kernels build for sm_90a without register spills or local memory.

Reads the resource usage of every kernel in the built extension (minisched/ops/_C*.so) with
`cuobjdump -res-usage` (seconds); where the extension was built without CUDA, compiles the
attention kernel file alone with nvcc (about half a minute). Skipped without nvcc or a CUDA
build of torch. Runs on machines without a GPU.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cuda_home() -> str | None:
    for cand in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if cand and os.path.exists(os.path.join(cand, "bin", "nvcc")):
            return cand
    nvcc = shutil.which("nvcc")
    return os.path.dirname(os.path.dirname(nvcc)) if nvcc else None


def _cuobjdump() -> str | None:
    """$CUOBJDUMP (device_check.sh exports its choice), $CUDA_HOME's, then Triton's bundled copy."""
    if os.access(os.environ.get("CUOBJDUMP", ""), os.X_OK):
        return os.environ["CUOBJDUMP"]
    home = _cuda_home()
    if home and os.access(os.path.join(home, "bin", "cuobjdump"), os.X_OK):
        return os.path.join(home, "bin", "cuobjdump")
    try:
        import triton

        cand = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.access(cand, os.X_OK):
            return cand
    except ImportError:
        pass
    return shutil.which("cuobjdump")


CUDA_HOME = _cuda_home()
CUOBJDUMP = _cuobjdump()
pytestmark = pytest.mark.skipif(
    torch.version.cuda is None or CUDA_HOME is None or CUOBJDUMP is None,
    reason="needs nvcc, cuobjdump and a CUDA build of torch",
)

FUNC = re.compile(r"^\s*Function (\S+):\s*$")
RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def parse_res_usage(text: str) -> dict:
    """{mangled kernel name: (REG, STACK, SHARED, LOCAL)} from `cuobjdump -res-usage` output."""
    kernels, name = {}, None
    for line in text.splitlines():
        m = FUNC.match(line)
        if m:
            name = m.group(1)
            continue
        r = RES.search(line)
        if r and name:
            kernels[name] = tuple(int(x) for x in r.groups())
            name = None
    return kernels


def _compile_attention_kernel(tmp_path, source: str = "attention_kernel.cu") -> str:
    from torch.utils.cpp_extension import include_paths

    obj = str(tmp_path / source.replace(".cu", ".o"))
    incs = [f"-I{p}" for p in include_paths()] + [f"-I{os.path.join(ROOT, 'csrc')}"]
    for site in __import__("site").getsitepackages():
        incs += [f"-I{p}" for p in glob.glob(os.path.join(site, "nvidia", "cu13", "include"))]
    cmd = [
        os.path.join(CUDA_HOME, "bin", "nvcc"),
        "-std=c++20",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-O3",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "-Xptxas=-warn-spills,-Werror",
        "-c",
        os.path.join(ROOT, "csrc", "cuda", source),
        "-o",
        obj,
        *incs,
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return obj


def _demangle(name: str) -> str:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt:
        return name
    out = subprocess.run([cxxfilt, name], capture_output=True, text=True).stdout.strip()
    out = re.sub(r"minisched::cuda::\(anonymous namespace\)::", "", out)
    return out.split("(")[0] if out else name


def test_no_spills_or_local_memory(tmp_path):
    sos = [p for p in glob.glob(os.path.join(ROOT, "minisched", "ops", "_C*.so"))]
    kernels = {}
    for so in sos:
        res = subprocess.run([CUOBJDUMP, "-res-usage", so], capture_output=True, text=True, timeout=120)
        kernels.update(parse_res_usage(res.stdout))
    source = ", ".join(os.path.basename(s) for s in sos)
    if not kernels:  # a CPU-only build (or none): compile the attention kernels alone
        obj = _compile_attention_kernel(tmp_path)
        res = subprocess.run([CUOBJDUMP, "-res-usage", obj], capture_output=True, text=True, timeout=120)
        kernels = parse_res_usage(res.stdout)
        source = "csrc/cuda/attention_kernel.cu"
    assert kernels, f"no kernels found in {source}"
    print(f"\nkernel resource usage ({source}):", file=sys.stderr)
    print(f"{'REG':>4} {'STACK':>5} {'LOCAL':>5}  kernel", file=sys.stderr)
    for name, (reg, stack, _shared, local) in sorted(kernels.items(), key=lambda kv: _demangle(kv[0])):
        print(f"{reg:>4} {stack:>5} {local:>5}  {_demangle(name)}", file=sys.stderr)
    bad = {_demangle(n): r for n, r in kernels.items() if r[3] != 0 or r[1] > 0}
    assert not bad, f"kernels with local memory / stack (register spills or dynamically indexed arrays): {bad}"
    assert any("paged_attention_kernel" in n for n in kernels), "the paged attention kernel is missing"


# -- resident warps per SM (H200 / sm_90 limits) ------------------------------------------------------------
REGS_PER_SM, REG_ALLOC_UNIT = 64 * 1024, 256  # registers are allocated per warp in units of 256
SMEM_PER_SM, SMEM_RESERVED_PER_CTA = 228 * 1024, 1024
MAX_WARPS_PER_SM, MAX_CTAS_PER_SM = 64, 32
KERNEL = re.compile(r"paged_attention_kernel<(\w+), (\d+), (\d+), (\d+), (\d+)>")


def attention_smem_bytes(d: int, row_warps: int, row_frags: int = 1) -> int:
    """smem_bytes<D>(rows_tile) in attention_kernel.cu: Q tile (16 rows per row fragment per row warp) + 2 stages
    of 64-row K and V, rows padded by 8."""
    return (16 * row_frags * row_warps + 2 * 2 * 64) * (d + 8) * 2


def ctas_per_sm(regs: int, threads: int, smem: int) -> int:
    warps = threads // 32
    reg_per_warp = -(-regs * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = (REGS_PER_SM // reg_per_warp) // warps
    by_smem = SMEM_PER_SM // (smem + SMEM_RESERVED_PER_CTA)
    return min(by_regs, by_smem, MAX_WARPS_PER_SM // warps, MAX_CTAS_PER_SM)


def attention_occupancy(tmp_path) -> list:
    """(dtype, D, row warps, KV warps, row fragments, REG, smem, CTAs/SM, warps/SM) of every paged_attention_kernel."""
    sos = glob.glob(os.path.join(ROOT, "minisched", "ops", "_C*.so"))
    kernels = {}
    for so in sos:
        res = subprocess.run([CUOBJDUMP, "-res-usage", so], capture_output=True, text=True, timeout=120)
        kernels.update(parse_res_usage(res.stdout))
    if not kernels:
        obj = _compile_attention_kernel(tmp_path)
        res = subprocess.run([CUOBJDUMP, "-res-usage", obj], capture_output=True, text=True, timeout=120)
        kernels = parse_res_usage(res.stdout)
    rows = []
    for name, (reg, _stack, _shared, _local) in kernels.items():
        m = KERNEL.search(_demangle(name))
        if m:
            dtype, d, rw, kw, rf = m.group(1), *(int(m.group(i)) for i in range(2, 6))
            smem = attention_smem_bytes(d, rw, rf)
            ctas = ctas_per_sm(reg, 32 * rw * kw, smem)
            rows.append((dtype, d, rw, kw, rf, reg, smem, ctas, ctas * rw * kw))
    assert rows, "no paged_attention_kernel<T, D, ROW_WARPS, KV_WARPS, RF> found"
    print(f"\n{'kernel':36} {'REG':>4} {'smem':>6} {'CTAs/SM':>7} {'warps/SM':>8}", file=sys.stderr)
    for dtype, d, rw, kw, rf, reg, smem, ctas, warps in sorted(rows):
        print(f"{dtype:16} D{d:<4} {rw} x {kw} x {rf:<6} {reg:>4} {smem:>6} {ctas:>7} {warps:>8}", file=sys.stderr)
    return rows


def test_decode_occupancy(tmp_path):
    """The decode CTA (1 row warp x 4 KV warps, GQA <= 16) keeps >= 12 resident warps per SM."""
    rows = attention_occupancy(tmp_path)
    decode = [r for r in rows if r[2:5] == (1, 4, 1)]
    assert len(decode) == 4, "the 1 x 4 decode CTA for {bf16, fp16} x D {64, 128}"
    for dtype, d, _rw, _kw, _rf, reg, smem, ctas, warps in decode:
        assert warps >= 12, f"{dtype} D {d}: {reg} registers, {smem} B smem -> {ctas} CTAs = {warps} warps per SM"


def test_prefill_occupancy(tmp_path):
    """The prefill / shared-prefix CTA (4 warps x 32 rows: 128-row tiles) keeps the resident rows per SM it was
    sized for (NOTES.md, "Prefill kernel (mma.sync)"): D 128 2 CTAs (255 registers, 102 KB smem), D 64 3 CTAs (168 registers: the
    launch bounds' min-CTAs; 54 KB), i.e. at least the 16-row 4 x 1 CTA's warps per SM, with twice the rows."""
    rows = attention_occupancy(tmp_path)
    prefill = [r for r in rows if r[2:5] == (4, 1, 2)]
    assert len(prefill) == 4, "the 4 x 1 x 2 prefill CTA for {bf16, fp16} x D {64, 128}"
    want = {128: 2, 64: 3}
    for dtype, d, _rw, _kw, _rf, reg, smem, ctas, warps in prefill:
        assert ctas >= want[d], f"{dtype} D {d}: {reg} registers, {smem} B smem -> {ctas} CTAs = {warps} warps per SM"


# -- the prefill tile loop's shared-memory traffic (SASS) ---------------------------------------------------
SASS_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
SASS_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def tile_loop_ops(sass: str, kernel: str = "paged_attention_kernel", mma: str = "HMMA") -> dict:
    """{demangled kernel: Counter of opcodes} over each `kernel`'s tile loop: the innermost loop (a backward BRA)
    that contains every `mma` instruction, from its head to its back edge (`cuobjdump -sass` text)."""
    import collections

    loops, name, ins = {}, None, []

    def flush():
        if name and kernel in name and ins:
            hmma = [a for a, op, _ in ins if op.startswith(mma)]
            head = edge = None  # the innermost backward branch around all HMMA: largest target
            for a, op, arg in ins:
                m = re.match(r"0x([0-9a-f]+)", arg.strip())
                if op.startswith("BRA") and m and a > hmma[-1] and int(m.group(1), 16) < hmma[0]:
                    if head is None or int(m.group(1), 16) > head:
                        head, edge = int(m.group(1), 16), a
            assert head is not None, f"no tile loop found in {_demangle(name)}"
            loops[_demangle(name)] = collections.Counter(op.split(".")[0] for a, op, _ in ins if head <= a <= edge)

    for line in sass.splitlines():
        m = SASS_FUNC.match(line)
        if m:
            flush()
            name, ins = m.group(1), []
            continue
        m = SASS_INS.search(line)
        if m and name:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    flush()
    return loops


def test_prefill_tile_loop_shares_kv_fragments(tmp_path):
    """The 32-row prefill warp loads each K / V fragment once for both row fragments: per 64-token tile 2 x D HMMA
    and at most 0.32 LDSM per HMMA (K 4 x D / 16, V 4 x D / 16, Q 2 x D / 16); the 16-row warp has 0.5 plus Q."""
    sos = glob.glob(os.path.join(ROOT, "minisched", "ops", "_C*.so"))
    target = sos[0] if sos else _compile_attention_kernel(tmp_path)
    sass = subprocess.run([CUOBJDUMP, "-sass", target], capture_output=True, text=True, timeout=300).stdout
    loops = tile_loop_ops(sass)
    prefill = {n: c for n, c in loops.items() if re.search(r"paged_attention_kernel<\w+, \d+, 4, 1, 2>", n)}
    assert len(prefill) == 4, f"the 4 x 1 x 2 CTA for {{bf16, fp16}} x D {{64, 128}}: {sorted(loops)}"
    print(f"\n{'kernel':52} {'instr':>6} {'HMMA':>5} {'LDSM':>5} {'BAR':>4}", file=sys.stderr)
    for n, c in sorted(loops.items()):
        print(f"{n:52} {sum(c.values()):>6} {c['HMMA']:>5} {c['LDSM']:>5} {c['BAR']:>4}", file=sys.stderr)
    for n, c in prefill.items():
        d = int(KERNEL.search(n).group(2))
        assert c["HMMA"] == 2 * d, f"{n}: {c['HMMA']} HMMA per tile, want {2 * d}"
        assert c["LDSM"] <= 0.32 * c["HMMA"], f"{n}: {c['LDSM']} LDSM for {c['HMMA']} HMMA"


# -- the Hopper wgmma prefill kernel (attention_wgmma.cu, NOTES.md "Prefill kernel (wgmma)") ----------------------------------
WGMMA_KERNEL = re.compile(r"paged_attention_wgmma_kernel<(\w+), (\d+)>")


def wgmma_smem_bytes(d: int) -> int:
    """wgmma_smem_bytes<D>(): Q (128 rows) + 2 stages of 64-token K and V, unpadded (swizzled) + 1 KB of slack
    for the 1024-byte alignment."""
    return 128 * d * 2 + 4 * 64 * d * 2 + 1024


def _wgmma_target(tmp_path) -> str:
    """The built extension when it holds the wgmma kernel, else attention_wgmma.cu compiled alone."""
    for so in glob.glob(os.path.join(ROOT, "minisched", "ops", "_C*.so")):
        res = subprocess.run([CUOBJDUMP, "-res-usage", so], capture_output=True, text=True, timeout=120)
        if "paged_attention_wgmma_kernel" in res.stdout:
            return so
    return _compile_attention_kernel(tmp_path, "attention_wgmma.cu")


def test_wgmma_kernel_resources_and_hgmma(tmp_path):
    """Each paged_attention_wgmma_kernel<T, D>: 0 stack / local (no spills), the CTAs per SM its registers and
    shared memory allow (D 128: 1 CTA = 8 warps, 166 registers; D 64: 2 CTAs, <= 128 registers by the launch
    bounds), and its tile loop issues D / 16 HGMMA 64x64x16 (S = Q K^T) + 4 HGMMA 64xDx16 (O += P V) per 64-token
    tile, with the warpgroup arrive / wait around them; no mma.sync (HMMA) left."""
    target = _wgmma_target(tmp_path)
    res = subprocess.run([CUOBJDUMP, "-res-usage", target], capture_output=True, text=True, timeout=120).stdout
    kernels = {_demangle(n): r for n, r in parse_res_usage(res).items() if "paged_attention_wgmma_kernel" in n}
    assert len(kernels) == 4, f"{{bf16, fp16}} x D {{64, 128}}: {sorted(kernels)}"
    want_ctas = {128: 1, 64: 2}
    print(f"\n{'kernel':48} {'REG':>4} {'smem':>7} {'CTAs/SM':>7}", file=sys.stderr)
    for n, (reg, stack, _shared, local) in sorted(kernels.items()):
        d = int(WGMMA_KERNEL.search(n).group(2))
        ctas = ctas_per_sm(reg, 256, wgmma_smem_bytes(d))
        print(f"{n:48} {reg:>4} {wgmma_smem_bytes(d):>7} {ctas:>7}", file=sys.stderr)
        assert stack == 0 and local == 0, f"{n}: stack {stack}, local {local}"
        assert ctas >= want_ctas[d], f"{n}: {reg} registers -> {ctas} CTAs per SM, want {want_ctas[d]}"
    sass = subprocess.run([CUOBJDUMP, "-sass", target], capture_output=True, text=True, timeout=300).stdout
    loops = tile_loop_ops(sass, "paged_attention_wgmma_kernel", "HGMMA")
    assert len(loops) == 4, sorted(loops)
    print(f"{'kernel':48} {'instr':>6} {'HGMMA':>5} {'WARPGROUP':>9} {'LDGSTS':>6} {'MUFU':>5}", file=sys.stderr)
    for n, c in sorted(loops.items()):
        d = int(WGMMA_KERNEL.search(n).group(2))
        print(
            f"{n:48} {sum(c.values()):>6} {c['HGMMA']:>5} {c['WARPGROUP']:>9} {c['LDGSTS']:>6} {c['MUFU']:>5}",
            file=sys.stderr,
        )
        assert c["HGMMA"] == d // 16 + 4, f"{n}: {c['HGMMA']} HGMMA per tile, want {d // 16 + 4}"
        assert c["HMMA"] == 0, f"{n}: mma.sync in the wgmma kernel"
        assert c["WARPGROUP"] >= 4, f"{n}: {c['WARPGROUP']} warpgroup arrive / depbar, want 2 of each per tile"
        assert c["FENCE"] >= 1, f"{n}: no fence.proxy.async in the tile loop"
