"""Variables across workers before their first use: they start from the chief's value, which
every read shows, a restore or an update replaces, and a repr names without a collective.

Each worker makes its variables with an initial value of its own (the chief's is the one that
counts), and what each rank saw is compared through ``allgather``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from aioreplica import Checkpoint, CheckpointError, PerReplica, Variable
from multiworker.mwtools import RANK, WORKERS, WORLD, allgather, shared_directory

if TYPE_CHECKING:
    from collections.abc import Callable

    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]

#: The variables a checkpoint restores into before their first use: name, dtype,
#: synchronization, aggregation, and the value saved (one that a SUM split over 2 or 4
#: copies leaves a remainder of).
KINDS: list[tuple[str, type[np.generic], str, str, float]] = [
    ("sum_int", np.int64, "on_read", "sum", 7),
    ("sum_float", np.float64, "on_read", "sum", 7.5),
    ("mean_float", np.float64, "on_read", "mean", 7.5),
    ("first_int", np.int64, "on_read", "only_first_replica", 7),
    ("first_float", np.float64, "on_read", "only_first_replica", 7.5),
    ("mirrored_int", np.int64, "on_write", "none", 7),
]


def own_value(rank: int = RANK) -> Array:
    """A different initial value on every worker; the chief's is ``own_value(0)``."""
    return np.array([10.0 * (rank + 1), 1.0])


def new_variables(strategy: Any) -> dict[str, Variable]:
    """One variable of every kind of ``KINDS``, each worker's starting from 100 * (rank + 1)."""
    with strategy.scope():
        return {
            name: Variable(
                100 * (RANK + 1),
                dtype=dtype,
                name=name,
                synchronization=sync,
                aggregation=aggregation,
            )
            for name, dtype, sync, aggregation, _ in KINDS
        }


def every_copy(variable: Variable) -> list[Any]:
    """Every copy of ``variable`` over all workers, in global replica order."""
    mine = [np.asarray(copy).item() for copy in variable.values]
    return [copy for copies in allgather(mine) for copy in copies]


@pytest.mark.parametrize("local", [1, 2])
async def test_a_restore_before_the_first_use_reads_the_saved_value(
    make_strategy: MakeStrategy, local: int
) -> None:
    """Variables restored before their first use read the saved value on every worker: a
    SUM sync-on-read variable's copies sum to it over all workers (its first sync does not
    copy the chief's first copy over the split total), the others' copies each hold it."""
    strategy = make_strategy(local)
    with shared_directory() as directory:
        path = os.path.join(directory, "saved.npz")
        if RANK == 0:  # written by one process alone: plain variables, no collective
            saved = {
                name: Variable(value, dtype=dtype, name=name) for name, dtype, _, _, value in KINDS
            }
            await Checkpoint(**saved).save(path)
        WORLD.Barrier()
        variables = new_variables(strategy)
        await Checkpoint(**variables).restore(path)
        read = {name: v.numpy().item() for name, v in variables.items()}
        copies = {name: every_copy(v) for name, v in variables.items()}
        WORLD.Barrier()
    want = {name: value for name, _, _, _, value in KINDS}
    assert allgather(read) == [want] * WORKERS
    n = WORKERS * local
    assert sum(copies["sum_int"]) == 7
    assert sum(copies["sum_float"]) == 7.5
    assert {name: set(c) for name, c in copies.items() if not name.startswith("sum")} == {
        name: {value} for name, value in want.items() if not name.startswith("sum")
    }
    assert all(len(c) == n for c in copies.values())


async def test_a_refused_restore_leaves_variables_to_take_the_chiefs_value(
    make_strategy: MakeStrategy,
) -> None:
    """A restore refused on every worker (a saved value of another shape) changes nothing: the
    variable still takes the chief's value at its first use."""
    strategy = make_strategy(2)
    with shared_directory() as directory:
        path = os.path.join(directory, "other_shape.npz")
        if RANK == 0:
            await Checkpoint(w=Variable(np.zeros(3), name="w")).save(path)
        WORLD.Barrier()
        with strategy.scope():
            w = Variable(own_value(), name="w")
        with pytest.raises(CheckpointError):
            await Checkpoint(w=w).restore(path)
        shown = repr(w)
        WORLD.Barrier()
    assert "takes the chief's value when first used" in shown
    assert allgather(w.numpy().tolist()) == [own_value(0).tolist()] * WORKERS


