"""The command line as a new user meets it: one-line errors (exit 2) for bad files, fields and paths;
per-request errors labelled by position or JSONL id (exit 1); readable streaming; progress; the
version and help; `minisched chat`; Ctrl-C during `bench` keeps the partial run."""

from __future__ import annotations

import json
import struct

import pytest

from minisched.cli import main
from minisched.model.weights import ModelNotFound, default_gguf_path

TINY = ["--model", "dummy:tiny"]


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(rc, err, rc_expected=2):
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == rc_expected and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("minisched ")
    for cmd in ("generate", "bench", "chat"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = capsys.readouterr().out
        # every option has a meaning, and defaults are shown
        assert "(default: 16)" in out and "(default: fcfs)" in out and "tokens per KV page" in out


@pytest.fixture(scope="module")
def real_gguf() -> str:
    try:
        return default_gguf_path()
    except ModelNotFound as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("empty", "empty or truncated"),
        ("header", "truncated or corrupt GGUF header"),
        ("tensors", "truncated GGUF file"),
        ("strings", "truncated or corrupt GGUF file"),
        ("text", "not a GGUF"),
    ],
)
def test_broken_gguf_files(tmp_path, real_gguf, capsys, kind, needle):
    raw = open(real_gguf, "rb").read(3_000_000)
    path = tmp_path / f"{kind}.gguf"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "header":
        path.write_bytes(raw[:100])
    elif kind == "tensors":
        path.write_bytes(raw)  # the header is whole, the tensor data is cut
    elif kind == "strings":  # a metadata string length that runs past the end
        path.write_bytes(raw[:24] + struct.pack("<Q", 2**62) + raw[32:4096])
    else:
        path.write_bytes(b"hello, I am not a model at all\n" * 4)
    rc, _, err = run(["generate", "x", "--model", str(path)], capsys)
    line = one_line_error(rc, err)
    assert str(path) in line and needle in line


def test_directory_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hi")
    rc, _, err = run(["generate", "x", "--model", str(tmp_path)], capsys)
    assert str(tmp_path) in one_line_error(rc, err)
    (tmp_path / "config.json").write_text('{"vocab_size": 5}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    rc, _, err = run(["generate", "x", "--model", str(tmp_path)], capsys)
    assert str(tmp_path) in one_line_error(rc, err)


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"prompt": "x", "stop": 5}', "'stop' must be a string or a list of strings"),
        ('{"prompt": 42}', "'prompt' must be a string or a list of token ids"),
        ('{"messages": "hello"}', "'messages' must be a list"),
        ('{"prompt": "x", "max_new_tokens": "10"}', "max_new_tokens"),
        ('{"prompt": "x", "temperature": "hot"}', "temperature"),
        ('{"prompt": [1, true]}', "'prompt' must be"),
    ],
)
def test_jsonl_field_types_name_file_and_line(tmp_path, capsys, line, needle):
    f = tmp_path / "p.jsonl"
    f.write_text('"fine"\n\n' + line + "\n")
    rc, _, err = run(["generate", "--file", str(f), *TINY], capsys)
    msg = one_line_error(rc, err)
    assert f"{f}:3" in msg and needle in msg


def test_request_errors_are_labelled_and_ids_echoed(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "alpha", "prompt": [5, 6]}\n{"id": "beta", "prompt": [5, 99999999]}\n{"prompt": ""}\n')
    rc, out, err = run(["generate", "--file", str(f), "--json", "--max-new-tokens", "2", *TINY], capsys)
    recs = [json.loads(x) for x in out.splitlines()]
    assert rc == 1 and [r.get("id") for r in recs] == ["alpha", "beta", None]
    assert recs[0]["finish_reason"] == "max_new_tokens" and len(recs[0]["token_ids"]) == 2
    errs = err.strip().splitlines()
    assert errs[0].startswith("minisched: request id='beta': ") and "token 99999999 at position 1" in errs[0]
    assert errs[1].startswith("minisched: request prompt 2: ") and "empty prompt" in errs[1]


@pytest.mark.parametrize("flag, path", [("--json", "nodir/run.json"), ("--trace", "nodir/t.json"), ("--json", ".")])
def test_bench_checks_output_paths_before_running(capsys, flag, path):
    rc, out, err = run(["bench", "--num-requests", "2", "--scale", "0.05", flag, path, *TINY], capsys)
    assert path in one_line_error(rc, err) and "TTFT" not in out  # nothing ran


