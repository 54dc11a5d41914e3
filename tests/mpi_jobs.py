"""Running a program as an MPI job from a test, bounded, with nothing left behind.

The ``mpiexec`` is the one next to ``sys.executable`` (the venv's own, from the ``mpich`` wheel
of the ``mpi`` extra, part of the ``test`` extra); every socket stays on loopback. A job is
bounded by Hydra's ``MPIEXEC_TIMEOUT`` and by this process: past ``timeout`` it kills the
launcher and every process it started, found by id (Hydra puts each rank in a session of its
own, so killing the launcher's process group misses them). Past ``MPIEXEC_TIMEOUT`` Hydra kills
the ranks and prints ``TIMED OUT`` but may still exit 0: a job that printed it has failed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

#: The venv's own MPICH launcher, next to the interpreter (``pip install 'aioreplica[mpi]'``).
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def mpiexec(ranks: int = 2) -> list[str]:
    """The start of a launch line: ``ranks`` ranks on loopback. Fails (never skips) without
    mpi4py or the launcher: the test extra installs both."""
    if importlib.util.find_spec("mpi4py") is None or not MPIEXEC.exists():
        pytest.fail(
            f"the multi-worker tests need mpi4py and an mpiexec next to {sys.executable} (the "
            "mpi extra, part of the test extra): pip install -e '.[test]'"
        )
    return [str(MPIEXEC), "-iface", "lo", "-n", str(ranks)]


@dataclass(frozen=True)
class Job:
    """How an MPI job ended."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        """Both streams, stdout first."""
        return self.stdout + self.stderr

    @property
    def log(self) -> str:
        """What to show when a check fails: the exit status, the time, what it printed."""
        return (
            f"exit status {self.returncode} after {self.seconds:.1f} s\n"
            f"stdout:\n{self.stdout}\nstderr:\n{self.stderr[-6000:]}"
        )


def run_job(
    command: list[str],
    *,
    timeout: float,
    cwd: Path,
    env: dict[str, str] | None = None,
    merge_output: bool = False,
) -> Job:
    """Run ``command`` (an ``mpiexec`` line) to its end, or kill it and everything it started
    after ``timeout`` seconds and fail the test with what it printed.

    ``MPIEXEC_TIMEOUT`` is set a little below ``timeout``. ``merge_output``: the ranks' stderr
    goes into stdout, in the order printed.
    """
    full_env = {
        **os.environ,
        "UCX_NET_DEVICES": "lo",
        "MPIEXEC_TIMEOUT": str(max(1, int(timeout) - 5)),
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    for name in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER"):
        full_env.pop(name, None)
    start = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=full_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_output else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*_descendants(process.pid), process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"{command} ran past {timeout} s and was killed\n"
            f"stdout:\n{stdout}\nstderr:\n{(stderr or '')[-6000:]}"
        )
    job = Job(process.returncode, stdout, stderr or "", time.monotonic() - start)
    assert "TIMED OUT" not in job.output, f"{command} timed out in Hydra\n{job.log}"
    return job


def _children() -> dict[int, list[int]]:
    """Every process's children, from ``/proc`` (Linux): ``{ppid: [pid, ...]}``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return children


def _descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs, found before any of them is killed."""
    children, found, todo = _children(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
