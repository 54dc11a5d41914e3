"""The multi-worker tests, launched under ``mpiexec -n 2`` from the plain run.

``tests/multiworker/`` holds tests that run in every rank of an MPI job (the plain run does not
collect it: ``norecursedirs`` in ``pyproject.toml``); ``tests/multiworker/scenarios.py`` holds
failure scenarios that are MPI jobs of their own. Each launch goes through
``tests/mpi_jobs.py`` (the venv's own ``mpiexec``, loopback only) and is bounded three ways:
Hydra's ``MPIEXEC_TIMEOUT``, this process's own timeout (killing every process the job
started), and a watchdog in every rank.

Two ranks only: the ranks spin while they wait, and CI machines have two cores.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_jobs import Job, mpiexec, run_job

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "tests" / "multiworker" / "scenarios.py"
RANKS = 2
#: The event loops of the suite (uvloop has no Windows build).
BACKENDS = ["asyncio", *(["uvloop"] if sys.platform != "win32" else []), "trio"]


def reported(job: Job, rank: int, part: str) -> bool:
    """Whether ``rank`` printed ``ok PART`` (ranks' lines may interleave mid-line)."""
    return f"rank {rank}: ok {part} " in job.output


def launch(args: list[str], *, timeout: float, mpi4py: bool = True) -> Job:
    """Run ``python [-m mpi4py] ARGS`` in 2 ranks from the repository root."""
    command = [*mpiexec(RANKS), sys.executable, *(["-m", "mpi4py"] if mpi4py else []), *args]
    watchdog = {"AIOREPLICA_MW_WATCHDOG": str(int(timeout) - 5), "AIOREPLICA_MW_KEEP_GOING": ""}
    return run_job(command, timeout=timeout + 10, cwd=ROOT, env=watchdog, merge_output=True)


def assert_scenario(name: str, backend: str, parts: tuple[str, ...], within: float) -> None:
    """Scenario ``name`` of ``scenarios.py`` ends well on ``backend``: every rank reported
    each of ``parts``, and the whole job took under ``within`` seconds."""
    job = launch([str(SCENARIOS), name, backend], timeout=60)
    assert job.returncode == 0, job.log
    for part in parts:
        for rank in range(RANKS):
            assert reported(job, rank, part), job.log
    assert job.seconds < within, job.log


@pytest.mark.timeout(660)
def test_multiworker_suite() -> None:
    """tests/multiworker passes in 2 ranks on asyncio, uvloop and trio: every test passed on every
    rank, none skipped or failed."""
    job = launch(["-m", "pytest", "tests/multiworker", "-p", "no:cacheprovider", "-q"], timeout=600)
    assert job.returncode == 0, job.log
    summary = re.search(r"\b(\d+) passed(?: in|,)", job.output)
    assert summary, job.log
    for bad in ("failed", "error", "skipped", "xfail", "xpass", "deselected"):
        assert not re.search(rf"\d+ {bad}", job.output), job.log
    passed = int(summary.group(1))
    agreed = re.search(
        rf"all {RANKS} ranks passed the same {passed} tests "
        r"\(asyncio: (\d+), uvloop: (\d+), trio: (\d+)\)",
        job.output,
    )
    assert agreed, job.log
    asyncio_tests, uvloop_tests, trio_tests = (int(n) for n in agreed.groups())
    assert asyncio_tests == trio_tests > 0, job.log  # every loop ran them all
    assert uvloop_tests == (asyncio_tests if "uvloop" in BACKENDS else 0), job.log


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failing_worker_fails_every_run(backend: str) -> None:
    """A replica or merge function failing on worker 1: rank 1's run() raises its own error,
    rank 0's a ReplicaSyncError naming worker 1, the replica and the error, in seconds; a
    failure after the last collective, and a dataset raising inside run_steps, too; the
    strategy then refuses further calls."""
    parts = (
        "failure-in-collective",
        "failure-after-last-collective",
        "failure-in-merge-fn",
        "failure-in-dataset",
    )
    assert_scenario("failing", backend, parts, within=20)


@pytest.mark.timeout(120)
def test_an_uncaught_failure_ends_the_job() -> None:
    """Without ``-m mpi4py``, a failure nobody catches ends the whole job non-zero in seconds
    (no hang in MPI_Finalize): the strategy's excepthook aborts it."""
    job = launch([str(SCENARIOS), "uncaught", "asyncio"], timeout=60, mpi4py=False)
    assert job.returncode != 0, job.log
    assert "ValueError: bad batch in replica 3" in job.output, job.log
    assert "the failure was lost" not in job.output, job.log
    assert job.seconds < 20, job.log


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_late_worker_times_out(backend: str) -> None:
    """sync_timeout=1 with worker 1 five seconds late: rank 0 raises naming worker 1 within
    1-3 s, rank 1 raises when it arrives; a collective's own timeout_seconds does the same, and
    sync_timeout bounds a blocking first read of a variable, the start of a dataset pass that
    only the chief begins, and a pass's wait for a worker whose data is late (naming it); the
    making of a strategy waits for a late worker, idle."""
    parts = (
        "sync-timeout",
        "collective-timeout",
        "blocking-read-timeout",
        "dataset-pass-timeout",
        "dataset-late-worker",
        "late-construction",
    )
    assert_scenario("late", backend, parts, within=25)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelling_one_worker_fails_the_others(backend: str) -> None:
    """Cancelling run() on worker 1, before or inside the collective, counts as worker 1
    failing: rank 0 raises naming it; both strategies refuse further calls."""
    parts = ("cancel-before-collective", "cancel-in-collective", "cancel-in-restore")
    assert_scenario("cancelled", backend, parts, within=20)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_worker_that_ended_its_program_fails_the_others_waits(backend: str) -> None:
    """Worker 1 ends its program; worker 0's next collectives, async and blocking, raise a
    ReplicaSyncError naming it within seconds instead of waiting forever."""
    assert_scenario("left", backend, ("left",), within=20)


def test_import_aioreplica_leaves_mpi4py_alone() -> None:
    """``import aioreplica`` (and naming the strategy class) never imports mpi4py."""
    code = (
        "import sys, aioreplica; aioreplica.MultiWorkerMirroredStrategy; "
        "print('mpi4py' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"
