"""`serve --record`'s series of run files (minisched/observe/record_series.py), written by a real EngineLoop on
the tiny random model with a pool small enough to queue, chunk and rotate often:
- the series joined replays identically (exact and what-if); every file is explained on its own, and the
  client's X-Request-Id names its request there; a segment after the first alone, or a series with a
  segment missing, is a one-line error (exit 2);
- rotation keeps at most K files per replica (older series' too) and every file within the byte bound;
- a second series never overwrites the first; bad options are one-line errors."""

from __future__ import annotations

import json
import os

import pytest

from helpers.record import cli, drive
from minisched.engine import Engine
from minisched.observe.explain import request_story
from minisched.observe.record_series import MIN_MAX_BYTES, RecordOptions, SeriesRecorder
from minisched.observe.run_record import load_runs
from minisched.serve import EngineLoop


@pytest.fixture(scope="module")
def engine():
    return Engine("dummy:tiny", num_pages=64, page_size=4, chunk_size=16)


def record(engine, options: RecordOptions, n: int) -> SeriesRecorder:
    recorder = SeriesRecorder(options)
    loop = EngineLoop(engine, recorder=recorder, check_invariants=True).start()
    try:
        drive(loop, n)
    finally:
        loop.stop()
        loop.join(60)
    assert not loop.is_alive() and not loop.invariant_errors and recorder.errors == 0
    return recorder


@pytest.fixture(scope="module")
def series(engine, tmp_path_factory):
    """A whole series (nothing pruned): its files in order."""
    folder = tmp_path_factory.mktemp("series")
    options = RecordOptions(str(folder / "serve.json"), max_bytes=MIN_MAX_BYTES, keep=100, interval=0.05)
    recorder = record(engine, options, 60)
    files = options.replica_files(0)
    assert len(files) == recorder.files_written >= 3  # it rotated
    return files


def test_the_series_replays_identically_and_each_file_is_explained(series, capsys):
    rc, out, err = cli(["replay", *series], capsys)
    assert rc == 0 and out.startswith("identical, "), out + err
    steps = int(out.split()[1])  # every build of the engine's life was replayed, not a prefix of them
    assert steps == load_runs(series[-1])[0].config["record"]["last_step"] > 0
    rc, out, err = cli(["replay", *reversed(series), "--policy", "lpm", "--chunk-size", "8"], capsys)  # any order
    assert rc == 0 and "policy=lpm" in out and "TTFT p50" in out, err
    rc, out, err = cli(["replay", series[0]], capsys)  # the first file starts at the engine's birth
    assert rc == 0 and out.startswith("identical, "), err
    seen_clients = set()
    for path in series:
        run = load_runs(path)[0]
        assert run.config["record"]["segment"] == int(path.name.split(".")[-2])
        rc, out, err = cli(["explain", path, "--slowest", "3"], capsys)
        assert rc == 0 and out.count("-token prompt") >= 1, err
        client, rids = next(iter(run.client_ids.items()))
        seen_clients |= set(run.client_ids)
        rc, out, err = cli(["explain", path, "--request", client], capsys)
        assert rc == 0 and out.startswith(f"{rids[0]}:"), err
    assert seen_clients == {f"client-{k}" for k in range(60)}


def test_a_later_segment_carries_the_requests_live_at_its_start(series, capsys):
    later = load_runs(series[1])[0]
    assert later.journal[0]["op"] != "init" and later.carried
    rid = later.carried[0]["rid"]
    rc, out, err = cli(["explain", series[1], "--request", rid], capsys)
    assert rc == 0 and "arrived (before this file" in out, err
    # a carried request that was already admitted does not wait in the later file (unless retracted there)
    running = [(run, c["rid"]) for run in map(lambda p: load_runs(p)[0], series[1:]) for c in run.carried]
    running = [(run, rid) for run, rid in running if not next(c for c in run.carried if c["rid"] == rid)["waiting"]]
    assert running
    for run, rid in running:
        texts = [t for _, _, t in request_story(run, rid)]
        until = next((i for i, t in enumerate(texts) if t.startswith(("retracted", "preempted"))), len(texts))
        assert not any(t.startswith("waited") for t in texts[:until]), texts


