"""Scheduler rules, minisched's against SGLang's, one option at a time (issue #33). Not a test.

Each rule option of SchedulerConfig where minisched and SGLang 0.5.23 differ (docs/architecture.md,
"Scheduler decisions beyond SGLang's") is switched on its own: the default profile against the default
with only that option set to the other rule's value (`RULES`: minisched's value, SGLang's value); as a
reference row, the whole sglang profile. All arms run the same seeded traffic in the same run.

Decisions are machine-independent: a fake runner (every sampled token is 1, or the stop token 2 where a
request's answer ends early) drives the real Scheduler. Time is virtual: each step advances the clock by a
step-cost model (minisched/observe/whatif.py, `CostModel`) fitted on SmolLM2-135M on this machine's CPU
(`COST_RUN`: which run, its coefficients; `--cost-run PATH` refits from another `minisched bench --json`
file), and requests arrive at their seeded times on that clock. Per arm and workload, over `--seeds` seeds:

- TTFT p50 / p99 / max (virtual s; the max is the fairness figure: the worst-treated request), output
  throughput (tokens / virtual s, first arrival to last finish), the inter-token gap p99 (virtual s);
- machine-free counts: steps, tokens computed (prefill + decode), recomputed tokens (prefill rows of
  requests that were retracted before: work done twice), retractions;
- robustness, once per arm (`stalled`): requests the stall guard ends over 300 random tiny pools.

Workloads (`WORKLOADS`; each names the rules it is there for): shared prefixes under LPM with a pool
smaller than the prefixes, mixed lengths in bursts, memory pressure with retraction, long prompts that
chunk, a chunk budget above max_prefill_tokens, many waiting requests over a prefix tree for the LPM /
DFS-weight fallbacks and ties, cache-hot and cache-cold requests under LPM (aging), and a steady stream
of arrivals over long decodes. Arrivals are spread relative to the default profile's own service time
(`Workload.load`), so the offered load is the same fraction of capacity on any cost model.

Verdict per rule (`verdict`): per workload and metric, the change when SGLang's value replaces minisched's
(the mean over seeds of the per-seed relative change; the tables print it) counts where it is material:
>= MATERIAL (2 %) and of the same sign in all seeds but at most one. Only the issue's measures decide
(`DECIDE`: TTFT p99, throughput, recomputed tokens, fairness as TTFT max and ITL p99, and stalls); TTFT
p50, steps and tokens computed are listed beside them. "minisched wins": some material win and no
material loss; "sglang wins": the reverse; "mixed": both (counted in workload x measure pairs); "no
difference": neither. Prints the tables (markdown) and writes them beside the JSON (`--json`: PATH.json
and PATH.md; `--report PATH` prints a saved run's tables again).

    python benchmarks/sched/bench_rules.py [--seeds 5] [--only WORKLOAD,...] [--rules NAME,...] [--jobs 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from minisched.observe import workloads as bw
from minisched.observe.whatif import FEATURES, CostModel
from minisched.sched.config import PRESETS, SchedulerConfig
from minisched.sched.req import FinishReason
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MATERIAL = 0.02  # a change smaller than 2 % on every metric counts as no difference

# The step-cost model: a `minisched bench --json` run of SmolLM2-135M-Instruct (fp32, CPU, 2 threads) recorded
# once on the development machine; `CostModel.fit` of its journal gave these coefficients (seconds).
COST_RUN = {
    "command": "minisched bench --workload mixed --num-requests 48 --rate 1 --seed 0 --page-size 16 "
    "--num-pages 512 --chunk-size 512 --threads 2 --no-progress --json benchmarks/results/bench_rules_cost_run.json",
    "run": "2026-12-06 01:20 UTC, commit 2a3be69, dev machine (AMD EPYC, AVX2 kernels, 2 cores), fp32; load 0.8 -> 2.7;"
    " 48/48 requests in 196.9 s, out 33.9 tok/s",
    "steps": 479,
    "r2": 0.883,
    "mean_abs_err": 0.213,
    # step, prefill_tokens, prefill_attn_k, decode_rows, decode_ctx_k, draft_tokens (FEATURES), seconds
    "coef_s": [0.09706, 0.003983, 0.013255, 0.0, 0.032549, 0.0],
}

# rule option -> (minisched's value, SGLang 0.5.23's value)
RULES: dict[str, tuple[object, object]] = {
    "max_prefill_rounds_between_decodes": (1, None),
    "admission_budget": ("minisched", "sglang"),
    "max_prefill_tokens_with_chunking": (True, False),
    "chunk_rule": ("minisched", "sglang"),
    "in_batch_prefix_rule": ("defer", "sglang"),
    "retraction_rule": ("minisched", "sglang"),
    "retracted_to_tail": (False, True),
    "pause_admission_when_full": (False, True),
    "policy_sort": ("minisched", "sglang"),
    "aging_rounds": (32, None),
    "dfs_weight_fallback": (True, False),
    "dfs_ties_reversed": (True, False),
    "conservative_eviction": (False, True),
    "lru_rule": ("minisched", "sglang"),
}
# (key, better when: +1 higher, -1 lower). DECIDE: the measures -- TTFT p99, throughput, recompute after
# retraction, fairness (the worst wait of a waiting request, TTFT max, and of a running one, ITL p99); the rest
# (TTFT p50, steps, tokens computed) are reported beside them but decide nothing
METRICS = (
    ("ttft_p99", -1),
    ("out_tok_s", +1),
    ("recomputed", -1),
    ("ttft_max", -1),
    ("itl_p99", -1),
    ("ttft_p50", -1),
    ("steps", -1),
    ("tokens_computed", -1),
    ("stalled", -1),  # the tiny-pools robustness count (`stalled`)
)
DECIDE = {"ttft_p99", "out_tok_s", "recomputed", "ttft_max", "itl_p99", "stalled"}
TINY = "tiny-pools"  # the robustness pseudo-workload: one count per arm


@dataclass(frozen=True)
class Request:
    rid: str
    prompt: tuple[int, ...]
    max_new: int
    arrival: float  # virtual seconds (in a workload's `make`: a fraction of its span, see Workload.load)
    eos_at: int | None = None  # the answer's n-th token is the stop token (None: runs to max_new)


@dataclass(frozen=True)
class Workload:
    name: str
    rules: str  # what it is there for (the table's note)
    config: dict  # SchedulerConfig fields of this workload (pool, chunk, policy)
    make: Callable[[int], list[Request]]  # seed -> requests, arrivals in [0, 1]
    # the arrivals are spread over `load` x the time the default profile takes to serve the same requests all
    # arriving at once (so the offered load is about 1 / load of capacity on any cost model); 0: all at once
    load: float = 0.0


def _poisson(rng, n: int) -> list[float]:
    t = np.cumsum(rng.exponential(1.0, size=n))
    return list(t / t[-1])


def _tokens(rng, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(1000, 20000, size=n))


def _bench(reqs: list[bw.BenchRequest], arrivals) -> list[Request]:
    return [Request(r.rid, r.prompt_ids, r.max_new_tokens, float(a)) for r, a in zip(reqs, arrivals)]


def shared_prefix(seed: int) -> list[Request]:
    # 8 system prompts of ~400 tokens (3,200 in all) over a 2,048-token pool: the cache must choose
    reqs = bw.make_shared_prefix(128, 8, 0, seed=seed)
    return _bench(reqs, _poisson(np.random.default_rng(seed), len(reqs)))


def mixed_burst(seed: int) -> list[Request]:
    # 6 bursts of 16 mixed requests (prompts 8-256, answers 8-128)
    reqs = bw.make_workload("mixed", 96, 0, seed=seed, scale=0.5)
    return _bench(reqs, [(i // 16) / 6 for i in range(len(reqs))])


def pressure(seed: int) -> list[Request]:
    # 96 requests at once, each running to its max_new_tokens (64-384) in a 2,048-token pool: the admission
    # budget's estimate (new_token_ratio decays toward 0.1) admits more than fits later: retraction
    rng = np.random.default_rng(seed)
    return [
        Request(f"p{i}", _tokens(rng, int(rng.integers(64, 257))), int(rng.integers(64, 385)), 0.0) for i in range(96)
    ]


def long_prompt(seed: int) -> list[Request]:
    # 4 bursts of 6 long prompts (1-3k tokens x 0.5, chunked by 512) among chat-sized ones (Poisson)
    rng = np.random.default_rng(seed)
    longs = bw.make_workload("long-prompt", 24, 0, seed=seed, scale=0.5)
    shorts = bw.make_workload("poisson", 48, 0, seed=seed + 1000, scale=0.5)
    return _bench(longs + shorts, [(i // 6) / 4 for i in range(24)] + _poisson(rng, 48))


def big_chunk(seed: int) -> list[Request]:
    # 4 bursts of 16 mixed requests under a chunk budget (2,048) above max_prefill_tokens (1,024)
    reqs = bw.make_workload("mixed", 64, 0, seed=seed)
    return _bench(reqs, [(i // 16) / 4 for i in range(len(reqs))])


def many_waiting(seed: int) -> list[Request]:
    """320 requests at once over a two-level prefix tree: 4 roots (256 tokens) x 4 branches (128) + own 16-64
    tokens; more than 128 wait at first (the FCFS fallback), then fewer."""
    rng = np.random.default_rng(seed)
    branches = [[root + _tokens(rng, 128) for _ in range(4)] for root in (_tokens(rng, 256) for _ in range(4))]
    out = []
    for i in range(320):
        prompt = branches[int(rng.integers(4))][int(rng.integers(4))] + _tokens(rng, int(rng.integers(16, 65)))
        out.append(Request(f"t{i}", prompt, int(rng.integers(8, 33)), 0.0))
    return out


def hot_and_cold(seed: int) -> list[Request]:
    """LPM starvation: 200 requests, 90 % sharing one of two 512-token prefixes (hot), 10 % unique prompts of the
    same length (cold), Poisson, more than the batch takes: a cold request is overtaken by every hot arrival."""
    rng = np.random.default_rng(seed)
    hot = [_tokens(rng, 512) for _ in range(2)]
    out = []
    for i, t in enumerate(_poisson(rng, 200)):
        own = _tokens(rng, int(rng.integers(16, 65)))
        prompt = hot[int(rng.integers(2))] + own if rng.random() < 0.9 else _tokens(rng, 512) + own
        out.append(Request(f"h{i}", prompt, int(rng.integers(16, 65)), t))
    return out


def arrivals(seed: int) -> list[Request]:
    # 8 long decodes and a steady Poisson stream of 256-token prompts with short answers
    rng = np.random.default_rng(seed)
    out = [Request(f"long{i}", _tokens(rng, 64), 300, 0.0) for i in range(8)]
    times = _poisson(rng, 120)
    return out + [Request(f"a{i}", _tokens(rng, 256), 16, t) for i, t in enumerate(times)]


WORKLOADS = [
    Workload(
        "shared-prefix",
        "lpm; deferral, policy sort, aging, LRU",
        {"policy": "lpm", "num_pages": 128},
        shared_prefix,
        load=1.2,
    ),
    Workload("mixed-burst", "admission budget, batch_is_full", {"num_pages": 384}, mixed_burst, load=1.2),
    Workload(
        "pressure",
        "retraction rule, retracted position, eviction",
        {"num_pages": 128, "chunk_size": 512},
        pressure,
    ),
    Workload("long-prompt", "chunk rule", {"num_pages": 192, "chunk_size": 512}, long_prompt, load=1.2),
    Workload(
        "big-chunk",
        "max_prefill_tokens with chunking",
        {"num_pages": 512, "chunk_size": 2048, "max_prefill_tokens": 1024},
        big_chunk,
        load=1.2,
    ),
    Workload(
        "many-waiting/dfs",
        "dfs-weight: fallback above 128 waiting, ties, aging",
        {"policy": "dfs-weight", "num_pages": 256, "max_running_requests": 32},
        many_waiting,
    ),
    Workload(
        "many-waiting/lpm",
        "lpm: fallback, aging, policy sort, in-batch prefixes",
        {"policy": "lpm", "num_pages": 256, "max_running_requests": 32},
        many_waiting,
    ),
    Workload(
        "hot-and-cold",
        "lpm: aging (a cold request overtaken by hot ones)",
        {"policy": "lpm", "num_pages": 256, "max_running_requests": 16},
        hot_and_cold,
        load=0.8,
    ),
    Workload("arrivals", "prefill vs decode rounds", {"num_pages": 1024}, arrivals, load=1.2),
]
WORKLOAD = {w.name: w for w in WORKLOADS}


def traffic(wl: Workload, seed: int, coef: tuple[float, ...]) -> list[Request]:
    """The workload's requests with arrivals in virtual seconds (see Workload.load)."""
    return _traffic(wl.name, seed, coef)


