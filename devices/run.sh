#!/usr/bin/env bash
# The device run: the GPU conformance checks, the CUDA backend's tests and the quick benchmarks,
# under one hard timeout.
#
#   devices/run.sh                  # writes everything under ./bench-results
#   OUT=/some/dir devices/run.sh    # or under $OUT
#
# Runs from the repository root with PYTHONPATH=. (aioreplica from this checkout, before any
# PYTHONPATH given) and installs nothing into the Python it runs: the Python is $PYTHON, else
# .venv/bin/python when present, else python3. Needs numpy, anyio and CuPy, and pytest for the
# backend's tests (no trio, no pytest-asyncio, no git checkout: without one, environment.txt
# says so). Writes under $OUT: environment.txt, check_gpu.log, check_gpu_multiworker.log,
# test_cupy_gpu.log, bench_collectives.{log,json}, bench_scheduler.{log,json},
# bench_multiworker.{log,json}, and summary.txt (one line per step run: its name, exit status
# and seconds).
#
# MPI, for the steps across two workers: with the wheels of mpich and mpi4py in ./.whl (carry
# them to a machine without MPI), they are installed in a new folder under /tmp and used; else
# the mpiexec beside the Python, else one on PATH. Without any, those steps are left out (the
# summary says so).
#
# Time. Each step has its own limit, so one hanging step cannot starve the others:
#   check_gpu              240 s  (the smoke test's 10 s, at most 3 layouts of 60 s each on one
#                                  loop, asyncio: 190 s, plus 50 s to import CuPy and compile)
#   check_gpu_multiworker  150 s  (2 workers, 2 layouts of at most 60 s each)
#   test_cupy_gpu          120 s  (tests/backends/test_cupy_gpu.py, asyncio and uvloop)
#   bench_collectives       90 s  (--quick: about 30 s on a 2-core host, part C on the GPU)
#   bench_scheduler         60 s  (--quick: under a minute)
#   bench_multiworker       90 s  (the 8-byte step only, 2 workers: about 45 s)
#   sum                    750 s
# The whole script stops after AIOREPLICA_RUN_TIMEOUT seconds (default 540, less than the sum:
# what one call of a GPU machine may take; there the whole run takes about two minutes). One
# step that hangs to its limit still leaves time for the others and the summary; several that
# do can use up the whole run, which then ends with exit status 124, the summary holding the
# steps that ended. A step that runs out of its own time exits 124.
#
# AIOREPLICA_RUN_QUICK=1 shortens every step, to try the script itself (against the CPU stand-in
# of CuPy, PYTHONPATH=tests/cupy_sim, it then takes seconds): check_gpu --quick (16 x 16
# matrices), check_gpu_multiworker --quick, bench_collectives on 2 replicas and 1 MiB with one
# sample, bench_scheduler on 2 and 8 replicas with one sample, and no bench_multiworker. The
# limits stay as above.
#
# Exit status: the GPU checks' when one failed (1: a check failed, 2: no CuPy or no CUDA
# device, 124: timed out); else 3 when the backend's tests or a benchmark failed or timed out;
# else 0; 124 when the whole run ran out of time.
set -uo pipefail

if [[ -z "${AIOREPLICA_RUN_UNDER_TIMEOUT:-}" ]]; then
    export AIOREPLICA_RUN_UNDER_TIMEOUT=1
    exec timeout --kill-after=10 "${AIOREPLICA_RUN_TIMEOUT:-540}" bash "$0" "$@"
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
multiworker_args=(--loop asyncio --layout-timeout 60)
collectives_args=(--quick)
scheduler_args=(--quick)
quick="${AIOREPLICA_RUN_QUICK:-0}"
if [[ "$quick" == 1 ]]; then
    check_args+=(--quick)
    multiworker_args+=(--quick)
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
    echo "quick: $quick"
    "$py" -c 'import cupy; print("cupy:", cupy.__version__)' 2>&1 || true
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1 || true
} >"$OUT/environment.txt"
cat "$OUT/environment.txt"

# MPI for the steps across workers (see the top): sets $mpiexec, or leaves it empty.
mpiexec=""
if compgen -G ".whl/mpich-*.whl" >/dev/null && compgen -G ".whl/mpi4py-*.whl" >/dev/null; then
    prefix=$(mktemp -d /tmp/aioreplica-mpi.XXXXXX)
    if "$py" -m pip install -q --no-index --no-deps --no-compile --ignore-installed \
        --prefix "$prefix" .whl/mpich-*.whl .whl/mpi4py-*.whl; then
        for site in "$prefix"/lib/python3*/site-packages; do
            export PYTHONPATH="$PYTHONPATH:$site"
        done
        export LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export MPI4PY_LIBMPI="$prefix/lib/libmpi.so.12"
        mpiexec="$prefix/bin/mpiexec"
    fi
fi
if [[ -z "$mpiexec" && -x "$(dirname "$py")/mpiexec" ]]; then
    mpiexec="$(dirname "$py")/mpiexec"
elif [[ -z "$mpiexec" ]] && command -v mpiexec >/dev/null; then
    mpiexec="$(command -v mpiexec)"
fi
# The workers share this machine: loopback only (MPICH's launcher takes -iface; others need
# nothing said).
export UCX_NET_DEVICES=lo
launch=()
if [[ -n "$mpiexec" ]]; then
    launch=("$mpiexec" -n 2)
    if "$mpiexec" --version 2>&1 | grep -qi hydra; then
        launch=("$mpiexec" -iface lo -n 2)
    fi
fi
echo "mpiexec: ${launch[*]:-none}" | tee -a "$OUT/environment.txt"

step check_gpu 240 "$py" devices/check_gpu.py "${check_args[@]}"
check=$?
if [[ -n "$mpiexec" ]]; then
    step check_gpu_multiworker 150 "${launch[@]}" \
        "$py" devices/check_gpu_multiworker.py "${multiworker_args[@]}"
    status=$?
    ((check == 0)) && check=$status
else
    echo "check_gpu_multiworker left out: no mpiexec" | tee -a "$summary"
fi

others=0
PYTHONPATH="$PYTHONPATH:tests" step test_cupy_gpu 120 "$py" -m pytest -c /dev/null --rootdir . \
    -p no:cacheprovider -q -o timeout=60 -o "markers=gpu: needs CuPy and a CUDA device" \
    -k "not trio" tests/backends/test_cupy_gpu.py || others=3
step bench_collectives 90 "$py" devices/bench_collectives.py "${collectives_args[@]}" \
    --json "$OUT/bench_collectives.json" || others=3
step bench_scheduler 60 "$py" devices/bench_scheduler.py "${scheduler_args[@]}" \
    --json "$OUT/bench_scheduler.json" || others=3
if [[ -n "$mpiexec" && "$quick" != 1 ]]; then
    step bench_multiworker 90 "${launch[@]}" "$py" devices/bench_multiworker.py \
        --sizes 8B --deadline 80 --json "$OUT/bench_multiworker.json" || others=3
fi

echo "== summary (also in $summary)"
cat "$summary"
if ((check != 0)); then
    echo "GPU check FAILED (exit $check): see $OUT/check_gpu*.log"
    exit "$check"
fi
exit "$others"
