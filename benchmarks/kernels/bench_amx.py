"""The AMX variants against the AVX-512 ones they replace from 16 rows on -- not a test.

    python benchmarks/kernels/bench_amx.py [--rows 16 32 64 128 512] [--threads 1 2] [--rounds 3]
        [--json benchmarks/results/amx.json] [--md benchmarks/results/amx.md]

On SmolLM2's projection shapes, for each row count M: int8_linear (`--quantize int8`) and packed_linear
on bf16 panels (`--quantize bf16`) as the `amx` and the `avx512` variant (ops.use_cpu_isa), and, for
scale, packed_linear on fp32 panels (the default model's path) and F.linear (ATen's sgemm, MKL here).
Each round times every system on every shape (order reversed every other round, so both variants see
the same machine load); a cell is the best of the calls within --seconds. Reported: GFLOP/s (2 M N K
per call), the median over rounds, and amx / avx512 as the median of per-round time ratios with their
range. Before timing, the outputs are checked: int8 AMX equals AVX-512 bit for bit, bf16 AMX is within
float32 summation error of it. Every row carries the load average and the machine's ISA flags.
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

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SYSTEMS = ("int8-amx", "int8-avx512", "bf16-amx", "bf16-avx512", "fp32-avx512", "F.linear")


def best_seconds(fn, seconds: float) -> float:
    fn()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class Case:
    """One shape at one row count: its weights in every format, inputs and an output buffer."""

    def __init__(self, n: int, k: int, m: int, gen: torch.Generator):
        w = torch.randn(n, k, generator=gen) * 0.05
        self.x = torch.randn(m, k, generator=gen)
        self.out = torch.empty(m, n)
        self.w = w
        self.w32 = ops.pack_linear_weight(w)
        self.wbf = ops.pack_linear_weight(w.bfloat16())
        w_q, scales = ops.quantize_int8(w)
        self.w8, self.s8 = ops.pack_int8_weight(w_q, scales)
        self.flop = 2 * m * n * k

    def call(self, system: str) -> None:
        op = torch.ops.minisched
        if system == "F.linear":
            F.linear(self.x, self.w)
            return
        fmt, isa = system.split("-")
        with ops.use_cpu_isa(isa):
            if fmt == "int8":
                op.int8_linear(self.x, self.w8, self.s8, self.out)
            else:
                op.packed_linear(self.x, self.wbf if fmt == "bf16" else self.w32, self.out)

    def output(self, system: str) -> torch.Tensor:
        self.out.fill_(float("nan"))
        self.call(system)
        return self.out.clone()

    def check(self) -> None:
        """int8: AMX's bits are AVX-512's; bf16: the same products summed in another order."""
        if not torch.equal(self.output("int8-amx"), self.output("int8-avx512")):
            raise SystemExit("int8_linear: the amx and avx512 variants differ")
        a, b = self.output("bf16-amx"), self.output("bf16-avx512")
        k = self.x.shape[1]
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4 * k**0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 512])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.15, help="per timed cell")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args()
    feats = ops.cpu_features()
    if "amx" not in feats["supported"]:
        raise SystemExit(f"no AMX variant on this machine ({feats.get('amx_error') or 'cpuid lists no AMX'})")
    if min(args.rows) < 16:
        raise SystemExit("--rows: the AMX variants take 16 rows and more (fewer run the AVX-512 kernels)")
    gen = torch.Generator().manual_seed(0)
    cases = {(s, m): Case(*SHAPES[s], m, gen) for s in args.shapes for m in args.rows}
    for case in cases.values():
        case.check()
    results = []
    before = torch.get_num_threads()
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            times: dict[tuple, list[float]] = {}
            loads = [loadavg()]
            for r in range(args.rounds):
                order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
                for (shape, m), case in cases.items():
                    for system in order:
                        times.setdefault((shape, m, system), []).append(
                            best_seconds(lambda: case.call(system), args.seconds)
                        )
                loads.append(loadavg())
                print(f"threads {threads} round {r} done (load {loads[-1]})", flush=True)
            for (shape, m), case in cases.items():
                row = {"threads": threads, "shape": shape, "n_k": SHAPES[shape], "rows": m, "load": loads}
                for system in SYSTEMS:
                    row[system] = case.flop / statistics.median(times[(shape, m, system)]) / 1e9
                for fmt in ("int8", "bf16"):
                    ratios = [
                        av / am
                        for am, av in zip(
                            times[(shape, m, f"{fmt}-amx")], times[(shape, m, f"{fmt}-avx512")], strict=True
                        )
                    ]
                    row[f"{fmt} amx/avx512"] = [statistics.median(ratios), min(ratios), max(ratios)]
                results.append(row)
    finally:
        torch.set_num_threads(before)
    lines = [
        f"CPU: {feats['model']}; kernels' variants: {', '.join(feats['supported'])}; torch threads as stated",
        "",
        "| threads | shape (N x K) | M | int8 amx | int8 avx512 | int8 amx/avx512 | bf16 amx | bf16 avx512 | "
        "bf16 amx/avx512 | fp32 packed | F.linear (MKL) | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:

        def ratio(key: str, r: dict = r) -> str:
            med, lo, hi = r[key]
            return f"**{med:.2f}x** ({lo:.2f}-{hi:.2f})"

        lines.append(
            f"| {r['threads']} | {r['shape']} {r['n_k'][0]}x{r['n_k'][1]} | {r['rows']} | {r['int8-amx']:.0f} | "
            f"{r['int8-avx512']:.0f} | {ratio('int8 amx/avx512')} | {r['bf16-amx']:.0f} | {r['bf16-avx512']:.0f} | "
            f"{ratio('bf16 amx/avx512')} | {r['fp32-avx512']:.0f} | {r['F.linear']:.0f} | {r['load'][0]} -> {r['load'][-1]} |"
        )
    table = "\n".join(lines)
    print(table)
    meta = {"cpu": feats["model"], "supported": feats["supported"], "args": vars(args), "unit": "GFLOP/s"}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"# AMX vs AVX-512 (`kernels/bench_amx.py`), GFLOP/s\n\n{table}\n")


if __name__ == "__main__":
    main()
