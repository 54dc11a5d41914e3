"""Concurrent callers never lose work (invariant 8): a hundred runs at once, on every loop.

Each test starts ``RUNS`` tasks at once, each calling ``strategy.run`` (and, for checkpoints,
``CheckpointManager.save``) on shared state, and checks the exact result: every write, step
and save applied once. Writes of the 2 MiB variables await a device worker between reading the
old copies and committing the new ones, so the runs really interleave there.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest
from harness import BIG, lower_inline_bytes

from aioreplica import Checkpoint, CheckpointManager, MirroredStrategy, Variable
from aioreplica.optimizers import SGD
from aioreplica.testing import host_devices, replica_id

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from pathlib import Path

pytestmark = pytest.mark.anyio

RUNS = 100
REPLICAS = 2
#: What one run adds, summed over the replicas (each adds ``replica_id() + 1``).
PER_RUN = sum(range(1, REPLICAS + 1))
DEADLINE = 20.0


@pytest.fixture(autouse=True)
def _big_is_not_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    lower_inline_bytes(monkeypatch)


async def at_once(count: int, call: Callable[[], Coroutine[Any, Any, Any]]) -> None:
    """``count`` calls of ``call`` started together; returns when all have ended."""
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as group:
            for _ in range(count):
                group.start_soon(call)


def held(variable: Variable) -> list[list[float]]:
    """Each copy's distinct values (a variable here holds one value in every element)."""
    return [np.unique(np.asarray(copy)).tolist() for copy in variable.values]


async def test_replica_writes_are_all_applied() -> None:
    """assign_add in replica context, mirrored and sync-on-read, small and 2 MiB: none lost."""
    strategy = MirroredStrategy(host_devices(REPLICAS))
    with strategy.scope():
        mirrored = [Variable(np.zeros(n), aggregation="sum") for n in (4, BIG)]
        on_read = [
            Variable(np.zeros(n), synchronization="on_read", aggregation="sum") for n in (4, BIG)
        ]

    async def step() -> None:
        for variable in (*mirrored, *on_read):
            await variable.assign_add(replica_id() + 1.0)

    await at_once(RUNS, lambda: strategy.run(step))
    for variable in mirrored:
        assert held(variable) == [[RUNS * PER_RUN]] * REPLICAS
    for variable in on_read:  # each replica's own copy
        assert held(variable) == [[RUNS * (replica + 1.0)] for replica in range(REPLICAS)]


async def test_cross_replica_writes_are_all_applied() -> None:
    strategy = MirroredStrategy(host_devices(REPLICAS))
    with strategy.scope():
        big = Variable(np.zeros(BIG))

    await at_once(RUNS, lambda: big.assign_add(1.0))
    assert held(big) == [[float(RUNS)]] * REPLICAS


async def test_optimizer_steps_are_all_applied() -> None:
    """A hundred concurrent steps give what a hundred steps one after another give (every
    step is the same, so their order does not matter): variables, momentum, step count."""

    async def train(concurrently: bool) -> tuple[list[Variable], SGD]:
        strategy = MirroredStrategy(host_devices(REPLICAS))
        with strategy.scope():
            variables = [Variable(np.ones(n), name=f"v{n}") for n in (4, BIG)]
        optimizer = SGD(0.01, momentum=0.9)

        async def step() -> None:
            await optimizer.apply_gradients([(np.ones(v.shape), v) for v in variables])

        if concurrently:
            await at_once(RUNS, lambda: strategy.run(step))
        else:
            for _ in range(RUNS):
                await strategy.run(step)
        return variables, optimizer

    variables, optimizer = await train(concurrently=True)
    expected_variables, expected_optimizer = await train(concurrently=False)
    assert optimizer.iterations == RUNS
    for variable, expected in zip(variables, expected_variables, strict=True):
        momentum = optimizer.get_slot(variable, "momentum")
        expected_momentum = expected_optimizer.get_slot(expected, "momentum")
        for got, want in [(variable, expected), (momentum, expected_momentum)]:
            for copy in got.values:
                np.testing.assert_array_equal(copy, want.values[0])


@pytest.mark.parametrize("max_to_keep", [None, 3])
async def test_checkpoint_saves_get_distinct_numbers(
    tmp_path: Path, max_to_keep: int | None
) -> None:
    """Runs and saves from a hundred tasks: a hundred checkpoints numbered 1 to 100; the
    directory holds exactly the ones the manager keeps, and the newest restores."""
    strategy = MirroredStrategy(host_devices(REPLICAS))
    with strategy.scope():
        counter = Variable(0.0, aggregation="sum")
    manager = CheckpointManager(Checkpoint(counter=counter), tmp_path, max_to_keep=max_to_keep)
    saved: list[str] = []

    async def step() -> None:
        await counter.assign_add(replica_id() + 1.0)

    async def run_and_save() -> None:
        await strategy.run(step)
        saved.append(await manager.save())

    await at_once(RUNS, run_and_save)
    numbers = [int(os.path.basename(path)[len("ckpt-") : -len(".npz")]) for path in saved]
    assert sorted(numbers) == list(range(1, RUNS + 1))
    kept = manager.checkpoints
    assert len(kept) == (RUNS if max_to_keep is None else max_to_keep)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(path) for path in kept)
    assert manager.latest == str(tmp_path / f"ckpt-{RUNS}.npz")
    restored = Variable(-1.0, name="counter")
    assert manager.latest is not None
    await Checkpoint(counter=restored).restore(manager.latest)
    assert 0 < float(restored) <= RUNS * PER_RUN  # a value the counter held when it was saved
    assert float(counter) == RUNS * PER_RUN
