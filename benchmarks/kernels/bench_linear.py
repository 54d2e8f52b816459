"""The packed float32 matmul (csrc/cpu/packed_linear.cpp) against torch's F.linear (MKL sgemm here)
on SmolLM2-135M's projection shapes -- not a test.

    python benchmarks/kernels/bench_linear.py [--rows 1 2 4 8 16 32 64 512] [--threads 1 2] [--rounds 3]
        [--isa avx2 avx512] [--json out.json]

For each thread count, row count M and projection ([N, K]: qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536, lm_head 49152x576), F.linear and packed_linear under each --isa variant
(default: every one this machine supports; ops.use_cpu_isa) run alternately (A, B, C, C, B, A, ...)
for --rounds rounds of ~0.2 s each on fresh random inputs; reported: median microseconds per call,
GFLOP/s and the speedups (median of the per-round ratios) over F.linear and over the first variant. The weights are the same tensors every call, so the
small ones are cache-resident (a decode step streams them from memory: the model-level numbers are
in benchmarks/cpu/bench_cpu.py); the 113 MB LM head is not. /proc/loadavg is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from minisched import ops
from minisched.base.cpus import loadavg

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def per_call(fn, seconds: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        fn()
        n += 1
    return elapsed / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 512])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.2, help="per timed run")
    p.add_argument("--isa", nargs="+", default=None, help="packed_linear's ISA variants (default: all supported)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    isas = args.isa or ops.supported_cpu_isas()
    results = {"load_before": loadavg(), "isas": isas, "cpu": ops.cpu_features(), "runs": []}
    print(f"load {results['load_before']}; packed_linear variants {isas}")
    print(
        f"{'thr':>3} {'M':>4} {'shape':>8} {'aten us':>9} "
        + " ".join(f"{isa + ' us':>12} {'GFLOP/s':>8} {'x aten':>7}" for isa in isas)
        + (f" {isas[-1] + '/' + isas[0]:>14}" if len(isas) > 1 else "")
    )
    for threads in args.threads:
        torch.set_num_threads(threads)
        for m in args.rows:
            for name in args.shapes:
                n, k = SHAPES[name]
                if name == "lm_head" and m > 64:
                    continue  # prefill computes logits for the last row only
                g = torch.Generator().manual_seed(m * 7 + n)
                w, x = torch.randn(n, k, generator=g) * 0.05, torch.randn(m, k, generator=g)
                wp, out = ops.pack_linear_weight(w), torch.empty(m, n)
                torch.testing.assert_close(ops.packed_linear(x, wp, n, out=out), F.linear(x, w), rtol=1e-4, atol=1e-4)

                fns = [("aten", None, lambda: F.linear(x, w))]
                fns += [(isa, isa, lambda: ops.packed_linear(x, wp, n, out=out)) for isa in isas]
                times = {label: [] for label, _, _ in fns}
                for r in range(args.rounds):
                    for label, isa, fn in fns if r % 2 == 0 else fns[::-1]:
                        with ops.use_cpu_isa(isa):  # (None: the default, for F.linear)
                            times[label].append(per_call(fn, args.seconds))
                med = {label: statistics.median(v) for label, v in times.items()}
                ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))  # noqa: E731
                row = dict(
                    threads=threads,
                    rows=m,
                    shape=name,
                    n=n,
                    k=k,
                    aten_us=med["aten"],
                    packed_us={isa: med[isa] for isa in isas},
                    speedup={isa: ratio("aten", isa) for isa in isas},
                    packed_gflops={isa: 2 * m * n * k / med[isa] / 1e3 for isa in isas},
                    isa_speedup=ratio(isas[0], isas[-1]) if len(isas) > 1 else None,
                )
                results["runs"].append(row)
                print(
                    f"{threads:>3} {m:>4} {name:>8} {row['aten_us']:>9.1f} "
                    + " ".join(
                        f"{med[isa]:>12.1f} {row['packed_gflops'][isa]:>8.1f} {row['speedup'][isa]:>6.2f}x"
                        for isa in isas
                    )
                    + (f" {row['isa_speedup']:>13.2f}x" if len(isas) > 1 else ""),
                    flush=True,
                )
    results["load_after"] = loadavg()
    print(f"load {results['load_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
