"""The `minisched` command line on the tiny random model (in-process `main(argv)`), plus one
`python -m minisched` subprocess and one real-model run (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from minisched.cli import main
from minisched.observe import workloads as bw

TINY = ["--model", "dummy:tiny"]


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_text_and_json(capsys):
    rc, out, _ = run(["generate", "hello", "world", "--max-new-tokens", "4", *TINY], capsys)
    assert rc == 0 and out.count("=== [") == 2
    rc, out, _ = run(["generate", "hello", "--max-new-tokens", "4", "--json", *TINY], capsys)
    rec = json.loads(out)
    assert rc == 0 and len(rec["token_ids"]) == 4 and rec["finish_reason"] == "max_new_tokens"


def test_generate_stream_equals_plain(capsys):
    _, plain, _ = run(["generate", "abc", "--max-new-tokens", "6", *TINY], capsys)
    rc, streamed, _ = run(["generate", "abc", "--max-new-tokens", "6", "--stream", *TINY], capsys)
    assert rc == 0 and streamed == plain


def test_generate_file_and_bad_lines(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text(
        '"plain text"\n{"prompt": [5, 6, 7], "max_new_tokens": 2}\n'
        '{"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "seed": 1}\n'
        '{"prompt": ""}\n'
    )
    rc, out, err = run(["generate", "--file", str(f), "--json", "--max-new-tokens", "3", *TINY], capsys)
    recs = [json.loads(line) for line in out.splitlines()]
    assert rc == 1 and len(recs) == 4  # the empty prompt fails, the others run
    assert [len(r.get("token_ids", [])) for r in recs] == [3, 2, 3, 0]
    assert "empty prompt" in recs[3]["error"] and "empty prompt" in err
    f.write_text('{"prompt": "x", "bogus": 1}\n')
    rc, _, err = run(["generate", "--file", str(f), *TINY], capsys)
    assert rc == 2 and "unknown fields" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "x", "--model", "/no/such.gguf"], "model not found"),
        (["generate", "x", "--num-pages", "1", *TINY], "at least 2 pages"),
        (["generate", "x", "--num-pages", str(10**9), *TINY], "GiB"),
        (["generate", "x", "--top-p", "0", *TINY], "top_p"),
        (["generate", *TINY], "no prompts"),
        (["bench", "--num-requests", "0", *TINY], "num-requests"),
    ],
)
def test_clear_errors(argv, message, capsys):
    rc, _, err = run(argv, capsys)
    assert rc == 2 and message in err and "Traceback" not in err


def test_bench_compare_static_writes_run_records(tmp_path, capsys):
    out = tmp_path / "run.json"
    rc, text, _ = run(
        [
            "bench",
            "--workload",
            "mixed",
            "--num-requests",
            "6",
            "--rate",
            "0",
            "--scale",
            "0.05",
            "--compare",
            "static",
            "--static-batch",
            "2",
            "--json",
            str(out),
            "--no-progress",
            *TINY,
        ],
        capsys,
    )
    assert rc == 0 and "continuous vs static" in text and "TTFT" in text
    data = json.loads(out.read_text())
    assert data["version"] == 1 and [r["name"] for r in data["runs"]] == ["continuous", "static"]
    run0 = data["runs"][0]
    assert run0["summary"]["completed"] == 6 and run0["summary"]["output_tok_s"] > 0
    assert {"events", "step_stats", "requests", "config"} <= set(run0)
    assert [r["config"]["quantize"] for r in data["runs"]] == ["none", "none"]  # resolved: auto on dummy weights
    assert {e["dst"] for e in run0["events"]} >= {"waiting", "prefilling", "finished"}
    static_sizes = {s["batch_size"] for s in data["runs"][1]["step_stats"]}
    assert max(static_sizes) <= 2


def test_workloads():
    for name in bw.WORKLOADS:
        w = bw.make_workload(name, 12, 5.0, seed=1)
        assert len(w) == 12 and all(r.prompt_ids and r.max_new_tokens >= 1 for r in w)
        assert [r.arrival for r in w] == sorted(r.arrival for r in w)
    mixed = bw.make_workload("mixed", 200, 1.0)
    assert 16 <= min(r.max_new_tokens for r in mixed) and max(r.max_new_tokens for r in mixed) <= 256
    shared = bw.make_workload("shared-prefix", 8, 0)
    assert shared[0].prompt_ids[:300] == shared[4].prompt_ids[:300] and all(r.arrival == 0 for r in shared)
    with pytest.raises(ValueError, match="unknown workload"):
        bw.make_workload("nope", 1, 1)


def test_python_dash_m_entry_point():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(
        [sys.executable, "-m", "minisched", "generate", "hi", "--max-new-tokens", "2", *TINY],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "minisched", "bench", "--workload", "warp"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 2 and "invalid choice" in p.stderr


@pytest.mark.slow
def test_generate_smollm2_chat(capsys):
    pytest.importorskip("gguf")
    from minisched.model.weights import ModelNotFound, default_gguf_path

    try:
        default_gguf_path()
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    rc, out, _ = run(["generate", "What is the capital of France?", "--chat", "--max-new-tokens", "12"], capsys)
    assert rc == 0 and "Paris" in out
