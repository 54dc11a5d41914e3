"""Variables across workers: the chief's initial value, writes, optimizer steps, sync-on-read.

Copies are compared bitwise across workers (dtype, shape and bytes through ``allgather``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

import aioreplica
from aioreplica import MirroredVariable, PerReplica, SyncOnReadVariable, Variable
from aioreplica._backends import HOST_BACKEND
from aioreplica.optimizers import SGD, Adam, Optimizer
from aioreplica.testing import replica_context, replica_id
from multiworker.mwtools import (
    RANK,
    WORKERS,
    WORLD,
    allgather,
    assert_same_on_every_worker,
    global_ids,
)

if TYPE_CHECKING:
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]


def worker_value(rank: int) -> Array:
    """A different initial value on every worker; the chief's is ``worker_value(0)``."""
    return np.arange(4, dtype=np.float64) + 10.0 * rank


def assert_copies_equal(v: Variable, want: Any) -> None:
    """Every local copy of ``v`` equals ``want`` exactly, and every worker holds the same."""
    for copy in v.values:
        np.testing.assert_array_equal(copy, np.asarray(want, dtype=v.dtype), strict=True)
    assert_same_on_every_worker(*v.values)


@pytest.mark.parametrize("local", [1, 2])
async def test_chief_initial_value_wins_in_run(make_strategy: MakeStrategy, local: int) -> None:
    """Each worker passes its own initial value; the first run() sees the chief's everywhere."""
    strategy = make_strategy(local)
    with strategy.scope():
        v = Variable(worker_value(RANK), name="w")
    assert isinstance(v, MirroredVariable)
    assert len(v.values) == local

    async def step() -> Array:
        return np.array(v.value())

    for got in strategy.experimental_local_results(await strategy.run(step)):
        np.testing.assert_array_equal(got, worker_value(0))
    assert_copies_equal(v, worker_value(0))


async def test_chief_initial_value_wins_in_a_cross_replica_read(
    make_strategy: MakeStrategy,
) -> None:
    """A cross-replica read (on every worker) is the first use: it gives the chief's value."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(worker_value(RANK), name="w")
        flag = Variable(RANK == 0, name="flag")
    np.testing.assert_array_equal(v.numpy(), worker_value(0))
    assert bool(flag.numpy()) is True
    assert_copies_equal(v, worker_value(0))
    assert_copies_equal(flag, True)


async def test_chief_initial_value_wins_before_a_write(make_strategy: MakeStrategy) -> None:
    """A cross-replica assign_add as first use adds to the chief's value on every worker."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(worker_value(RANK).astype(np.float32), name="w")
    await v.assign_add(np.float32(1.5))
    assert_copies_equal(v, worker_value(0).astype(np.float32) + np.float32(1.5))


async def test_chief_initial_value_from_a_callable(make_strategy: MakeStrategy) -> None:
    """A callable initial value (called on each worker) also ends as the chief's."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(lambda: np.full((2, 2), RANK + 1, dtype=np.int32), name="counts")

    async def step() -> Array:
        return np.array(v.value())

    for got in strategy.experimental_local_results(await strategy.run(step)):
        np.testing.assert_array_equal(got, np.full((2, 2), 1, dtype=np.int32))
    assert_copies_equal(v, np.full((2, 2), 1, dtype=np.int32))


@pytest.mark.parametrize("local", [1, 2])
async def test_mirrored_writes_in_both_contexts(make_strategy: MakeStrategy, local: int) -> None:
    """Cross-replica writes, and replica writes aggregated SUM / MEAN / ONLY_FIRST_REPLICA over
    all workers' replicas, leave every copy on every worker bitwise equal."""
    strategy = make_strategy(local)
    n = WORKERS * local
    data = np.random.default_rng(11).normal(size=(n, 3))
    with strategy.scope():
        plain = Variable(np.zeros(3), name="plain")
        total = Variable(np.zeros(3), name="total", aggregation="sum")
        mean = Variable(np.zeros(3), name="mean", aggregation="mean")
        first = Variable(np.zeros(3), name="first", aggregation="only_first_replica")

    await plain.assign(np.full(3, 2.0))
    await plain.assign_add(np.array([1.0, 2.0, 3.0]))
    await plain.assign_sub(0.5)
    assert_copies_equal(plain, np.array([2.5, 3.5, 4.5]))

    async def step() -> None:
        g = replica_id()
        await total.assign_add(data[g])
        await total.assign_add(data[g])
        await mean.assign(data[g])
        await first.assign(data[g] + 100.0)

    await strategy.run(step)
    np.testing.assert_allclose(total.values[0], 2 * data.sum(axis=0), rtol=1e-12)
    assert_same_on_every_worker(*total.values)
    np.testing.assert_allclose(mean.values[0], data.mean(axis=0), rtol=1e-12)
    assert_same_on_every_worker(*mean.values)
    assert_copies_equal(first, data[0] + 100.0)


#: Writes in cross-replica context, each worker passing its own ``value`` (``rank``'s),
#: and what the variable holds after on every worker: ``after(start, chief's value)``.
CROSS_REPLICA_WRITES: dict[str, tuple[str, str, Any]] = {
    "mirrored assign": ("mean", "assign", lambda start, chiefs: chiefs),
    "mirrored assign_add": ("mean", "assign_add", lambda start, chiefs: start + chiefs),
    "mirrored assign_sub": ("mean", "assign_sub", lambda start, chiefs: start - chiefs),
    "sync-on-read SUM assign": ("sum", "assign", lambda start, chiefs: chiefs),
    "sync-on-read MEAN assign_add": ("mean", "assign_add", lambda start, chiefs: start + chiefs),
}


