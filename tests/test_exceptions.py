"""Exceptions, cancellation and context in one process, as an anyio/trio user expects them."""

from __future__ import annotations

import contextvars
import traceback
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import pytest
from event_loops import ASYNCIO_ONLY

from aioreplica import Checkpoint, MirroredStrategy, PerReplica, ReduceOp, Variable
from aioreplica.testing import host_devices, replica_context, replica_id

pytestmark = pytest.mark.anyio

user_var: contextvars.ContextVar[str] = contextvars.ContextVar("user_var", default="unset")


def noop(strategy: MirroredStrategy) -> None:
    return None


class TestSeveralReplicasRaising:
    async def test_every_replica_raising_after_one_round_is_noted(self) -> None:
        """Every replica raises right after its round completes (no await in between): run()
        raises one of them, the others summarised in notes, on every loop (each replica
        takes its part of the round before the run's cancellation reaches it)."""
        strategy = MirroredStrategy(host_devices(3))

        async def step() -> None:
            await replica_context().merge_call(noop)
            raise ValueError(f"replica {replica_id()} failed")

        with anyio.fail_after(5), pytest.raises(ValueError, match=r"^replica \d failed\n") as info:
            await strategy.run(step)
        assert not isinstance(info.value, BaseExceptionGroup)
        notes = info.value.__notes__
        first = int(str(info.value).split()[1])
        assert notes[0] == f"raised in replica {first} of 3 (device cpu:{first})"
        assert sorted(notes[1:]) == [
            f"also raised in replica {other}: ValueError: replica {other} failed"
            for other in sorted({0, 1, 2} - {first})
        ], notes
        assert strategy.statistics().runs_active == 0

    async def test_a_replica_whose_round_completed_gets_its_part_when_a_sibling_fails(
        self,
    ) -> None:
        """docs/concepts.md: a replica cancelled once its round's merge function ran with its
        part still gets its result (the cancellation fires at its next await), so it is never
        told that a write it took part in did not happen. Here the run's cancellation comes
        from replica 2 failing right after the round."""
        strategy = MirroredStrategy(host_devices(3))
        events: list[Any] = []

        def merge(s: MirroredStrategy, v: Any) -> Any:
            events.append(("merged", v.values))
            return v

        async def step() -> None:
            try:
                got = await replica_context().merge_call(merge, args=(replica_id(),))
            except BaseException as exc:
                events.append((replica_id(), "merge_call raised", type(exc).__name__))
                raise
            events.append((replica_id(), "got", got))
            if replica_id() == 2:
                raise ValueError("replica 2 failed")

        with anyio.fail_after(5), pytest.raises(ValueError, match="replica 2 failed"):
            await strategy.run(step)
        assert events[0] == ("merged", (0, 1, 2))
        assert sorted(events[1:]) == [(0, "got", 0), (1, "got", 1), (2, "got", 2)]

    async def test_sync_replicas_raising_at_once(self) -> None:
        """A plain-function step: as TF runs fn on every replica, every replica runs, on
        every loop (a replica not started yet when another fails still starts: the
        cancellation reaches it at its first wait, which a plain function never has)."""
        strategy = MirroredStrategy(host_devices(2))
        ran: list[int] = []

        def step() -> None:
            ran.append(replica_id())
            raise KeyError(replica_id())

        with anyio.fail_after(5), pytest.raises(KeyError) as info:
            await strategy.run(step)
        notes = info.value.__notes__
        assert sorted(ran) == [0, 1]
        assert len(notes) == 2, notes
        assert notes[0].startswith("raised in replica ")
        assert notes[1].startswith("also raised in replica ")

    async def test_different_types_first_wins_and_strategy_usable(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> int:
            if replica_id() == 0:
                await anyio.sleep(0.01)
                raise TypeError("late")
            raise ValueError("early")

        with anyio.fail_after(5), pytest.raises(ValueError, match="early") as info:
            await strategy.run(step)
        assert info.value.__notes__ == ["raised in replica 1 of 2 (device cpu:1)"]

        async def ok() -> Any:
            return await replica_context().merge_call(
                lambda s, v: sum(v.values), args=(replica_id() + 1,)
            )

        with anyio.fail_after(5):
            assert await strategy.run(ok) == 3


class TestBaseExceptions:
    @pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit, GeneratorExit])
    async def test_base_exception_in_a_replica_comes_out_unwrapped(
        self, raised: type[BaseException]
    ) -> None:
        strategy = MirroredStrategy(host_devices(2))
        events: list[str] = []

        async def step() -> None:
            if replica_id() == 1:
                await anyio.lowlevel.checkpoint()
                raise raised("boom")
            try:
                await replica_context().merge_call(noop)
            finally:
                events.append("replica 0 unwound")

        with anyio.fail_after(5), pytest.raises(raised) as info:
            await strategy.run(step)
        assert type(info.value) is raised
        assert info.value.__notes__ == ["raised in replica 1 of 2 (device cpu:1)"]
        assert events == ["replica 0 unwound"]
        assert strategy.statistics().runs_active == 0

    @pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
    async def test_base_exception_in_merge_fn_comes_out_once(
        self, raised: type[BaseException]
    ) -> None:
        strategy = MirroredStrategy(host_devices(2))
        calls: list[int] = []

        def merge(s: MirroredStrategy) -> None:
            calls.append(1)
            raise raised("in merge")

        async def step() -> None:
            await replica_context().merge_call(merge)

        with anyio.fail_after(5), pytest.raises(raised) as info:
            await strategy.run(step)
        assert type(info.value) is raised
        assert calls == [1]
        assert info.value.__notes__[0].startswith("raised by merge_fn")

    @ASYNCIO_ONLY  # trio.Cancelled cannot be raised by hand
    async def test_the_loops_cancellation_raised_by_hand_in_a_replica(self) -> None:
        """``raise anyio.get_cancelled_exc_class()()`` inside a replica with nothing cancelled."""
        strategy = MirroredStrategy(host_devices(2))
        cancelled = anyio.get_cancelled_exc_class()

        async def step() -> None:
            if replica_id() == 0:
                raise cancelled()
            await replica_context().merge_call(noop)

        with anyio.fail_after(5), pytest.raises(RuntimeError, match="replica 0 raised"):
            await strategy.run(step)


