"""Scheduler overhead benchmark (pure Python, fake runner; not a test).

1. Step overhead per policy: 256 running + 1,000 waiting requests (shared 256-token
   system prompts + unique suffixes, page_size 16), with churn: running requests finish
   after 1-64 tokens and the queue is refilled to 1,000, so admissions, radix inserts and
   policy sorts happen continually. Timed: get_next_batch + process_batch_result
   ("sched"), and additionally the Batch arrays an engine builds ("+arrays":
   input_ids, positions, out_slots, page_table, logits_indices). "lpm@128" keeps 128
   waiting so LPM does not fall back to FCFS.
2. Radix cache: insert 10,000 requests' prompts, then match_prefix on 2,000 prompts.

Targets: FCFS step under 1 ms, LPM under 3 ms. Writes JSON (--json) and prints a table.

    python benchmarks/sched/bench_scheduler.py [--steps 300] [--running 256] [--waiting 1000] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import time

from minisched.sched.radix_cache import RadixCache
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")

VOCAB = 32000


def make_prompt(rng: random.Random, systems: list[list[int]]) -> list[int]:
    return rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(rng.randint(16, 256))]


def bench_policy(policy: str, n_running: int, n_waiting: int, steps: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(256)] for _ in range(16)]
    cfg = SchedulerConfig(
        page_size=16,
        num_pages=16384,
        max_context_len=4096,
        chunk_size=8192,
        max_prefill_tokens=16384,
        max_running_requests=n_running,
        policy=policy,
    )
    sched = Scheduler(cfg)
    n = 0

    def add(k: int) -> None:
        nonlocal n
        for _ in range(k):
            sched.add_request(
                f"r{n}", make_prompt(rng, systems), SamplingParams(max_new_tokens=rng.randint(1, 64), ignore_eos=True)
            )
            n += 1

    def one_step(arrays: bool) -> tuple[float, float, str]:
        t0, c0 = time.perf_counter(), time.thread_time()
        batch = sched.get_next_batch()
        if batch is None:
            return 0.0, 0.0, "idle"
        if arrays:
            batch.input_ids(), batch.positions(), batch.out_slots(), batch.page_table(), batch.logits_indices()
        sched.process_batch_result(batch, [1] * len(batch.reqs))
        return time.perf_counter() - t0, time.thread_time() - c0, batch.mode.value

    add(n_running)
    while len(sched.running) < n_running and sched.has_work():  # warm up: fill the decode batch
        one_step(False)
        add(n_running - len(sched.running) - len(sched.waiting))
    gc.collect()
    gc.freeze()  # long-lived setup objects out of the collector's way, as a server would after warm-up
    out = {"policy": policy, "running": n_running, "waiting": n_waiting}
    for arrays in (False, True):
        wall: dict[str, list[float]] = {"all": []}
        cpu: dict[str, list[float]] = {"all": []}
        for _ in range(steps):
            add(n_waiting - len(sched.waiting))
            dt, ct, mode = one_step(arrays)
            for d, t in ((wall, dt), (cpu, ct)):
                d["all"].append(t)
                d.setdefault(mode, []).append(t)
        tag = "arrays_" if arrays else ""
        for k in wall:
            out[f"{tag}{k}_cpu_mean_ms"] = 1e3 * statistics.fmean(cpu[k])
            out[f"{tag}{k}_wall_mean_ms"] = 1e3 * statistics.fmean(wall[k])
            out[f"{tag}{k}_wall_p99_ms"] = 1e3 * sorted(wall[k])[int(0.99 * (len(wall[k]) - 1))]
            out[f"{tag}{k}_steps"] = len(wall[k])
    gc.unfreeze()
    out["mean_running"] = statistics.fmean(s.num_running for s in sched.step_stats[-steps:])
    out["cache_hit_tokens_per_step"] = statistics.fmean(s.cache_hit_tokens for s in sched.step_stats[-steps:])
    return out


def bench_radix(n_reqs: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(256)] for _ in range(64)]
    prompts = [make_prompt(rng, systems) for _ in range(n_reqs)]
    ps = 16
    tree = RadixCache(ps)
    next_page = 0
    queries = [rng.choice(prompts) for _ in range(1000)] + [make_prompt(rng, systems) for _ in range(1000)]
    gc.collect()
    gc.freeze()
    w0, c0 = time.perf_counter(), time.thread_time()
    for p in prompts:
        npg = len(p) // ps
        tree.insert(p, list(range(next_page, next_page + npg)))
        next_page += npg
    w_insert, c_insert = time.perf_counter() - w0, time.thread_time() - c0
    w0, c0 = time.perf_counter(), time.thread_time()
    for q in queries:
        tree.match_prefix(q)
    w_match, c_match = time.perf_counter() - w0, time.thread_time() - c0
    nodes = sum(1 for _ in tree.iter_nodes())
    cached = tree.total_pages
    w0, c0 = time.perf_counter(), time.thread_time()
    tree.evict(1000)
    w_evict, c_evict = time.perf_counter() - w0, time.thread_time() - c0
    gc.unfreeze()
    return {
        "requests": n_reqs,
        "nodes": nodes,
        "cached_pages": cached,
        "insert_cpu_us": 1e6 * c_insert / n_reqs,
        "insert_wall_us": 1e6 * w_insert / n_reqs,
        "match_prefix_cpu_us": 1e6 * c_match / len(queries),
        "match_prefix_wall_us": 1e6 * w_match / len(queries),
        "evict_1000_pages_cpu_ms": 1e3 * c_evict,
        "evict_1000_pages_wall_ms": 1e3 * w_evict,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=os.path.join(RESULTS_DIR, "bench_scheduler.json"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--waiting", type=int, default=1000)
    ap.add_argument("--radix-requests", type=int, default=10_000)
    args = ap.parse_args()

    rows = [bench_policy(p, args.running, args.waiting, args.steps) for p in ("fcfs", "lpm", "dfs-weight", "lof")]
    lpm128 = bench_policy("lpm", args.running, 128, args.steps)
    lpm128["policy"] = "lpm@128"
    rows.append(lpm128)
    radix = bench_radix(args.radix_requests)
    result = {
        "machine": {
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "loadavg_1min": os.getloadavg()[0],
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "policies": rows,
        "radix": radix,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)

    print(
        f"scheduler step overhead (ms), {args.running} running, {args.waiting} waiting, {args.steps} steps; "
        f"cpu = thread CPU time (robust to a loaded machine), wall = mean / p99"
    )
    print(
        f"{'policy':<11} {'cpu step':>9} {'cpu decode':>11} {'cpu prefill':>12} {'wall step':>16} "
        f"{'cpu +arrays':>12} {'wall +arrays':>16} {'running':>8}"
    )
    for r in rows:

        def c(k: str) -> str:
            return f"{r[k]:.3f}" if k in r else "-"

        print(
            f"{r['policy']:<11} {c('all_cpu_mean_ms'):>9} {c('decode_cpu_mean_ms'):>11} {c('prefill_cpu_mean_ms'):>12} "
            f"{c('all_wall_mean_ms') + ' / ' + c('all_wall_p99_ms'):>16} {c('arrays_all_cpu_mean_ms'):>12} "
            f"{c('arrays_all_wall_mean_ms') + ' / ' + c('arrays_all_wall_p99_ms'):>16} {r['mean_running']:>8.1f}"
        )
    print(
        f"radix cache, {radix['requests']} requests ({radix['nodes']} nodes, {radix['cached_pages']} pages), "
        f"cpu / wall: insert {radix['insert_cpu_us']:.1f} / {radix['insert_wall_us']:.1f} us, "
        f"match_prefix {radix['match_prefix_cpu_us']:.1f} / {radix['match_prefix_wall_us']:.1f} us, "
        f"evict 1000 pages {radix['evict_1000_pages_cpu_ms']:.2f} / {radix['evict_1000_pages_wall_ms']:.2f} ms"
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
