"""Cross-worker calls from concurrent tasks outside run(): each call holds the communicator
from its first collective to its last, so the collectives of two calls never interleave, calls
pair in the order they reached the strategy, and a run() waits for a call in progress.

Runs under ``mpiexec -n 2`` (see conftest.py). A call is held open on purpose by user code
that runs inside one: the ``init_fn`` of ``CheckpointManager.restore_or_initialize`` (no
checkpoint in a new directory, so every worker calls it), which waits for an event the test
sets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import numpy as np
import pytest

from aioreplica import Checkpoint, CheckpointManager, PerReplica, Variable
from aioreplica.testing import replica_context
from multiworker.mwtools import RANK, WORKERS, each_replica, global_ids

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine
    from pathlib import Path

    from aioreplica import MultiWorkerMirroredStrategy
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

LOCAL = 2


class HeldCall:
    """A ``restore_or_initialize`` whose ``init_fn`` records ``"init_fn"``, waits for
    ``release``, then awaits ``then()`` (if any) and records ``"init_fn done"``; the call
    records ``"held call ended"`` once it returns."""

    def __init__(
        self,
        strategy: MultiWorkerMirroredStrategy,
        directory: Path,
        events: list[str],
        then: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        with strategy.scope():
            self.v = Variable(np.zeros(3), name="v")
        self.entered = anyio.Event()
        self.release = anyio.Event()
        self.events = events
        self.then = then
        self.manager = CheckpointManager(Checkpoint(v=self.v), directory, init_fn=self.init_fn)

    async def init_fn(self) -> None:
        self.events.append("init_fn")
        self.entered.set()
        await self.release.wait()
        if self.then is not None:
            await self.then()
        self.events.append("init_fn done")

    async def __call__(self) -> None:
        assert await self.manager.restore_or_initialize() is None
        self.events.append("held call ended")

    async def beside(self, task: Callable[[], Coroutine[Any, Any, Any]], note: str = "") -> None:
        """Make this call and, once it is held in ``init_fn``, start ``task`` in another
        task; release the call once every task waits (recording ``note`` first, if any)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self)
            await self.entered.wait()
            tg.start_soon(task)
            await anyio.wait_all_tasks_blocked()
            if note:
                self.events.append(note)
            self.release.set()


def nested(scale: float) -> dict[str, PerReplica[Any]]:
    """This worker's replicas' values of a nested value with two dtypes (so two collectives
    per reduction): ``scale`` times (1 + the global replica id)."""
    ids = global_ids(LOCAL)
    return {
        "f": PerReplica([np.full(2, scale * (1 + r), np.float32) for r in ids]),
        "i": PerReplica([np.full(3, int(scale) * (1 + r), np.int64) for r in ids]),
    }


def total(scale: float) -> float:
    """The sum over every worker's replicas of ``nested(scale)``'s elements."""
    return scale * sum(1 + r for r in range(WORKERS * LOCAL))


async def test_calls_started_in_one_order_pair_whatever_their_timing(
    make_strategy: MakeStrategy, tmp_path: Path
) -> None:
    """A call (a reduction of two collectives inside the held call) and another task's
    reduction of the same shapes, started in the same order on every worker but timed
    differently: on worker 0 the first call goes on before the second starts, on worker 1
    the second is already waiting. Each pairs with its own counterpart (had their collectives
    interleaved, the workers would have paired one call's with the other's)."""
    strategy = make_strategy(LOCAL)
    events: list[str] = []
    results: dict[str, Any] = {}

    async def first_reduction() -> None:
        results["first"] = await strategy.reduce("sum", nested(1.0), axis=None)
        events.append("first reduced")

    async def second_reduction() -> None:
        results["second"] = await strategy.reduce("sum", nested(10.0), axis=None)
        events.append("second reduced")

    held = HeldCall(strategy, tmp_path, events, then=first_reduction)
    async with anyio.create_task_group() as tg:
        tg.start_soon(held)
        await held.entered.wait()
        if RANK == 0:
            held.release.set()
        tg.start_soon(second_reduction)
        await anyio.wait_all_tasks_blocked()
        held.release.set()
    assert events == [
        "init_fn",
        "first reduced",
        "init_fn done",
        "held call ended",
        "second reduced",
    ]
    for name, scale in (("first", 1.0), ("second", 10.0)):
        np.testing.assert_array_equal(results[name]["f"], np.full(2, total(scale), np.float32))
        np.testing.assert_array_equal(results[name]["i"], np.full(3, int(total(scale))))


