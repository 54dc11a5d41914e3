"""Distributed datasets across workers by dtype: the workers' global batches are compared by
their values, whatever else the bytes of a dtype hold.

An x87 long double (``np.longdouble`` on x86) fills 10 of its bytes; the rest hold whatever
was in memory, which differs between processes. The batches here put the worker's rank in
those bytes where the platform has them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from aioreplica import WorkersDisagree
from multiworker.mwtools import RANK, WORKERS, allgather

if TYPE_CHECKING:
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]

#: The bytes of a long double that hold its value: 10 for x87's, all of them otherwise.
VALUE_BYTES = 10 if np.finfo(np.longdouble).nmant == 63 else np.dtype(np.longdouble).itemsize

#: Scales that take long doubles beyond float64's range ("1e400") and below it ("1e-400"),
#: where a float64 holds them all as inf, or as 0.
OUT_OF_FLOAT64 = [
    pytest.param(
        scale,
        marks=pytest.mark.skipif(
            np.finfo(np.longdouble).maxexp <= np.finfo(np.float64).maxexp,
            reason="np.longdouble is a float64 here",
        ),
    )
    for scale in ["1e400", "1e-400"]
]


def with_rank_in_padding(values: Array) -> Array:
    """``values`` (long doubles, real or complex) with this worker's rank in every byte that
    holds no part of a value."""
    padded = values.copy()
    parts = padded.view(np.longdouble).reshape(-1)  # a complex number's parts, one by one
    raw = parts.view(np.uint8).reshape(len(parts), -1)
    raw[:, VALUE_BYTES:] = RANK + 1
    return padded


async def outcome(strategy: Any, batches: list[Array]) -> list[Any]:
    """What a pass over ``batches`` gave this worker: each element's first replica's values,
    or the WorkersDisagree it ended with."""
    got: list[Any] = []
    try:
        async for element in strategy.distribute_dataset(batches):
            first = strategy.experimental_local_results(element)[0]
            got.append(first.tolist())
    except WorkersDisagree as disagreement:
        got.append(type(disagreement).__name__)
    return got


@pytest.mark.parametrize("scale", ["1", *OUT_OF_FLOAT64])
@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble])
async def test_equal_long_doubles_agree_whatever_their_padding(
    make_strategy: MakeStrategy, dtype: type[np.generic], scale: str
) -> None:
    """Global batches of equal long doubles are one batch on every worker, though the unused
    bytes of each value differ between the workers: every replica gets its rows. Values out
    of float64's range warn of nothing (the suite makes a warning an error)."""
    strategy = make_strategy(1)
    values = np.arange(8).astype(dtype) / 3 * np.longdouble(scale)
    got = await outcome(strategy, [with_rank_in_padding(values)])
    want = [(values[4 * RANK : 4 * RANK + 4]).tolist()]
    assert allgather(got == want) == [True] * WORKERS, got


async def test_long_doubles_that_differ_beyond_float64_disagree(
    make_strategy: MakeStrategy,
) -> None:
    """Long doubles that differ only in digits a float64 cannot hold still make the workers'
    batches differ: every worker raises WorkersDisagree."""
    strategy = make_strategy(1)
    values = np.ones(8, np.longdouble) + RANK * np.finfo(np.longdouble).eps
    got = await outcome(strategy, [with_rank_in_padding(values)])
    assert allgather(got) == [["WorkersDisagree"]] * WORKERS


@pytest.mark.parametrize("scale", OUT_OF_FLOAT64)
@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble])
async def test_long_doubles_that_differ_out_of_float64s_range_disagree(
    make_strategy: MakeStrategy, dtype: type[np.generic], scale: str
) -> None:
    """Long doubles beyond float64's range, or below it, that differ between the workers
    (1e400 and 2e400, 1e-400 and 2e-400) make the workers' batches differ: every worker
    raises WorkersDisagree."""
    strategy = make_strategy(1)
    values = np.full(8, np.longdouble(scale) * (RANK + 1), dtype)
    got = await outcome(strategy, [with_rank_in_padding(values)])
    assert allgather(got) == [["WorkersDisagree"]] * WORKERS
