"""benchmarks/cpu/bench_ab.py, the paired comparison of two checkouts, runs end to end on a tiny model:
both worker processes start from their checkout, answer every pair, and the JSON holds the per-pair
times and their ratio (here a checkout against itself)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_checkout_against_itself(tmp_path):
    out = tmp_path / "ab.json"
    argv = ["--a", str(ROOT), "--b", str(ROOT), "--model", "dummy:tiny", "--tokens", "8", "--pairs", "3"]
    argv += ["--pause", "0", "--threads", "1", "--json", str(out)]
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu" / "bench_ab.py"), *argv],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert len(d["seconds"]["a"]) == len(d["seconds"]["b"]) == 3
    assert all(s > 0 for s in d["seconds"]["a"] + d["seconds"]["b"])
    assert d["ratio_q1"] <= d["ratio_a_over_b_median"] <= d["ratio_q3"]
    assert d["engines"]["a"].startswith("none ")  # the resolved --quantize, then the CPU kernels' line
    assert "A/B per pair median" in r.stdout.splitlines()[-1]
