"""The host KV tier: multi-turn chats that do not fit the device pool, retraction under pressure, and the
copy kernels' speed, with the tier off and on in one interleaved run (A, B, B, A).

    python benchmarks/serving/bench_kv_tier.py [--model smollm2] [--convs 16] [--turns 4] [--json out.json]

1. Chats: `--convs` conversations x `--turns` turns (each turn: the conversation so far + 24 new
   tokens; 16 output tokens), the turns of all conversations submitted together, turn after turn;
   the device pool holds about a quarter of the conversations, the host tier all of them.
   Measured: prefill tokens computed, cache hit rate (device + host), TTFT p50 / p99, output tok/s.
   Targets: recomputed prefill <= 0.3x of tier-off, TTFT p99 <= 0.5x.
2. Retraction: 24 requests decoding 48 tokens in a pool that holds about half of them; tokens
   recomputed (prefill of re-admissions) and steps to drain, recompute (tier off) vs swap (tier on:
   a retracted request's full pages go to the cache, under pressure to the host, and come back).
3. Kernels: gather_kv_pages into a host buffer and scatter_kv_pages back, GB/s against a plain
   tensor copy of the same bytes (target >= 80 %).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from minisched import Engine, SamplingParams, ops

OUT = 16


def chats(n: int, turns: int, vocab: int, seed: int = 0) -> list[list[list[int]]]:
    import random

    rng = random.Random(seed)
    hi = min(vocab, 40000)
    convs = [[rng.randrange(3, hi) for _ in range(48)] for _ in range(n)]
    rounds = []
    for _ in range(turns):
        for c in convs:
            c += [rng.randrange(3, hi) for _ in range(24)]
        rounds.append([list(c) for c in convs])
    return rounds


def run_chats(engine: Engine, rounds) -> dict:
    sp = SamplingParams(max_new_tokens=OUT, ignore_eos=True)
    engine.scheduler.drain_records()
    t0, outs = time.perf_counter(), []
    for ps in rounds:
        outs += engine.generate(ps, sp)
    dt = time.perf_counter() - t0
    prompt = sum(len(o.prompt_ids) for o in outs)
    cached = sum(o.cached_tokens for o in outs)
    ttft = sorted(o.ttft for o in outs)
    return {
        "seconds": dt,
        "prefill_tokens": sum(s.num_prefill_tokens for s in engine.scheduler.records().step_stats),
        "prompt_tokens": prompt,
        "cache_hit_rate": cached / prompt,
        "ttft_p50": statistics.median(ttft),
        "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "output_tok_s": sum(len(o.token_ids) for o in outs) / dt,
        "host_loads": engine.host_tier.stats.loads if engine.host_tier else 0,
        "host_hit_tokens": engine.host_tier.stats.host_hit_tokens if engine.host_tier else 0,
    }


def run_retraction(engine: Engine) -> dict:
    hi = min(engine.cfg.vocab_size, 40000)
    import random

    rng = random.Random(1)
    ps = [[rng.randrange(3, hi) for _ in range(64)] for _ in range(24)]
    engine.scheduler.drain_records()
    t0 = time.perf_counter()
    outs = engine.generate(ps, SamplingParams(max_new_tokens=48, ignore_eos=True))
    stats = engine.scheduler.records().step_stats
    return {
        "seconds": time.perf_counter() - t0,
        "steps": len(stats),
        "retracted": sum(s.num_retracted for s in stats),
        "recomputed_tokens": sum(s.num_prefill_tokens for s in stats) - sum(len(p) for p in ps),
        "outputs": [o.token_ids for o in outs],
    }


def kernel_speed(engine: Engine, pages: int = 64, reps: int = 20) -> dict:
    cache = engine.model.new_kv_cache(4 * pages, 16)  # a pool of the model's shape, pages at random places
    cache.normal_()
    idx = torch.randperm(cache.shape[2])[:pages].to(torch.int32)
    buf = torch.empty((*cache.shape[:2], pages, *cache.shape[3:]), dtype=cache.dtype)
    src = cache[:, :, :pages].contiguous()
    nbytes = buf.numel() * buf.element_size()

    def timed(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return nbytes * reps / (time.perf_counter() - t0) / 1e9

    out = {}
    for _ in range(2):  # interleaved
        for name, fn in (
            ("copy", lambda: buf.copy_(src)),
            ("gather_kv_pages", lambda: ops.gather_kv_pages(cache, idx, buf, check=False)),
            ("scatter_kv_pages", lambda: ops.scatter_kv_pages(buf, cache, idx, check=False)),
        ):
            out.setdefault(name, []).append(timed(fn))
    res = {k: max(v) for k, v in out.items()}
    res["gather_vs_copy"] = res["gather_kv_pages"] / res["copy"]
    res["scatter_vs_copy"] = res["scatter_kv_pages"] / res["copy"]
    res["bytes"] = nbytes
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--convs", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    conv_tokens = 48 + 24 * args.turns + OUT
    page = 16
    device_pages = max(8, (args.convs // 4) * conv_tokens // page)  # about a quarter of the conversations
    host_pages = 2 * args.convs * conv_tokens // page
    base = Engine(args.model, page_size=page, num_pages=device_pages)
    print(f"{args.model}: quantize {base.quant.mode}, backend {base.backend}", flush=True)  # as resolved (auto)
    rounds = chats(args.convs, args.turns, base.cfg.vocab_size)
    rows = []
    for r in range(args.rounds):
        for host in (0, host_pages) if r % 2 == 0 else (host_pages, 0):
            e = base.fresh(num_pages=device_pages, host_kv_pages=host)
            rows.append(
                {
                    "round": r,
                    "case": "chats",
                    "tier": "on" if host else "off",
                    "load": os.getloadavg()[0],
                    **run_chats(e, rounds),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    retr_pages = 24 * (64 + 48) // page // 2
    retr = {}
    for host in (0, 4 * retr_pages):
        e = base.fresh(num_pages=retr_pages, host_kv_pages=host)
        retr["swap" if host else "recompute"] = run_retraction(e)
    same = retr["swap"].pop("outputs") == retr["recompute"].pop("outputs")
    kern = kernel_speed(base)
    summary = {}
    for tier in ("off", "on"):
        mine = [x for x in rows if x["tier"] == tier]
        summary[tier] = {
            k: statistics.median(x[k] for x in mine)
            for k in ("prefill_tokens", "cache_hit_rate", "ttft_p50", "ttft_p99", "output_tok_s")
        }
    on, off = summary["on"], summary["off"]
    print(f"\nchats ({args.convs} x {args.turns}, device pool {device_pages} pages, host {host_pages}):")
    for k in ("prefill_tokens", "cache_hit_rate", "ttft_p50", "ttft_p99", "output_tok_s"):
        print(f"  {k:15} off {off[k]:10.3f}  on {on[k]:10.3f}  on/off {on[k] / max(off[k], 1e-9):.3f}")
    print(f"retraction: {retr}; outputs identical: {same}")
    print(f"kernels: {kern}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "benchmark": "bench_kv_tier",
                    "model": args.model,
                    "quantize": base.quant.mode,  # as resolved (auto: gguf for SmolLM2); fresh() keeps it
                    "machine": platform.processor(),
                    "device_pages": device_pages,
                    "host_pages": host_pages,
                    "rows": rows,
                    "summary": summary,
                    "retraction": retr,
                    "retraction_outputs_identical": same,
                    "kernels": kern,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
