"""Helpers of the multi-worker tests: the world, strategies, and comparing ranks with mpi4py.

Tests compute what they expect with NumPy on the whole global data, which every rank can
build (seeded), and compare what each rank got through ``COMM_WORLD.allgather``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from aioreplica import MultiWorkerMirroredStrategy, select_replica
from aioreplica.testing import host_devices, replica_context

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    #: The ``make_strategy`` fixture (conftest.py).
    MakeStrategy = Callable[..., MultiWorkerMirroredStrategy]

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
WORKERS = WORLD.Get_size()

Array = np.ndarray[Any, Any]


def strategy(local: int = 2, **kwargs: Any) -> MultiWorkerMirroredStrategy:
    """A ``MultiWorkerMirroredStrategy`` over ``cpu:0`` ... ``cpu:{local-1}`` on this worker."""
    return MultiWorkerMirroredStrategy(host_devices(local), **kwargs)


def each_replica(strategy: MultiWorkerMirroredStrategy, result: Any) -> list[Any]:
    """What each local replica returned, from run()'s regrouped ``result`` (any structure)."""
    return [select_replica(j, result) for j in range(len(strategy.extended.worker_devices))]


async def assert_in_step(strategy: MultiWorkerMirroredStrategy) -> None:
    """The workers are still in step: a run() of an all_reduce sums every worker's replicas."""

    async def step() -> Any:
        context = replica_context()
        return await context.all_reduce("sum", float(context.replica_id_in_sync_group))

    total = sum(range(len(strategy.extended.worker_devices) * WORKERS))
    assert each_replica(strategy, await strategy.run(step)) == [total] * 2


def global_ids(local: int, worker: int = RANK) -> list[int]:
    """The global replica ids of ``worker``'s local replicas (worker-major)."""
    return [worker * local + j for j in range(local)]


def allgather(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order."""
    result: list[Any] = WORLD.allgather(value)
    return result


def fingerprint(value: Any) -> tuple[str, tuple[int, ...], bytes]:
    """The dtype, shape and bytes of ``value`` as a host array: equal means bitwise equal."""
    array = np.ascontiguousarray(np.asarray(value))
    return (array.dtype.str, array.shape, array.tobytes())


def assert_same_on_every_worker(*values: Any) -> None:
    """Every value is bitwise identical on every rank (dtype, shape and bytes)."""
    mine = [fingerprint(v) for v in values]
    everyone = allgather(mine)
    for rank, theirs in enumerate(everyone):
        assert theirs == everyone[0], f"rank {rank} differs from rank 0"


def rows(value: Any) -> int:
    return int(np.asarray(value).shape[0])


@contextlib.contextmanager
def shared_directory() -> Iterator[str]:
    """A fresh directory every rank sees (made by rank 0, its name broadcast); removed after.

    The multi-worker strategy assumes a shared filesystem: here, the one machine's.
    """
    path = tempfile.mkdtemp(prefix="aioreplica-mw-") if RANK == 0 else None
    path = WORLD.bcast(path, root=0)
    assert path is not None
    try:
        yield path
    finally:
        WORLD.Barrier()
        if RANK == 0:
            for root, dirs, files in os.walk(path, topdown=False):
                for name in files:
                    os.remove(os.path.join(root, name))
                for name in dirs:
                    os.rmdir(os.path.join(root, name))
            os.rmdir(path)
