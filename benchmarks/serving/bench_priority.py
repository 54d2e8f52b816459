"""Priority scheduling: the TTFT of an urgent trickle under a saturating batch load, in process -- not a test.

    python benchmarks/serving/bench_priority.py [--model smollm2] [--steps 150] [--rounds 3] [--json out.json]

A batch load keeps --backlog low-priority requests waiting at every step (random --low-prompt-token
prompts, --low-new tokens each on average, EOS ignored) on an engine with --max-running slots, so the
decode batch is always full and requests queue; after --warmup steps, every --every steps one urgent
request arrives (--hp-prompt tokens, --hp-new tokens) for --steps steps. Variants on the same weights, alternated (A, B, C, C, B, A, ...) for --rounds rounds,
cache-cold each time, the same arrivals in each:

- fcfs: no priorities (`priority_scheduling` off): the urgent requests queue behind the backlog;
- priority, no preemption: the urgent requests go first in the queue but wait for a free slot;
- priority: and they preempt the least urgent running request when no slot or page is free.

Per run: the urgent requests' TTFT (seconds and steps, p50 / p99 / max), the batch load's output
tok/s over the window, preemptions. Medians of the rounds go to stdout and --json with /proc/loadavg.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from minisched.base.cpus import loadavg
from minisched.engine import Engine
from minisched.sched.req import ReqStatus
from minisched.sched.sampling_params import SamplingParams


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def one_run(engine: Engine, args, prio: bool, seed: int) -> dict:
    sched = engine.scheduler
    sched.flush_cache()
    rng = random.Random(seed)
    vocab = min(engine.cfg.vocab_size, 30000)
    low_prio = 5 if prio else 0
    hp_sp = SamplingParams(max_new_tokens=args.hp_new, ignore_eos=True, priority=-1 if prio else 0)
    low, urgent, arrived, first = [], [], {}, {}
    sched.drain_records()
    t0, tokens0, step = time.perf_counter(), 0, 0

    def record() -> None:
        for r in urgent:
            if r.rid not in first and r.first_token_time is not None:
                first[r.rid] = step

    for step in range(args.warmup + args.steps):
        if step == args.warmup:  # the load is in its steady state: measure from here
            t0, tokens0 = time.perf_counter(), sum(len(r.output_ids) for r in low)
        waiting_low = sum(1 for r in low if r.status is ReqStatus.WAITING)
        for _ in range(args.backlog - waiting_low):
            n = rng.randint(args.low_new // 2, 3 * args.low_new // 2)  # staggered ends: slots free steadily
            sp = SamplingParams(max_new_tokens=n, ignore_eos=True, priority=low_prio)
            low.append(engine.add_request([rng.randrange(3, vocab) for _ in range(args.low_prompt)], sp))
        if step >= args.warmup and step % args.every == args.every - 1:
            r = engine.add_request([rng.randrange(3, vocab) for _ in range(args.hp_prompt)], hp_sp)
            urgent.append(r)
            arrived[r.rid] = step
        engine.step()
        record()
    window = time.perf_counter() - t0
    low_tokens = sum(len(r.output_ids) for r in low) - tokens0
    for r in low:
        engine.abort(r.rid)
    while len(first) < len(urgent):  # the last arrivals' first tokens
        step += 1
        engine.step()
        record()
    for r in urgent:
        engine.abort(r.rid)
    while engine.has_work():
        engine.step()
    ttft = [r.first_token_time - r.arrival_time for r in urgent]
    steps = [first[r.rid] - arrived[r.rid] + 1 for r in urgent]
    return dict(
        ttft_p50=pct(ttft, 0.5),
        ttft_p99=pct(ttft, 0.99),
        ttft_max=max(ttft),
        ttft_steps_p50=pct(steps, 0.5),
        ttft_steps_p99=pct(steps, 0.99),
        low_tok_s=low_tokens / window,
        preemptions=sum(1 for e in sched.records().events if e.note == "preempted"),
        urgent=len(urgent),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=60, help="steps of batch load before the urgent requests start")
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--backlog", type=int, default=8)
    ap.add_argument("--low-prompt", type=int, default=64)
    ap.add_argument("--low-new", type=int, default=48)
    ap.add_argument("--hp-prompt", type=int, default=16)
    ap.add_argument("--hp-new", type=int, default=8)
    ap.add_argument("--every", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = dict(loadavg_before=loadavg(), args=vars(args), variants={})
    base = Engine(args.model, num_threads=args.threads, max_running_requests=args.max_running)
    result["quantize"] = base.quant.mode  # as resolved (the default, auto: gguf for SmolLM2); fresh() keeps it
    print(f"{args.model}: quantize {base.quant.mode}, backend {base.backend}", flush=True)
    variants = {
        "fcfs": (base, False),
        "priority, no preemption": (
            base.fresh(priority_scheduling=True, priority_preemption_threshold=None, num_threads=args.threads),
            True,
        ),
        "priority": (base.fresh(priority_scheduling=True, num_threads=args.threads), True),
    }
    names = list(variants)
    runs: dict[str, list] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            eng, prio = variants[n]
            runs[n].append(one_run(eng, args, prio, seed=r))
    for n in names:
        med = {k: statistics.median(x[k] for x in runs[n]) for k in runs[n][0]}
        result["variants"][n] = dict(median=med, runs=runs[n])
        print(
            f"{n:24s} urgent TTFT p50 {med['ttft_p50'] * 1000:7.0f} ms  p99 {med['ttft_p99'] * 1000:7.0f} ms  "
            f"({med['ttft_steps_p50']:.0f} / {med['ttft_steps_p99']:.0f} steps)  batch load {med['low_tok_s']:6.1f} "
            f"tok/s  preemptions {med['preemptions']:.0f}  ({med['urgent']:.0f} urgent)",
            flush=True,
        )
    result["loadavg_after"] = loadavg()
    print(f"loadavg before {result['loadavg_before']} after {result['loadavg_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
