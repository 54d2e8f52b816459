#!/usr/bin/env bash
# One-shot GPU check for the H200 test machine (docs: benchmarks/README.md, "On the H200"). It builds the
# extension there, runs the GPU tests, compute-sanitizer on tiny cases, the kernel benchmarks against
# torch's own attention and the measured copy bandwidth / matmul rate, and a short end-to-end run; then
# prints a summary LAST. Shaped by that machine's limits: 15 minutes of device time per session in all
# (start-up included), at most 8 files back from the output folder, the last 12,000 characters of output.
#
#   usage: benchmarks/device_check.sh OUTDIR
#
# OUTDIR gets at most 4 files: summary.txt (<= 8,000 characters, most important first: stages, failing
# tests, one row per target), results.json (the same, machine-readable), device_check.tar.gz (every log,
# junit file and per-stage JSON) and, after a build, the extension (minisched/ops/_C*.so) so that a later
# session can carry it and skip the build. Working files live in WORK (default: a new folder under /tmp).
#
# Stages, in this order (what has never been measured first, FlexAttention last and optional):
#   build, res_usage, tests_wgmma, bench_wgmma, tests, sanitize_memcheck, sanitize_racecheck, bench, e2e,
#   cuda_graph, flex
# Each stage is timed and bounded by `timeout -s INT -k GRACE` (SIGINT: pytest still writes its summary
# and junit file) and cut so that the stages after it keep MIN_STAGE seconds each of BUDGET; a stage that
# would get less than MIN_RUN is skipped. A failing stage is recorded and the later stages still run.
# Worst case: BUDGET + GRACE + a few seconds for the summary (default 390 + 15 + ~10: under 7 minutes).
#
# Rerun (docs in benchmarks/README.md): SKIP_BUILD=1 keeps the extension already in minisched/ops/ (built by an
# earlier run on a machine still warm, or carried back from an earlier run's OUTDIR); STAGES="a b" runs
# only those stages.
#
# Knobs: PYTHON (python3), CUDA_HOME (/usr/local/cuda when present), WORK, BUDGET (390), GRACE (15),
# MIN_STAGE (20), MIN_RUN (10), STAGES, SKIP_BUILD, FLEX (1; 0 skips), <STAGE>_TIMEOUT for each stage
# (e.g. TESTS_TIMEOUT), TEST_PATHS, WGMMA_TEST_PATHS (the tests_wgmma stage's files; -k wgmma), PYTEST_MARK
# ("not slow"), PYTEST_K (the tests stage's -k), PYTEST_ARGS (extra words, split on spaces), PYTEST_XDIST
# (8; 0: off), PER_TEST_TIMEOUT (60), MAXFAIL (30), BENCH_ARGS, E2E_ARGS, CG_ARGS, SAN_ARGS, RETURN_SO (1).
# SKIP_BUILD=1 BENCH_ARGS=--dry-run is a CPU smoke run.
set -u

OUT=${1:?usage: benchmarks/device_check.sh OUTDIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/device_check.XXXXXX")}
mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd) || exit 1