@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize("case", list(CROSS_REPLICA_WRITES))
async def test_a_cross_replica_write_takes_the_chiefs_value(
    make_strategy: MakeStrategy, local: int, case: str
) -> None:
    """A write outside run() made with a different value on every worker (a random
    re-initialisation, say) writes the chief's on every worker, as a new variable starts from
    the chief's initial value: the copies stay identical."""
    strategy = make_strategy(local)
    aggregation, op, after = CROSS_REPLICA_WRITES[case]
    start = np.array([1.0, 2.0, 3.0], np.float32)
    with strategy.scope():
        if case.startswith("mirrored"):
            v = Variable(start, name="v", aggregation=aggregation)
        else:
            v = Variable(start, name="v", synchronization="on_read", aggregation=aggregation)
    await strategy.run(lambda: None)  # synced: the write alone decides
    mine = (np.arange(3) + 10.0 * (RANK + 1)).astype(np.float32)
    await getattr(v, op)(mine)
    chiefs = (np.arange(3) + 10.0).astype(np.float32)
    np.testing.assert_array_equal(v.numpy(), after(start, chiefs))  # the global read
    assert_same_on_every_worker(*v.values)


@pytest.mark.parametrize("local", [1, 2])
async def test_a_cross_replica_write_copies_the_chiefs_value_alone(
    make_strategy: MakeStrategy, monkeypatch: pytest.MonkeyPatch, local: int
) -> None:
    """A write outside run() moves the chief's value; the other workers give their value's
    shape and dtype alone, which the workers compare, and copy nothing off their replicas'
    devices (a write of a large variable would copy it on every worker for nothing)."""
    strategy = make_strategy(local)
    shape = (256, 1024)  # 1 MiB of float32: it follows the records
    with strategy.scope():
        v = Variable(np.zeros(shape, np.float32), name="v")
    await strategy.run(lambda: None)
    copied: list[tuple[int, ...]] = []
    to_host = HOST_BACKEND.to_host

    async def recording(value: Any, device: Any) -> Array:
        copied.append(tuple(value.shape))
        return await to_host(value, device)

    monkeypatch.setattr(HOST_BACKEND, "to_host", recording)
    await v.assign(np.full(shape, RANK + 1.0, np.float32))
    assert copied == ([shape] if RANK == 0 else [])
    assert_copies_equal(v, np.ones(shape))
    with pytest.raises(ValueError, match=r"refusing its arguments|shape") as caught:
        await v.assign(np.ones((2, 2) if RANK == WORKERS - 1 else shape, np.float32))
    if RANK != WORKERS - 1:
        assert f"worker {WORKERS - 1}: " in str(caught.value)
    assert_copies_equal(v, np.ones(shape))


#: Cross-replica writes with bad arguments (``bad``), and their errors.
BAD_CROSS_REPLICA_WRITES: dict[str, tuple[Any, type[Exception]]] = {
    "shape": (lambda v, m, bad: v.assign(np.ones(4 if bad else 3)), ValueError),
    "dtype": (
        lambda v, m, bad: v.assign_add(np.ones(3, np.complex64 if bad else np.float32)),
        TypeError,
    ),
    "PerReplica": (
        lambda v, m, bad: v.assign(PerReplica([np.ones(3)] * 2) if bad else np.ones(3)),
        TypeError,
    ),
    "SUM assign_add": (lambda v, m, bad: m.assign_add(1.0) if bad else m.assign(1.0), ValueError),
    "update fn not callable": (
        lambda v, m, bad: v.distribute_strategy.extended.update(v, None if bad else np.negative),
        TypeError,
    ),
    "update fn async": (
        lambda v, m, bad: v.distribute_strategy.extended.update(
            v, _async_negative if bad else np.negative
        ),
        TypeError,
    ),
    "update args": (
        lambda v, m, bad: v.distribute_strategy.extended.update(
            v, np.multiply, 5 if bad else (2.0,)
        ),
        TypeError,
    ),
    "update fn raising": (
        lambda v, m, bad: v.distribute_strategy.extended.update(
            v, _missing_key if bad else np.negative
        ),
        KeyError,
    ),
}


async def _async_negative(copy: Any) -> Any:
    return -copy


def _missing_key(copy: Any) -> Any:
    found: dict[str, Any] = {}
    return found["missing"]


