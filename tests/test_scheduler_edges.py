"""The scheduler and the write engine at their edges: writers on several threads' event loops,
what a failed run leaves behind, notes on an exception raised again, misuse inside merge_fn."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import pytest

from aioreplica import MirroredStrategy, PerReplica, ReplicaSyncError, Variable, optimizers
from aioreplica._backends._numpy import INLINE_BYTES
from aioreplica.testing import host_devices, replica_context, replica_id

pytestmark = pytest.mark.anyio

#: Big enough that computing a write awaits a device's worker thread (host work that reads
#: INLINE_BYTES or more is not done inline), so the write holds its turn meanwhile.
BIG = INLINE_BYTES // 8


def noop(strategy: MirroredStrategy) -> None:
    return None


class Payload:
    """What a replica's frame holds, watched through a weak reference."""


class TestWritesFromSeveralThreads:
    async def test_a_write_queued_on_another_threads_loop_takes_its_turn(
        self, anyio_backend: tuple[str, dict[str, Any]]
    ) -> None:
        """A write waiting on another thread's event loop (a threaded server calling anyio.run
        per request) is woken there when the write before it commits, and the turn ends free."""
        backend, options = anyio_backend
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.zeros(BIG))
        computing, go_on, queued = threading.Event(), threading.Event(), threading.Event()
        events: list[str] = []

        def held_add(copy: Any, amount: float) -> Any:  # on the device's worker thread
            computing.set()
            assert go_on.wait(10), "the test never let the first write go on"
            events.append("first computed")
            return copy + amount

        async def add_second() -> None:
            await v.assign_add(10.0)
            events.append("second written")

        async def queue_second() -> None:
            async with anyio.create_task_group() as group:
                group.start_soon(add_second)
                await anyio.wait_all_tasks_blocked()  # waiting for the turn
                queued.set()

        thread = threading.Thread(
            target=anyio.run,
            args=(queue_second,),
            kwargs={"backend": backend, "backend_options": options},
            daemon=True,
        )
        async with anyio.create_task_group() as group:
            group.start_soon(strategy.extended.update, v, held_add, (1.0,))
            assert await anyio.to_thread.run_sync(computing.wait, 10)
            thread.start()
            assert await anyio.to_thread.run_sync(queued.wait, 10)
            go_on.set()
        await anyio.to_thread.run_sync(thread.join, 10)
        assert not thread.is_alive(), "the write on the other thread's loop was never woken"
        with anyio.fail_after(5):
            await v.assign_add(100.0)  # a later writer finds the turn free
        assert events == ["first computed", "second written"]
        assert np.all(v.numpy() == 111.0)


async def failed_without_collection(
    strategy: MirroredStrategy, step: Any, held: list[weakref.ref[Payload]]
) -> tuple[list[str], list[bool]]:
    """The message of the ValueError that ``strategy.run(step)`` raised, once dropped, and
    whether each payload in ``held`` is still alive then, with cycle collection off: what
    reference counting alone frees."""
    messages: list[str] = []
    gc.collect()
    gc.disable()
    try:
        try:
            await strategy.run(step)
        except ValueError as exc:
            messages.append(str(exc))
        alive = [ref() is not None for ref in held]
    finally:
        gc.enable()
    return messages, alive