PY=${PYTHON:-python3}
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda
  elif command -v nvcc >/dev/null 2>&1; then CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); export CUDA_HOME
  fi
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-16}
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-390}
GRACE=${GRACE:-15}
MIN_STAGE=${MIN_STAGE:-20}
MIN_RUN=${MIN_RUN:-10}
ORDER="build res_usage tests_wgmma bench_wgmma tests sanitize_memcheck sanitize_racecheck bench e2e cuda_graph flex"
STAGES=${STAGES:-$ORDER}
[ "${FLEX:-1}" = 0 ] && STAGES=${STAGES//flex/}
# nominal limits (seconds); each is cut to fit the budget
declare -A LIMIT=([build]=150 [res_usage]=15 [tests_wgmma]=45 [bench_wgmma]=30 [tests]=90 [sanitize_memcheck]=45
                  [sanitize_racecheck]=45 [bench]=60 [e2e]=40 [cuda_graph]=40 [flex]=30)
for s in $ORDER; do
  v="${s^^}_TIMEOUT"
  [ -n "${!v:-}" ] && LIMIT[$s]=${!v}
done

STAGES_TSV="$WORK/stages.tsv"
printf "stage\tstatus\tseconds\tlimit\n" > "$STAGES_TSV"
SECONDS=0

selected() { [[ " $STAGES " == *" $1 "* ]]; }

# later_count NAME: how many selected stages come after NAME
later_count() {
  local n=0 seen=0 s
  for s in $ORDER; do
    if [ "$seen" = 1 ] && selected "$s"; then n=$((n + 1)); fi
    [ "$s" = "$1" ] && seen=1
  done
  echo "$n"
}

# stage_limit NAME: its nominal limit, or less so that every later stage keeps MIN_STAGE seconds
stage_limit() {
  local left=$(( BUDGET - SECONDS - GRACE - MIN_STAGE * $(later_count "$1") ))
  local lim=${LIMIT[$1]}
  if [ "$left" -lt "$lim" ]; then echo "$left"; else echo "$lim"; fi
}

skip_stage() { printf "%s\t%s\t0\t-\n" "$1" "$2" >> "$STAGES_TSV"; echo "== [$1] $2"; }

# run_stage NAME LOG CMD...: unless deselected or out of budget, run CMD under `timeout -s INT` (its output
# in LOG), record status and seconds, never abort the script.
run_stage() {
  local name=$1 log=$2; shift 2
  selected "$name" || return 0
  local limit t0 rc status
  limit=$(stage_limit "$name")
  if [ "$limit" -lt "$MIN_RUN" ]; then skip_stage "$name" "skipped(budget)"; return 0; fi
  t0=$SECONDS
  echo "== [$name] $(date -u +%H:%M:%S) limit ${limit}s"  # stdout stays short: the summary must fit the tail
  echo "== [$name] $(date -u +%H:%M:%S) limit ${limit}s: $*" >> "$log"
  timeout -s INT -k "$GRACE" "$limit" "$@" >> "$log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124) status="TIMEOUT(${limit}s)" ;;
    137) status="KILLED(${limit}s+${GRACE}s)" ;;
    *) status="FAILED(rc=$rc)" ;;
  esac
  printf "%s\t%s\t%s\t%s\n" "$name" "$status" "$((SECONDS - t0))" "$limit" >> "$STAGES_TSV"
  echo "== [$name] $status in $((SECONDS - t0))s" | tee -a "$log"
  return 0
}

# -- environment (the summary's header and results.json read env.txt) ------------------------------
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "host: $(hostname)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo n/a)$(git diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
  echo "work: $WORK"
  echo "CUDA_HOME: ${CUDA_HOME:-unset}"
  echo "nvcc: $("${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version 2>/dev/null | grep -o 'release [0-9.]*' || echo none)"
  echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader 2>/dev/null || echo none)"
} > "$WORK/env.txt" 2>&1

# -- 1. build (CUDA kernels for sm_90a; any spill fails the build) --------------------------------
BUILT=0
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  selected build && skip_stage build "skipped(SKIP_BUILD=1)"
else
  # an editable install (offline: no index, no build isolation) builds minisched/ops/_C in place and maps
  # minisched.triton_kernels to triton_kernels/, as `make build` does here
  run_stage build "$WORK/build.log" env MINISCHED_CUDA=1 "$PY" -m pip install --no-deps --no-build-isolation --no-index -e .
  grep -q "^build	ok" "$STAGES_TSV" && BUILT=1
fi
# one Python start for what the later stages need to know (each start imports torch: seconds)
"$PY" - >> "$WORK/env.txt" 2>&1 <<'EOF'
import importlib, os, sys, sysconfig
print("python:", sys.version.split()[0])
print("ext_suffix:", sysconfig.get_config_var("EXT_SUFFIX"))
try:
    import torch
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print("torch:", torch.__version__, "cuda", torch.version.cuda, "| device:", dev)
except Exception as exc:  # noqa: BLE001
    print("torch: does not import:", exc)
for name in ("triton", "xdist", "pytest_timeout", "fastapi", "uvicorn"):
    try:
        mod = importlib.import_module(name)
        print(f"{name}: yes {getattr(mod, '__version__', '')}".rstrip())
        if name == "triton":
            print("triton_dir:", os.path.dirname(mod.__file__))
    except Exception:  # noqa: BLE001
        print(f"{name}: no")
try:
    from minisched import ops
    print("native:", ops.native_available(), ops.NATIVE_ERROR or "")
    ops.triton_launchers()  # minisched.triton_kernels: triton_kernels/ of this tree
    print("triton_kernels: import ok")
except Exception as exc:  # noqa: BLE001
    print("minisched.triton_kernels does not import:", type(exc).__name__, exc)
EOF
has() { grep -q "^$1: yes" "$WORK/env.txt"; }

