"""What does `minisched serve --record` cost the engine? -- not a test.

    python benchmarks/serving/bench_record.py [--model dummy:tiny] [--requests 96] [--rounds 3] [--json out.json]

The serving engine loop (serve/engine_loop.py, on its thread, as in an engine process) runs the same
traffic -- --requests calls of --prompt-len tokens, --new-tokens greedy tokens each, all queued at once --
without a recorder and with one (observe/record_series.py), at the default interval (10 s) and at a
stress interval (0.1 s: a hand-over and a rewrite of the current file ten times a second, 64 KiB files
rotating), alternated round by round so all see the same machine load. Per run: the wall time (to the
loop's stop: the recorder's last write included), the engine's forward step times (mean, p99: the writer
thread's share of the GIL and the cores shows here), what was written and the writer thread's CPU time. Also the engine thread's own cost of one hand-over at its largest (the records of HISTORY_LIMIT
steps copied, as before a drain). The medians and /proc/loadavg go to stdout and --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from minisched.base.cpus import loadavg
from minisched.engine import Engine
from minisched.observe.record_series import MIN_MAX_BYTES, RecordOptions, SeriesRecorder
from minisched.sched.sampling_params import SamplingParams
from minisched.serve import EngineLoop
from minisched.serve.engine_loop import HISTORY_LIMIT


class Sink:
    def __init__(self, rid: str, loop: asyncio.AbstractEventLoop):
        self.rid, self.loop, self.done = rid, loop, threading.Event()

    def deliver(self, update) -> None:
        if update.finish_reason is not None:
            self.done.set()


def drive(loop, n: int, prompt_len: int, max_new_tokens: int, tag: str = "") -> None:
    """n one-choice calls with client ids, queued at once, waited for (their sinks' event loop: a thread)."""
    aloop = asyncio.new_event_loop()
    thread = threading.Thread(target=aloop.run_forever, daemon=True)
    thread.start()
    sinks = []
    for k in range(n):
        sink = Sink(f"call{tag}{k}-0", aloop)
        prompt = [5 + (k * 7 + j) % 100 for j in range(prompt_len)]
        loop.submit([sink.rid], prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True), [sink], f"c{k}")
        sinks.append(sink)
    for sink in sinks:
        sink.done.wait(600)
    aloop.call_soon_threadsafe(aloop.stop)
    thread.join(5)


def run_once(engine, args, options: RecordOptions | None) -> dict:
    engine.scheduler.drain_records()  # each run records its own traffic only
    recorder = None if options is None else SeriesRecorder(options)
    engine.step_times.clear()
    loop = EngineLoop(engine, recorder=recorder, keep_history=False).start()
    t = time.perf_counter()
    drive(loop, args.requests, args.prompt_len, args.new_tokens)
    loop.stop()  # the recorder's last write and close are timed too: all its work is in the wall time
    loop.join(60)
    wall = time.perf_counter() - t
    steps = sorted(b - a for a, b in engine.step_times)
    out = {
        "wall_s": wall,
        "steps": len(steps),
        "step_mean_ms": 1e3 * statistics.fmean(steps),
        "step_p99_ms": 1e3 * steps[int(0.99 * (len(steps) - 1))],
    }
    if recorder is not None:
        files = options.replica_files(0) if options else []
        out.update(
            files_written=recorder.files_written,
            bytes_kept=sum(p.stat().st_size for p in files),
            writer_cpu_s=recorder.cpu_s,
            records_mb=recorder.bytes_taken / 2**20,
        )
    return out


def handover_cost(engine, args) -> dict:
    """The engine thread's part of one hand-over at its largest: `records()` over HISTORY_LIMIT steps, sliced."""
    engine.scheduler.drain_records()
    start = engine.scheduler.snapshot().step
    loop = EngineLoop(engine, keep_history=True).start()
    k = 0
    while engine.scheduler.snapshot().step - start < HISTORY_LIMIT:
        drive(loop, 64, args.prompt_len, args.new_tokens, tag=f"h{k}.")
        k += 1
    loop.stop()
    loop.join(60)
    times, n = [], 0
    for _ in range(20):
        t = time.perf_counter()
        recs = engine.scheduler.records()
        n = len(recs.events) + len(recs.step_stats) + len(recs.journal)
        _ = (recs.events[1:], recs.step_stats[1:], recs.journal[1:])
        times.append(time.perf_counter() - t)
    engine.scheduler.drain_records()
    return {
        "steps": engine.scheduler.snapshot().step - start,
        "records": n,
        "median_ms": 1e3 * statistics.median(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--handover", action="store_true", help="also time one hand-over at HISTORY_LIMIT steps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = Engine(args.model, num_pages=256, page_size=4, chunk_size=64)
    load = {"before": loadavg()}
    results: dict[str, list[dict]] = {"off": [], "on (10 s)": [], "on (0.1 s, 64 KiB files)": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(results) if r % 2 == 0 else list(reversed(results))
            for name in order:
                options = None
                if name == "on (10 s)":
                    options = RecordOptions(f"{tmp}/d{r}.json")
                elif name.startswith("on (0.1"):
                    options = RecordOptions(f"{tmp}/s{r}.json", max_bytes=MIN_MAX_BYTES, keep=4, interval=0.1)
                results[name].append(run_once(engine, args, options))
    load["after"] = loadavg()
    summary = {}
    for name, runs in results.items():
        keys = runs[0].keys()
        summary[name] = {k: statistics.median(run[k] for run in runs) for k in keys}
    base = summary["off"]
    print(f"{args.requests} calls x {args.new_tokens} tokens, {args.model}, {args.rounds} rounds; load {load}")
    for name, s in summary.items():
        print(
            f"  {name:<26} wall {s['wall_s']:.2f} s ({s['wall_s'] / base['wall_s']:.3f}x), "
            f"step mean {s['step_mean_ms']:.3f} ms ({s['step_mean_ms'] / base['step_mean_ms']:.3f}x), "
            f"p99 {s['step_p99_ms']:.3f} ms, {int(s['steps'])} steps"
            + (
                f", {int(s['files_written'])} files written, writer CPU {s['writer_cpu_s']:.2f} s "
                f"for {s['records_mb']:.1f} MB of records"
                if "files_written" in s
                else ""
            )
        )
    out = {"summary": summary, "runs": results, "load": load}
    if args.handover:
        out["handover"] = handover_cost(engine, args)
        h = out["handover"]
        print(f"  one hand-over at {h['steps']} steps ({h['records']} records): {h['median_ms']:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