@pytest.mark.parametrize("everywhere", [True, False], ids=["every worker", "one worker"])
@pytest.mark.parametrize("case", list(BAD_CROSS_REPLICA_WRITES))
async def test_a_bad_cross_replica_write_is_refused_everywhere(
    make_strategy: MakeStrategy, case: str, everywhere: bool
) -> None:
    """A cross-replica write refused on one worker raises on every worker (the others a
    ValueError naming it), instead of leaving them waiting for the chief's value; nothing is
    written anywhere, and the next write and run() work."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(np.zeros(3, np.float32), name="v")
        m = Variable(np.zeros(3), name="m", synchronization="on_read", aggregation="sum")
    await strategy.run(lambda: None)
    write, error = BAD_CROSS_REPLICA_WRITES[case]
    bad = everywhere or RANK == WORKERS - 1
    with pytest.raises(error if bad else ValueError) as caught:
        await write(v, m, bad)
    if not bad:
        assert f"worker {WORKERS - 1}: " in str(caught.value)
        assert "refusing its arguments" in str(caught.value)
    assert_copies_equal(v, np.zeros(3))
    for copy in m.values:
        np.testing.assert_array_equal(copy, np.zeros(3))
    await v.assign(np.full(3, float(RANK)))
    assert_copies_equal(v, np.zeros(3))  # the chief's
    await strategy.run(lambda: None)


@pytest.mark.parametrize("everywhere", [True, False], ids=["every worker", "one worker"])
async def test_an_update_outside_run_takes_the_chiefs_value(
    make_strategy: MakeStrategy, everywhere: bool
) -> None:
    """``extended.update`` outside run() with a different argument on every worker gives every
    worker the chief's new value, as a write does; one refused on one worker (a PerReplica
    argument whose values differ) raises on every worker, the others a ValueError naming it,
    and changes nothing."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(np.zeros(3), name="v")
    await strategy.run(lambda: None)
    new = await strategy.extended.update(v, lambda copy, x: copy + x, args=(RANK + 1.0,))
    np.testing.assert_array_equal(new, np.ones(3))  # host replicas share one array
    assert_copies_equal(v, np.ones(3))

    bad = everywhere or RANK == WORKERS - 1
    per_replica = PerReplica([np.ones(3), np.full(3, 2.0)])
    with pytest.raises(TypeError if bad else ValueError) as caught:
        await strategy.extended.update(
            v, lambda copy, x: copy + x, args=(per_replica if bad else 1.0,)
        )
    if not bad:
        assert f"worker {WORKERS - 1}: update() of variable 'v' refusing" in str(caught.value)
    assert_copies_equal(v, np.ones(3))
    await strategy.run(lambda: None)


async def test_a_write_in_a_merge_fn_is_no_collective(make_strategy: MakeStrategy) -> None:
    """In a merge_fn, a write takes its value as it is (one every worker has there, such as a
    reduced one), with no collective of its own, as in TF."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(np.zeros(3), name="v")

    async def merge(s: Any, grads: Any) -> None:
        total = await s.reduce("sum", grads)
        before = s._workers._sequence
        await v.assign(total)
        assert s._workers._sequence == before  # no cross-worker collective

    async def step() -> None:
        await replica_context().merge_call(merge, args=(np.full(3, float(replica_id())),))

    await strategy.run(step)
    assert_copies_equal(v, np.full(3, float(sum(range(2 * WORKERS)))))


@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize("kind", ["sgd", "sgd-momentum", "adam"])
async def test_optimizer_steps_keep_workers_identical(
    make_strategy: MakeStrategy, local: int, kind: str
) -> None:
    """Steps with per-replica gradients sum them over all workers; every copy of every variable
    and slot stays bitwise identical across workers, and matches NumPy's update."""
    strategy = make_strategy(local)
    n = WORKERS * local
    steps = 3
    rng = np.random.default_rng(12)
    init = rng.normal(size=(2, 3))
    grads = rng.normal(size=(steps, n, 2, 3))
    lr = 0.05
    with strategy.scope():
        w = Variable(init + RANK, name="w")  # the chief's init wins
        bias = Variable(np.zeros(3, dtype=np.float32), name="bias")
    optimizer: Optimizer = {
        "sgd": SGD(lr),
        "sgd-momentum": SGD(lr, momentum=0.9),
        "adam": Adam(lr),
    }[kind]

    async def step(i: int) -> int:
        g = replica_id()
        bias_grad = np.full(3, g + 1.0, dtype=np.float32)
        return await optimizer.apply_gradients([(grads[i, g], w), (bias_grad, bias)])

    for i in range(steps):
        result = await strategy.run(step, args=(i,))
        assert set(strategy.experimental_local_results(result)) == {i + 1}
    assert optimizer.iterations == steps

    want = init.copy()
    m = np.zeros_like(init)
    v = np.zeros_like(init)
    for i in range(steps):
        g = grads[i].sum(axis=0)
        if kind == "sgd":
            want = want - lr * g
        elif kind == "sgd-momentum":
            m = 0.9 * m - lr * g
            want = want + m
        else:
            t = i + 1
            alpha = lr * math.sqrt(1.0 - 0.999**t) / (1.0 - 0.9**t)
            m = m + (g - m) * (1.0 - 0.9)
            v = v + (g * g - v) * (1.0 - 0.999)
            want = want - m * alpha / (np.sqrt(v) + 1e-7)
    np.testing.assert_allclose(w.values[0], want, rtol=1e-10)
    assert_same_on_every_worker(*w.values)
    assert_same_on_every_worker(*bias.values)
    assert bias.values[0].dtype == np.float32
    for slot in optimizer.variables():
        assert_same_on_every_worker(*slot.values)


@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize("aggregation", ["sum", "mean", "only_first_replica"])
async def test_sync_on_read_reads_aggregate_all_workers(
    make_strategy: MakeStrategy, local: int, aggregation: str
) -> None:
    """Each replica accumulates into its own copy; a cross-replica read (made on every worker)
    aggregates over all workers' replicas; ONLY_FIRST_REPLICA is global replica 0's copy."""
    strategy = make_strategy(local)
    n = WORKERS * local
    with strategy.scope():
        seen = Variable(
            np.zeros(2), name="seen", synchronization="on_read", aggregation=aggregation
        )
    assert isinstance(seen, SyncOnReadVariable)

    async def step() -> None:
        g = replica_id()
        await seen.assign_add(np.array([g + 1.0, 10.0 * g]))
        await seen.assign_add(np.array([g + 1.0, 10.0 * g]))

    await strategy.run(step)
    per_replica = np.array([[2.0 * (g + 1), 20.0 * g] for g in range(n)])
    # This worker's copies hold its own replicas' sums: nothing was exchanged.
    for copy, g in zip(seen.values, global_ids(local), strict=True):
        np.testing.assert_array_equal(copy, per_replica[g])
    want = {
        "sum": per_replica.sum(axis=0),
        "mean": per_replica.mean(axis=0),
        "only_first_replica": per_replica[0],
    }[aggregation]
    np.testing.assert_allclose(seen.numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(seen.value()), want, rtol=1e-12)
    if aggregation != "only_first_replica":
        got = await strategy.reduce(aggregation, seen)
        np.testing.assert_allclose(got, want, rtol=1e-12)
    assert_same_on_every_worker(seen.numpy())