def test_report_formats_and_bad_paths(tmp_path, capsys):
    run_json = tmp_path / "run.json"
    rc, _, _ = run(
        [
            "bench",
            "--num-requests",
            "3",
            "--rate",
            "0",
            "--scale",
            "0.05",
            "--json",
            str(run_json),
            "--no-progress",
            *TINY,
        ],
        capsys,
    )
    assert rc == 0
    heads = {"svg": b"<?xml", "pdf": b"%PDF", "png": b"\x89PNG"}
    for ext, head in heads.items():
        out = tmp_path / f"r.{ext}"
        assert main(["report", str(run_json), "-o", str(out)]) == 0
        assert out.read_bytes().startswith(head)
    capsys.readouterr()
    for argv, needle in (
        (["-o", str(tmp_path / "r.jpeg")], "unknown picture format"),
        (["-o", str(tmp_path / "no" / "r.png")], "does not exist"),
        (["--html", str(tmp_path)], "is a directory"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["report", str(run_json), *argv])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_bench_ctrl_c_keeps_the_partial_run(tmp_path, capsys, monkeypatch):
    import minisched.sched.scheduler as sched_mod

    real_sched_step, calls = sched_mod.Scheduler.step, [0]

    def step(self, runner):
        calls[0] += 1
        if calls[0] == 12:
            raise KeyboardInterrupt
        return real_sched_step(self, runner)

    monkeypatch.setattr(sched_mod.Scheduler, "step", step)
    out_json = tmp_path / "partial.json"
    rc, out, err = run(
        [
            "bench",
            "--num-requests",
            "6",
            "--rate",
            "0",
            "--scale",
            "0.1",
            "--json",
            str(out_json),
            "--no-progress",
            *TINY,
        ],
        capsys,
    )
    assert rc == 130 and "interrupted: partial" in out
    data = json.loads(out_json.read_text())
    assert data["runs"][0]["config"]["interrupted"] is True
    assert data["runs"][0]["summary"]["completed"] < 6


def test_backend_triton_without_gpu_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc, _, err = run(["generate", "x", "--backend", "triton", *TINY], capsys)
    assert "CUDA" in one_line_error(rc, err)


def test_quantize_with_tp_is_one_line(capsys):
    rc, _, err = run(["generate", "x", *TINY, "--quantize", "int8", "--tp", "2"], capsys)
    assert "--quantize with --tp" in one_line_error(rc, err)


def test_quantize_int8_generates(capsys):
    rc, out, err = run(["generate", "hello", *TINY, "--quantize", "int8", "--max-new-tokens", "4"], capsys)
    assert rc == 0 and out.strip(), err


def test_stream_several_prompts_is_readable(capsys):
    rc, out, _ = run(["generate", "ab", "cd", "--stream", "--max-new-tokens", "12", *TINY], capsys)
    lines = out.splitlines()
    assert rc == 0 and lines and all(x.startswith(("[0] ", "[1] ")) for x in lines)
    assert len(lines) < 2 * 12  # not a line per token
    rc, plain, _ = run(["generate", "ab", "cd", "--json", "--max-new-tokens", "12", *TINY], capsys)
    texts = [json.loads(x)["text"] for x in plain.splitlines()]
    got = {0: [], 1: []}
    for x in lines:
        got[int(x[1])].append(x[4:].replace("  [stopped: length]", ""))
    assert ["\n".join(got[i]) for i in (0, 1)] == texts


def test_stream_json_lines(capsys):
    rc, out, _ = run(["generate", "ab", "cd", "--stream", "--json", "--max-new-tokens", "5", *TINY], capsys)
    recs = [json.loads(x) for x in out.splitlines()]
    finals = [r for r in recs if r.get("finished")]
    assert rc == 0 and len(finals) == 2 and all(len(r["token_ids"]) == 5 for r in finals)
    for i in (0, 1):
        assert "".join(r["delta"] for r in recs if r["index"] == i) == finals[i]["text"]


def test_plain_text_says_length_stop(capsys):
    rc, _, err = run(["generate", "ab", "--max-new-tokens", "3", *TINY], capsys)
    assert rc == 0 and "stopped at the length limit" in err


def test_chat_reuses_the_conversation(capsys, monkeypatch):
    import io

    from minisched.cli import build_parser
    from minisched.cli.chat import cmd_chat

    lines = iter(["hello there", "and again", "/reset", "hello there", "/exit"])
    out = io.StringIO()
    args = build_parser().parse_args(["chat", "--max-new-tokens", "20", "--page-size", "4", *TINY])
    assert cmd_chat(args, read=lambda prompt: next(lines), out=out) == 0
    stats = [x for x in out.getvalue().splitlines() if "prompt tokens from the cache" in x]
    cached = [int(x.split("[")[1].split("/")[0]) for x in stats]
    assert len(cached) == 3 and cached[0] == 0
    assert cached[1] >= 20  # the second turn reuses the first turn's prompt and reply
    assert cached[2] > 0  # after /reset the same first turn is still in the radix cache


def test_bench_summary_and_report_agree_on_latencies(tmp_path, capsys):
    """Both count from each request's scheduled arrival and use one percentile definition."""
    from minisched.observe.run_record import derived_summary, load_runs

    run_json = tmp_path / "run.json"
    rc, _, _ = run(
        [
            "bench",
            "--workload",
            "poisson",
            "--num-requests",
            "8",
            "--rate",
            "40",
            "--scale",
            "0.1",
            "--json",
            str(run_json),
            "--no-progress",
            *TINY,
        ],
        capsys,
    )
    assert rc == 0
    rec = load_runs(run_json)[0]
    derived = derived_summary(rec)
    for q in (50, 90, 99):
        assert derived[f"TTFT p{q} (s)"] == pytest.approx(rec.summary["ttft_s"][f"p{q}"], abs=2e-3)
        assert derived[f"e2e p{q} (s)"] == pytest.approx(rec.summary["e2e_latency_s"][f"p{q}"], abs=2e-3)
    arrivals = sorted(r["arrival"] for r in rec.requests)
    assert arrivals[-1] > arrivals[0]  # scheduled Poisson arrivals, not the admission times of one step
