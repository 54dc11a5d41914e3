"""Configuration of the multi-worker tests: one pytest per MPI rank, under ``mpiexec``.

``tests/test_multiworker.py`` launches this folder as
``mpiexec -n 2 python -m mpi4py -m pytest tests/multiworker``; the plain run never collects it
(``norecursedirs`` in ``pyproject.toml``). Every rank collects the same tests in the same
order, so the collective calls of each test meet their peers on the other rank.

- Fewer than two ranks is a usage error: the run fails, it does not skip.
- A failed test report on any rank is printed at once and ends the whole job with
  ``MPI.COMM_WORLD.Abort(1)``: a rank that fails would otherwise leave its peer waiting in a
  collective. ``AIOREPLICA_MW_KEEP_GOING=1`` keeps going instead, to see more failures while
  developing: the ranks may then fall out of step, and a rank stuck in a blocking MPI call
  ends only by the watchdog.
- Ranks other than 0 write no terminal report, so rank 0's closing "N passed" line is the
  job's; at the end every rank checks that all ranks passed the same tests.
- A per-rank watchdog (``faulthandler.dump_traceback_later(..., exit=True)``) ends a rank that
  outlives ``AIOREPLICA_MW_WATCHDOG`` seconds (default 600), printing every thread's stack:
  ``mpiexec`` puts the ranks in sessions of their own, out of the launcher's reach.
- Each test gets a timeout of ``AIOREPLICA_MW_TEST_TIMEOUT`` seconds (default 20) unless it
  has its own ``timeout`` mark.
- Async tests run on asyncio, uvloop and trio (the root ``conftest.py``'s ``anyio_backend``).
- Each rank has a temporary directory of its own (``tmp_path``'s base), made for the job and
  removed at its end: in pytest's shared one, both ranks cleaned up the same old directories
  at exit, and one's "directory not empty" warning (an error here) aborted the job.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pytest
from _pytest.config import create_terminal_writer
from mpi4py import MPI

from multiworker import mwtools

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Iterator

    from aioreplica import MultiWorkerMirroredStrategy

WORLD = MPI.COMM_WORLD

if WORLD.Get_size() < 2:
    raise pytest.UsageError(
        f"tests/multiworker needs at least 2 MPI ranks, got {WORLD.Get_size()}: run it under "
        "`mpiexec -n 2 python -m mpi4py -m pytest tests/multiworker` "
        "(tests/test_multiworker.py does)"
    )

RANK = WORLD.Get_rank()
KEEP_GOING = os.environ.get("AIOREPLICA_MW_KEEP_GOING") == "1"
WATCHDOG_SECONDS = float(os.environ.get("AIOREPLICA_MW_WATCHDOG", "600"))
TEST_TIMEOUT = float(os.environ.get("AIOREPLICA_MW_TEST_TIMEOUT", "20"))

#: The rank's real stderr (a duplicate taken while pytest's capture is suspended).
_stderr: IO[str] | None = None
_passed: list[str] = []
_failed: list[str] = []


def _err() -> IO[str]:
    return _stderr if _stderr is not None else sys.__stderr__  # type: ignore[return-value]


def pytest_cmdline_main(config: pytest.Config) -> None:
    """A base temporary directory per rank (before pytest's own ``tmp_path`` set-up reads it,
    in ``pytest_configure``), in one made for the job by rank 0."""
    if config.option.basetemp is None:
        job = WORLD.bcast(tempfile.mkdtemp(prefix="aioreplica-mw-") if RANK == 0 else None)
        config.option.basetemp = str(Path(job) / f"rank{RANK}")
        config.add_cleanup(lambda: _remove_job_directory(Path(job)))


def _remove_job_directory(job: Path) -> None:
    shutil.rmtree(job / f"rank{RANK}", ignore_errors=True)
    if RANK == 0:  # once the other ranks removed theirs (a few seconds at most, else it stays)
        deadline = time.monotonic() + 5
        while job.exists() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                job.rmdir()
            time.sleep(0.01)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    global _stderr
    _stderr = os.fdopen(os.dup(sys.__stderr__.fileno()), "w", buffering=1)  # type: ignore[union-attr]
    faulthandler.dump_traceback_later(WATCHDOG_SECONDS, exit=True, file=_stderr)
    if RANK != 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            devnull = open(os.devnull, "w")  # noqa: SIM115 (open for the whole session)
            reporter._tw = create_terminal_writer(config, devnull)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.passed and report.when == "call":
        _passed.append(report.nodeid)
    if report.skipped and report.when == "call":
        _failed.append(f"{report.nodeid} (skipped)")
    if not report.failed:
        return
    _failed.append(report.nodeid)
    err = _err()
    print(
        f"\n[rank {RANK}] FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n",
        file=err,
        flush=True,
    )
    if not KEEP_GOING:
        print(f"[rank {RANK}] aborting the MPI job", file=err, flush=True)
        time.sleep(1.0)  # give mpiexec time to forward the report before the job is killed
        WORLD.Abort(1)


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Generator[None, None, None]:
    """Check that every rank passed the same tests; rank 0 prints the agreement line."""
    faulthandler.cancel_dump_traceback_later()
    outcomes = WORLD.allgather((sorted(_passed), sorted(_failed)))
    if RANK == 0:
        passed = {tuple(p) for p, _ in outcomes}
        failed = [f for _, fs in outcomes for f in fs]
        if len(passed) == 1 and not failed:
            loops = {
                loop: sum(bool(re.search(rf"[\[-]{loop}[\]-]", p)) for p in outcomes[0][0])
                for loop in ("asyncio", "uvloop", "trio")
            }
            print(
                f"\nmultiworker: all {WORLD.Get_size()} ranks passed the same "
                f"{len(outcomes[0][0])} tests (asyncio: {loops['asyncio']}, "
                f"uvloop: {loops['uvloop']}, trio: {loops['trio']})",
                file=_err(),
                flush=True,
            )
        else:
            print(
                f"\nmultiworker: ranks disagree or failed: {[len(p) for p, _ in outcomes]} "
                f"passed per rank; failed or skipped: {failed}",
                file=_err(),
                flush=True,
            )
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    return (yield)


@pytest.fixture
def make_strategy() -> Iterator[Callable[..., MultiWorkerMirroredStrategy]]:
    """Makes multi-worker strategies (``make_strategy(local=2, **kwargs)``); closes them after."""
    made: list[MultiWorkerMirroredStrategy] = []

    def make(local: int = 2, **kwargs: Any) -> MultiWorkerMirroredStrategy:
        made.append(mwtools.strategy(local, **kwargs))
        return made[-1]

    yield make
    for strategy in made:
        strategy.close()
