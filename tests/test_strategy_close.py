"""close(), aclose() and ``async with strategy``: host worker threads stopped per strategy.

Host devices are process-wide, and an open strategy keeps its devices' threads, so these tests
use device numbers few other tests use (``cpu:40`` and up) and first collect the garbage: a
strategy that other tests dropped without closing it holds its devices until it is collected.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import anyio
import numpy as np
import pytest

import aioreplica
from aioreplica import MirroredStrategy, get_replica_context
from aioreplica._backends import _numpy, host_device

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _collect_dropped_strategies() -> None:
    gc.collect()  # strategies other tests dropped, whose claims go when they are collected


def cpus(*indices: int) -> list[str]:
    return [f"cpu:{i}" for i in indices]


def alive(*indices: int) -> list[str]:
    """The names of the live worker threads of these host devices, sorted."""
    wanted = {f"aioreplica cpu:{i}" for i in indices}
    return sorted(t.name for t in threading.enumerate() if t.name in wanted and t.is_alive())


async def thread_names(strategy: MirroredStrategy) -> tuple[str, ...]:
    """Run one step whose replicas each run a job on their device's worker thread."""

    async def step() -> str:
        context = get_replica_context()
        assert context is not None
        return await context.device.run(lambda: threading.current_thread().name)

    result = await strategy.run(step)
    names: tuple[str, ...] = strategy.experimental_local_results(result)
    return names


class TestClose:
    async def test_aclose_ends_the_threads_of_its_devices(self) -> None:
        """After ``aclose()`` no worker thread of the strategy's host devices is alive."""
        strategy = MirroredStrategy(cpus(40, 41))
        assert await thread_names(strategy) == ("aioreplica cpu:40", "aioreplica cpu:41")
        assert alive(40, 41) == ["aioreplica cpu:40", "aioreplica cpu:41"]
        assert not strategy.closed
        await strategy.aclose()
        assert strategy.closed
        assert alive(40, 41) == []

    async def test_async_with_closes_on_exit(self) -> None:
        """``async with strategy:`` yields the strategy and closes it at the end, even when the
        block raises; the block's exception comes out."""
        async with MirroredStrategy(cpus(42)) as strategy:
            assert await thread_names(strategy) == ("aioreplica cpu:42",)
            assert alive(42) == ["aioreplica cpu:42"]
        assert (strategy.closed, alive(42)) == (True, [])

        failing = MirroredStrategy(cpus(42))

        async def fail_inside() -> None:
            async with failing:
                await thread_names(failing)
                raise ValueError("inside the block")

        with pytest.raises(ValueError, match="inside the block"):
            await fail_inside()
        assert (failing.closed, alive(42)) == (True, [])

    async def test_an_open_strategy_keeps_the_threads_it_shares(self) -> None:
        """Two strategies share cpu:44: closing one stops only the thread no open strategy
        uses; closing the other stops the rest."""
        first = MirroredStrategy(cpus(43, 44))
        second = MirroredStrategy(cpus(44, 45))
        await thread_names(first)
        await thread_names(second)
        assert alive(43, 44, 45) == ["aioreplica cpu:43", "aioreplica cpu:44", "aioreplica cpu:45"]
        await first.aclose()
        assert alive(43, 44, 45) == ["aioreplica cpu:44", "aioreplica cpu:45"]
        assert await thread_names(second) == ("aioreplica cpu:44", "aioreplica cpu:45")
        await first.aclose()  # again: releases nothing more, so cpu:44 stays
        assert alive(43, 44, 45) == ["aioreplica cpu:44", "aioreplica cpu:45"]
        await second.aclose()
        assert alive(43, 44, 45) == []

    async def test_a_later_use_starts_the_threads_again(self) -> None:
        """After a close, another strategy over the same devices, or the same one reopened with
        ``async with``, runs on freshly started threads, which its own close stops."""
        strategy = MirroredStrategy(cpus(46, 47))
        first = await thread_names(strategy)
        await strategy.aclose()
        again = MirroredStrategy(cpus(46, 47))
        assert await thread_names(again) == first
        assert alive(46, 47) == ["aioreplica cpu:46", "aioreplica cpu:47"]
        await again.aclose()
        assert alive(46, 47) == []
        async with strategy:  # reopened
            assert not strategy.closed
            assert await thread_names(strategy) == first
            assert alive(46, 47) == ["aioreplica cpu:46", "aioreplica cpu:47"]
        assert alive(46, 47) == []

    async def test_a_closed_strategy_refuses_to_run(self) -> None:
        """``run()`` and ``run_steps()`` on a closed strategy raise a RuntimeError saying how to
        reopen it; nothing starts."""
        strategy = MirroredStrategy(cpus(48))
        strategy.close()
        message = r"\(\) was called on .* after close\(\).*`async with strategy:`"
        with pytest.raises(RuntimeError, match="^run" + message):
            await strategy.run(lambda: 1)
        batches = strategy.distribute_dataset(aioreplica.batched(np.arange(4.0), 2))
        with pytest.raises(RuntimeError, match="^run_steps" + message):
            await strategy.run_steps(lambda x: x, aiter(batches), 1)
        assert alive(48) == []

    async def test_other_uses_of_a_closed_strategys_devices_restart_them(self) -> None:
        """A closed strategy's devices still run jobs (a variable update, ``device.run``): the
        thread starts again, and closing again stops it."""
        strategy = MirroredStrategy(cpus(49))
        strategy.close()
        device = strategy.extended.replica_devices[0]
        assert await device.run(lambda: threading.current_thread().name) == "aioreplica cpu:49"
        assert alive(49) == ["aioreplica cpu:49"]
        await strategy.aclose()
        assert alive(49) == []

    async def test_close_during_a_run_is_refused(self) -> None:
        """``close()`` while a ``run()`` is in progress raises RuntimeError and changes
        nothing: the run finishes on its threads, and a close afterwards works."""
        strategy = MirroredStrategy(cpus(50, 51))
        events: list[str] = []
        gate = anyio.Event()

        async def step() -> str:
            context = get_replica_context()
            assert context is not None
            await gate.wait()
            return await context.device.run(lambda: threading.current_thread().name)

        async def run() -> None:
            result = await strategy.run(step)
            events.append(f"run done on {list(strategy.experimental_local_results(result))}")

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(RuntimeError, match=r"while 1 run\(\) call is in progress"):
                strategy.close()
            with pytest.raises(RuntimeError, match=r"while 1 run\(\) call is in progress"):
                await strategy.aclose()
            events.append(f"close refused, closed={strategy.closed}")
            gate.set()
        await strategy.aclose()
        events.append(f"closed, threads {alive(50, 51)}")
        assert events == [
            "close refused, closed=False",
            "run done on ['aioreplica cpu:50', 'aioreplica cpu:51']",
            "closed, threads []",
        ]

    async def test_aclose_waits_for_a_queued_job_without_blocking_the_loop(self) -> None:
        """A job already on the worker runs to its end; ``aclose()`` returns after the thread
        ended, and the loop ran other tasks meanwhile (one of them let the job finish)."""
        strategy = MirroredStrategy(cpus(52))
        device = strategy.extended.replica_devices[0]
        started = threading.Event()
        release = threading.Event()
        events: list[str] = []

        def job() -> None:
            started.set()
            release.wait(10)
            events.append("job done")

        async def close() -> None:
            events.append("aclose called")
            await strategy.aclose()
            events.append(f"aclose returned, threads {alive(52)}")

        async with anyio.create_task_group() as group:
            group.start_soon(device.run, job)
            await anyio.to_thread.run_sync(started.wait, 10.0)
            group.start_soon(close)
            await anyio.wait_all_tasks_blocked()
            events.append("loop free")
            release.set()
        assert events == [
            "aclose called",
            "loop free",
            "job done",
            "aclose returned, threads []",
        ]

    def test_sync_close_stops_the_threads_without_waiting(self) -> None:
        """``close()`` outside any event loop stops the threads; they end on their own."""
        strategy = MirroredStrategy(cpus(53, 54))
        anyio.run(thread_names, strategy)
        threads = [t for t in threading.enumerate() if t.name in alive(53, 54)]
        assert len(threads) == 2
        strategy.close()
        strategy.close()  # idempotent
        for thread in threads:
            thread.join(10)
        assert (strategy.closed, alive(53, 54)) == (True, [])

    async def test_a_dropped_strategy_holds_its_devices_until_collected(self) -> None:
        """A strategy dropped without ``close()`` stops counting once it is collected: the
        close of another strategy over the same device then stops the thread."""
        dropped = MirroredStrategy(cpus(57))
        await thread_names(dropped)
        kept = MirroredStrategy(cpus(57))
        await kept.aclose()
        assert alive(57) == ["aioreplica cpu:57"]  # the dropped one is still open
        gone = weakref.ref(dropped)
        del dropped
        # The worker lets go of its last job (which holds the replica's context) only once it
        # has left that job's frame, a moment after the job's result reached the loop; and
        # strategies are in reference cycles, collected by the cycle collector. So: collect
        # until the strategy is gone, within a bound.
        with anyio.fail_after(5):
            while gone() is not None:
                gc.collect()
                await host_device(57).synchronize()
        kept = MirroredStrategy(cpus(57))
        await kept.aclose()
        assert alive(57) == []

    async def test_the_default_strategy_stays_open(self) -> None:
        """Closing the default strategy stops no one's claimed threads and leaves it usable."""
        default = aioreplica.get_strategy()
        default.close()
        assert not default.closed
        assert await default.run(lambda: 7) == 7


