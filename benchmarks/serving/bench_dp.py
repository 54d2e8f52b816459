"""Data parallelism: cache-aware vs round-robin routing over DP replicas, same run, interleaved.

    .venv/bin/python benchmarks/serving/bench_dp.py [--model dummy:tiny] [--dp 2] [--rounds 3] [--num-requests 64]
                                            [--prefixes 4] [--rate 16] [--scale 0.5] [--num-pages 256]

One `EnginePool` (N replica processes) behind the HTTP server in this process; the
client (`run_http_bench`, streaming, token-id prompts, `ignore_eos`) replays the shared-prefix
workload: `--prefixes` system prefixes of 350-450 tokens (x `--scale`) + a 8-32-token question,
outputs 16-64, Poisson arrivals at `--rate`. Each request's prefix is drawn at random -- with
`make_workload`'s `i % 4` order, round-robin over 2 replicas would keep every prefix on one
replica by accident. Round r runs both policies on the same workload (seed r), in the order
cache-aware, round-robin on even rounds and the reverse on odd ones; before each run the
replicas' radix caches and the router's trees are emptied.

Hit rate = prompt tokens served from a replica's radix cache / prompt tokens, summed from each
replica's finished requests (`EnginePool.health()`); it does not depend on the machine's
speed. Throughput (output tokens / s) and TTFT do, and this machine is shared: the 1-minute load
average is recorded before every run. JSON: benchmarks/results/dp_routing.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import socket
import statistics
import threading
import time
from pathlib import Path

from minisched.engine import Engine
from minisched.observe.http_bench import run_http_bench
from minisched.observe.workloads import BenchRequest, make_shared_prefix
from minisched.serve import create_app, make_server
from minisched.serve.limits import ServerLimits
from minisched.serve.pool import EnginePool
from minisched.serve.router import RouterConfig

ROOT = Path(__file__).resolve().parents[2]  # the repository
POLICIES = ("cache-aware", "round-robin")


def serve(pool: EnginePool):
    app = create_app(pool.info, model_name="bench", engine_loop=pool, limits=ServerLimits(max_queued_requests=4096))
    server = make_server(app, grace_period=1.0, log_level="warning")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def one_run(url: str, pool: EnginePool, policy: str, workload: list[BenchRequest]) -> dict:
    pool.set_policy(RouterConfig(policy))
    pool.flush_cache()
    before = pool.health().replicas
    load = os.getloadavg()[0]
    summary, _ = run_http_bench(url, workload, model="bench", name=policy)
    after = pool.health().replicas
    per = [
        {k: a[k] - b[k] for k in ("finished", "prompt_tokens", "cached_tokens", "routed")}
        for a, b in zip(after, before)
    ]
    for p in per:
        p["hit_rate"] = p["cached_tokens"] / p["prompt_tokens"] if p["prompt_tokens"] else 0.0
    prompt, cached = sum(p["prompt_tokens"] for p in per), sum(p["cached_tokens"] for p in per)
    return {
        "policy": policy,
        "loadavg_1m": load,
        "hit_rate": cached / prompt if prompt else 0.0,
        "client_hit_rate": summary["cache_hit_rate"],
        "output_tok_s": summary["output_tok_s"],
        "duration_s": summary["duration_s"],
        "ttft_p50_s": summary["ttft_s"]["p50"],
        "e2e_p50_s": summary["e2e_latency_s"]["p50"],
        "failed": summary["failed"],
        "replicas": per,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--rate", type=float, default=16.0, help="requests/s (0: all at t=0)")
    ap.add_argument("--scale", type=float, default=0.5, help="length scale of prompts and outputs")
    ap.add_argument("--num-pages", type=int, default=256, help="KV pages per replica")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/dp_routing.json"))
    args = ap.parse_args()

    factory = functools.partial(Engine, args.model, num_pages=args.num_pages)
    pool = EnginePool([factory] * args.dp).start()
    url, server, thread = serve(pool)
    runs = []
    try:
        vocab = pool.info.cfg.vocab_size
        for r in range(args.rounds):
            workload = make_shared_prefix(
                args.num_requests, args.prefixes, args.rate, vocab=vocab, seed=r, scale=args.scale, name="dp"
            )
            for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                res = one_run(url, pool, policy, workload)
                res["round"] = r
                runs.append(res)
                print(
                    f"round {r} {policy:12s} hit {res['hit_rate']:.3f}  {res['output_tok_s']:7.1f} out tok/s  "
                    f"TTFT p50 {res['ttft_p50_s']:.3f} s  load {res['loadavg_1m']:.1f}  "
                    f"routed {[p['routed'] for p in res['replicas']]}  failed {res['failed']}",
                    flush=True,
                )
    finally:
        server.should_exit = True
        thread.join(30)
        pool.stop()
        pool.join(20)

    def med(policy, key):
        return statistics.median(x[key] for x in runs if x["policy"] == policy)

    ratios = {
        key: [
            a[key] / b[key] if b[key] else None
            for a, b in zip(*([x for x in runs if x["policy"] == p] for p in POLICIES))
        ]
        for key in ("hit_rate", "output_tok_s")
    }
    summary = {p: {k: med(p, k) for k in ("hit_rate", "output_tok_s", "ttft_p50_s", "e2e_p50_s")} for p in POLICIES}
    print(f"\nmedian over {args.rounds} rounds (cache-aware / round-robin per round):")
    for key in ("hit_rate", "output_tok_s", "ttft_p50_s"):
        print(
            f"  {key:13s} cache-aware {summary['cache-aware'][key]:8.3f}   round-robin "
            f"{summary['round-robin'][key]:8.3f}"
        )
    print(
        f"  ratios hit {[f'{x:.2f}' for x in ratios['hit_rate']]}  throughput "
        f"{[f'{x:.2f}' for x in ratios['output_tok_s']]}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "config": vars(args),
                "router_defaults": dataclasses.asdict(RouterConfig()),
                "cpus": len(os.sched_getaffinity(0)),
                "runs": runs,
                "median": summary,
                "ratios": ratios,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
