"""Collectives on numbers in the other byte order (``>f8`` on a little-endian machine), in one
process: the right numbers, in the dtype they were passed in, whatever the call."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aioreplica import MirroredStrategy, PerReplica
from aioreplica.testing import host_devices, replica_context

pytestmark = pytest.mark.anyio

#: A dtype in the byte order this machine does not use, and the same in the one it does.
OTHER = np.dtype("f8").newbyteorder("S")
OTHER_INT = np.dtype("i4").newbyteorder("S")


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("dtype", [OTHER, OTHER_INT], ids=["f8", "i4"])
async def test_reduce_along_an_axis_in_the_other_byte_order(op: str, dtype: np.dtype[Any]) -> None:
    """``strategy.reduce`` along an axis of arrays in the other byte order reduces as NumPy
    does on the batches joined, and gives the result in their dtype (a ``MEAN`` of integers:
    float64), as the reduction without an axis does."""
    strategy = MirroredStrategy(host_devices(3))
    batches = [np.arange(1, 7).reshape(3, 2), np.ones((0, 2), int), np.full((1, 2), 2)]
    value = PerReplica([b.astype(dtype) for b in batches])
    got = await strategy.reduce(op, value, axis=0)
    want = getattr(np, op)(np.concatenate(batches), axis=0)
    np.testing.assert_allclose(got, want)
    assert got.dtype == (np.dtype(np.float64) if op == "mean" and dtype.kind == "i" else dtype)
    whole = await strategy.reduce(op, PerReplica([b[:1].astype(dtype) for b in [batches[0]] * 3]))
    assert whole.dtype == got.dtype


async def test_collectives_keep_the_other_byte_order() -> None:
    """all_reduce (one leaf and packed), all_gather, broadcast, and the strategy's reduce and
    gather give arrays in the other byte order back in it."""
    strategy = MirroredStrategy(host_devices(2))
    seen: list[tuple[str, str]] = []

    async def step() -> None:
        ctx = replica_context()
        x = np.arange(3).astype(OTHER) * 1  # a product: in this machine's order ...
        x = x.astype(OTHER)  # ... so made the other's again
        results = {
            "all_reduce": await ctx.all_reduce("sum", x),
            "packed": (await ctx.all_reduce("sum", [x, x]))[0],
            "all_gather": await ctx.all_gather(x.astype(OTHER_INT), axis=0),
            "broadcast": await ctx.broadcast(x.astype(OTHER_INT)),
        }
        if ctx.replica_id_in_sync_group == 0:
            seen.extend((name, array.dtype.str) for name, array in results.items())

    await strategy.run(step)
    x = PerReplica([np.arange(3).astype(OTHER)] * 2)
    seen.append(("reduce", (await strategy.reduce("sum", x)).dtype.str))
    seen.append(("gather", (await strategy.gather(x)).dtype.str))
    assert seen == [
        ("all_reduce", OTHER.str),
        ("packed", OTHER.str),
        ("all_gather", OTHER_INT.str),
        ("broadcast", OTHER_INT.str),
        ("reduce", OTHER.str),
        ("gather", OTHER.str),
    ]