class TestWorkerRestart:
    async def test_jobs_keep_their_order_across_a_stop(self) -> None:
        """A job queued after a stop runs on a new thread, but only once the old thread has
        run its queued jobs and ended: one job at a time, in submission order."""
        device = host_device(55)
        release = threading.Event()
        events: list[Any] = []

        def first() -> None:
            events.append("first started")
            release.wait(10)
            events.append("first done")

        def second(old: threading.Thread) -> None:
            events.append(("second", threading.current_thread() is old, old.is_alive()))

        done_first = _numpy._submit(device, first)
        old = device.stop_worker()
        assert old is not None
        done_second = _numpy._submit(device, second, old)
        release.set()
        await done_first
        await done_second
        assert events == ["first started", "first done", ("second", False, False)]
        thread = device.stop_worker()
        assert thread is not None
        thread.join(10)
        assert alive(55) == []

    async def test_a_claimed_device_is_not_stopped_as_unclaimed(self) -> None:
        """``stop_worker(unclaimed=True)`` leaves a claimed device's thread running."""
        device = host_device(56)
        device.claim()
        try:
            await device.run(int)
            assert device.stop_worker(unclaimed=True) is None
            assert alive(56) == ["aioreplica cpu:56"]
        finally:
            device.release()
        thread = device.stop_worker(unclaimed=True)
        assert thread is not None
        thread.join(10)
        assert alive(56) == []