# -- tools: $CUDA_HOME first, Triton's bundled copies second, then PATH ----------------------------
TRITON_DIR=$(sed -n 's/^triton_dir: //p' "$WORK/env.txt")
find_tool() {
  local cand
  for cand in "${CUDA_HOME:-/usr/local/cuda}/bin/$1" "${TRITON_DIR:-/nonexistent}/backends/nvidia/bin/$1"; do
    if [ -x "$cand" ]; then echo "$cand"; return 0; fi
  done
  command -v "$1" 2>/dev/null || true
}
CUOBJDUMP=$(find_tool cuobjdump)
NVDISASM=$(find_tool nvdisasm)
SANITIZER=$(find_tool compute-sanitizer)
export CUOBJDUMP NVDISASM
printf "cuobjdump: %s\nnvdisasm: %s\ncompute-sanitizer: %s\n" "${CUOBJDUMP:-none}" "${NVDISASM:-none}" \
  "${SANITIZER:-none}" >> "$WORK/env.txt"
SO="minisched/ops/_C$(sed -n 's/^ext_suffix: //p' "$WORK/env.txt")"  # this Python's extension (one per version)
[ -f "$SO" ] || SO=""
if [ -n "$SO" ] && [ -n "$CUOBJDUMP" ]; then
  run_stage res_usage "$WORK/res_usage.txt" "$CUOBJDUMP" -res-usage "$SO"
elif selected res_usage; then
  skip_stage res_usage "skipped(no .so or cuobjdump)"
fi

