"""Killing and freezing the engine process of `minisched serve` under 32 streaming clients.

    python benchmarks/serving/bench_faults.py [--model smollm2] [--clients 32] [--json out.json]

For SIGKILL and SIGSTOP in turn: a fresh server (subprocess, engine in its own process), 32
clients streaming back to back (closed loop: prompt 64 tokens, 48 output tokens, `ignore_eos`);
after `--warm` seconds the engine process gets the signal. Measured: time until the first client
sees its stream end with an error (detection), time until `/health` is 200 again (serving again),
and per request: finished normally, failed (it had streamed tokens: only those in flight), or lost
(no answer at all: must be 0). Requests sent while the engine is down wait for the restarted one
(retried) or fail fast with 503.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_pid(url: str) -> int:
    return httpx.get(url + "/health", timeout=5).json()["replicas"][0]["pid"]


async def client(c: httpx.AsyncClient, i: int, stop: asyncio.Event, log: list) -> None:
    k = 0
    while not stop.is_set():
        body = {
            "model": "m",
            "prompt": [100 + (i * 7 + k + j) % 5000 for j in range(64)],
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        rec = {"client": i, "start": time.monotonic(), "tokens": 0, "end": None, "outcome": "lost"}
        log.append(rec)
        try:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    rec["outcome"] = f"http {r.status_code}"
                else:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and '"error"' in line:
                            rec["outcome"] = "error"
                        elif line.startswith("data: {"):
                            rec["tokens"] += 1
                        elif line == "data: [DONE]" and rec["outcome"] == "lost":
                            rec["outcome"] = "ok"
        except httpx.HTTPError as exc:
            rec["outcome"] = f"transport {type(exc).__name__}"
        rec["end"] = time.monotonic()
        if rec["outcome"].startswith("http 503"):
            await asyncio.sleep(0.2)
        k += 1


async def one_fault(url: str, how: str, clients: int, warm: float, after: float) -> dict:
    log: list = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=clients + 4)) as c:
        tasks = [asyncio.create_task(client(c, i, stop, log)) for i in range(clients)]
        await asyncio.sleep(warm)
        pid = engine_pid(url)
        t_sig = time.monotonic()
        os.kill(pid, getattr(signal, how))
        back = None
        while time.monotonic() - t_sig < 120:
            await asyncio.sleep(0.1)
            try:
                h = await c.get("/health", timeout=2)
                if h.status_code == 200 and h.json()["replicas"][0]["pid"] != pid:
                    back = time.monotonic() - t_sig
                    break
            except httpx.HTTPError:
                pass
        await asyncio.sleep(after)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 180)
    errors = [r for r in log if r["outcome"] == "error"]
    first_err = min((r["end"] for r in errors), default=None)
    at_signal = [r for r in log if r["start"] <= t_sig and (r["end"] or 1e18) > t_sig]
    return {
        "signal": how,
        "requests": len(log),
        "detect_s": None if first_err is None else round(first_err - t_sig, 3),
        "serving_again_s": None if back is None else round(back, 2),
        "in_flight_at_signal": len(at_signal),
        "failed": len(errors),
        "failed_had_tokens": sum(r["tokens"] > 0 for r in errors),
        "ok": sum(r["outcome"] == "ok" for r in log),
        "ok_across_the_fault": sum(r["outcome"] == "ok" for r in at_signal),
        "http_503": sum(r["outcome"] == "http 503" for r in log),
        "lost": sum(r["outcome"] not in ("ok", "error", "http 503") for r in log),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--warm", type=float, default=8.0)
    ap.add_argument("--after", type=float, default=5.0)
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for how in ("SIGKILL", "SIGSTOP"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = open(f"/tmp/bench_faults_{how}.log", "w")
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "minisched",
                "serve",
                "--model",
                args.model,
                "--port",
                str(port),
                "--served-model-name",
                "m",
                "--engine-heartbeat-timeout",
                str(args.heartbeat_timeout),
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
                time.sleep(0.5)
            row = asyncio.run(one_fault(url, how, args.clients, args.warm, args.after))
            row["load"] = os.getloadavg()[0]
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"benchmark": "bench_faults", "model": args.model, "clients": args.clients, "rows": rows}, indent=1
            )
        )
    return 0 if all(r["lost"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
