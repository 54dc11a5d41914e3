"""Cross-replica calls of several collectives across workers (``strategy.reduce`` along an
axis or of a nested value, ``gather``, ``reduce_to``, ``batch_reduce_to``): workers that pass
other structures, ops or axes raise the same ValueError, in step, before any data moves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from aioreplica import CommunicationOptions, PerReplica, Variable
from multiworker.mwtools import RANK, WORKERS, allgather

if TYPE_CHECKING:
    from collections.abc import Callable

    from aioreplica import MultiWorkerMirroredStrategy
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]
SQUARE = np.array([[1.0, 2.0], [3.0, 4.0]])
ROW = np.array([1.0, 2.0, 3.0])

#: One call per worker, worker 0's differing from the others', and what the error shows.
CALLS: dict[str, tuple[Callable[[MultiWorkerMirroredStrategy], Any], str]] = {
    "reduce along other axes": (
        lambda s: s.reduce("sum", SQUARE, axis=min(RANK, 1)),
        r"along axis 0 .*along axis 1 ",
    ),
    "reduce mean against sum along an axis": (
        lambda s: s.reduce("mean" if RANK == 0 else "sum", SQUARE, axis=0),
        r"reduce \(mean\) along axis 0.*reduce \(sum\) along axis 0",
    ),
    "reduce along an axis against no axis": (
        lambda s: s.reduce("sum", np.arange(3), axis=0) if RANK == 0 else s.reduce("sum", [5]),
        r"worker 0: strategy\.reduce: reduce \(sum\) along axis 0.*worker 1: .*all_reduce",
    ),
    "reduce along an axis, one leaf more": (
        lambda s: s.reduce("sum", {"a": ROW} if RANK == 0 else {"a": ROW, "b": ROW}, axis=0),
        r"1 leaf: \['a'\].*2 leaves: \['a'\] float64 \(\*,\); \['b'\]",
    ),
    "gather, one leaf more": (
        lambda s: s.gather({"a": ROW} if RANK == 0 else {"a": ROW, "b": ROW}),
        r"worker 1: strategy\.gather: gather along axis 0 of 2 leaves",
    ),
    "gather, other leaves": (
        lambda s: s.gather({"a": ROW, "b": ROW} if RANK == 0 else {"a": ROW, "c": ROW}),
        r"\['b'\] float64.*\['c'\] float64",
    ),
}

#: Calls whose leaves go in reductions of their own (a pack holds 8 bytes), one more leaf on
#: every worker but worker 0.
UNPACKED: dict[str, Callable[[MultiWorkerMirroredStrategy, Any], Any]] = {
    "reduce": lambda s, value: s.reduce("sum", value),
    "reduce_to": lambda s, value: s.extended.reduce_to("sum", value, "cpu:0"),
    "batch_reduce_to": lambda s, value: s.extended.batch_reduce_to("sum", [(value, "cpu:0")]),
}


async def assert_in_step(strategy: MultiWorkerMirroredStrategy) -> None:
    """The workers are still in step: a gather and a reduce made alike give every worker's."""
    rows = await strategy.gather(np.full(2, float(RANK)))
    np.testing.assert_array_equal(rows, np.repeat(np.arange(WORKERS, dtype=float), 2))
    assert await strategy.reduce("sum", 1.0) == WORKERS


def assert_alike(message: str) -> None:
    """Every worker raised the same error (past the name of the collective it had reached)."""
    assert "the workers passed different values" in message, message
    assert len({m.split(":", 1)[1] for m in allgather(message)}) == 1, message


@pytest.mark.parametrize("case", list(CALLS))
async def test_workers_making_other_calls_raise_alike(
    make_strategy: MakeStrategy, case: str
) -> None:
    """Other axes, another op, an axis on one worker only, or other leaves: every worker raises
    the same ValueError naming what each passed, rather than one returning a wrong value or
    leaving the workers a collective apart; the strategy goes on."""
    strategy = make_strategy(1)
    call, shown = CALLS[case]
    with pytest.raises(ValueError, match=shown) as caught:
        await call(strategy)
    assert_alike(str(caught.value))
    await assert_in_step(strategy)


@pytest.mark.parametrize("call", list(UNPACKED))
async def test_one_leaf_more_in_reductions_of_their_own(
    make_strategy: MakeStrategy, call: str
) -> None:
    """Leaves too large to pack, one more on the other workers than on worker 0: every worker
    raises the same ValueError, worker 0 included (it made its one reduction), and the strategy
    goes on."""
    strategy = make_strategy(1, communication_options=CommunicationOptions(bytes_per_pack=8))
    value = {"a": ROW} if RANK == 0 else {"a": ROW, "b": ROW}
    with pytest.raises(
        ValueError, match=r"of 2 leaves: (\[0\])?\['a'\] float64 \(3,\); (\[0\])?\['b'\]"
    ) as caught:
        await UNPACKED[call](strategy, value)
    assert_alike(str(caught.value))
    await assert_in_step(strategy)


@pytest.mark.parametrize("call", list(UNPACKED))
async def test_calls_of_several_reductions_that_agree(
    make_strategy: MakeStrategy, call: str
) -> None:
    """The same structure on every worker, in reductions of their own: every worker's values
    are combined, as without packing."""
    strategy = make_strategy(2, communication_options=CommunicationOptions(bytes_per_pack=8))
    value = {"a": PerReplica([ROW, 2 * ROW]), "b": PerReplica([ROW * RANK, ROW])}
    got = await UNPACKED[call](strategy, value)
    if call == "batch_reduce_to":
        got = got[0]
    np.testing.assert_array_equal(got["a"], 3 * WORKERS * ROW)
    np.testing.assert_array_equal(got["b"], ROW * (WORKERS + sum(range(WORKERS))))


async def test_reduce_along_an_axis_in_either_byte_order(make_strategy: MakeStrategy) -> None:
    """``>f8`` on one worker, ``<f8`` on another, along an axis: the numbers of every worker,
    each in its own dtype."""
    strategy = make_strategy(2)
    dtype = np.dtype(">f8" if RANK % 2 == 0 else "<f8")
    value = PerReplica([SQUARE.astype(dtype), SQUARE[:1].astype(dtype)])
    got = await strategy.reduce("sum", value, axis=0)
    np.testing.assert_array_equal(got, WORKERS * (SQUARE.sum(axis=0) + SQUARE[0]))
    assert got.dtype == dtype


async def test_gather_of_a_new_variable_gathers_the_chiefs_value(
    make_strategy: MakeStrategy,
) -> None:
    """A variable made on every worker with another initial value takes the chief's before a
    gather reads it, as before a reduce: every copy of every worker holds the chief's."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(np.array([10.0 * (RANK + 1)]))
    gathered = await strategy.gather(v, axis=0)
    np.testing.assert_array_equal(gathered, np.full(2 * WORKERS, 10.0))
    np.testing.assert_array_equal(await strategy.reduce("mean", v), [10.0])