@functools.cache
def _traffic(name: str, seed: int, coef: tuple[float, ...]) -> list[Request]:
    wl = WORKLOAD[name]
    reqs = wl.make(seed)
    if not wl.load:
        return [dataclasses.replace(r, arrival=0.0) for r in reqs]
    burst = [dataclasses.replace(r, arrival=0.0) for r in reqs]
    span = wl.load * simulate(arm_config(wl, {}), burst, np.array(coef))["duration"]
    return [dataclasses.replace(r, arrival=r.arrival * span) for r in reqs]


def simulate(cfg: SchedulerConfig, reqs: list[Request], coef: np.ndarray) -> dict:
    """The requests on a virtual clock: each step costs the model's price of its batch."""
    sched = Scheduler(cfg)
    pending = sorted(reqs, key=lambda r: r.arrival)
    eos = {r.rid: (r.eos_at or 1 << 60) for r in reqs}
    arrival = {r.rid: r.arrival for r in reqs}
    live: dict = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    finish: dict[str, float] = {}
    gaps: list[float] = []
    clock, steps, computed, recomputed = 0.0, 0, 0, 0
    while pending or sched.has_work():
        while pending and pending[0].arrival <= clock:
            r = pending.pop(0)
            sp = SamplingParams(max_new_tokens=r.max_new, ignore_eos=r.eos_at is None, stop_token_ids=(2,))
            live[r.rid] = sched.add_request(r.rid, list(r.prompt), sp)
        batch = sched.get_next_batch()
        if batch is None:
            sched.take_finished()
            if not sched.has_work():
                if not pending:
                    break
                clock = max(clock, pending[0].arrival)
            else:
                clock += float(coef[0])  # an idle step (nothing admissible yet)
            continue
        steps += 1
        rows = set(range(batch.batch_size - batch.num_decode))
        drafts = [0] * batch.batch_size
        clock += max(0.0, float(CostModel.features(batch.prefix_lens, batch.extend_lens, rows, drafts) @ coef))
        computed += batch.num_tokens
        recomputed += sum(batch.extend_lens[b] for b in rows if batch.reqs[b].num_retractions)
        tokens = [2 if len(r.output_ids) + 1 >= eos[r.rid] else 1 for r in batch.reqs]
        done = sched.process_batch_result(batch, tokens)
        for r, sampled in zip(batch.reqs, batch.sampled):
            if not sampled or not r.output_ids:
                continue
            if r.rid not in first:
                first[r.rid] = clock
            elif r.rid in last:
                gaps.append(clock - last[r.rid])
            last[r.rid] = clock
        for r in done:
            finish[r.rid] = clock
    ttfts = [first[rid] - arrival[rid] for rid in first]
    out_tokens = sum(len(r.output_ids) for r in live.values())
    duration = max(finish.values()) - min(arrival.values()) if finish else 0.0
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else 0.0  # noqa: E731
    return {
        "ttft_p50": pct(ttfts, 50),
        "ttft_p99": pct(ttfts, 99),
        "ttft_max": max(ttfts, default=0.0),
        "out_tok_s": out_tokens / max(duration, 1e-9),
        "itl_p99": pct(gaps, 99),
        "steps": steps,
        "tokens_computed": computed,
        "recomputed": recomputed,
        "retractions": sched.num_retracted,
        "duration": duration,
        "finished": len(finish),
        "requests": len(reqs),
    }


