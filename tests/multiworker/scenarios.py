"""Failure scenarios of the multi-worker strategy, each an MPI job of its own.

``tests/test_multiworker.py`` launches ``mpiexec -n 2 python [-m mpi4py] scenarios.py NAME
BACKEND`` and checks the exit status, the time the job took and the lines printed. Each rank
checks what it saw with plain asserts (an assertion error ends the job: ``-m mpi4py``, or
the strategy's own ``sys.excepthook``) and prints ``rank R: ok PART SECONDS`` per part.

- ``failing``: rank 1's replica raises ``ValueError`` while rank 0 waits in an ``all_reduce``;
  then a failure after the last collective of a step; then a merge function failing on rank 1
  while rank 0's merge function reduces across workers. Rank 1 gets its own error, rank 0 a
  ``ReplicaSyncError`` naming worker 1; each strategy then refuses further calls (a write of
  a variable outside run() is then the worker's own).
- ``uncaught``: as the first part of ``failing``, caught nowhere: the job must end non-zero
  within seconds, without ``-m mpi4py`` (the strategy's ``sys.excepthook`` aborts it).
- ``late``: ``sync_timeout=1``: rank 1 sleeps 5 s before its collective; rank 0 raises
  ``ReplicaSyncError`` naming worker 1 after about 1 s, rank 1 when it gets there. Then the
  same with ``CommunicationOptions(timeout_seconds=0.5)`` on one collective, with a new
  variable's (blocking) first read, and with a dataset pass that only rank 0 starts (rank 0
  raises naming worker 1 after about 1 s, rank 1 naming worker 0), and with rank 1's data
  3 s late in a pass. Last, rank 1 makes a strategy 2 s late: rank 0 waits for it
  (no timeout bounds the making), without spinning a core.
- ``cancelled``: rank 1 cancels its ``run()`` (``anyio.move_on_after``), before reaching the
  collective and while waiting in it, then a restore while it waits in the restore's agreement;
  rank 0 raises naming worker 1.
- ``left``: rank 1 ends its program after a step; rank 0's next collectives (a
  ``strategy.reduce``, a new variable's blocking first read) raise naming worker 1 at once.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
from mpi4py import MPI

from aioreplica import (
    Checkpoint,
    CommunicationOptions,
    MultiWorkerMirroredStrategy,
    ReplicaSyncError,
    Variable,
    batched,
)
from aioreplica.testing import host_devices, replica_context, replica_id

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from aioreplica import MirroredStrategy

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
LOCAL = 2
#: Global id of the failing replica: worker 1's second local replica.
FAILING = 1 * LOCAL + 1


def report(part: str, seconds: float) -> None:
    print(f"rank {RANK}: ok {part} {seconds:.2f} s (cpu {cpu_seconds:.2f} s)", flush=True)


def check_sync_error(error: BaseException | None, *texts: str) -> ReplicaSyncError:
    """``error`` is a ReplicaSyncError naming worker 1 (``.workers``) and every text."""
    assert isinstance(error, ReplicaSyncError), f"expected ReplicaSyncError, got {error!r}"
    assert error.workers == (1,), error.workers
    message = str(error)
    for text in ("worker 1", *texts):
        assert text in message, f"{text!r} not in {message!r}"
    return error


#: The CPU time the last ``outcome`` took, in seconds (every thread of this process).
cpu_seconds = 0.0


async def outcome(call: Callable[[], Awaitable[Any]]) -> tuple[BaseException | None, float]:
    """Run ``call`` after every rank is ready; what it raised and how long it took."""
    global cpu_seconds
    WORLD.Barrier()
    start, cpu = time.monotonic(), time.process_time()
    error: BaseException | None = None
    try:
        await call()
    except Exception as exc:
        error = exc
    cpu_seconds = time.process_time() - cpu
    return error, time.monotonic() - start


async def assert_refused(strategy: MirroredStrategy) -> None:
    """After a cross-worker failure the strategy refuses run() with RuntimeError."""

    async def step() -> Any:
        return await replica_context().all_reduce("sum", np.ones(1))

    error: RuntimeError | None = None
    try:
        await strategy.run(step)
    except RuntimeError as exc:
        error = exc
    assert isinstance(error, RuntimeError), f"run() after a cross-worker failure: {error!r}"
    assert "MPI cannot cancel a collective" in str(error), str(error)
    try:
        await strategy.reduce("sum", np.ones(2))
    except RuntimeError as exc:
        error = exc
    assert "was refused: the workers fell out of step" in str(error), f"reduce: {error!r}"


# -- failing ----------------------------------------------------------------------------------


async def fail_before_collective(strategy: MirroredStrategy) -> Any:
    async def step() -> Any:
        ctx = replica_context()
        if ctx.replica_id_in_sync_group == FAILING:
            await anyio.sleep(0.05)  # let every other replica reach its all_reduce first
            raise ValueError(f"bad batch in replica {FAILING}")
        return await ctx.all_reduce("sum", np.ones(4))

    return await strategy.run(step)


async def failing() -> None:
    # 1. A replica fails while the other worker waits in an all_reduce.
    strategy = MultiWorkerMirroredStrategy(host_devices(LOCAL))
    with strategy.scope():
        weights = Variable(np.zeros(3), name="weights")
    weights.numpy()  # synced: the chief's values
    error, seconds = await outcome(lambda: fail_before_collective(strategy))
    if RANK == 1:
        assert isinstance(error, ValueError), repr(error)
        assert str(error) == f"bad batch in replica {FAILING}"
    else:
        check_sync_error(
            error, f"replica {FAILING}", "ValueError", f"bad batch in replica {FAILING}"
        )
    assert seconds < 5, seconds
    await assert_refused(strategy)
    # What is this worker's own goes on: a write outside run() writes its own value, locally.
    await weights.assign(np.full(3, float(RANK)))
    assert weights.numpy().tolist() == [float(RANK)] * 3, weights.numpy()
    report("failure-in-collective", seconds)

    # 2. A replica fails after the step's last collective: every run() still raises.
    strategy = MultiWorkerMirroredStrategy(host_devices(LOCAL))

    async def after_last() -> Any:
        ctx = replica_context()
        total = await ctx.all_reduce("sum", np.ones(2))
        if ctx.replica_id_in_sync_group == FAILING:
            raise KeyError("after the last collective")
        return total

    error, seconds = await outcome(lambda: strategy.run(after_last))
    if RANK == 1:
        assert isinstance(error, KeyError), repr(error)
    else:
        check_sync_error(error, "KeyError", "after the last collective")
    assert seconds < 5, seconds
    await assert_refused(strategy)
    report("failure-after-last-collective", seconds)

    # 3. A merge function fails on worker 1 while worker 0's reduces across workers.
    strategy = MultiWorkerMirroredStrategy(host_devices(LOCAL))

    async def merge(s: MirroredStrategy, value: Any) -> Any:
        if RANK == 1:
            raise ZeroDivisionError("merge failed on worker 1")
        return await s.reduce("sum", value)

    async def merging() -> Any:
        return await replica_context().merge_call(merge, args=(np.full(2, float(replica_id())),))

    error, seconds = await outcome(lambda: strategy.run(merging))
    if RANK == 1:
        assert isinstance(error, ZeroDivisionError), repr(error)
    else:
        check_sync_error(error, "ZeroDivisionError", "merge failed on worker 1")
    assert seconds < 5, seconds
    await assert_refused(strategy)
    report("failure-in-merge-fn", seconds)

    # 4. Worker 1's dataset raises in run_steps, which pulls it in a merge of its run().
    strategy = MultiWorkerMirroredStrategy(host_devices(LOCAL))

    def batches() -> Any:
        for index in range(6):
            if RANK == 1 and index == 2:
                raise OSError("shard 2 is unreadable")
            yield np.arange(4.0 * LOCAL) + index

    async def steps() -> Any:
        iterator = aiter(strategy.distribute_dataset(batches()))
        return await strategy.run_steps(lambda x: float(x.sum()), iterator, 5)

    error, seconds = await outcome(steps)
    if RANK == 1:
        assert isinstance(error, OSError), repr(error)
    else:
        check_sync_error(error, "dataset", "OSError", "shard 2 is unreadable")
    assert seconds < 5, seconds
    await assert_refused(strategy)
    report("failure-in-dataset", seconds)


async def uncaught() -> None:
    strategy = MultiWorkerMirroredStrategy(host_devices(LOCAL))
    WORLD.Barrier()
    await fail_before_collective(strategy)  # raises on every rank, caught nowhere
    print(f"rank {RANK}: run() returned: the failure was lost", flush=True)


# -- late ----------------------------------------------------------------------------------


async def check_late(
    strategy: MirroredStrategy,
    part: str,
    error: BaseException | None,
    seconds: float,
    waited: tuple[float, float],
    arrived: tuple[float, float],
    late_error: type[BaseException],
    *texts: str,
) -> None:
    """Rank 0 gave up waiting for rank 1 after ``waited`` seconds (between), raising a
    ReplicaSyncError naming worker 1 and every text, without spinning a core all along; rank 1
    raised ``late_error`` when it arrived, after ``arrived`` seconds; the strategy refuses
    further calls on both."""
    if RANK == 0:
        check_sync_error(error, *texts)
        assert waited[0] <= seconds <= waited[1], seconds
        assert cpu_seconds < 0.5 * seconds, (cpu_seconds, seconds)
    else:
        assert isinstance(error, late_error), repr(error)
        assert arrived[0] <= seconds <= arrived[1], seconds
    await assert_refused(strategy)
    report(part, seconds)


async def late() -> None:
    # 1. sync_timeout bounds every cross-worker wait.
    strategy = MultiWorkerMirroredStrategy(host_devices(LOCAL), sync_timeout=1.0)

    async def step() -> Any:
        if RANK == 1:
            await anyio.sleep(5.0)
        return await replica_context().all_reduce("sum", np.ones(3))

    error, seconds = await outcome(lambda: strategy.run(step))
    await check_late(strategy, "sync-timeout", error, seconds, (0.8, 3.0), (5.0, 8.0), RuntimeError)

    # 2. CommunicationOptions(timeout_seconds) bounds one collective.
    strategy = MultiWorkerMirroredStrategy(host_devices(LOCAL))
    options = CommunicationOptions(timeout_seconds=0.5)

    async def bounded() -> Any:
        ctx = replica_context()
        await ctx.all_reduce("sum", np.ones(1))  # unbounded, both on time
        if RANK == 1:
            await anyio.sleep(2.0)
        return await ctx.all_reduce("sum", np.ones(3), options)

    error, seconds = await outcome(lambda: strategy.run(bounded))
    await check_late(
        strategy, "collective-timeout", error, seconds, (0.4, 2.0), (2.0, 4.5), RuntimeError
    )

    # 3. sync_timeout bounds a blocking read's wait (a new variable's first read) too.
    strategy = MultiWorkerMirroredStrategy(host_devices(LOCAL), sync_timeout=1.0)
    with strategy.scope():
        variable = Variable(np.full(2, float(RANK)))

    async def read() -> None:
        if RANK == 1:
            await anyio.sleep(3.0)
        variable.numpy()

    error, seconds = await outcome(read)
    await check_late(
        strategy,
        "blocking-read-timeout",
        error,
        seconds,
        (0.8, 2.5),
        (3.0, 5.0),
        ReplicaSyncError,
        "the first read of variables",
    )

    # 4. A dataset pass that only the chief starts: its first agreement waits for a pass no
    # other worker begins, and sync_timeout ends that wait too (not a hang in MPI). Rank 1,
    # waiting longer, learns of rank 0's failure.
    timeout = 1.0 if RANK == 0 else 10.0
    strategy = MultiWorkerMirroredStrategy(host_devices(LOCAL), sync_timeout=timeout)
    dataset = strategy.distribute_dataset(batched(np.arange(8.0), 4))

    async def chief_only_loop() -> None:
        if RANK == 0:
            async for batch in dataset:
                await strategy.run(lambda x: x, args=(batch,))
        await strategy.run(lambda: None)

    error, seconds = await outcome(chief_only_loop)
    assert isinstance(error, ReplicaSyncError), repr(error)
    assert 0.8 <= seconds <= 3.0, seconds
    if RANK == 0:
        check_sync_error(error, "waited 1 s in the start of a dataset pass")
        assert cpu_seconds < 0.5 * seconds, (cpu_seconds, seconds)
    else:  # told by the chief, which gave up waiting for it there
        assert error.workers == (1,), error.workers
        assert str(error).startswith("worker 0 gave up waiting for worker 1 (this worker"), error
        assert "the start of a dataset pass" in str(error), str(error)
    await assert_refused(strategy)
    report("dataset-pass-timeout", seconds)

    # 5. A worker whose data comes late in a pass: sync_timeout ends the others' wait in the
    # pass's agreement on the next batch, naming it.
    strategy = MultiWorkerMirroredStrategy(host_devices(LOCAL), sync_timeout=1.0)

    def batches() -> Any:
        for start in (0, 4):
            if RANK == 1 and start:
                time.sleep(3.0)  # a slow read, on the pass's loader thread
            yield np.arange(start, start + 4.0)

    async def slow_data() -> None:
        async for batch in strategy.distribute_dataset(batches()):
            await strategy.run(lambda x: x, args=(batch,))

    error, seconds = await outcome(slow_data)
    await check_late(
        strategy, "dataset-late-worker", error, seconds, (0.8, 2.5), (3.0, 5.0), ReplicaSyncError
    )

    # 6. No timeout bounds making the strategy: rank 0 waits for rank 1, 2 s late, without
    # spinning a core meanwhile.
    async def make_late() -> None:
        if RANK == 1:
            await anyio.sleep(2.0)
        MultiWorkerMirroredStrategy(host_devices(LOCAL), sync_timeout=0.5).close()

    error, seconds = await outcome(make_late)
    assert error is None, repr(error)
    if RANK == 0:
        assert 2.0 <= seconds <= 4.0, seconds
        assert cpu_seconds < 0.5 * seconds, (cpu_seconds, seconds)
    report("late-construction", seconds)


# -- cancelled ------------------------------------------------------------------------------


async def cancelled() -> None:
    for part, rank0_delay in (("cancel-before-collective", 0.0), ("cancel-in-collective", 1.5)):
        strategy = MultiWorkerMirroredStrategy(host_devices(LOCAL))

        async def step(delay: float = rank0_delay) -> Any:
            if RANK == 1 and delay == 0.0:
                await anyio.sleep_forever()  # cancelled before reaching the collective
            if RANK == 0:
                await anyio.sleep(delay)  # rank 1 waits in the collective when cancelled
            return await replica_context().all_reduce("sum", np.ones(2))

        async def run_it(s: MirroredStrategy = strategy) -> Any:
            if RANK != 1:
                return await s.run(step)
            with anyio.move_on_after(0.5) as scope:
                await s.run(step)
            assert scope.cancelled_caught, "rank 1's run() was not cancelled"
            return None

        error, seconds = await outcome(run_it)
        if RANK == 0:
            check_sync_error(error)
            assert seconds < 5, seconds
        else:
            assert error is None, repr(error)
            assert seconds < 2, seconds
        await assert_refused(strategy)
        report(part, seconds)
    await cancel_in_restore()


async def cancel_in_restore() -> None:
    """Rank 1's restore is cancelled while it waits for rank 0 (late) in the restore's agreement:
    that counts as rank 1 failing. Rank 1 restored nothing; rank 0 raises naming it, in the
    restore or, when rank 1's part of the agreement had already reached it, at its next call."""
    strategy = MultiWorkerMirroredStrategy(host_devices(LOCAL))
    with strategy.scope():
        weights = Variable(np.ones(3), name="w")
    checkpoint = Checkpoint(w=weights)
    path = await checkpoint.save(f"/tmp/aioreplica-scenario-{WORLD.bcast(time.time_ns())}.npz")
    await weights.assign(np.zeros(3))

    async def restore() -> None:
        if RANK != 1:
            await anyio.sleep(1.0)  # late: rank 1 waits for it in the agreement
            await checkpoint.restore(path)
            await strategy.run(lambda: None)  # the next call, if the restore passed
            return
        with anyio.move_on_after(0.3) as scope:
            await checkpoint.restore(path)
        assert scope.cancelled_caught, "rank 1's restore was not cancelled"

    error, seconds = await outcome(restore)
    if RANK == 0:
        check_sync_error(error, "Checkpoint.restore", "interrupted by")
        assert seconds < 5, seconds
    else:
        assert error is None, repr(error)
        assert seconds < 2, seconds
        assert weights.numpy().tolist() == [0.0, 0.0, 0.0]  # not restored
    await assert_refused(strategy)
    WORLD.Barrier()
    if RANK == 0:
        os.remove(path)
    report("cancel-in-restore", seconds)


