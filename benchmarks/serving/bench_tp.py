"""Tensor parallelism on the CPU (gloo): per step, the bytes all-reduced and the share of step time in
collectives, TP=1 vs TP=N -- not a test.

    python benchmarks/serving/bench_tp.py [--model dummy:smollm2-135m --heads 8 --kv-heads 2] [--tp 2] [--batch 1 8]
                                  [--prompt-len 128] [--new-tokens 32] [--rounds 2] [--json out.json]
    python benchmarks/serving/bench_tp.py --model smollm2 --tp 3     # the real SmolLM2: 9 query heads, TP must divide them

The default model has SmolLM2-135M's shapes (30 layers, hidden 576, MLP 1536, vocabulary 49152)
with 8 query / 2 KV heads instead of 9 / 3, random weights: an even split for TP=2.

One process holds both engines: the one-process engine (run with one thread and with every usable
core) and rank 0 of a TP=N session (the cores shared out: one thread per rank on 2 cores). Rounds alternate between them
(A B B A ...) so both see the same machine load. Per batch size B: B random prompts of
--prompt-len tokens, --new-tokens greedy tokens each; every step is timed on rank 0 (the whole
`Engine.step`: scheduling, the forward on every rank, sampling) with the collectives' calls,
bytes and seconds inside it (`TPGroup.stats`). A collective's seconds include waiting for the
slower rank to arrive, so "in collectives" is communication plus imbalance, seen from rank 0.

The machine is shared: every result carries /proc/loadavg before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from minisched.base.cpus import default_num_threads, loadavg
from minisched.engine import Engine
from minisched.model.config import preset
from minisched.parallel import ModelSource, TPSession
from minisched.parallel.group import CommStats
from minisched.sched.sampling_params import SamplingParams


def run_batch(engine: Engine, threads: int, prompts, new_tokens: int, stats) -> list[dict]:
    """Every step of one batch: mode, tokens, seconds, and the collectives inside it."""
    torch.set_num_threads(threads)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    steps = []
    while engine.has_work():
        before = stats.snapshot() if stats else {}
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        s = engine.scheduler.drain_records().step_stats[-1]
        comm = CommStats.delta(stats.snapshot(), before) if stats else {}
        steps.append(dict(mode=s.mode, tokens=s.num_prefill_tokens + s.num_decode_tokens, seconds=dt, comm=comm))
    return steps


def summarize(tp: int, threads: int, batch: int, steps: list[dict]) -> list[dict]:
    rows = []
    for phase in ("prefill", "decode"):
        sel = [s for s in steps if s["mode"] == phase]
        if not sel:
            continue

        def per_step(kind, field):
            return statistics.mean(s["comm"].get(kind, {}).get(field, 0) for s in sel)

        coll = [sum(v["seconds"] for v in s["comm"].values()) for s in sel]
        total = sum(s["seconds"] for s in sel)
        tokens = statistics.mean(s["tokens"] for s in sel)
        rows.append(
            dict(
                tp=tp,
                threads_per_rank=threads,
                batch=batch,
                phase=phase,
                steps=len(sel),
                tokens_per_step=tokens,
                step_ms_median=1e3 * statistics.median(s["seconds"] for s in sel),
                collective_ms_median=1e3 * statistics.median(coll),
                collective_share=sum(coll) / total if total else 0.0,
                allreduce_calls_per_step=per_step("all_reduce", "calls"),
                allreduce_bytes_per_step=per_step("all_reduce", "bytes"),
                allreduce_bytes_per_token=per_step("all_reduce", "bytes") / tokens if tokens else 0.0,
                allreduce_ms_per_step=1e3 * per_step("all_reduce", "seconds"),
                broadcast_bytes_per_step=per_step("broadcast", "bytes"),
                broadcast_ms_per_step=1e3 * per_step("broadcast", "seconds"),
                gather_bytes_per_step=per_step("gather", "bytes"),
                gather_ms_per_step=1e3 * per_step("gather", "seconds"),
            )
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="dummy:smollm2-135m")
    ap.add_argument("--heads", type=int, default=8, help="dummy models: query heads (KV heads: --kv-heads)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    cores = default_num_threads()
    la0 = loadavg()
    if args.model.startswith("dummy:"):
        cfg = preset(args.model.split(":", 1)[1], num_heads=args.heads, num_kv_heads=args.kv_heads)
        source = ModelSource(config=cfg)
        model_name = f"{args.model} ({args.heads} query / {args.kv_heads} KV heads)"
    else:
        source, model_name = ModelSource(args.model), args.model
    session = TPSession.start(args.tp, source, timeout=120)
    try:
        tp_engine = Engine(tp_session=session, page_size=16, chunk_size=512)
        one = Engine(source.load(), tokenizer=tp_engine.tokenizer, num_threads=cores, page_size=16, chunk_size=512)
        # label -> (engine, threads, stats): TP=1 with one thread and with every core, TP=N with the cores shared
        engines = {
            (1, 1): (one, 1, None),
            (1, cores): (one, cores, None),
            (args.tp, session.num_threads): (tp_engine, session.num_threads, session.group.stats),
        }
        g = torch.Generator().manual_seed(0)
        vocab = one.cfg.vocab_size
        results: dict = {}
        for batch in args.batch:
            for eng, threads, stats in engines.values():  # warm-up
                run_batch(eng, threads, [[5] * 8], 2, stats)
            order = []
            for r in range(args.rounds):
                order += list(engines) if r % 2 == 0 else list(reversed(engines))
            for key in order:
                prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(batch)]
                eng, threads, stats = engines[key]
                results.setdefault((key, batch), []).extend(run_batch(eng, threads, prompts, args.new_tokens, stats))
        rows = [row for (key, batch), steps in sorted(results.items()) for row in summarize(*key, batch, steps)]
    finally:
        session.close()
    out = dict(
        benchmark="bench_tp",
        model=model_name,
        tp=args.tp,
        cores=cores,
        backend=one.backend,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        rounds=args.rounds,
        torch=torch.__version__,
        loadavg_before=la0,
        loadavg_after=loadavg(),
        rows=rows,
    )
    print(f"model {model_name}, {cores} cores, load {la0} -> {out['loadavg_after']}; per step on rank 0 (medians):")
    print(
        "| TP | threads/rank | batch | phase | tokens/step | step ms | in collectives ms | share | all-reduce calls | "
        "all-reduce bytes/step | bytes/token | broadcast bytes | gather bytes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tp']} | {r['threads_per_rank']} | {r['batch']} | {r['phase']} | {r['tokens_per_step']:.0f} | {r['step_ms_median']:.1f} | "
            f"{r['collective_ms_median']:.1f} | {r['collective_share']:.0%} | {r['allreduce_calls_per_step']:.0f} | "
            f"{r['allreduce_bytes_per_step'] / 1e3:.0f} kB | {r['allreduce_bytes_per_token'] / 1e3:.1f} kB | "
            f"{r['broadcast_bytes_per_step']:.0f} | {r['gather_bytes_per_step'] / 1e3:.0f} kB |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