def stalled(fields: dict, runs: int = 300, seed: int = 6) -> int:
    """Robustness: requests the stall guard ended (FinishReason.ERROR: no batch could be formed for
    max_stalled_steps steps) over `runs` random small configurations -- page sizes 1-16, chunks 4-32 or none,
    pools of 1-8 pages --, each with a few requests continuing one document. Machine-free."""
    rng = np.random.default_rng(seed)
    doc = [int(t) for t in rng.integers(3, 50, size=200)]
    n = 0
    for r in range(runs):
        ps = int(rng.choice([1, 2, 4, 16]))
        pages = int(rng.integers(1, 9))
        chunk = [None, 4, 8, 16, 32][int(rng.integers(5))]
        try:
            cfg = SchedulerConfig(
                **{
                    "page_size": ps,
                    "num_pages": pages,
                    "chunk_size": chunk,
                    "max_prefill_tokens": int(rng.choice([16, 64, 4096])),
                    "max_context_len": 1000,
                    **fields,
                }
            )
        except ValueError:
            continue
        sched = Scheduler(cfg)
        reqs = []
        for j in range(int(rng.integers(1, 5))):
            k = int(rng.integers(1, ps * pages + 1))
            try:
                sp = SamplingParams(max_new_tokens=int(rng.choice([1, 4, 16])), ignore_eos=True)
                reqs.append(sched.add_request(f"s{r}-{j}", doc[:k], sp))
            except ValueError:  # does not fit this pool: refused at arrival
                pass
        for _ in range(5000):
            if not sched.has_work():
                break
            batch = sched.get_next_batch()
            if batch is None:
                sched.take_finished()
            else:
                sched.process_batch_result(batch, [1] * batch.batch_size)
        n += sum(1 for q in reqs if q.finish_reason is FinishReason.ERROR)
    return n


