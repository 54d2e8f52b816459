"""`minisched explain` and `minisched replay` on runs recorded by `minisched bench --json` and `minisched
generate --record` (the tiny random model, a pool small enough to chunk and retract): the stories, an
identical exact replay, a what-if table, and bad input as one line with exit 2."""

from __future__ import annotations

import json

import pytest

from minisched.cli import main

TINY = ["--model", "dummy:tiny"]


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("explain") / "run.json"
    rc = main(
        [
            "bench",
            "--workload",
            "shared-prefix",
            "--num-requests",
            "12",
            "--rate",
            "0",
            "--scale",
            "0.1",
            "--num-pages",
            "40",
            "--page-size",
            "4",
            "--chunk-size",
            "32",
            "--json",
            str(path),
            "--no-progress",
            *TINY,
        ]
    )
    assert rc == 0
    return path


def test_bench_run_is_explained_and_replays_identically(bench_run, capsys):
    data = json.loads(bench_run.read_text())
    journal = data["runs"][0]["journal"]
    assert journal[0]["op"] == "init" and any(e["op"] == "build" for e in journal)
    rc, out, err = run(["explain", str(bench_run)], capsys)
    assert rc == 0, err
    assert "arrived" in out and "admitted" in out and "finished" in out and "waited" in out
    rc, out, _ = run(["explain", str(bench_run), "--slowest", "2"], capsys)
    assert rc == 0 and out.count("-token prompt") == 2
    rid = data["runs"][0]["requests"][0]["rid"]
    rc, out, _ = run(["explain", str(bench_run), "--request", rid], capsys)
    assert rc == 0 and out.startswith(f"{rid}:")
    rc, out, _ = run(["replay", str(bench_run)], capsys)
    assert rc == 0 and out.startswith("identical, ")
    rc, out, _ = run(["replay", str(bench_run), "--policy", "fcfs", "--chunk-size", "16"], capsys)
    assert rc == 0 and "policy=fcfs" in out and "chunk_size=16" in out and "TTFT p50" in out and "R^2" in out
    rc, out, _ = run(["replay", str(bench_run), "--num-pages", "30", "--json"], capsys)
    pred = json.loads(out)
    assert rc == 0 and pred["overrides"] == {"num_pages": 30} and pred["predicted"]["output_tok_s"] > 0


def test_generate_record_replays(tmp_path, capsys):
    path = tmp_path / "gen.json"
    rc, _, err = run(["generate", "a", "b", "c", "--max-new-tokens", "5", "--record", str(path), *TINY], capsys)
    assert rc == 0, err
    rc, out, _ = run(["replay", str(path)], capsys)
    assert rc == 0 and out.startswith("identical")
    rc, out, _ = run(["explain", str(path)], capsys)
    assert rc == 0 and out.count("-token prompt") == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "/no/such.json"], "no such file"),
        (["replay", "/no/such.json"], "no such file"),
        (["explain", "{run}", "--request", "nope"], "no request 'nope'"),
        (["explain", "{run}", "--slowest", "0"], "--slowest"),
        (["explain", "{run}", "--name", "other"], "no run named"),
        (["replay", "{run}", "--chunk-size", "-5"], "chunk"),
        (["explain", "{bad}"], "not a minisched run file"),
        (["replay", "{old}"], "no journal"),
    ],
)
def test_clear_errors(argv, message, bench_run, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    old = tmp_path / "old.json"
    doc = json.loads(bench_run.read_text())
    doc["runs"][0].pop("journal")
    old.write_text(json.dumps(doc))
    argv = [a.format(run=bench_run, bad=bad, old=old) for a in argv]
    rc, _, err = run(argv, capsys)
    assert rc == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
