"""Building the strategy where the workers' arguments do not fit together: a rank left out of
the communicator (``MPI.COMM_NULL``), a freed communicator, something that is no communicator
while the others are on a communicator of their own, and workers that pack their collectives
differently. Each raises at once, or within ``sync_timeout``, with an error saying what is
wrong, instead of hanging or failing in every later collective.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from mpi4py import MPI

from aioreplica import CommunicationOptions, MultiWorkerMirroredStrategy, WorkersDisagree
from aioreplica.testing import host_devices, replica_context
from multiworker.mwtools import RANK, WORKERS, WORLD, allgather, each_replica

if TYPE_CHECKING:
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

#: The worker whose arguments are wrong.
LAST = WORKERS - 1


async def sum_of_ids(strategy: MultiWorkerMirroredStrategy) -> list[Any]:
    """What each local replica gets from a run() of an all_reduce of the global replica ids."""

    async def step() -> Any:
        context = replica_context()
        return await context.all_reduce("sum", float(context.replica_id_in_sync_group))

    return each_replica(strategy, await strategy.run(step))


async def work_without_the_last(communicator: MPI.Comm) -> str:
    """On a rank of ``communicator`` (every worker but the last): a strategy made on it sums
    the replica ids of its workers only; what it saw, for the test's events."""
    strategy = MultiWorkerMirroredStrategy(host_devices(1), communicator=communicator)
    try:
        assert await sum_of_ids(strategy) == [sum(range(WORKERS - 1))]
        return f"{strategy.cluster.num_workers} workers"
    finally:
        strategy.close()


async def test_a_rank_left_out_of_the_communicator_raises_at_once() -> None:
    """The last rank, left out by Split(MPI.UNDEFINED), gets MPI.COMM_NULL: it raises a
    TypeError saying so at once, with no collective, while the other ranks make their strategy
    on the communicator they are in."""
    events: list[str] = []
    sub = WORLD.Split(MPI.UNDEFINED if RANK == LAST else 0, 0)
    started = time.monotonic()
    if RANK == LAST:
        with pytest.raises(TypeError) as caught:
            MultiWorkerMirroredStrategy(host_devices(1), communicator=sub, sync_timeout=30.0)
        message = str(caught.value)
        assert "communicator is MPI.COMM_NULL: this rank is not in it" in message, message
        events.append("refused")
    else:
        try:
            events.append(await work_without_the_last(sub))
        finally:
            sub.Free()
    assert time.monotonic() - started < 10
    expected = [f"{WORKERS - 1} workers"] * (WORKERS - 1) + ["refused"]
    assert allgather(events) == [[e] for e in expected]


@pytest.mark.parametrize("kind", ["COMM_NULL", "freed"])
async def test_a_null_or_freed_communicator_says_so(kind: str) -> None:
    """Every worker given MPI.COMM_NULL, or a communicator it freed, raises a TypeError that
    says the communicator is MPI.COMM_NULL or freed (not "got Intracomm <object at ...>")."""
    communicator: MPI.Comm = MPI.COMM_NULL
    if kind == "freed":
        communicator = WORLD.Dup()
        communicator.Free()
    started = time.monotonic()
    with pytest.raises(TypeError) as caught:
        MultiWorkerMirroredStrategy(host_devices(1), communicator=communicator)
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert message.startswith("communicator is MPI.COMM_NULL: this rank is not in it"), message
    assert "or it was freed" in message, message
    assert allgather(message) == [message] * WORKERS