def arms(rules: list[str]) -> list[tuple[str, dict]]:
    """(label, config fields over the default profile): the default, each rule at the value that is not the
    default's (the other is the default arm itself), the sglang profile."""
    default = SchedulerConfig()
    out = [("default", {})]
    for name in rules:
        for who, value in zip(("minisched", "sglang"), RULES[name]):
            if getattr(default, name) != value:
                out.append((f"{name}={who}", {name: value}))
    out.append(("sglang profile", dict(PRESETS["sglang"])))
    return out


def arm_config(wl: Workload, fields: dict) -> SchedulerConfig:
    base = {"page_size": 16, "max_context_len": 4096, **wl.config}
    return SchedulerConfig(**{**base, **fields})


def _job(args: tuple) -> tuple:
    wl_name, seed, label, fields, coef = args
    t = time.process_time()
    if wl_name == TINY:
        return wl_name, seed, label, {"stalled": stalled(fields), "cpu_s": time.process_time() - t}
    wl = WORKLOAD[wl_name]
    res = simulate(arm_config(wl, fields), traffic(wl, seed, tuple(coef)), np.array(coef))
    res["cpu_s"] = time.process_time() - t
    return wl_name, seed, label, res


def side(results: dict, wl: str, name: str, who: str, default: object) -> list[dict] | None:
    """The per-seed results of rule `name` at `who`'s value on workload `wl` (the default arm when that is it)."""
    value = RULES[name][0 if who == "minisched" else 1]
    if default == value:
        return results[wl].get("default")
    return results[wl].get(f"{name}={who}")