async def test_a_run_waits_for_another_tasks_call(
    make_strategy: MakeStrategy, tmp_path: Path
) -> None:
    """A run() started while another task's call is in progress starts its replicas once the
    call has ended, and sees what the call wrote."""
    strategy = make_strategy(LOCAL)
    events: list[str] = []

    async def initialize() -> None:
        await held.v.assign(np.full(3, 1.0 + RANK))  # the chief's value: 1.0
        events.append("assigned")

    held = HeldCall(strategy, tmp_path, events, then=initialize)

    async def step() -> Any:
        events.append("step")
        return await replica_context().all_reduce("sum", held.v.read_value())

    results: list[Any] = []

    async def run() -> None:
        results.append(await strategy.run(step))

    await held.beside(run, note="released")
    assert events == [
        "init_fn",
        "released",
        "assigned",
        "init_fn done",
        "held call ended",
        *["step"] * LOCAL,
    ]
    for value in each_replica(strategy, results[0]):
        np.testing.assert_array_equal(value, np.full(3, float(WORKERS * LOCAL)))


async def test_a_write_from_another_task_waits_for_the_call_in_progress(
    make_strategy: MakeStrategy, tmp_path: Path
) -> None:
    """Another task's write of a variable outside run() while a call is in progress (which
    writes the same variable) is applied after the call, on every worker alike."""
    strategy = make_strategy(LOCAL)
    events: list[str] = []

    async def initialize() -> None:
        await held.v.assign(np.full(3, 1.0 + RANK))
        events.append("call's write")

    held = HeldCall(strategy, tmp_path, events, then=initialize)

    async def write() -> None:
        await held.v.assign(np.full(3, 5.0 + RANK))
        events.append("other task's write")

    await held.beside(write)
    assert events == [
        "init_fn",
        "call's write",
        "init_fn done",
        "held call ended",
        "other task's write",
    ]
    for copy in held.v.values:
        np.testing.assert_array_equal(copy, np.full(3, 5.0))  # the chief's, written last


@pytest.mark.parametrize("read", ["sync-on-read value", "first read"])
async def test_a_synchronous_read_during_another_tasks_call_is_refused(
    make_strategy: MakeStrategy, tmp_path: Path, read: str
) -> None:
    """A read that needs a collective (a sync-on-read variable's global value, a new
    variable's first read) cannot wait: during another task's call it raises RuntimeError on
    every worker, having made no collective, and works once the call has ended."""
    strategy = make_strategy(LOCAL)
    events: list[str] = []
    held = HeldCall(strategy, tmp_path, events)
    with strategy.scope():
        seen = Variable(
            np.full(2, 1.0 + RANK), name="seen", synchronization="on_read", aggregation="sum"
        )
    before = seen.numpy()  # (every variable made so far takes the chief's values now)
    if read == "first read":
        with strategy.scope():
            fresh = Variable(np.full(2, 3.0 + RANK), name="fresh")

    def reading() -> Any:
        return seen.numpy() if read == "sync-on-read value" else fresh.numpy()

    async with anyio.create_task_group() as tg:
        tg.start_soon(held)
        await held.entered.wait()
        with pytest.raises(RuntimeError, match="another cross-worker call or collective"):
            reading()
        events.append("refused")
        held.release.set()
    assert events == ["init_fn", "refused", "init_fn done", "held call ended"]
    expected = before if read == "sync-on-read value" else np.full(2, 3.0)  # the chief's
    np.testing.assert_array_equal(reading(), expected)


async def test_a_call_cancelled_while_it_waits_for_its_turn_breaks_nothing(
    make_strategy: MakeStrategy, tmp_path: Path
) -> None:
    """A call cancelled while it waits for the call in progress never made a collective: the
    call in progress ends normally and the strategy goes on working on every worker."""
    strategy = make_strategy(LOCAL)
    events: list[str] = []
    held = HeldCall(strategy, tmp_path, events)

    async def waiting_reduction(scope: anyio.CancelScope) -> None:
        with scope:
            await strategy.reduce("sum", nested(1.0), axis=None)
            events.append("reduced")  # never: cancelled first
        events.append("cancelled" if scope.cancelled_caught else "not cancelled")

    scope = anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(held)
        await held.entered.wait()
        tg.start_soon(waiting_reduction, scope)
        await anyio.wait_all_tasks_blocked()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        held.release.set()
    assert events == ["init_fn", "cancelled", "init_fn done", "held call ended"]
    reduced = await strategy.reduce("sum", nested(2.0), axis=None)
    np.testing.assert_array_equal(reduced["f"], np.full(2, total(2.0), np.float32))