async def test_sync_on_read_cross_replica_assign_sets_the_global_total(
    make_strategy: MakeStrategy,
) -> None:
    """assign() in cross-replica context on a SUM sync-on-read variable: the global read is
    the value assigned (split over all replicas of all workers)."""
    strategy = make_strategy(2)
    with strategy.scope():
        count = Variable(0, name="count", synchronization="on_read", aggregation="sum")
    await count.assign(10)
    assert int(count.numpy()) == 10
    local_sums = allgather(int(sum(int(c) for c in count.values)))
    assert sum(local_sums) == 10


async def test_variables_in_run_args_and_per_replica_values(make_strategy: MakeStrategy) -> None:
    """A mirrored variable read inside a step combined with a local PerReplica argument."""
    strategy = make_strategy(2)
    with strategy.scope():
        scale = Variable(float(RANK + 2), name="scale")  # chief: 2.0
    xs = PerReplica([np.full(2, float(g)) for g in global_ids(2)])

    async def step(x: Array) -> Any:
        ctx = replica_context()
        return await ctx.all_reduce("sum", x * np.asarray(scale.value()))

    for got in strategy.experimental_local_results(await strategy.run(step, args=(xs,))):
        np.testing.assert_array_equal(got, np.full(2, 2.0 * sum(range(2 * WORKERS))))


async def test_a_new_variable_reduced_across_replicas_holds_the_chiefs_value(
    make_strategy: MakeStrategy,
) -> None:
    """``strategy.reduce`` and ``extended.reduce_to`` of a mirrored variable made just before
    (each worker passing its own value) read the chief's value, as a run() would."""
    strategy = make_strategy(2)
    with strategy.scope():
        first = Variable(np.full(2, 10.0 * (RANK + 1)), name="first")
    placed = await strategy.extended.reduce_to("mean", first, "cpu:0")
    with strategy.scope():
        second = Variable(np.full(2, 10.0 * (RANK + 1)), name="second")
    reduced = await strategy.reduce("mean", second)
    np.testing.assert_array_equal(reduced, np.full(2, 10.0))
    np.testing.assert_array_equal(placed, np.full(2, 10.0))


@pytest.mark.parametrize("first_use", ["run", "read"])
async def test_variables_of_other_shapes_are_refused_on_every_worker(
    make_strategy: MakeStrategy, first_use: str
) -> None:
    """A variable made with another shape on one worker cannot take the chief's value: its
    first use raises the same ValueError on every worker, naming both shapes, before any data
    moved, and it stays unsynced, so every later use raises too."""
    strategy = make_strategy(1)
    with strategy.scope():
        good = Variable(worker_value(RANK), name="good")
        bad = Variable(np.zeros(2 + RANK), name="bad")

    async def use() -> Any:
        if first_use == "read":
            return bad.numpy()
        return await strategy.run(lambda: np.array(bad.value()))

    for attempt in range(2):
        with pytest.raises(ValueError, match=r"\(2,\).*\(3,\)") as caught:
            await use()
        assert "worker 0" in str(caught.value), (attempt, str(caught.value))
        assert len({m.split(":", 1)[1] for m in allgather(str(caught.value))}) == 1
        notes = "\n".join(getattr(caught.value, "__notes__", []))
        unsynced = "#0 'good', #1 'bad'" if first_use == "read" else "#1 'bad'"
        assert f"new variables are not synced here ({unsynced})" in notes, notes
        assert "make a new strategy, and the variables again, on every worker" in notes
    if first_use == "run":  # synced one by one, in order of making: "good" came first
        assert_copies_equal(good, worker_value(0))
    else:  # a synchronous first read syncs every new variable at once: none was (the
        # repr shows a worker's own copies without syncing)
        assert f"this worker's copies: {worker_value(RANK)!r}>" in repr(good)


@pytest.mark.parametrize("first_use", ["run", "read"])
async def test_variables_made_in_another_order_are_refused_on_every_worker(
    make_strategy: MakeStrategy, first_use: str
) -> None:
    """Variables of the same shape made in another order on worker 1 would each take the
    chief's value of the other: their first use raises the same ValueError on every worker,
    naming what each made, and no copy changed."""
    strategy = make_strategy(1)
    with strategy.scope():
        if RANK == 1:
            b = Variable(worker_value(RANK) + 1, name="b")
        a = Variable(worker_value(RANK), name="a")
        if RANK != 1:
            b = Variable(worker_value(RANK) + 1, name="b")

    async def use() -> Any:
        if first_use == "read":
            return a.numpy()
        return await strategy.run(lambda: np.array(a.value()))

    with pytest.raises(ValueError, match=r"'a'.*'b'|'b'.*'a'") as caught:
        await use()
    assert "worker 1" in str(caught.value)
    # The same after the what (each worker's own list of variables, in a first read):
    assert len({m.split(":", 1)[1] for m in allgather(str(caught.value))}) == 1
    # No copy changed (the repr shows a worker's own copies without syncing):
    assert f"this worker's copies: {worker_value(RANK)!r}>" in repr(a)
    assert f"this worker's copies: {worker_value(RANK) + 1!r}>" in repr(b)