def change(a: list[dict], b: list[dict], key: str) -> tuple[float, int]:
    """(mean over seeds of (b - a) / |a|, how many seeds agree with the mean's sign); a 0 -> x change counts as
    +-100 %, equal values as 0."""
    rel = [0.0 if x[key] == y[key] else (y[key] - x[key]) / abs(x[key]) if x[key] else 1.0 for x, y in zip(a, b)]
    m = float(np.mean(rel)) if rel else 0.0
    return m, sum(1 for r in rel if r * m > 0)


def material(m: float, agree: int, seeds: int) -> bool:
    """>= MATERIAL on average and the same sign in every seed but at most one (all of them below 3 seeds)."""
    return abs(m) >= MATERIAL and agree >= (seeds - 1 if seeds >= 3 else seeds)


def verdict(results: dict, name: str, default: object) -> tuple[str, list[str], list[str], list[str]]:
    """(verdict, where minisched's rule wins, where it loses, other material changes): per workload and metric,
    the change from minisched's value to SGLang's where it is material (`material`); the verdict counts the
    DECIDE metrics only."""
    wins, losses, other = [], [], []
    for wl in results:
        a, b = side(results, wl, name, "minisched", default), side(results, wl, name, "sglang", default)
        if a is None or b is None:
            continue
        for key, better in METRICS:
            if key not in a[0]:
                continue
            c, agree = change(a, b, key)  # c > 0: higher with SGLang's value
            if material(c, agree, len(a)):
                item = f"{wl} {key} {c:+.1%}"
                if key in ("recomputed", "stalled"):  # (counts near 0: absolute means, minisched's -> SGLang's)
                    item = f"{wl} {key} {mean(a, key):.0f} -> {mean(b, key):.0f}"
                if key not in DECIDE:
                    other.append(item)
                else:
                    (wins if c * better < 0 else losses).append(item)
    if wins and not losses:
        v = "minisched wins"
    elif losses and not wins:
        v = "sglang wins"
    elif wins:
        v = f"mixed ({len(wins)} wins, {len(losses)} losses)"
    else:
        v = "no difference"
    return v, wins, losses, other


