"""Cancellation means what it says: the run's, the caller's, or a replica's own, on every loop."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from event_loops import ASYNCIO_ONLY

from aioreplica import MirroredStrategy, ReplicaSyncError
from aioreplica.testing import host_devices, replica_context, replica_id

pytestmark = pytest.mark.anyio


def noop(strategy: MirroredStrategy) -> None:
    return None


@ASYNCIO_ONLY
class TestAReplicasOwnCancellation:
    """A ``CancelledError`` that replica code raises itself is that replica's failure."""

    async def test_before_a_merge_point_fails_the_run_naming_the_replica(self) -> None:
        strategy = MirroredStrategy(host_devices(3))

        async def step() -> None:
            if replica_id() == 1:
                raise asyncio.CancelledError
            await replica_context().merge_call(noop)

        with anyio.fail_after(5), pytest.raises(RuntimeError) as info:
            await strategy.run(step)
        assert "replica 1 raised CancelledError although its run() was not cancelled" in str(
            info.value
        )
        assert isinstance(info.value.__cause__, asyncio.CancelledError)
        assert info.value.__notes__ == ["raised in replica 1 of 3 (device cpu:1)"]
        assert strategy.statistics().runs_active == 0

    async def test_without_merge_points_it_is_not_a_result(self) -> None:
        """Today's bug: the replica's result silently became ``None``."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> int:
            await anyio.lowlevel.checkpoint()
            if replica_id() == 0:
                raise asyncio.CancelledError
            return replica_id()

        with anyio.fail_after(5), pytest.raises(RuntimeError, match="replica 0 raised Cancelled"):
            await strategy.run(step)

    async def test_from_an_inner_task_that_was_cancelled(self) -> None:
        """The usual way it happens: awaiting a task that something else cancelled."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            if replica_id() == 1:
                inner = asyncio.ensure_future(asyncio.sleep(10))
                inner.cancel()
                await inner
            await replica_context().merge_call(noop)

        with anyio.fail_after(5), pytest.raises(RuntimeError, match="replica 1 raised"):
            await strategy.run(step)

    async def test_in_merge_fn_it_names_the_merge_function(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        def cancels(strategy: MirroredStrategy) -> None:
            raise asyncio.CancelledError

        async def step() -> None:
            await replica_context().merge_call(cancels)

        with anyio.fail_after(5), pytest.raises(RuntimeError) as info:
            await strategy.run(step)
        assert "merge_fn" in str(info.value)
        assert "cancels" in str(info.value)
        assert info.value.__notes__[0].startswith("raised by merge_fn")

    async def test_the_callers_cancellation_is_still_a_cancellation(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        events: list[str] = []

        async def step() -> None:
            try:
                await replica_context().merge_call(noop)
                await anyio.sleep_forever()
            except asyncio.CancelledError:
                events.append(f"replica {replica_id()} cancelled")
                raise

        with anyio.move_on_after(0.05) as scope:
            await strategy.run(step)
        assert scope.cancelled_caught
        assert sorted(events) == ["replica 0 cancelled", "replica 1 cancelled"]

    @pytest.mark.parametrize("order", ["replicas first", "caller first"])
    async def test_every_task_cancelled_at_once_is_the_callers_cancellation(
        self, order: str
    ) -> None:
        """Cancelling every task at once, as asyncio.run()'s shutdown and a runner's close do
        (a replica's bare ``Task.cancel()`` may come before its caller's): run() raises the
        caller's cancellation, not a replica's "own cancellation" RuntimeError, in either
        order."""
        strategy = MirroredStrategy(host_devices(2))
        events: list[str] = []

        async def step() -> None:
            if replica_id() == 1:
                await anyio.sleep_forever()
            await replica_context().merge_call(noop)

        async def caller() -> None:
            try:
                await strategy.run(step)
            except asyncio.CancelledError:
                events.append("run() raised CancelledError")
                raise
            except Exception as exc:
                events.append(f"run() raised {type(exc).__name__}")
                raise

        before = asyncio.all_tasks()
        task = asyncio.ensure_future(caller())
        with anyio.fail_after(5):
            await anyio.wait_all_tasks_blocked()
            replicas = [t for t in asyncio.all_tasks() - before if t is not task]
            assert len(replicas) == 2
            for victim in [*replicas, task] if order == "replicas first" else [task, *replicas]:
                victim.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        assert events == ["run() raised CancelledError"]


class TestCancelledOnceItsRoundIsDone:
    """A cancellation that reaches a parked replica once its round has committed its part (the
    merge function ran with it) does not tell it otherwise: the replica takes its part, and
    the cancellation fires at its next checkpoint, as trio does for an operation that
    completed."""

    @pytest.mark.parametrize("checkpoint", [True, False])
    async def test_the_replica_takes_its_part_and_is_cancelled_next(self, checkpoint: bool) -> None:
        strategy = MirroredStrategy(host_devices(2))
        scopes: list[anyio.CancelScope] = []  # in arrival order
        events: list[Any] = []

        def merge(strategy: MirroredStrategy, value: Any) -> Any:
            scopes[0].cancel()  # the first arrival is parked: cancelled as its round completes
            events.append(("merged", value.values))
            return value

        async def step() -> int:
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                result: int = await replica_context().merge_call(merge, args=(replica_id(),))
                if scope.cancel_called:
                    events.append(("the first arrival got its part", result == replica_id()))
                if checkpoint:
                    await anyio.lowlevel.checkpoint()
                    if scope.cancel_called:
                        events.append("not reached")
            if scope.cancel_called:
                events.append(("cancelled at a checkpoint", scope.cancelled_caught))
            await anyio.lowlevel.checkpoint()  # nothing of the cancellation is left over
            return result

        with anyio.fail_after(5):
            assert (await strategy.run(step)).values == (0, 1)
        assert events == [
            ("merged", (0, 1)),
            ("the first arrival got its part", True),
            ("cancelled at a checkpoint", checkpoint),
        ]

    async def test_a_merge_call_after_it_is_a_checkpoint(self) -> None:
        """The next merge_call of a replica whose cancellation waits raises it, never joins
        the round (a last arrival completes a round without waiting: no loop would see it)."""
        strategy = MirroredStrategy(host_devices(2))
        scopes: list[anyio.CancelScope] = []  # in arrival order
        events: list[str] = []

        def merge(strategy: MirroredStrategy) -> None:
            if len(scopes) == 2:
                scopes[0].cancel()

        async def step() -> None:
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                await replica_context().merge_call(merge)
                await replica_context().merge_call(merge)
            events.append(f"cancelled: {scope.cancelled_caught}")

        with anyio.fail_after(5), pytest.raises(ReplicaSyncError) as info:
            await strategy.run(step)
        assert events == ["cancelled: True"]
        assert info.value.merge_number == 2
        assert "finished after 1 merge_call()s" in str(info.value)

    async def test_while_an_async_merge_fn_runs_the_replica_waits_for_it(self) -> None:
        """Cancelled while the merge function (async) runs with its part, the replica waits
        for it instead of leaving: merge_fn runs once, and every replica gets its part."""
        strategy = MirroredStrategy(host_devices(2))
        scopes: list[anyio.CancelScope] = []  # in arrival order
        events: list[Any] = []

        async def merge(strategy: MirroredStrategy, value: Any) -> Any:
            events.append(("merge", value.values))
            await anyio.lowlevel.checkpoint()
            scopes[0].cancel()  # the first arrival is parked, its part in this merge
            await anyio.sleep(0.01)
            events.append("merged")
            return value

        async def step() -> int:
            while True:  # retry what was cancelled: here, nothing
                with anyio.CancelScope() as scope:
                    scopes.append(scope)
                    result: int = await replica_context().merge_call(merge, args=(replica_id(),))
                    events.append(("got its part", result == replica_id()))
                    return result
                events.append("retried")

        with anyio.fail_after(5):
            assert (await strategy.run(step)).values == (0, 1)
        assert events == [("merge", (0, 1)), "merged", *[("got its part", True)] * 2]

    @pytest.mark.parametrize("interleave", ["ordered", "random"])
    async def test_the_replica_running_an_async_merge_fn_runs_it_to_the_end(
        self, interleave: str
    ) -> None:
        """The last arrival runs the (async) merge function; cancelled meanwhile, it runs it to
        the end in a shield, takes its part, and is cancelled at its next checkpoint (it used
        to be told its merge did not happen, and trio's retry loops never ended)."""
        strategy = MirroredStrategy(
            host_devices(2),
            interleave=interleave,  # type: ignore[arg-type]
            seed=0 if interleave == "random" else None,
        )
        scopes: list[anyio.CancelScope] = []  # in arrival order
        events: list[Any] = []

        async def merge(strategy: MirroredStrategy, value: Any) -> Any:
            events.append(("merge", value.values))
            scopes[-1].cancel()  # the last arrival: the replica running this merge function
            await anyio.sleep(0.01)
            await anyio.lowlevel.checkpoint()
            events.append("merged")
            return value

        async def step() -> int:
            while True:  # retry what was cancelled: here, nothing
                got = False
                with anyio.CancelScope() as scope:
                    scopes.append(scope)
                    result: int = await replica_context().merge_call(merge, args=(replica_id(),))
                    got = True
                    events.append(("got its part", result == replica_id()))
                    await anyio.lowlevel.checkpoint()
                if got:
                    events.append(("cancelled at its checkpoint", scope.cancelled_caught))
                    return result
                events.append("retried")

        with anyio.fail_after(5):
            assert (await strategy.run(step)).values == (0, 1)
        assert events[:2] == [("merge", (0, 1)), "merged"]
        assert sorted(events[2:]) == [
            ("cancelled at its checkpoint", False),
            ("cancelled at its checkpoint", True),
            ("got its part", True),
            ("got its part", True),
        ]
        with anyio.fail_after(5):  # the strategy goes on as before
            assert (await strategy.run(step)).values == (0, 1)

    async def test_the_callers_cancellation_still_stops_an_async_merge_fn(self) -> None:
        """The shield that holds off the last arrival's own cancellation keeps out neither the
        caller's cancellation nor a failing run's: the merge function stops, on every loop."""
        strategy = MirroredStrategy(host_devices(2))
        caller = anyio.CancelScope()
        events: list[str] = []

        async def merge(strategy: MirroredStrategy) -> None:
            events.append("merge started")
            caller.cancel()
            try:
                await anyio.sleep_forever()
            finally:
                events.append("merge stopped")

        async def step() -> None:
            await replica_context().merge_call(merge)
            events.append("not reached")

        with anyio.fail_after(5), caller:
            await strategy.run(step)
        assert caller.cancelled_caught
        assert events == ["merge started", "merge stopped"]
        assert strategy.statistics().runs_active == 0

    @pytest.mark.parametrize("shielded", ["checkpoint", "merge_call"])
    async def test_its_next_step_inside_a_shield_is_not_cancelled(self, shielded: str) -> None:
        """The cancellation that waits for the replica's next checkpoint does not pass an
        anyio shield there: it fires at the first checkpoint after it."""
        strategy = MirroredStrategy(host_devices(2))
        arrivals: list[tuple[int, anyio.CancelScope]] = []
        events: list[Any] = []

        def merge(strategy: MirroredStrategy, value: Any) -> Any:
            if not events:
                arrivals[0][1].cancel()  # the first arrival is parked: its round is done
                events.append("cancelled the first arrival")
            return value

        async def step() -> int:
            with anyio.CancelScope() as scope:
                arrivals.append((replica_id(), scope))
                result: int = await replica_context().merge_call(merge, args=(replica_id(),))
                with anyio.CancelScope(shield=True):
                    if shielded == "checkpoint":
                        await anyio.lowlevel.checkpoint()
                    else:
                        await replica_context().merge_call(merge, args=(replica_id(),))
                    events.append(("shielded part done", replica_id()))
                await anyio.lowlevel.checkpoint()
                events.append(("not cancelled", replica_id()))
            events.append(("after its scope", replica_id(), scope.cancelled_caught))
            return result

        with anyio.fail_after(5):
            assert (await strategy.run(step)).values == (0, 1)
        first, second = (replica for replica, _ in arrivals)
        assert events[0] == "cancelled the first arrival"
        assert sorted(events[1:], key=repr) == sorted(
            [
                ("shielded part done", first),
                ("shielded part done", second),
                ("not cancelled", second),
                ("after its scope", first, True),
                ("after its scope", second, False),
            ],
            key=repr,
        )

    @ASYNCIO_ONLY
    @pytest.mark.parametrize("checkpoint", [True, False])
    async def test_an_expiring_asyncio_timeout_fires_at_the_next_await(
        self, checkpoint: bool
    ) -> None:
        """``asyncio.timeout`` cancels once: the cancellation is requested again for the next
        await inside it, and dropped if the block ends first (its exit withdraws it)."""
        strategy = MirroredStrategy(host_devices(2))
        timeouts: list[asyncio.Timeout] = []
        events: list[Any] = []

        def merge(strategy: MirroredStrategy, value: Any) -> Any:
            # Expires before replica 0 resumes, after its round is done.
            timeouts[0].reschedule(asyncio.get_running_loop().time() - 1)
            return value

        async def step() -> int:
            if replica_id() == 1:
                result: int = await replica_context().merge_call(merge, args=(1,))
                return result
            try:
                async with asyncio.timeout(None) as timeout:
                    timeouts.append(timeout)
                    result = await replica_context().merge_call(merge, args=(0,))
                    events.append(("replica 0 got", result))
                    if checkpoint:
                        await asyncio.sleep(0)
                        events.append("not reached")
            except TimeoutError:
                events.append("timed out")
            await asyncio.sleep(0)  # nothing of the cancellation is left over
            events.append("done")
            return result

        with anyio.fail_after(5):
            assert (await strategy.run(step)).values == (0, 1)
        assert events == [("replica 0 got", 0), *(["timed out"] if checkpoint else []), "done"]


class TestTheCallersCancellation:
    """What cancelling the caller of run() does besides cancelling every replica."""

    @pytest.mark.parametrize("raised", [ValueError, KeyboardInterrupt])
    async def test_a_replica_failing_meanwhile_is_raised(self, raised: type[BaseException]) -> None:
        """A replica whose cleanup raises (an error, or a KeyboardInterrupt) while the caller's
        cancellation unwinds it: run() raises that failure, as a task group does, instead of
        losing it."""
        strategy = MirroredStrategy(host_devices(2))
        caller = anyio.CancelScope()

        async def step() -> None:
            try:
                await anyio.lowlevel.checkpoint()
                if replica_id() == 0:
                    caller.cancel()
                await anyio.sleep_forever()
            finally:
                if replica_id() == 1:
                    raise raised("cleanup failed")

        with anyio.fail_after(5), pytest.raises(raised, match="cleanup failed") as info, caller:
            await strategy.run(step)
        assert info.value.__notes__ == ["raised in replica 1 of 2 (device cpu:1)"]
        assert strategy.statistics().runs_active == 0

    async def test_a_run_in_a_cancelled_scope_raises_before_any_replica_starts(self) -> None:
        """As any await in a cancelled scope does, on every loop."""
        strategy = MirroredStrategy(host_devices(2))
        started: list[int] = []

        def step() -> int:
            started.append(replica_id())
            return 1

        with anyio.CancelScope() as scope:
            scope.cancel()
            await strategy.run(step)
        assert scope.cancelled_caught
        assert started == []


class TestShields:
    """A replica inside an anyio shield finishes the shielded part before run() ends, on every
    loop, whether the run fails or its caller is cancelled."""

    async def test_a_failing_sibling_waits_for_the_shield(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        events: list[str] = []

        async def step() -> None:
            if replica_id() == 0:
                await anyio.sleep(0.01)
                raise ValueError("replica 0 fails")
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.1)
                events.append("shielded part done")
            events.append("after the shield")  # no checkpoint between: still runs
            await anyio.lowlevel.checkpoint()
            events.append("unreachable: cancelled at the checkpoint")

        with anyio.fail_after(5), pytest.raises(ValueError, match="replica 0 fails"):
            await strategy.run(step)
        events.append("run() raised")
        assert events == ["shielded part done", "after the shield", "run() raised"]

    async def test_a_worker_thread_finishes_before_run_returns(self) -> None:
        """``anyio.to_thread.run_sync`` shields its wait: its side effect is never late."""
        strategy = MirroredStrategy(host_devices(2))
        events: list[str] = []
        started = threading.Event()

        def work() -> None:
            started.set()
            time.sleep(0.1)
            events.append("thread done")

        async def step() -> None:
            if replica_id() == 0:
                await anyio.to_thread.run_sync(started.wait)
                raise ValueError("replica 0 fails")
            await anyio.to_thread.run_sync(work)

        with anyio.fail_after(5), pytest.raises(ValueError, match="replica 0 fails"):
            await strategy.run(step)
        events.append("run() raised")
        assert events == ["thread done", "run() raised"]

    async def test_the_callers_cancellation_waits_for_the_shield(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        events: list[str] = []

        async def step() -> None:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.1)
                events.append(f"replica {replica_id()} shielded part done")
            await anyio.sleep_forever()

        with anyio.fail_after(5), anyio.move_on_after(0.02) as scope:
            await strategy.run(step)
        events.append("scope left")
        assert scope.cancelled_caught
        assert sorted(events[:2]) == [
            "replica 0 shielded part done",
            "replica 1 shielded part done",
        ]
        assert events[2:] == ["scope left"]


class TestMergePointInsideAShield:
    """A replica waiting at a merge point inside a shield cannot be cancelled; when the run
    fails, that round can never complete: the replica leaves it, and run() raises the failure
    (it used to hang, past any deadline around it)."""

    async def test_another_replica_fails(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        ended: list[str] = []

        async def step() -> None:
            if replica_id() == 1:
                await anyio.sleep(0.05)
                raise ValueError("replica 1 fails")
            try:
                with anyio.CancelScope(shield=True):
                    await replica_context().merge_call(noop)
            finally:
                ended.append("replica 0 left the merge point")

        with anyio.fail_after(5), pytest.raises(ValueError, match="replica 1 fails") as info:
            await strategy.run(step)
        assert info.value.__notes__ == ["raised in replica 1 of 2 (device cpu:1)"]
        assert ended == ["replica 0 left the merge point"]

    async def test_a_siblings_own_cancellation_does_not_reach_it(self) -> None:
        """A cleanup merge_call in a shield, in the ``finally`` of a cancelled scope, stays in
        its round when a sibling parked there is cancelled by its own scope and comes back
        (asyncio took the sibling's cancellation for the shielded replica's own)."""
        strategy = MirroredStrategy(host_devices(3))
        scopes: dict[int, anyio.CancelScope] = {}
        events: list[Any] = []

        def merge(strategy: MirroredStrategy, value: Any) -> Any:
            events.append(("merged", value.values))
            return value

        async def step() -> int:
            result: int
            if replica_id() == 0:
                with anyio.CancelScope() as outer:
                    outer.cancel()
                    try:
                        await anyio.sleep_forever()
                    finally:
                        with anyio.CancelScope(shield=True):
                            result = await replica_context().merge_call(merge, args=(0,))
                            events.append(("replica 0 got", result))
                return result
            if replica_id() == 1:
                while True:
                    with anyio.CancelScope() as scopes[1]:
                        result = await replica_context().merge_call(merge, args=(1,))
                        return result
                    events.append("replica 1 left the round")
            await anyio.wait_all_tasks_blocked()  # replicas 0 and 1 wait in the round
            scopes[1].cancel()
            await anyio.wait_all_tasks_blocked()  # replica 1 is back
            result = await replica_context().merge_call(merge, args=(2,))
            return result

        with anyio.fail_after(5):
            assert (await strategy.run(step)).values == (0, 1, 2)
        assert events == ["replica 1 left the round", ("merged", (0, 1, 2)), ("replica 0 got", 0)]

    @pytest.mark.parametrize("interleave", ["ordered", "random"])
    async def test_sync_timeout_expires(self, interleave: str) -> None:
        seed = 1 if interleave == "random" else None
        strategy = MirroredStrategy(
            host_devices(2),
            sync_timeout=0.1,
            interleave=interleave,  # type: ignore[arg-type]
            seed=seed,
        )

        async def step() -> None:
            if replica_id() == 1:
                await anyio.sleep(5)
            with anyio.CancelScope(shield=True):
                await replica_context().merge_call(noop)

        with anyio.fail_after(5), pytest.raises(ReplicaSyncError, match="for replica 1"):
            await strategy.run(step)


class TestKeyboardInterrupt:
    """Ctrl-C comes out of run() as ``KeyboardInterrupt``, never wrapped in a group."""

    @pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
    async def test_it_outranks_an_earlier_failure(self, raised: type[BaseException]) -> None:
        """A replica that a failing run cancels raises KeyboardInterrupt (or SystemExit) in its
        cleanup: run() raises that, as a task group does, noting the first failure (it used
        to be a note on the first failure)."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            if replica_id() == 0:
                await anyio.lowlevel.checkpoint()
                raise ValueError("replica 0 failed")
            try:
                await anyio.sleep_forever()
            finally:
                raise raised("interrupted")

        with anyio.fail_after(5), pytest.raises(raised, match="interrupted") as info:
            await strategy.run(step)
        assert info.value.__notes__ == [
            "raised in replica 1 of 2 (device cpu:1)",
            "also raised in replica 0: ValueError: replica 0 failed",
        ]
        assert strategy.statistics().runs_active == 0

    @pytest.mark.parametrize("backend", ["asyncio", "trio"])
    def test_ctrl_c_while_the_loop_waits(self, backend: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            pytest.fail("signals reach only the main thread; run this test there")
        strategy = MirroredStrategy(host_devices(2))
        main_thread = threading.get_ident()
        events: list[str] = []

        async def step() -> None:
            if replica_id() == 0:
                # Sent while the loop idles (protected from KeyboardInterrupt on trio, which
                # then delivers it to the main task: the caller of run(), in its task group).
                await anyio.to_thread.run_sync(signal.pthread_kill, main_thread, signal.SIGINT)
            await anyio.sleep(5)
            events.append("not interrupted")

        async def main() -> None:
            with anyio.fail_after(10):
                await strategy.run(step)

        with pytest.raises(KeyboardInterrupt) as info:
            anyio.run(main, backend=backend)
        assert type(info.value) is KeyboardInterrupt
        assert events == []
        assert os.getpid() > 0  # the test process survived the signal


@ASYNCIO_ONLY
async def test_a_replica_spawning_its_own_cancelled_task_group_is_not_confused() -> None:
    """Cancellation inside a replica's own task group stays inside it."""
    strategy = MirroredStrategy(host_devices(2))

    async def step() -> Any:
        async with anyio.create_task_group() as group:
            group.start_soon(anyio.sleep_forever)
            await anyio.lowlevel.checkpoint()
            group.cancel_scope.cancel()
        return await replica_context().merge_call(
            lambda s, v: sum(v.values), args=(replica_id() + 1,)
        )

    with anyio.fail_after(5):
        assert await strategy.run(step) == 3
