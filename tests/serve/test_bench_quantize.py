"""The serving benchmarks that build an engine by name name the weights' format it resolved (`--quantize
auto`, the default: gguf for SmolLM2) in their JSON and their printed header, as bench_serving and
bench_peers do; each runs here once, tiny (dummy weights, a few tokens)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# script -> its arguments for a run of a second or two
RUNS = {
    "bench_overlap": "--batch 1 --rounds 1 --prompt-len 8 --new-tokens 4 --threads 1",
    "bench_spec": "--batch 1 --rounds 1 --new-tokens 4 --num-draft-tokens 2 --workload chat --threads 1",
    "bench_priority": "--steps 20 --warmup 5 --rounds 1 --threads 1",
    "bench_kv_tier": "--convs 2 --turns 1 --rounds 1",
}


def quantize_fields(obj) -> list:
    if isinstance(obj, dict):
        return [v for k, v in obj.items() if k == "quantize"] + [x for v in obj.values() for x in quantize_fields(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in quantize_fields(v)]
    return []


@pytest.mark.parametrize("name", RUNS)
def test_bench_names_the_resolved_quantize_mode(name, tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "serving" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", [name, "--model", "dummy:tiny", *RUNS[name].split(), "--json", str(out)])
    mod.main()
    assert "dummy:tiny: quantize none," in capsys.readouterr().out  # dummy weights: auto resolves to none
    fields = quantize_fields(json.loads(out.read_text()))
    assert fields and set(fields) == {"none"}
