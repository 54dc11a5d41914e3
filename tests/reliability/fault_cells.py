"""The fault matrix: each fault, struck in each phase of a training step, and what must come of it.

A ``Cell`` names a *phase* (where the run is when the fault strikes), a *fault*, how the test
injects it, and the outcome: the exception ``run()`` (or the caller's own call) raises, its
message and its note, or a cancellation, or a normal end; the state the variables must be left
in; the newest checkpoint; and which thread-side work may be left running. A cell that cannot
occur is not in the table; a comment at its phase says why. ``test_fault_matrix.py`` plays every
cell on asyncio, uvloop and trio; ``docs/reliability.md`` shows the same table, rendered by
``render_table`` and compared by a test. After changing the table, regenerate the docs with::

    .venv/bin/python tests/reliability/fault_cells.py --write

In messages and notes, ``…`` stands for any text (a file name, a line number).

The world every cell plays in is ``harness.World``: three host replicas, a 2 MiB mirrored
variable (``big``), a small one, an SGD optimizer, a checkpoint manager that saved ``ckpt-1``.
A "write" is every replica adding ``replica_id() + 1`` to ``big`` (one merge round); a "step" is one
``apply_gradients`` of both variables.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import re
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.lowlevel
import numpy as np

if __name__ == "__main__":  # run as a script: find the test helpers as pytest does
    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from harness import BIG, REPLICAS, World, raise_, until

from aioreplica import CommunicationOptions, ReplicaSyncError
from aioreplica.testing import replica_context, replica_id

if TYPE_CHECKING:
    from collections.abc import Iterator

    from aioreplica import MirroredStrategy

Scenario = Callable[[World], Awaitable[None]]

ALL_LOOPS: Final = ("asyncio", "uvloop", "trio")
#: Where a replica can raise ``asyncio.CancelledError`` of its own; trio has no such exception
#: that user code can make (``trio.Cancelled`` cannot be instantiated).
ASYNCIO_LOOPS: Final = ("asyncio", "uvloop")

#: ``sync_timeout`` and ``timeout_seconds`` of the timeout cells, and how long their slow work
#: takes (four timeouts: long enough that a timer firing during the work would be seen).
TIMEOUT: Final = 0.05
SLOW: Final = 0.2

# Phases, in the order of a training step.
BEFORE_MERGE: Final = "before the first merge"
PARKED: Final = "parked at a merge point"
SYNC_MERGE_FN: Final = "in a sync merge_fn"
ASYNC_MERGE_FN: Final = "in an async merge_fn"
COLLECTIVE: Final = "in a collective (ctx.all_reduce)"
DEVICE_RUN: Final = "in ctx.device.run"
WRITE: Final = "in a variable write (2 MiB)"
STEP: Final = "in an optimizer step"
SAVE: Final = "in Checkpoint.save"
PREFETCH: Final = "in dataset prefetch"

# Faults.
EXCEPTION: Final = "exception"
CANCEL: Final = "caller cancelled"
TIMEOUT_EXPIRY: Final = "timeout expiry"
SYNC_ERROR: Final = "skipped or different merge"
BASE_EXCEPTION: Final = "KeyboardInterrupt-like"
OWN_CANCEL: Final = "replica's own CancelledError"

#: What each expected state means, for the docs (``harness.STATES`` holds the values).
STATE_WORDS: Final = {
    "untouched": "untouched",
    "written": "written once",
    "stepped": "stepped once",
}


class Abort(BaseException):
    """A private ``BaseException``: neither an ``Exception`` nor a cancellation, like
    ``KeyboardInterrupt`` and ``SystemExit``."""


@dataclass(frozen=True)
class Cell:
    """One fault struck in one phase, and what must come of it.

    Attributes:
        id: the test id.
        phase: where the run is when the fault strikes.
        fault: which fault.
        injection: how the test injects it.
        scenario: plays it (``World.play`` runs it as the caller of ``strategy.run``).
        raises: the exception type the caller gets, unwrapped (no exception group); ``None``:
            none (with ``cancelled``: the caller's cancel scope catches its cancellation).
        message: found in the message (``…``: any text).
        note: the note saying where the exception came from (``…``: any text), which the run
            adds after any note of the exception's own; ``None``: the exception has no note.
        cancelled: the caller's cancellation ends the play.
        state: the variables and optimizer after it (``harness.STATES``).
        newest_checkpoint: the number of the manager's newest checkpoint after it.
        abandoned: thread-side work still running when the play ends (it is not waited for).
        detail: how the outcome comes about, for the docs (the outcome or ``events`` checks it).
        events: what the scenario records, in any order; ``None``: not checked.
        loops: the event loops the cell exists on.
        sync_timeout: the strategy's ``sync_timeout``.
    """

    id: str
    phase: str
    fault: str
    injection: str
    scenario: Scenario
    raises: type[BaseException] | None = None
    message: str = ""
    note: str | None = None
    cancelled: bool = False
    state: str = "untouched"
    newest_checkpoint: int = 1
    abandoned: str | None = None
    detail: str = ""
    events: tuple[str, ...] | None = None
    loops: tuple[str, ...] = ALL_LOOPS
    sync_timeout: float | None = None


def pattern(text: str) -> re.Pattern[str]:
    """``text`` as a regular expression in which ``…`` matches any text."""
    return re.compile(".*?".join(map(re.escape, text.split("…"))), re.DOTALL)


# -- what replicas and merge functions do --------------------------------------------------


async def stuck(w: World, who: str) -> None:
    """Wait for ever, noting that ``who`` waits and, when it comes, that it was cancelled."""
    w.events.append(f"{who} waits")
    try:
        await w.never.wait()
    except anyio.get_cancelled_exc_class():
        w.events.append(f"{who} cancelled")
        raise


def failing_merge(error: BaseException, strategy: MirroredStrategy, *args: Any) -> None:
    raise error


async def failing_async_merge(error: BaseException, strategy: MirroredStrategy, *args: Any) -> None:
    await anyio.lowlevel.checkpoint()
    raise error


def noop_merge(strategy: MirroredStrategy, *args: Any) -> None:
    return None


def other_merge(strategy: MirroredStrategy, *args: Any) -> None:
    return None


async def tagged_async_merge(tag: str, strategy: MirroredStrategy, *args: Any) -> None:
    await anyio.lowlevel.checkpoint()


def cancelling_merge(w: World, strategy: MirroredStrategy, *args: Any) -> None:
    w.events.append("merge_fn ran")
    w.cancel_caller()


def slow_merge(w: World, strategy: MirroredStrategy, *args: Any) -> None:
    time.sleep(SLOW)  # a merge function's own slow work, blocking as CPU work would
    w.events.append("merge_fn ran")


async def slow_async_merge(w: World, strategy: MirroredStrategy, *args: Any) -> None:
    await anyio.sleep(SLOW)
    w.events.append("merge_fn ran")


async def stuck_async_merge(w: World, strategy: MirroredStrategy, *args: Any) -> None:
    await stuck(w, "merge_fn")


def nothing() -> None:
    return None


# -- before the first merge ----------------------------------------------------------------
# No timeout cell: sync_timeout and timeout_seconds time the wait at a merge point, and before
# the first merge nobody waits at one; a replica stuck there is bounded by its caller (the
# caller-cancelled cell).


def replica_1_raises_at_once(make: Callable[[], BaseException]) -> Scenario:
    async def scenario(w: World) -> None:
        error = w.inject(make())

        async def step() -> None:
            if replica_id() == 1:
                raise error
            await stuck(w, f"replica {replica_id()}")
            await w.write()

        await w.strategy.run(step)

    return scenario


async def caller_cancelled_before_merging(w: World) -> None:
    async def step() -> None:
        await stuck(w, f"replica {replica_id()}")
        await w.write()

    w.cancel_when(lambda: len(w.events) == REPLICAS, "every replica waits before merging")
    await w.strategy.run(step)


def caller_cancelled_in_shielded_work(work: Callable[[World], Awaitable[None]]) -> Scenario:
    """The caller is cancelled while replica 1 is in ``work``, shielded from cancellation, and
    replicas 0 and 2 wait before merging."""

    async def scenario(w: World) -> None:
        async def step() -> None:
            if replica_id() == 1:
                await work(w)
                w.events.append("replica 1's shielded work ended")
            await stuck(w, f"replica {replica_id()}")
            await w.write()

        w.cancel_when(
            lambda: w.events.count("replica 1 is shielded") == 1 and len(w.events) == REPLICAS,
            "replica 1 is in its shielded work, replicas 0 and 2 wait",
        )
        await w.strategy.run(step)

    return scenario


async def shielded_wait(w: World) -> None:
    """Wait in ``anyio.CancelScope(shield=True)`` until the caller has been cancelled."""
    released = anyio.Event()
    w.start_helper(_once_caller_cancelled, w, released.set)
    with anyio.CancelScope(shield=True):
        w.events.append("replica 1 is shielded")
        await released.wait()


async def thread_job(w: World) -> None:
    """``anyio.to_thread.run_sync`` (shielded) of a job that returns once the caller has been
    cancelled."""
    gate = w.gate()

    def job() -> None:
        w.events.append("replica 1 is shielded")
        gate.hold()

    w.start_helper(_once_caller_cancelled, w, gate.open)
    await anyio.to_thread.run_sync(job)


async def _once_caller_cancelled(w: World, then: Callable[[], None]) -> None:
    await until(lambda: w.caller_cancelled, "the caller is cancelled")
    then()


async def replica_2_finishes_before_anyone_merges(w: World) -> None:
    async def step() -> None:
        if replica_id() == 2:
            w.events.append("replica 2 finished")
            return
        await until(lambda: "replica 2 finished" in w.events, "replica 2 finishes")
        await w.write()

    await w.strategy.run(step)


# -- parked at a merge point ---------------------------------------------------------------
# Every fault can strike here (replicas 0 and 1 wait in the write's merge_call).


def replica_2_after_0_and_1_park(fault: Callable[[World], Awaitable[None]]) -> Scenario:
    """Replicas 0 and 1 park in the write's merge_call; then replica 2 meets ``fault``."""

    async def scenario(w: World) -> None:
        async def step() -> None:
            if replica_id() == 2:
                await until(lambda: w.waiting() == 2, "replicas 0 and 1 park in merge_call #1")
                await fault(w)
            await w.write()

        await w.strategy.run(step)

    return scenario


def raising(make: Callable[[], BaseException]) -> Callable[[World], Awaitable[None]]:
    async def fault(w: World) -> None:
        raise w.inject(make())

    return fault


async def stuck_replica_2(w: World) -> None:
    await stuck(w, "replica 2")


async def caller_cancelled_at_merge_point(w: World) -> None:
    w.cancel_when(
        lambda: w.waiting() == 2 and "replica 2 waits" in w.events,
        "replicas 0 and 1 park in merge_call #1, replica 2 waits before it",
    )
    await replica_2_after_0_and_1_park(stuck_replica_2)(w)


async def replica_2_finishes_while_others_wait(w: World) -> None:
    async def step() -> None:
        if replica_id() == 2:
            await until(lambda: w.waiting() == 2, "replicas 0 and 1 park in merge_call #1")
            return
        await w.write()

    await w.strategy.run(step)


# -- in a merge function -------------------------------------------------------------------
# Every fault can strike here; a merge function's own CancelledError exists on asyncio only
# (see ASYNCIO_LOOPS).


async def merge_then_write(w: World, merge_for: Callable[[int], Callable[..., Any]]) -> None:
    """Every replica calls ``merge_for(its id)`` in merge_call #1, then writes."""

    async def step() -> None:
        await replica_context().merge_call(merge_for(replica_id()), args=(replica_id(),))
        await w.write()

    await w.strategy.run(step)


def one_merge(make: Callable[[World], Callable[..., Any]]) -> Scenario:
    """Every replica passes the one merge function ``make(w)``."""

    async def scenario(w: World) -> None:
        merge = make(w)
        await merge_then_write(w, lambda replica: merge)

    return scenario


def failing(
    merge: Callable[..., Any], make: Callable[[], BaseException]
) -> Callable[[World], Callable[..., Any]]:
    """``merge`` bound to the cell's injected exception ``make()``."""
    return lambda w: functools.partial(merge, w.inject(make()))


def with_world(merge: Callable[..., Any]) -> Callable[[World], Callable[..., Any]]:
    return lambda w: functools.partial(merge, w)


async def replica_2_passes_other_merge(w: World) -> None:
    await merge_then_write(w, lambda replica: other_merge if replica == 2 else noop_merge)


async def replica_2_passes_other_partial(w: World) -> None:
    usual, odd = (functools.partial(tagged_async_merge, tag) for tag in ("a", "b"))
    await merge_then_write(w, lambda replica: odd if replica == 2 else usual)


async def caller_cancelled_in_async_merge_fn(w: World) -> None:
    w.cancel_when(lambda: "merge_fn waits" in w.events, "merge_fn waits")
    await one_merge(with_world(stuck_async_merge))(w)


# -- in a collective -----------------------------------------------------------------------
# No own-CancelledError cell: no user code runs in a collective's own work; a replica raising
# one while the others wait in a collective is the parked-at-a-merge-point cell.


async def reduce_then_write(
    w: World,
    value_for: Callable[[int], Any] = lambda replica: np.ones(BIG),
    op_for: Callable[[int], str] = lambda replica: "sum",
    options: CommunicationOptions | None = None,
) -> None:
    """Every replica all-reduces 2 MiB (on the device workers), then writes."""

    async def step() -> None:
        await replica_context().all_reduce(op_for(replica_id()), value_for(replica_id()), options)
        await w.write()

    await w.strategy.run(step)


async def replica_2_reduces_another_shape(w: World) -> None:
    await reduce_then_write(w, value_for=lambda replica: np.ones(3 if replica == 2 else BIG))


async def replica_2_reduces_with_max(w: World) -> None:
    await reduce_then_write(w, op_for=lambda replica: "max" if replica == 2 else "sum")


async def reduce_with_timeout(w: World) -> None:
    await reduce_then_write(w, options=CommunicationOptions(timeout_seconds=TIMEOUT))


async def replica_2_late_for_collective(w: World) -> None:
    async def step() -> None:
        if replica_id() == 2:
            await stuck(w, "replica 2")
        await replica_context().all_reduce(
            "sum", np.ones(BIG), CommunicationOptions(timeout_seconds=TIMEOUT)
        )

    await w.strategy.run(step)


def device_fails(
    make: Callable[[], BaseException], then: Callable[[World], Awaitable[None]]
) -> Scenario:
    """Replica 0's device worker raises ``make()`` at its next job, during ``then``."""

    async def scenario(w: World) -> None:
        w.fail_next_job(0, make())
        await then(w)

    return scenario


def worker_held_then_cancelled(then: Callable[[World], Awaitable[None]]) -> Scenario:
    """Replica 0's device worker is busy; the caller is cancelled while ``then``'s merge
    function waits for it."""

    async def scenario(w: World) -> None:
        await w.occupy_worker(0)
        w.cancel_when(lambda: w.waiting() == REPLICAS, "the merge function waits for cpu:0")
        await then(w)

    return scenario


def worker_slow(then: Callable[[World], Awaitable[None]]) -> Scenario:
    """Replica 0's device worker is busy for ``SLOW`` seconds: ``then``'s merge function, which
    needs it, takes that long."""

    async def scenario(w: World) -> None:
        w.open_after(await w.occupy_worker(0), SLOW)
        await then(w)

    return scenario


# -- in ctx.device.run ---------------------------------------------------------------------
# No skipped-or-different-merge cell: device.run makes no merge_call.


async def device_job_then_write(w: World, job_for: Callable[[int], Callable[[], Any]]) -> None:
    async def step() -> None:
        await replica_context().device.run(job_for(replica_id()))
        await w.write()

    await w.strategy.run(step)


def replica_1_job_raises(make: Callable[[], BaseException]) -> Scenario:
    async def scenario(w: World) -> None:
        job = functools.partial(raise_, w.inject(make()))
        await device_job_then_write(w, lambda replica: job if replica == 1 else nothing)

    return scenario


def held_device_jobs(w: World, replicas: set[int]) -> Callable[[int], Callable[[], Any]]:
    """The device jobs of ``replicas`` wait at one gate, watched as abandoned work."""
    gate = w.abandoned_gate = w.gate()
    return lambda replica: gate.hold if replica in replicas else nothing


async def caller_cancelled_in_device_jobs(w: World) -> None:
    job_for = held_device_jobs(w, {0, 1, 2})
    gate = w.abandoned_gate
    assert gate is not None
    w.cancel_when(lambda: gate.inside == REPLICAS, "every replica's device job runs")
    await device_job_then_write(w, job_for)


async def replica_2_job_outlasts_timeout(w: World) -> None:
    await device_job_then_write(w, held_device_jobs(w, {2}))


# -- in a variable write -------------------------------------------------------------------
# No own-CancelledError cell: no user code runs in a write's own work.


async def write_once(w: World) -> None:
    await w.strategy.run(w.write)


def replica_2_writes(how: Callable[[World], Awaitable[Any]]) -> Scenario:
    async def scenario(w: World) -> None:
        async def step() -> None:
            await (how(w) if replica_id() == 2 else w.write())

        await w.strategy.run(step)

    return scenario


# -- in an optimizer step ------------------------------------------------------------------
# No own-CancelledError cell: no user code runs in a step's own work.


async def step_once(w: World) -> None:
    await w.strategy.run(w.step)


def replica_2_steps(pairs: Callable[[World], list[tuple[Any, Any]]]) -> Scenario:
    async def scenario(w: World) -> None:
        async def step() -> None:
            if replica_id() == 2:
                await w.optimizer.apply_gradients(pairs(w))
            else:
                await w.step()

        await w.strategy.run(step)

    return scenario


# -- in Checkpoint.save --------------------------------------------------------------------
# Saves run in cross-replica code, outside run(): no merge and no sync timeout applies (no
# timeout or skipped-merge cell), no replica code runs (no own-CancelledError cell).


async def replica_1_saves(w: World) -> None:
    async def step() -> None:
        if replica_id() == 1:
            await w.model.checkpoint.save(Path(w.manager.directory) / "inside.npz")
        await w.write()

    await w.strategy.run(step)


def fsync_raises(make: Callable[[], BaseException]) -> Scenario:
    """The disk fails while the manager's save writes its file (at its fsync)."""

    async def scenario(w: World) -> None:
        w.patch_fsync(functools.partial(raise_, w.inject(make())))
        await w.manager.save()

    return scenario


async def caller_cancelled_while_saving(w: World) -> None:
    gate = w.gate()
    w.patch_fsync(gate.hold)
    w.cancel_when(lambda: gate.inside == 1, "the save writes its file", then=gate.open)
    await w.manager.save()
    w.events.append("the save returned")
    await anyio.lowlevel.checkpoint()  # the caller's next await


# -- in dataset prefetch -------------------------------------------------------------------
# The loader is the caller's code, not a replica's (no own-CancelledError cell), and runs
# outside merge rounds (no timeout or skipped-merge cell). ``aioreplica.batched`` holds its
# data in memory and is pulled inline, so it cannot block; the loaders here are generators,
# which the dataset pulls in a thread.


def loader(second: Callable[[], None]) -> Iterator[np.ndarray[Any, Any]]:
    """Two global batches of six rows; ``second()`` runs before the second one."""
    yield np.arange(6.0)
    second()
    yield np.arange(6.0)


def train(prefetch: int, second: Callable[[World], Callable[[], None]], *, close: bool) -> Scenario:
    """One write per batch of ``loader(second(w))``; ``close``: iterate in ``async with``."""

    async def scenario(w: World) -> None:
        async def step(batch: Any) -> None:
            await w.write()

        dataset = w.strategy.distribute_dataset(loader(second(w)), prefetch=prefetch)
        if close:
            async with aiter(dataset) as batches:
                async for batch in batches:
                    await w.strategy.run(step, (batch,))
        else:
            async for batch in dataset:
                await w.strategy.run(step, (batch,))

    return scenario


def loader_raises(make: Callable[[], BaseException]) -> Scenario:
    return train(2, lambda w: functools.partial(raise_, w.inject(make())), close=False)


def loader_blocks_and_caller_cancels(prefetch: int, *, close: bool) -> Scenario:
    """The loader blocks before the second batch; the caller is cancelled once the first
    step is done and the loader blocks."""

    def second(w: World) -> Callable[[], None]:
        gate = w.abandoned_gate = w.gate()
        w.cancel_when(
            lambda: gate.inside == 1 and w.strategy.statistics().merge_rounds_completed == 1,
            "the loader blocks after the first step",
        )
        return gate.hold

    return train(prefetch, second, close=close)


# -- the table -----------------------------------------------------------------------------


def replica_note(replica: int) -> str:
    return f"raised in replica {replica} of {REPLICAS} (device cpu:{replica})"


def merge_fn_note(name: str) -> str:
    return f"raised by merge_fn {name} (…) in merge_call #1, in cross-replica context"


def call_note(call: str) -> str:
    """The note of a failure in the merge function of one of the library's own calls."""
    return f"raised by {call} (merge_call #1), in cross-replica context"


def own_cancel_message(replica: int) -> str:
    return f"replica {replica}…CancelledError…not cancelled"


#: How messages name the call of merge_call #1 that the scenarios make.
WRITE_CALL = "a write of a variable (assign, assign_add or assign_sub) (merge_call #1) at …"
ALL_REDUCE_CALL = "all_reduce (merge_call #1) at …"


def late_message(call: str) -> str:
    return f"replicas 0 and 1 waited {TIMEOUT:g} s in {call} for replica 2, which did not arrive"


def disagree_message(what: str, usual: str, odd: str) -> str:
    return f"replicas disagree on {what}: replica 2 passed {odd}…replicas 0 and 1…passed {usual}"


_value_error = functools.partial(ValueError, "injected failure")
_keyboard_interrupt = functools.partial(KeyboardInterrupt, "injected")
_abort = functools.partial(Abort, "injected")
_own_cancel = functools.partial(asyncio.CancelledError, "injected: the replica's own")
_out_of_memory = functools.partial(MemoryError, "injected: device out of memory")
_disk_full = functools.partial(OSError, errno.ENOSPC, "injected: no space left on device")
_waits_then_cancelled = ("waits", "cancelled")
_reduce_note = call_note("all_reduce")

CELLS: Final = [
    # -- before the first merge
    Cell(
        id="before_merge-exception",
        phase=BEFORE_MERGE,
        fault=EXCEPTION,
        injection="replica 1 raises ValueError; replicas 0 and 2 wait before merging",
        scenario=replica_1_raises_at_once(_value_error),
        raises=ValueError,
        message="injected failure",
        note=replica_note(1),
    ),
    Cell(
        id="before_merge-cancel",
        phase=BEFORE_MERGE,
        fault=CANCEL,
        injection="the caller's scope is cancelled while every replica waits before merging",
        scenario=caller_cancelled_before_merging,
        cancelled=True,
        events=tuple(f"replica {r} {e}" for r in range(REPLICAS) for e in _waits_then_cancelled),
    ),
    Cell(
        id="before_merge-cancel_shielded",
        phase=BEFORE_MERGE,
        fault=CANCEL,
        injection="the caller's scope is cancelled while replica 1 waits in "
        "anyio.CancelScope(shield=True)",
        scenario=caller_cancelled_in_shielded_work(shielded_wait),
        cancelled=True,
        events=(
            "replica 0 waits",
            "replica 2 waits",
            "replica 1 is shielded",
            "replica 1's shielded work ended",
            "replica 0 cancelled",
            "replica 2 cancelled",
            "replica 1 waits",
            "replica 1 cancelled",
        ),
        detail="once the shielded wait has ended",
    ),
    Cell(
        id="before_merge-cancel_to_thread",
        phase=BEFORE_MERGE,
        fault=CANCEL,
        injection="the caller's scope is cancelled while replica 1 awaits "
        "anyio.to_thread.run_sync (shielded)",
        scenario=caller_cancelled_in_shielded_work(thread_job),
        cancelled=True,
        events=(
            "replica 0 waits",
            "replica 2 waits",
            "replica 1 is shielded",
            "replica 1's shielded work ended",
            "replica 0 cancelled",
            "replica 2 cancelled",
            "replica 1 waits",
            "replica 1 cancelled",
        ),
        detail="once the thread's job has returned",
    ),
    Cell(
        id="before_merge-finished",
        phase=BEFORE_MERGE,
        fault=SYNC_ERROR,
        injection="replica 2 returns without merging; replicas 0 and 1 then write",
        scenario=replica_2_finishes_before_anyone_merges,
        raises=ReplicaSyncError,
        message=f"reached {WRITE_CALL}, but replica 2 already finished after 0 merge_call()s",
        note="detected at a merge point",
        events=("replica 2 finished",),
    ),
    Cell(
        id="before_merge-keyboard_interrupt",
        phase=BEFORE_MERGE,
        fault=BASE_EXCEPTION,
        injection="replica 1 raises KeyboardInterrupt",
        scenario=replica_1_raises_at_once(_keyboard_interrupt),
        raises=KeyboardInterrupt,
        note=replica_note(1),
    ),
    Cell(
        id="before_merge-base_exception",
        phase=BEFORE_MERGE,
        fault=BASE_EXCEPTION,
        injection="replica 1 raises a private BaseException subclass",
        scenario=replica_1_raises_at_once(_abort),
        raises=Abort,
        note=replica_note(1),
    ),
    Cell(
        id="before_merge-own_cancel",
        phase=BEFORE_MERGE,
        fault=OWN_CANCEL,
        injection="replica 1 raises asyncio.CancelledError, the run not being cancelled",
        scenario=replica_1_raises_at_once(_own_cancel),
        raises=RuntimeError,
        message=own_cancel_message(1),
        note=replica_note(1),
        loops=ASYNCIO_LOOPS,
    ),
    # -- parked at a merge point (replicas 0 and 1 in the write's merge_call)
    Cell(
        id="parked-exception",
        phase=PARKED,
        fault=EXCEPTION,
        injection="replica 2 raises ValueError while replicas 0 and 1 are parked",
        scenario=replica_2_after_0_and_1_park(raising(_value_error)),
        raises=ValueError,
        message="injected failure",
        note=replica_note(2),
    ),
    Cell(
        id="parked-cancel",
        phase=PARKED,
        fault=CANCEL,
        injection="the caller's scope is cancelled while replicas 0 and 1 are parked",
        scenario=caller_cancelled_at_merge_point,
        cancelled=True,
        events=("replica 2 waits", "replica 2 cancelled"),
    ),
    Cell(
        id="parked-sync_timeout",
        phase=PARKED,
        fault=TIMEOUT_EXPIRY,
        injection=f"sync_timeout={TIMEOUT:g}; replica 2 never arrives",
        scenario=replica_2_after_0_and_1_park(stuck_replica_2),
        raises=ReplicaSyncError,
        message=late_message(WRITE_CALL),
        note="detected by a merge timeout",
        sync_timeout=TIMEOUT,
        events=("replica 2 waits", "replica 2 cancelled"),
    ),
    Cell(
        id="parked-finished",
        phase=PARKED,
        fault=SYNC_ERROR,
        injection="replica 2 returns while replicas 0 and 1 are parked",
        scenario=replica_2_finishes_while_others_wait,
        raises=ReplicaSyncError,
        message=(
            f"replica 2 finished after 0 merge_call()s while replicas 0 and 1 wait in {WRITE_CALL}"
        ),
        note="detected when replica 2 finished",
    ),
    Cell(
        id="parked-base_exception",
        phase=PARKED,
        fault=BASE_EXCEPTION,
        injection="replica 2 raises a private BaseException subclass; replicas 0 and 1 are parked",
        scenario=replica_2_after_0_and_1_park(raising(_abort)),
        raises=Abort,
        note=replica_note(2),
    ),
    Cell(
        id="parked-own_cancel",
        phase=PARKED,
        fault=OWN_CANCEL,
        injection="replica 2 raises asyncio.CancelledError while replicas 0 and 1 are parked",
        scenario=replica_2_after_0_and_1_park(raising(_own_cancel)),
        raises=RuntimeError,
        message=own_cancel_message(2),
        note=replica_note(2),
        loops=ASYNCIO_LOOPS,
    ),
    # -- in a sync merge_fn
    Cell(
        id="sync_merge_fn-exception",
        phase=SYNC_MERGE_FN,
        fault=EXCEPTION,
        injection="merge_fn raises ValueError",
        scenario=one_merge(failing(failing_merge, _value_error)),
        raises=ValueError,
        message="injected failure",
        note=merge_fn_note("failing_merge"),
    ),
    Cell(
        id="sync_merge_fn-cancel",
        phase=SYNC_MERGE_FN,
        fault=CANCEL,
        injection="merge_fn cancels the caller's scope; the replicas then write",
        scenario=one_merge(with_world(cancelling_merge)),
        cancelled=True,
        events=("merge_fn ran",),
        detail="once merge_fn has returned, at the replicas' next await",
    ),
    Cell(
        id="sync_merge_fn-slow",
        phase=SYNC_MERGE_FN,
        fault=TIMEOUT_EXPIRY,
        injection=f"sync_timeout={TIMEOUT:g}; merge_fn blocks {SLOW:g} s, then the replicas write",
        scenario=one_merge(with_world(slow_merge)),
        state="written",
        sync_timeout=TIMEOUT,
        events=("merge_fn ran",),
        detail="not a timeout",
    ),
    Cell(
        id="sync_merge_fn-different",
        phase=SYNC_MERGE_FN,
        fault=SYNC_ERROR,
        injection="replica 2 passes another merge_fn",
        scenario=replica_2_passes_other_merge,
        raises=ReplicaSyncError,
        message=disagree_message("the merge function", "noop_merge (…)", "other_merge (…)"),
        note="detected in merge_call #1",
    ),
    Cell(
        id="sync_merge_fn-keyboard_interrupt",
        phase=SYNC_MERGE_FN,
        fault=BASE_EXCEPTION,
        injection="merge_fn raises KeyboardInterrupt",
        scenario=one_merge(failing(failing_merge, _keyboard_interrupt)),
        raises=KeyboardInterrupt,
        note=merge_fn_note("failing_merge"),
    ),
    Cell(
        id="sync_merge_fn-own_cancel",
        phase=SYNC_MERGE_FN,
        fault=OWN_CANCEL,
        injection="merge_fn raises asyncio.CancelledError, the run not being cancelled",
        scenario=one_merge(failing(failing_merge, _own_cancel)),
        raises=RuntimeError,
        message="CancelledError…not cancelled",
        note=merge_fn_note("failing_merge"),
        loops=ASYNCIO_LOOPS,
    ),
    # -- in an async merge_fn
    Cell(
        id="async_merge_fn-exception",
        phase=ASYNC_MERGE_FN,
        fault=EXCEPTION,
        injection="merge_fn awaits, then raises ValueError",
        scenario=one_merge(failing(failing_async_merge, _value_error)),
        raises=ValueError,
        message="injected failure",
        note=merge_fn_note("failing_async_merge"),
    ),
    Cell(
        id="async_merge_fn-cancel",
        phase=ASYNC_MERGE_FN,
        fault=CANCEL,
        injection="the caller's scope is cancelled while merge_fn waits",
        scenario=caller_cancelled_in_async_merge_fn,
        cancelled=True,
        events=("merge_fn waits", "merge_fn cancelled"),
        detail="merge_fn cancelled at its await",
    ),
    Cell(
        id="async_merge_fn-slow",
        phase=ASYNC_MERGE_FN,
        fault=TIMEOUT_EXPIRY,
        injection=f"sync_timeout={TIMEOUT:g}; merge_fn sleeps {SLOW:g} s, then the replicas write",
        scenario=one_merge(with_world(slow_async_merge)),
        state="written",
        sync_timeout=TIMEOUT,
        events=("merge_fn ran",),
        detail="not a timeout",
    ),
    Cell(
        id="async_merge_fn-different",
        phase=ASYNC_MERGE_FN,
        fault=SYNC_ERROR,
        injection="replica 2 passes a partial of merge_fn with another argument",
        scenario=replica_2_passes_other_partial,
        raises=ReplicaSyncError,
        message=disagree_message(
            "the merge function", "partial(…, 'a')", "partial(tagged_async_merge (…), 'b')"
        ),
        note="detected in merge_call #1",
    ),
    Cell(
        id="async_merge_fn-base_exception",
        phase=ASYNC_MERGE_FN,
        fault=BASE_EXCEPTION,
        injection="merge_fn awaits, then raises a private BaseException subclass",
        scenario=one_merge(failing(failing_async_merge, _abort)),
        raises=Abort,
        note=merge_fn_note("failing_async_merge"),
    ),
    Cell(
        id="async_merge_fn-own_cancel",
        phase=ASYNC_MERGE_FN,
        fault=OWN_CANCEL,
        injection="merge_fn awaits, then raises asyncio.CancelledError (the run is not cancelled)",
        scenario=one_merge(failing(failing_async_merge, _own_cancel)),
        raises=RuntimeError,
        message="CancelledError…not cancelled",
        note=merge_fn_note("failing_async_merge"),
        loops=ASYNCIO_LOOPS,
    ),
    # -- in a collective (2 MiB, reduced on the device workers)
    Cell(
        id="collective-bad_shape",
        phase=COLLECTIVE,
        fault=EXCEPTION,
        injection="replica 2 passes a value of another shape",
        scenario=replica_2_reduces_another_shape,
        raises=ValueError,
        message="all_reduce: replica 2's value at … has shape (3,)",
        note=_reduce_note,
    ),
    Cell(
        id="collective-device_fails",
        phase=COLLECTIVE,
        fault=EXCEPTION,
        injection="cpu:0's worker raises MemoryError during the reduction",
        scenario=device_fails(_out_of_memory, reduce_then_write),
        raises=MemoryError,
        message="device out of memory",
        note=_reduce_note,
    ),
    Cell(
        id="collective-cancel",
        phase=COLLECTIVE,
        fault=CANCEL,
        injection="the caller's scope is cancelled while the reduction waits for a busy cpu:0",
        scenario=worker_held_then_cancelled(reduce_then_write),
        cancelled=True,
    ),
    Cell(
        id="collective-timeout",
        phase=COLLECTIVE,
        fault=TIMEOUT_EXPIRY,
        injection=f"timeout_seconds={TIMEOUT:g}; replica 2 never arrives",
        scenario=replica_2_late_for_collective,
        raises=ReplicaSyncError,
        message=late_message(ALL_REDUCE_CALL),
        note="detected by a merge timeout",
        events=("replica 2 waits", "replica 2 cancelled"),
    ),
    Cell(
        id="collective-slow",
        phase=COLLECTIVE,
        fault=TIMEOUT_EXPIRY,
        injection=f"timeout_seconds={TIMEOUT:g}; the reduction waits {SLOW:g} s for a busy cpu:0",
        scenario=worker_slow(reduce_with_timeout),
        state="written",
        detail="not a timeout",
    ),
    Cell(
        id="collective-different",
        phase=COLLECTIVE,
        fault=SYNC_ERROR,
        injection="replica 2 reduces with 'max', the others with 'sum'",
        scenario=replica_2_reduces_with_max,
        raises=ReplicaSyncError,
        message=disagree_message("the reduce op of all_reduce", "…sum…", "…max…"),
        note=_reduce_note,
    ),
    Cell(
        id="collective-base_exception",
        phase=COLLECTIVE,
        fault=BASE_EXCEPTION,
        injection="cpu:0's worker raises a private BaseException subclass during the reduction",
        scenario=device_fails(_abort, reduce_then_write),
        raises=Abort,
        note=_reduce_note,
    ),
    # -- in ctx.device.run
    Cell(
        id="device_run-exception",
        phase=DEVICE_RUN,
        fault=EXCEPTION,
        injection="replica 1's job raises ValueError in the device worker",
        scenario=replica_1_job_raises(_value_error),
        raises=ValueError,
        message="injected failure",
        note=replica_note(1),
    ),
    Cell(
        id="device_run-cancel",
        phase=DEVICE_RUN,
        fault=CANCEL,
        injection="the caller's scope is cancelled while every replica's job runs",
        scenario=caller_cancelled_in_device_jobs,
        cancelled=True,
        abandoned="the device jobs",
    ),
    Cell(
        id="device_run-sync_timeout",
        phase=DEVICE_RUN,
        fault=TIMEOUT_EXPIRY,
        injection=f"sync_timeout={TIMEOUT:g}; replica 2's job outlasts it",
        scenario=replica_2_job_outlasts_timeout,
        raises=ReplicaSyncError,
        message=late_message(WRITE_CALL),
        note="detected by a merge timeout",
        abandoned="replica 2's device job",
        sync_timeout=TIMEOUT,
    ),
    Cell(
        id="device_run-keyboard_interrupt",
        phase=DEVICE_RUN,
        fault=BASE_EXCEPTION,
        injection="replica 1's job raises KeyboardInterrupt in the device worker",
        scenario=replica_1_job_raises(_keyboard_interrupt),
        raises=KeyboardInterrupt,
        note=replica_note(1),
    ),
    Cell(
        id="device_run-own_cancel",
        phase=DEVICE_RUN,
        fault=OWN_CANCEL,
        injection="replica 1's job raises asyncio.CancelledError in the device worker",
        scenario=replica_1_job_raises(_own_cancel),
        raises=RuntimeError,
        message=own_cancel_message(1),
        note=replica_note(1),
        loops=ASYNCIO_LOOPS,
    ),
    # -- in a variable write (2 MiB: aggregated and computed on the device workers)
    Cell(
        id="write-bad_shape",
        phase=WRITE,
        fault=EXCEPTION,
        injection="replica 2 writes a value of another shape",
        scenario=replica_2_writes(lambda w: w.big.assign_add(np.ones(3))),
        raises=ValueError,
        message=f"cannot write a value of shape (3,) to variable 'big' of shape ({BIG},) from "
        "replica 2",
        note=replica_note(2),
    ),
    Cell(
        id="write-device_fails",
        phase=WRITE,
        fault=EXCEPTION,
        injection="cpu:0's worker raises MemoryError during the write",
        scenario=device_fails(_out_of_memory, write_once),
        raises=MemoryError,
        message="device out of memory",
        note=call_note("a write of a variable (assign, assign_add or assign_sub)"),
    ),
    Cell(
        id="write-cancel",
        phase=WRITE,
        fault=CANCEL,
        injection="the caller's scope is cancelled while the write waits for a busy cpu:0",
        scenario=worker_held_then_cancelled(write_once),
        cancelled=True,
    ),
    Cell(
        id="write-slow",
        phase=WRITE,
        fault=TIMEOUT_EXPIRY,
        injection=f"sync_timeout={TIMEOUT:g}; the write waits {SLOW:g} s for a busy cpu:0",
        scenario=worker_slow(write_once),
        state="written",
        sync_timeout=TIMEOUT,
        detail="not a timeout",
    ),
    Cell(
        id="write-different",
        phase=WRITE,
        fault=SYNC_ERROR,
        injection="replica 2 calls assign_sub, the others assign_add",
        scenario=replica_2_writes(lambda w: w.big.assign_sub(3.0)),
        raises=ReplicaSyncError,
        message=disagree_message(
            "the kind of write (assign, assign_add, assign_sub)", "'assign_add'", "'assign_sub'"
        ),
        note=call_note("a write of a variable (assign, assign_add or assign_sub)"),
    ),
    Cell(
        id="write-base_exception",
        phase=WRITE,
        fault=BASE_EXCEPTION,
        injection="cpu:0's worker raises a private BaseException subclass during the write",
        scenario=device_fails(_abort, write_once),
        raises=Abort,
        note=call_note("a write of a variable (assign, assign_add or assign_sub)"),
    ),
    # -- in an optimizer step (both variables; the 2 MiB one on the device workers)
    Cell(
        id="step-bad_gradient",
        phase=STEP,
        fault=EXCEPTION,
        injection="replica 2's gradient of 'big' has another shape",
        scenario=replica_2_steps(lambda w: [(np.ones(4), w.small), (np.ones(3), w.big)]),
        raises=ValueError,
        message="the gradient of variable 'big' from replica 2 has shape (3,)",
        note=replica_note(2),
    ),
    Cell(
        id="step-device_fails",
        phase=STEP,
        fault=EXCEPTION,
        injection="cpu:0's worker raises MemoryError during the step",
        scenario=device_fails(_out_of_memory, step_once),
        raises=MemoryError,
        message="device out of memory",
        note=call_note("an optimizer step (apply_gradients)"),
    ),
    Cell(
        id="step-cancel",
        phase=STEP,
        fault=CANCEL,
        injection="the caller's scope is cancelled while the step waits for a busy cpu:0",
        scenario=worker_held_then_cancelled(step_once),
        cancelled=True,
    ),
    Cell(
        id="step-slow",
        phase=STEP,
        fault=TIMEOUT_EXPIRY,
        injection=f"sync_timeout={TIMEOUT:g}; the step waits {SLOW:g} s for a busy cpu:0",
        scenario=worker_slow(step_once),
        state="stepped",
        sync_timeout=TIMEOUT,
        detail="not a timeout",
    ),
    Cell(
        id="step-different",
        phase=STEP,
        fault=SYNC_ERROR,
        injection="replica 2 lists the variables in another order",
        scenario=replica_2_steps(lambda w: [(np.ones(BIG), w.big), (np.ones(4), w.small)]),
        raises=ReplicaSyncError,
        message=disagree_message(
            "the variable of pair 0 of apply_gradients()", "variable 'small'", "variable 'big'"
        ),
        note=call_note("an optimizer step (apply_gradients)"),
    ),
    Cell(
        id="step-base_exception",
        phase=STEP,
        fault=BASE_EXCEPTION,
        injection="cpu:0's worker raises a private BaseException subclass during the step",
        scenario=device_fails(_abort, step_once),
        raises=Abort,
        note=call_note("an optimizer step (apply_gradients)"),
    ),
    # -- in Checkpoint.save (CheckpointManager.save, max_to_keep=1, after ckpt-1)
    Cell(
        id="save-in_replica",
        phase=SAVE,
        fault=EXCEPTION,
        injection="replica 1 calls Checkpoint.save",
        scenario=replica_1_saves,
        raises=RuntimeError,
        message="Checkpoint.save() was called inside replica 1",
        note=replica_note(1),
    ),
    Cell(
        id="save-disk_fails",
        phase=SAVE,
        fault=EXCEPTION,
        injection="the file's fsync raises OSError(ENOSPC)",
        scenario=fsync_raises(_disk_full),
        raises=OSError,
        message="no space left on device: '…/ckpt-2.npz'",
        note="while saving checkpoint '…/ckpt-2.npz': writing its temporary file "
        "'…/.ckpt-2.npz.….tmp'; any file already there is intact",
    ),
    Cell(
        id="save-cancel",
        phase=SAVE,
        fault=CANCEL,
        injection="the caller's scope is cancelled while the file is being written; the caller "
        "awaits again after the save",
        scenario=caller_cancelled_while_saving,
        cancelled=True,
        newest_checkpoint=2,
        events=("the save returned",),
        detail="after the save has finished, at the caller's next await",
    ),
    Cell(
        id="save-keyboard_interrupt",
        phase=SAVE,
        fault=BASE_EXCEPTION,
        injection="the file's fsync raises KeyboardInterrupt",
        scenario=fsync_raises(_keyboard_interrupt),
        raises=KeyboardInterrupt,
    ),
    # -- in dataset prefetch (a generator of two batches; one write per batch)
    Cell(
        id="prefetch-exception",
        phase=PREFETCH,
        fault=EXCEPTION,
        injection="the loader raises ValueError before its second batch",
        scenario=loader_raises(_value_error),
        raises=ValueError,
        message="injected failure",
        state="written",
    ),
    Cell(
        id="prefetch-cancel_on_demand",
        phase=PREFETCH,
        fault=CANCEL,
        injection="prefetch=0; the caller's scope is cancelled while the loader blocks",
        scenario=loader_blocks_and_caller_cancels(0, close=False),
        cancelled=True,
        state="written",
        abandoned="the loader thread",
    ),
    Cell(
        id="prefetch-cancel_prefetching",
        phase=PREFETCH,
        fault=CANCEL,
        injection="prefetch=2, async for; the caller's scope is cancelled while the loader blocks",
        scenario=loader_blocks_and_caller_cancels(2, close=False),
        cancelled=True,
        state="written",
        abandoned="the loader thread",
    ),
    Cell(
        id="prefetch-cancel_closing",
        phase=PREFETCH,
        fault=CANCEL,
        injection="prefetch=2, async with aiter(...); the caller's scope is cancelled while the "
        "loader blocks",
        scenario=loader_blocks_and_caller_cancels(2, close=True),
        cancelled=True,
        state="written",
        abandoned="the loader thread",
    ),
    Cell(
        id="prefetch-base_exception",
        phase=PREFETCH,
        fault=BASE_EXCEPTION,
        injection="the loader raises a private BaseException subclass before its second batch",
        scenario=loader_raises(_abort),
        raises=Abort,
        state="written",
    ),
]


# -- the table in the docs -------------------------------------------------------------------

DOC: Final = Path(__file__).parents[2] / "docs" / "reliability.md"
BEGIN: Final = "<!-- fault-matrix: begin (tests/reliability/fault_cells.py --write) -->"
END: Final = "<!-- fault-matrix: end -->"


def describe_outcome(cell: Cell) -> str:
    if cell.raises is None:
        outcome = "cancelled (the caller's scope catches it)" if cell.cancelled else "completes"
    else:
        outcome = f"`{cell.raises.__name__}`"
        if cell.message:
            outcome += f" `{cell.message}`"
        if cell.note:
            outcome += f", note `{cell.note}`"
        if cell.fault == OWN_CANCEL:
            outcome += ", `__cause__` the CancelledError"
    if cell.detail:
        outcome += f", {cell.detail}"
    if cell.abandoned:
        outcome += f"; {cell.abandoned} left running, abandoned"
    return outcome


def describe_state(cell: Cell) -> str:
    state = STATE_WORDS[cell.state]
    if cell.newest_checkpoint != 1:
        state += f"; newest checkpoint ckpt-{cell.newest_checkpoint}"
    return state


def render_table(cells: list[Cell]) -> str:
    rows = [
        "| Phase | Fault | Injected as | Outcome | State | Loops |",
        "|---|---|---|---|---|---|",
    ]
    for cell in cells:
        loops = "all" if cell.loops == ALL_LOOPS else ", ".join(cell.loops)
        fields = [
            cell.phase,
            cell.fault,
            cell.injection,
            describe_outcome(cell),
            describe_state(cell),
            loops,
        ]
        rows.append("| " + " | ".join(field.replace("|", "\\|") for field in fields) + " |")
    return "\n".join(rows)


def doc_table(text: str) -> str:
    """The table between the markers of ``docs/reliability.md``."""
    start = text.index(BEGIN) + len(BEGIN)
    return text[start : text.index(END)].strip()


def write_doc() -> None:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(BEGIN) + len(BEGIN)
    table = render_table(CELLS)
    DOC.write_text(f"{text[:start]}\n{table}\n{text[text.index(END) :]}", encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/reliability/fault_cells.py --write")
    write_doc()
