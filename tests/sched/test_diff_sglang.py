"""The differential harness against SGLang 0.5.23 (benchmarks/sched/diff_sglang.py) on a small trace set.

Runs only where the SGLang environment exists (`make sglang-env`, or MINISCHED_SGLANG_PYTHON naming its
python); skips with one line otherwise.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HARNESS = ROOT / "benchmarks" / "sched" / "diff_sglang.py"
DEFAULT_PY = pathlib.Path.home() / ".cache" / "minisched" / "sglang-venv" / "bin" / "python"
SGLANG_PY = pathlib.Path(os.environ.get("MINISCHED_SGLANG_PYTHON", DEFAULT_PY))

pytestmark = pytest.mark.skipif(
    not SGLANG_PY.exists(), reason=f"no SGLang environment at {SGLANG_PY} (make sglang-env, or MINISCHED_SGLANG_PYTHON)"
)

TRACES = 5  # per policy x page size: 40 traces


def run_harness(tmp_path, *args) -> tuple[dict, str]:
    out = tmp_path / "summary.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [str(SGLANG_PY), str(HARNESS), "--traces", str(TRACES), "--json", str(out), "--show", "0", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.timeout(300)
def test_harness_runs_and_reports(tmp_path):
    summary, stdout = run_harness(tmp_path)
    assert summary["traces"] == TRACES * 8
    assert len(summary["cells"]) == 8 and all(c["traces"] == TRACES for c in summary["cells"].values())
    assert summary["steps"] > summary["traces"]  # traces ran for many steps, not just one
    assert sum(summary["kinds"].values()) == summary["differ"]
    assert "crash" not in summary["kinds"], stdout[-3000:]
    assert f"{summary['traces']} traces" in stdout


def test_harness_rejects_bad_options(tmp_path):
    proc = subprocess.run(
        [str(SGLANG_PY), str(HARNESS), "--traces", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 2 and "--traces" in proc.stderr


@pytest.mark.timeout(300)
def test_sglang_profile_makes_every_decision_as_sglang(tmp_path):
    """Under the sglang preset no step of any trace differs (all four policies, page sizes 1 and 16); the
    default differs on some (it keeps its own rules)."""
    sglang, stdout = run_harness(tmp_path, "--profile", "sglang", "--seed", "3")
    assert sglang["traces"] == TRACES * 8 and sglang["steps"] > sglang["traces"]
    assert sglang["differ"] == 0, stdout[-4000:]
    default, _ = run_harness(tmp_path, "--seed", "3")
    assert default["differ"] > 0
