"""Chrome trace-event JSON of a run, for ui.perfetto.dev or chrome://tracing.

Layout (one process per run; times in microseconds from the run's start):

- tid 0 "batch steps": one complete ("X") slice per scheduled batch, named by its mode
  (prefill / decode / mixed), lasting until the next step starts; args: step, batch
  size, prefill and decode tokens, cache-hit tokens, retractions, new_token_ratio.
- tid 1.. one track per request life, in arrival order, named by its rid: "X" slices
  waiting, "prefill chunk N" (one per chunk), chunk paused (between two chunks), decode,
  retracted (waiting again after a retraction),
  and instant ("i") events retract, finished, aborted.
- counters ("C"): "KV pages" (used by requests / cached in the radix tree / free; they sum
  to the pool size), "KV evictable pages", "queue" (running, waiting).
- metadata ("M"): process_name, thread_name and thread_sort_index, so Perfetto labels and
  orders the tracks.

`chrome_trace(record_or_records)` returns the dict; `write_chrome_trace(path, ...)` writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

from minisched.observe.explain import story_marks
from minisched.observe.run_record import RunRecord, lifecycle_segments, step_bounds

US = 1e6
STEP_TID = 0


def _us(t: float) -> float:
    return round(t * US, 3)


def _meta(pid: int, tid: int | None, name: str, value) -> dict:
    ev = {"ph": "M", "pid": pid, "name": name, "args": {"name" if name != "thread_sort_index" else "sort_index": value}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def _run_events(record: RunRecord, pid: int) -> list[dict]:
    out = [
        _meta(pid, None, "process_name", f"minisched: {record.name}"),
        _meta(pid, STEP_TID, "thread_name", "batch steps"),
        _meta(pid, STEP_TID, "thread_sort_index", STEP_TID),
    ]
    # -- batch steps and counters --
    for s, start, end in step_bounds(record):
        args = {
            k: s[k]
            for k in (
                "step",
                "batch_size",
                "num_prefill_tokens",
                "num_decode_tokens",
                "cache_hit_tokens",
                "num_retracted",
                "new_token_ratio",
            )
            if k in s
        }
        out.append(
            {
                "ph": "X",
                "pid": pid,
                "tid": STEP_TID,
                "name": s["mode"],
                "cat": "step",
                "ts": _us(start),
                "dur": max(_us(end) - _us(start), 0.0),
                "args": args,
            }
        )
        ts = _us(start)
        used = record.num_pages - s["free_pages"] - s["cached_pages"]
        out.append(
            {
                "ph": "C",
                "pid": pid,
                "name": "KV pages",
                "ts": ts,
                "args": {"used": used, "cached": s["cached_pages"], "free": s["free_pages"]},
            }
        )
        out.append(
            {"ph": "C", "pid": pid, "name": "KV evictable pages", "ts": ts, "args": {"evictable": s["evictable_pages"]}}
        )
        out.append(
            {
                "ph": "C",
                "pid": pid,
                "name": "queue",
                "ts": ts,
                "args": {"running": s["num_running"], "waiting": s["num_waiting"]},
            }
        )
    # -- one track per request; its decisions (observe/explain.py) as instants whose args say why --
    marks = story_marks(record)
    for tid, seg in enumerate(lifecycle_segments(record), start=1):
        for t, steps, text in marks.pop(seg["key"], []):
            if t < 0:  # before the record's start (a warm-up on the same scheduler)
                continue
            out.append(
                {
                    "ph": "i",
                    "s": "t",
                    "pid": pid,
                    "tid": tid,
                    "name": "why: " + text.split(":")[0].split(" (")[0],
                    "cat": "decision",
                    "ts": _us(t),
                    "args": {"steps": steps, "why": text},
                }
            )
        out.append(_meta(pid, tid, "thread_name", f"req {seg['key']}"))
        out.append(_meta(pid, tid, "thread_sort_index", tid))
        for state, start, end, args in seg["slices"]:
            name = f"prefill chunk {args['chunk']}" if state == "prefill" else state
            out.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": tid,
                    "name": name,
                    "cat": state,
                    "ts": _us(start),
                    "dur": max(_us(end) - _us(start), 0.0),
                    "args": args,
                }
            )
        for kind, t, args in seg["marks"]:
            out.append(
                {"ph": "i", "s": "t", "pid": pid, "tid": tid, "name": kind, "cat": kind, "ts": _us(t), "args": args}
            )
    return out


def chrome_trace(records: RunRecord | list[RunRecord]) -> dict:
    """Trace-event JSON object ({"traceEvents": [...], "displayTimeUnit": "ms"}); one
    process per run (pid 1, 2, ...). Events are sorted by (pid, tid, ts), metadata first."""
    runs = [records] if isinstance(records, RunRecord) else list(records)
    events: list[dict] = []
    for pid, rec in enumerate(runs, start=1):
        events.extend(_run_events(rec, pid))
    events.sort(key=lambda e: (e["pid"], e["ph"] != "M", e.get("tid", -1), e.get("ts", 0.0)))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"generator": "minisched.observe.trace", "runs": [r.name for r in runs]},
    }


def write_chrome_trace(path: str | Path, records: RunRecord | list[RunRecord]) -> None:
    Path(path).write_text(json.dumps(chrome_trace(records), separators=(",", ":")) + "\n")
