"""`RunRecord`: one serving run's lifecycle events, step stats and per-request metrics, as JSON.

Built from a finished `Scheduler` (`RunRecord.from_scheduler`), it is the input of the
Chrome/Perfetto trace (`minisched.observe.trace`) and the lifecycle report (`minisched.observe.report`).
All times are seconds relative to the run's start (`start_time`, a time.monotonic()
value; default: the first event or step).

File layout (`save_runs` / `load_runs`; a `--compare` bench writes two runs):

    {"version": 1,
     "runs": [{
        "name": "fcfs",
        "config": {...},            # free-form: what the bench ran (scheduler config, model, workload)
        "summary": {...},           # free-form: the bench's headline numbers (throughput, ...)
        "num_pages": 256, "page_size": 16,
        "events": [                 # one per request state change (minisched.sched.events.Event fields)
            {"time": 0.0012, "step": 3, "rid": "r0", "src": "waiting", "dst": "prefilling",
             "prompt_len": 40, "output_len": 0, "kv_len": 0, "cached_len": 16, "note": ""}, ...],
        "step_stats": [             # one per scheduled batch (minisched.events.StepStats fields)
            {"step": 3, "time": 0.0013, "mode": "prefill", "batch_size": 2, "num_prefill_tokens": 64,
             "num_decode_tokens": 0, "num_running": 1, "num_waiting": 4, "free_pages": 100,
             "cached_pages": 20, "evictable_pages": 4, "token_usage": 0.5, ...}, ...],
        "requests": [               # one per request life, in arrival order (`request_metrics`)
            {"rid": "r0", "status": "finished", "finish_reason": "max_new_tokens",
             "arrival": 0.0, "first_token": 0.05, "finish": 0.9, "prompt_tokens": 40,
             "output_tokens": 32, "cached_tokens": 16, "num_retractions": 0,
             "ttft": 0.05, "e2e_latency": 0.9}, ...],
        "journal": [                # the scheduler's inputs and decisions (minisched/sched/journal.py)
            {"op": "init", "config": {...}, "host": null, "drafter": false},
            {"op": "add", "rid": "r0", "prompt": [1, 2, ...], "sampling": {...}, "t": 0.0}, ...],
        "carried": [],              # `serve --record` segments after the first: the requests live at its start
        "client_ids": {}}]}         # `serve --record`: each client's X-Request-Id -> the engine request ids

`carried` and `client_ids` are written by `minisched serve --record` (observe/record_series.py says
how a series of files covers one engine's life); a file without them reads as empty ones.

A request's status values are `ReqStatus` values: waiting, prefilling, running, retracted,
finished, aborted; `src` is null when the request arrives. `first_token`/`ttft` are null
for a request aborted before its first token; `finish`/`e2e_latency` are null for one still
live when the record was taken; `arrival`, `ttft`, `e2e_latency` are null for one that
arrived before `start_time`. `cached_tokens` is the radix-cache prefix hit at the first
admission (a retracted request's re-admission reuses its own KV; that is not counted).

`lifecycle_segments(record)` turns the events into per-request time slices (waiting,
retracted = waiting again after a retraction, prefill chunks, chunk paused = a chunked
request between two of its chunks, decode) and marks (retract, finished, aborted): the shared model of the trace and the report. A prefill chunk of a
request is each prefill/mixed step between its admission and the end of its prefill: the
scheduler carries at most one chunked request, and it runs first in every prefill round.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
FINAL_STATES = ("finished", "aborted")
PREFILL_MODES = ("prefill", "mixed")


_FIELDS: dict[type, tuple[str, ...]] = {}  # a dataclass's field names (dataclasses.fields is slow per call)


def plain(obj: Any, t0: float) -> dict:
    """A StepStats/Event dataclass (or a dict) as a JSON-ready dict, times relative to t0. Shallow: the
    records are frozen and flat (dataclasses.asdict's deep copy took 4x the CPU: benchmarks/RESULTS.md,
    "Recording")."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = _FIELDS.get(type(obj))
        if names is None:
            names = _FIELDS[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
        d = {k: getattr(obj, k) for k in names}
    else:
        d = dict(obj)
    for k, v in d.items():
        if isinstance(v, enum.Enum):
            d[k] = v.value
    d["time"] = round(float(d["time"]) - t0, 6)  # microseconds are plenty
    return d


@dataclass
class RunRecord:
    """One run, JSON-ready: `events` and `step_stats` are the scheduler's Event/StepStats
    as plain dicts (enum values as strings, times relative to the run's start)."""

    name: str
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    num_pages: int = 0
    page_size: int = 0
    events: list[dict] = field(default_factory=list)
    step_stats: list[dict] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)  # per-request metrics (`request_metrics`)
    # the scheduler's journal (minisched/sched/journal.py): inputs and decisions from its birth, `t` relative
    # to the run's start like every time here; `minisched explain` and `minisched replay` read it
    journal: list[dict] = field(default_factory=list)
    # `serve --record` (record_series.py): the requests live when a segment started (compact add entries with
    # their arrival step and whether they were waiting), and client X-Request-Id -> engine request ids
    carried: list[dict] = field(default_factory=list)
    client_ids: dict[str, list[str]] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        times = [e["time"] for e in self.events] + [s["time"] for s in self.step_stats]
        return max(times, default=0.0)

    @classmethod
    def from_events(
        cls,
        name: str,
        events: list,
        step_stats: list,
        num_pages: int,
        page_size: int,
        config: dict | None = None,
        summary: dict | None = None,
        start_time: float | None = None,
        journal: list | tuple = (),
    ) -> RunRecord:
        """From `Event`/`StepStats` objects (absolute time.monotonic() times). With
        `start_time`, what happened before it (a warm-up on the same scheduler) is dropped, but from the
        journal (replay needs it whole)."""
        if start_time is not None:
            events = [e for e in events if e.time >= start_time]
            step_stats = [s for s in step_stats if s.time >= start_time]
        times = [e.time for e in events] + [s.time for s in step_stats]
        t0 = start_time if start_time is not None else min(times, default=0.0)
        rec = cls(
            name,
            dict(config or {}),
            dict(summary or {}),
            int(num_pages),
            int(page_size),
            [plain(e, t0) for e in events],
            [plain(s, t0) for s in step_stats],
        )
        rec.requests = request_metrics(rec.events)
        rec.journal = [relative(e, t0) for e in journal]
        return rec

    @classmethod
    def from_scheduler(
        cls,
        name: str,
        scheduler,
        config: dict | None = None,
        summary: dict | None = None,
        start_time: float | None = None,
    ) -> RunRecord:
        """From a scheduler after (or during) a run; `start_time`: the run's time.monotonic()
        origin (events before it are dropped), default the first event. The scheduler's
        own config is added under config["scheduler"] unless the caller already put one there."""
        config = dict(config or {})
        config.setdefault("scheduler", dataclasses.asdict(scheduler.config))
        records = scheduler.records()
        return cls.from_events(
            name,
            records.events,
            records.step_stats,
            scheduler.config.num_pages,
            scheduler.config.page_size,
            config,
            summary,
            start_time,
            records.journal,
        )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "config": self.config,
            "summary": self.summary,
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "events": self.events,
            "step_stats": self.step_stats,
            "requests": self.requests,
            "journal": self.journal,
            "carried": self.carried,
            "client_ids": self.client_ids,
        }

    @classmethod
    def from_dict(cls, d: dict) -> RunRecord:
        for key in ("name", "events", "step_stats"):
            if key not in d:
                raise ValueError(f"run record lacks {key!r}")
        events = [dict(e) for e in d["events"]]
        requests = [dict(r) for r in d["requests"]] if "requests" in d else request_metrics(events)
        return cls(
            str(d["name"]),
            dict(d.get("config", {})),
            dict(d.get("summary", {})),
            int(d.get("num_pages", 0)),
            int(d.get("page_size", 0)),
            events,
            [dict(s) for s in d["step_stats"]],
            requests,
            [dict(e) for e in d.get("journal", [])],
            [dict(e) for e in d.get("carried", [])],
            {str(k): [str(r) for r in v] for k, v in d.get("client_ids", {}).items()},
        )


