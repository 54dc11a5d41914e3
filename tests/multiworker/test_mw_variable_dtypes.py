"""Variables of a non-native byte order across workers: their first value comes from the
chief, and a sync-on-read one's aggregate is read and saved, as in the native order.

(MPI moves typed numbers in this machine's byte order only: big-endian values go as bytes, or
are summed in the native order and given back in the variable's own dtype.)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from aioreplica import Checkpoint, Variable
from multiworker.mwtools import RANK, WORKERS, assert_same_on_every_worker, shared_directory

if TYPE_CHECKING:
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]

BIG_ENDIAN = [">f4", ">f8", ">i8"]


@pytest.mark.parametrize("dtype", BIG_ENDIAN)
async def test_first_read_takes_the_chiefs_value(make_strategy: MakeStrategy, dtype: str) -> None:
    """Read before any run(), a big-endian variable holds the chief's value, in its dtype,
    and so does a native variable made before it whose first read syncs both."""
    strategy = make_strategy(1)
    with strategy.scope():
        native = Variable(np.array([RANK + 1.0]), name="native")
        big = Variable(np.array([RANK + 1, 7], dtype), name="big")
    assert native.numpy().tolist() == [1.0]
    got = big.numpy()
    assert (got.dtype.str, got.tolist()) == (np.dtype(dtype).str, [1, 7])
    assert_same_on_every_worker(*big.values)


@pytest.mark.parametrize("aggregation", ["sum", "mean", "only_first_replica"])
async def test_sync_on_read_aggregate_is_read_and_saved(
    make_strategy: MakeStrategy, aggregation: str
) -> None:
    """A big-endian ``>f4`` sync-on-read variable's cross-worker aggregate reads (numpy(),
    extended.read_var) and saves in its own dtype; the workers stay in step after."""
    local = 2
    strategy = make_strategy(local)
    with strategy.scope():
        total = Variable(
            np.zeros(2, ">f4"), synchronization="on_read", aggregation=aggregation, name="total"
        )

    async def step() -> None:
        await total.assign_add(np.array([1, 2], ">f4"))

    await strategy.run(step)
    replicas = local * WORKERS
    want = {"sum": [replicas, 2 * replicas], "mean": [1, 2], "only_first_replica": [1, 2]}
    read = total.numpy()
    assert (read.dtype.str, read.tolist()) == (">f4", want[aggregation])
    assert np.asarray(strategy.extended.read_var(total)).tolist() == want[aggregation]
    with strategy.scope():
        back = Variable(
            np.zeros(2, ">f4"), synchronization="on_read", aggregation=aggregation, name="total"
        )
    with shared_directory() as directory:
        path = await Checkpoint(total=total).save(os.path.join(directory, "total.npz"))
        await Checkpoint(total=back).restore(path)
    read = back.numpy()
    assert (read.dtype.str, read.tolist()) == (">f4", want[aggregation])
    await strategy.run(step)  # every worker is still in step
    assert total.numpy().tolist() == [2 * x for x in want[aggregation]]