# -- left -------------------------------------------------------------------------------------


async def left() -> None:
    # Rank 1 ends its program after a step; rank 0 then makes a collective alone (a
    # strategy.reduce, then a new variable's first read, which blocks): each raises naming
    # worker 1 instead of waiting for it forever.
    first = MultiWorkerMirroredStrategy(host_devices(LOCAL))
    second = MultiWorkerMirroredStrategy(host_devices(LOCAL))
    assert await first.run(lambda: RANK) == RANK
    if RANK == 1:
        report("left", 0.0)
        raise SystemExit(0)  # exit handlers run: the strategy tells its peers
    error, seconds = await outcome_alone(lambda: first.reduce("sum", np.ones(2), axis=None))
    check_sync_error(error, "ended its program", "all_reduce")
    assert seconds < 5, seconds
    with second.scope():
        variable = Variable(np.ones(2))

    async def read() -> None:
        variable.numpy()

    error, seconds = await outcome_alone(read)
    check_sync_error(error, "ended its program", "the first read of variables")
    assert seconds < 5, seconds
    await assert_refused(first)
    report("left", seconds)


async def outcome_alone(call: Callable[[], Awaitable[Any]]) -> tuple[BaseException | None, float]:
    """``outcome`` without the starting barrier (the other rank is gone)."""
    start = time.monotonic()
    try:
        await call()
    except Exception as exc:
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


SCENARIOS = {
    "failing": failing,
    "uncaught": uncaught,
    "late": late,
    "cancelled": cancelled,
    "left": left,
}


def main() -> None:
    name, backend = sys.argv[1], sys.argv[2]
    faulthandler.dump_traceback_later(60, exit=True)
    start = time.monotonic()
    options = {"use_uvloop": True} if backend == "uvloop" else {}
    anyio.run(
        SCENARIOS[name], backend="trio" if backend == "trio" else "asyncio", backend_options=options
    )
    if name != "left":  # there, rank 1 is gone
        WORLD.Barrier()
    print(f"rank {RANK}: scenario {name} on {backend} done in {time.monotonic() - start:.2f}")


if __name__ == "__main__":
    main()