def relative(entry: dict, t0: float) -> dict:
    """A journal entry with its time relative to t0."""
    if "t" not in entry:
        return dict(entry)
    return {**entry, "t": round(float(entry["t"]) - t0, 6)}


HEAD = ("name", "config", "summary", "num_pages", "page_size", "client_ids")
LISTS = ("events", "step_stats", "requests", "journal", "carried")


def dump(obj: Any) -> str:
    """One JSON value as the run files write it (enums as values, dataclasses as dicts)."""
    return json.dumps(obj, default=_json_default)


def run_text(head: dict[str, str], lists: dict[str, list[str]]) -> str:
    """One run's JSON from its head values and list items, each already `dump`ed: one item per line
    (greppable, diffable)."""
    fields = ", ".join(f"{dump(k)}: {head[k]}" for k in HEAD)
    body = ",\n ".join(f"{dump(k)}: [\n  " + ",\n  ".join(lists[k]) + "]" for k in LISTS)
    return "{" + fields + ",\n " + body + "}"


def file_text(runs: list[str]) -> str:
    """A run file from its runs' `run_text`s."""
    return f'{{"version": {FORMAT_VERSION}, "runs": [\n' + ",\n".join(runs) + "]}\n"


def save_runs(path: str | Path, runs: list[RunRecord]) -> None:
    """Write runs to one JSON file: {"version": 1, "runs": [...]}."""
    parts = []
    for run in runs:
        d = run.to_dict()
        parts.append(run_text({k: dump(d[k]) for k in HEAD}, {k: [dump(x) for x in d[k]] for k in LISTS}))
    Path(path).write_text(file_text(parts))