async def test_a_run_inside_a_call_goes_ahead(make_strategy: MakeStrategy, tmp_path: Path) -> None:
    """A call's own work may include a run() (an init_fn that trains a step, say): it does
    not wait for the call it is part of."""
    strategy = make_strategy(LOCAL)
    events: list[str] = []
    results: list[Any] = []

    async def train() -> None:
        results.append(await strategy.run(lambda: replica_context().all_reduce("sum", 1.0)))
        events.append("ran")

    held = HeldCall(strategy, tmp_path, events, then=train)
    held.release.set()
    await held()
    assert events == ["init_fn", "ran", "init_fn done", "held call ended"]
    assert each_replica(strategy, results[0]) == [float(WORKERS * LOCAL)] * LOCAL


async def test_a_task_that_outlives_its_call_is_no_longer_in_it(
    make_strategy: MakeStrategy, tmp_path: Path
) -> None:
    """A task started within a call into a task group outside it carries on after the call
    has ended, and is no longer part of it: during another task's call, its read that needs a
    collective is refused, as any other task's is (within the call it would go ahead)."""
    strategy = make_strategy(LOCAL)
    events: list[str] = []
    go_on = anyio.Event()
    with strategy.scope():
        fresh = Variable(np.full(2, 3.0 + RANK), name="fresh")
    async with anyio.create_task_group() as tg:

        async def late_read() -> None:
            await go_on.wait()
            with pytest.raises(RuntimeError, match="another cross-worker call or collective"):
                fresh.numpy()
            events.append("late read refused")

        async def start_late_read() -> None:
            tg.start_soon(late_read)

        first = HeldCall(strategy, tmp_path / "first", events, then=start_late_read)
        first.release.set()
        await first()
        second = HeldCall(strategy, tmp_path / "second", events)
        tg.start_soon(second)
        await second.entered.wait()
        go_on.set()
        await anyio.wait_all_tasks_blocked()
        second.release.set()
    assert events == [
        *["init_fn", "init_fn done", "held call ended"],
        *["init_fn", "late read refused", "init_fn done", "held call ended"],
    ]
    np.testing.assert_array_equal(fresh.numpy(), np.full(2, 3.0))  # the chief's


async def test_a_call_goes_on_while_a_run_waits_for_it(
    make_strategy: MakeStrategy, tmp_path: Path
) -> None:
    """While a run() waits for another task's call, the call's own collectives go on, its
    synchronous reads (a sync-on-read variable's global value) included."""
    strategy = make_strategy(LOCAL)
    events: list[str] = []
    with strategy.scope():
        seen = Variable(
            np.full(2, 1.0 + RANK), name="seen", synchronization="on_read", aggregation="sum"
        )
    before = seen.numpy()  # (every variable made so far takes the chief's values now)

    async def read_and_reduce() -> None:
        np.testing.assert_array_equal(seen.numpy(), before)
        reduced = await strategy.reduce("sum", nested(1.0), axis=None)
        np.testing.assert_array_equal(reduced["f"], np.full(2, total(1.0), np.float32))
        events.append("read and reduced")

    held = HeldCall(strategy, tmp_path, events, then=read_and_reduce)

    async def step() -> None:
        events.append("step")

    async def run() -> None:
        await strategy.run(step)

    await held.beside(run)
    assert events == [
        "init_fn",
        "read and reduced",
        "init_fn done",
        "held call ended",
        *["step"] * LOCAL,
    ]


async def test_concurrent_calls_sync_new_variables_once(make_strategy: MakeStrategy) -> None:
    """Two tasks' reductions, started one after the other while new variables wait for their
    first sync: the first call gives them the chief's values, the second finds them synced
    (two syncs at once would both work through the same list of pending variables)."""
    strategy = make_strategy(LOCAL)
    with strategy.scope():
        made = [Variable(np.full(2, 10.0 * i + RANK), name=f"new{i}") for i in range(3)]
    results: dict[float, Any] = {}

    async def reduction(scale: float, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()  # (the reduction takes its turn before the next task starts)
        results[scale] = await strategy.reduce("sum", nested(scale), axis=None)

    async with anyio.create_task_group() as tg:
        await tg.start(reduction, 1.0)
        await tg.start(reduction, 2.0)
    for scale in (1.0, 2.0):
        np.testing.assert_array_equal(results[scale]["f"], np.full(2, total(scale), np.float32))
        np.testing.assert_array_equal(results[scale]["i"], np.full(3, int(total(scale))))
    for i, variable in enumerate(made):
        for copy in variable.values:
            np.testing.assert_array_equal(copy, np.full(2, 10.0 * i))  # the chief's