@pytest.mark.parametrize("local", [1, 2])
async def test_variables_made_inside_a_replica_are_refused(
    make_strategy: MakeStrategy, local: int
) -> None:
    """A variable made inside a replica could not start from the chief's value before the
    replica reads it: every worker's run() raises the RuntimeError saying where to make it,
    refused on every worker alike, so the strategy goes on."""
    strategy = make_strategy(local)

    async def step() -> Any:
        return Variable(worker_value(RANK), name="w")

    with pytest.raises(
        RuntimeError,
        match=r"^variable 'w' was created inside replica \d of MultiWorkerMirroredStrategy.*; "
        r"across workers, create variables in `with strategy\.scope\(\):` outside run\(\), "
        r"where every worker starts them from the chief's value",
    ):
        await strategy.run(step)
    got = await strategy.run(lambda: np.array(replica_id()))
    assert [int(g) for g in strategy.experimental_local_results(got)] == global_ids(local)


@pytest.mark.parametrize(("dtype", "aggregation"), [(np.int64, "mean"), (np.float64, "none")])
@pytest.mark.parametrize("local", [1, 2])
async def test_variables_that_take_one_value_from_every_worker(
    make_strategy: MakeStrategy, local: int, dtype: type, aggregation: str
) -> None:
    """An integer MEAN variable, or one without aggregation, written in replica context takes
    the value every replica of every worker passed; values that differ on one worker only are
    refused on every worker alike, changing nothing, and the strategy carries on."""
    strategy = make_strategy(local)
    with strategy.scope():
        v = Variable(1, name="n", aggregation=aggregation, dtype=dtype)

    async def same() -> None:
        await v.assign(dtype(7))

    await strategy.run(same)
    assert_copies_equal(v, 7)

    async def differs() -> None:
        await v.assign(dtype(9 if replica_id() == WORKERS * local - 1 else 8))

    with pytest.raises(ValueError, match=r"the replicas passed different values"):
        await strategy.run(differs)
    assert_copies_equal(v, 7)
    await strategy.run(same)
    assert_copies_equal(v, 7)


#: Bad writes made in a replica, and the error they raise: ``write(v, optimizer, bad)``
#: writes ``v`` (shape (3,), float32) with bad arguments (``bad``) or good ones; the name of
#: the write in the others' message.
BAD_WRITES: dict[str, tuple[Any, type[Exception], str]] = {
    "assign shape": (
        lambda v, opt, bad: v.assign(np.ones(4 if bad else 3, np.float32)),
        ValueError,
        "assign() of variable 'v'",
    ),
    "assign_add dtype": (
        lambda v, opt, bad: v.assign_add(np.ones(3, np.complex64 if bad else np.float32)),
        TypeError,
        "assign_add() of variable 'v'",
    ),
    "replica shapes": (
        lambda v, opt, bad: v.assign(np.ones(4 if bad and replica_id() % 2 else 3)),
        ValueError,
        "assign() of variable 'v'",
    ),
    "gradient shape": (
        lambda v, opt, bad: opt.apply_gradients([(np.ones(4 if bad else 3, np.float32), v)]),
        ValueError,
        "apply_gradients()",
    ),
    "gradient string": (
        lambda v, opt, bad: opt.apply_gradients([("grad" if bad else np.ones(3, np.float32), v)]),
        TypeError,  # its dtype (a string) is refused before its shape
        "apply_gradients()",
    ),
    "no gradients": (
        lambda v, opt, bad: opt.apply_gradients([(None if bad else np.ones(3, np.float32), v)]),
        ValueError,
        "apply_gradients()",
    ),
    "update fn not callable": (
        lambda v, opt, bad: v.distribute_strategy.extended.update(v, None if bad else np.negative),
        TypeError,
        "update()",
    ),
    "update fn async": (
        lambda v, opt, bad: v.distribute_strategy.extended.update(
            v, _async_negative if bad else np.negative
        ),
        TypeError,
        "update()",
    ),
    "update args": (
        lambda v, opt, bad: v.distribute_strategy.extended.update(
            v, np.multiply, 5 if bad else (2.0,)
        ),
        TypeError,
        "update()",
    ),
    "update result shape": (
        lambda v, opt, bad: v.distribute_strategy.extended.update(
            v, _four_ones if bad else np.negative
        ),
        ValueError,
        "update() of variable 'v'",
    ),
}


def _four_ones(copy: Any) -> Any:
    return np.ones(4, np.float32)


