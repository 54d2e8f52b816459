"""gguf_linear (a GGUF file's own blocks, csrc/cpu/gguf_linear.cpp) against the float32 packed_linear
on the same dequantized weights, on SmolLM2-135M's projection shapes and formats -- not a test.

    python benchmarks/kernels/bench_gguf_linear.py [--rows 1 8 32 512] [--threads 2] [--rounds 3]
        [--layers 30] [--isa avx2 ...] [--a8] [--json out.json]
    python benchmarks/kernels/bench_gguf_linear.py --bytes [--json out.json]

`--bytes`: the weight bytes one decode step reads in SmolLM2 (the projections and the LM head; the
embedding lookup reads one row) for fp32 and `--quantize gguf`, and the machine's read bandwidth
(torch.sum over 1 GiB of float32, 2 threads, best of 5): a B=1 decode's tok/s x bytes per token over
it is the bandwidth fraction.

Shapes ([N, K], the file's format): qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536 (Q4_1),
lm_head 49152x576 (Q8_0). Each shape is held --layers times (distinct weights, as the model's 30
layers), and the calls cycle through them: the weights stream from memory, as in a decode step,
instead of sitting in cache (the LM head, 113 MB in float32, is one copy). packed_linear and
gguf_linear (per --isa variant) run alternately (A, B, B, A, ...) for --rounds rounds of ~--seconds
each on fresh random inputs; reported: median microseconds per call, the weight bytes read per
call over the time (GB/s), and the speedup (median of per-round ratios). The outputs are checked
equal bit for bit first. /proc/loadavg is recorded before and after.

`--a8`: one more column, gguf_a8_linear on the same blocks (activations rounded to 8 bits per block of
32, integer dot products; the machine's default ISA variant), timed in the same alternation, with its
speed against the last gguf_linear column (a8_x_gguf = that column's time / a8's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from minisched import ops
from minisched.base.cpus import loadavg
from minisched.ops import reference

SHAPES = {
    "qkv": (960, 576, 3),
    "o": (576, 576, 3),
    "gate_up": (3072, 576, 3),
    "down": (576, 1536, 3),
    "lm_head": (49152, 576, 8),
}


def per_call(fn, seconds: float, copies: int) -> float:
    """Mean microseconds per call, cycling through the weight copies (whole cycles)."""
    for i in range(copies):
        fn(i)
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds or n % copies:
        fn(n % copies)
        n += 1
    return elapsed / n * 1e6


def bytes_per_token() -> dict:
    """Weight bytes of a SmolLM2 decode step: fp32 (packed), gguf and gguf-a8 (the file's blocks, in two
    layouts of the same bytes)."""
    from minisched.engine.build import build_parts
    from minisched.engine.config import EngineConfig

    out = {}
    for mode, name in (("none", "fp32"), ("gguf", "gguf"), ("gguf-a8", "gguf-a8")):
        model = build_parts(EngineConfig(quantize=mode, num_pages=64)).model
        heads = [model.lm_head] if model.lm_head is not None else [model.embed]
        weights = [getattr(layer, n) for layer in model.decoder_layers for n in ("qkv", "o", "gate_up", "down")]
        out[name] = sum(b.numel() * b.element_size() for w in weights + heads for b in w.buffers())
    return out


def read_bandwidth(gib: float = 1.0, threads: int = 2) -> float:
    """GB/s of torch.sum over `gib` GiB of float32 (best of 5)."""
    torch.set_num_threads(threads)
    a = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.numel() * 4 / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    p.add_argument("--threads", type=int, nargs="+", default=[2])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--layers", type=int, default=30, help="weight copies per shape (the model's layers)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.3, help="per timed run")
    p.add_argument("--isa", nargs="+", default=None, help="gguf_linear's ISA variants (default: all supported)")
    p.add_argument("--json", default=None)
    p.add_argument("--bytes", action="store_true", help="bytes per decode step and the read bandwidth only")
    p.add_argument(
        "--a8", action="store_true", help="also gguf_a8_linear (8-bit activations; the default ISA), x the gguf column"
    )
    args = p.parse_args()
    if args.bytes:
        res = {"load_before": loadavg(), "bytes_per_token": bytes_per_token(), "read_gbps": read_bandwidth()}
        res["load_after"] = loadavg()
        print(json.dumps(res, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    isas = args.isa or ops.supported_cpu_isas()
    results = {"load_before": loadavg(), "isas": isas, "cpu": ops.cpu_features(), "layers": args.layers, "runs": []}
    print(f"load {results['load_before']}; gguf_linear variants {isas}; {args.layers} weight copies per shape")
    print(
        f"{'thr':>3} {'M':>4} {'shape':>8} {'fmt':>4} {'fp32 us':>9} {'GB/s':>6} "
        + " ".join(f"{isa + ' us':>11} {'GB/s':>6} {'x fp32':>7}" for isa in isas)
        + (f" {'a8 us':>9} {'GB/s':>6} {'x ' + isas[-1]:>10}" if args.a8 else "")
    )
    weights = {}
    for name in args.shapes:
        n, k, qtype = SHAPES[name]
        copies = 1 if name == "lm_head" else args.layers
        g = torch.Generator().manual_seed(n + k)
        packed, fp32, a8 = [], [], []
        for _ in range(copies):
            w = torch.randn(n, k, generator=g) * 0.05
            blocks = torch.from_numpy(gguf_quantize(w.numpy(), GGMLQuantizationType(qtype)).view(np.uint8))
            packed.append(ops.pack_gguf_weight(blocks.reshape(n, -1), qtype))
            fp32.append(ops.pack_linear_weight(reference.dequantize_gguf(blocks.reshape(n, -1), qtype)))
            if args.a8:
                a8.append(ops.pack_gguf_a8_weight(blocks.reshape(n, -1), qtype))
        weights[name] = (packed, fp32, a8)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for m in args.rows:
            for name in args.shapes:
                n, k, qtype = SHAPES[name]
                if name == "lm_head" and m > 64:
                    continue  # prefill computes logits for the last row only
                packed, fp32, a8 = weights[name]
                copies = len(packed)
                g = torch.Generator().manual_seed(m * 7 + n)
                x, out = torch.randn(m, k, generator=g), torch.empty(m, n)
                assert torch.equal(ops.gguf_linear(x, packed[0], qtype, n), ops.packed_linear(x, fp32[0], n))
                fns = [("fp32", None, lambda i: ops.packed_linear(x, fp32[i], n, out=out))]
                fns += [(isa, isa, lambda i: ops.gguf_linear(x, packed[i], qtype, n, out=out)) for isa in isas]
                if args.a8:
                    fns.append(("a8", None, lambda i: ops.gguf_a8_linear(x, a8[i], qtype, n, out=out)))
                times: dict[str, list[float]] = {label: [] for label, _, _ in fns}
                for r in range(args.rounds):
                    x.copy_(torch.randn(m, k, generator=g))
                    for label, isa, fn in fns if r % 2 == 0 else fns[::-1]:
                        with ops.use_cpu_isa(isa):
                            times[label].append(per_call(fn, args.seconds, copies))
                med = {label: statistics.median(v) for label, v in times.items()}
                ratio = lambda a, b: statistics.median(u / v for u, v in zip(times[a], times[b]))  # noqa: E731
                bytes_fp32 = fp32[0].numel() * 4
                bytes_gguf = packed[0].numel()
                row = dict(
                    threads=threads,
                    rows=m,
                    shape=name,
                    n=n,
                    k=k,
                    qtype=qtype,
                    fp32_us=med["fp32"],
                    fp32_gbps=bytes_fp32 / med["fp32"] / 1e3,
                    gguf_us={isa: med[isa] for isa in isas},
                    gguf_gbps={isa: bytes_gguf / med[isa] / 1e3 for isa in isas},
                    speedup={isa: ratio("fp32", isa) for isa in isas},
                    bytes_fp32=bytes_fp32,
                    bytes_gguf=bytes_gguf,
                )
                if args.a8:
                    row.update(a8_us=med["a8"], a8_gbps=bytes_gguf / med["a8"] / 1e3, a8_x_gguf=ratio(isas[-1], "a8"))
                results["runs"].append(row)
                fmt = "Q8_0" if qtype == 8 else "Q4_1"
                print(
                    f"{threads:>3} {m:>4} {name:>8} {fmt:>4} {med['fp32']:>9.1f} {row['fp32_gbps']:>6.1f} "
                    + " ".join(
                        f"{med[isa]:>11.1f} {row['gguf_gbps'][isa]:>6.1f} {row['speedup'][isa]:>6.2f}x" for isa in isas
                    )
                    + (f" {med['a8']:>9.1f} {row['a8_gbps']:>6.1f} {row['a8_x_gguf']:>9.2f}x" if args.a8 else ""),
                    flush=True,
                )
    results["load_after"] = loadavg()
    print(f"load {results['load_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