class TestStopIteration:
    async def test_stop_iteration_in_a_replica_is_a_runtime_error(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            await anyio.lowlevel.checkpoint()
            if replica_id() == 1:
                raise StopIteration
            await replica_context().merge_call(noop)

        with anyio.fail_after(5), pytest.raises(RuntimeError) as info:
            await strategy.run(step)
        assert "replica 1" in str(info.value) + "".join(getattr(info.value, "__notes__", []))
        assert isinstance(info.value.__cause__, StopIteration) or isinstance(
            info.value.__context__, StopIteration
        )

    async def test_stop_iteration_in_a_sync_step(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        def step() -> None:
            next(iter([]))

        with anyio.fail_after(5), pytest.raises(RuntimeError) as info:
            await strategy.run(step)
        assert "replica" in str(info.value) + "".join(getattr(info.value, "__notes__", []))

    async def test_stop_iteration_in_merge_fn(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        def merge(s: MirroredStrategy) -> None:
            raise StopIteration

        async def step() -> None:
            await replica_context().merge_call(merge)

        with anyio.fail_after(5), pytest.raises(RuntimeError) as info:
            await strategy.run(step)
        assert "merge_fn" in str(info.value) + "".join(getattr(info.value, "__notes__", []))

    async def test_stop_async_iteration_in_a_replica_is_raised_as_itself(self) -> None:
        """StopAsyncIteration is an ordinary Exception: raised unchanged, with the note."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            if replica_id() == 0:
                raise StopAsyncIteration("done")
            await replica_context().merge_call(noop)

        with anyio.fail_after(5), pytest.raises(StopAsyncIteration) as info:
            await strategy.run(step)
        assert info.value.__notes__ == ["raised in replica 0 of 2 (device cpu:0)"]


class TestMergeFnFailure:
    async def test_copies_agree_when_merge_fn_fails_after_an_update(self) -> None:
        """merge_fn updates one variable, then raises: the update stays (TF has no rollback)
        but must be all replicas' copies; every replica's copy agrees."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.zeros(3), name="v")

        async def merge(s: MirroredStrategy) -> None:
            await v.assign(np.ones(3))
            raise ValueError("merge failed")

        async def step() -> None:
            await replica_context().merge_call(merge)

        with anyio.fail_after(5), pytest.raises(ValueError, match="merge failed") as info:
            await strategy.run(step)
        assert info.value.__notes__[0].startswith("raised by merge_fn")
        copies = [np.asarray(c).tolist() for c in v.values]
        assert copies[0] == copies[1]

    async def test_merge_fn_raising_while_replicas_wait_cancels_them_all(self) -> None:
        strategy = MirroredStrategy(host_devices(3))
        events: list[str] = []

        def merge(s: MirroredStrategy) -> None:
            raise ValueError("merge failed")

        async def step() -> None:
            try:
                await replica_context().merge_call(merge)
                events.append("resumed")
            except anyio.get_cancelled_exc_class():
                events.append("cancelled")
                raise
            except ValueError:
                events.append("got the merge error")
                raise

        with anyio.fail_after(5), pytest.raises(ValueError, match="merge failed") as info:
            await strategy.run(step)
        assert len(info.value.__notes__) == 1
        assert "resumed" not in events
        assert strategy.statistics().runs_active == 0


class TestTimeoutsAround:
    async def test_fail_after_around_run(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        events: list[str] = []

        async def step() -> None:
            try:
                await replica_context().merge_call(noop)
                await anyio.sleep_forever()
            finally:
                events.append(f"{replica_id()} out")

        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.05):
                await strategy.run(step)
        assert sorted(events) == ["0 out", "1 out"]
        assert strategy.statistics().runs_active == 0

        async def ok() -> Any:
            return await replica_context().merge_call(
                lambda s, v: sum(v.values), args=(replica_id() + 1,)
            )

        with anyio.fail_after(5):
            assert await strategy.run(ok) == 3

    async def test_move_on_after_inside_a_replica_around_merge_call(self) -> None:
        """Replica 0 gives up on a merge point that replica 1 is late for; then both meet at the
        next one."""
        strategy = MirroredStrategy(host_devices(2))
        events: list[Any] = []

        def merge(s: MirroredStrategy, v: Any) -> Any:
            events.append(("merge", v.values))
            return v

        async def step() -> Any:
            if replica_id() == 0:
                with anyio.move_on_after(0.05) as scope:
                    await replica_context().merge_call(merge, args=(0,))
                events.append(("replica 0 timed out", scope.cancelled_caught))
                return await replica_context().merge_call(merge, args=(10,))
            await anyio.sleep(0.2)
            return await replica_context().merge_call(merge, args=(11,))

        with anyio.fail_after(5):
            result = await strategy.run(step)
        assert result.values == (10, 11)
        assert events == [("replica 0 timed out", True), ("merge", (10, 11))]

    async def test_fail_after_around_strategy_reduce_in_cross_replica(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with anyio.fail_after(5):
            got = await strategy.reduce(
                ReduceOp.SUM, PerReplica([np.ones(2), np.ones(2)]), axis=None
            )
        assert np.asarray(got).tolist() == [2.0, 2.0]

    @pytest.mark.parametrize(
        "call",
        [
            "reduce",
            "gather",
            "reduce_to",
            "batch_reduce_to",
            "broadcast_to",
            "update",
            "assign",
            "assign_add",
            "assign_sub",
        ],
    )
    async def test_a_cross_replica_call_in_a_cancelled_scope_is_a_checkpoint(
        self, call: str
    ) -> None:
        """Every awaited call is a checkpoint, as trio's and anyio's are: in a cancelled scope
        it raises the cancellation before it starts, and writes nothing."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.ones(2, np.float32))
        values = PerReplica([np.ones(2, np.float32), np.ones(2, np.float32)])
        calls: dict[str, Any] = {
            "reduce": lambda: strategy.reduce(ReduceOp.SUM, values, axis=None),
            "gather": lambda: strategy.gather(values, 0),
            "reduce_to": lambda: strategy.extended.reduce_to(ReduceOp.SUM, values, v),
            "batch_reduce_to": lambda: strategy.extended.batch_reduce_to(
                ReduceOp.SUM, [(values, v)]
            ),
            "broadcast_to": lambda: strategy.extended.broadcast_to(np.ones(2), v),
            "update": lambda: strategy.extended.update(
                v, lambda copy, x: copy.__setitem__(..., x), (np.zeros(2, np.float32),)
            ),
            "assign": lambda: v.assign(np.zeros(2, np.float32)),
            "assign_add": lambda: v.assign_add(np.ones(2, np.float32)),
            "assign_sub": lambda: v.assign_sub(np.ones(2, np.float32)),
        }
        reached: list[str] = []
        with anyio.CancelScope() as scope:
            scope.cancel()
            await calls[call]()
            reached.append(call)
        assert reached == []
        assert scope.cancelled_caught
        assert [copy.tolist() for copy in v.values] == [[1.0, 1.0], [1.0, 1.0]]

    @pytest.mark.parametrize("kind", ["mirrored", "sync-on-read"])
    async def test_a_write_in_a_replica_in_a_cancelled_scope_goes_on(self, kind: str) -> None:
        """Inside a replica, calls are no checkpoints (a merge round needs every replica):
        a write in a cancelled scope is made, on every replica, and the scope catches
        nothing."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            if kind == "mirrored":
                v = Variable(0.0, aggregation="sum")
            else:
                v = Variable(0.0, synchronization="on_read", aggregation="sum")
        caught: list[bool] = []

        async def step() -> None:
            with anyio.CancelScope() as scope:
                scope.cancel()
                await v.assign_add(np.float64(1.0))  # made in each replica
            caught.append(scope.cancelled_caught)

        with anyio.fail_after(5):
            await strategy.run(step)
        assert caught == [False, False]
        want = [2.0, 2.0] if kind == "mirrored" else [1.0, 1.0]
        assert [float(copy) for copy in v.values] == want

    async def test_shield_around_run_finishes(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        outer = anyio.CancelScope()

        async def step() -> Any:
            outer.cancel()
            await anyio.sleep(0.01)
            return await replica_context().merge_call(
                lambda s, v: sum(v.values), args=(replica_id() + 1,)
            )

        with anyio.fail_after(5):
            with outer:
                with anyio.CancelScope(shield=True):
                    result = await strategy.run(step)
                assert result == 3
                await anyio.lowlevel.checkpoint()
        assert outer.cancelled_caught

    async def test_cancelled_checkpoint_save_leaves_nothing_or_all(self, tmp_path: Any) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.arange(1000.0), name="v")
        ckpt = Checkpoint(v=v)
        with anyio.move_on_after(0) as scope:
            await ckpt.save(tmp_path / "ck")
        files = sorted(p.name for p in tmp_path.iterdir())
        assert scope.cancelled_caught or files
        with anyio.fail_after(5):
            path = await ckpt.save(tmp_path / "ck")
        await v.assign(np.zeros(1000))
        with anyio.fail_after(5):
            await Checkpoint(v=v).restore(path)
        assert v.numpy()[5] == 5.0

    async def test_shielded_checkpoint_save_in_cancelled_scope(self, tmp_path: Any) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.arange(10.0), name="v")
        ckpt = Checkpoint(v=v)
        with anyio.CancelScope() as scope:
            scope.cancel()
            with anyio.CancelScope(shield=True):
                path = await ckpt.save(tmp_path / "ck")
        assert path


class TestTaskGroupInsideAReplica:
    async def test_children_that_do_not_touch_the_strategy(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            results: list[int] = []

            async def child(i: int) -> None:
                await anyio.sleep(0.001)
                results.append(i)

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(child, i)
            return await replica_context().merge_call(
                lambda s, v: sum(v.values), args=(sum(results) + replica_id(),)
            )

        with anyio.fail_after(5):
            assert await strategy.run(step) == 7

    async def test_a_child_calling_a_collective_raises_runtime_error(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(replica_context().all_reduce, "sum", 1.0)

        # The task group wraps its child's error.
        with anyio.fail_after(5), pytest.raises(ExceptionGroup) as info:
            await strategy.run(step)
        assert info.group_contains(
            RuntimeError,
            match=r"^ctx\.all_reduce\(\) must be awaited by replica \d's own coroutine, not by "
            "a task it spawned",
            depth=1,
        )
        assert strategy.statistics().runs_active == 0

    async def test_child_failure_in_a_replica_task_group_has_replica_note(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            async def child() -> None:
                raise ValueError("child failed")

            async with anyio.create_task_group() as tg:
                tg.start_soon(child)

        with anyio.fail_after(5), pytest.raises(BaseExceptionGroup) as info:
            await strategy.run(step)
        assert info.value.__notes__[0].startswith("raised in replica ")


class TestContextVars:
    async def test_a_var_set_before_run_is_seen_in_every_replica_and_merge_fn(self) -> None:
        strategy = MirroredStrategy(host_devices(3))
        seen: list[Any] = []

        def merge(s: MirroredStrategy) -> None:
            seen.append(("merge", user_var.get()))

        async def step() -> None:
            seen.append((replica_id(), user_var.get()))
            await replica_context().merge_call(merge)

        token = user_var.set("outer")
        try:
            with anyio.fail_after(5):
                await strategy.run(step)
        finally:
            user_var.reset(token)
        assert sorted(seen, key=repr) == sorted(
            [(0, "outer"), (1, "outer"), (2, "outer"), ("merge", "outer")], key=repr
        )

    async def test_a_set_in_one_replica_does_not_leak(self) -> None:
        strategy = MirroredStrategy(host_devices(3))
        seen: list[Any] = []

        async def step() -> None:
            user_var.set(f"replica {replica_id()}")
            await replica_context().merge_call(noop)
            await anyio.lowlevel.checkpoint()
            seen.append((replica_id(), user_var.get()))

        with anyio.fail_after(5):
            await strategy.run(step)
        assert sorted(seen) == [(i, f"replica {i}") for i in range(3)]
        assert user_var.get() == "unset"

    async def test_a_sync_step_setting_a_var_does_not_leak(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        seen: list[Any] = []

        def step() -> None:
            seen.append(user_var.get())
            user_var.set(f"replica {replica_id()}")

        with anyio.fail_after(5):
            await strategy.run(step)
            await strategy.run(step)
        assert seen == ["unset"] * 4
        assert user_var.get() == "unset"

    async def test_to_thread_sees_the_replica_context_and_var(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        token = user_var.set("outer")

        def in_thread() -> tuple[str, int | None]:
            import aioreplica

            ctx = aioreplica.get_replica_context()
            return user_var.get(), None if ctx is None else ctx.replica_id_in_sync_group

        async def step() -> Any:
            return await anyio.to_thread.run_sync(in_thread)

        try:
            with anyio.fail_after(5):
                result = await strategy.run(step)
        finally:
            user_var.reset(token)
        assert result[0] == "outer"
        assert result[1].values == (0, 1)


class TestThreads:
    async def test_from_thread_run_inside_a_replica(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def back_on_loop(x: int) -> int:
            await anyio.lowlevel.checkpoint()
            return x * 10

        def in_thread(x: int) -> int:
            return anyio.from_thread.run(back_on_loop, x)

        async def step() -> Any:
            got = await anyio.to_thread.run_sync(in_thread, replica_id())
            return await replica_context().merge_call(lambda s, v: sum(v.values), args=(got,))

        with anyio.fail_after(5):
            assert await strategy.run(step) == 10

    async def test_merge_call_from_a_worker_thread_through_from_thread_run(
        self, anyio_backend: Any
    ) -> None:
        """A replica's ``merge_call`` awaited through ``anyio.from_thread.run`` from a thread
        the replica waits on: asyncio runs it in a task of its own, which is refused, naming
        the replica; trio runs it in the replica's own task (``trio.from_thread.run`` reuses
        the task that waits in ``to_thread.run_sync``), so there it is the replica's call."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            ctx = replica_context()

            async def merge_from_loop() -> Any:
                return await ctx.merge_call(lambda s, v: sum(v.values), args=(replica_id() + 1,))

            def in_thread() -> Any:
                return anyio.from_thread.run(merge_from_loop)

            return await anyio.to_thread.run_sync(in_thread)

        if anyio_backend[0] == "trio":
            with anyio.fail_after(5):
                assert await strategy.run(step) == 3
            return
        with anyio.fail_after(5), pytest.raises(RuntimeError) as info:
            await strategy.run(step)
        assert str(info.value).startswith("merge_call() must be awaited by replica ")
        assert "own coroutine, not by a task it spawned" in str(info.value)

    async def test_run_called_from_a_worker_thread(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Any:
            return await replica_context().merge_call(
                lambda s, v: sum(v.values), args=(replica_id() + 3,)
            )

        def in_thread() -> Any:
            return anyio.from_thread.run(strategy.run, step)

        with anyio.fail_after(5):
            assert await anyio.to_thread.run_sync(in_thread) == 7

    async def test_run_failing_from_a_worker_thread(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            raise ValueError(f"r{replica_id()}")

        def in_thread() -> Any:
            return anyio.from_thread.run(strategy.run, step)

        with anyio.fail_after(5), pytest.raises(ValueError, match=r"^r\d\n") as info:
            await anyio.to_thread.run_sync(in_thread)
        assert info.value.__notes__[0].startswith("raised in replica ")


class TestTracebacks:
    async def test_the_traceback_shows_the_users_line(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def my_failing_step() -> None:
            await replica_context().merge_call(noop)
            raise ValueError("here")  # MARK-USER-LINE

        with anyio.fail_after(5), pytest.raises(ValueError, match=r"^here\n") as info:
            await strategy.run(my_failing_step)
        text = "".join(traceback.format_exception(info.value))
        assert "MARK-USER-LINE" in text
        assert "my_failing_step" in text

    async def test_the_traceback_of_merge_fn_shows_the_users_line(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        def my_merge(s: MirroredStrategy) -> None:
            raise ValueError("merge here")  # MARK-MERGE-LINE

        async def step() -> None:
            await replica_context().merge_call(my_merge)

        with anyio.fail_after(5), pytest.raises(ValueError, match=r"^merge here\n") as info:
            await strategy.run(step)
        text = "".join(traceback.format_exception(info.value))
        assert "MARK-MERGE-LINE" in text

    @pytest.mark.parametrize("chained", ["explicit", "implicit"])
    async def test_cause_and_context_are_kept(self, chained: str) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            await anyio.lowlevel.checkpoint()
            try:
                {"present": 1}["missing"]
            except KeyError as exc:
                if chained == "explicit":
                    raise ValueError("explicit") from exc
                raise ValueError("implicit")  # noqa: B904
            await replica_context().merge_call(noop)

        with anyio.fail_after(5), pytest.raises(ValueError, match=f"^{chained}\n") as info:
            await strategy.run(step)
        if chained == "explicit":
            assert isinstance(info.value.__cause__, KeyError)
        else:
            assert info.value.__cause__ is None
        assert isinstance(info.value.__context__, KeyError)

    async def test_the_replicas_exception_has_no_cancellation_as_context(self) -> None:
        """The raised exception's __context__ must not be the library's internal
        cancellation (that would show "During handling of the above exception" noise)."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            if replica_id() == 0:
                await anyio.sleep(0.01)
                raise ValueError("plain")
            await anyio.sleep_forever()

        with anyio.fail_after(5), pytest.raises(ValueError, match=r"^plain\n") as info:
            await strategy.run(step)
        assert info.value.__context__ is None
        assert info.value.__cause__ is None


class TestCallersCancellationDuringASyncMerge:
    async def test_parked_replicas_get_their_part(self) -> None:
        """The caller's scope is cancelled while a (plain) merge_fn runs with every replica's
        part: each replica is still handed its result (the cancellation fires at its next
        await), as docs/concepts.md "All or nothing" promises."""
        strategy = MirroredStrategy(host_devices(3))
        caller = anyio.CancelScope()
        events: list[Any] = []

        def merge(s: MirroredStrategy, v: Any) -> Any:
            caller.cancel()
            events.append(("merged", v.values))
            return v

        async def step() -> None:
            try:
                got = await replica_context().merge_call(merge, args=(replica_id(),))
            except BaseException as exc:
                events.append((replica_id(), "merge_call raised", type(exc).__name__))
                raise
            events.append((replica_id(), "got", got))
            await anyio.sleep_forever()

        with anyio.fail_after(5), caller:
            await strategy.run(step)
        assert caller.cancelled_caught
        assert events[0] == ("merged", (0, 1, 2))
        assert sorted(events[1:]) == [(0, "got", 0), (1, "got", 1), (2, "got", 2)]
