"""What the OpenAI sampling features cost: `n` = 4 against four separate requests, and logprobs on
against off, in-process on SmolLM2 (CPU), interleaved rounds (A, B, A, B).

    python benchmarks/serving/bench_sampling.py [--rounds 2] [--json out.json]

- n: 8 chat prompts x 4 sampled choices (temperature 0.8, seeds s..s+3), as `generate(..., n=4)`
  and as 32 requests (each prompt four times, seeds s..s+3): prefill tokens computed, output tok/s.
  The outputs are the same either way (same seeds); only the prefill work differs.
- logprobs: the same 8 prompts x 32 greedy tokens with `logprobs=5` and without: ms per step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from minisched import Engine, SamplingParams

PROMPTS = [
    "What is paged attention?",
    "Name three fruits.",
    "Explain radix trees briefly.",
    "Write a haiku about rain.",
    "What is 17 times 3?",
    "Give me a synonym for fast.",
    "Why is the sky blue?",
    "Describe a cat in one line.",
]
SYSTEM = "You are a concise assistant. Answer in one or two sentences."


def loadavg() -> float:
    return os.getloadavg()[0]


def run(engine: Engine, prompts, sampling, n: int) -> dict:
    engine.scheduler.drain_records()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sampling, n=n)
    dt = time.perf_counter() - t0
    stats = engine.scheduler.records().step_stats
    return {
        "seconds": dt,
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "prefill_tokens": sum(s.num_prefill_tokens for s in stats),
        "steps": len(stats),
        "tokens": [o.token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = Engine("smollm2")
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}] for p in PROMPTS]
    ids = [engine.encode(c) for c in chats]
    rows = []
    for r in range(args.rounds):
        for mode in ("n=4", "4 requests") if r % 2 == 0 else ("4 requests", "n=4"):
            fresh = engine.fresh()  # an empty radix cache each time: the prefill work is what differs
            sp = SamplingParams(temperature=0.8, seed=100, max_new_tokens=args.new_tokens, ignore_eos=True)
            if mode == "n=4":
                res = run(fresh, ids, sp, 4)
            else:
                sps = [
                    SamplingParams(temperature=0.8, seed=100 + j, max_new_tokens=args.new_tokens, ignore_eos=True)
                    for _ in ids
                    for j in range(4)
                ]
                res = run(fresh, [p for p in ids for _ in range(4)], sps, 1)
            rows.append({"round": r, "case": mode, "load": loadavg(), **res})
        for mode in ("logprobs off", "logprobs 5") if r % 2 == 0 else ("logprobs 5", "logprobs off"):
            fresh = engine.fresh()
            sp = SamplingParams(
                max_new_tokens=args.new_tokens, ignore_eos=True, logprobs=5 if mode == "logprobs 5" else None
            )
            res = run(fresh, ids, sp, 1)
            rows.append({"round": r, "case": mode, "load": loadavg(), **res})
    same = {tuple(map(tuple, row["tokens"])) for row in rows if row["case"] in ("n=4", "4 requests")}
    print(f"{'case':14}{'prefill tok':>12}{'out tok/s':>11}{'ms/step':>9}{'load':>6}")
    summary = {}
    for case in ("n=4", "4 requests", "logprobs off", "logprobs 5"):
        mine = [row for row in rows if row["case"] == case]
        tps = statistics.median(row["output_tokens"] / row["seconds"] for row in mine)
        ms = statistics.median(1e3 * row["seconds"] / row["steps"] for row in mine)
        summary[case] = {"prefill_tokens": mine[0]["prefill_tokens"], "output_tok_s": tps, "ms_per_step": ms}
        print(
            f"{case:14}{mine[0]['prefill_tokens']:>12}{tps:>11.1f}{ms:>9.1f}{statistics.mean(r['load'] for r in mine):>6.2f}"
        )
    print(
        f"n=4 computes {summary['n=4']['prefill_tokens'] / summary['4 requests']['prefill_tokens']:.2f}x the prefill "
        f"tokens of 4 requests; outputs identical: {len(same) == 1}; logprobs cost "
        f"{summary['logprobs 5']['ms_per_step'] / summary['logprobs off']['ms_per_step']:.3f}x per step"
    )
    if args.json:
        for row in rows:
            row.pop("tokens")
        with open(args.json, "w") as f:
            json.dump(
                {
                    "benchmark": "bench_sampling",
                    "machine": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(),
                    "rows": rows,
                    "summary": summary,
                    "outputs_identical": len(same) == 1,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
