"""Kernel microbenchmark on the GPU (not a test): every minisched op, backends "native" (CUDA) and
"triton", against torch's own paths measured in the same run, with the device's measured copy
bandwidth and bf16 matmul rate as the roofline references.

Baselines on the dense equivalent of the paged problem: F.scaled_dot_product_attention under each
SDPA backend (flash / cudnn / efficient, via torch.nn.attention.sdpa_kernel, enable_gqa=True),
FlexAttention (torch.compile'd, its own stage, last) where it works, FlashInfer where it is importable.

Timing: triton.testing.do_bench (median; it flushes L2 between runs) or CUDA events; random data;
the copy ops rotate over input sets larger than the L2 cache. Cascade decode is several launches
(shared prefix, suffix decode, merge), so it is timed eagerly and replayed from a CUDA graph, where
the launch overhead is gone; plain paged decode beside it the same two ways.

Targets (one row each, with the best torch path's figure from the same run):
  copy ops (store_kv, copy/gather/scatter_kv_pages, tens of MB)  >= 85% of measured copy bandwidth
  decode  (B 64, ctx 4096, 32/8 heads, d128, bf16)              >= 85% of copy bandwidth, faster than
                                                                  the best torch path
  prefill (8 x 2048 causal, 32/8 heads, d128, bf16)              >= 400 TFLOP/s, <= 1.5x SDPA's best
  prefill, the wgmma kernel (cuda_kernel="wgmma", same shape)    >= 400 TFLOP/s, after its output
                                                                  matched the mma.sync kernel's in this run
  cascade (64 requests sharing a 4096 prefix + 256 own tokens)  >= 10x faster than plain paged decode,
                                                                  eager and under a CUDA graph
(the mma.sync prefill kernel is not expected to reach 400: csrc/cuda/NOTES.md)

Stages (--only, comma list; default all, in this order): roof, copy, decode, prefill, cascade, merge,
wgmma, flex. The wgmma kernel has never run on hardware and a fault would take the CUDA context of
every later stage with it, so it runs after the others; benchmarks/device_check.sh runs it in a
process of its own (`--only wgmma`) first, the rest without flex, and flex last (`--only flex`).
`--merge A.json B.json ...` joins such runs' results and evaluates the targets over all of them.

Usage:  python benchmarks/kernels/bench_kernels_gpu.py [--json PATH] [--quick] [--no-flex] [--only STAGES]
        python benchmarks/kernels/bench_kernels_gpu.py --merge W.json B.json F.json --json ALL.json
        python benchmarks/kernels/bench_kernels_gpu.py --dry-run     # tiny shapes on the CPU: plumbing only
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

import torch
import torch.nn.functional as F

from minisched import ops

RESULTS: list[dict] = []
TARGETS: list[dict] = []
STAGES = ("roof", "copy", "decode", "prefill", "cascade", "merge", "wgmma", "flex")
# torch's own paths: a target's "best torch path" (not FlashInfer, not minisched's reference backend "torch")
TORCH_IMPLS = ("sdpa", "flex-attention", "torch ")


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


def record(
    case: str,
    impl: str,
    ms: float | None,
    *,
    bytes_moved: float = 0.0,
    flops: float = 0.0,
    error: str | None = None,
    **extra,
) -> dict:
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


def best(case: str, prefix: str | tuple = "") -> dict | None:
    """The fastest successful row of `case` whose impl starts with `prefix` (a string or a tuple of them)."""
    rows = [r for r in RESULTS if r["case"] == case and r["ms"] and r["impl"].startswith(prefix)]
    return min(rows, key=lambda r: r["ms"]) if rows else None


def get(case: str, impl: str) -> dict | None:
    for r in RESULTS:
        if r["case"] == case and r["impl"] == impl and r["ms"]:
            return r
    return None


def target(name: str, met: bool | None, value: str, goal: str, torch_best: str = "n/a") -> None:
    TARGETS.append({"target": name, "met": met, "value": value, "goal": goal, "torch": torch_best})


def graphed(fn):
    """fn captured once into a CUDA graph (after a warm-up on a side stream); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


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
    return [
        ("sdpa-flash", SDPBackend.FLASH_ATTENTION, sdpa_kernel),
        ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION, sdpa_kernel),
        ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION, sdpa_kernel),
        ("sdpa-math", SDPBackend.MATH, sdpa_kernel),
    ]


