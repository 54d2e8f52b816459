"""A soak with faults: mixed traffic against a real `minisched serve` while its engine process is
SIGKILLed and SIGSTOPped at intervals.

    python benchmarks/serving/bench_soak.py --duration 1800 [--window 300] [--json out.json]

One server on 127.0.0.1 (SmolLM2 by default; priority scheduling, ngram speculative decoding, a
small KV pool over a host tier, so preemptions, drafts and host-tier traffic all happen), `--clients`
closed-loop clients sending a mix: completions and chat, streaming or not, n=2, logprobs,
json_schema, priorities (a few urgent ones), prompts that repeat themselves (drafts accepted), a
shared system prompt (radix hits); `--disconnect` of all requests hang up mid-stream. From
`--warmup` on, every `--fault-every` seconds the engine process (its pid from /health) gets the
next fault of `--faults`: `kill` (SIGKILL: the pool restarts it) or `stop` (SIGSTOP for
`--stop-hold` s, then SIGCONT: held past the heartbeat timeout, the pool kills and restarts it;
shorter, it resumes).

Reported (JSON with `--json`, a markdown table beside it and on stdout):
- requests served / failed; a failure must overlap a fault's outage (from its signal to its
  recovery): `failed_outside_faults` must be 0;
- per fault: the time until /health shows the engine again (a new pid, unless it resumed) and
  until a probe request is answered (recovery);
- the server's and the engine's RSS over time (sampled from /proc), and their growth from the first
  `--window` after warm-up to the last (the engine's samples from `--settle` s after a restart on);
  the processes of the server's session (a leaked compile worker shows there);
- p50 / p99 TTFT (streams, to the first chunk with text) per `--window` of the run;
- at idle, the pages still held: all of them must be the radix cache's evictable ones.

Bounded: 127.0.0.1 only, a deadline on every request and wait, the run ends by itself, and the
server (its whole session: engine process, compile workers) is killed at the end, even on error.
Exit status 0 when every bound holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import httpx

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You are a concise assistant. Answer in one short sentence, plainly, without lists or code."
TOPICS = ["the sea", "a mountain", "bread", "rain", "a library", "trains", "the moon", "coffee", "a bridge", "winter"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
# (kind, weight): what a client sends next
MIX = (
    ("completion_stream", 18),
    ("completion", 8),
    ("chat_stream", 18),
    ("chat", 8),
    ("n2", 8),
    ("n2_stream", 6),
    ("logprobs_stream", 8),
    ("chat_logprobs", 6),
    ("json_schema", 10),
    ("repeat_stream", 10),  # repeats itself: ngram drafts get accepted
)
FAILED = ("error", "http 5", "transport", "timeout", "lost")


@dataclass
class Rec:
    kind: str
    stream: bool
    start: float
    priority: int = 0
    first: Optional[float] = None  # the first chunk with text (streams)
    end: Optional[float] = None
    outcome: str = "lost"  # ok | disconnected | error | http NNN | transport ... | timeout
    chunks: int = 0
    bad_json: bool = False


@dataclass
class Fault:
    kind: str  # kill | stop
    at: float  # seconds since the traffic started
    pid: int
    restarted: Optional[bool] = None
    back_s: Optional[float] = None  # /health shows a serving engine (a new pid after a restart)
    recovered_s: Optional[float] = None  # a probe request answered
    new_pid: Optional[int] = None


@dataclass
class Run:
    t0: float = field(default_factory=time.monotonic)
    end: float = 0.0  # seconds of traffic (--duration, or more with --min-faults)
    recs: list = field(default_factory=list)
    faults: list = field(default_factory=list)
    rss: list = field(default_factory=list)  # (t, server_kb, engine_pid, engine_kb, session_procs, load1)
    errors: list = field(default_factory=list)  # a few failed requests' messages, for the report

    def now(self) -> float:
        return time.monotonic() - self.t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kb(pid: Optional[int]) -> Optional[int]:
    if not pid:
        return None
    try:
        m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (the server was started as its leader); zombies count too."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid:  # state ppid pgrp session ...
            out.append(int(d.name))
    return out


def pct(values: list, q: float) -> Optional[float]:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))], 4)


def build_request(rng: random.Random, kind: str, priorities: bool, k: int) -> tuple[str, dict, bool]:
    """(path, body, stream) of a request of `kind`."""
    topic = rng.choice(TOPICS)
    prio = 0
    if priorities:
        prio = -50 if rng.random() < 0.08 else rng.randint(0, 8)  # a few urgent ones preempt the rest
    chat = {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me about {topic}."}],
        "max_tokens": rng.randint(8, 32),
        "temperature": rng.choice([0, 0.7]),
        "priority": prio,
    }
    comp = {
        "model": "m",
        "prompt": f"{SYSTEM}\nA few words about {topic} (note {k}):",
        "max_tokens": rng.randint(8, 32),
        "temperature": rng.choice([0, 0.8]),
        "priority": prio,
    }
    if kind == "completion_stream":
        return "/v1/completions", {**comp, "stream": True}, True
    if kind == "completion":
        return "/v1/completions", comp, False
    if kind == "chat_stream":
        return "/v1/chat/completions", {**chat, "stream": True}, True
    if kind == "chat":
        return "/v1/chat/completions", chat, False
    if kind == "n2":
        return "/v1/completions", {**comp, "n": 2, "temperature": 0.8, "seed": k}, False
    if kind == "n2_stream":
        return "/v1/chat/completions", {**chat, "n": 2, "temperature": 0.8, "stream": True}, True
    if kind == "logprobs_stream":
        return "/v1/completions", {**comp, "logprobs": 2, "stream": True}, True
    if kind == "chat_logprobs":
        return "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}, False
    if kind == "json_schema":
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        return "/v1/chat/completions", {**chat, "max_tokens": 48, "response_format": rf}, False
    if kind == "repeat_stream":
        seq = ", ".join(str(i % 7) for i in range(k % 5, k % 5 + 40))
        body = {**comp, "prompt": f"Repeat: {seq}, {seq}", "temperature": 0, "max_tokens": 32, "stream": True}
        return "/v1/completions", body, True
    raise ValueError(kind)


def _text_of(chunk: dict) -> str:
    out = ""
    for ch in chunk.get("choices") or ():
        out += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
    return out


async def one_request(c: httpx.AsyncClient, run: Run, rec: Rec, path: str, body: dict, hang_up: int) -> None:
    """Sends one request and fills `rec`; `hang_up` > 0: close the stream after that many text chunks."""
    if not rec.stream:
        r = await c.post(path, json=body)
        if r.status_code != 200:
            rec.outcome = f"http {r.status_code}"
            if r.status_code >= 500 and len(run.errors) < 20:
                run.errors.append(r.text[:300])
            return
        got = r.json()
        if "response_format" in body:
            for ch in got["choices"]:
                if ch["finish_reason"] == "stop":
                    try:
                        json.loads(ch["message"]["content"])
                    except ValueError:
                        rec.bad_json = True
        rec.outcome = "ok"
        return
    async with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            rec.outcome = f"http {r.status_code}"
            return
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                if rec.outcome == "lost":
                    rec.outcome = "ok"
                break
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                rec.outcome = "error"
                if len(run.errors) < 20:
                    run.errors.append(line[:300])
                continue
            if _text_of(chunk):
                rec.chunks += 1
                if rec.first is None:
                    rec.first = run.now()
                if hang_up and rec.chunks >= hang_up:
                    rec.outcome = "disconnected"
                    return  # leaving the block closes the connection mid-stream


async def client(i: int, url: str, run: Run, args, stop: asyncio.Event, stream_share: float) -> None:
    rng = random.Random(args.seed * 1000 + i)
    kinds, weights = zip(*MIX)
    timeout = httpx.Timeout(args.request_timeout, connect=5)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as c:
        k = 0
        while not stop.is_set():
            k += 1
            kind = rng.choices(kinds, weights)[0]
            path, body, stream = build_request(rng, kind, args.priorities, i * 100000 + k)
            hang_up = rng.randint(1, 4) if stream and rng.random() < args.disconnect / stream_share else 0
            rec = Rec(kind, stream, run.now(), priority=body.get("priority", 0))
            run.recs.append(rec)
            try:
                await asyncio.wait_for(one_request(c, run, rec, path, body, hang_up), args.request_timeout)
            except asyncio.TimeoutError:
                rec.outcome = "timeout"
            except httpx.HTTPError as exc:
                rec.outcome = f"transport {type(exc).__name__}"
            rec.end = run.now()
            if rec.outcome.startswith(("http 5", "transport", "error")):
                await asyncio.sleep(1.0)  # the engine is down: do not spin


async def health(c: httpx.AsyncClient) -> Optional[dict]:
    try:
        r = await c.get("/health", timeout=3)
        return {"status": r.status_code, **r.json()}
    except (httpx.HTTPError, ValueError):
        return None


async def engine_row(c: httpx.AsyncClient) -> Optional[dict]:
    h = await health(c)
    return h["replicas"][0] if h and h.get("replicas") else None


async def probe(c: httpx.AsyncClient) -> bool:
    try:
        body = {"model": "m", "prompt": "ok", "max_tokens": 1, "temperature": 0}
        return (await c.post("/v1/completions", json=body, timeout=10)).status_code == 200
    except httpx.HTTPError:
        return False


async def inject_faults(url: str, run: Run, args, stop: asyncio.Event) -> None:
    plan = [k.strip() for k in args.faults.split(",") if k.strip()]
    async with httpx.AsyncClient(base_url=url) as c:
        n = 0
        while plan:
            at = args.warmup + n * args.fault_every
            if run.faults:  # a slow recovery pushes the next fault back: served traffic between two faults
                last = run.faults[-1]
                at = max(at, last.at + (last.recovered_s or 0) + args.fault_gap)
            if len(run.faults) >= args.min_faults and at > args.duration - args.fault_gap:
                return
            while run.now() < at and not stop.is_set():
                await asyncio.sleep(0.2)
            if stop.is_set():  # the traffic has ended (a slow recovery can push a fault past it)
                return
            kind = plan[n % len(plan)]
            n += 1
            row = await engine_row(c)
            if row is None or not row["alive"]:
                run.faults.append(Fault(kind, round(run.now(), 2), 0, restarted=None))  # nothing to signal
                continue
            pid, restarts = row["pid"], row["restarts"]
            f = Fault(kind, round(run.now(), 2), pid)
            run.faults.append(f)
            t_sig = time.monotonic()
            if kind == "kill":
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(args.stop_hold)
                try:
                    os.kill(pid, signal.SIGCONT)  # the pool may have killed it already (held past the heartbeat)
                except ProcessLookupError:
                    pass
            expect_restart = kind == "kill" or args.stop_hold > args.heartbeat_timeout
            deadline = t_sig + args.recovery_timeout
            while time.monotonic() < deadline:
                row = await engine_row(c)
                if row and row["alive"] and (row["pid"] != pid or not expect_restart):
                    f.back_s = round(time.monotonic() - t_sig, 2)
                    f.new_pid, f.restarted = row["pid"], row["restarts"] > restarts
                    break
                await asyncio.sleep(0.1)
            while f.back_s is not None and time.monotonic() < deadline:
                if await probe(c):
                    f.recovered_s = round(time.monotonic() - t_sig, 2)
                    break
                await asyncio.sleep(0.1)
            if f.recovered_s is None:
                return  # not back: the run ends with this fault unrecovered (reported)


async def sample_rss(url: str, server_pid: int, run: Run, args, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=url) as c:
        while not stop.is_set():
            row = await engine_row(c)
            epid = row["pid"] if row and row["alive"] else None
            run.rss.append(
                (
                    round(run.now(), 1),
                    rss_kb(server_pid),
                    epid,
                    rss_kb(epid),
                    len(session_pids(server_pid)),
                    os.getloadavg()[0],
                )
            )
            try:
                await asyncio.wait_for(stop.wait(), args.rss_every)
            except asyncio.TimeoutError:
                pass


def metrics_values(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(minisched_[a-z_]+) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


async def idle_pages(url: str, timeout: float) -> dict:
    """After the traffic: wait until nothing runs, then the pages still held."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as c:
        deadline = time.monotonic() + timeout
        got: dict = {}
        while time.monotonic() < deadline:
            h = await health(c)
            try:
                got = metrics_values((await c.get("/metrics")).text)
            except httpx.HTTPError:
                got = {}
            quiet = h is not None and all(r["in_flight"] == 0 for r in h.get("replicas", ()))
            if (
                quiet
                and got
                and got["minisched_num_requests_running"] == 0
                and got["minisched_num_requests_waiting"] == 0
            ):
                break
            await asyncio.sleep(0.5)
        else:
            return {"idle": False, "metrics": got}
        used, evictable = got["minisched_kv_pages_used"], got["minisched_kv_pages_evictable"]
        return {
            "idle": True,
            "pages_total": got["minisched_kv_pages_total"],
            "pages_used": used,
            "pages_cached": got["minisched_kv_pages_cached"],
            "pages_evictable": evictable,
            "pages_held_by_requests": used - evictable,
            "metrics": got,
        }


