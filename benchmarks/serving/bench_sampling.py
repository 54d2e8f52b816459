"""What the OpenAI sampling features cost: `n` = 4 against four separate requests, and logprobs on
against off, in-process on SmolLM2 (CPU), interleaved rounds (A, B, A, B).

    python benchmarks/serving/bench_sampling.py [--rounds 2] [--json out.json]
    python benchmarks/serving/bench_sampling.py --sampler [--rounds 3] [--json out.json]

- n: 8 chat prompts x 4 sampled choices (temperature 0.8, seeds s..s+3), as `generate(..., n=4)`
  and as 32 requests (each prompt four times, seeds s..s+3): prefill tokens computed, output tok/s.
  The outputs are the same either way (same seeds); only the prefill work differs.
- logprobs: the same 8 prompts x 32 greedy tokens with `logprobs=5` and without: ms per step.
- `--sampler`: one `sample()` call (model/sampling.py) on [B, 49152] logits, B = 1 / 8 / 64, against the
  sampler before 742d18d (a full sort of every sampled row: `_sorted_probs` on all rows, then the same
  inverse CDF), alternated, median ms of each of --rounds rounds of ~0.5 s; Zipf-like logits (p ~
  rank^-1.2, a language model's shape) and settings: temperature 1 (the OpenAI default and vLLM's
  benchmark client), top-k 40, top-p 0.9, temperature 0.8 + top-p 0.95 + min-p 0.05. Both draw from the
  same distribution (tests/model/test_sampling.py).
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


def full_sort_sample(logits, params, generators) -> list[int]:
    """The sampler before 742d18d: every sampled row sorted over the whole vocabulary."""
    import torch

    from minisched.model.sampling import _sorted_probs

    t = torch.tensor([p.temperature for p in params])[:, None]
    probs, order = _sorted_probs(logits / t, params, logits.shape[-1])
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.stack([torch.rand((), generator=g) for g in generators]) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None], right=True).clamp(max=logits.shape[-1] - 1)
    return order.gather(1, pick)[:, 0].tolist()


def sampler_cost(rounds: int) -> dict:
    import torch

    from minisched.model.sampling import make_generator, sample

    vocab = 49152
    g = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32).log() * -1.2
    settings = {
        "temperature 1": SamplingParams(temperature=1.0),
        "top-k 40": SamplingParams(temperature=1.0, top_k=40),
        "top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
        "t 0.8, top-p 0.95, min-p 0.05": SamplingParams(temperature=0.8, top_p=0.95, min_p=0.05),
    }
    out: dict = {"load_before": loadavg(), "cases": []}
    for b in (1, 8, 64):
        logits = torch.stack([ranks[torch.randperm(vocab, generator=g)] for _ in range(b)])
        for name, sp in settings.items():
            ps, gens = [sp] * b, [make_generator(i) for i in range(b)]
            ms: dict[str, list[float]] = {"new": [], "full sort": []}
            for r in range(rounds):
                for which in ("new", "full sort") if r % 2 == 0 else ("full sort", "new"):
                    fn = sample if which == "new" else full_sort_sample
                    fn(logits, ps, gens)
                    times = []
                    end = time.perf_counter() + 0.5
                    while time.perf_counter() < end or len(times) < 3:
                        t0 = time.perf_counter()
                        fn(logits, ps, gens)
                        times.append(time.perf_counter() - t0)
                    ms[which].append(1e3 * statistics.median(times))
            ratio = statistics.median(f / n for f, n in zip(ms["full sort"], ms["new"]))
            case = {"batch": b, "setting": name, "new_ms": statistics.median(ms["new"])}
            case |= {"full_sort_ms": statistics.median(ms["full sort"]), "speedup": ratio}
            out["cases"].append(case)
            print(
                f"B={b:3d} {name:32s} new {case['new_ms']:8.2f} ms  full sort {case['full_sort_ms']:8.2f} ms  "
                f"x{ratio:.1f}",
                flush=True,
            )
    out["load_after"] = loadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--sampler", action="store_true", help="the sampler's own cost only (see the docstring)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.sampler:
        res = sampler_cost(args.rounds)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"benchmark": "bench_sampling --sampler", "isa": platform.machine(), **res}, f, indent=1)
        return
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
