"""Concurrent writers never lose work: writes of one object apply one after another, in the order
their callers reached them, each all-or-nothing (invariant 8)."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aioreplica
from aioreplica import MirroredStrategy, PerReplica, Variable
from aioreplica._backends._numpy import INLINE_BYTES
from aioreplica._writes import Turn, taking_turns
from aioreplica.testing import host_devices, replica_id

pytestmark = pytest.mark.anyio

#: Big enough that computing a write awaits a device's worker thread (host work that reads
#: INLINE_BYTES or more is not done inline), which is where a writer used to be overtaken.
BIG = INLINE_BYTES // 8


class TestVariables:
    async def test_concurrent_assign_add_loses_nothing(self) -> None:
        v = Variable(np.zeros(BIG))
        async with anyio.create_task_group() as group:
            for _ in range(5):
                group.start_soon(v.assign_add, 1.0)
        assert np.all(v.numpy() == 5.0)

    async def test_writes_apply_in_the_order_callers_reached_them(self) -> None:
        """Each ``extended.update`` sees the value the one before it committed."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.zeros(BIG))
        seen: list[tuple[int, float]] = []

        def bump(copy: Any, i: int) -> Any:
            seen.append((i, float(copy[0])))
            return copy + 1

        async with anyio.create_task_group() as group:
            for i in range(6):
                group.start_soon(strategy.extended.update, v, bump, (i,))
                await anyio.lowlevel.checkpoint()  # the callers reach update() in order
        # Host copies are one shared array, so each update computes once.
        assert seen == [(i, float(i)) for i in range(6)]
        assert all(np.all(copy == 6.0) for copy in v.values)

    async def test_mirrored_writes_from_concurrent_runs(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            total = Variable(np.zeros(BIG), aggregation="sum")

        async def step() -> None:
            await total.assign_add(np.full(BIG, replica_id() + 1.0))

        async with anyio.create_task_group() as group:
            for _ in range(8):
                group.start_soon(strategy.run, step)
        assert all(np.all(copy == 24.0) for copy in total.values)

    async def test_sync_on_read_writes_from_concurrent_runs(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            seen = Variable(np.zeros(BIG, np.int64), synchronization="on_read", aggregation="sum")

        async def step() -> None:
            await seen.assign_add(np.full(BIG, replica_id() + 1, np.int64))

        async with anyio.create_task_group() as group:
            for _ in range(6):
                group.start_soon(strategy.run, step)
        assert np.all(seen.numpy() == 18)
        assert [int(copy[0]) for copy in seen.values] == [6, 12]

    async def test_a_cancelled_writer_writes_nothing_and_blocks_nobody(self) -> None:
        v = Variable(np.zeros(BIG))
        order: list[str] = []

        async def add(name: str, amount: float) -> None:
            await v.assign_add(amount)
            order.append(name)

        async with anyio.create_task_group() as group:
            group.start_soon(add, "first", 1.0)  # holds the turn while its worker computes
            await anyio.lowlevel.checkpoint()
            async with anyio.create_task_group() as doomed:
                doomed.start_soon(add, "cancelled", 10.0)  # queued behind "first"
                await anyio.lowlevel.checkpoint()
                group.start_soon(add, "last", 1000.0)  # queued behind "cancelled"
                await anyio.lowlevel.checkpoint()
                doomed.cancel_scope.cancel()
        assert order == ["first", "last"]
        assert np.all(v.numpy() == 1001.0)


class TestOptimizers:
    async def test_concurrent_steps_each_count(self) -> None:
        """Ten concurrent ``apply_gradients`` used to end with ``iterations == 1``."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros(BIG), name="w")
        opt = aioreplica.optimizers.SGD(0.1, momentum=0.9)

        async def step() -> None:
            await opt.apply_gradients([(np.ones(BIG), w)])

        async with anyio.create_task_group() as group:
            for _ in range(10):
                group.start_soon(strategy.run, step)
        assert opt.iterations == 10
        # The same ten steps one after another: momentum m = 0.9 m - 0.1 g, w += m, g = 2.
        m = expected = 0.0
        for _ in range(10):
            m = 0.9 * m - 0.1 * 2.0
            expected += m
        assert all(np.allclose(copy, expected) for copy in w.values)
        assert np.allclose(opt.get_slot(w, "momentum").numpy(), m)

    async def test_steps_over_shared_variables_in_any_order_do_not_deadlock(self) -> None:
        """Two optimizers, the same variables listed in opposite orders, and writes between."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            a = Variable(np.zeros(BIG), name="a")
            b = Variable(np.zeros(BIG), name="b")
        first, second = aioreplica.optimizers.SGD(1.0), aioreplica.optimizers.SGD(1.0)

        async def forward() -> None:
            await first.apply_gradients([(np.ones(BIG), a), (np.ones(BIG), b)])

        async def backward() -> None:
            await second.apply_gradients([(np.ones(BIG), b), (np.ones(BIG), a)])

        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                for _ in range(4):
                    group.start_soon(strategy.run, forward)
                    group.start_soon(strategy.run, backward)
                    group.start_soon(a.assign_add, 0.5)
        assert (first.iterations, second.iterations) == (4, 4)
        assert np.all(a.numpy() == -16.0 + 2.0)  # 8 steps of -2 (summed over 2), 4 x +0.5
        assert np.all(b.numpy() == -16.0)

    async def test_the_first_steps_share_one_set_of_slots(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros(BIG), name="w")
        opt = aioreplica.optimizers.Adam(0.01)

        async def step() -> None:
            await opt.apply_gradients([(np.ones(BIG), w)])

        async with anyio.create_task_group() as group:
            for _ in range(3):
                group.start_soon(strategy.run, step)
        assert opt.iterations == 3
        assert len(opt.variables()) == 2  # m and v of the one variable, made once


class TestTurn:
    async def test_first_in_first_out(self) -> None:
        turn = Turn()
        order: list[int] = []

        async def write(i: int) -> None:
            async with taking_turns(lambda: [turn]):
                await anyio.lowlevel.checkpoint()
                order.append(i)

        async with anyio.create_task_group() as group:
            for i in range(5):
                group.start_soon(write, i)
                await anyio.lowlevel.checkpoint()
        assert order == [0, 1, 2, 3, 4]
        assert not turn.held

    async def test_a_turn_handed_to_a_cancelled_waiter_passes_on(self) -> None:
        turn = Turn()
        order: list[str] = []
        scope = anyio.CancelScope()
        await turn.acquire()

        async def take(name: str) -> None:
            await turn.acquire()
            order.append(name)
            turn.release()

        async def doomed() -> None:
            with scope:
                await take("cancelled")

        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(doomed)
                await anyio.lowlevel.checkpoint()
                group.start_soon(take, "next")
                await anyio.lowlevel.checkpoint()
                turn.release()  # handed to the first waiter...
                scope.cancel()  # ...cancelled before it runs: it passes the turn on
        # asyncio delivers the cancellation at once; trio at the waiter's next checkpoint, after
        # it has taken its turn. Either way the turn reaches "next" and ends free.
        assert order in (["next"], ["cancelled", "next"])
        assert not turn.held

    async def test_several_turns_are_taken_in_creation_order(self) -> None:
        turns = [Turn() for _ in range(3)]
        async with taking_turns(lambda: reversed(turns)):
            assert all(turn.held for turn in turns)
        assert not any(turn.held for turn in turns)

    async def test_per_replica_values_are_unchanged_by_serialisation(self) -> None:
        """A write's own semantics stay: per-replica values of a SUM variable are summed."""
        strategy = MirroredStrategy(host_devices(3))
        with strategy.scope():
            v = Variable(0.0, aggregation="sum")

        async def step(x: float) -> None:
            await v.assign(x)

        await strategy.run(step, args=(PerReplica([1.0, 2.0, 3.0]),))
        assert float(v) == 6.0


async def test_slots_built_during_a_first_step_get_its_values() -> None:
    """``build()`` (synchronous) while a first step awaits its update: one set of slots, and
    it holds the step's values."""
    strategy = MirroredStrategy(host_devices(2))
    with strategy.scope():
        w = Variable(np.zeros(BIG), name="w")
    opt = aioreplica.optimizers.SGD(0.1, momentum=0.9)

    async def step() -> None:
        await opt.apply_gradients([(np.ones(BIG), w)])

    async with anyio.create_task_group() as group:
        group.start_soon(strategy.run, step)
        while not opt._turn.held:  # the step has started, and will await its worker
            await anyio.lowlevel.checkpoint()
        opt.build([w])
        built = opt.get_slot(w, "momentum")
    assert opt.get_slot(w, "momentum") is built
    assert np.allclose(built.numpy(), -0.2)  # momentum after one step of g = 1 + 1
    assert np.allclose(w.numpy(), -0.2)
