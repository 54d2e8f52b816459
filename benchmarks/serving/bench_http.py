"""Serving over HTTP: in-process vs over HTTP, /health latency under load, continuous vs
static batching over HTTP. Writes JSON (default benchmarks/results/http_serving.json) and prints a table.

    .venv/bin/python benchmarks/serving/bench_http.py [--model smollm2] [--pairs 2] [--num-requests 16] [--scale 0.5]

1. in-process vs HTTP: the same workload (poisson; all requests at t=0, the engine saturated, and
   at a Poisson rate for TTFT without a queue),
   run A = `run_workload` on an Engine in this process (stepped from a worker thread, like the
   server's engine loop), B = `run_http_bench` against
   `minisched serve` in a subprocess (same model and pool), interleaved A,B,A,B; pair i uses
   workload seed i, so no run reuses another's cached prompts. The server subprocess is idle
   during A (its engine thread blocks on its inbox).
2. /health while saturated: during every B run a thread GETs /health every 50 ms (its own
   connection); p50 / p99 / max.
3. continuous vs static over HTTP: the mixed workload against a continuous server and a
   static-batching server (`EngineLoop(static_batch=N)`, no radix cache -- the in-process
   bench's baseline), interleaved.

The machine is shared: the 1-minute load average is recorded before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]  # the repository


def serve_only(args) -> None:
    """The server subprocess: `minisched serve`, optionally with static batching."""
    from minisched.engine import Engine
    from minisched.serve import EngineLoop, create_app, run
    from minisched.serve.limits import ServerLimits

    engine = Engine(
        args.model, num_pages=args.num_pages, enable_radix_cache=not args.static_batch, max_running_requests=64
    )
    loop = EngineLoop(engine, static_batch=args.static_batch or None)
    app = create_app(engine, model_name="bench", engine_loop=loop, limits=ServerLimits(max_queued_requests=4096))
    run(app, port=args.port, log_level="warning", grace_period=1.0)


class Server:
    def __init__(self, args, static_batch: int = 0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            __file__,
            "--serve-only",
            "--port",
            str(self.port),
            "--model",
            args.model,
            "--num-pages",
            str(args.num_pages),
            "--static-batch",
            str(static_batch),
        ]
        self.proc = subprocess.Popen(cmd, cwd=ROOT)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class HealthProbe:
    """GET /health every `period` seconds on its own connection while a run is going."""

    def __init__(self, url: str, period: float = 0.05):
        self.url, self.period, self.lat = url, period, []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=10) as c:
            while not self._stop.is_set():
                t = time.perf_counter()
                c.get(self.url + "/health").raise_for_status()
                self.lat.append(time.perf_counter() - t)
                self._stop.wait(self.period)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(10)


def in_thread(fn):
    """Run fn() on a worker thread, as the server's engine loop runs the engine (so both sides run the
    model the same way; on the busy 2-core machine, before OMP_WAIT_POLICY=PASSIVE, small torch ops
    stepped from the main thread were up to 10x slower than from a thread)."""
    box = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join()
    return box[0]


def load() -> float:
    return round(os.getloadavg()[0], 2)


def headline(s: dict) -> dict:
    ms = lambda d, k: None if d[k] is None else round(d[k] * 1e3, 1)  # noqa: E731
    return {
        "output_tok_s": round(s["output_tok_s"], 1),
        "duration_s": round(s["duration_s"], 2),
        "completed": s["completed"],
        "ttft_p50_ms": ms(s["ttft_s"], "p50"),
        "ttft_p99_ms": ms(s["ttft_s"], "p99"),
        "tpot_p50_ms": ms(s["tpot_s"], "p50"),
        "e2e_p99_ms": ms(s["e2e_latency_s"], "p99"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-pages", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[0.0, 2.0],
        help="arrival rates of the in-process vs HTTP runs (0: all at once, saturated)",
    )
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--static-batch", type=int, default=4)
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/http_serving.json"))
    ap.add_argument("--serve-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_only:
        serve_only(args)
        return 0

    from minisched.engine import Engine
    from minisched.observe.http_bench import run_http_bench
    from minisched.observe.workloads import make_workload, run_workload, summarize

    engine = Engine(args.model, num_pages=args.num_pages, max_running_requests=64)
    vocab = engine.cfg.vocab_size
    out = {
        "model": args.model,
        "quantize": engine.quant.mode,  # as resolved (auto: gguf for SmolLM2); the server's engine resolves the same
        "num_pages": args.num_pages,
        "num_requests": args.num_requests,
        "scale": args.scale,
        "cpus": os.cpu_count(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "in_process_vs_http": [],
        "continuous_vs_static_http": [],
    }
    print(f"{args.model}: quantize {out['quantize']}, backend {engine.backend}", flush=True)
    server = Server(args)
    try:
        warm = make_workload("poisson", 2, 0, vocab=vocab, seed=99, scale=0.1)
        in_thread(lambda: run_workload(engine, warm))
        run_http_bench(server.url, warm)
        for rate, i in [(r, i) for r in args.rates for i in range(args.pairs)]:
            wl = make_workload("poisson", args.num_requests, rate, vocab=vocab, seed=i, scale=args.scale)
            la = load()
            a = summarize(in_thread(lambda: run_workload(engine, wl)))
            lb = load()
            with HealthProbe(server.url) as probe:
                b, _ = run_http_bench(server.url, wl)
            lat = sorted(probe.lat)
            pct = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3, 2) if lat else None  # noqa: E731
            row = {
                "rate": rate,
                "pair": i,
                "in_process": {**headline(a), "load": la},
                "http": {**headline(b), "load": lb},
                "health_ms": {
                    "n": len(lat),
                    "p50": pct(0.5),
                    "p99": pct(0.99),
                    "max": round(lat[-1] * 1e3, 2) if lat else None,
                },
                "throughput_ratio": round(b["output_tok_s"] / a["output_tok_s"], 3),
            }
            out["in_process_vs_http"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.close()
    if not args.skip_static:
        wl = make_workload("mixed", args.num_requests, 0, vocab=vocab, seed=7, scale=args.scale * 0.2)
        servers = {"continuous": Server(args), "static": Server(args, static_batch=args.static_batch)}
        try:
            for i in range(args.pairs):
                for mode, srv in servers.items():
                    la = load()
                    s, _ = run_http_bench(srv.url, wl, name=mode)
                    row = {"pair": i, "mode": mode, **headline(s), "load": la}
                    out["continuous_vs_static_http"].append(row)
                    print(json.dumps(row), flush=True)
        finally:
            for srv in servers.values():
                srv.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
