"""Collectives of large values move their data on a thread, so the event loop runs on.

MPI moves data only while a request is tested (and MPICH copies a worker's own part when the
collective is posted), so the data of a large collective is posted and tested on a thread of
its own. Its wait keeps every promise of a wait on the loop: a peer's failure or the timeout
ends it, and a cancelled wait is this worker's failure, told to its peers, and stops its thread.

The tests watch the collectives' communicator (``Watched``): on which thread each data
collective is posted and tested, and, on a worker that holds its data back, a transfer that
never completes (or fails) while the others wait for it.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.to_thread
import numpy as np
import pytest
from mpi4py import MPI

from aioreplica import Checkpoint, PerReplica, ReplicaSyncError, Variable
from aioreplica.testing import replica_context
from multiworker.mwtools import (
    RANK,
    WORKERS,
    WORLD,
    allgather,
    each_replica,
    global_ids,
    shared_directory,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from aioreplica import MultiWorkerMirroredStrategy
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

#: float32 elements per replica: 32 MiB, the size from which data moves on a thread.
LARGE = 2**23


class TransferFailed(ConnectionError):
    """What a held-back transfer raises when tested, on the worker that fails."""


#: The tag of the message that tells the worker holding its data back that a peer posted its
#: part of the collective (``Watched``).
POSTED = 77


class Watched:
    """The collectives' communicator of ``strategy``'s cluster, seen through: records where
    (``"loop"`` or ``"thread"``) each data collective is posted and each of its requests
    tested.

    A request whose wait is left before it completes is recorded as it is handed to the
    cluster (``"left behind"``), which its thread does once it stops testing it.

    Worker ``holder``, if given, holds its data back: the collective is not posted there, and
    its request never completes (until ``release()`` posts it). Once every peer has posted
    its part (they tell it so: a peer that learnt of a failure before would raise before
    posting, not in the wait under test), its test sets ``tested``, and raises ``failing`` if
    given."""

    def __init__(
        self,
        strategy: MultiWorkerMirroredStrategy,
        holder: int | None = None,
        failing: BaseException | None = None,
    ) -> None:
        self.workers: Any = strategy._workers
        self.comm: Any = self.workers._comm
        self.loop = threading.get_ident()
        self.holder = holder
        self.holds = holder == RANK
        self.failing = failing
        self.events: list[tuple[str, str]] = []
        #: Set once the peers have posted (on the holder), and once a request is left behind.
        self.tested = threading.Event()
        self.left = threading.Event()
        self.peers_posted = 0
        self.held: list[tuple[str, tuple[Any, ...]]] = []
        self.released = False
        self.workers._comm = self
        self.workers._left = _LeftBehind(self)

    def where(self) -> str:
        return "loop" if threading.get_ident() == self.loop else "thread"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)

    def _posted(self, name: str, *args: Any) -> _Request:
        self.events.append((f"{name} posted", self.where()))
        if self.holds:
            self.held.append((name, args))
            return _Request(self, None)
        request = _Request(self, getattr(self.comm, name)(*args))
        if self.holder is not None:
            WORLD.send(None, self.holder, POSTED)
        return request

    def heard_from_peers(self) -> bool:
        """On the holder: whether every peer has said it posted its part."""
        while self.peers_posted < WORKERS - 1 and WORLD.iprobe(tag=POSTED):
            WORLD.recv(tag=POSTED)
            self.peers_posted += 1
        return self.peers_posted == WORKERS - 1

    def Iallgatherv(self, *args: Any) -> _Request:
        return self._posted("Iallgatherv", *args)

    def Iallreduce(self, *args: Any) -> _Request:
        return self._posted("Iallreduce", *args)

    def Ibcast(self, *args: Any) -> _Request:
        return self._posted("Ibcast", *args)

    def release(self) -> None:
        """Post the collectives held back, and wait for them (the peers' complete too): the
        requests held back complete then."""
        self.workers._comm = self.comm
        for name, args in self.held:
            getattr(self.comm, name)(*args).Wait()
        self.released = True


class _LeftBehind(list[Any]):
    """The requests a cluster's waits left behind, each recorded by its ``Watched``."""

    def __init__(self, watched: Watched) -> None:
        super().__init__()
        self.watched = watched

    def append(self, request: Any) -> None:
        self.watched.events.append(("left behind", self.watched.where()))
        self.watched.left.set()
        super().append(request)


class _Request:
    """A request of ``Watched``: its tests are recorded (``None``: held back)."""

    def __init__(self, watched: Watched, request: Any) -> None:
        self.watched = watched
        self.request = request

    def Test(self) -> bool:
        watched = self.watched
        event = ("tested", watched.where())
        if not watched.events or watched.events[-1] != event:  # one entry for a run of tests
            watched.events.append(event)
        if self.request is None:
            if watched.released:
                return True
            if not watched.heard_from_peers():
                return False
            watched.tested.set()
            if watched.failing is not None:
                raise watched.failing
            return False
        return bool(self.request.Test())


def _values(size: int) -> PerReplica[Any]:
    """This worker's replicas' arrays of ``size`` elements, each full of its global id."""
    return PerReplica([np.full(size, float(r), np.float32) for r in global_ids(2)])


def _gathered(size: int) -> np.ndarray[Any, Any]:
    return np.concatenate([np.full(size, float(r), np.float32) for r in range(2 * WORKERS)])


CALLS: dict[str, tuple[Callable[[MultiWorkerMirroredStrategy, int], Awaitable[Any]], Any]] = {
    "ctx.all_gather": (
        lambda s, size: s.run(lambda v: replica_context().all_gather(v, 0), args=(_values(size),)),
        _gathered,
    ),
    "ctx.all_reduce": (
        lambda s, size: s.run(
            lambda v: replica_context().all_reduce("sum", v), args=(_values(size),)
        ),
        lambda size: np.full(size, float(sum(range(2 * WORKERS))), np.float32),
    ),
    "ctx.broadcast": (
        lambda s, size: s.run(lambda v: replica_context().broadcast(v, 1), args=(_values(size),)),
        lambda size: np.full(size, 1.0, np.float32),
    ),
    "strategy.gather": (lambda s, size: s.gather(_values(size), 0), _gathered),
}


@pytest.mark.parametrize("case", list(CALLS))
async def test_a_large_collective_moves_its_data_off_the_event_loop(
    make_strategy: MakeStrategy, case: str
) -> None:
    """A collective of 32 MiB per replica posts its data and tests it on a thread, never on the
    event loop's, and every replica gets the right result."""
    call, expected = CALLS[case]
    strategy = make_strategy(2)
    watched = Watched(strategy)
    result = await call(strategy, LARGE)
    got = result if case == "strategy.gather" else each_replica(strategy, result)
    for value in got if isinstance(got, list) else [got]:
        np.testing.assert_array_equal(value, expected(LARGE))
    name = {"ctx.all_reduce": "Iallreduce", "ctx.broadcast": "Ibcast"}.get(case, "Iallgatherv")
    assert watched.events == [(f"{name} posted", "thread"), ("tested", "thread")]


async def test_a_small_gather_stays_on_the_event_loop(make_strategy: MakeStrategy) -> None:
    """A small all_gather posts and tests its data on the event loop's thread, as ever."""
    strategy = make_strategy(2)
    watched = Watched(strategy)
    np.testing.assert_array_equal(await strategy.gather(_values(4), 0), _gathered(4))
    assert watched.events == [("Iallgatherv posted", "loop"), ("tested", "loop")]


#: A wait's events when its data, posted and tested on a thread, is left behind there.
LEFT_ON_THREAD = [("Iallgatherv posted", "thread"), ("tested", "thread"), ("left behind", "thread")]


async def _gather_outcome(strategy: MultiWorkerMirroredStrategy) -> str:
    try:
        await strategy.gather(_values(LARGE), 0)
    except ReplicaSyncError as exc:  # (asyncio's CancelledError is trio's Cancelled)
        said = str(exc).split(";")[0].replace("CancelledError", "Cancelled")
        return f"ReplicaSyncError naming workers {exc.workers}: {said}"
    except TransferFailed as exc:
        return f"TransferFailed: {exc}"
    return "done"


async def test_a_peer_failing_ends_a_large_wait(make_strategy: MakeStrategy) -> None:
    """Worker 1's transfer fails while worker 0 waits for its data on a thread: worker 0 raises
    ReplicaSyncError naming worker 1, worker 1 the transfer's own error."""
    strategy = make_strategy(2)
    failing = TransferFailed("the link went down") if RANK == 1 else None
    watched = Watched(strategy, holder=1, failing=failing)
    outcome = await _gather_outcome(strategy)
    watched.release()
    assert allgather((outcome, watched.events)) == [
        (
            "ReplicaSyncError naming workers (1,): worker 1 failed: its strategy.gather "
            "was interrupted by TransferFailed in all_gather",
            LEFT_ON_THREAD,
        ),
        (
            "TransferFailed: the link went down",
            LEFT_ON_THREAD,
        ),
    ]


async def test_the_timeout_bounds_a_large_wait(make_strategy: MakeStrategy) -> None:
    """``sync_timeout`` ends worker 0's wait, on a thread, for data that worker 1 holds back:
    worker 0 raises ReplicaSyncError saying so, and worker 1, still waiting, raises naming
    worker 0."""
    strategy = make_strategy(2, sync_timeout=0.5 if RANK == 0 else 30.0)
    watched = Watched(strategy, holder=1)
    outcome = await _gather_outcome(strategy)
    watched.release()
    assert allgather((outcome, watched.events)) == [
        (
            "ReplicaSyncError naming workers (): worker 0 waited 0.5 s in all_gather for a "
            "worker, which did not arrive",
            LEFT_ON_THREAD,
        ),
        (
            "ReplicaSyncError naming workers (0,): worker 0 failed: it waited 0.5 s in "
            "all_gather (cross-worker collective #1) for a worker, which did not arrive",
            LEFT_ON_THREAD,
        ),
    ]


async def test_a_cancelled_large_wait_stops_its_thread_and_fails_the_worker(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 1's wait for data it holds back is cancelled while its thread tests it: the thread
    stops, and worker 0, waiting for the data, raises ReplicaSyncError naming worker 1."""
    strategy = make_strategy(2)
    watched = Watched(strategy, holder=1)
    if RANK == 1:
        with anyio.CancelScope() as scope:

            async def cancel_once_tested() -> None:
                await anyio.to_thread.run_sync(watched.tested.wait)
                scope.cancel()

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(cancel_once_tested)
                await strategy.gather(_values(LARGE), 0)
        await anyio.to_thread.run_sync(watched.left.wait, 10.0)
        outcome = "cancelled"
    else:
        outcome = await _gather_outcome(strategy)
    watched.release()
    assert allgather((outcome, watched.events)) == [
        (
            "ReplicaSyncError naming workers (1,): worker 1 failed: its strategy.gather "
            "was interrupted by Cancelled in all_gather",
            LEFT_ON_THREAD,
        ),
        (
            "cancelled",
            LEFT_ON_THREAD,
        ),
    ]


async def test_a_large_collective_waits_on_the_loop_unless_mpi_allows_threads(
    make_strategy: MakeStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where MPI runs below ``MPI_THREAD_MULTIPLE`` (here: it says it gives FUNNELED), only
    the loop's thread calls MPI: a large collective is posted and tested there, and its result
    is right."""
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_FUNNELED)
    strategy = make_strategy(2)
    watched = Watched(strategy)
    np.testing.assert_array_equal(await strategy.gather(_values(LARGE), 0), _gathered(LARGE))
    assert watched.events == [("Iallgatherv posted", "loop"), ("tested", "loop")]


async def test_a_large_wait_starts_while_the_programs_threads_are_all_taken(
    make_strategy: MakeStrategy,
) -> None:
    """The program's only thread token of anyio's is held by a thread that waits for a large
    reduce (``anyio.from_thread.run``): the reduce's wait does not need that token, and
    completes."""
    strategy = make_strategy(1, sync_timeout=10.0)
    values = PerReplica([np.full(LARGE, 1.0, np.float32)])
    limiter = anyio.to_thread.current_default_thread_limiter()
    tokens = limiter.total_tokens
    limiter.total_tokens = 1
    try:
        result = await anyio.to_thread.run_sync(
            lambda: anyio.from_thread.run(strategy.reduce, "sum", values, None)
        )
    finally:
        limiter.total_tokens = tokens
    np.testing.assert_array_equal(result, np.full(LARGE, float(WORKERS), np.float32))


#: The tag of worker 0's message telling worker 1 that worker 0's loop ran during its save.
RAN = 78


async def test_a_checkpoint_reads_a_sync_on_read_variable_without_holding_the_loop(
    make_strategy: MakeStrategy,
) -> None:
    """A checkpoint save reads a sync-on-read variable over the workers as an awaited
    collective. Worker 1 holds its part of the read back until worker 0 tells it, from a task
    of its own, that its loop ran while its save waited for that part: a read that held worker
    0's loop would never tell, and its save would time out instead."""
    strategy = make_strategy(2, sync_timeout=10.0)
    with strategy.scope():
        seen = Variable(0.0, synchronization="on_read", aggregation="sum")

    async def step() -> None:
        await seen.assign_add(1.0)

    await strategy.run(step)
    checkpoint = Checkpoint(seen=seen)
    watched = Watched(strategy, holder=1)
    posted = anyio.Event()
    post = watched._posted

    def posted_and_told(name: str, *args: Any) -> _Request:
        request = post(name, *args)
        posted.set()
        return request

    watched._posted = posted_and_told  # type: ignore[method-assign]
    events: list[str] = []

    async def tell_worker_1() -> None:
        await posted.wait()
        events.append("the loop ran while the save waited for worker 1's part")
        WORLD.send(None, 1, RAN)

    async def let_go_once_told() -> None:
        await anyio.to_thread.run_sync(watched.tested.wait, 10.0)
        await anyio.to_thread.run_sync(functools.partial(WORLD.recv, source=0, tag=RAN))
        events.append("let its part go")
        watched.release()

    with shared_directory() as directory:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(tell_worker_1 if RANK == 0 else let_go_once_told)
            path = await checkpoint.save(f"{directory}/seen.npz")
            events.append("saved")
        with np.load(path) as saved:
            totals = [float(saved[k]) for k in saved.files if k != "manifest.json"]
    assert allgather(events) == [
        ["the loop ran while the save waited for worker 1's part", "saved"],
        ["let its part go", "saved"],
    ]
    assert totals == [2.0 * WORKERS]  # every replica's 1.0
