"""The fused elementwise tail (CPU, float32): ops.rope and ops.silu_and_mul against the torch sequences
the model ran before them, at SmolLM2-135M's shapes (9 q heads, 3 kv heads, head_dim 64, intermediate
1536), interleaved, median of --rounds, threads as given.

  rope:          torch: x * cos + roll(x) * signed_sin on the q and k views at once (apply_rope_signed),
                 then q.contiguous() for the attention; fused: ops.rope on q and on k (contiguous out).
  silu_and_mul:  torch: F.silu(gate, inplace=True).mul_(up); fused: ops.silu_and_mul(gate_up).

Per prefill: 30 layers x (one rope pair + one silu_and_mul); the table's last column multiplies out the
per-layer saving at each row count.

    python benchmarks/kernels/bench_elementwise.py [--rows 1 8 64 512] [--threads 2] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from minisched import ops
from minisched.model.llama import apply_rope_signed, rope_cos_sin, signed_sin
from minisched.ops.cpu import describe as cpu_describe

HQ, HKV, D, INTER, LAYERS = 9, 3, 64, 1536, 30


def per_call(fn, min_seconds: float = 0.05) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while (t := time.perf_counter() - t0) < min_seconds:
        fn()
        n += 1
    return t / n


def cases(rows: int, gen: torch.Generator) -> dict:
    qkv = torch.randn(rows, (HQ + 2 * HKV) * D, generator=gen)
    positions = torch.randint(0, 4000, (rows,), generator=gen)
    inv = 1.0 / (1e5 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = rope_cos_sin(positions, inv, torch.float32)
    ssin = signed_sin(sin)
    hcos, hsin = cos[:, 0, : D // 2].contiguous(), sin[:, 0, : D // 2].contiguous()
    qv, kv = qkv[:, : HQ * D].view(rows, HQ, D), qkv[:, HQ * D : (HQ + HKV) * D].view(rows, HKV, D)
    gate_up = torch.randn(rows, 2 * INTER, generator=gen)

    def rope_torch():
        qk = apply_rope_signed(qkv[:, : (HQ + HKV) * D].view(rows, HQ + HKV, D), cos, ssin)
        return qk[:, :HQ].contiguous(), qk[:, HQ:]

    def rope_fused():
        return ops.rope(qv, hcos, hsin), ops.rope(kv, hcos, hsin)

    def silu_torch():
        g = gate_up.clone()  # the model's silu is in place on the projection output: time the clone apart
        gate, up = g.chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)

    def clone_only():
        return gate_up.clone()

    def silu_fused():
        return ops.silu_and_mul(gate_up)

    return dict(rope=(rope_torch, rope_fused, None), silu_and_mul=(silu_torch, silu_fused, clone_only))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    print(f"threads {a.threads}, load {os.getloadavg()[0]:.2f}, {cpu_describe()}")
    print(f"| op | rows | torch us | fused us | torch / fused | saved per 512-token-style prefill, ms (x{LAYERS}) |")
    print("|---|---|---|---|---|---|")
    for rows in a.rows:
        for name, (slow, fast, extra) in cases(rows, gen).items():
            ts, tf = [], []
            for r in range(a.rounds):
                order = [(slow, ts), (fast, tf)] if r % 2 == 0 else [(fast, tf), (slow, ts)]
                for fn, acc in order:
                    acc.append(per_call(fn))
            t_slow, t_fast = statistics.median(ts), statistics.median(tf)
            if extra is not None:
                t_slow -= statistics.median(per_call(extra) for _ in range(a.rounds))
            row = dict(op=name, rows=rows, torch_us=t_slow * 1e6, fused_us=t_fast * 1e6, ratio=t_slow / t_fast)
            row["saved_ms_per_forward"] = (t_slow - t_fast) * LAYERS * 1e3
            rows_out.append(row)
            print(
                f"| {name} | {rows} | {row['torch_us']:.1f} | {row['fused_us']:.1f} | {row['ratio']:.2f} |"
                f" {row['saved_ms_per_forward']:.2f} |"
            )
    if a.json:
        meta = dict(threads=a.threads, load=os.getloadavg(), cpu=cpu_describe())
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
