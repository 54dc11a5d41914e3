"""A step that fails on one worker while a dataset pass prefetches: every worker's call raises.

A prefetching pass over a distributed dataset makes its agreements (does any worker still have
data?) on a communicator of its own, beside the step's collectives, and both kinds of wait
listen for a peer's failure notice. The notice comes once; the wait that takes it must not
leave the other one waiting for a collective that the failed worker will never make.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest
from test_dataset import global_batches

from aioreplica import ReplicaSyncError
from aioreplica.testing import replica_context
from multiworker.mwtools import RANK, WORLD, allgather

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

#: The step (from 1) at which worker 1's replica raises, and worker 0's makes an all_reduce
#: that worker 1 never makes.
FAILING_STEP = 3


class StepFailed(ArithmeticError):
    """What worker 1's replica raises at ``FAILING_STEP``."""


async def test_a_step_failing_on_one_worker_stops_run_steps_over_a_prefetching_pass(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 1's replica raises at step 3 of ``run_steps`` over a prefetching pass, and worker
    1 goes on to other work; worker 0 waits in that step's all_reduce, and its prefetcher then
    makes the pass's next agreement, which worker 1's prefetcher had made before it failed, so
    that agreement meets the failure notice first. Worker 0's ``run_steps`` still raises a
    ReplicaSyncError naming worker 1, instead of waiting for the all_reduce forever, and
    worker 1's raises its replica's own exception."""
    strategy = make_strategy(1)
    go = WORLD.Dup()  # worker 1 tells worker 0 that its run_steps has raised
    reached = anyio.Event()  # worker 0's step 3 waits in its all_reduce
    pulled = anyio.Event()  # worker 1's pass has started its agreement on the next batch
    batches = global_batches(32, 4)

    async def dataset() -> AsyncIterator[Any]:
        for index, batch in enumerate(batches):
            if index == FAILING_STEP and RANK == 1:  # the batch after the failing step's
                pulled.set()  # its agreement starts as it is yielded, before the step resumes
            if index == FAILING_STEP and RANK == 0:
                await reached.wait()
                # Blocking the event loop until worker 1 has failed: its failure notice is
                # here before anything on this worker can test for it, and the pass's
                # agreement on this batch is the first to.
                go.recv(source=1)
            yield batch

    steps: list[int] = []

    async def step(element: Any) -> None:
        steps.append(len(steps) + 1)
        if len(steps) == FAILING_STEP:
            if RANK == 1:
                await pulled.wait()
                raise StepFailed(f"step {FAILING_STEP} failed on worker 1")
            reached.set()
        await replica_context().all_reduce("sum", np.ones(2))

    outcome: tuple[str, Any]
    async with aiter(strategy.distribute_dataset(dataset(), prefetch=1)) as iterator:
        try:
            await strategy.run_steps(step, iterator, 8)
        except ReplicaSyncError as exc:
            outcome = ("ReplicaSyncError naming workers", exc.workers)
        except StepFailed as exc:
            outcome = ("StepFailed", str(exc))
        else:
            outcome = ("returned", None)
        if RANK == 1:
            go.send(None, dest=0)
    go.Free()
    assert allgather((steps, outcome)) == [
        ([1, 2, 3], ("ReplicaSyncError naming workers", (1,))),
        ([1, 2, 3], ("StepFailed", "step 3 failed on worker 1")),
    ]