def time_sdpa(timer, case, q, k, v, causal, kw, device, skip_math=True):
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] dense; every SDPA backend (GQA via enable_gqa)."""
    if device != "cuda":
        attempt(
            timer,
            case,
            "sdpa-default",
            lambda: lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
            **kw,
        )
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
            mask = create_block_mask(
                lambda b, h, qi, ki: ki <= qi + (lk - lq), B=None, H=None, Q_LEN=lq, KV_LEN=lk, device=q.device
            )

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
    r = attempt(timer, "ref:copy", "torch copy_", lambda: lambda: b.copy_(a), bytes_moved=2 * n)
    copy_bw = (r["GB/s"] or 0.0) * 1e9
    m = 8192 if device == "cuda" else 256
    x, y = randn((m, m), dtype, device), randn((m, m), dtype, device)
    r = attempt(timer, "ref:matmul", f"torch mm {str(dtype)[6:]}", lambda: lambda: x @ y, flops=2 * m**3)
    mm_rate = (r["TFLOP/s"] or 0.0) * 1e12
    if device == "cuda":
        host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        attempt(
            timer,
            "ref:d2h-pinned",
            "torch copy_",
            lambda: lambda: host.copy_(dev, non_blocking=True),
            bytes_moved=host.numel(),
        )
        attempt(
            timer,
            "ref:h2d-pinned",
            "torch copy_",
            lambda: lambda: dev.copy_(host, non_blocking=True),
            bytes_moved=host.numel(),
        )
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
    dsts = [p[n_move : 2 * n_move].contiguous() for p in perm]
    bufs = [torch.empty((pool.shape[0], 2, n_move, ps, hkv, d), dtype=dtype, device=device) for _ in range(sets)]
    mb = moved / 2**20
    for be in backends_for(device):
        kw = dict(bytes_moved=2 * moved, MB=mb)
        attempt(
            timer,
            "copy_kv_pages",
            be,
            lambda: [
                (lambda i=i: ops.call_op("copy_kv_pages", (pool, srcs[i], dsts[i]), be, check=False))
                for i in range(sets)
            ],
            **kw,
        )
        attempt(
            timer,
            "gather_kv_pages",
            be,
            lambda: [
                (lambda i=i: ops.call_op("gather_kv_pages", (pool, srcs[i], bufs[i]), be, check=False))
                for i in range(sets)
            ],
            **kw,
        )
        attempt(
            timer,
            "scatter_kv_pages",
            be,
            lambda: [
                (lambda i=i: ops.call_op("scatter_kv_pages", (bufs[i], pool, dsts[i]), be, check=False))
                for i in range(sets)
            ],
            **kw,
        )
    if device == "cuda":
        host = torch.empty(bufs[0].shape, dtype=dtype, pin_memory=True)
        for be in backends_for(device):
            attempt(
                timer,
                "gather_kv_pages->pinned",
                be,
                lambda: lambda: ops.call_op("gather_kv_pages", (pool, srcs[0], host), be, check=False),
                bytes_moved=moved,
                MB=mb,
            )
            attempt(
                timer,
                "scatter_kv_pages<-pinned",
                be,
                lambda: lambda: ops.call_op("scatter_kv_pages", (host, pool, dsts[0]), be, check=False),
                bytes_moved=moved,
                MB=mb,
            )
    # torch baseline: index_select over the page dim (gather) and index_copy_ (scatter)
    attempt(
        timer,
        "gather_kv_pages",
        "torch index_select",
        lambda: [(lambda i=i: torch.index_select(pool, 2, srcs[i].long(), out=bufs[i])) for i in range(sets)],
        bytes_moved=2 * moved,
        MB=mb,
    )

    # store_kv: one prefill chunk of tokens into one layer's caches
    n_tok = 16384 // s
    kc = randn((max(n_tok // ps * 4, 64), ps, hkv, d), dtype, device)
    vc = torch.empty_like(kc)
    ks = [randn((n_tok, hkv, d), dtype, device) for _ in range(2)]
    vs = [randn((n_tok, hkv, d), dtype, device) for _ in range(2)]
    slots = [torch.randperm(kc.shape[0] * ps, device=device)[:n_tok].to(torch.int32) for _ in range(2)]
    tok_bytes = 2 * n_tok * hkv * d * kc.element_size()
    for be in backends_for(device):
        attempt(
            timer,
            "store_kv",
            be,
            lambda: [
                (lambda i=i: ops.call_op("store_kv", (ks[i], vs[i], kc, vc, slots[i]), be, check=False))
                for i in range(2)
            ],
            bytes_moved=2 * tok_bytes,
            MB=tok_bytes / 2**20,
        )
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    attempt(
        timer,
        "store_kv",
        "torch index_copy_",
        lambda: [
            (lambda i=i: (flat_k.index_copy_(0, slots[i].long(), ks[i]), flat_v.index_copy_(0, slots[i].long(), vs[i])))
            for i in range(2)
        ],
        bytes_moved=2 * tok_bytes,
        MB=tok_bytes / 2**20,
    )


def decode_shape(args):
    s = args.scale
    return 64 // s, 4096 // s, 32, 8, 128, 16  # B, ctx, hq, hkv, d, page_size


def bench_decode(timer, device, dtype, args, copy_bw):
    B, ctx, hq, hkv, d, ps = decode_shape(args)
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
        attempt(
            timer,
            case,
            be,
            lambda: (
                lambda: ops.call_op("paged_decode_attention", (q, kc, vc, *table, d**-0.5, out, lse), be, check=False)
            ),
            **kw,
        )
    # dense equivalents (contiguous K/V per request: what the paged layout avoids)
    qd = q.view(B, hq, 1, d)
    kd = randn((B, hkv, ctx, d), dtype, device)
    vd = randn((B, hkv, ctx, d), dtype, device)
    time_sdpa(timer, case, qd, kd, vd, False, kw, device)
    if device == "cuda":
        bench_flashinfer_decode(timer, case, q, kc, vc, table, hq, hkv, d, ps, kw)


def bench_flashinfer_decode(timer, case, q, kc, vc, table, hq, hkv, d, ps, kw):
    def make():
        import flashinfer

        ws = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(table[0], table[1], table[2], hq, hkv, d, ps, data_type=q.dtype, q_data_type=q.dtype)
        return lambda: w.run(q, (kc, vc))

    attempt(timer, case, "flashinfer", make, **kw)


def prefill_inputs(device, dtype, args):
    """The prefill case's paged inputs and its row's metadata (flops, shape)."""
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
    kw = dict(flops=flops, shape=f"{B}x{L} causal {hq}/{hkv} d{d} ps{ps}")
    return dict(q=q, qo=qo, kc=kc, vc=vc, table=table, d=d, out=out, lse=lse, dense=(B, L, hq, hkv, d)), kw


def bench_prefill(timer, device, dtype, args, mm_rate):
    x, kw = prefill_inputs(device, dtype, args)
    q, qo, kc, vc, table, d, out, lse = (x[k] for k in ("q", "qo", "kc", "vc", "table", "d", "out", "lse"))
    for be in backends_for(device):
        attempt(
            timer,
            "prefill",
            be,
            lambda: (
                lambda: ops.call_op(
                    "paged_prefill_attention", (q, qo, kc, vc, *table, True, d**-0.5, out, lse), be, check=False
                )
            ),
            **kw,
        )
    B, L, hq, hkv, d = x["dense"]
    qd = randn((B, hq, L, d), dtype, device)
    kd = randn((B, hkv, L, d), dtype, device)
    vd = randn((B, hkv, L, d), dtype, device)
    time_sdpa(timer, "prefill", qd, kd, vd, True, kw, device)


def bench_prefill_wgmma(timer, device, dtype, args):
    """cuda_kernel="wgmma" (schema kernel=2): first its output against the mma.sync kernel's on the same inputs
    (a wrong kernel gets no speed recorded), then timed as "native wgmma" (and "native mma" beside it)."""
    case = "prefill"
    x, kw = prefill_inputs(device, dtype, args)
    if device != "cuda" or not ops.native_available() or torch.cuda.get_device_capability() != (9, 0):
        record(case, "native wgmma", None, error="needs the native kernels on an sm_90 device", **kw)
        return
    q, qo, kc, vc, table, d, out, lse = (x[k] for k in ("q", "qo", "kc", "vc", "table", "d", "out", "lse"))

    def run(kernel, o, l):
        ops.call_op(
            "paged_prefill_attention", (q, qo, kc, vc, *table, True, d**-0.5, o, l, kernel), "native", check=False
        )

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
    attempt(timer, case, "native mma", lambda: lambda: run(1, out, lse), **kw)
    attempt(timer, case, "native wgmma", lambda: lambda: run(2, out, lse), **kw)


def bench_flex(timer, device, dtype, args):
    """FlexAttention (torch.compile) on the decode and prefill cases' dense equivalents: the slowest stage
    to start (compile time) and a torch path, so it runs last."""
    if device != "cuda":
        print("  (FlexAttention: CUDA only)", flush=True)
        return
    B, ctx, hq, hkv, d, ps = decode_shape(args)
    kw = dict(
        bytes_moved=2 * B * ctx * hkv * d * torch.empty((), dtype=dtype).element_size(),
        shape=f"B{B} ctx{ctx} {hq}/{hkv} d{d} ps{ps}",
    )
    time_flex(
        timer,
        "decode",
        randn((B, hq, 1, d), dtype, device),
        randn((B, hkv, ctx, d), dtype, device),
        randn((B, hkv, ctx, d), dtype, device),
        False,
        kw,
    )
    x, kw = prefill_inputs(device, dtype, args)
    B, L, hq, hkv, d = x["dense"]
    del x
    time_flex(
        timer,
        "prefill",
        randn((B, hq, L, d), dtype, device),
        randn((B, hkv, L, d), dtype, device),
        randn((B, hkv, L, d), dtype, device),
        True,
        kw,
    )


def bench_cascade(timer, device, dtype, args):
    s = args.scale
    n, prefix, suffix, hq, hkv, d, ps = 64 // s, 4096 // s, 256 // s, 32, 8, 128, 16
    pre_pages, suf_pages = prefix // ps, suffix // ps
    num_pages = pre_pages + n * suf_pages + 8
    kc = randn((num_pages, ps, hkv, d), dtype, device)
    vc = randn((num_pages, ps, hkv, d), dtype, device)
    perm = torch.randperm(num_pages, device=device).to(torch.int32)
    pre = perm[:pre_pages]
    own = perm[pre_pages : pre_pages + n * suf_pages].view(n, suf_pages)
    i32 = dict(dtype=torch.int32, device=device)
    full_idx = torch.cat([torch.cat([pre, own[i]]) for i in range(n)])
    full = (
        torch.arange(0, n * (pre_pages + suf_pages) + 1, pre_pages + suf_pages, **i32),
        full_idx,
        torch.full((n,), ps, **i32),
    )
    suf = (
        torch.arange(0, n * suf_pages + 1, suf_pages, **i32),
        own.reshape(-1).contiguous(),
        torch.full((n,), ps, **i32),
    )
    pre_t = (torch.tensor([0, pre_pages], **i32), pre.contiguous(), torch.full((1,), ps, **i32))
    group = torch.tensor([0, n], **i32)
    q = randn((n, hq, d), dtype, device)
    bytes_unique = 2 * (prefix + n * suffix) * hkv * d * kc.element_size()
    case = "cascade"
    kw = dict(bytes_moved=bytes_unique, shape=f"{n} reqs, prefix {prefix}, suffix {suffix}, {hq}/{hkv} d{d}")
    for be in backends_for(device):

        def cascade(be=be):
            return ops.cascade_decode_attention(q, group, kc, vc, pre_t, suf, backend=be, check=False)

        def plain(be=be):
            return ops.paged_decode_attention(q, kc, vc, *full, backend=be, check=False)

        attempt(timer, case, f"{be} cascade", lambda: cascade, **kw)
        attempt(timer, case, f"{be} plain decode", lambda: plain, **kw)
        if device == "cuda":  # the launches replayed from one graph: the kernels' time, not the launch overhead
            attempt(timer, case, f"{be} cascade graph", lambda: graphed(cascade), **kw)
            attempt(timer, case, f"{be} plain decode graph", lambda: graphed(plain), **kw)


def bench_merge(timer, device, dtype, args, copy_bw):
    n, h, d = 16384 // args.scale, 32, 128
    va, vb = randn((n, h, d), dtype, device), randn((n, h, d), dtype, device)
    la, lb = randn((n, h), torch.float32, device), randn((n, h), torch.float32, device)
    vo, lo = torch.empty_like(va), torch.empty_like(la)
    moved = 3 * va.numel() * va.element_size() + 3 * la.numel() * 4
    for be in backends_for(device):
        attempt(
            timer,
            "merge_attention_states",
            be,
            lambda: lambda: ops.call_op("merge_attention_states", (va, la, vb, lb, vo, lo), be),
            bytes_moved=moved,
        )


# -- targets -----------------------------------------------------------------------------------------


def fmt(r: dict | None, copy_bw: float = 0.0) -> str:
    """One result as 'impl 0.123 ms, 2950 GB/s (69%)' / '..., 310 TFLOP/s'; 'n/a' when missing."""
    if not r:
        return "n/a"
    out = f"{r['impl']} {r['ms']:.3f} ms"
    if r.get("GB/s"):
        out += f", {r['GB/s']:.0f} GB/s" + (f" ({100 * r['GB/s'] * 1e9 / copy_bw:.0f}%)" if copy_bw else "")
    if r.get("TFLOP/s"):
        out += f", {r['TFLOP/s']:.0f} TFLOP/s"
    return out


def evaluate(copy_bw: float) -> None:
    """The targets, from the results so far (re-evaluated after every stage and by --merge)."""
    TARGETS.clear()
    frac = lambda r: r["GB/s"] * 1e9 / copy_bw if (r and r.get("GB/s") and copy_bw) else None
    # decode
    r, tb = get("decode", "native"), best("decode", TORCH_IMPLS)
    target(
        "decode >= 85% copy bw",
        None if frac(r) is None else frac(r) >= 0.85,
        fmt(r, copy_bw),
        ">= 85%",
        fmt(tb, copy_bw),
    )
    target(
        "decode faster than best torch",
        None if not (r and tb) else r["ms"] < tb["ms"],
        "n/a" if not (r and tb) else f"{r['ms']:.3f} ms = {tb['ms'] / r['ms']:.2f}x torch's speed",
        "native < torch",
        fmt(tb, copy_bw),
    )
    # prefill: mma.sync ("native", cuda_kernel auto) and wgmma
    r, sd = get("prefill", "native"), best("prefill", TORCH_IMPLS)
    tflops = lambda x: None if not (x and x.get("TFLOP/s")) else x["TFLOP/s"] >= 400
    target("prefill mma.sync >= 400 TFLOP/s", tflops(r), fmt(r), ">= 400", fmt(sd))
    target(
        "prefill mma.sync <= 1.5x torch best",
        None if not (r and sd) else r["ms"] <= 1.5 * sd["ms"],
        "n/a" if not (r and sd) else f"{r['ms'] / sd['ms']:.2f}x of {sd['impl']}",
        "<= 1.5x",
        fmt(sd),
    )
    w = get("prefill", "native wgmma")
    werr = next(
        (x["error"] for x in RESULTS if x["case"] == "prefill" and x["impl"] == "native wgmma" and not x["ms"]), None
    )
    target(
        "prefill wgmma >= 400 TFLOP/s",
        tflops(w) if w else (False if werr and "differs" in werr else None),
        fmt(w) if w else (f"failed: {werr[:60]}" if werr else "n/a"),
        ">= 400, equal to mma.sync",
        fmt(sd),
    )
    # cascade: eager and replayed from a CUDA graph
    for how, suffix in (("eager", ""), ("graph", " graph")):
        c, p = get("cascade", f"native cascade{suffix}"), get("cascade", f"native plain decode{suffix}")
        target(
            f"cascade >= 10x plain decode, {how}",
            None if not (c and p) else p["ms"] / c["ms"] >= 10,
            "n/a" if not (c and p) else f"{p['ms'] / c['ms']:.1f}x ({c['ms']:.4f} vs {p['ms']:.4f} ms)",
            ">= 10x",
        )
    # KV copy ops (torch: index_select / index_copy_ where measured, else the copy_ roofline)
    roof = get("ref:copy", "torch copy_")
    for case in ("store_kv", "copy_kv_pages", "gather_kv_pages", "scatter_kv_pages"):
        r = get(case, "native")
        target(
            f"{case} >= 85% copy bw",
            None if frac(r) is None else frac(r) >= 0.85,
            fmt(r, copy_bw),
            ">= 85%",
            fmt(best(case, TORCH_IMPLS) or roof, copy_bw),
        )
    r = get("merge_attention_states", "native")
    target("merge_attention_states (no target)", None, fmt(r, copy_bw), "-", fmt(roof, copy_bw))


# -- main ---------------------------------------------------------------------------------------------


def table() -> str:
    lines = ["", "== results (median) ==", f"{'case':<26}{'impl':<26}{'ms':>10}{'GB/s':>10}{'TFLOP/s':>10}"]
    for r in RESULTS:
        if r["ms"]:
            gb = f"{r['GB/s']:.1f}" if r["GB/s"] else ""
            tf = f"{r['TFLOP/s']:.1f}" if r["TFLOP/s"] else ""
            lines.append(f"{r['case']:<26}{r['impl']:<26}{r['ms']:>10.4f}{gb:>10}{tf:>10}")
        else:
            lines.append(f"{r['case']:<26}{r['impl']:<26}{'failed':>10}  {(r['error'] or '')[:60]}")
    return "\n".join(lines + ["", "== targets =="] + target_lines(TARGETS))


def target_lines(targets: list[dict]) -> list[str]:
    """The targets as a table: met, target, goal, value (minisched), best torch path (same run)."""
    lines = [f"{'met':<8} {'target':<38} {'goal':<26} {'value':<44} best torch path"]
    for t in targets:
        met = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        lines.append(f"{met:<8} {t['target']:<38} {t['goal']:<26} {t['value']:<44} {t.get('torch', 'n/a')}")
    return lines


def merge(paths: list[str], out: str | None) -> int:
    """Join the results of several runs (e.g. device_check's wgmma, main and flex stages) and evaluate."""
    meta: dict = {}
    for path in paths:
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as exc:
            print(f"merge: skipping {path}: {exc}", file=sys.stderr)
            continue
        RESULTS.extend(d.get("results", []))
        m = d.get("meta", {})
        if not meta or (m.get("copy_GBps") and not meta.get("copy_GBps")):
            meta = {**meta, **m}
    evaluate((meta.get("copy_GBps") or 0.0) * 1e9)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"meta": meta, "results": RESULTS, "targets": TARGETS, "merged_from": paths}, f, indent=1)
    print(table(), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (torch.compile time)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (fp32): checks the plumbing")
    ap.add_argument("--only", default="", help="comma list of stages: " + ",".join(STAGES))
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="join these runs' results, evaluate the targets over all of them (with --json: write)",
    )
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.json)
    only = set(filter(None, args.only.split(",")))
    if only - set(STAGES):
        ap.error(f"--only: unknown stage(s) {sorted(only - set(STAGES))}; stages: {','.join(STAGES)}")
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.dry_run:
        print("no CUDA device: use --dry-run for the CPU plumbing check", file=sys.stderr)
        return 2
    args.scale = 16 if args.dry_run else 1
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    timer = Timer(device, args.quick)
    want = lambda k: k in only if only else not (k == "flex" and args.no_flex)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": torch.__version__,
        "device": device,
        "dtype": str(dtype),
        "host": platform.node(),
        "native": ops.native_available(),
        "native_error": ops.NATIVE_ERROR,
        "stages": [k for k in STAGES if want(k)],
    }
    if device == "cuda":
        prop = torch.cuda.get_device_properties(0)
        meta.update(gpu=prop.name, sms=prop.multi_processor_count, l2_mb=getattr(prop, "L2_cache_size", 0) / 2**20)
        l2 = getattr(prop, "L2_cache_size", 50 << 20)
    else:
        l2 = 1 << 20
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    print(f"bench_kernels_gpu: {meta}", flush=True)
    copy_bw = mm_rate = 0.0

    def roof():
        nonlocal copy_bw, mm_rate
        copy_bw, mm_rate = roofline(timer, device, dtype, args)
        meta.update(copy_GBps=copy_bw / 1e9, matmul_TFLOPs=mm_rate / 1e12)

    stages = {
        "roof": roof,
        "copy": lambda: bench_copy_ops(timer, device, dtype, args, copy_bw, l2),
        "decode": lambda: bench_decode(timer, device, dtype, args, copy_bw),
        "prefill": lambda: bench_prefill(timer, device, dtype, args, mm_rate),
        "cascade": lambda: bench_cascade(timer, device, dtype, args),
        "merge": lambda: bench_merge(timer, device, dtype, args, copy_bw),
        "wgmma": lambda: bench_prefill_wgmma(timer, device, dtype, args),
        "flex": lambda: bench_flex(timer, device, dtype, args),
    }

    def save():
        evaluate(copy_bw)
        if args.json:  # after every stage, so a run cut short still leaves its numbers
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": RESULTS, "targets": TARGETS}, f, indent=1)

    for name in STAGES:
        if not want(name):
            continue
        print(f"-- {name}", flush=True)
        try:
            stages[name]()
        except Exception as exc:  # noqa: BLE001 - one broken stage must not hide the others
            traceback.print_exc()
            record(name, "(stage)", None, error=f"{type(exc).__name__}: {exc}")
        if device == "cuda":
            torch.cuda.empty_cache()
        save()
    save()
    print(table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