class TestFailedRun:
    async def test_a_dropped_failure_frees_every_replicas_frame(self) -> None:
        """Once the caller drops the exception of a failed run(), the replicas' frames (and what
        they hold) are freed by reference counting, with no cycle collection."""
        strategy = MirroredStrategy(host_devices(2))
        held: list[weakref.ref[Payload]] = []
        blocked = anyio.Event()

        async def step() -> None:
            payload = Payload()
            held.append(weakref.ref(payload))
            await replica_context().merge_call(noop)
            if replica_id() == 0:
                blocked.set()
                await anyio.sleep_forever()  # cancelled when replica 1 fails
            await blocked.wait()
            raise ValueError("replica 1 failed")

        assert await failed_without_collection(strategy, step, held) == (
            ["replica 1 failed"],
            [False, False],
        )

    async def test_a_dropped_failure_frees_a_replica_cancelled_at_a_merge_point(self) -> None:
        """As above, for a replica that the failure cancels while it is parked at a merge
        point (the loop adapters' gates must not hold the cancellation either)."""
        strategy = MirroredStrategy(host_devices(2))
        held: list[weakref.ref[Payload]] = []

        async def step() -> None:
            payload = Payload()
            held.append(weakref.ref(payload))
            await replica_context().merge_call(noop)
            if replica_id() == 1:
                raise ValueError("replica 1 failed")
            await replica_context().merge_call(noop)  # parked here when replica 1 fails

        assert await failed_without_collection(strategy, step, held) == (
            ["replica 1 failed"],
            [False, False],
        )

    async def test_an_exception_raised_again_carries_one_runs_notes(self) -> None:
        """The same exception object, raised by every replica in every run, carries the notes
        of the run that raised it last, and any the program added itself."""
        strategy = MirroredStrategy(host_devices(3))
        sentinel = ValueError("the same object every time")  # as a module-level one would be

        async def step() -> None:
            await anyio.lowlevel.checkpoint()
            raise sentinel

        notes: list[list[str]] = []
        for run in range(3):
            with pytest.raises(ValueError, match="the same object every time") as info:
                await strategy.run(step)
            assert info.value is sentinel
            notes.append(list(info.value.__notes__))
            if run == 1:
                info.value.add_note("the program's own")
        assert [len(run_notes) for run_notes in notes] == [1, 1, 2]
        assert all(run_notes[-1].startswith("raised in replica ") for run_notes in notes)
        assert notes[2][0] == "the program's own"

    async def test_a_run_inside_merge_fn_keeps_the_notes_of_both_runs(self) -> None:
        """A failure of a run() made inside merge_fn, raised on by the run around it, keeps
        the inner run's note (which replica) beside the outer run's (which merge_fn): only
        runs that started before the one raising lose their notes."""
        strategy = MirroredStrategy(host_devices(2))

        def inner() -> None:
            if replica_id() == 1:
                raise ValueError("inner failure")

        async def merge_fn(s: MirroredStrategy) -> None:
            await s.run(inner)

        async def outer() -> None:
            await replica_context().merge_call(merge_fn)

        with pytest.raises(ValueError, match="inner failure") as info:
            await strategy.run(outer)
        notes = list(info.value.__notes__)
        assert len(notes) == 2, notes
        assert notes[0].startswith("raised in replica 1 of 2 (device "), notes
        assert notes[1].startswith("raised by merge_fn "), notes
        assert ".<locals>.merge_fn (" in notes[1], notes


class TestMisuseInMergeFn:
    async def test_a_collective_inside_merge_fn_is_named(self) -> None:
        """A replica context's collective awaited inside merge_fn is named as the call made,
        with the cross-replica forms to use there instead."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            ctx = replica_context()

            async def merge(merge_strategy: MirroredStrategy, ids: PerReplica[int]) -> Any:
                return await ctx.all_reduce("sum", 1.0)

            await ctx.merge_call(merge, args=(replica_id(),))

        with pytest.raises(RuntimeError) as info:
            await strategy.run(step)
        assert str(info.value) == (
            "ctx.all_reduce() was called inside merge_fn (cross-replica context) with the context "
            "of replica 0; a replica context's collectives are merge calls, and merge functions "
            "cannot nest: in merge_fn, pass its arguments (every replica's values) to the "
            "cross-replica forms, `await strategy.reduce(...)`, `strategy.gather(...)`, "
            "`strategy.extended.reduce_to(...)` or `batch_reduce_to(...)` (a barrier is not "
            "needed there: every replica has arrived)"
        )

    async def test_an_optimizer_made_in_each_replica_is_named(self) -> None:
        """An optimizer made inside the step function is one per replica: its step's merge
        functions are one method of two objects, which the error names, with the fix (and no
        note claiming the replicas made different calls); nothing changes."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.zeros(2), name="v")

        async def step() -> None:
            opt = optimizers.SGD(0.1)
            await opt.apply_gradients([(np.ones(2), v)])

        with pytest.raises(ReplicaSyncError) as raised:
            await strategy.run(step)
        message = str(raised.value)
        assert "of another SGD object (each replica made its own SGD: one made inside the " in (
            message
        )
        assert "make it once, outside run())" in message
        assert not any("different calls" in note for note in raised.value.__notes__)
        assert v.numpy().tolist() == [0.0, 0.0]
