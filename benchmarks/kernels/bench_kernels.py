"""Kernel microbenchmark, CPU part (not a test): the C++ attention kernels against the reference path
measured in the same run.

Reference path ("gather+sdpa") = gather the batch's pages out of the paged cache with torch indexing
(one indexing op for the whole batch: all requests have the same length here, which favours the
baseline) + torch.nn.functional.scaled_dot_product_attention with enable_gqa (bottom-right causal
mask for prefill, built once outside the timed region).

Cases (page_size 16, fp32, torch.set_num_threads(2) unless --threads says otherwise):
  decode   16 requests x 1024 context, 9 query / 3 kv heads, head_dim 64
  prefill  4 requests x 512 new tokens on 512 cached (kv_len 1024), causal, same heads

Reported: median milliseconds (native and reference calls alternate, so load on a shared machine hits
both alike; minima are in the JSON), speedup (reference / native), effective GB/s of KV read
(K and V bytes of every request's context, once, over the median time) and, for prefill, GFLOP/s.
Writes JSON (--json, default benchmarks/results/bench_kernels_cpu.json) and prints a table.

    python benchmarks/kernels/bench_kernels.py [--threads 2] [--cases decode,prefill] [--json PATH]

The builders take a device, but this script measures the CPU; the GPU numbers are
benchmarks/kernels/bench_kernels_gpu.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from minisched import ops

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")

CASES = {
    "decode": dict(batch=16, qo_len=1, kv_len=1024, hq=9, hkv=3, head_dim=64, causal=False),
    "prefill": dict(batch=4, qo_len=512, kv_len=1024, hq=9, hkv=3, head_dim=64, causal=True),
}


def build_case(
    kind: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    page_size: int = 16,
    seed: int = 0,
    **overrides,
) -> dict:
    """Inputs of one case: a shuffled page pool holding every request's KV, and its CSR page table."""
    cfg = {**CASES[kind], **overrides}
    g = torch.Generator().manual_seed(seed)
    b, kv_len, hkv, d = cfg["batch"], cfg["kv_len"], cfg["hkv"], cfg["head_dim"]
    pages_per_req = -(-kv_len // page_size)
    num_pages = b * pages_per_req + 8
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(device=device, dtype=dtype)
    perm = torch.randperm(num_pages, generator=g)[: b * pages_per_req].to(torch.int32)
    i32 = dict(dtype=torch.int32, device=device)
    case = dict(
        kind=kind,
        cfg=cfg,
        page_size=page_size,
        dtype=dtype,
        device=device,
        q=torch.randn(b * cfg["qo_len"], cfg["hq"], d, generator=g).to(device=device, dtype=dtype),
        qo_indptr=torch.arange(0, b + 1, **i32) * cfg["qo_len"],
        k_cache=k_cache,
        v_cache=v_cache,
        kv_indptr=torch.arange(0, b + 1, **i32) * pages_per_req,
        kv_indices=perm.to(device),
        kv_last_page_len=torch.full((b,), (kv_len - 1) % page_size + 1, **i32),
        sm_scale=d**-0.5,
    )
    if cfg["causal"]:  # bottom-right aligned: query i sees keys j <= kv_len - qo_len + i
        qi = torch.arange(cfg["qo_len"], device=device)[:, None]
        case["mask"] = torch.arange(kv_len, device=device)[None, :] <= kv_len - cfg["qo_len"] + qi
    return case


def native_fn(case: dict):
    """The native op (C++ on the CPU, CUDA on a GPU) with preallocated outputs."""
    c = case
    out = torch.empty_like(c["q"])
    if c["kind"] == "decode":
        args = (
            c["q"],
            c["k_cache"],
            c["v_cache"],
            c["kv_indptr"],
            c["kv_indices"],
            c["kv_last_page_len"],
            c["sm_scale"],
            out,
            None,
        )
        op = torch.ops.minisched.paged_decode_attention
    else:
        args = (
            c["q"],
            c["qo_indptr"],
            c["k_cache"],
            c["v_cache"],
            c["kv_indptr"],
            c["kv_indices"],
            c["kv_last_page_len"],
            c["cfg"]["causal"],
            c["sm_scale"],
            out,
            None,
        )
        op = torch.ops.minisched.paged_prefill_attention

    def run():
        op(*args)
        return out

    return run


def reference_fn(case: dict):
    """Gather every request's pages (torch indexing) + SDPA with GQA, batched over requests."""
    c, cfg = case, case["cfg"]
    b, qo_len, kv_len, hq, hkv, d = (cfg[k] for k in ("batch", "qo_len", "kv_len", "hq", "hkv", "head_dim"))
    idx = c["kv_indices"].long()
    mask = c.get("mask")

    def run():
        k = c["k_cache"][idx].view(b, -1, hkv, d)[:, :kv_len].transpose(1, 2)  # [B, Hkv, L, D]
        v = c["v_cache"][idx].view(b, -1, hkv, d)[:, :kv_len].transpose(1, 2)
        q = c["q"].view(b, qo_len, hq, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c["sm_scale"], enable_gqa=True)
        return o.transpose(1, 2).reshape(b * qo_len, hq, d)

    return run


def kv_bytes(case: dict) -> int:
    cfg = case["cfg"]
    return 2 * cfg["batch"] * cfg["kv_len"] * cfg["hkv"] * cfg["head_dim"] * case["k_cache"].element_size()


def flops(case: dict) -> float:
    """2 matmuls x 2 flops per multiply-add over the visible (query, key) pairs, all query heads."""
    cfg = case["cfg"]
    qo, kv = cfg["qo_len"], cfg["kv_len"]
    pairs = sum(kv - qo + i + 1 for i in range(qo)) if cfg["causal"] else qo * kv
    return 4.0 * cfg["batch"] * cfg["hq"] * cfg["head_dim"] * pairs


def time_interleaved(fns: dict, *, warmup: int, iters: int, device: str) -> dict:
    """Milliseconds per call of each fn, {name: (median, min)}; the fns alternate call by call so that
    a busy machine slows them alike."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync()
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: (1e3 * statistics.median(t), 1e3 * min(t)) for name, t in times.items()}


def bench_case(kind: str, *, device: str, dtype: torch.dtype, page_size: int, warmup: int, iters: int) -> dict:
    case = build_case(kind, device=device, dtype=dtype, page_size=page_size)
    nat, ref = native_fn(case), reference_fn(case)
    err = (nat().float() - ref().float()).abs().max().item()
    t = time_interleaved({"native": nat, "reference": ref}, warmup=warmup, iters=iters, device=device)
    (t_nat, min_nat), (t_ref, min_ref) = t["native"], t["reference"]
    nbytes, nflops = kv_bytes(case), flops(case)
    return dict(
        case=kind,
        **case["cfg"],
        page_size=page_size,
        dtype=str(dtype).removeprefix("torch."),
        native_ms=t_nat,
        reference_ms=t_ref,
        speedup=t_ref / t_nat,
        native_min_ms=min_nat,
        reference_min_ms=min_ref,
        native_gbps=nbytes / t_nat / 1e6,
        reference_gbps=nbytes / t_ref / 1e6,
        native_gflops=nflops / t_nat / 1e6,
        reference_gflops=nflops / t_ref / 1e6,
        max_abs_err=err,
    )


def table(rows: list[dict]) -> str:
    head = (
        f"{'case':8} {'dtype':8} {'native ms':>10} {'gather+sdpa ms':>15} {'speedup':>8} "
        f"{'native GB/s':>12} {'ref GB/s':>9} {'native GFLOP/s':>15} {'max err':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['case']:8} {r['dtype']:8} {r['native_ms']:10.3f} {r['reference_ms']:15.3f} "
            f"{r['speedup']:7.2f}x {r['native_gbps']:12.2f} {r['reference_gbps']:9.2f} "
            f"{r['native_gflops']:15.2f} {r['max_abs_err']:9.1e}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (this script's purpose); GPU numbers: bench_kernels_gpu.py")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--cases", default="decode,prefill")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=os.path.join(RESULTS_DIR, "bench_kernels_cpu.json"))
    args = ap.parse_args()
    if not ops.native_available():
        sys.exit(ops.NATIVE_ERROR)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = [
        bench_case(
            kind, device=args.device, dtype=dtype, page_size=args.page_size, warmup=args.warmup, iters=args.iters
        )
        for kind in args.cases.split(",")
    ]
    meta = dict(
        device=args.device,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        machine=platform.machine(),
        processor=platform.processor() or platform.platform(),
        time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        loadavg=os.getloadavg() if hasattr(os, "getloadavg") else None,
        cpus=os.cpu_count(),
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=2)
    print(
        f"# bench_kernels device={args.device} threads={meta['threads']} torch={meta['torch']} "
        f"page_size={args.page_size} load={meta['loadavg'][0] if meta['loadavg'] else float('nan'):.1f}/{meta['cpus']} cpus "
        "(reference = gather pages + SDPA, same run, calls interleaved; medians)"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