def load_runs(path: str | Path) -> list[RunRecord]:
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION or not isinstance(doc.get("runs"), list):
        raise ValueError(f"{path}: not a minisched run file (want {{'version': {FORMAT_VERSION}, 'runs': [...]}})")
    return [RunRecord.from_dict(r) for r in doc["runs"]]


def _json_default(obj: Any) -> Any:
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


# -- per-request views ------------------------------------------------------------
def request_lives(events: list[dict]) -> list[tuple[str, list[dict]]]:
    """Events grouped per request life, in arrival order: [(key, events)]. The key is the
    rid, or "rid#2", "rid#3" ... when a finished request's id was reused."""
    lives: list[tuple[str, list[dict]]] = []
    current: dict[str, list[dict]] = {}
    count: dict[str, int] = {}
    for e in events:
        rid = e["rid"]
        if e["src"] is None or rid not in current:
            count[rid] = count.get(rid, 0) + 1
            current[rid] = []
            lives.append((rid if count[rid] == 1 else f"{rid}#{count[rid]}", current[rid]))
        current[rid].append(e)
    return lives


def request_metrics(events: list[dict]) -> list[dict]:
    out = []
    for key, evs in request_lives(events):
        arrival = evs[0]["time"] if evs[0]["src"] is None else None  # None: arrived before the record
        first = next((e["time"] for e in evs if e["output_len"] >= 1), None)
        last = evs[-1]
        done = last["dst"] in FINAL_STATES
        finish = last["time"] if done else None
        out.append(
            {
                "rid": key,
                "status": last["dst"],
                "finish_reason": last.get("note", "") if done else "",
                "arrival": arrival,
                "first_token": first,
                "finish": finish,
                "prompt_tokens": last["prompt_len"],
                "output_tokens": last["output_len"],
                "cached_tokens": next((e["cached_len"] for e in evs if e["dst"] == "prefilling"), 0),
                "num_retractions": sum(1 for e in evs if e["dst"] == "retracted"),
                "ttft": None if first is None or arrival is None else first - arrival,
                "e2e_latency": None if finish is None or arrival is None else finish - arrival,
            }
        )
    return out


def step_bounds(record: RunRecord) -> list[tuple[dict, float, float]]:
    """[(step, start, end)]: a step lasts until the next step starts; the last one until
    the last event of that step (or the run's end)."""
    steps, out = record.step_stats, []
    last_event: dict[int, float] = {}
    for e in record.events:
        last_event[e["step"]] = max(last_event.get(e["step"], e["time"]), e["time"])
    for i, s in enumerate(steps):
        if i + 1 < len(steps):
            end = steps[i + 1]["time"]
        else:
            end = max(last_event.get(s["step"], s["time"]), s["time"])
        out.append((s, s["time"], max(end, s["time"])))
    return out


