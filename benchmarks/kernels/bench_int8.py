"""int8 weights (`--quantize int8`) against fp32 -- not a test.

    python benchmarks/kernels/bench_int8.py [--rounds 3] [--threads 1 2] [--cpu-isa avx2] [--json benchmarks/results/int8.json]
    python benchmarks/kernels/bench_int8.py --quantize gguf-a8 --skip kernels   # another mode's decode and agreement

Three parts, each interleaving fp32 and int8 (A, B, A, B) so both see the same machine load:
  kernels    F.linear (fp32 sgemm/sgemv), packed_linear (fp32, the engine default) and
             torch.ops.minisched.int8_linear on SmolLM2's shapes, --rows M, best of N calls per turn;
  decode     one engine per mode on SmolLM2-135M, B prompts decoded to --new-tokens greedy tokens
             (ignore_eos): output tok/s of the whole generate;
  agreement  int8 vs fp32 on chat prompts: teacher-forced top-1 agreement along fp32's own greedy
             continuation, and how many generated tokens are identical before the first divergence;
             --emulate-act-bits 8: the same with the projections' inputs rounded to 8 bits per row
             (torch emulation of W8A8), what the kernel's 16-bit rows are measured against.
Every row carries the load average and the CPU kernels' ISA variant (--cpu-isa: another one, e.g. avx2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from minisched import Engine, SamplingParams, ops
from minisched.base.cpus import loadavg
from minisched.model.llama import dense_forward

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
PROMPTS = [
    "What is paged attention? Answer in one sentence.",
    "Name three fruits.",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is.",
    "What is the capital of France?",
    "Give me a tip for learning Python.",
    "Why is the sky blue?",
    "Describe a cat in two sentences.",
]


def best_us(fn, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def run_kernels(args) -> list[dict]:
    """Per shape and row count, interleaved (the order flips every round): fp32 F.linear (ATen sgemm), fp32
    packed_linear (the engine's fp32 default) and int8_linear."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, generator=gen) * 0.05
            q_packed, s_packed = ops.pack_int8_weight(*ops.quantize_int8(w, 64))
            w_packed = ops.pack_linear_weight(w)
            for m in args.rows:
                x = torch.randn(m, k, generator=gen)
                out = torch.empty(m, n)
                calls = 4 if name == "lm_head" else 20
                fns = {
                    "fp32": lambda: F.linear(x, w),
                    "packed": lambda: torch.ops.minisched.packed_linear(x, w_packed, out),
                    "int8": lambda: torch.ops.minisched.int8_linear(x, q_packed, s_packed, out),
                }
                times = {key: [] for key in fns}
                for r in range(args.rounds):
                    for key in list(fns) if r % 2 == 0 else list(reversed(fns)):
                        times[key].append(best_us(fns[key], calls))
                us = {key: min(v) for key, v in times.items()}
                row = dict(
                    threads=threads,
                    shape=name,
                    n=n,
                    k=k,
                    m=m,
                    fp32_us=us["fp32"],
                    packed_us=us["packed"],
                    int8_us=us["int8"],
                    speedup=us["fp32"] / us["int8"],
                    int8_vs_packed=us["packed"] / us["int8"],
                    loadavg=loadavg(),
                )
                rows.append(row)
                print(
                    f"kernel t={threads} {name:8s} M={m:3d}  fp32 {us['fp32']:9.1f} us  packed {us['packed']:9.1f} us"
                    f"  int8 {us['int8']:9.1f} us  int8/packed x{row['int8_vs_packed']:.2f}  load {row['loadavg']}",
                    flush=True,
                )
    return rows


def run_decode(args, engines) -> list[dict]:
    rows = []
    sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    for batch in args.batch:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        speeds = {name: [] for name in engines}
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                t0 = time.perf_counter()
                outs = engines[name].generate(prompts, sp, chat=True)
                speeds[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
        row = dict(
            batch=batch,
            fp32_tok_s=statistics.median(speeds["fp32"]),
            quant_tok_s=statistics.median(speeds["quant"]),
            rounds=speeds,
            loadavg=loadavg(),
        )
        row["speedup"] = row["quant_tok_s"] / row["fp32_tok_s"]
        rows.append(row)
        print(
            f"decode B={batch:3d}  fp32 {row['fp32_tok_s']:7.1f} tok/s  {args.quantize} {row['quant_tok_s']:7.1f} tok/s  "
            f"x{row['speedup']:.2f}  load {row['loadavg']}",
            flush=True,
        )
    return rows


def teacher_forced(fp32, model, prompts, outs) -> tuple[int, int]:
    agree = total = 0
    for p, a in zip(prompts, outs):
        ids = torch.tensor(fp32.encode(p, chat=True) + a.token_ids)
        start = len(ids) - len(a.token_ids) - 1
        fa = dense_forward(fp32.model, ids).argmax(-1)[start:-1]
        agree += int((fa == dense_forward(model, ids).argmax(-1)[start:-1]).sum())
        total += len(a.token_ids)
    return agree, total


def run_emulated_activations(args, fp32, q) -> list[dict]:
    """The int8 weights with each projection's input rows rounded to `bits` bits (one scale per row),
    emulated in torch: why the kernel quantizes activations to 16 bits, not 8 (vpdpbusd's operands)."""
    from minisched.model.quant import Int8Weight

    sp = SamplingParams(max_new_tokens=args.new_tokens)
    ref = fp32.generate(PROMPTS, sp, chat=True)
    real = Int8Weight.linear
    rows = []
    for bits in args.emulate_act_bits:
        qmax = 2 ** (bits - 1) - 1

        def emulated(self, x, backend, qmax=qmax):
            w_q, scales = self.unpacked()
            w = ops.reference.dequantize_int8(w_q, scales)
            x2 = x.reshape(-1, x.shape[-1]).float()
            s = x2.abs().amax(dim=1, keepdim=True) / qmax
            s = torch.where(s > 0, s, torch.ones_like(s))
            return ((torch.round(x2 / s).clamp(-qmax, qmax) * s) @ w.T).reshape(*x.shape[:-1], -1)

        Int8Weight.linear = emulated
        try:
            agree, total = teacher_forced(fp32, q.model, PROMPTS, ref)
        finally:
            Int8Weight.linear = real
        rows.append(dict(act_bits=bits, teacher_forced_top1=agree / total, tokens=total, loadavg=loadavg()))
        print(
            f"emulated {bits}-bit activations: teacher-forced top-1 {agree}/{total} = {agree / total:.3f}", flush=True
        )
    return rows


def run_agreement(args, engines) -> dict:
    fp32, q = engines["fp32"], engines["quant"]
    sp = SamplingParams(max_new_tokens=args.new_tokens)
    ref = fp32.generate(PROMPTS, sp, chat=True)
    got = q.generate(PROMPTS, sp, chat=True)
    forced = total = prefix = 0
    identical = 0
    for p, a, b in zip(PROMPTS, ref, got):
        ids = torch.tensor(fp32.encode(p, chat=True) + a.token_ids)
        start = len(ids) - len(a.token_ids) - 1
        fa = dense_forward(fp32.model, ids).argmax(-1)[start:-1]
        fb = dense_forward(q.model, ids).argmax(-1)[start:-1]
        forced += int((fa == fb).sum())
        total += len(a.token_ids)
        n = 0
        while n < min(len(a.token_ids), len(b.token_ids)) and a.token_ids[n] == b.token_ids[n]:
            n += 1
        prefix += n
        identical += a.token_ids == b.token_ids
    out = dict(
        quantize=args.quantize,
        prompts=len(PROMPTS),
        tokens=total,
        teacher_forced_top1=forced / total,
        identical_prefix_tokens=prefix,
        identical_outputs=identical,
        loadavg=loadavg(),
    )
    print(
        f"agreement: teacher-forced top-1 {forced}/{total} = {forced / total:.3f}; identical outputs "
        f"{identical}/{len(PROMPTS)}; tokens before the first divergence {prefix}/{total}",
        flush=True,
    )
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 17, 32, 64, 512], help="kernel rows M")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--engine-threads", type=int, default=None, help="engines' num_threads (default: tuned)")
    p.add_argument("--skip", nargs="*", default=[], choices=["kernels", "decode", "agreement"])
    p.add_argument(
        "--emulate-act-bits",
        type=int,
        nargs="*",
        default=[],
        help="also the agreement with activations rounded to N bits per row, emulated in torch (e.g. 8 12)",
    )
    p.add_argument(
        "--quantize",
        default="int8",
        choices=["int8", "bf16", "gguf", "gguf-a8"],
        help="the mode the decode and agreement parts compare with fp32 (the kernels part is int8's)",
    )
    p.add_argument("--cpu-isa", default=None, help="the CPU kernels' ISA variant (default: the best supported)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.cpu_isa:
        ops.set_cpu_isa(args.cpu_isa)
    result = dict(loadavg_start=loadavg(), cpu_count=os.cpu_count(), cpu_isa=ops.cpu_isa())
    if "kernels" not in args.skip:
        result["kernels"] = run_kernels(args)
    if not {"decode", "agreement"} <= set(args.skip):
        threads = args.engine_threads
        engines = {
            "fp32": Engine(num_threads=threads, quantize="none"),  # the default (auto) is gguf here
            "quant": Engine(num_threads=threads, quantize=args.quantize),
        }
        result["engine_threads"] = threads or "tuned"
        if "agreement" not in args.skip:
            result["agreement"] = run_agreement(args, engines)
        if args.emulate_act_bits:
            result["emulated_activations"] = run_emulated_activations(args, engines["fp32"], engines["quant"])
        if "decode" not in args.skip:
            result["decode"] = run_decode(args, engines)
    result["loadavg_end"] = loadavg()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