@pytest.mark.parametrize("everywhere", [True, False], ids=["every worker", "one worker"])
@pytest.mark.parametrize("case", list(BAD_WRITES))
async def test_bad_writes_change_nothing(
    make_strategy: MakeStrategy, case: str, everywhere: bool
) -> None:
    """A write or optimizer step refused on every worker (or on one: the others raise a
    ValueError naming it) changes no copy on any worker, and the strategy goes on working."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(np.arange(3, dtype=np.float32) + RANK, name="v", aggregation="mean")
    optimizer = SGD(0.5)
    write, error, what = BAD_WRITES[case]
    bad = everywhere or RANK == WORKERS - 1

    async def step() -> None:
        await write(v, optimizer, bad)

    with pytest.raises(error if bad else ValueError) as caught:
        await strategy.run(step)
    if not bad:
        message = str(caught.value)
        assert f"worker {WORKERS - 1}: {what} refusing its arguments" in message, message
    assert optimizer.iterations == 0
    for copy in v.values:
        np.testing.assert_array_equal(copy, np.arange(3, dtype=np.float32))  # the chief's

    async def good() -> None:
        await optimizer.apply_gradients([(np.full(3, replica_id(), np.float32), v)])

    await strategy.run(good)
    assert_same_on_every_worker(*v.values)  # the gradients are summed over every replica
    np.testing.assert_allclose(v.values[0], np.arange(3) - 0.5 * sum(range(2 * WORKERS)))


@pytest.mark.parametrize("local", [1, 2])
async def test_an_update_in_run_computing_other_values_on_a_worker_is_refused(
    make_strategy: MakeStrategy, local: int
) -> None:
    """``extended.update`` in a replica whose arguments differ between workers (so fn computes
    other copies on each) raises ValueError on every worker and changes no copy: a mirrored
    variable's copies stay bitwise identical everywhere. The same arguments then work."""
    strategy = make_strategy(local)
    with strategy.scope():
        v = Variable(np.zeros(3), name="v")

    async def step(shift: float) -> None:
        await strategy.extended.update(v, lambda copy, d: copy + d, args=(shift,))

    with pytest.raises(ValueError, match="computed different values on different workers"):
        await strategy.run(step, args=(RANK + 1.0,))
    assert_copies_equal(v, np.zeros(3))
    await strategy.run(step, args=(2.0,))
    assert_copies_equal(v, np.full(3, 2.0))


async def test_an_update_in_run_whose_fn_raises_on_a_worker_changes_nothing(
    make_strategy: MakeStrategy,
) -> None:
    """fn raising in a replica's ``extended.update`` on one worker fails that worker's run()
    with its exception, the others' with a ReplicaSyncError naming it; no worker commits
    its update (the others wait for every worker's new copies before they change any)."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(np.zeros(3), name="v")
    failing = WORKERS - 1

    async def step() -> None:
        fn = _missing_key if failing == RANK else np.negative
        await strategy.extended.update(v, fn)

    with pytest.raises(KeyError if failing == RANK else aioreplica.ReplicaSyncError) as caught:
        await strategy.run(step)
    if failing != RANK:
        assert f"worker {failing} failed: KeyError" in str(caught.value)
    for copy in v.values:
        np.testing.assert_array_equal(copy, np.zeros(3), strict=True)
    WORLD.Barrier()  # both done before either closes the strategy


@pytest.mark.parametrize("synced", [False, True])
async def test_a_sync_on_read_repr_on_the_chief_alone_makes_no_collective(
    make_strategy: MakeStrategy, synced: bool
) -> None:
    """repr() and str() of a sync-on-read variable (a log line on the chief alone) show this
    worker's copies and make no collective, so the workers stay in step."""
    strategy = make_strategy(2)
    with strategy.scope():
        m = Variable(np.ones(2), name="m", synchronization="on_read", aggregation="sum")
    if synced:
        await strategy.run(lambda: None)
    if RANK == 0:
        shown = [repr(m), str(m)]
        assert all(
            "this worker's copies: array([1., 1.]), array([1., 1.])>" in text for text in shown
        ), shown
    np.testing.assert_array_equal(await strategy.reduce("sum", m), np.full(2, 2.0 * WORKERS))
    np.testing.assert_array_equal(m.numpy(), np.full(2, 2.0 * WORKERS))


@pytest.mark.parametrize("local", [1, 2])
async def test_an_optimizer_step_without_aggregation(
    make_strategy: MakeStrategy, local: int
) -> None:
    """Gradients all-reduced in the step and applied without aggregation step once on every
    worker; gradients that differ only between workers are refused on every worker (no
    replica of this process to name), nothing changes, and the strategy goes on working."""
    strategy = make_strategy(local)
    with strategy.scope():
        v = Variable(np.zeros(3, np.float32), name="v")
    optimizer = SGD(0.5)

    async def step(differ: bool) -> None:
        reduced = await replica_context().all_reduce("sum", np.full(3, replica_id(), np.float32))
        if differ:  # the same on a worker's replicas, another on each worker
            reduced = reduced + np.float32(RANK)
        await optimizer.apply_gradients([(reduced, v)], experimental_aggregate_gradients=False)

    total = sum(range(local * WORKERS))
    await strategy.run(step, args=(False,))
    assert_copies_equal(v, np.full(3, -0.5 * total))
    with pytest.raises(
        ValueError,
        match=r"^apply_gradients\(\) without aggregation: the replicas passed different "
        r"gradients for 'v'; every replica must pass the same gradient",
    ):
        await strategy.run(step, args=(True,))
    assert optimizer.iterations == 1
    assert_copies_equal(v, np.full(3, -0.5 * total))
    await strategy.run(step, args=(False,))
    assert optimizer.iterations == 2
    assert_copies_equal(v, np.full(3, -1.0 * total))


