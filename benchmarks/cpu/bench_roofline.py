"""Prefill against the machine's measured float32 FMA peak (issue #37 item 3) -- not a test.

    python benchmarks/cpu/bench_roofline.py [--threads 2] [--rows 512] [--prefill-len 512] [--rounds 3]
        [--json out.json] [--md out.md]

Three figures, each as GFLOP/s and as a fraction of the peak:
- the peak: fma_peak.c (built here with gcc into a temporary folder and loaded with ctypes), 12 or 16
  independent FMA chains per thread on registers only, ymm (AVX2) and, where the CPU has AVX-512, zmm;
  `--threads` threads (OpenMP), best of 5. Measured before and after the rest: a drop means the machine
  changed during the run.
- packed_linear and F.linear (MKL sgemm) at `--rows` rows on SmolLM2's four projection shapes
  (2 M N K flops per call), alternated, median of `--rounds` rounds.
- the end-to-end prefill: one `--prefill-len`-token prompt through `Engine("smollm2")` (one new token),
  per `--quantize` mode (default: none, the float32 weights, and auto, the default: gguf here), alternated,
  median of `--rounds` runs; flops = the projections (2 L sum N K per layer) +
  causal attention (QK and PV: 2 x 2 x heads x head_dim x L(L+1)/2 per layer) + the LM head for the one
  sampled row. /proc/loadavg and the kernel ISA are recorded.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minisched import ops
from minisched.base.cpus import loadavg

HERE = Path(__file__).resolve().parent
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
CHAINS = {8: 12, 16: 16}  # fma_peak.c: chains per thread, by lanes


def build_peak() -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp(prefix="fma_peak_")) / "fma_peak.so"
    subprocess.run(["gcc", "-O2", "-fopenmp", "-shared", "-fPIC", "-o", str(out), str(HERE / "fma_peak.c")], check=True)
    lib = ctypes.CDLL(str(out))
    for name in ("fma_ymm", "fma_zmm"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [ctypes.c_int64, ctypes.c_int], ctypes.c_float
    return lib


def peak_gflops(lib: ctypes.CDLL, width: int, threads: int, seconds: float = 0.3) -> float:
    """Best of 5 runs of ~seconds each: 2 flops x width lanes x chains x iters x threads."""
    fn = lib.fma_zmm if width == 16 else lib.fma_ymm
    iters = 1 << 20
    while True:  # calibrate to ~seconds
        t = time.perf_counter()
        fn(iters, threads)
        dt = time.perf_counter() - t
        if dt > seconds / 4:
            break
        iters *= 4
    iters = int(iters * seconds / dt)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        fn(iters, threads)
        dt = time.perf_counter() - t
        best = max(best, 2 * width * CHAINS[width] * iters * threads / dt / 1e9)
    return best


def timed(fn, seconds: float) -> float:
    """Median seconds per call over ~seconds of calls (after one warm call)."""
    fn()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def linears(rows: int, rounds: int) -> dict:
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) / k**0.5
        wp = ops.pack_linear_weight(w)
        x = torch.randn(rows, k)
        flops = 2 * rows * n * k
        per = {"packed": [], "mkl": []}
        for r in range(rounds):
            order = ("packed", "mkl") if r % 2 == 0 else ("mkl", "packed")
            for which in order:
                if which == "packed":
                    s = timed(lambda: ops.packed_linear(x, wp, n), 0.3)
                else:
                    s = timed(lambda: F.linear(x, w), 0.3)
                per[which].append(flops / s / 1e9)
        out[name] = {k2: statistics.median(v) for k2, v in per.items()} | {"gflop": flops / 1e9}
    return out


def prefill_flops(cfg, length: int) -> float:
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d * h
    o = h * cfg.num_heads * d
    mlp = 3 * h * cfg.intermediate_size
    proj = 2 * length * (qkv + o + mlp) * cfg.num_layers
    attn = 2 * 2 * cfg.num_heads * d * length * (length + 1) / 2 * cfg.num_layers
    head = 2 * cfg.vocab_size * h
    return proj + attn + head


def prefill(length: int, rounds: int, threads: int, modes: list[str]) -> dict:
    """Each --quantize mode's engine (none: the float32 weights; auto: the default), alternated per round."""
    import numpy as np

    from minisched import Engine, SamplingParams

    engines = {m: Engine("smollm2", num_threads=threads, quantize=m) for m in modes}
    sp = SamplingParams(max_new_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)
    secs: dict[str, list[float]] = {m: [] for m in modes}
    for engine in engines.values():
        engine.generate([rng.integers(100, 40000, size=length).tolist()], sp)  # warm
    for r in range(rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            ids = rng.integers(100, 40000, size=length).tolist()  # fresh ids: no prefix-cache hit
            t = time.perf_counter()
            engines[m].generate([ids], sp)
            secs[m].append(time.perf_counter() - t)
    flops = prefill_flops(next(iter(engines.values())).cfg, length)
    out = {}
    for m, e in engines.items():
        s = statistics.median(secs[m])
        out[m] = dict(quantize=e.quant.mode, tokens=length, seconds=s, gflop=flops / 1e9, gflops=flops / s / 1e9)
        out[m] |= dict(tok_s=length / s, rounds_s=secs[m])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quantize", nargs="+", default=["none", "auto"], help="the prefill's weight formats")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lib = build_peak()
    widths = [8, 16] if "avx512" in ops.supported_cpu_isas() else [8]
    la0 = loadavg()
    peak0 = {w: peak_gflops(lib, w, args.threads) for w in widths}
    lin = linears(args.rows, args.rounds)
    pre = prefill(args.prefill_len, args.rounds, args.threads, args.quantize)
    peak1 = {w: peak_gflops(lib, w, args.threads) for w in widths}
    peak = max(max(peak0.values()), max(peak1.values()))
    res = dict(
        isa=ops.cpu_isa(),
        threads=args.threads,
        loadavg_before=la0,
        loadavg_after=loadavg(),
        peak_before={f"{32 * w}-bit": v for w, v in peak0.items()},
        peak_after={f"{32 * w}-bit": v for w, v in peak1.items()},
        peak=peak,
        linears=lin,
        rows=args.rows,
        prefill=pre,
    )
    lines = [
        f"FMA peak, {args.threads} threads (before / after): "
        + ", ".join(f"{32 * w}-bit {peak0[w]:.0f} / {peak1[w]:.0f} GFLOP/s" for w in widths),
        f"isa {res['isa']}, load {la0} -> {res['loadavg_after']}",
        "",
        f"| at {args.rows} rows | packed_linear GFLOP/s (of peak) | MKL GFLOP/s (of peak) | packed / MKL |",
        "|---|---|---|---|",
    ]
    for name, v in lin.items():
        lines.append(
            f"| {name} | {v['packed']:.0f} ({v['packed'] / peak:.0%}) | {v['mkl']:.0f} ({v['mkl'] / peak:.0%}) "
            f"| {v['packed'] / v['mkl']:.2f}x |"
        )
    for m, v in pre.items():
        lines.append(
            f"\nprefill {v['tokens']} tokens, --quantize {m} ({v['quantize']}): {v['seconds'] * 1e3:.0f} ms, "
            f"{v['gflop']:.1f} GFLOP, {v['gflops']:.0f} GFLOP/s = {v['gflops'] / peak:.0%} of the peak "
            f"({v['tok_s']:.0f} tok/s)"
        )
    text = "\n".join(lines)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.md:
        Path(args.md).write_text(text + "\n")


if __name__ == "__main__":
    main()