async def test_no_communicator_waits_for_the_others_on_comm_world_at_most_sync_timeout() -> None:
    """The last worker passes something that is no communicator while the others make their
    strategy on a communicator of their own: it looks for them on COMM_WORLD no longer than its
    sync_timeout, then raises its TypeError with a note saying they were not told. The
    refusal stays posted there: the others' next strategy on COMM_WORLD meets it and raises a
    ValueError naming the last worker."""
    events: list[str] = []
    told = WORLD.Dup()  # for the last worker to say that it raised
    sub = WORLD.Split(1 if RANK == LAST else 0, 0)
    try:
        if RANK == LAST:
            started = time.monotonic()
            with pytest.raises(TypeError) as caught:
                MultiWorkerMirroredStrategy(host_devices(1), communicator="sub", sync_timeout=0.5)
            assert time.monotonic() - started < 10
            assert "got str 'sub'" in str(caught.value)
            notes = getattr(caught.value, "__notes__", [])
            assert len(notes) == 1, notes
            assert notes[0].startswith(
                "The other workers were not told: none joined this worker's refusal on "
                "MPI.COMM_WORLD within sync_timeout (0.5 s)"
            ), notes
            events.append("refused")
            told.Barrier()
        else:
            events.append(await work_without_the_last(sub))
            told.Barrier()
            with pytest.raises(ValueError, match=f"worker {LAST} could not make its") as refused:
                MultiWorkerMirroredStrategy(host_devices(1))
            assert "TypeError: communicator must be an mpi4py intracommunicator" in str(
                refused.value
            )
            events.append("refused on COMM_WORLD")
    finally:
        told.Free()
        sub.Free()
    others = [f"{WORKERS - 1} workers", "refused on COMM_WORLD"]
    assert allgather(events) == [others] * (WORKERS - 1) + [["refused"]]


async def test_a_sync_timeout_too_large_for_a_float_is_refused_on_every_worker() -> None:
    """A sync_timeout of 10**400 on the last worker (too large for a float: infinite) is its
    ValueError, and every other worker's construction raises naming it instead of waiting for
    it; then a strategy made alike on every worker works."""
    given: Any = 10**400 if RANK == LAST else None
    outcome = ""
    try:
        MultiWorkerMirroredStrategy(["cpu:0"], sync_timeout=given)
    except ValueError as exc:
        outcome = str(exc)
    if RANK == LAST:
        assert outcome.startswith("sync_timeout must be a positive number of seconds"), outcome
        assert "which is infinite or too large" in outcome, outcome
    else:
        assert f"worker {LAST} could not make its MultiWorkerMirroredStrategy" in outcome, outcome
    strategy = MultiWorkerMirroredStrategy(["cpu:0"])
    try:
        total = await strategy.reduce("sum", np.ones(1))
        assert total.tolist() == [float(WORKERS)]
    finally:
        strategy.close()


async def test_other_pack_sizes_are_refused_on_every_worker() -> None:
    """Workers given another CommunicationOptions.bytes_per_pack (16 and 0, the default)
    would pack the same values into different collectives: every worker raises the same
    ValueError naming the option and each worker's pack size; workers given the same one
    then make a strategy that reduces packed values."""
    packs = [16 if w == 0 else 0 for w in range(WORKERS)]
    with pytest.raises(ValueError, match=r"CommunicationOptions\.bytes_per_pack differ") as caught:
        MultiWorkerMirroredStrategy(
            host_devices(2), communication_options=CommunicationOptions(bytes_per_pack=packs[RANK])
        )
    message = str(caught.value)
    shown = "; ".join(f"worker {w}: {p or 4 << 20} bytes" for w, p in enumerate(packs))
    assert f"({shown}; a bytes_per_pack of 0 counts as its default)" in message, message
    assert allgather(message) == [message] * WORKERS
    strategy = MultiWorkerMirroredStrategy(
        host_devices(2), communication_options=CommunicationOptions(bytes_per_pack=16)
    )
    try:

        async def step() -> Any:
            return await replica_context().all_reduce("sum", [np.ones(3), np.ones(5)])

        result = each_replica(strategy, await strategy.run(step))
        expected = 2.0 * WORKERS
        assert [[part.tolist() for part in parts] for parts in result] == [
            [[expected] * 3, [expected] * 5]
        ] * 2
    finally:
        strategy.close()


async def test_other_pack_sizes_in_a_calls_options_are_named(make_strategy: MakeStrategy) -> None:
    """One collective given options= whose bytes_per_pack differs between the workers packs
    the same values differently: every worker raises the same WorkersDisagree, which says
    that the call's bytes_per_pack may differ; the workers stay in step."""
    strategy = make_strategy(2)
    options = CommunicationOptions(bytes_per_pack=16 if RANK == 0 else 0)

    async def step() -> Any:
        return await replica_context().all_reduce("sum", [np.ones(3), np.ones(5)], options=options)

    with pytest.raises(WorkersDisagree) as caught:
        await strategy.run(step)
    message = str(caught.value)
    assert "the CommunicationOptions.bytes_per_pack of this call's options= differ" in message, (
        message
    )
    assert allgather(message) == [message] * WORKERS
    assert await sum_of_ids(strategy) == [sum(range(2 * WORKERS))] * 2