# -- pytest: on the stage's SIGINT it stops, prints its summary and writes junit (KeyboardInterrupt; timeout
#    sets SIGINT to its default in the child even when this script was started with SIGINT ignored) ----------
PYTEST=("$PY" -m pytest)
read -r -a EXTRA <<< "${PYTEST_ARGS:-}"
COMMON=(-q -m "${PYTEST_MARK:-not slow}" --maxfail="${MAXFAIL:-30}" -p no:cacheprovider -rfE "${EXTRA[@]}")
XDIST=()
if [ "${PYTEST_XDIST:-8}" != 0 ] && has xdist; then XDIST=(-n "${PYTEST_XDIST:-8}"); fi
# per-test timeouts: pytest-timeout where installed (the device image has it; the thread method under
# xdist: a worker stuck in a CUDA call is replaced, and the test reported failed); without it,
# faulthandler dumps the stuck test's stack after PER_TEST_TIMEOUT and the stage's SIGINT ends it.
if has pytest_timeout; then
  TMO=(--timeout="${PER_TEST_TIMEOUT:-60}")
  [ ${#XDIST[@]} -gt 0 ] && TMO+=(--timeout-method=thread)
else
  TMO=(-o faulthandler_timeout="${PER_TEST_TIMEOUT:-60}")
fi
# The GPU cases: the kernels' CUDA/Triton variants and CUDA graphs. Not here: what CI runs already on the
# CPU (the numpy emulations of the CUDA kernels, the Triton AOT compile tests -- which also use Triton
# internals that differ between Triton 3.8 and the device's 3.6 --, the CPU-only ops packed_linear /
# int8_linear / rms_norm / silu_and_mul / rope, and the "-cpu-" variants of every op test).
read -r -a PATHS <<< "${TEST_PATHS:-tests/ops tests/engine/test_cuda_graph.py}"
DESELECT=(--ignore-glob='tests/ops/test_cuda_emulation*.py' --ignore=tests/ops/test_triton_compile.py
          --ignore=tests/ops/test_packed_linear.py --ignore=tests/ops/test_int8_linear.py
          --ignore=tests/ops/test_rms_norm.py --ignore=tests/ops/test_silu_and_mul.py --ignore=tests/ops/test_rope.py
          --continue-on-collection-errors)
{ has fastapi && has uvicorn; } || DESELECT+=(--ignore=tests/serve)  # not on the device image

# -- 2. the wgmma prefill kernel's tests, then its benchmark: never run on hardware, own processes
#       (a device fault would poison the CUDA context of everything after it in the same process) --
read -r -a WGMMA_PATHS <<< "${WGMMA_TEST_PATHS:-tests/ops/test_cuda_kernels.py tests/ops/test_cuda_build.py}"
run_stage tests_wgmma "$WORK/pytest_wgmma.log" env OMP_NUM_THREADS=2 "${PYTEST[@]}" "${WGMMA_PATHS[@]}" -k wgmma \
  "${COMMON[@]}" "${XDIST[@]}" "${TMO[@]}" --junitxml="$WORK/junit_tests_wgmma.xml"
read -r -a BENCH_EXTRA <<< "${BENCH_ARGS:-}"
BENCH=("$PY" benchmarks/kernels/bench_kernels_gpu.py "${BENCH_EXTRA[@]}")
run_stage bench_wgmma "$WORK/bench_wgmma.log" "${BENCH[@]}" --only wgmma --json "$WORK/bench_wgmma.json"

# -- 3. the GPU tests -----------------------------------------------------------------------------
run_stage tests "$WORK/pytest.log" env OMP_NUM_THREADS=2 "${PYTEST[@]}" "${PATHS[@]}" "${DESELECT[@]}" \
  -k "${PYTEST_K:-not -cpu- and not wgmma}" "${COMMON[@]}" "${XDIST[@]}" "${TMO[@]}" --junitxml="$WORK/junit_tests.xml"

# -- 4. compute-sanitizer: one tiny case per kernel configuration, once under each tool -------------
read -r -a SAN_EXTRA <<< "${SAN_ARGS:-}"
SAN_CASES=("$PY" benchmarks/kernels/sanitize_cases.py)
grep -q "| device: none" "$WORK/env.txt" && SAN_CASES+=(--device cpu)  # a CPU smoke run: the C++ kernels
for tool in memcheck racecheck; do
  if [ -z "$SANITIZER" ]; then
    selected "sanitize_$tool" && skip_stage "sanitize_$tool" "skipped(no compute-sanitizer)"
    continue
  fi
  # every tensor its own cudaMalloc: an access past a tensor's end is not inside a neighbour in the cache
  run_stage "sanitize_$tool" "$WORK/sanitize_$tool.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    "$SANITIZER" --tool "$tool" --error-exitcode 9 --print-limit 20 "${SAN_EXTRA[@]}" "${SAN_CASES[@]}"
done

# -- 5. the kernel benchmarks (no FlexAttention: last stage) --------------------------------------
run_stage bench "$WORK/bench.log" "${BENCH[@]}" --no-flex --only roof,copy,decode,prefill,cascade,merge \
  --json "$WORK/bench.json"

# -- 6. a short end-to-end benchmark on dummy weights (CUDA graphs on: the CUDA default) --------------
read -r -a E2E <<< "${E2E_ARGS:-bench --model dummy:llama3-1b --device cuda --dtype bfloat16 --backend native --num-requests 64 --scale 0.25 --no-progress}"
run_stage e2e "$WORK/e2e.log" "$PY" -m minisched "${E2E[@]}" --json "$WORK/e2e.json"

# -- 7. decode with and without CUDA graphs (one process, interleaved) ------------------------------
read -r -a CG <<< "${CG_ARGS:-}"
run_stage cuda_graph "$WORK/cuda_graph.log" "$PY" benchmarks/serving/bench_cuda_graph.py --json "$WORK/cuda_graph.json" "${CG[@]}"

# -- 8. FlexAttention (torch.compile: slow to start; a torch path, not ours): last, optional ---------
run_stage flex "$WORK/bench_flex.log" "${BENCH[@]}" --only flex --json "$WORK/bench_flex.json"

# -- summary (printed last), results.json, one tarball of the rest ---------------------------------
"$PY" benchmarks/kernels/bench_kernels_gpu.py --merge "$WORK"/bench_wgmma.json "$WORK"/bench.json \
  "$WORK"/bench_flex.json --json "$WORK/bench_all.json" > "$WORK/bench_all.log" 2>&1
"$PY" benchmarks/device_check_summary.py "$WORK" "$OUT" --budget "$BUDGET" --seconds "$SECONDS" \
  > "$WORK/summary.log" 2>&1 || echo "device_check_summary failed: see summary.log in the tarball" > "$OUT/summary.txt"
cp "$OUT/summary.txt" "$OUT/results.json" "$WORK/" 2>/dev/null
# a log over 4 MB keeps its first 1 MB and last 3 MB (the files that come back are at most 16 MiB)
find "$WORK" -type f -size +4M | while read -r f; do
  { head -c 1000000 "$f"; printf '\n[... cut by device_check.sh ...]\n'; tail -c 3000000 "$f"; } > "$f.cut" && mv "$f.cut" "$f"
done
tar -czf "$OUT/device_check.tar.gz" -C "$WORK" . 2>/dev/null
if [ "$BUILT" = 1 ] && [ "${RETURN_SO:-1}" = 1 ] && [ -n "$SO" ] && [ "$(stat -c %s "$SO")" -lt 15000000 ]; then
  cp "$SO" "$OUT/"  # carry it back with SKIP_BUILD=1 (benchmarks/README.md)
fi
cat "$OUT/summary.txt"
exit 0
