#!/usr/bin/env bash
# The device run: the GPU conformance check, then the quick benchmarks, under one hard timeout.
#
#   devices/run.sh                  # writes everything under ./bench-results
#   OUT=/some/dir devices/run.sh    # or under $OUT
#
# Runs from the repository root with PYTHONPATH=. (aioreplica from this checkout) and installs
# nothing: the Python is $PYTHON, else .venv/bin/python when present, else python3. Writes under
# $OUT: check_gpu.log, bench_collectives.{log,json}, bench_scheduler.{log,json}, environment.txt,
# and summary.txt (one line per step with its exit status and seconds).
#
# Time: the whole script stops after AIOREPLICA_RUN_TIMEOUT seconds (default 240); each step
# also has its own limit (check 120 s, each benchmark 60 s), so a hanging step cannot starve the
# others. A step that runs out of time exits 124.
#
# Exit status: the GPU check's when it failed (1: a check failed, 2: no CuPy or no CUDA
# device, 124: timed out); else 3 when a benchmark crashed or timed out; else 0.
set -uo pipefail

if [[ -z "${AIOREPLICA_RUN_UNDER_TIMEOUT:-}" ]]; then
    export AIOREPLICA_RUN_UNDER_TIMEOUT=1
    exec timeout --kill-after=10 "${AIOREPLICA_RUN_TIMEOUT:-240}" bash "$0" "$@"
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

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "python: $py ($("$py" --version 2>&1))"
    echo "git: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
    "$py" -c 'import cupy; print("cupy:", cupy.__version__)' 2>&1 || true
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1 || true
} >"$OUT/environment.txt"
cat "$OUT/environment.txt"

step check_gpu 120 "$py" devices/check_gpu.py
check=$?

benchmarks=0
step bench_collectives 60 "$py" devices/bench_collectives.py --quick \
    --json "$OUT/bench_collectives.json" || benchmarks=3
step bench_scheduler 60 "$py" devices/bench_scheduler.py --quick \
    --json "$OUT/bench_scheduler.json" || benchmarks=3

echo "== summary (also in $summary)"
cat "$summary"
if ((check != 0)); then
    echo "GPU check FAILED (exit $check): see $OUT/check_gpu.log"
    exit "$check"
fi
exit "$benchmarks"
