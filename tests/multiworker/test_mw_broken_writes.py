"""After a cross-worker failure, writes that replace a variable go on, on each worker alone.

docs/multi-worker.md: once the cluster is broken, "a write of a variable outside run() writes
this worker's own value, and restore restores this worker's variables". A variable made after
the failure (or never used before it) still waits for the chief's first value, which can no
longer come: a restore or an ``assign`` gives it a value of its own here, while a write that
needs its first value (``assign_add``) and a plain read still refuse.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import pytest

from aioreplica import Checkpoint, ClusterBroken, ReplicaSyncError, Variable
from multiworker.mwtools import RANK, shared_directory

if TYPE_CHECKING:
    from aioreplica import MultiWorkerMirroredStrategy
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio


async def broken(strategy: MultiWorkerMirroredStrategy) -> None:
    """Break ``strategy``'s cluster: a step that fails on worker 1."""

    async def step() -> None:
        if RANK == 1:
            raise RuntimeError("worker 1 fails")

    with pytest.raises((RuntimeError, ReplicaSyncError)):
        await strategy.run(step)


async def test_a_restore_gives_a_variable_waiting_for_its_first_value_the_saved_one(
    make_strategy: MakeStrategy,
) -> None:
    strategy = make_strategy(1)
    with strategy.scope():
        saved = Variable(np.array([1.0, 2.0]), name="w")
    with shared_directory() as directory:
        path = await Checkpoint(w=saved, count=5).save(os.path.join(directory, "ckpt"))
        await broken(strategy)
        with strategy.scope():
            earlier = Variable(np.zeros(2), name="earlier")  # waits for its first value too
            fresh = Variable(np.array([7.0, 7.0]) + RANK, name="w")
        with pytest.raises(ClusterBroken):
            fresh.numpy()  # its first value can no longer come from the chief
        checkpoint = Checkpoint(w=fresh, count=0)
        await checkpoint.restore(path)
        assert checkpoint.count == 5  # the whole restore went through
        assert [copy.tolist() for copy in fresh.values] == [[1.0, 2.0]]
        with pytest.raises(ClusterBroken):
            earlier.numpy()  # still waiting: not restored
        assert fresh.numpy().tolist() == [1.0, 2.0]
        await fresh.assign_add(np.array([1.0, 1.0]))  # a value of its own now: written here
        assert fresh.numpy().tolist() == [2.0, 3.0]


async def test_an_assign_gives_it_a_value_of_its_own_and_an_assign_add_is_refused(
    make_strategy: MakeStrategy,
) -> None:
    strategy = make_strategy(1)
    await broken(strategy)
    with strategy.scope():
        added = Variable(np.zeros(2), name="added")
        assigned = Variable(np.zeros(2), name="assigned")
    await assigned.assign(np.array([3.0, 4.0]) + RANK)
    assert assigned.numpy().tolist() == [3.0 + RANK, 4.0 + RANK]
    with pytest.raises(ClusterBroken):
        await added.assign_add(np.ones(2))  # needs the chief's first value
    with pytest.raises(ClusterBroken):
        added.numpy()
