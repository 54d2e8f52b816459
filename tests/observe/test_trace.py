"""The run record and the Chrome/Perfetto trace of a recorded scheduler run (CPU, no torch).

The scenario (tests/lifecycle_scenario.py) runs the real Scheduler with the fake runner and
covers chunked prefill, a prefix hit, retractions and aborts (running and waiting).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest

from helpers.fake_runner import FakeRunner
from helpers.lifecycle_scenario import record_scenario, scenario_config
from minisched.observe.run_record import RunRecord, lifecycle_segments, load_runs, save_runs
from minisched.observe.trace import chrome_trace, write_chrome_trace
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler

LEGAL = {
    (None, "waiting"),
    ("waiting", "prefilling"),
    ("prefilling", "running"),
    ("prefilling", "finished"),
    ("running", "finished"),
    ("running", "retracted"),
    ("prefilling", "retracted"),
    ("retracted", "waiting"),
    ("waiting", "aborted"),
    ("prefilling", "aborted"),
    ("running", "aborted"),
}
# a request track's slices, one letter each: W waiting, P prefill chunk, Z chunk paused, D decode,
# R retracted (waiting again); a life may end (abort) anywhere after its first slice
SLICE_LETTER = {"waiting": "W", "chunk paused": "Z", "decode": "D", "retracted": "R"}
LIFE = re.compile(r"^W(P[PZ]*D?(RP[PZ]*D?)*R?)?$")


@pytest.fixture(scope="module")
def recorded() -> RunRecord:
    rec, _ = record_scenario("scenario")
    return rec


def test_scenario_covers_the_lifecycle(recorded):
    evs = recorded.events
    assert any(e["dst"] == "retracted" for e in evs), "no retraction"
    assert {e["rid"] for e in evs if e["dst"] == "aborted"} == {"r4", "r7"}
    assert any(e["src"] == "waiting" and e["dst"] == "prefilling" and e["cached_len"] > 0 for e in evs), "no prefix hit"
    chunks = defaultdict(int)
    for seg in lifecycle_segments(recorded):
        for state, *_ in seg["slices"]:
            chunks[seg["key"]] += state == "prefill"
    assert chunks["r1"] >= 3, "r1 (22 tokens, chunk 8) must prefill in chunks"


def test_events_legal_and_metrics(recorded):
    state = {}
    for e in recorded.events:
        assert (e["src"], e["dst"]) in LEGAL, e
        assert state.get(e["rid"]) == e["src"], e
        state[e["rid"]] = e["dst"]
    assert all(s in ("finished", "aborted") for s in state.values())
    times = [e["time"] for e in recorded.events]
    assert times == sorted(times) and times[0] >= 0
    by_rid = {r["rid"]: r for r in recorded.requests}
    assert list(by_rid) == ["r0", "r1", "r2", "r3", "r4", "r5", "r6", "r7"]
    for r in recorded.requests:
        assert r["finish"] is not None and r["finish"] >= r["arrival"]
        if r["status"] == "finished":
            assert 0 <= r["ttft"] <= r["e2e_latency"]
            assert r["output_tokens"] >= 1
    assert by_rid["r7"]["status"] == "aborted" and by_rid["r7"]["ttft"] is None
    assert by_rid["r2"]["cached_tokens"] == 12  # the shared system prompt
    assert by_rid["r1"]["num_retractions"] >= 1


def test_json_round_trip(recorded, tmp_path):
    path = tmp_path / "run.json"
    other = RunRecord.from_dict(json.loads(json.dumps(recorded.to_dict())))
    other.name = "second"
    save_runs(path, [recorded, other])
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and len(doc["runs"]) == 2
    loaded = load_runs(path)
    assert [r.name for r in loaded] == ["scenario", "second"]
    assert loaded[0].to_dict() == json.loads(json.dumps(recorded.to_dict()))
    assert loaded[0].config["scheduler"]["num_pages"] == 20
    with pytest.raises(ValueError):
        path.write_text('{"version": 99, "runs": []}')
        load_runs(path)


def _validate(trace: dict) -> dict:
    """Checks trace-event JSON; returns {(pid, tid): [events]} of the non-metadata events."""
    json.loads(json.dumps(trace))  # plain JSON
    tracks, open_b = defaultdict(list), defaultdict(list)
    names = set()
    for ev in trace["traceEvents"]:
        assert ev["ph"] in {"X", "B", "E", "i", "C", "M"}, ev
        assert isinstance(ev["pid"], int) and isinstance(ev["name"], str)
        if ev["ph"] == "M":
            names.add((ev["pid"], ev.get("tid"), ev["name"]))
            continue
        assert ev["ts"] >= 0
        if ev["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in ev["args"].values())
            continue
        key = (ev["pid"], ev["tid"])
        if tracks[key]:
            assert ev["ts"] >= tracks[key][-1]["ts"], f"time goes back on track {key}"
        tracks[key].append(ev)
        if ev["ph"] == "X":
            assert ev["dur"] >= 0, ev
        elif ev["ph"] == "B":
            open_b[key].append(ev["name"])
        elif ev["ph"] == "E":
            assert open_b[key], f"end without begin on {key}"
            open_b[key].pop()
    assert not any(open_b.values()), "a begin without an end"
    for pid, tid in tracks:
        assert (pid, tid, "thread_name") in names and (pid, None, "process_name") in names
    return tracks


def test_chrome_trace_valid(recorded, tmp_path):
    trace = chrome_trace(recorded)
    tracks = _validate(trace)
    steps = tracks[(1, 0)]
    assert len(steps) == len(recorded.step_stats)
    assert {e["name"] for e in steps} <= {"prefill", "decode", "mixed"}
    for a, b in zip(steps, steps[1:]):  # a step lasts until the next one starts
        assert a["ts"] + a["dur"] == pytest.approx(b["ts"], abs=1e-2)
    thread_names = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert len(thread_names) == 1 + len(recorded.requests)
    for tid, name in thread_names.items():
        if tid == 0:
            continue
        evs = tracks[(1, tid)]
        slices = [e for e in evs if e["ph"] == "X"]
        for a, b in zip(slices, slices[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, f"{name}: overlapping slices"
        letters = "".join("P" if e["name"].startswith("prefill chunk") else SLICE_LETTER[e["name"]] for e in slices)
        assert LIFE.match(letters), f"{name}: illegal state order {letters}"
        marks = [e for e in evs if e["ph"] == "i"]
        final = [e for e in marks if e["name"] in ("finished", "aborted")]
        assert len(final) == 1 and final[0]["ts"] >= slices[-1]["ts"] + slices[-1]["dur"] - 1e-3
        assert sum(e["name"] == "retract" for e in marks) == letters.count("R")
        if final[0]["name"] == "finished":
            assert letters[-1] in "PD"
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert {e["name"] for e in counters} >= {"KV pages", "queue"}
    for e in counters:
        if e["name"] == "KV pages":
            assert sum(e["args"].values()) == recorded.num_pages and min(e["args"].values()) >= 0
    path = tmp_path / "trace.json"
    write_chrome_trace(path, [recorded, recorded])
    both = json.loads(path.read_text())
    _validate(both)
    assert {e["pid"] for e in both["traceEvents"]} == {1, 2}


def test_record_taken_mid_run():
    """Live requests get their current state up to the record's end; the trace stays valid."""
    cfg = scenario_config()
    sched, runner = Scheduler(cfg), FakeRunner(cfg.num_pages, cfg.page_size, 50)
    for i in range(4):
        sched.add_request(f"q{i}", list(range(10 * i, 10 * i + 12)), SamplingParams(max_new_tokens=20))
    for _ in range(3):
        sched.step(runner)
    rec = RunRecord.from_scheduler("partial", sched)
    segs = lifecycle_segments(rec)
    assert len(segs) == 4 and all(seg["slices"] for seg in segs)
    assert all(seg["slices"][-1][2] == pytest.approx(rec.duration) for seg in segs)
    assert any(r["finish"] is None and r["e2e_latency"] is None for r in rec.requests)
    _validate(chrome_trace(rec))


def test_start_time_drops_warmup(recorded):
    """A record started mid-run (after a warm-up on the same scheduler) keeps only what followed."""
    _, sched = record_scenario("again", base=0.0, per_token=0.0)
    cut = sched.step_stats[len(sched.step_stats) // 2].time
    rec = RunRecord.from_scheduler("second half", sched, start_time=cut)
    assert rec.events and min(e["time"] for e in rec.events) >= 0
    assert len(rec.step_stats) < len(sched.step_stats)
    _validate(chrome_trace(rec))
    assert all(seg["slices"] or seg["marks"] for seg in lifecycle_segments(rec))
    assert any(r["arrival"] is None and r["ttft"] is None for r in rec.requests)
