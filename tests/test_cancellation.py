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
