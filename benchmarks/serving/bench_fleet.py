"""A fleet on one host: 1 worker vs 2 workers behind sglang-router (round-robin, cache-aware) vs one
worker with `--dp 2`; and what the router in front of one worker costs.

    .venv/bin/python benchmarks/serving/bench_fleet.py [--model dummy:tiny] [--rounds 3] [--streams 8]
        [--turns 4] [--num-requests 48] [--prefixes 8] [--scale 1.0] [--num-pages 2048] [--quick]

Setups (every process is a `minisched serve` subprocess or the real router; the router from its own
venv, `make router-env`):

  1 worker             one worker, the client talks to it directly
  1 worker + router    the same worker behind sglang-router (cache_aware): the router's cost
  2 workers rr         two workers behind sglang-router, round_robin
  2 workers ca         the same two workers behind sglang-router, cache_aware
  1 worker --dp 2      one worker with two engine replicas and its own cache-aware router

Cores: each worker's engine runs on one core (`sched_setaffinity`, as `taskset` does): worker 0 on the
first usable CPU, worker 1 on the second; the `--dp 2` worker's server on both and replica i on CPU i.
So "1 worker" has one core for the engine, the other setups two. The client (this process) and the
router are not pinned: they share the same cores. On a 2-core machine that is all there is.

Workloads, both closed loop with `--streams` requests in flight, over SGLang's `/generate` with token
ids (the router's `/v1/completions` refuses token-id prompts):

  multi-turn     `--streams` conversations at once, `--turns` turns each (workloads.make_conversations:
                 a 150-250-token system prompt, 16-48-token user turns, 16-48-token replies); each turn
                 is sent when the one before it finished and carries the whole conversation so far
  shared-prefix  `--num-requests` requests, `--prefixes` system prefixes of 350-450 tokens drawn at
                 random + an 8-32-token question, replies 16-64 (workloads.make_shared_prefix)

Every engine serves a few warm-up requests first. Round r runs every setup on both workloads (seed r), setups in a rotated order per round; before each
run every worker's radix cache is flushed (`POST /flush_cache`) and the router is started afresh (an
empty prefix tree). Measured per run: output tokens/s, TTFT p50/p99 (from when a request was sent),
and the cache hit rate = cached prompt tokens / prompt tokens, summed from the workers' own counters
(each engine replica's `cached_tokens`, GET /health), with the requests each one served.

The machine may be shared: /proc/loadavg is recorded before every run; ratios from a loaded run are
provisional. JSON: benchmarks/results/fleet.json; markdown beside it (fleet.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

from minisched.observe import fleet
from minisched.observe.http_bench import run_http_bench, run_http_conversations
from minisched.observe.workloads import make_conversations, make_shared_prefix
from minisched.parallel import ModelSource

ROOT = Path(__file__).resolve().parents[2]  # the repository
SETUPS = ("1 worker", "1 worker + router", "2 workers rr", "2 workers ca", "1 worker --dp 2")
WORKLOADS = ("multi-turn", "shared-prefix")
ROUTER_COST = ("router cost: throughput behind / direct", "1 worker + router", "1 worker", "output_tok_s", 0.95, True)
TARGETS = (  # (what, workload, numerator setup, denominator setup, key, bound, at least?)
    ("cache-aware hit rate / 1 worker's", "multi-turn", "2 workers ca", "1 worker", "hit_rate", 0.9, True),
    ("cache-aware hit rate / round-robin's", "multi-turn", "2 workers ca", "2 workers rr", "hit_rate", 1.3, True),
    (ROUTER_COST[0], "multi-turn", *ROUTER_COST[1:]),
    (ROUTER_COST[0], "shared-prefix", *ROUTER_COST[1:]),
)


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


class Fleet:
    """The workers (started once, for every round) and a fresh router per run."""

    def __init__(self, args, logdir: Path, cpus: list[int]):
        self.args, self.logdir, self.cpus = args, logdir, cpus
        self.router_py = fleet.router_python()
        if self.router_py is None and any("router" in s or s.startswith("2 workers") for s in args.setups):
            sys.exit("bench_fleet: sglang-router is not installed (make router-env, or MINISCHED_SGLANG_ROUTER)")
        opts = ["--num-pages", str(args.num_pages), "--threads", "1", "--log-level", "warning"]
        opts += ["--max-queued-requests", "4096", *args.worker_args]
        kw = dict(model=args.model, served_model_name="bench")
        self.procs: list[fleet.Proc] = []
        self.router: Optional[fleet.Proc] = None
        start = lambda name, core_ids, *more: self._add(  # noqa: E731
            fleet.start_worker(name, logdir, *opts, *more, cpus=core_ids, **kw)
        )
        try:
            self.w0 = start("worker-0", cpus[:1])
            self.w1 = start("worker-1", cpus[1:2]) if any(s.startswith("2 workers") for s in args.setups) else None
            self.dp = start("worker-dp2", cpus[:2], "--dp", "2") if "1 worker --dp 2" in args.setups else None
            for w in self.procs:
                fleet.wait_healthy(w, 600)
            if self.dp is not None:
                for i, row in enumerate(self.replicas(self.dp)):  # one replica per core, like the two workers
                    fleet.pin_process(row["pid"], [cpus[i]])
            self.warm_up()
        except BaseException:
            self.close()
            raise

    def warm_up(self) -> None:
        """A few requests on every engine first: a worker's first steps (weight packing, allocator) are slow."""
        warm = make_shared_prefix(4, 4, 0, vocab=ModelSource(self.args.model).model_config().vocab_size, seed=99)
        for w in self.procs:  # 4 distinct prompts at once: both replicas of the --dp 2 worker get some
            s, _ = run_http_bench(w.url, warm, model="bench", name="warm-up", api="generate")
            if s["failed"]:
                raise RuntimeError(f"{w.name}: warm-up failed: {s['errors']}")

    def _add(self, p: fleet.Proc) -> fleet.Proc:
        self.procs.append(p)
        return p

    @staticmethod
    def replicas(worker: fleet.Proc) -> list[dict]:
        rows = httpx.get(worker.url + "/health", timeout=10).json().get("replicas")
        if not rows:
            raise RuntimeError(f"{worker.name}: /health lists no engine replicas (an --engine-in-process worker?)")
        return rows

    def workers(self, setup: str) -> list[fleet.Proc]:
        ws = (
            [self.dp]
            if setup == "1 worker --dp 2"
            else [self.w0, self.w1]
            if setup.startswith("2 workers")
            else [self.w0]
        )
        return [w for w in ws if w is not None]

    def url(self, setup: str) -> str:
        """The client's endpoint for `setup`; starts its router (an empty prefix tree) where it has one."""
        self.stop_router()
        if setup in ("1 worker", "1 worker --dp 2"):
            return self.workers(setup)[0].url
        policy = "round_robin" if setup.endswith("rr") else "cache_aware"
        ws = self.workers(setup)
        assert self.router_py is not None  # checked at the start
        self.router = fleet.start_router(self.router_py, [w.url for w in ws], policy, self.logdir, name="router")
        fleet.wait_healthy(self.router, 60, "/liveness")
        fleet.wait_registered(self.router, [w.url for w in ws], 60)
        return self.router.url

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.kill()
            self.router = None

    def flush(self) -> None:
        for w in self.procs:
            r = httpx.post(w.url + "/flush_cache", timeout=60)
            if r.status_code != 200:
                raise RuntimeError(f"{w.name}: /flush_cache answered {r.status_code}: {r.text[:200]}")

    def counters(self, setup: str) -> list[dict]:
        """Each engine replica of the setup's workers: finished requests, prompt and cached tokens so far."""
        keys = ("finished", "prompt_tokens", "cached_tokens")
        return [{k: row[k] for k in keys} for w in self.workers(setup) for row in self.replicas(w)]

    def close(self) -> None:
        self.stop_router()
        for p in self.procs:
            p.kill()