@pytest.mark.parametrize("which", ["alone", "gap", "mixed"])
def test_a_series_that_cannot_be_replayed_is_one_line(which, series, tmp_path, capsys):
    other = tmp_path / "other.json"
    doc = json.loads(series[0].read_text())
    doc["runs"][0]["config"]["record"]["series"] = "another"
    other.write_text(json.dumps(doc))
    argv = {
        "alone": [series[1]],
        "gap": [series[0], series[2]],
        "mixed": [series[0], other],
    }[which]
    message = {"alone": "starts mid-run", "gap": "segment 1 is missing", "mixed": "series"}[which]
    rc, _, err = cli(["replay", *argv], capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_rotation_keeps_k_files_within_the_byte_bound(engine, tmp_path):
    base = tmp_path / "serve.json"
    # an earlier server's series of this replica: the oldest files, deleted first
    old = [tmp_path / f"serve.r0.20200101T000000.000Z.p1.{k:04d}.json" for k in range(3)]
    for p in old:
        p.write_text("{}")
    unrelated = [tmp_path / "serve.r1.20200101T000000.000Z.p1.0000.json", tmp_path / "other.json"]
    for p in unrelated:
        p.write_text("{}")
    options = RecordOptions(str(base), max_bytes=MIN_MAX_BYTES, keep=2, interval=0.05)
    recorder = record(engine, options, 40)
    files = options.replica_files(0)
    assert recorder.files_written > 2 and len(files) == 2
    assert not any(p.exists() for p in old) and all(p.exists() for p in unrelated)
    assert all(recorder.series in p.name for p in files)
    assert all(os.path.getsize(p) <= MIN_MAX_BYTES for p in files)
    numbers = [load_runs(p)[0].config["record"]["segment"] for p in files]
    assert numbers == [recorder.files_written - 2, recorder.files_written - 1]


def test_a_new_series_overwrites_nothing(engine, tmp_path):
    options = RecordOptions(str(tmp_path / "serve.json"), max_bytes=MIN_MAX_BYTES, keep=100, interval=0.05)
    first = record(engine, options, 4)
    before = {p: p.read_bytes() for p in options.replica_files(0)}
    second = record(engine, options, 4)
    assert second.series != first.series
    after = options.replica_files(0)
    assert all(p.read_bytes() == data for p, data in before.items())
    assert len(after) == len(before) + second.files_written


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--record", "/no/such/folder/serve.json"], "--record /no/such/folder/serve.json: folder"),
        (["--record", "{tmp}"], "is a directory"),
        (["--record", "{tmp}/s.json", "--record-max-bytes", "1000"], "--record-max-bytes must be >= 65536"),
        (["--record", "{tmp}/s.json", "--record-keep", "0"], "--record-keep must be >= 1"),
        (["--record", "{tmp}/s.json", "--record-interval", "0"], "--record-interval must be > 0"),
    ],
)
def test_bad_record_options_are_one_line_errors(argv, message, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path) for a in argv]
    rc, _, err = cli(["serve", "--model", "dummy:tiny", *argv], capsys)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_the_records_a_drain_drops_reach_the_files_first(engine, tmp_path, monkeypatch, capsys):
    """The engine loop drains the scheduler's records every HISTORY_LIMIT steps: with hand-overs only there
    (and at the stop), the series still holds every step."""
    import minisched.serve.engine_loop as engine_loop

    monkeypatch.setattr(engine_loop, "HISTORY_LIMIT", 25)
    options = RecordOptions(str(tmp_path / "serve.json"), max_bytes=MIN_MAX_BYTES, keep=100, interval=1000.0)
    record(engine, options, 30)
    files = options.replica_files(0)
    rc, out, err = cli(["replay", *files], capsys)
    assert rc == 0 and out.startswith("identical, "), out + err
    runs = [load_runs(p)[0] for p in files]
    first = runs[0].journal[0]
    assert first["op"] == "init"
    steps = sorted(e["step"] for r in runs for e in r.journal if e["op"] == "build")
    assert steps == list(range(steps[0], steps[-1] + 1)) and int(out.split()[1]) == len(steps) > 25
