"""benchmarks/sched/bench_rules.py, the rule-by-rule benchmark behind the default profile, on a small case:
it runs, its arms differ only in the option they name, and its verdicts read the numbers the right way round."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "sched" / "bench_rules.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_rules", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_rules"] = mod  # (dataclasses look the module up by name)
    spec.loader.exec_module(mod)
    return mod


def test_arms_switch_one_option_each():
    br = load()
    arms = dict(br.arms(list(br.RULES)))
    assert arms.pop("default") == {} and set(arms.pop("sglang profile")) == set(br.RULES)
    for label, fields in arms.items():
        name, who = label.split("=")
        assert list(fields) == [name] and fields[name] == br.RULES[name][("minisched", "sglang").index(who)]


def test_verdict_signs():
    br = load()
    ms = [{"ttft_p99": 10.0, "recomputed": 100, "ttft_p50": 1.0}] * 3
    worse = [{"ttft_p99": 12.0, "recomputed": 100, "ttft_p50": 1.0}] * 3
    better = [{"ttft_p99": 9.0, "recomputed": 200, "ttft_p50": 0.5}] * 3
    rule = "retraction_rule"  # default "minisched": the default arm is minisched's side
    v, wins, losses, other = br.verdict({"w": {"default": ms, f"{rule}=sglang": worse}}, rule, "minisched")
    assert v == "minisched wins" and wins == ["w ttft_p99 +20.0%"] and not losses
    v, wins, losses, other = br.verdict({"w": {"default": ms, f"{rule}=sglang": better}}, rule, "minisched")
    assert v.startswith("mixed (1 wins, 1 losses)") and other == ["w ttft_p50 -50.0%"]
    # a change below MATERIAL, or not in the same direction in enough seeds, is no difference
    noisy = [{"ttft_p99": x, "recomputed": 100, "ttft_p50": 1.0} for x in (13.0, 8.0, 9.5)]
    assert br.verdict({"w": {"default": ms, f"{rule}=sglang": noisy}}, rule, "minisched")[0] == "no difference"


def test_a_small_run(tmp_path):
    out = tmp_path / "rules.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "arrivals", "--rules", "max_prefill_rounds_between_decodes,chunk_rule"]
        + ["--seeds", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    saved = json.loads(out.read_text())
    runs = saved["results"]["arrivals"]
    assert set(runs) == {
        "default",
        "max_prefill_rounds_between_decodes=minisched",
        "chunk_rule=sglang",
        "sglang profile",
    }
    assert all(r[0]["finished"] == r[0]["requests"] for r in runs.values())
    # alternating rounds bound a running request's wait; prefill first (the default) does not
    assert runs["max_prefill_rounds_between_decodes=minisched"][0]["itl_p99"] < runs["default"][0]["itl_p99"]
    tiny = saved["results"]["tiny-pools"]
    assert tiny["default"][0]["stalled"] == 0 < tiny["chunk_rule=sglang"][0]["stalled"]
    assert saved["verdicts"]["chunk_rule"]["verdict"] == "minisched wins"
    assert (tmp_path / "rules.md").read_text().count("| arrivals |") == 4
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--rules", "nope"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert bad.returncode == 2 and "unknown" in bad.stderr