def run_once(f: Fleet, setup: str, workload: str, data, streams: int) -> dict:
    f.flush()
    url = f.url(setup)
    before, load = f.counters(setup), loadavg()
    try:
        if workload == "multi-turn":
            s, _ = run_http_conversations(url, data, model="bench", name=setup)
        else:
            s, _ = run_http_bench(url, data, model="bench", name=setup, api="generate", concurrency=streams)
    finally:
        f.stop_router()
    after = f.counters(setup)
    per = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    prompt, cached = sum(p["prompt_tokens"] for p in per), sum(p["cached_tokens"] for p in per)
    return {
        "setup": setup,
        "workload": workload,
        "loadavg": load,
        "loadavg_1m": float(load.split()[0]),
        "hit_rate": cached / prompt if prompt else 0.0,
        "client_hit_rate": s["cache_hit_rate"],
        "later_turn_hit_rate": s.get("later_turn_hit_rate"),
        "output_tok_s": s["output_tok_s"],
        "duration_s": s["duration_s"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p99_s": s["ttft_s"]["p99"],
        "tpot_p50_s": s["tpot_s"]["p50"],
        "completed": s["completed"],
        "failed": s["failed"],
        "errors": s["errors"],
        "per_engine": per,
    }


def geomean(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def summarize(runs: list[dict], rounds: int) -> dict:
    def pick(setup, workload):
        return [r for r in runs if r["setup"] == setup and r["workload"] == workload]

    median = {
        w: {
            s: {
                k: statistics.median(r[k] for r in pick(s, w))
                for k in ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "hit_rate")
            }
            for s in SETUPS
            if pick(s, w)
        }
        for w in WORKLOADS
    }
    targets = []
    for what, w, num, den, key, bound, at_least in TARGETS:
        pairs = list(zip(pick(num, w), pick(den, w)))
        per_round = [a[key] / b[key] if b[key] else None for a, b in pairs]
        g = geomean([x for x in per_round if x is not None])
        ok = None if g is None else (g >= bound if at_least else g <= bound)
        loads = [r["loadavg_1m"] for pair in pairs for r in pair]
        targets.append(
            {
                "what": what,
                "workload": w,
                "key": key,
                "per_round": per_round,
                "geomean": g,
                "bound": bound,
                "ok": ok,
                "load_1m": [min(loads), max(loads)] if loads else None,
            }
        )
    return {"median": median, "targets": targets, "rounds": rounds}


def markdown(result: dict) -> str:
    cfg, summ = result["config"], result["summary"]
    out = [
        "# Fleet on one host: per-run rows (benchmarks/serving/bench_fleet.py)",
        "",
        f"Generated from `{Path(cfg['out']).name}` ({result['date']}, commit {result['commit']}, model "
        f"{cfg['model']}, {cfg['streams']} streams, {summ['rounds']} round(s){', --quick' if cfg['quick'] else ''}); "
        f"see RESULTS.md, Serving > Fleet. CPUs {result['cpus']}: each worker's engine pinned to one of them; "
        "client and router unpinned. Load before the run: " + result["loadavg_start"] + ".",
        "",
        "| round | workload | setup | out tok/s | TTFT p50 ms | TTFT p99 ms | hit rate (workers) | requests per engine | load 1/5/15 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        failed = f" ({r['failed']} failed)" if r["failed"] else ""
        out.append(
            f"| {r['round']} | {r['workload']} | {r['setup']} | {r['output_tok_s']:.1f} | {1e3 * r['ttft_p50_s']:.0f} | "
            f"{1e3 * r['ttft_p99_s']:.0f} | {r['hit_rate']:.3f} | {'/'.join(str(p['finished']) for p in r['per_engine'])}"
            f"{failed} | {' '.join(r['loadavg'].split()[:3])} |"
        )
    out += ["", "Medians over rounds:", "", "| workload | setup | out tok/s | TTFT p50 ms | TTFT p99 ms | hit rate |"]
    out.append("|---|---|---|---|---|---|")
    for w, rows in summ["median"].items():
        for s, m in rows.items():
            out.append(
                f"| {w} | {s} | {m['output_tok_s']:.1f} | {1e3 * m['ttft_p50_s']:.0f} | {1e3 * m['ttft_p99_s']:.0f} | "
                f"{m['hit_rate']:.3f} |"
            )
    out += ["", "| target | per round | geo-mean | bound | met |", "|---|---|---|---|---|"]
    for t in summ["targets"]:
        per = ", ".join("-" if x is None else f"{x:.2f}" for x in t["per_round"])
        g = "-" if t["geomean"] is None else f"{t['geomean']:.3f}"
        met = {True: "yes", False: "no", None: "-"}[t["ok"]]
        if t["ok"] is not None and t["key"] == "output_tok_s":  # hit rates do not depend on the machine's speed
            met += f" (provisional: load {t['load_1m'][0]:.1f}-{t['load_1m'][1]:.1f})"
        out.append(f"| {t['what']} ({t['workload']}) | {per} | {g} | ≥ {t['bound']} | {met} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8, help="requests in flight (conversations at once)")
    ap.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    ap.add_argument("--num-requests", type=int, default=48, help="shared-prefix: requests per run")
    ap.add_argument("--prefixes", type=int, default=8, help="shared-prefix: distinct system prefixes")
    ap.add_argument("--scale", type=float, default=1.0, help="length scale of prompts and replies")
    ap.add_argument("--num-pages", type=int, default=2048, help="KV pages per engine (default: no eviction)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    ap.add_argument("--worker-args", nargs=argparse.REMAINDER, default=[], help="more `minisched serve` options")
    ap.add_argument("--quick", action="store_true", help="1 round, 4 streams x 2 turns, 16 requests, scale 0.5")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/fleet.json"))
    ap.add_argument("--from-json", metavar="FILE", help="no run: summarize FILE's runs again, rewrite it and its .md")
    args = ap.parse_args()
    if args.from_json:
        path = Path(args.from_json)
        result = json.loads(path.read_text())
        result["summary"] = summarize(result["runs"], result["summary"]["rounds"])
        path.write_text(json.dumps(result, indent=1))
        path.with_suffix(".md").write_text(markdown(result))
        print(f"rewrote {path} and {path.with_suffix('.md')}")
        return
    if args.quick:
        args.rounds, args.streams, args.turns, args.num_requests, args.scale = 1, 4, 2, 16, 0.5
    if args.rounds < 1 or args.streams < 1:
        ap.error("--rounds and --streams must be >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the workers are killed on the way out
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit(f"bench_fleet: needs 2 CPUs (one per worker), this process may use {cpus}")
    start_load = loadavg()
    print(f"load before: {start_load}; CPUs {cpus[:2]} for the workers ({len(cpus)} usable)", flush=True)

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_fleet_") as tmp:
        f = Fleet(args, Path(tmp), cpus)
        try:
            vocab = ModelSource(args.model).model_config().vocab_size
            for r in range(args.rounds):
                for w in args.workloads:
                    if w == "multi-turn":
                        data = make_conversations(args.streams, args.turns, vocab=vocab, seed=r, scale=args.scale)
                    else:
                        data = make_shared_prefix(
                            args.num_requests, args.prefixes, 0, vocab=vocab, seed=r, scale=args.scale
                        )
                    k = r % len(args.setups)
                    order = args.setups[k:] + args.setups[:k]
                    for setup in order if r % 2 == 0 else order[::-1]:
                        res = run_once(f, setup, w, data, args.streams)
                        res["round"] = r
                        runs.append(res)
                        print(
                            f"round {r} {w:13s} {setup:18s} {res['output_tok_s']:8.1f} out tok/s  TTFT p50 "
                            f"{1e3 * res['ttft_p50_s']:7.0f} ms p99 {1e3 * res['ttft_p99_s']:7.0f} ms  hit "
                            f"{res['hit_rate']:.3f}  per engine {[p['finished'] for p in res['per_engine']]}  "
                            f"failed {res['failed']}  load {res['loadavg_1m']:.2f}",
                            flush=True,
                        )
        except BaseException:
            for p in f.procs:
                if not p.alive():
                    print(f"{p.name} exited:\n{p.text()[-2000:]}", file=sys.stderr)
            raise
        finally:
            f.close()

    runs.sort(key=lambda x: (x["round"], WORKLOADS.index(x["workload"]), SETUPS.index(x["setup"])))
    commit = os.popen(f"git -C {ROOT} rev-parse --short HEAD 2>/dev/null").read().strip() or "?"
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "config": {**vars(args), "out": args.out},
        "cpus": cpus[:2],
        "usable_cpus": len(cpus),
        "loadavg_start": start_load,
        "loadavg_end": loadavg(),
        "runs": runs,
        "summary": summarize(runs, args.rounds),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    print("\n" + markdown(result).split("Medians over rounds:")[1])
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