def lifecycle_segments(record: RunRecord) -> list[dict]:
    """Per request life, in arrival order: {"key", "arrival", "slices": [(state, start, end,
    args)], "marks": [(kind, time, args)]}. Slices on one request never overlap and are in
    time order; states are "waiting", "retracted", "prefill" (one per chunk), "chunk paused"
    (a chunked request between two of its chunks), "decode"; marks are "retract",
    "finished", "aborted". A request still live when the record was taken gets its
    current state up to the end of the record; one that was live before its start, from
    the start."""
    bounds = [(s, a, b) for s, a, b in step_bounds(record) if s["mode"] in PREFILL_MODES]
    bound_steps = [s["step"] for s, _, _ in bounds]
    run_end, last_step = record.duration, max((s["step"] for s in record.step_stats), default=0)
    out = []
    first_step = min((s["step"] for s in record.step_stats), default=0)
    for key, evs in request_lives(record.events):
        if evs[0]["src"] is not None:  # live before the record started: in src since its start
            evs = [dict(evs[0], src=None, dst=evs[0]["src"], time=0.0, step=first_step)] + evs
        slices: list[tuple[str, float, float, dict]] = []
        marks: list[tuple[str, float, dict]] = []
        cursor = evs[0]["time"]

        def add(state: str, start: float, end: float, args: dict) -> None:
            nonlocal cursor
            start = max(start, cursor)
            end = max(end, start)
            slices.append((state, start, end, args))  # noqa: B023 (called within this iteration only)
            cursor = end

        entered, wait_state = evs[0], "waiting"
        tail = (
            []
            if evs[-1]["dst"] in FINAL_STATES
            else [dict(evs[-1], src=evs[-1]["dst"], dst=None, time=run_end, step=last_step)]
        )
        for e in evs[1:] + tail:
            src, dst, t = e["src"], e["dst"], e["time"]
            if src == "waiting":
                add(wait_state, entered["time"], t, {"cached_len": e["cached_len"]})
            elif src == "prefilling":
                lo, hi = bisect_left(bound_steps, entered["step"]), bisect_right(bound_steps, e["step"])
                for i, (s, a, b) in enumerate(bounds[lo:hi]):
                    start = entered["time"] if i == 0 else a
                    if start > cursor:  # the carried chunk skipped steps (pages short, decode due)
                        add("chunk paused", cursor, start, {})
                    add(
                        "prefill",
                        start,
                        min(b, t),
                        {"step": s["step"], "chunk": i + 1, "cached_len": entered["cached_len"]},
                    )
                if hi > lo and t > cursor:
                    add("chunk paused", cursor, t, {})
                if hi == lo:  # no step ran it (a record taken mid-step)
                    add("prefill", entered["time"], t, {"chunk": 0})
            elif src == "running":
                add("decode", entered["time"], t, {"output_len": e["output_len"]})
            if dst == "retracted":
                marks.append(("retract", t, {"output_len": e["output_len"], "step": e["step"]}))
                wait_state = "retracted"
            elif dst in FINAL_STATES:
                marks.append((dst, t, {"reason": e.get("note", ""), "output_len": e["output_len"]}))
            entered = e
        out.append({"key": key, "arrival": evs[0]["time"], "slices": slices, "marks": marks})
    return out


def percentile(values: list[float], q: float) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def derived_summary(record: RunRecord) -> dict:
    """Headline numbers computed from the record itself (the report's table)."""
    reqs, steps = record.requests, record.step_stats
    ttft = [r["ttft"] for r in reqs if r["ttft"] is not None]
    e2e = [r["e2e_latency"] for r in reqs if r["status"] == "finished" and r["e2e_latency"] is not None]
    out_tokens = sum(r["output_tokens"] for r in reqs)
    dur = record.duration
    prompt = sum(r["prompt_tokens"] for r in reqs)
    out = {
        "requests": len(reqs),
        "finished": sum(r["status"] == "finished" for r in reqs),
        "aborted": sum(r["status"] == "aborted" for r in reqs),
        "retractions": sum(r["num_retractions"] for r in reqs),
        "steps": len(steps),
        "prefill steps": sum(s["mode"] == "prefill" for s in steps),
        "decode steps": sum(s["mode"] == "decode" for s in steps),
        "mixed steps": sum(s["mode"] == "mixed" for s in steps),
        "duration (s)": dur,
        "output tokens": out_tokens,
        "output tok/s": out_tokens / dur if dur > 0 else None,
        "prefix-cache hit / prompt": sum(r["cached_tokens"] for r in reqs) / prompt if prompt else None,
        "mean batch size": sum(s["batch_size"] for s in steps) / len(steps) if steps else None,
    }
    for name, vals in (("TTFT", ttft), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name} p{q} (s)"] = percentile(vals, q)
    return out
