"""The soak's short form: benchmarks/serving/bench_soak.py's main for two minutes against a real
`minisched serve` (SmolLM2; priority scheduling, ngram drafts, a host KV tier), mixed traffic with
hang-ups, one SIGKILL and one SIGSTOP of the engine process. Asserted: failures only at the faults,
both recovered, RSS growth bounded, nothing but evictable radix-cache pages held at idle, no process
left behind. The long form (30 min) and its figures: benchmarks/RESULTS.md, "Serving > Soak"."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
]  # 120 s of traffic (240 at most) + the server's start and drain


def bench_soak():
    spec = importlib.util.spec_from_file_location("bench_soak", ROOT / "benchmarks" / "serving" / "bench_soak.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_soak"] = mod  # its dataclasses look their module up while they are built
    spec.loader.exec_module(mod)
    return mod


def test_two_minutes_of_mixed_traffic_with_a_kill_and_a_stop(tmp_path):
    try:
        from minisched.model.weights import default_gguf_path

        default_gguf_path()
    except Exception as exc:  # the model package is part of the dev setup (make test installs it)
        pytest.skip(f"SmolLM2 not available: {exc}")
    out = tmp_path / "soak.json"
    argv = "--duration 120 --window 30 --warmup 25 --fault-every 45 --faults kill,stop --min-faults 2 --clients 3"
    # the server's RSS reference is taken at 25 s, still in its warm-up (+4 % by the end of two minutes, where the
    # 25-minute run stays within +0.3 % after its 60 s warm-up: RESULTS.md): 10 % here
    argv += " --max-rss-growth 0.10"
    argv += f" --settle 15 --rss-every 2 --recovery-timeout 120 --request-timeout 60 --json {out} --log {tmp_path / 'server.log'}"
    rc = bench_soak().main(argv.split())
    s = json.loads(out.read_text())
    print("\n" + out.with_suffix(".md").read_text())
    assert [f["kind"] for f in s["faults"]] == ["kill", "stop"], s["faults"]
    for f in s["faults"]:  # both ends restarted the engine (SIGSTOP held past the heartbeat timeout)
        assert f["restarted"] and f["new_pid"] != f["pid"] and f["recovered_s"] < 120, f
    assert s["failed_outside_faults"] == 0, s["failed_outside_examples"]
    # served before, between and after the faults (a few on a busy 2-core machine, where a restart takes ~45 s)
    assert s["served"] >= 5 and s["bad_json"] == 0 and s["other_4xx"] == 0
    assert s["windows"][-1]["requests"] > s["windows"][-1]["failed"], s["windows"]
    assert s["idle"]["idle"] and s["idle"]["pages_held_by_requests"] == 0, s["idle"]
    assert s["rss_server"]["growth"] <= 0.10, s["rss_server"]
    # the engine restarts twice in two minutes: its growth is measured when an incarnation lived long enough
    assert s["rss_engine"] is None or s["rss_engine"]["growth"] <= 0.05, s["rss_engine"]
    assert not s["leftover_procs"]
    others = [v for v in s["violations"] if not v.startswith("rss_engine: too few samples")]
    assert not others, s["violations"]
    assert rc == (1 if s["violations"] else 0)


def test_engine_growth_is_measured_within_each_incarnation():
    """A restarted engine is a fresh process: its size against the one before it is not growth (that
    comparison made the two-minute soak flaky). Growth inside any incarnation is still caught."""
    soak = bench_soak()
    args = type("A", (), {"settle": 4.0, "warmup": 10.0, "window": 30.0, "rss_every": 2.0})()
    flat = [(float(t), 101, 1_700_000) for t in range(0, 60, 2)] + [
        (float(t), 202, 1_950_000) for t in range(60, 120, 2)
    ]
    g = soak.engine_growth(flat, args)
    assert g is not None and g["growth"] == 0.0, g
    leaking = flat[:30] + [(float(t), 202, 1_950_000 + 10_000 * (t - 60)) for t in range(60, 120, 2)]
    g = soak.engine_growth(leaking, args)
    assert g is not None and g["growth"] > 0.05, g  # the soak's limit
    assert soak.engine_growth([(float(t), 303, 1_000_000) for t in range(0, 14, 2)], args) is None  # too short