def growth(samples: list[tuple[float, int]], ref: tuple[float, float], last: tuple[float, float]) -> Optional[dict]:
    a = [v for t, v in samples if ref[0] <= t < ref[1] and v]
    b = [v for t, v in samples if last[0] <= t <= last[1] and v]
    if not a or not b:
        return None
    ma, mb = statistics.median(a), statistics.median(b)
    return {"ref_mb": round(ma / 1024, 1), "last_mb": round(mb / 1024, 1), "growth": round(mb / ma - 1, 4)}


def engine_growth(samples: list[tuple[float, Optional[int], int]], args) -> Optional[dict]:
    """The engine's RSS growth from (t, engine pid, RSS kB) samples: within each incarnation (a restart
    is a fresh process that warms up again), from --settle s after its pid appeared and from --warmup
    on, the median of its earliest samples against its latest ones; the largest growth of the
    incarnations with enough samples (a leak shows in any of them). Two incarnations are never compared
    with each other: a restarted engine's size is not growth. None: no incarnation lived long enough."""
    by_pid: dict[int, list[int]] = {}
    since, pid = 0.0, None
    for t, epid, ekb in samples:
        if epid != pid:
            pid, since = epid, t
        if epid and ekb and t - since >= args.settle and t >= args.warmup:
            by_pid.setdefault(epid, []).append(ekb)
    k = max(3, int(min(args.window, 60) / args.rss_every))
    worst = None
    for settled in by_pid.values():
        if len(settled) < 2 * 3:
            continue
        n = min(k, len(settled) // 2)
        a, b = statistics.median(settled[:n]), statistics.median(settled[-n:])
        g = {"ref_mb": round(a / 1024, 1), "last_mb": round(b / 1024, 1), "growth": round(b / a - 1, 4)}
        if worst is None or g["growth"] > worst["growth"]:
            worst = g
    return worst


def summarize(run: Run, args, pages: dict, load: list) -> dict:
    recs = run.recs
    outage = [(f.at, f.at + f.recovered_s if f.recovered_s is not None else run.end) for f in run.faults]

    def at_fault(r: Rec) -> bool:
        return any(r.start <= b + 1.0 and (r.end if r.end is not None else 1e18) >= a for a, b in outage)

    failed = [r for r in recs if r.outcome.startswith(FAILED)]
    in_flight_at_signal = [r for r in failed if any(r.start <= a <= (r.end or 1e18) for a, _ in outage)]
    outside = [r for r in failed if not at_fault(r)]
    during_outage = len(failed) - len(in_flight_at_signal) - len(outside)  # sent while no engine served
    by = lambda rs: {o: sum(r.outcome == o for r in rs) for o in sorted({r.outcome for r in rs})}
    windows = []
    t = 0.0
    while t < run.end - 1:  # no sliver of a window past the end
        w = [r for r in recs if t <= r.start < t + args.window]
        ttft = [
            r.first - r.start for r in w if r.stream and r.first is not None and r.outcome in ("ok", "disconnected")
        ]
        windows.append(
            {
                "from_s": round(t),
                "to_s": round(min(t + args.window, run.end)),
                "requests": len(w),
                "failed": sum(r.outcome.startswith(FAILED) for r in w),
                "faults": sum(t <= f.at < t + args.window for f in run.faults),
                "ttft_p50_s": pct(ttft, 0.5),
                "ttft_p99_s": pct(ttft, 0.99),
            }
        )
        t += args.window
    ref = (args.warmup, args.warmup + args.window)
    last = (max(args.warmup, run.end - args.window), run.end)
    server = growth([(t, s) for t, s, *_ in run.rss], ref, last)
    engine = engine_growth([(t, epid, ekb) for t, _, epid, ekb, *_ in run.rss], args)
    procs = [row[4] for row in run.rss if row[0] >= args.warmup]
    loads = [row[5] for row in run.rss]
    return {
        "benchmark": "bench_soak",
        "duration_s": round(run.end, 1),
        "window_s": args.window,
        "clients": args.clients,
        "model": args.model,
        "server_args": args.server_args,
        "requests": len(recs),
        "served": sum(r.outcome in ("ok", "disconnected") for r in recs),
        "disconnected": sum(r.outcome == "disconnected" for r in recs),
        "disconnect_share": round(sum(r.outcome == "disconnected" for r in recs) / max(1, len(recs)), 3),
        "refused_429": sum(r.outcome == "http 429" for r in recs),
        "other_4xx": sum(r.outcome.startswith("http 4") and r.outcome != "http 429" for r in recs),
        "bad_json": sum(r.bad_json for r in recs),
        "failed": len(failed),
        "failed_by_outcome": by(failed),
        "failed_in_flight_at_signal": len(in_flight_at_signal),
        "failed_sent_during_outage": during_outage,
        "failed_outside_faults": len(outside),
        "failed_outside_examples": [asdict(r) for r in outside[:5]],
        "error_examples": run.errors[:5],
        "kinds": {k: sum(r.kind == k for r in recs) for k, _ in MIX},
        "faults": [asdict(f) for f in run.faults],
        "windows": windows,
        "rss_server": server,
        "rss_engine": engine,
        "session_procs": {
            "min": min(procs, default=None),
            "max": max(procs, default=None),
            "end": procs[-1] if procs else None,
        },
        "rss_samples": run.rss,
        "idle": {k: v for k, v in pages.items() if k != "metrics"},
        "counters": {
            k.removeprefix("minisched_"): v
            for k, v in pages.get("metrics", {}).items()
            if k.endswith("_total") or "preempt" in k or k.startswith("minisched_spec")
        },
        "load": {
            "start": load[0],
            "end": load[-1],
            "mean_1min": round(statistics.mean(loads), 2) if loads else None,
            "max_1min": max(loads, default=None),
        },
    }


def check(s: dict, args) -> list[str]:
    """The bounds the run must hold (empty: all held)."""
    bad = []
    if s["failed_outside_faults"]:
        bad.append(f"{s['failed_outside_faults']} requests failed away from any fault")
    if not s["served"]:
        bad.append("nothing was served")
    if s["bad_json"]:
        bad.append(f"{s['bad_json']} json_schema answers that are not JSON")
    if s["other_4xx"]:
        bad.append(f"{s['other_4xx']} requests refused with a 4xx other than 429")
    for f in s["faults"]:
        if f["recovered_s"] is None or f["recovered_s"] > args.recovery_timeout:
            bad.append(f"fault {f['kind']} at {f['at']} s: not recovered within {args.recovery_timeout} s")
    for who in ("rss_server", "rss_engine"):
        g = s[who]
        if g is None:
            bad.append(f"{who}: too few samples to measure growth")
        elif g["growth"] > args.max_rss_growth:
            bad.append(f"{who} grew {g['growth']:.1%} (bound {args.max_rss_growth:.0%})")
    idle = s["idle"]
    if not idle.get("idle"):
        bad.append("the server never went idle after the traffic")
    elif idle["pages_held_by_requests"]:
        bad.append(f"{idle['pages_held_by_requests']} pages held at idle beyond the radix cache's evictable ones")
    if s.get("leftover_procs"):
        bad.append(f"processes left after the server exited: {s['leftover_procs']}")
    return bad


def markdown(s: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v}"
    lines = [
        f"soak: {s['duration_s']} s, {s['clients']} clients, {s['requests']} requests: {s['served']} served "
        f"({s['disconnected']} hung up mid-stream), {s['failed']} failed ({s['failed_in_flight_at_signal']} in "
        f"flight at a signal, {s['failed_sent_during_outage']} sent while the engine was down, "
        f"{s['failed_outside_faults']} away from faults), {s['refused_429']} 429",
        "",
        "| window | requests | failed | faults | TTFT p50 (s) | TTFT p99 (s) |",
        "|---|---|---|---|---|---|",
    ]
    for w in s["windows"]:
        lines.append(
            f"| {w['from_s']}-{w['to_s']} s | {w['requests']} | {w['failed']} | {w['faults']} | "
            f"{fmt(w['ttft_p50_s'])} | {fmt(w['ttft_p99_s'])} |"
        )
    lines += ["", "| fault | at (s) | engine back (s) | recovered (s) | restarted |", "|---|---|---|---|---|"]
    for f in s["faults"]:
        lines.append(
            f"| {f['kind']} | {f['at']} | {fmt(f['back_s'])} | {fmt(f['recovered_s'])} | {fmt(f['restarted'])} |"
        )
    rs, re_ = s["rss_server"] or {}, s["rss_engine"] or {}
    idle = s["idle"]
    lines += [
        "",
        f"RSS server {fmt(rs.get('ref_mb'))} -> {fmt(rs.get('last_mb'))} MB ({fmt(rs.get('growth'))}), "
        f"engine {fmt(re_.get('ref_mb'))} -> {fmt(re_.get('last_mb'))} MB ({fmt(re_.get('growth'))}); "
        f"session processes {s['session_procs']}",
        f"idle: {idle.get('pages_used')} pages used, {idle.get('pages_evictable')} evictable, "
        f"{idle.get('pages_held_by_requests')} held by requests; load {s['load']}",
    ]
    return "\n".join(lines)


async def soak(url: str, server_pid: int, args) -> tuple[Run, dict]:
    run = Run()
    stop = asyncio.Event()
    share = sum(w for k, w in MIX if k.endswith("stream")) / sum(w for _, w in MIX)
    clients = [asyncio.create_task(client(i, url, run, args, stop, share)) for i in range(args.clients)]
    faults = asyncio.create_task(inject_faults(url, run, args, stop))
    sampler = asyncio.create_task(sample_rss(url, server_pid, run, args, stop))
    try:
        while True:
            await asyncio.sleep(0.5)
            if faults.done() and faults.exception() is not None:
                raise faults.exception()
            now, made = run.now(), run.faults[: args.min_faults]
            if now < args.duration:
                continue
            if now >= 2 * args.duration or faults.done() and len(run.faults) < args.min_faults:
                break  # the run's bound; or the faults stopped (one did not recover)
            recovered = [f for f in made if f.recovered_s is not None]
            if len(recovered) == args.min_faults and (
                not made or now >= made[-1].at + made[-1].recovered_s + args.fault_gap
            ):
                break
        run.end = run.now()
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), args.request_timeout + 30)
        await asyncio.wait_for(faults, args.recovery_timeout + 30)
        pages = await idle_pages(url, args.idle_timeout)
        await asyncio.wait_for(sampler, 30)
    finally:
        stop.set()
        for t in (*clients, faults, sampler):
            t.cancel()
    return run, pages


