"""The workers compare their merge calls at the end of every run(): a merge function runs once
per worker and makes no cross-worker collective of its own, so merge calls that differ between
workers raise ``ReplicaSyncError`` on every worker, as replicas that differ in one process do.

Runs under ``mpiexec -n 2`` (see conftest.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import aioreplica
from aioreplica import ReplicaSyncError
from aioreplica.testing import replica_context
from multiworker.mwtools import RANK, WORKERS, allgather

if TYPE_CHECKING:
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio


def merge_a(strategy: Any, *values: Any) -> str:
    return "a"


def merge_b(strategy: Any, *values: Any) -> str:
    return "b"


#: Per case, the merge functions of worker 0's run() and of the other workers'.
SEQUENCES: dict[str, tuple[list[Any], list[Any]]] = {
    "skipped": ([merge_a], []),
    "other function": ([merge_a], [merge_b]),
    "one more": ([merge_a, merge_a], [merge_a]),
    "other order": ([merge_a, merge_b], [merge_b, merge_a]),
    "other order, repeated": ([merge_a, merge_a, merge_b], [merge_a, merge_b, merge_a]),
}


@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize("case", list(SEQUENCES))
async def test_workers_making_other_merge_calls_fail_alike(
    make_strategy: MakeStrategy, case: str, local: int
) -> None:
    """Worker 0's replicas make other merge calls than the other workers' (none, another merge
    function, one more, another order): every worker's run() raises the same ReplicaSyncError
    naming what each worker made and the workers that differ; the merge functions ran apart, so
    the strategy then refuses further cross-worker calls."""
    strategy = make_strategy(local)
    first, others = SEQUENCES[case]
    mine = first if RANK == 0 else others

    async def step() -> int:
        ctx = replica_context()
        for merge_fn in mine:
            await ctx.merge_call(merge_fn)
        return RANK

    with pytest.raises(ReplicaSyncError) as caught:
        await strategy.run(step)
    message = str(caught.value)
    assert len(set(allgather(message))) == 1, message  # the same error on every worker
    assert "made different merge calls" in message, message
    for name in {fn.__name__ for fn in first + others}:
        assert name in message, message
    if not others:
        assert "worker 1: no merge_call" in message, message
    assert caught.value.workers == tuple(range(1, WORKERS))
    assert caught.value.replicas == tuple(range(local, WORKERS * local))
    with pytest.raises(RuntimeError, match="fell out of step"):
        await strategy.run(lambda: RANK)


async def test_run_steps_compares_the_merge_calls_of_every_step(
    make_strategy: MakeStrategy,
) -> None:
    """run_steps: worker 1 merges with another function in its second step only; every
    worker's run_steps raises ReplicaSyncError, and the strategy refuses further calls."""
    strategy = make_strategy(1)
    batches = aioreplica.batched(np.arange(3.0 * WORKERS), WORKERS)
    iterator = aiter(strategy.distribute_dataset(batches))
    steps: list[float] = []

    async def step(x: Any) -> str:
        merge_fn = merge_b if RANK == 1 and len(steps) == 1 else merge_a
        steps.append(float(x.sum()))
        result: str = await replica_context().merge_call(merge_fn, args=(x,))
        return result

    with pytest.raises(ReplicaSyncError, match="made different merge calls") as caught:
        await strategy.run_steps(step, iterator, 3)
    assert len(set(allgather(str(caught.value)))) == 1
    assert len(steps) == 3
    with pytest.raises(RuntimeError, match="fell out of step"):
        await strategy.run(lambda: RANK)


async def test_same_merge_calls_with_new_functions_agree(make_strategy: MakeStrategy) -> None:
    """A merge function made anew in every step (a lambda, a partial) is the same merge call
    on every worker, run after run."""
    strategy = make_strategy(2)

    async def step() -> Any:
        ctx = replica_context()
        first = await ctx.merge_call(
            lambda s, v: sum(v.values), args=(ctx.replica_id_in_sync_group,)
        )
        return await ctx.merge_call(merge_a, args=(first,))

    results = [await strategy.run(step) for _ in range(3)]
    assert results == ["a", "a", "a"]