@pytest.mark.parametrize("write", ["assign", "update"])
async def test_a_write_reached_late_under_sync_timeout_changes_nothing_anywhere(
    make_strategy: MakeStrategy, write: str
) -> None:
    """Outside run(), under sync_timeout, a worker reaching a write after the others gave up
    on it raises too, instead of writing alone, naming itself as the late worker (the fault
    is its own): every copy on every worker keeps its value."""
    strategy = make_strategy(1, sync_timeout=1.0)
    with strategy.scope():
        v = Variable(np.zeros(3), name="v")
    await strategy.run(lambda: None)
    late = WORKERS - 1
    if late == RANK:
        await anyio.sleep(2.5)  # past the others' sync_timeout

    async def call() -> Any:
        if write == "assign":
            return await v.assign(np.full(3, 7.0))
        return await strategy.extended.update(v, lambda copy: copy + 7.0)

    with anyio.fail_after(20), pytest.raises(aioreplica.ReplicaSyncError) as caught:
        await call()
    assert caught.value.workers == (late,)
    if late == RANK:  # told by a worker that gave up on it
        message = str(caught.value)
        assert message.startswith(f"worker 0 gave up waiting for worker {late} (this worker")
        assert "it waited 1 s in " in message
    for copy in v.values:
        np.testing.assert_array_equal(copy, np.zeros(3), strict=True)
    # Both done with this strategy before either closes it (its communicators are freed),
    # so that no worker frees them under a call the other still makes.
    WORLD.Barrier()


@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize(
    "how", ["another variable", "another order", "a namesake", "without aggregation"]
)
async def test_an_optimizer_step_of_other_variables_on_a_worker_is_refused(
    make_strategy: MakeStrategy, local: int, how: str
) -> None:
    """A step that trains other variables on one worker would put a gradient into another
    variable (pairs in another order), or leave a variable's copies different between
    workers (another variable, even one of the same name): every worker's run() raises the
    same ValueError, naming what each trains, before any copy changed; the workers stay in
    step, and a step of the same variables then works."""
    strategy = make_strategy(local)
    with strategy.scope():
        a = Variable(np.zeros(2), name="a")
        b = Variable(np.zeros(2), name="a" if how == "a namesake" else "b")
    optimizer = SGD(1.0)
    pairs = [(np.ones(2), a), (np.full(2, 10.0), b)]
    if how == "another order":
        mine = pairs if RANK == 0 else pairs[::-1]
    else:
        mine = [pairs[0]] if RANK == 0 else [(np.ones(2), b)]
    aggregate = how != "without aggregation"

    async def step(pairs: list[tuple[Array, Variable]]) -> int:
        return await optimizer.apply_gradients(pairs, experimental_aggregate_gradients=aggregate)

    with pytest.raises(ValueError, match=r"apply_gradients\(\) of variable #0 'a'") as caught:
        await strategy.run(step, args=(mine,))
    assert "worker 1: " in str(caught.value)
    assert len(set(allgather(str(caught.value)))) == 1
    labels = {id(a): "variable #0 'a'", id(b): f"variable #1 {b.name!r}"}
    trained = ", ".join(labels[id(v)] for _, v in mine)
    assert f"this worker's apply_gradients() trains {trained}" in "\n".join(
        getattr(caught.value, "__notes__", [])
    )
    assert optimizer.iterations == 0
    assert_copies_equal(a, np.zeros(2))
    assert_copies_equal(b, np.zeros(2))
    await strategy.run(step, args=(pairs,))
    scale = 1 if aggregate else 1 / (local * WORKERS)  # each replica's own step, not summed
    assert_copies_equal(a, np.full(2, -1.0 * local * WORKERS * scale))
    assert_copies_equal(b, np.full(2, -10.0 * local * WORKERS * scale))


def _optimizer_set_apart(how: str) -> Optimizer:
    """An optimizer set as on the other worker, except on worker 1 where ``how`` says."""
    other = RANK == 1
    if how == "learning rate":
        return SGD(0.2 if other else 0.1)
    if how == "class":
        return Adam(0.1) if other else SGD(0.1)
    if how == "hyperparameter":
        return SGD(0.1, momentum=0.9 if other else 0.0)
    if how == "clipping":
        return SGD(0.1, clipnorm=0.5 if other else None)
    if how == "step count":
        optimizer = SGD(lambda step: 0.1)
        optimizer.iterations = 3 if other else 0
        return optimizer
    assert how == "weight-decay exclusion"
    optimizer = SGD(0.1, weight_decay=0.5)
    if other:
        optimizer.exclude_from_weight_decay(var_names=["w"])
    return optimizer


@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize(
    "how",
    [
        "learning rate",
        "class",
        "hyperparameter",
        "clipping",
        "step count",
        "weight-decay exclusion",
    ],
)
async def test_an_optimizer_set_otherwise_on_a_worker_is_refused(
    make_strategy: MakeStrategy, local: int, how: str
) -> None:
    """Optimizers set apart between workers (another learning rate, class, hyperparameter,
    clipping, step count or weight-decay exclusion) would step the same variable apart, so
    its copies would differ between workers for good: every worker's run() raises the same
    ValueError before any copy changed, each naming its own setting, and the workers stay
    in step."""
    strategy = make_strategy(local)
    with strategy.scope():
        w = Variable(np.ones(2), name="w")
    optimizer = _optimizer_set_apart(how)
    before = optimizer.iterations

    async def step() -> int:
        return await optimizer.apply_gradients([(np.ones(2), w)])

    with pytest.raises(ValueError, match=r"apply_gradients\(\) of variable #0 'w' by ") as caught:
        await strategy.run(step)
    assert len(set(allgather(str(caught.value)))) == 1
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert (
        f"this worker's apply_gradients() trains variable #0 'w' by {type(optimizer).__name__}("
        in notes
    )
    assert optimizer.iterations == before
    assert_copies_equal(w, np.ones(2))

    async def count() -> Any:  # the workers are still in step
        return await replica_context().all_reduce("sum", np.ones(1))

    for total in strategy.experimental_local_results(await strategy.run(count)):
        np.testing.assert_array_equal(total, [local * WORKERS])


