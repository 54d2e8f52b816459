"""Kernel microbenchmark on the GPU (not a test): every minisched op, backends "native" (CUDA) and
"triton", against torch's own paths measured in the same run, with the device's measured copy
bandwidth and bf16 matmul rate as the roofline references.

Baselines on the dense equivalent of the paged problem: F.scaled_dot_product_attention under each
SDPA backend (flash / cudnn / efficient, via torch.nn.attention.sdpa_kernel, enable_gqa=True),
FlexAttention (torch.compile'd) where it works, FlashInfer where it is importable.

Timing: triton.testing.do_bench (median; it flushes L2 between runs) or CUDA events; random data;
the copy ops rotate over input sets larger than the L2 cache.

Targets (met / not met in the table, printed last):
  copy ops (store_kv, copy/gather/scatter_kv_pages, tens of MB)  >= 85% of measured copy bandwidth
  decode  (B 64, ctx 4096, 32/8 heads, d128, bf16)              >= 85% of copy bandwidth, faster than
                                                                  the best torch path
  prefill (8 x 2048 causal, 32/8 heads, d128, bf16)              >= 400 TFLOP/s, <= 1.5x SDPA's best
  prefill, the wgmma kernel (cuda_kernel="wgmma", same shape)    >= 400 TFLOP/s (issue 15), after its output
                                                                  matched the mma.sync kernel's in this run
  cascade (64 requests sharing a 4096 prefix + 256 own tokens)  >= 10x faster than plain paged decode
(the targets of issues 15 and 16; the mma.sync prefill kernel is not expected to reach 400, NOTES.md)

Usage:  python benchmarks/bench_kernels_gpu.py [--json PATH] [--quick] [--no-flex]
        python benchmarks/bench_kernels_gpu.py --dry-run     # tiny shapes on the CPU: plumbing only
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minisched import ops  # noqa: E402

RESULTS: list[dict] = []
TARGETS: list[dict] = []
FLEX_JOBS: list = []  # FlexAttention runs last (torch.compile time); its inputs stay alive until then
WGMMA_JOBS: list = []  # the wgmma prefill kernel runs after everything else (never run on hardware before)


# -- timing ------------------------------------------------------------------------------------------

class Timer:
    def __init__(self, device: str, quick: bool):
        self.cuda = device == "cuda"
        self.quick = quick
        try:
            from triton.testing import do_bench
            self.do_bench = do_bench if self.cuda else None
        except ImportError:
            self.do_bench = None

    def __call__(self, fns) -> float:
        """Median milliseconds of one call, rotating over the callables in `fns`."""
        fns = fns if isinstance(fns, (list, tuple)) else [fns]
        it = itertools.cycle(fns)

        def call():
            return next(it)()

        if not self.cuda:
            call()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        call()
        torch.cuda.synchronize()
        if self.do_bench is not None:
            warm, rep = (5, 20) if self.quick else (10, 60)
            return float(self.do_bench(call, warmup=warm, rep=rep, return_mode="median"))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(30)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(30)]
        for _ in range(5):
            call()
        for s, e in zip(starts, ends):
            s.record()
            call()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def record(case: str, impl: str, ms: float | None, *, bytes_moved: float = 0.0, flops: float = 0.0,
           error: str | None = None, **extra) -> dict:
    r = {"case": case, "impl": impl, "ms": ms, "GB/s": None, "TFLOP/s": None, "error": error, **extra}
    if ms:
        if bytes_moved:
            r["GB/s"] = bytes_moved / (ms * 1e-3) / 1e9
        if flops:
            r["TFLOP/s"] = flops / (ms * 1e-3) / 1e12
    RESULTS.append(r)
    msg = f"  {case:<22} {impl:<22} " + (f"{ms:9.4f} ms" if ms else f"   failed: {(error or '')[:90]}")
    if r["GB/s"]:
        msg += f"  {r['GB/s']:8.1f} GB/s"
    if r["TFLOP/s"]:
        msg += f"  {r['TFLOP/s']:7.1f} TFLOP/s"
    print(msg, flush=True)
    return r


def attempt(timer: Timer, case: str, impl: str, make, **kw) -> dict:
    """make() -> callable (or list of callables); time it, recording any failure instead of raising."""
    try:
        fns = make()
        ms = timer(fns)
        return record(case, impl, ms, **kw)
    except Exception as exc:  # noqa: BLE001 - a failing baseline must not stop the run
        err = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        return record(case, impl, None, error=err, **kw)


def best(case: str, prefix: str = "") -> dict | None:
    rows = [r for r in RESULTS if r["case"] == case and r["ms"] and r["impl"].startswith(prefix)]
    return min(rows, key=lambda r: r["ms"]) if rows else None


def get(case: str, impl: str) -> dict | None:
    for r in RESULTS:
        if r["case"] == case and r["impl"] == impl and r["ms"]:
            return r
    return None


def target(name: str, met: bool | None, value: str, goal: str) -> None:
    TARGETS.append({"target": name, "met": met, "value": value, "goal": goal})


# -- builders ---------------------------------------------------------------------------------------

def paged_table(lens, page_size, num_pages, device, shared_prefix_pages=None):
    """CSR page table with each request's pages drawn at random from a pool of num_pages."""
    need = [-(-n // page_size) for n in lens]
    perm = torch.randperm(num_pages, device=device).to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(need).cumsum(0)
    indices = perm[: int(indptr[-1])]
    last = torch.tensor([(n - 1) % page_size + 1 for n in lens], dtype=torch.int32)
    return indptr.to(device), indices.contiguous(), last.to(device)


def randn(shape, dtype, device):
    return torch.randn(shape, device=device, dtype=torch.float32).to(dtype)


def backends_for(device: str) -> list:
    out = []
    if ops.native_available():
        out.append("native")
    if device == "cuda":
        try:
            import triton  # noqa: F401
            out.append("triton")
        except ImportError:
            pass
    else:
        out.append("torch")  # the dry run exercises the plumbing with the reference
    return out


def sdpa_backends():
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return []
    return [("sdpa-flash", SDPBackend.FLASH_ATTENTION, sdpa_kernel),
            ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION, sdpa_kernel),
            ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION, sdpa_kernel),
            ("sdpa-math", SDPBackend.MATH, sdpa_kernel)]