@pytest.mark.parametrize("local", [1, 2])
async def test_a_cross_replica_assign_before_the_first_use_sets_the_global_total(
    make_strategy: MakeStrategy, local: int
) -> None:
    """assign() in cross-replica context as the first use of an integer SUM sync-on-read
    variable: its copies over all workers sum to the value assigned."""
    strategy = make_strategy(local)
    with strategy.scope():
        count = Variable(
            100 * (RANK + 1), name="count", synchronization="on_read", aggregation="sum"
        )
    await count.assign(7)
    assert allgather(int(count.numpy())) == [7] * WORKERS
    assert sum(every_copy(count)) == 7


@pytest.mark.parametrize("local", [1, 2])
async def test_an_update_before_the_first_use_starts_from_the_chiefs_value(
    make_strategy: MakeStrategy, local: int
) -> None:
    """``extended.update`` outside run() as the first use of a sync-on-read variable updates
    the chief's value, each copy with its own replica's argument, on every worker."""
    strategy = make_strategy(local)
    with strategy.scope():
        total = Variable(
            100.0 * (RANK + 1), name="total", synchronization="on_read", aggregation="sum"
        )
    steps = PerReplica([float(RANK * local + j) for j in range(local)])  # global replica id
    new = await strategy.extended.update(total, lambda copy, step: copy + step, args=(steps,))
    n = WORKERS * local
    assert allgather([float(c) for c in strategy.experimental_local_results(new)]) == [
        [100.0 + w * local + j for j in range(local)] for w in range(WORKERS)
    ]
    assert every_copy(total) == [100.0 + g for g in range(n)]
    assert allgather(float(total.numpy())) == [100.0 * n + sum(range(n))] * WORKERS


@pytest.mark.parametrize("synchronization", ["on_write", "on_read"])
async def test_copies_read_before_the_first_use_are_the_chiefs(
    make_strategy: MakeStrategy, synchronization: str
) -> None:
    """Every read of a variable's copies before its first use shows the chief's value on
    every worker: ``values``, ``experimental_local_results``, ``value_container``,
    ``strategy.gather``, as ``numpy()`` does."""
    strategy = make_strategy(2)
    chief = own_value(0).tolist()
    reads: dict[str, Callable[[Variable], list[Any]]] = {
        "values": lambda v: [copy.tolist() for copy in v.values],
        "experimental_local_results": lambda v: [
            np.asarray(copy).tolist() for copy in strategy.experimental_local_results(v)
        ],
        "value_container": lambda v: [
            np.asarray(copy).tolist()
            for copy in strategy.experimental_local_results(strategy.extended.value_container(v))
        ],
    }
    got: dict[str, Any] = {}
    for what, read in reads.items():
        with strategy.scope():
            v = Variable(own_value(), name=what, synchronization=synchronization, aggregation="sum")
        got[what] = read(v)
    with strategy.scope():
        v = Variable(own_value(), name="gather", synchronization=synchronization, aggregation="sum")
    got["gather"] = (await strategy.gather(v, axis=0)).tolist()
    want = {what: [chief, chief] for what in reads} | {"gather": chief * (2 * WORKERS)}
    assert allgather(got) == [want] * WORKERS


async def test_a_repr_before_the_first_use_makes_no_collective(
    make_strategy: MakeStrategy,
) -> None:
    """repr() of a variable not used yet (a log line on the chief alone) says it takes the
    chief's value when first used and shows this worker's copies, with no collective: the
    workers stay in step, and the first read then gives the chief's value everywhere."""
    strategy = make_strategy(2)
    with strategy.scope():
        w = Variable(own_value(), name="w")
    if RANK == 0:
        assert repr(w) == (
            "<aioreplica.MirroredVariable 'w' shape=(2,) dtype=float64 devices=['cpu:0', "
            "'cpu:1'] value=<takes the chief's value when first used; this worker's copies: "
            "array([10.,  1.]), array([10.,  1.])>>"
        )
    assert allgather(w.numpy().tolist()) == [own_value(0).tolist()] * WORKERS
    assert allgather(repr(w).endswith("value=array([10.,  1.])>")) == [True] * WORKERS
