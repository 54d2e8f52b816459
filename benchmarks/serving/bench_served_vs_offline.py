"""Served throughput against the offline engine, at 1, 8 and 64 streams, with the engine in its own
process (the default) and on a thread of the server process (`--engine-in-process`, the layout
before), and client-side TTFT against the server's.

    python benchmarks/serving/bench_served_vs_offline.py [--model smollm2] [--streams 1 8 64] [--rounds 2]

Per round and stream count S, interleaved (offline, thread, process; the order rotates by round):
- offline: `Engine.generate` on S x k requests with `max_running_requests=S` in this process;
- served: `minisched serve` (subprocess, same engine options) and S light streaming clients
  (httpx, closed loop: each sends k requests one after another): output tok/s over the run.
Prompts are 64 random token ids, 32 greedy output tokens (`ignore_eos`). With --vllm-python (and
--vllm-tokenizer, an HF directory of the model's tokenizer) a third served arm, `vllm-client`: the same
server (own process) driven by vLLM's own benchmark client (`vllm.benchmarks.serve`, random dataset,
64 input and 32 output tokens, ignore_eos, greedy like the other arms (`--temperature 0`: the client
sends none by default -- vLLM 0.32 warns it no longer sets greedy -- so the server would sample at 1.0),
--max-concurrency S), its output throughput. Ratio: served / offline of the same round. TTFT: each
client's first streamed chunk (chat, where a role chunk at admission used to arrive before prefill)
against the server's own histogram (`/metrics`, admission to first token); target: within 10 %. The
light-client runs also record who used the cores (`cpu_share`: this process as the client, the server's
HTTP process, its engine process, from /proc/PID/stat), since all of them share the machine; the offline
runs, the engine's share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from minisched.observe.fleet import descendants

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))  # the sibling script with vLLM's client wrapper
from openai_clients import vllm_client  # noqa: E402

NEW, PROMPT = 32, 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(n: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(PROMPT)] for _ in range(n)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (/proc/PID/stat), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def offline(model: str, streams: int, ps: list[list[int]], threads: int | None) -> dict:
    from minisched import Engine, SamplingParams

    engine = Engine(model, max_running_requests=streams, num_threads=threads)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(ps, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    dt = time.perf_counter() - t0
    share = (time.process_time() - c0) / (dt * len(os.sched_getaffinity(0)))  # every thread of this process
    return {"output_tok_s": sum(len(o.token_ids) for o in outs) / dt, "seconds": dt, "cpu_share": {"engine": share}}


async def stream_client(c: httpx.AsyncClient, mine: list[list[int]], chat: bool, ttfts: list) -> int:
    n = 0
    for p in mine:
        t0 = time.monotonic()
        if chat:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": " ".join(map(str, p[:40]))}],
                "max_tokens": NEW,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            path = "/v1/chat/completions"
        else:
            body = {
                "model": "m",
                "prompt": p,
                "max_tokens": NEW,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            path = "/v1/completions"
        first = None
        async with c.stream("POST", path, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.monotonic() - t0
                if line.startswith("data: {") and not chat:
                    n += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
        ttfts.append(first)
        if chat:
            n += NEW
    return n


def served(
    model: str,
    streams: int,
    ps: list[list[int]],
    in_process: bool,
    chat_ttft: bool,
    threads: int | None,
    vllm: tuple[str, str] | None = None,
) -> dict:
    """`minisched serve` driven by the light clients, or by vLLM's client (vllm = (python, tokenizer dir))."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "minisched",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--served-model-name",
        "m",
        "--max-running-requests",
        str(streams),
        "--log-level",
        "warning",
    ]
    if in_process:
        cmd.append("--engine-in-process")
    if threads is not None:
        cmd += ["--threads", str(threads)]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)

        async def run(chat: bool, work):
            ttfts: list = []
            limits = httpx.Limits(max_connections=streams + 2)
            async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
                t0 = time.perf_counter()
                counts = await asyncio.gather(
                    *(stream_client(c, work[i::streams], chat, ttfts) for i in range(streams))
                )
                return sum(counts), time.perf_counter() - t0, ttfts

        if vllm is not None:
            with tempfile.TemporaryDirectory() as work:
                res = vllm_client(
                    vllm[0], port, vllm[1], "openai", "/v1/completions", work, len(ps), streams,
                    model="m", input_len=PROMPT, output_len=NEW, ignore_eos=True, temperature=0.0,
                )  # fmt: skip
            if res.get("output_throughput") is None or res.get("failed"):
                raise RuntimeError(f"vLLM's client failed: {res}")
            return {"output_tok_s": res["output_throughput"], "client": "vllm", "completed": res["completed"]}
        # Who used the cores during the run, as a share of all of them: the light client (this process), the
        # server's HTTP process and its engine process. Offline, the engine has them to itself.
        # (The engine: every descendant of the server, e.g. with multiprocessing's resource tracker, which is idle.)
        pids = {"client": [os.getpid()], "http": [server.pid], "engine": descendants(server.pid)}
        used = lambda k: sum(cpu_seconds(pid) for pid in pids[k])  # noqa: E731
        before = {k: used(k) for k in pids}
        tokens, dt, _ = asyncio.run(run(False, ps))
        cores = len(os.sched_getaffinity(0))
        share = {k: (used(k) - before[k]) / (dt * cores) for k in pids}
        out = {"output_tok_s": tokens / dt, "seconds": dt, "cpu_share": share}
        if chat_ttft:
            text = httpx.get(url + "/metrics", timeout=5).text
            s0 = float(re.search(r"^minisched_time_to_first_token_seconds_sum (\S+)", text, re.M).group(1))
            n0 = float(re.search(r"^minisched_time_to_first_token_seconds_count (\S+)", text, re.M).group(1))
            _, _, ttfts = asyncio.run(run(True, ps[: max(streams, 8)]))
            text = httpx.get(url + "/metrics", timeout=5).text
            s1 = float(re.search(r"^minisched_time_to_first_token_seconds_sum (\S+)", text, re.M).group(1))
            n1 = float(re.search(r"^minisched_time_to_first_token_seconds_count (\S+)", text, re.M).group(1))
            out["client_ttft_s"] = statistics.mean(ttfts)
            out["server_ttft_s"] = (s1 - s0) / (n1 - n0)
        return out
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="compute threads, fixed (default: tuned while running)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/served_vs_offline.json"))
    ap.add_argument("--modes", nargs="+", default=["offline", "thread", "process"], help="arms to run")
    ap.add_argument("--vllm-python", default=None, help="a Python with vllm: adds the vllm-client arm")
    ap.add_argument("--vllm-tokenizer", default=None, help="HF directory of the model's tokenizer (vllm-client)")
    ap.add_argument(
        "--longer", type=int, default=1, help="this many times the requests per stream (longer runs: less noise)"
    )
    args = ap.parse_args()
    if args.vllm_python and not args.vllm_tokenizer:
        ap.error("--vllm-python needs --vllm-tokenizer")
    vllm = (args.vllm_python, args.vllm_tokenizer) if args.vllm_python else None
    k = {1: 8, 8: 4}
    rows = []
    for r in range(args.rounds):
        for s in args.streams:
            ps = prompts(s * k.get(s, 2) * args.longer, seed=100 * r + s)
            modes = list(args.modes) + (["vllm-client"] if vllm else [])
            modes = modes[r % len(modes) :] + modes[: r % len(modes)]
            for mode in modes:
                load = os.getloadavg()[0]
                if mode == "offline":
                    res = offline(args.model, s, ps, args.threads)
                elif mode == "vllm-client":
                    res = served(args.model, s, ps, False, chat_ttft=False, threads=args.threads, vllm=vllm)
                else:
                    res = served(args.model, s, ps, mode == "thread", chat_ttft=(s == 8), threads=args.threads)
                rows.append({"round": r, "streams": s, "mode": mode, "load": load, **res})
                print(json.dumps(rows[-1]), flush=True)
    served_modes = [m for m in modes if m != "offline"]
    print(f"\n{'streams':>7}" + "".join(f"{m + '/offline':>22}" for m in served_modes) + f"{'client/server TTFT':>20}")
    summary = {}
    for s in args.streams:
        ratio = {}
        for mode in served_modes:
            ratio[mode] = statistics.median(
                next(x["output_tok_s"] for x in rows if x["round"] == r and x["streams"] == s and x["mode"] == mode)
                / next(
                    x["output_tok_s"] for x in rows if x["round"] == r and x["streams"] == s and x["mode"] == "offline"
                )
                for r in range(args.rounds)
            )
        tt = [
            x["client_ttft_s"] / x["server_ttft_s"]
            for x in rows
            if x["streams"] == s and "client_ttft_s" in x and x["mode"] == "process"
        ]
        summary[s] = {**ratio, "ttft_client_over_server": statistics.median(tt) if tt else None}
        ttft = summary[s]["ttft_client_over_server"]
        print(
            f"{s:>7}"
            + "".join(f"{ratio[m]:>22.3f}" for m in served_modes)
            + f"{'-' if ttft is None else f'{ttft:.3f}':>20}"
        )
    shares = [x for x in rows if "cpu_share" in x]
    if shares:
        print("\nshare of the cores during the runs (light client), median of rounds: client / HTTP process / engine")
        for s in args.streams:
            for mode in ("offline", "process", "thread"):
                got = [x["cpu_share"] for x in shares if x["streams"] == s and x["mode"] == mode]
                if got:
                    med = {k: statistics.median(g.get(k, 0.0) for g in got) for k in ("client", "http", "engine")}
                    summary[s][f"cpu_share_{mode}"] = med
                    print(f"{s:>7} {mode:>8}: " + " / ".join(f"{med[k]:.1%}" for k in ("client", "http", "engine")))
    Path(args.json).write_text(
        json.dumps(
            {"benchmark": "bench_served_vs_offline", "model": args.model, "rows": rows, "summary": summary}, indent=1
        )
    )


if __name__ == "__main__":
    main()