def time_sdpa(timer, case, q, k, v, causal, kw, device, skip_math=True):
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] dense; every SDPA backend (GQA via enable_gqa)."""
    if device != "cuda":
        attempt(timer, case, "sdpa-default", lambda: (lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=True)), **kw)
        return
    for name, be, ctx in sdpa_backends():
        if skip_math and name == "sdpa-math":
            continue

        def make(be=be, ctx=ctx):
            def fn():
                with ctx(be):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            fn()
            return fn
        attempt(timer, case, name, make, **kw)


def time_flex(timer, case, q, k, v, causal, kw):
    def make():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
        mask = None
        if causal:
            lq, lk = q.shape[2], k.shape[2]
            mask = create_block_mask(lambda b, h, qi, ki: ki <= qi + (lk - lq), B=None, H=None, Q_LEN=lq,
                                     KV_LEN=lk, device=q.device)

        def fn():
            return flex(q, k, v, block_mask=mask, enable_gqa=True)
        fn()
        return fn
    attempt(timer, case, "flex-attention", make, **kw)


# -- references: copy bandwidth and matmul rate -------------------------------------------------------

def roofline(timer, device, dtype, args) -> tuple[float, float]:
    n = (256 << 20) if device == "cuda" and not args.quick else (64 << 20 if device == "cuda" else 1 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    r = attempt(timer, "ref:copy", "torch copy_", lambda: (lambda: b.copy_(a)), bytes_moved=2 * n)
    copy_bw = (r["GB/s"] or 0.0) * 1e9
    m = 8192 if device == "cuda" else 256
    x, y = randn((m, m), dtype, device), randn((m, m), dtype, device)
    r = attempt(timer, "ref:matmul", f"torch mm {str(dtype)[6:]}", lambda: (lambda: x @ y), flops=2 * m ** 3)
    mm_rate = (r["TFLOP/s"] or 0.0) * 1e12
    if device == "cuda":
        host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        attempt(timer, "ref:d2h-pinned", "torch copy_", lambda: (lambda: host.copy_(dev, non_blocking=True)),
                bytes_moved=host.numel())
        attempt(timer, "ref:h2d-pinned", "torch copy_", lambda: (lambda: dev.copy_(host, non_blocking=True)),
                bytes_moved=host.numel())
    return copy_bw, mm_rate


# -- cases ------------------------------------------------------------------------------------------

def bench_copy_ops(timer, device, dtype, args, copy_bw, l2_bytes):
    s = args.scale
    layers, hkv, d, ps = 32, 8, 128, 16
    n_move = max(1, 32 // s)  # pages moved per call: 32 x (32 layers x K,V x 32 KB) = 64 MB read
    num_pages = max(4 * n_move, 256 // s)
    pool = randn((layers // s if s > 1 else layers, 2, num_pages, ps, hkv, d), dtype, device)
    page_bytes = pool[:, :, 0].numel() * pool.element_size()
    moved = n_move * page_bytes
    sets = max(1, min(8, math.ceil(4 * l2_bytes / max(1, 2 * moved))))
    perm = [torch.randperm(num_pages, device=device).to(torch.int32) for _ in range(sets)]
    srcs = [p[:n_move].contiguous() for p in perm]
    dsts = [p[n_move:2 * n_move].contiguous() for p in perm]
    bufs = [torch.empty((pool.shape[0], 2, n_move, ps, hkv, d), dtype=dtype, device=device) for _ in range(sets)]
    mb = moved / 2 ** 20
    for be in backends_for(device):
        kw = dict(bytes_moved=2 * moved, MB=mb)
        attempt(timer, "copy_kv_pages", be, lambda: [
            (lambda i=i: ops.call_op("copy_kv_pages", (pool, srcs[i], dsts[i]), be, check=False))
            for i in range(sets)], **kw)
        attempt(timer, "gather_kv_pages", be, lambda: [
            (lambda i=i: ops.call_op("gather_kv_pages", (pool, srcs[i], bufs[i]), be, check=False))
            for i in range(sets)], **kw)
        attempt(timer, "scatter_kv_pages", be, lambda: [
            (lambda i=i: ops.call_op("scatter_kv_pages", (bufs[i], pool, dsts[i]), be, check=False))
            for i in range(sets)], **kw)
    if device == "cuda":
        host = torch.empty(bufs[0].shape, dtype=dtype, pin_memory=True)
        for be in backends_for(device):
            attempt(timer, "gather_kv_pages->pinned", be,
                    lambda: (lambda: ops.call_op("gather_kv_pages", (pool, srcs[0], host), be, check=False)),
                    bytes_moved=moved, MB=mb)
            attempt(timer, "scatter_kv_pages<-pinned", be,
                    lambda: (lambda: ops.call_op("scatter_kv_pages", (host, pool, dsts[0]), be, check=False)),
                    bytes_moved=moved, MB=mb)
    # torch baseline: index_select over the page dim (gather) and index_copy_ (scatter)
    attempt(timer, "gather_kv_pages", "torch index_select", lambda: [
        (lambda i=i: torch.index_select(pool, 2, srcs[i].long(), out=bufs[i])) for i in range(sets)],
        bytes_moved=2 * moved, MB=mb)

    # store_kv: one prefill chunk of tokens into one layer's caches
    n_tok = 16384 // s
    kc = randn((max(n_tok // ps * 4, 64), ps, hkv, d), dtype, device)
    vc = torch.empty_like(kc)
    ks = [randn((n_tok, hkv, d), dtype, device) for _ in range(2)]
    vs = [randn((n_tok, hkv, d), dtype, device) for _ in range(2)]
    slots = [torch.randperm(kc.shape[0] * ps, device=device)[:n_tok].to(torch.int32) for _ in range(2)]
    tok_bytes = 2 * n_tok * hkv * d * kc.element_size()
    for be in backends_for(device):
        attempt(timer, "store_kv", be, lambda: [
            (lambda i=i: ops.call_op("store_kv", (ks[i], vs[i], kc, vc, slots[i]), be, check=False))
            for i in range(2)], bytes_moved=2 * tok_bytes, MB=tok_bytes / 2 ** 20)
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    attempt(timer, "store_kv", "torch index_copy_", lambda: [
        (lambda i=i: (flat_k.index_copy_(0, slots[i].long(), ks[i]), flat_v.index_copy_(0, slots[i].long(), vs[i])))
        for i in range(2)], bytes_moved=2 * tok_bytes, MB=tok_bytes / 2 ** 20)



def bench_decode(timer, device, dtype, args, copy_bw):
    s = args.scale
    B, ctx, hq, hkv, d, ps = 64 // s, 4096 // s, 32, 8, 128, 16
    lens = [ctx] * B
    num_pages = B * (ctx // ps) + 8
    kc = randn((num_pages, ps, hkv, d), dtype, device)
    vc = randn((num_pages, ps, hkv, d), dtype, device)
    table = paged_table(lens, ps, num_pages, device)
    q = randn((B, hq, d), dtype, device)
    out = torch.empty_like(q)
    lse = torch.empty((B, hq), dtype=torch.float32, device=device)
    kv_bytes = 2 * B * ctx * hkv * d * kc.element_size()
    case = "decode"
    kw = dict(bytes_moved=kv_bytes, shape=f"B{B} ctx{ctx} {hq}/{hkv} d{d} ps{ps}")
    for be in backends_for(device):
        attempt(timer, case, be, lambda: (lambda: ops.call_op(
            "paged_decode_attention", (q, kc, vc, *table, d ** -0.5, out, lse), be, check=False)), **kw)
    # dense equivalents (contiguous K/V per request: what the paged layout avoids)
    qd = q.view(B, hq, 1, d)
    kd = randn((B, hkv, ctx, d), dtype, device)
    vd = randn((B, hkv, ctx, d), dtype, device)
    time_sdpa(timer, case, qd, kd, vd, False, kw, device)
    if device == "cuda":
        bench_flashinfer_decode(timer, case, q, kc, vc, table, hq, hkv, d, ps, kw)
    if device == "cuda" and not args.no_flex:
        FLEX_JOBS.append(lambda: time_flex(timer, case, qd, kd, vd, False, kw))


def bench_flashinfer_decode(timer, case, q, kc, vc, table, hq, hkv, d, ps, kw):
    def make():
        import flashinfer
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(table[0], table[1], table[2], hq, hkv, d, ps, data_type=q.dtype, q_data_type=q.dtype)
        return lambda: w.run(q, (kc, vc))
    attempt(timer, case, "flashinfer", make, **kw)


def bench_prefill(timer, device, dtype, args, mm_rate):
    s = args.scale
    B, L, hq, hkv, d, ps = 8 // min(s, 8) or 1, 2048 // s, 32, 8, 128, 16
    num_pages = B * (L // ps) + 8
    kc = randn((num_pages, ps, hkv, d), dtype, device)
    vc = randn((num_pages, ps, hkv, d), dtype, device)
    table = paged_table([L] * B, ps, num_pages, device)
    q = randn((B * L, hq, d), dtype, device)
    qo = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    lse = torch.empty((B * L, hq), dtype=torch.float32, device=device)
    flops = 4.0 * B * hq * d * (L * (L + 1) / 2)  # causal: QK^T and PV over the visible pairs
    case = "prefill"
    kw = dict(flops=flops, shape=f"{B}x{L} causal {hq}/{hkv} d{d} ps{ps}")
    for be in backends_for(device):
        attempt(timer, case, be, lambda: (lambda: ops.call_op(
            "paged_prefill_attention", (q, qo, kc, vc, *table, True, d ** -0.5, out, lse), be, check=False)), **kw)
    qd = randn((B, hq, L, d), dtype, device)
    kd = randn((B, hkv, L, d), dtype, device)
    vd = randn((B, hkv, L, d), dtype, device)
    time_sdpa(timer, case, qd, kd, vd, True, kw, device)
    if device == "cuda" and not args.no_flex:
        FLEX_JOBS.append(lambda: time_flex(timer, case, qd, kd, vd, True, kw))
    if device == "cuda" and ops.native_available():
        # the Hopper wgmma kernel next to the mma.sync one ("native" = cuda_kernel "auto" = mma.sync today); run
        # LAST (its own stage, after flex): it has never run on hardware, and a fault would take the CUDA context
        # of every later stage with it
        WGMMA_JOBS.append(lambda: bench_prefill_wgmma(timer, case, (q, qo, kc, vc, table, d, out, lse), kw))


def bench_prefill_wgmma(timer, case, inputs, kw):
    """cuda_kernel="wgmma" (schema kernel=2): first its output against the mma.sync kernel's on the same inputs
    (a wrong kernel gets no speed recorded), then timed as "native wgmma" (and "native mma" beside it)."""
    q, qo, kc, vc, table, d, out, lse = inputs
    if torch.cuda.get_device_capability() != (9, 0):
        record(case, "native wgmma", None, error="not an sm_90 device", **kw)
        return

    def run(kernel, o, l):
        ops.call_op("paged_prefill_attention", (q, qo, kc, vc, *table, True, d ** -0.5, o, l, kernel), "native",
                    check=False)

    ref_o, ref_l = torch.empty_like(out), torch.empty_like(lse)
    run(1, ref_o, ref_l)
    got_o, got_l = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    run(2, got_o, got_l)
    torch.cuda.synchronize()
    err = (got_o.float() - ref_o.float()).abs().max().item()
    lse_err = (got_l - ref_l).abs().max().item()
    print(f"  wgmma vs mma.sync: max |out diff| {err:.3g}, max |lse diff| {lse_err:.3g}", flush=True)
    if not (err <= 2e-2 and lse_err <= 2e-3):  # NaN fails too
        record(case, "native wgmma", None, error=f"output differs from mma.sync: {err:.3g} / lse {lse_err:.3g}", **kw)
        return
    attempt(timer, case, "native mma", lambda: (lambda: run(1, out, lse)), **kw)
    attempt(timer, case, "native wgmma", lambda: (lambda: run(2, out, lse)), **kw)


def bench_cascade(timer, device, dtype, args):
    s = args.scale
    n, prefix, suffix, hq, hkv, d, ps = 64 // s, 4096 // s, 256 // s, 32, 8, 128, 16
    pre_pages, suf_pages = prefix // ps, suffix // ps
    num_pages = pre_pages + n * suf_pages + 8
    kc = randn((num_pages, ps, hkv, d), dtype, device)
    vc = randn((num_pages, ps, hkv, d), dtype, device)
    perm = torch.randperm(num_pages, device=device).to(torch.int32)
    pre = perm[:pre_pages]
    own = perm[pre_pages:pre_pages + n * suf_pages].view(n, suf_pages)
    i32 = dict(dtype=torch.int32, device=device)
    full_idx = torch.cat([torch.cat([pre, own[i]]) for i in range(n)])
    full = (torch.arange(0, n * (pre_pages + suf_pages) + 1, pre_pages + suf_pages, **i32), full_idx,
            torch.full((n,), ps, **i32))
    suf = (torch.arange(0, n * suf_pages + 1, suf_pages, **i32), own.reshape(-1).contiguous(),
           torch.full((n,), ps, **i32))
    pre_t = (torch.tensor([0, pre_pages], **i32), pre.contiguous(), torch.full((1,), ps, **i32))
    group = torch.tensor([0, n], **i32)
    q = randn((n, hq, d), dtype, device)
    bytes_unique = 2 * (prefix + n * suffix) * hkv * d * kc.element_size()
    case = "cascade"
    kw = dict(bytes_moved=bytes_unique, shape=f"{n} reqs, prefix {prefix}, suffix {suffix}, {hq}/{hkv} d{d}")
    for be in backends_for(device):
        attempt(timer, case, f"{be} cascade", lambda: (lambda: ops.cascade_decode_attention(
            q, group, kc, vc, pre_t, suf, backend=be, check=False)), **kw)
        attempt(timer, case, f"{be} plain decode", lambda: (lambda: ops.paged_decode_attention(
            q, kc, vc, *full, backend=be, check=False)), **kw)


def bench_merge(timer, device, dtype, args, copy_bw):
    n, h, d = 16384 // args.scale, 32, 128
    va, vb = randn((n, h, d), dtype, device), randn((n, h, d), dtype, device)
    la, lb = randn((n, h), torch.float32, device), randn((n, h), torch.float32, device)
    vo, lo = torch.empty_like(va), torch.empty_like(la)
    moved = 3 * va.numel() * va.element_size() + 3 * la.numel() * 4
    for be in backends_for(device):
        attempt(timer, "merge_attention_states", be, lambda: (lambda: ops.call_op(
            "merge_attention_states", (va, la, vb, lb, vo, lo), be)), bytes_moved=moved)


def evaluate(copy_bw: float) -> None:
    """The targets, from the results so far (re-evaluated after every stage)."""
    TARGETS.clear()
    for case in ("store_kv", "copy_kv_pages", "gather_kv_pages", "scatter_kv_pages"):
        r = get(case, "native")
        frac = (r["GB/s"] * 1e9 / copy_bw) if (r and copy_bw) else None
        target(f"{case} >= 85% copy bw", None if frac is None else frac >= 0.85,
               "n/a" if frac is None else f"{100 * frac:.0f}% ({r['GB/s']:.0f} GB/s)", ">= 85%")
    r = get("decode", "native")
    torch_best = min([x for x in (best("decode", "sdpa"), get("decode", "flex-attention")) if x],
                     key=lambda x: x["ms"], default=None)
    frac = r["GB/s"] * 1e9 / copy_bw if (r and copy_bw) else None
    target("decode >= 85% copy bw", None if frac is None else frac >= 0.85,
           "n/a" if frac is None else f"{100 * frac:.0f}% ({r['GB/s']:.0f} GB/s, {r['ms']:.3f} ms)", ">= 85%")
    target("decode faster than best torch", None if not (r and torch_best) else r["ms"] < torch_best["ms"],
           "n/a" if not (r and torch_best) else f"{r['ms']:.3f} vs {torch_best['ms']:.3f} ms ({torch_best['impl']})",
           "native < torch")
    r, sd = get("prefill", "native"), best("prefill", "sdpa")
    target("prefill >= 400 TFLOP/s", None if not r else r["TFLOP/s"] >= 400,
           "n/a" if not r else f"{r['TFLOP/s']:.0f} TFLOP/s ({r['ms']:.3f} ms)", ">= 400")
    w = get("prefill", "native wgmma")
    target("prefill wgmma >= 400 TFLOP/s", None if not w else w["TFLOP/s"] >= 400,
           "n/a" if not w else f"{w['TFLOP/s']:.0f} TFLOP/s ({w['ms']:.3f} ms)", ">= 400")
    target("prefill within 1.5x SDPA best", None if not (r and sd) else r["ms"] <= 1.5 * sd["ms"],
           "n/a" if not (r and sd) else f"{r['ms'] / sd['ms']:.2f}x of {sd['impl']} ({sd['ms']:.3f} ms)", "<= 1.5x")
    c, p = get("cascade", "native cascade"), get("cascade", "native plain decode")
    target("cascade >= 10x plain decode", None if not (c and p) else p["ms"] / c["ms"] >= 10,
           "n/a" if not (c and p) else f"{p['ms'] / c['ms']:.1f}x ({c['ms']:.3f} vs {p['ms']:.3f} ms)", ">= 10x")


# -- main ---------------------------------------------------------------------------------------------

def table() -> str:
    lines = ["", "== results (median) ==", f"{'case':<26}{'impl':<24}{'ms':>10}{'GB/s':>10}{'TFLOP/s':>10}"]
    for r in RESULTS:
        if r["ms"]:
            gb = f"{r['GB/s']:.1f}" if r["GB/s"] else ""
            tf = f"{r['TFLOP/s']:.1f}" if r["TFLOP/s"] else ""
            lines.append(f"{r['case']:<26}{r['impl']:<24}{r['ms']:>10.4f}{gb:>10}{tf:>10}")
        else:
            lines.append(f"{r['case']:<26}{r['impl']:<24}{'failed':>10}  {(r['error'] or '')[:60]}")
    lines += ["", "== targets ==", f"{'target':<36}{'met':<9}{'value':<48}goal"]
    for t in TARGETS:
        met = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        lines.append(f"{t['target']:<36}{met:<9}{t['value']:<48}{t['goal']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (torch.compile time)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (fp32): checks the plumbing")
    ap.add_argument("--only", default="", help="comma list of: roof,copy,decode,prefill,cascade,merge,flex")
    args = ap.parse_args(argv)
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.dry_run:
        print("no CUDA device: use --dry-run for the CPU plumbing check", file=sys.stderr)
        return 2
    args.scale = 16 if args.dry_run else 1
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    timer = Timer(device, args.quick)
    only = set(filter(None, args.only.split(",")))
    want = (lambda k: not only or k in only)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__, "device": device,
            "dtype": str(dtype), "host": platform.node(), "native": ops.native_available(),
            "native_error": ops.NATIVE_ERROR}
    if device == "cuda":
        prop = torch.cuda.get_device_properties(0)
        meta.update(gpu=prop.name, sms=prop.multi_processor_count, l2_mb=getattr(prop, "L2_cache_size", 0) / 2 ** 20)
        l2 = getattr(prop, "L2_cache_size", 50 << 20)
    else:
        l2 = 1 << 20
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    print(f"bench_kernels_gpu: {meta}", flush=True)
    copy_bw, mm_rate = roofline(timer, device, dtype, args) if want("roof") or not only else (0.0, 0.0)
    meta.update(copy_GBps=copy_bw / 1e9, matmul_TFLOPs=mm_rate / 1e12)
    stages = [("copy", lambda: bench_copy_ops(timer, device, dtype, args, copy_bw, l2)),
              ("decode", lambda: bench_decode(timer, device, dtype, args, copy_bw)),
              ("prefill", lambda: bench_prefill(timer, device, dtype, args, mm_rate)),
              ("cascade", lambda: bench_cascade(timer, device, dtype, args)),
              ("merge", lambda: bench_merge(timer, device, dtype, args, copy_bw)),
              ("flex", lambda: [job() for job in FLEX_JOBS]),
              ("prefill_wgmma", lambda: [job() for job in WGMMA_JOBS])]

    def save():
        evaluate(copy_bw)
        if args.json:  # after every stage, so a run cut short still leaves its numbers
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": RESULTS, "targets": TARGETS}, f, indent=1)

    for name, fn in stages:
        if not want(name) and not (name == "prefill_wgmma" and want("prefill")):
            continue
        print(f"-- {name}", flush=True)
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one broken stage must not hide the others
            traceback.print_exc()
            record(name, "(stage)", None, error=f"{type(exc).__name__}: {exc}")
        if device == "cuda" and name != "decode" and name != "prefill":
            torch.cuda.empty_cache()
        save()
    FLEX_JOBS.clear()
    WGMMA_JOBS.clear()
    save()
    print(table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