def start_server(args, port: int, log) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "minisched",
        "serve",
        "--model",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "m",
        "--engine-heartbeat-timeout",
        str(args.heartbeat_timeout),
        "--engine-max-restarts",
        str(len(range(0, max(1, int(args.duration)), max(1, int(args.fault_every)))) + 3),
        "--grace-period",
        "5",
        "--log-level",
        "warning",
        *args.server_args,
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def stop_server(server: subprocess.Popen) -> list[int]:
    """SIGINT (drain), then kill the whole session; returns the pids that outlived the server."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    deadline = time.monotonic() + 10  # the engine and its compile workers end when their parent does
    left = session_pids(server.pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = session_pids(server.pid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    ap.add_argument("--window", type=float, default=300.0, help="seconds per TTFT window (and RSS reference)")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds before the first fault and the RSS reference")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--disconnect", type=float, default=0.15, help="share of all requests that hang up mid-stream")
    ap.add_argument("--faults", default="kill,stop", help="the faults, in turn: kill, stop")
    ap.add_argument("--fault-every", type=float, default=300.0)
    ap.add_argument(
        "--min-faults",
        type=int,
        default=0,
        help="run past --duration (up to twice it) until this many faults recovered",
    )
    ap.add_argument("--fault-gap", type=float, default=15.0, help="seconds of traffic at least after each recovery")
    ap.add_argument("--stop-hold", type=float, default=8.0, help="seconds a SIGSTOPped engine stays stopped")
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0, help="the server's --engine-heartbeat-timeout")
    ap.add_argument("--recovery-timeout", type=float, default=120.0, help="seconds a fault may take to recover")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--idle-timeout", type=float, default=60.0)
    ap.add_argument("--settle", type=float, default=20.0, help="seconds after an engine start its RSS is ignored")
    ap.add_argument("--rss-every", type=float, default=5.0)
    ap.add_argument("--max-rss-growth", type=float, default=0.05)
    ap.add_argument("--no-priorities", dest="priorities", action="store_false")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the report here (and the markdown table beside it, .md)")
    ap.add_argument("--log", default=None, help="the server's log (default: a file in /tmp)")
    ap.add_argument(
        "--server-args",
        default="--priority-scheduling --speculative ngram --num-pages 256 --host-kv-pages 512 --max-running-requests 6",
        help="more `minisched serve` options (one string)",
    )
    args = ap.parse_args(argv)
    args.server_args = args.server_args.split()
    if "--priority-scheduling" not in args.server_args:
        args.priorities = False  # a priority is accepted either way; without the option it means nothing
    for name in ("duration", "window", "fault_every", "rss_every", "request_timeout"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if not 0 <= args.disconnect < 0.7:
        ap.error("--disconnect must be in [0, 0.7)")
    bad = [k for k in args.faults.split(",") if k.strip() and k.strip() not in ("kill", "stop")]
    if bad:
        ap.error(f"--faults: unknown {bad}; expected kill, stop")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(args.log or f"/tmp/bench_soak_{port}.log")
    load = [os.getloadavg()[0]]
    with open(log_path, "w") as log:
        server = start_server(args, port, log)
        leftover: list[int] = []
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"the server did not start (log: {log_path})")
                time.sleep(0.5)
            run, pages = asyncio.run(soak(url, server.pid, args))
            load.append(os.getloadavg()[0])
        finally:
            leftover = stop_server(server)
    s = summarize(run, args, pages, load)
    s["leftover_procs"] = leftover
    s["server_log"] = str(log_path)
    s["violations"] = check(s, args)
    table = markdown(s)
    print(table, flush=True)
    for v in s["violations"]:
        print("VIOLATION:", v, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1))
        Path(args.json).with_suffix(".md").write_text(table + "\n")
    return 0 if not s["violations"] else 1


if __name__ == "__main__":
    sys.exit(main())