async def test_a_learning_rate_variable_that_differs_between_workers_is_named(
    make_strategy: MakeStrategy,
) -> None:
    """A learning rate held in a variable of the default strategy (not synced by the chief)
    that holds another value on worker 1: the error every worker raises shows each worker's
    rate and names the variable, so the messages say what differs."""
    strategy = make_strategy(1)
    with strategy.scope():
        w = Variable(np.ones(2), name="w")
    rate = Variable(0.25 if RANK == 1 else 0.5, name="lr")
    optimizer = SGD(rate)

    async def step() -> int:
        return await optimizer.apply_gradients([(np.ones(2), w)])

    with pytest.raises(ValueError, match=r"apply_gradients\(\) of variable #0 'w' by ") as caught:
        await strategy.run(step)
    assert len(set(allgather(str(caught.value)))) == 1
    for worker, shown in enumerate(["0.5", "0.25"]):
        assert f"worker {worker}: " in str(caught.value)
        assert f"by SGD(rate {shown} (variable 'lr')" in str(caught.value)
    assert optimizer.iterations == 0
    assert_copies_equal(w, np.ones(2))


@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize("aggregation", ["sum", "mean", "only_first_replica", "none"])
@pytest.mark.parametrize("write", ["assign_add", "update", "reduce_to in a merge_fn"])
async def test_a_write_in_run_of_another_variable_on_a_worker_is_refused(
    make_strategy: MakeStrategy, local: int, aggregation: str, write: str
) -> None:
    """Replicas that write another mirrored variable on one worker (of the same name, shape
    and aggregation), or a ``merge_fn`` that reduces to another variable there (and would
    update it), would leave each variable's copies different between workers: every worker's
    run() raises the same ValueError naming the variable each wrote, and no copy changed."""
    strategy = make_strategy(local)
    with strategy.scope():
        a = Variable(np.zeros(2), name="w", aggregation=aggregation)
        b = Variable(np.zeros(2), name="w", aggregation=aggregation)
    mine = a if RANK == 0 else b

    async def merge(strategy: Any, g: Any) -> None:
        g = await strategy.extended.reduce_to("sum", g, destinations=mine)
        await strategy.extended.update(mine, lambda copy, d: copy + d, args=(g,))

    async def step() -> None:
        if write == "reduce_to in a merge_fn":
            await replica_context().merge_call(merge, args=(np.ones(2),))
        elif write == "update":
            await strategy.extended.update(mine, lambda copy, d: copy + d, args=(1.0,))
        elif aggregation in ("sum", "mean"):
            await mine.assign_add(np.full(2, replica_id() + 1.0))
        else:  # one value from every replica
            await mine.assign_add(np.ones(2))

    with pytest.raises(ValueError, match=r"variable #0 'w'.*variable #1 'w'") as caught:
        await strategy.run(step)
    assert len(set(allgather(str(caught.value)))) == 1
    assert_copies_equal(a, np.zeros(2))
    assert_copies_equal(b, np.zeros(2))


@pytest.mark.parametrize("first_use", ["run", "read"])
@pytest.mark.parametrize("other", ["aggregation", "synchronization"])
async def test_variables_of_another_kind_on_a_worker_are_refused(
    make_strategy: MakeStrategy, first_use: str, other: str
) -> None:
    """A variable made with another aggregation, or another synchronization, on one worker
    would aggregate otherwise there (a metric read as a sum on one worker, as a mean on the
    other): its first use raises the same ValueError on every worker, naming both kinds."""
    strategy = make_strategy(1)
    kinds = {
        "aggregation": [("on_read", "sum"), ("on_read", "mean")],
        "synchronization": [("on_write", "sum"), ("on_read", "sum")],
    }[other]
    synchronization, aggregation = kinds[min(RANK, 1)]
    with strategy.scope():
        v = Variable(
            np.zeros(2), name="m", synchronization=synchronization, aggregation=aggregation
        )

    async def use() -> Any:
        if first_use == "read":
            return v.numpy()
        return await strategy.run(lambda: np.array(v.value()))

    shown = [f"({'sync-on-read' if s == 'on_read' else 'mirrored'}, {g})" for s, g in kinds]
    with pytest.raises(ValueError, match="worker 1") as caught:
        await use()
    assert all(s in str(caught.value) for s in shown), str(caught.value)
    assert len({m.split(":", 1)[1] for m in allgather(str(caught.value))}) == 1


async def test_two_sync_on_read_variables_of_one_name_read_in_another_order_disagree(
    make_strategy: MakeStrategy,
) -> None:
    """Two sync-on-read variables of the same name, dtype and shape, read in cross-replica
    context in another order on each worker: the reads name each variable by its number
    too, so the workers disagree, on every worker alike, instead of summing one's copies with
    the other's."""
    strategy = make_strategy(1)
    with strategy.scope():
        first = Variable(0.0, synchronization="on_read", aggregation="sum", name="m")
        second = Variable(0.0, synchronization="on_read", aggregation="sum", name="m")

    async def step() -> None:
        await first.assign(1.0)
        await second.assign(100.0)

    await strategy.run(step)
    order = (first, second) if RANK == 0 else (second, first)
    outcome: tuple[str, object]
    try:
        read = float(order[0])
    except ValueError as exc:
        outcome = (type(exc).__name__, "#" in str(exc) and "'m'" in str(exc))
    else:
        outcome = ("read", read)
    assert allgather(outcome) == [("WorkersDisagree", True)] * WORKERS
