#!/usr/bin/env bash
# The device run: the GPU conformance check, then the quick benchmarks, under one hard timeout.
#
#   devices/run.sh                  # writes everything under ./bench-results
#   OUT=/some/dir devices/run.sh    # or under $OUT
#
# Runs from the repository root with PYTHONPATH=. (aioreplica from this checkout, before any
# PYTHONPATH given) and installs nothing: the Python is $PYTHON, else .venv/bin/python when
# present, else python3. Needs only numpy, anyio and CuPy (no trio, no pytest-asyncio, no git
# checkout: without one, environment.txt says so). Writes under $OUT: check_gpu.log,
# bench_collectives.{log,json}, bench_scheduler.{log,json}, environment.txt, and summary.txt
# (one line per step: its name, exit status and seconds).
#
# Time. Each step has its own limit, so a hanging step cannot starve the others:
#   check_gpu          240 s  (the smoke test's 10 s, at most 3 layouts of 60 s each on one loop,
#                              asyncio: 190 s, plus 50 s to import CuPy and compile kernels)
#   bench_collectives   90 s  (--quick: about 30 s on a 2-core host, part C on the GPU included)
#   bench_scheduler     60 s  (--quick: under a minute)
#   sum                390 s
# The whole script stops after AIOREPLICA_RUN_TIMEOUT seconds (default 420: the 390 s of the
# steps plus 30 s for the environment report and the shell), so it always writes its summary
# unless a step overruns its own limit. A step that runs out of time exits 124.
#
# AIOREPLICA_RUN_QUICK=1 shortens every step, to try the script itself (against the CPU stand-in
# of CuPy, PYTHONPATH=tests/cupy_sim, it then takes seconds): check_gpu --quick (16 x 16
# matrices), bench_collectives on 2 replicas and 1 MiB with one sample, bench_scheduler on 2 and
# 8 replicas with one sample. The limits stay as above.
#
# Exit status: the GPU check's when it failed (1: a check failed, 2: no CuPy or no CUDA
# device, 124: timed out); else 3 when a benchmark crashed or timed out; else 0.
set -uo pipefail

if [[ -z "${AIOREPLICA_RUN_UNDER_TIMEOUT:-}" ]]; then
    export AIOREPLICA_RUN_UNDER_TIMEOUT=1
    exec timeout --kill-after=10 "${AIOREPLICA_RUN_TIMEOUT:-420}" bash "$0" "$@"
fi

cd "$(dirname "$0")/.."
OUT="${OUT:-bench-results}"
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
else
    py=python3
fi

check_args=(--loop asyncio --layout-timeout 60)
collectives_args=(--quick)
scheduler_args=(--quick)
if [[ "${AIOREPLICA_RUN_QUICK:-0}" == 1 ]]; then
    check_args+=(--quick)
    collectives_args+=(--n 2 --sizes 1 --samples 1)
    scheduler_args+=(--n 2,8 --samples 1)
fi

summary="$OUT/summary.txt"
: >"$summary"

# step NAME SECONDS COMMAND...: run COMMAND with a time limit, its output to the terminal and
# to $OUT/NAME.log; record its exit status and duration in the summary; return the status.
step() {
    local name="$1" limit="$2"
    shift 2
    local started status
    started=$(date +%s)
    echo "== $name (limit ${limit} s): $*"
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    status=${PIPESTATUS[0]}
    echo "$name exit=$status seconds=$(($(date +%s) - started))" | tee -a "$summary"
    return "$status"
}

# The checkout: its commit and whether it has local changes, or that it is not a git checkout
# (a copied tree, or no git installed).
revision() {
    local commit
    if ! commit=$(git rev-parse HEAD 2>/dev/null); then
        echo "unknown (not a git checkout)"
    elif git diff --quiet HEAD -- 2>/dev/null; then
        echo "$commit"
    else
        echo "$commit (with local changes)"
    fi
}

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "python: $py ($("$py" --version 2>&1))"
    echo "git: $(revision)"
    echo "quick: ${AIOREPLICA_RUN_QUICK:-0}"
    "$py" -c 'import cupy; print("cupy:", cupy.__version__)' 2>&1 || true
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1 || true
} >"$OUT/environment.txt"
cat "$OUT/environment.txt"

step check_gpu 240 "$py" devices/check_gpu.py "${check_args[@]}"
check=$?

benchmarks=0
step bench_collectives 90 "$py" devices/bench_collectives.py "${collectives_args[@]}" \
    --json "$OUT/bench_collectives.json" || benchmarks=3
step bench_scheduler 60 "$py" devices/bench_scheduler.py "${scheduler_args[@]}" \
    --json "$OUT/bench_scheduler.json" || benchmarks=3

echo "== summary (also in $summary)"
cat "$summary"
if ((check != 0)); then
    echo "GPU check FAILED (exit $check): see $OUT/check_gpu.log"
    exit "$check"
fi
exit "$benchmarks"
