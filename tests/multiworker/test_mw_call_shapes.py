"""Calls whose shape differs between workers where no data shows it: a loop of steps given
another number of steps on one worker, and a cross-replica call given an empty structure on
one worker. Every worker raises the same ValueError before anything runs or moves, and the
workers stay in step; workers that all pass the same (empty) call go on as in one process.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from test_dataset import global_batches  # the same tables as one process's tests

from aioreplica import PerReplica, WorkersDisagree
from multiworker.mwtools import RANK, WORKERS, allgather, assert_in_step, each_replica

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from aioreplica import MultiWorkerMirroredStrategy
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

ROW = np.array([1.0, 2.0, 3.0])

#: A loop of steps, given the strategy, an iterator, the number of steps and a list that
#: records each step; and the name of its argument for the number.
LOOPS: dict[str, tuple[Callable[[MultiWorkerMirroredStrategy, Any, int, list[str]], Any], str]] = {
    "run_steps": (
        lambda s, it, n, ran: s.run_steps(lambda element: ran.append("step"), it, n),
        "steps",
    ),
    "run_steps_on_iterator": (
        lambda s, it, n, ran: s.extended.experimental_run_steps_on_iterator(
            lambda context, inputs: ran.append("step"), it, iterations=n
        ),
        "iterations",
    ),
}


async def outcome(call: Awaitable[Any]) -> str:
    """What ``call`` did on this worker: the message of the WorkersDisagree it raised, or
    what it returned (compared once every worker's is collected)."""
    try:
        returned = await call
    except WorkersDisagree as disagreement:
        return str(disagreement)
    return f"returned {returned!r}"


@pytest.mark.parametrize("others", [0, 1], ids=["no steps elsewhere", "one step elsewhere"])
@pytest.mark.parametrize("loop", list(LOOPS))
async def test_other_numbers_of_steps_raise_alike(
    make_strategy: MakeStrategy, loop: str, others: int
) -> None:
    """Worker 0 given 2 steps, the others fewer: every worker raises the same WorkersDisagree
    naming each worker's number, before any step or pull from the iterator, rather than
    hanging or pairing worker 0's extra step with the others' next run(); the strategy and the
    iterator go on working."""
    strategy = make_strategy(2)
    call, counted = LOOPS[loop]
    ran: list[str] = []
    async with aiter(strategy.distribute_dataset(global_batches(16, 8))) as iterator:
        message = await outcome(call(strategy, iterator, 2 if RANK == 0 else others, ran))
        # The first batch is still the next one: rows 0 to 7, two per replica.
        labels = await strategy.run_steps(lambda element: element[1].tolist(), iterator, 1)
    shown = "; ".join(f"worker {w}: {counted}={2 if w == 0 else others}" for w in range(WORKERS))
    assert allgather((message, ran)) == [(message, [])] * WORKERS
    assert f"different numbers of steps ({shown})" in message, message
    assert each_replica(strategy, labels) == [
        [4 * RANK, 4 * RANK + 1],
        [4 * RANK + 2, 4 * RANK + 3],
    ]
    await assert_in_step(strategy)


#: Cross-replica calls given a value (a structure): their result.
CALLS: dict[str, Callable[[MultiWorkerMirroredStrategy, Any], Any]] = {
    "reduce": lambda s, value: s.reduce("sum", value),
    "reduce_to": lambda s, value: s.extended.reduce_to("sum", value, "cpu:0"),
    "batch_reduce_to": lambda s, value: s.extended.batch_reduce_to(
        "sum", [(leaf, "cpu:0") for leaf in value.values()]
    ),
    "gather": lambda s, value: s.gather(value),
}

#: Worker 0's value where the others pass an empty one, and how worker 0's call shows it:
#: one collective of one leaf, or of two in one pack (a gather, whose leaves travel one by
#: one, agrees on them first).
FULL: dict[str, tuple[dict[str, Any], str]] = {
    "one leaf": ({"a": PerReplica([ROW, ROW])}, r"float64 [^;]*at (\['a'\]|\[0\])"),
    "two small leaves": (
        {"a": PerReplica([ROW, ROW]), "b": PerReplica([2 * ROW, ROW])},
        r"leaves at \S+ \(3,\), at \S+ \(3,\)|of 2 leaves",
    ),
}


@pytest.mark.parametrize("full", list(FULL))
@pytest.mark.parametrize("call", list(CALLS))
async def test_an_empty_structure_on_some_workers_raises_alike(
    make_strategy: MakeStrategy, call: str, full: str
) -> None:
    """Worker 0 passes leaves, the others an empty structure (which makes no collective):
    every worker raises the same WorkersDisagree naming both calls, rather than the others
    returning while worker 0 waits and meets their next call; the strategy goes on."""
    strategy = make_strategy(2)
    value, shown = FULL[full]
    message = await outcome(CALLS[call](strategy, value if RANK == 0 else {}))
    # The same past the name of the collective each worker had reached.
    assert len({m.partition(":")[2] for m in allgather(message)}) == 1, message
    both = rf"worker 0: .*({shown}).*; worker 1: [^;]* of no leaves\)"
    assert re.search(both, message), message
    await assert_in_step(strategy)


@pytest.mark.parametrize("call", list(CALLS))
async def test_an_empty_structure_on_every_worker_returns_it(
    make_strategy: MakeStrategy, call: str
) -> None:
    """Every worker passes an empty structure: each returns the empty result, as in one
    process, and the workers stay in step."""
    strategy = make_strategy(2)
    got = await CALLS[call](strategy, {})
    assert allgather(got) == [[] if call == "batch_reduce_to" else {}] * WORKERS
    await assert_in_step(strategy)
