"""A worker that fails after a collective that it completed: under ``sync_timeout`` the other
workers' same collective completes too, and they raise at their next call, not in it.

Worker 1 reaches the end of a collective late, so worker 0 waits in it (backing off) while
worker 1 completes it and fails right after; worker 1's failure notice then reaches worker 0
with (or before) the collective's data. The collective made on every worker succeeds on
every worker, and the failure stops each worker's next call: a step reported as failed on
one worker and done on another, or a write committed on one worker only, would leave the
workers telling different stories.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

from aioreplica import ReplicaSyncError, Variable
from aioreplica.testing import replica_context
from multiworker.mwtools import RANK, allgather

if TYPE_CHECKING:
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

#: How long worker 1 keeps worker 0 waiting (seconds): past the waits' busy phase, so that
#: worker 0 backs off and tests its side channel before the collective's data comes.
LATE = 0.3


def _fail_on_worker_1() -> None:
    if RANK == 1:
        raise ValueError("worker 1's next step fails")


async def _what_happens(call: Any) -> str:
    try:
        await call()
    except ReplicaSyncError as exc:
        return f"ReplicaSyncError naming workers {exc.workers}"
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "done"


async def test_a_run_that_completed_everywhere_succeeds_everywhere(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 1 ends its ``run()`` late and fails in the next one: the late ``run()`` returns
    on both workers, with its write on both, and the next one raises on both (worker 0's
    naming worker 1)."""
    strategy = make_strategy(1, sync_timeout=30)
    with strategy.scope():
        v = Variable(0.0, name="v")

    async def late_step() -> str:
        await v.assign_add(1.0)
        if RANK == 1:
            await anyio.sleep(LATE)
        return "step done"

    async def next_step() -> None:
        _fail_on_worker_1()

    results = []
    results.append(await _what_happens(lambda: strategy.run(late_step)))
    results.append(await _what_happens(lambda: strategy.run(next_step)))
    copies = [float(c) for c in strategy.experimental_local_results(v)]
    assert allgather((results, copies)) == [
        (["done", "ReplicaSyncError naming workers (1,)"], [1.0]),
        (["done", "ValueError: worker 1's next step fails"], [1.0]),
    ]


async def test_a_write_that_completed_everywhere_is_committed_everywhere(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 1 reaches a write outside ``run()`` late and fails in the ``run()`` after it:
    the write is committed on both workers (their copies stay equal), and the ``run()``
    raises on both."""
    strategy = make_strategy(1, sync_timeout=30)
    with strategy.scope():
        v = Variable(0.0, name="v")
    await v.assign(1.0)  # its first use: every worker takes the chief's value
    if RANK == 1:
        await anyio.sleep(LATE)

    async def step() -> None:
        _fail_on_worker_1()

    async def write() -> None:
        await v.assign(2.0)

    results = [await _what_happens(write), await _what_happens(lambda: strategy.run(step))]
    copies = [float(c) for c in strategy.experimental_local_results(v)]
    assert allgather((results, copies)) == [
        (["done", "ReplicaSyncError naming workers (1,)"], [2.0]),
        (["done", "ValueError: worker 1's next step fails"], [2.0]),
    ]


async def test_the_failure_is_raised_once_then_every_call_is_refused(
    make_strategy: MakeStrategy,
) -> None:
    """The failure kept for the next call is raised by that call alone; the calls after it
    are refused as after any cross-worker failure."""
    strategy = make_strategy(1, sync_timeout=30)

    async def late_step() -> float:
        total = await replica_context().all_reduce("sum", 1.0)
        if RANK == 1:
            await anyio.sleep(LATE)
        return float(total)

    async def next_step() -> None:
        _fail_on_worker_1()

    assert await strategy.run(late_step) == 2.0
    first = await _what_happens(lambda: strategy.run(next_step))
    with pytest.raises(RuntimeError, match="fell out of step") as refused:
        await strategy.reduce("sum", np.ones(1))
    assert not isinstance(refused.value, ReplicaSyncError)
    assert allgather(first) == [
        "ReplicaSyncError naming workers (1,)",
        "ValueError: worker 1's next step fails",
    ]


async def test_a_write_cancelled_on_one_worker_is_made_on_none(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 1's write outside ``run()`` is cancelled while it waits for worker 0, after its
    part of the exchange went out: worker 0, coming later, finds the exchange complete, yet
    raises naming worker 1 instead of writing alone; both keep the old value."""
    strategy = make_strategy(1)
    with strategy.scope():
        v = Variable(1.0, name="v")
    await v.assign(1.0)  # its first use: every worker takes the chief's value

    async def write() -> None:
        if RANK == 1:
            with anyio.move_on_after(LATE):
                await v.assign(7.0)
            raise ValueError("cancelled on worker 1")
        await anyio.sleep(2 * LATE)  # once worker 1 has given up
        await v.assign(7.0)

    result = await _what_happens(write)
    copies = [float(c) for c in strategy.experimental_local_results(v)]
    assert allgather((result, copies)) == [
        ("ReplicaSyncError naming workers (1,)", [1.0]),
        ("ValueError: cancelled on worker 1", [1.0]),
    ]