def mean(rows: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in rows]))


def fit_cost(path: str) -> dict:
    from minisched.observe.run_record import load_runs

    run = load_runs(path)[0]
    model = CostModel.fit(run.journal)
    return {
        "command": f"(refitted from {path})",
        "steps": model.num_steps,
        "r2": model.r2,
        "mean_abs_err": model.mean_abs_err,
        "coef_s": [float(c) for c in model.coef],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated workload names")
    ap.add_argument("--rules", default="", help="comma-separated rule options (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--cost-run", default=None, help="a `minisched bench --json` file to fit the step cost on")
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "bench_rules.json"))
    ap.add_argument("--report", default=None, help="print the tables of a JSON this script wrote; run nothing")
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        names = [n for n in saved["rules"] if n in RULES]
        defaults = {n: saved["rules"][n]["default"] for n in names}
        print(report(saved["results"], defaults, [WORKLOAD[w] for w in saved["results"] if w in WORKLOAD]))
        return
        return
    if args.seeds < 1 or args.jobs < 1:
        print("bench_rules: --seeds and --jobs must be >= 1", file=sys.stderr)
        sys.exit(2)
    only = set(filter(None, args.only.split(",")))
    unknown = only - {w.name for w in WORKLOADS}
    rules = [r for r in args.rules.split(",") if r] or list(RULES)
    bad = [r for r in rules if r not in RULES]
    if unknown or bad:
        print(f"bench_rules: unknown workload(s) {sorted(unknown)} or rule(s) {bad}", file=sys.stderr)
        sys.exit(2)
    cost = fit_cost(args.cost_run) if args.cost_run else COST_RUN
    if not any(cost["coef_s"]):
        print("bench_rules: no step-cost coefficients (COST_RUN is empty): pass --cost-run", file=sys.stderr)
        sys.exit(2)
    wls = [w for w in WORKLOADS if not only or w.name in only]
    jobs = [(w.name, s, label, f, cost["coef_s"]) for w in wls for label, f in arms(rules) for s in range(args.seeds)]
    jobs += [(TINY, 0, label, f, cost["coef_s"]) for label, f in arms(rules)]
    load0, t0 = os.getloadavg(), time.monotonic()
    results: dict[str, dict[str, list[dict]]] = {w.name: {} for w in wls} | {TINY: {}}
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as ex:
            done = list(ex.map(_job, jobs, chunksize=1))
    else:
        done = [_job(j) for j in jobs]
    for wl, _seed, label, res in done:
        results[wl].setdefault(label, []).append(res)
    wall, load1 = time.monotonic() - t0, os.getloadavg()
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    defaults = {n: getattr(SchedulerConfig(), n) for n in rules}
    tables = report(results, defaults, wls)
    print(tables)
    print(f"\n{len(jobs)} runs in {wall:.0f} s, load {load0[0]:.1f} -> {load1[0]:.1f}; cost model: {cost['command']}")
    out = {
        "commit": commit.stdout.strip(),
        "machine": platform.processor() or platform.machine(),
        "wall_s": wall,
        "load": [load0, load1],
        "seeds": args.seeds,
        "cost_model": {"features": list(FEATURES), **cost},
        "workloads": {w.name: {"for": w.rules, "config": w.config} for w in wls},
        "rules": {
            n: {"minisched": RULES[n][0], "sglang": RULES[n][1], "default": getattr(SchedulerConfig(), n)}
            for n in rules
        },
        "results": results,
        "verdicts": {
            n: dict(zip(("verdict", "minisched_wins", "minisched_loses", "other"), verdict(results, n, defaults[n])))
            for n in rules
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, default=str)
    md = os.path.splitext(args.json)[0] + ".md"
    with open(md, "w") as f:
        f.write(
            f"<!-- {' '.join(sys.argv)}; commit {out['commit']}; load {load0[0]:.1f} -> {load1[0]:.1f} -->\n\n{tables}"
        )
    print(f"wrote {args.json} and {md}")


def report(results: dict, defaults: dict, wls: list[Workload]) -> str:
    """The tables (markdown); `defaults`: rule -> the default profile's value when the run was made."""
    lines: list[str] = []
    print = lambda text="", end="\n": lines.append(text + end)  # noqa: A001, E731
    keys = ("ttft_p50", "ttft_p99", "ttft_max", "out_tok_s", "itl_p99", "steps", "tokens_computed", "recomputed")
    print("## Absolute values (mean over seeds)\n")
    print(
        "| workload | arm | TTFT p50 / p99 / max s | out tok/s | ITL p99 s | steps | tokens | recomputed | retractions |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for w in wls:
        for label, rows in results[w.name].items():
            m = {k: mean(rows, k) for k in (*keys, "retractions")}
            print(
                f"| {w.name} | {label} | {m['ttft_p50']:.2f} / {m['ttft_p99']:.2f} / {m['ttft_max']:.2f} | "
                f"{m['out_tok_s']:.1f} | {m['itl_p99']:.2f} | {m['steps']:.0f} | {m['tokens_computed']:.0f} | "
                f"{m['recomputed']:.0f} | {m['retractions']:.1f} |"
            )
    tiny = results.get(TINY, {})
    if tiny:
        print(f"\n{TINY} (`stalled`): requests ended by the stall guard, per arm: ", end="")
        print("; ".join(f"{label} {rows[0]['stalled']}" for label, rows in tiny.items()))
    print("\n## Per rule: the change when SGLang's value replaces minisched's (material ones; `verdict`)\n")
    print("| rule | verdict | where minisched's rule wins | where it loses | other material changes |")
    print("|---|---|---|---|---|")
    for name, default in defaults.items():
        v, wins, losses, other = verdict(results, name, default)
        print(f"| {name} | {v} | {'; '.join(wins) or '-'} | {'; '.join(losses) or '-'} | {'; '.join(other) or '-'} |")
    return "".join(lines)


if __name__ == "__main__":
    main()
