"""Collectives across workers: replica-context ones, and reduce/gather in cross-replica context.

Every test builds the whole global data on every rank (seeded), gives global replica ``g`` its
row ``g``, and compares with NumPy over all of it.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

from aioreplica import (
    ClusterBroken,
    CommunicationImplementation,
    CommunicationOptions,
    PerReplica,
    ReduceOp,
    ReplicaSyncError,
    Variable,
    _cluster,
)
from aioreplica.optimizers import SGD
from aioreplica.testing import host_devices, replica_context, replica_id
from multiworker.mwtools import (
    RANK,
    WORKERS,
    WORLD,
    allgather,
    assert_same_on_every_worker,
    each_replica,
    global_ids,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]

NUMPY = {
    "sum": lambda a: np.sum(a, axis=0),
    "mean": lambda a: np.mean(a, axis=0),
    "max": lambda a: np.max(a, axis=0),
    "min": lambda a: np.min(a, axis=0),
    "prod": lambda a: np.prod(a, axis=0),
}


def local_results(strategy: Any, value: Any) -> list[Any]:
    """Each local replica's part of ``value`` (a structure that may hold distributed values)."""
    return each_replica(strategy, value)


def per_replica(values: list[Any]) -> Any:
    """This worker's values as run() takes them: a PerReplica, or the value for one replica."""
    return PerReplica(values) if len(values) > 1 else values[0]


@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
async def test_all_reduce_every_op_float64(
    make_strategy: MakeStrategy, local: int, op: str
) -> None:
    """Every ReduceOp over all workers' replicas equals NumPy's over the global data."""
    strategy = make_strategy(local)
    data = np.random.default_rng(1).normal(size=(WORKERS * local, 4, 3))

    async def step() -> Any:
        return await replica_context().all_reduce(op, data[replica_id()])

    for got in local_results(strategy, await strategy.run(step)):
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, NUMPY[op](data), rtol=1e-12)


@pytest.mark.parametrize("local", [1, 2])
async def test_all_reduce_keeps_dtypes(make_strategy: MakeStrategy, local: int) -> None:
    """float32 and int32 keep their dtype for every op; bool MAX is any, MIN is all."""
    strategy = make_strategy(local)
    n = WORKERS * local
    rng = np.random.default_rng(2)
    f32 = rng.normal(size=(n, 5)).astype(np.float32)
    i32 = rng.integers(-5, 6, size=(n, 5)).astype(np.int32)
    flags = np.zeros((n, 4), dtype=bool)
    flags[n - 1, 0] = True  # only the last worker's last replica: any, not all
    flags[:, 1] = True  # everyone: any and all
    flags[0, 2] = True  # only the chief's first replica
    ops = ["sum", "mean", "max", "min", "prod"]

    async def step() -> Any:
        ctx = replica_context()
        g = ctx.replica_id_in_sync_group
        out: dict[str, Any] = {}
        for op in ops:
            out[f"f32-{op}"] = await ctx.all_reduce(op, f32[g])
        for op in ["sum", "max", "min", "prod"]:
            out[f"i32-{op}"] = await ctx.all_reduce(op, i32[g])
        out["bool-max"] = await ctx.all_reduce(ReduceOp.MAX, flags[g])
        out["bool-min"] = await ctx.all_reduce(ReduceOp.MIN, flags[g])
        return out

    for got in local_results(strategy, await strategy.run(step)):
        for op in ops:
            assert got[f"f32-{op}"].dtype == np.float32, op
            np.testing.assert_allclose(got[f"f32-{op}"], NUMPY[op](f32), rtol=2e-6)
        for op in ["sum", "max", "min", "prod"]:
            assert got[f"i32-{op}"].dtype == np.int32, op
            np.testing.assert_array_equal(got[f"i32-{op}"], NUMPY[op](i32).astype(np.int32))
        assert got["bool-max"].dtype == np.bool_
        assert got["bool-min"].dtype == np.bool_
        np.testing.assert_array_equal(got["bool-max"], flags.any(axis=0))
        np.testing.assert_array_equal(got["bool-min"], flags.all(axis=0))


@pytest.mark.parametrize("size", [3, 50_000], ids=["in the records", "in MPI"])
@pytest.mark.parametrize("local", [1, 2])
async def test_byte_orders_of_every_worker(
    make_strategy: MakeStrategy, local: int, size: int
) -> None:
    """Arrays in the other byte order (``>f8`` on a little-endian machine) on some workers and
    not others: every collective gives the right numbers, in each worker's own dtype (a
    broadcast: in its source's), as in one process (MPI itself takes numbers in the machine's
    order only)."""
    strategy = make_strategy(local)
    n = WORKERS * local
    data = np.random.default_rng(4).normal(size=(n, size))

    def dtype_of(worker: int) -> np.dtype[Any]:
        return np.dtype(">f8" if worker % 2 == 0 else "<f8")

    dtype = dtype_of(RANK)

    async def step() -> Any:
        ctx = replica_context()
        g = ctx.replica_id_in_sync_group
        x = data[g].astype(dtype)
        return {
            "sum": await ctx.all_reduce("sum", x),
            "max": await ctx.all_reduce("max", x),
            "gathered": await ctx.all_gather(x[: g + 1]),
            "sent": await ctx.broadcast(x, source_replica=n - 1),
            "row": x,
        }

    result = await strategy.run(step)
    gathered = np.concatenate([data[g][: g + 1] for g in range(n)])
    for got in local_results(strategy, result):
        for key, want in [
            ("sum", data.sum(axis=0)),
            ("max", data.max(axis=0)),
            ("gathered", gathered),
            ("sent", data[n - 1]),
        ]:
            assert got[key].dtype == (dtype_of(WORKERS - 1) if key == "sent" else dtype), key
            np.testing.assert_allclose(got[key], want, rtol=1e-12, atol=1e-12, err_msg=key)
    total = await strategy.reduce("sum", result["row"])
    rows = await strategy.gather(result["row"])
    assert total.dtype == rows.dtype == dtype
    np.testing.assert_allclose(total, data.sum(axis=0), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(rows, data.reshape(-1))


#: Arrays that collectives move but do not reduce: dates, fixed-width strings, records.
DATA_ONLY: dict[str, Callable[[int, int], Array]] = {
    "datetime64": lambda g, n: np.arange(n).astype("datetime64[D]") + g,
    "str": lambda g, n: np.array([f"r{g}-{i}" for i in range(n)]),
    "record": lambda g, n: np.array(
        [(g + 0.5, i) for i in range(n)], dtype=[("x", "<f4"), ("i", "<i8")]
    ),
}


@pytest.mark.parametrize("n", [2, 20_000], ids=["in the records", "in MPI"])
@pytest.mark.parametrize("kind", list(DATA_ONLY))
async def test_gather_and_broadcast_move_any_fixed_size_dtype(
    make_strategy: MakeStrategy, kind: str, n: int
) -> None:
    """all_gather, broadcast and strategy.gather move dates, strings and records between
    workers as one process moves them between replicas: bytes, in global replica order."""
    strategy = make_strategy(2)
    total = WORKERS * 2
    make = DATA_ONLY[kind]

    async def step() -> Any:
        ctx = replica_context()
        g = ctx.replica_id_in_sync_group
        mine = make(g, n)
        return {
            "gathered": await ctx.all_gather(mine[: g + 1]),
            "sent": await ctx.broadcast(mine, source_replica=total - 1),
            "mine": mine,
        }

    result = await strategy.run(step)
    gathered = np.concatenate([make(g, n)[: g + 1] for g in range(total)])
    for got in local_results(strategy, result):
        assert got["gathered"].dtype == gathered.dtype
        np.testing.assert_array_equal(got["gathered"], gathered)
        np.testing.assert_array_equal(got["sent"], make(total - 1, n))
    whole = await strategy.gather(result["mine"])
    np.testing.assert_array_equal(whole, np.concatenate([make(g, n) for g in range(total)]))


@pytest.mark.parametrize("everywhere", [True, False], ids=["every worker", "one worker"])
@pytest.mark.parametrize("collective", ["all_gather", "broadcast", "gather"])
async def test_arrays_of_python_objects_are_refused_across_workers(
    make_strategy: MakeStrategy, collective: str, everywhere: bool
) -> None:
    """Arrays of Python objects cannot travel between processes: a TypeError saying so on the
    workers that passed them (a broadcast's source), the others a ValueError naming them,
    nothing moved, and the strategy goes on working."""
    strategy = make_strategy(2)
    objects = everywhere or RANK == WORKERS - 1
    value = np.array([1, "x"], dtype=object if objects else "<U1")

    async def step() -> Any:
        ctx = replica_context()
        if collective == "all_gather":
            return await ctx.all_gather(value)
        return await ctx.broadcast(value, source_replica=2 * WORKERS - 1)

    async def use() -> Any:
        if collective == "gather":
            return await strategy.gather(PerReplica([value, value]))
        return await strategy.run(step)

    with pytest.raises((TypeError, ValueError)) as caught:
        await use()
    if objects if collective != "broadcast" else RANK == WORKERS - 1:  # (its source's worker)
        assert caught.type is TypeError
        assert "Python objects (dtype object)" in str(caught.value)
    else:
        assert f"worker {WORKERS - 1}" in str(caught.value)
        assert "Python objects" in str(caught.value)
    after = await strategy.run(lambda: replica_id())
    assert strategy.experimental_local_results(after) == tuple(global_ids(2))


async def test_records_of_other_fields_disagree(make_strategy: MakeStrategy) -> None:
    """Records of the same size but other fields on one worker are not gathered together:
    the same ValueError on every worker, naming both dtypes."""
    strategy = make_strategy(1)
    fields = [("x", "<f4"), ("i", "<i4")] if RANK == 0 else [("i", "<i4"), ("x", "<f4")]
    value = np.zeros(3, dtype=fields)

    async def step() -> Any:
        return await replica_context().all_gather(value)

    with pytest.raises(ValueError, match=r"\('x', '<f4'\), \('i', '<i4'\)") as caught:
        await strategy.run(step)
    assert "('i', '<i4'), ('x', '<f4')" in str(caught.value)


@pytest.mark.parametrize("local", [1, 2])
async def test_all_reduce_nested_structures(make_strategy: MakeStrategy, local: int) -> None:
    """Dicts and lists reduce leaf by leaf, each leaf keeping its dtype; scalars too."""
    strategy = make_strategy(local)
    n = WORKERS * local
    rng = np.random.default_rng(3)
    a = rng.normal(size=(n, 2, 2))
    b = rng.integers(0, 100, size=(n, 3)).astype(np.int32)
    c = rng.normal(size=(n, 7)).astype(np.float32)

    def value(g: int) -> Any:
        return {"a": a[g], "list": [b[g], {"c": c[g]}], "scalar": float(g)}

    async def step() -> Any:
        return await replica_context().all_reduce("sum", value(replica_id()))

    for got in local_results(strategy, await strategy.run(step)):
        assert set(got) == {"a", "list", "scalar"}
        np.testing.assert_allclose(got["a"], a.sum(axis=0), rtol=1e-12)
        assert got["list"][0].dtype == np.int32
        np.testing.assert_array_equal(got["list"][0], b.sum(axis=0))
        assert got["list"][1]["c"].dtype == np.float32
        np.testing.assert_allclose(got["list"][1]["c"], c.sum(axis=0), rtol=2e-6)
        assert float(got["scalar"]) == sum(range(n))


@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize("bytes_per_pack", [None, 0, 64, 1 << 20])
async def test_all_reduce_packs_many_small_leaves(
    make_strategy: MakeStrategy, local: int, bytes_per_pack: int | None
) -> None:
    """Hundreds of small leaves of mixed dtypes reduce right whatever the pack size."""
    options = None if bytes_per_pack is None else CommunicationOptions(bytes_per_pack)
    strategy = make_strategy(local)
    n = WORKERS * local
    rng = np.random.default_rng(4)
    dtypes = [np.float64, np.float32, np.int32, np.int64]
    leaves = [
        rng.integers(-9, 10, size=(n, 1 + i % 5)).astype(dtypes[i % len(dtypes)])
        for i in range(300)
    ]

    async def step() -> Any:
        g = replica_id()
        return await replica_context().all_reduce("sum", [x[g] for x in leaves], options)

    for got in local_results(strategy, await strategy.run(step)):
        assert len(got) == len(leaves)
        for leaf, want in zip(got, leaves, strict=True):
            assert leaf.dtype == want.dtype
            np.testing.assert_array_equal(leaf, want.sum(axis=0).astype(want.dtype))


@pytest.mark.parametrize("implementation", list(CommunicationImplementation))
async def test_every_implementation_combines_the_workers_alike(
    make_strategy: MakeStrategy, implementation: CommunicationImplementation
) -> None:
    """TF's usual ``CommunicationOptions(implementation=NCCL)`` for this strategy, and the
    others, for the strategy or for one call: the workers combine over MPI, as with AUTO."""
    options = CommunicationOptions(implementation=implementation)
    strategy = make_strategy(2, communication_options=options)
    data = np.random.default_rng(6).normal(size=(2 * WORKERS, 5)).astype(np.float32)

    async def step() -> Any:
        ctx = replica_context()
        row = data[replica_id()]
        return await ctx.all_reduce("sum", row), await ctx.all_gather(row[None], options=options)

    for total, rows in local_results(strategy, await strategy.run(step)):
        np.testing.assert_allclose(total, data.sum(axis=0), rtol=1e-6)
        np.testing.assert_array_equal(rows, data)
    mean = await strategy.reduce("mean", PerReplica([data[0], data[1]]), axis=None)
    np.testing.assert_allclose(mean, (data[0] + data[1]) / 2, rtol=1e-6)


async def test_strategy_communication_options_pack(make_strategy: MakeStrategy) -> None:
    """The strategy's own CommunicationOptions (tiny packs) give the same sums."""
    strategy = make_strategy(2, communication_options=CommunicationOptions(bytes_per_pack=16))
    n = 2 * WORKERS
    data = [np.arange(n * 3, dtype=np.float32).reshape(n, 3) * (i + 1) for i in range(40)]

    async def step() -> Any:
        return await replica_context().all_reduce("mean", [x[replica_id()] for x in data])

    for got in local_results(strategy, await strategy.run(step)):
        for leaf, want in zip(got, data, strict=True):
            np.testing.assert_allclose(leaf, want.mean(axis=0), rtol=1e-6)


@pytest.mark.parametrize("local", [1, 2])
async def test_all_gather_uneven_rows_in_global_order(
    make_strategy: MakeStrategy, local: int
) -> None:
    """Replicas with 0, 1, 2... rows gather into the global concatenation, in replica order."""
    strategy = make_strategy(local)
    n = WORKERS * local
    rng = np.random.default_rng(5)
    parts = [rng.normal(size=((g + 1) % 3, 2)).astype(np.float32) for g in range(n)]
    cols = [np.full((2, g + 1), g, dtype=np.int64) for g in range(n)]

    async def step() -> Any:
        ctx = replica_context()
        g = ctx.replica_id_in_sync_group
        return await ctx.all_gather(parts[g]), await ctx.all_gather(cols[g], axis=1)

    for rows, columns in local_results(strategy, await strategy.run(step)):
        assert rows.dtype == np.float32
        np.testing.assert_array_equal(rows, np.concatenate(parts))
        np.testing.assert_array_equal(columns, np.concatenate(cols, axis=1))


@pytest.mark.parametrize("local", [1, 2])
async def test_broadcast_from_every_global_source(make_strategy: MakeStrategy, local: int) -> None:
    """broadcast(source_replica=k) gives every replica of every worker replica k's value."""
    strategy = make_strategy(local)
    n = WORKERS * local

    def value(g: int) -> Any:
        return {"x": np.full(3, float(g)), "n": np.array([g, -g], dtype=np.int32)}

    async def step() -> Any:
        ctx = replica_context()
        mine = value(ctx.replica_id_in_sync_group)
        return [await ctx.broadcast(mine, source_replica=k) for k in range(n)]

    for got in local_results(strategy, await strategy.run(step)):
        for k, item in enumerate(got):
            np.testing.assert_array_equal(item["x"], value(k)["x"])
            assert item["n"].dtype == np.int32
            np.testing.assert_array_equal(item["n"], value(k)["n"])


async def test_broadcast_source_out_of_range(make_strategy: MakeStrategy) -> None:
    """A source beyond the global replica count is refused (ValueError)."""
    strategy = make_strategy(2)

    async def step() -> Any:
        return await replica_context().broadcast(np.ones(1), source_replica=2 * WORKERS)

    with pytest.raises(ValueError, match=str(2 * WORKERS)):
        await strategy.run(step)


@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
async def test_reduce_scatter_chunks_by_global_id(
    make_strategy: MakeStrategy, local: int, op: str
) -> None:
    """Replica g gets chunk g of array_split(reduced, W * L) (uneven chunks, larger first)."""
    strategy = make_strategy(local)
    n = WORKERS * local
    data = np.random.default_rng(6).normal(size=(n, 2 * n + 1, 2))

    async def step() -> Any:
        return await replica_context().reduce_scatter(op, data[replica_id()])

    chunks = np.array_split(NUMPY[op](data), n)
    got = local_results(strategy, await strategy.run(step))
    assert len(got) == local
    for g, chunk in zip(global_ids(local), got, strict=True):
        np.testing.assert_allclose(chunk, chunks[g], rtol=1e-12)


@pytest.mark.parametrize("local", [1, 2])
async def test_barrier_waits_for_the_other_worker(make_strategy: MakeStrategy, local: int) -> None:
    """No replica leaves the barrier before the last worker's replicas have reached it."""
    strategy = make_strategy(local)
    delay = 0.4

    async def step() -> float:
        if RANK == WORKERS - 1:
            await anyio.sleep(delay)  # the last worker reaches the barrier late
        await replica_context().barrier()
        return time.monotonic()

    WORLD.Barrier()
    start = time.monotonic()
    result = await strategy.run(step)
    left = [t - start for t in local_results(strategy, result)]
    if RANK != WORKERS - 1:
        assert min(left) >= delay * 0.9, left


@pytest.mark.parametrize("local", [1, 2])
async def test_strategy_reduce_axis_none_and_zero(make_strategy: MakeStrategy, local: int) -> None:
    """reduce(axis=None) combines replicas elementwise; reduce(axis=0) MEAN weights by rows,
    with every replica of the last worker holding no rows at all."""
    strategy = make_strategy(local)
    n = WORKERS * local
    rng = np.random.default_rng(8)
    same = rng.normal(size=(n, 3))
    counts = [0 if g // local == WORKERS - 1 else g + 1 for g in range(n)]
    batches = [rng.normal(size=(c, 3)) for c in counts]

    async def step() -> Any:
        g = replica_id()
        return same[g], batches[g]

    result = await strategy.run(step)
    locals_ = local_results(strategy, result)
    elementwise = per_replica([r[0] for r in locals_])
    uneven = per_replica([r[1] for r in locals_])
    for op in ["sum", "mean", "max", "min", "prod"]:
        got = await strategy.reduce(op, elementwise, axis=None)
        np.testing.assert_allclose(got, NUMPY[op](same), rtol=1e-12, err_msg=op)
    everything = np.concatenate(batches)
    np.testing.assert_allclose(
        await strategy.reduce("mean", uneven, axis=0), everything.mean(axis=0), rtol=1e-12
    )
    np.testing.assert_allclose(
        await strategy.reduce(ReduceOp.SUM, uneven, axis=0), everything.sum(axis=0), rtol=1e-12
    )
    # A nested structure with distributed leaves reduces leaf by leaf.
    nested = {"a": elementwise, "b": [uneven]}
    both = await strategy.reduce("sum", nested, axis=0)
    np.testing.assert_allclose(both["a"], same.sum(axis=(0, 1)), rtol=1e-12)
    np.testing.assert_allclose(both["b"][0], everything.sum(axis=0), rtol=1e-12)


@pytest.mark.parametrize("local", [1, 2])
async def test_strategy_reduce_along_several_axes(make_strategy: MakeStrategy, local: int) -> None:
    """reduce(axis=(0, 1)) reduces both axes of every replica's batch; MEAN divides by the
    elements of every worker's replicas, the last worker's being empty."""
    strategy = make_strategy(local)
    n = WORKERS * local
    rng = np.random.default_rng(9)
    counts = [0 if g // local == WORKERS - 1 else g + 1 for g in range(n)]
    batches = [rng.normal(size=(c, 4, 2)) for c in counts]

    async def step() -> Any:
        return batches[replica_id()]

    uneven = per_replica(local_results(strategy, await strategy.run(step)))
    everything = np.concatenate(batches)
    for op in ["sum", "mean", "max", "min"]:
        want = getattr(np, op)(everything, axis=(0, 1))
        got = await strategy.reduce(op, uneven, axis=[1, 0])
        np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=op)


@pytest.mark.parametrize("local", [1, 2])
async def test_strategy_reduce_mean_of_integers(make_strategy: MakeStrategy, local: int) -> None:
    """MEAN of integers over every worker's replicas is a float64 mean, as np.mean's."""
    strategy = make_strategy(local)
    n = WORKERS * local
    rows = [np.arange(g + 1, dtype=np.int32) * 3 for g in range(n)]

    async def step() -> Any:
        return rows[replica_id()]

    uneven = per_replica(local_results(strategy, await strategy.run(step)))
    mean = await strategy.reduce("mean", uneven, axis=0)
    assert mean.dtype == np.dtype(np.float64)
    np.testing.assert_allclose(mean, np.concatenate(rows).mean(), rtol=1e-12)


async def test_reduce_of_a_loss_from_one_local_replica(make_strategy: MakeStrategy) -> None:
    """With one local replica, run() returns the bare value; reducing it spans the workers."""
    strategy = make_strategy(1)
    losses = np.arange(1.0, WORKERS + 1.0)

    async def step() -> float:
        return float(losses[replica_id()])

    loss = await strategy.run(step)
    assert loss == losses[RANK]
    assert float(await strategy.reduce("sum", loss)) == losses.sum()
    assert float(await strategy.reduce("mean", loss)) == losses.mean()


@pytest.mark.parametrize("local", [1, 2])
async def test_gather_concatenates_every_worker_in_order(
    make_strategy: MakeStrategy, local: int
) -> None:
    """strategy.gather joins all workers' components in global replica order (uneven rows)."""
    strategy = make_strategy(local)
    n = WORKERS * local
    parts = [np.full((g % 3, 2), g, dtype=np.int32) for g in range(n)]
    value = per_replica([parts[g] for g in global_ids(local)])
    got = await strategy.gather(value, axis=0)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.concatenate(parts))


@pytest.mark.parametrize("local", [1, 2])
async def test_batch_reduce_to_and_reduce_to(make_strategy: MakeStrategy, local: int) -> None:
    """batch_reduce_to and reduce_to reduce over all workers, to local destinations."""
    strategy = make_strategy(local)
    n = WORKERS * local
    rng = np.random.default_rng(9)
    a = rng.normal(size=(n, 4))
    b = rng.integers(0, 9, size=(n, 2)).astype(np.int32)
    value_a = per_replica([a[g] for g in global_ids(local)])
    value_b = per_replica([b[g] for g in global_ids(local)])
    first = host_devices(local)[0]
    got_a, got_b = await strategy.extended.batch_reduce_to(
        "sum", [(value_a, first), (value_b, host_devices(local))]
    )
    np.testing.assert_allclose(got_a, a.sum(axis=0), rtol=1e-12)
    for part in local_results(strategy, got_b):
        assert part.dtype == np.int32
        np.testing.assert_array_equal(part, b.sum(axis=0))
    mean = await strategy.extended.reduce_to("mean", value_a, first)
    np.testing.assert_allclose(mean, a.mean(axis=0), rtol=1e-12)


@pytest.mark.parametrize("where", ["host value", "run() result"])
async def test_reduce_to_its_own_value(make_strategy: MakeStrategy, where: str) -> None:
    """TF's all-reduce idiom ``reduce_to(SUM, value, value)`` (and ``batch_reduce_to``, and
    ``strategy.reduce``) on one replica per worker: a host value, or a step's result, which
    ``run()`` gives back as the value itself; the destination is its device, the host."""
    strategy = make_strategy(1)
    value = np.float32(1.0)
    if where == "run() result":
        value = await strategy.run(lambda: np.float32(1.0))
    assert float(await strategy.reduce(ReduceOp.SUM, value, axis=None)) == WORKERS
    assert float(await strategy.extended.reduce_to(ReduceOp.SUM, value, value)) == WORKERS
    pairs = [(value, value), (value, value)]
    got = await strategy.extended.batch_reduce_to(ReduceOp.SUM, pairs)
    assert [float(x) for x in got] == [WORKERS, WORKERS]


async def test_collectives_agree_across_ranks_bitwise(make_strategy: MakeStrategy) -> None:
    """Every worker gets the very same bits from a float32 all_reduce."""
    strategy = make_strategy(2)
    data = np.random.default_rng(10).normal(size=(2 * WORKERS, 1000)).astype(np.float32)

    async def step() -> Any:
        return await replica_context().all_reduce("sum", data[replica_id()])

    got = local_results(strategy, await strategy.run(step))
    mine = [np.asarray(x).tobytes() for x in got]
    assert len(set(mine)) == 1
    assert len({m[0] for m in allgather(mine)}) == 1


# Sizes (float32 elements) on either side of the largest all-reduce that travels with the
# workers' headers (896 bytes), and far above it.
@pytest.mark.parametrize("size", [1, 224, 225, 40_000])
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
async def test_all_reduce_small_and_large_agree_with_numpy(
    make_strategy: MakeStrategy, size: int, op: str
) -> None:
    """Every op, with data in the headers' message and in one of its own, equals NumPy's over
    the global data, bitwise alike on every worker."""
    strategy = make_strategy(2)
    data = np.random.default_rng(size).uniform(0.5, 1.5, size=(2 * WORKERS, size))
    data = data.astype(np.float32)

    async def step() -> Any:
        return await replica_context().all_reduce(op, data[replica_id()])

    got = local_results(strategy, await strategy.run(step))
    for part in got:
        assert part.dtype == np.float32
        assert part.shape == (size,)
        np.testing.assert_allclose(part, NUMPY[op](data.astype(np.float64)), rtol=1e-5)
    assert len({fp for fps in allgather([np.asarray(x).tobytes() for x in got]) for fp in fps}) == 1


async def test_all_reduce_small_bools_and_ints(make_strategy: MakeStrategy) -> None:
    """max/min of bools are any/all, and int8 sums wrap, as they do in MPI."""
    strategy = make_strategy(1)
    flags = np.array([RANK == 0, True, False, RANK == 1])
    ints = np.array([100, -100], np.int8)

    async def step() -> Any:
        ctx = replica_context()
        return (
            await ctx.all_reduce("max", flags),
            await ctx.all_reduce("min", flags),
            await ctx.all_reduce("sum", ints),
        )

    any_, all_, total = await strategy.run(step)
    np.testing.assert_array_equal(any_, [True, True, False, WORKERS > 1])
    np.testing.assert_array_equal(all_, [False, True, False, False])
    assert total.dtype == np.int8
    np.testing.assert_array_equal(total, (np.array([100, -100]) * WORKERS).astype(np.int8))


DISAGREEMENTS: dict[str, tuple[Callable[[], tuple[str, Any]], str]] = {
    "shape": (lambda: ("sum", np.ones(2 + RANK, np.float32)), r"float32 \(2,\).*float32 \(3,\)"),
    "dtype": (lambda: ("sum", np.ones(2, [np.float32, np.float64][RANK % 2])), "float64"),
    "large shape": (lambda: ("sum", np.ones(1000 + RANK)), r"\(1000,\).*\(1001,\)"),
    "op": (lambda: (["sum", "max"][RANK % 2], np.ones(2)), r"\(sum\).*\(max\)"),
    "sum and mean": (lambda: (["mean", "sum"][RANK % 2], np.ones(2)), r"\(a mean\)"),
    "large sum and mean": (lambda: (["mean", "sum"][RANK % 2], np.ones(1000)), r"\(a mean\)"),
    "packed leaves": (
        lambda: ("sum", {"a": np.ones(2 + RANK), "b": np.ones(3 - RANK)}),
        r"leaves at \['a'\] \(2,\), at \['b'\] \(3,\).*leaves at \['a'\] \(3,\)",
    ),
    "key": (lambda: ("sum", {"ab"[RANK % 2]: np.ones(2)}), r"\(at \['a'\]\).*\(at \['b'\]\)"),
    "large key": (lambda: ("sum", {"ab"[RANK % 2]: np.ones(1000)}), r"at \['a'\].*at \['b'\]"),
    "packed keys": (
        lambda: ("sum", {"a": np.ones(2), "bc"[RANK % 2]: np.ones(2)}),
        r"at \['a'\] \(2,\), at \['b'\] \(2,\).*at \['a'\] \(2,\), at \['c'\] \(2,\)",
    ),
    "list index": (
        lambda: ("sum", [np.ones(3)] if RANK % 2 == 0 else [np.ones(0), np.ones(3)]),
        r"at \[0\].*at \[1\]",
    ),
}


@pytest.mark.parametrize("case", list(DISAGREEMENTS))
async def test_all_reduce_workers_disagree(make_strategy: MakeStrategy, case: str) -> None:
    """Workers all-reducing other shapes, dtypes, ops or packed leaves get the same ValueError
    on every worker, naming what each passed, before any data moved; the strategy goes on."""
    strategy = make_strategy(1)
    make_value, shown = DISAGREEMENTS[case]
    op, value = make_value()
    seen: list[Any] = []

    async def step() -> Any:
        seen.append(value)
        return await replica_context().all_reduce(op, value)

    with pytest.raises(ValueError, match="the workers passed different values") as caught:
        await strategy.run(step)
    message = str(caught.value)
    assert re.search(shown, message), message
    assert all(f"worker {w}: " in message for w in range(WORKERS)), message
    assert len(set(allgather(message))) == 1
    assert seen == [value]

    async def agreed() -> Any:
        return await replica_context().all_reduce("sum", np.full(3, RANK + 1.0))

    np.testing.assert_array_equal(
        await strategy.run(agreed), np.full(3, WORKERS * (WORKERS + 1) / 2)
    )


#: What one worker gathers or broadcasts that another does not, and what the error shows.
GATHER_DISAGREEMENTS: dict[str, tuple[Callable[[], Any], str]] = {
    "shape": (lambda: np.zeros((2, 3 + RANK)), r"worker 1\b"),
    "key": (lambda: {"ab"[RANK % 2]: np.zeros((2, 3))}, r"at \['a'\].*at \['b'\]"),
}


@pytest.mark.parametrize(
    ("collective", "case"), [("all_gather", "shape"), ("all_gather", "key"), ("broadcast", "key")]
)
async def test_gather_and_broadcast_workers_disagree(
    make_strategy: MakeStrategy, collective: str, case: str
) -> None:
    """Other trailing dimensions (all_gather) on one worker, or the same array under another
    key: the same ValueError on every worker, naming what differs, rather than values from
    different places combined; the strategy goes on."""
    strategy = make_strategy(1)
    make_value, shown = GATHER_DISAGREEMENTS[case]
    value = make_value()

    async def step() -> Any:
        ctx = replica_context()
        if collective == "all_gather":
            return await ctx.all_gather(value, axis=0)
        return await ctx.broadcast(value, source_replica=0)

    with pytest.raises(ValueError, match=shown) as caught:
        await strategy.run(step)
    assert len(set(allgather(str(caught.value)))) == 1

    async def agreed() -> Any:
        return await replica_context().all_gather(np.full((1, 2), RANK), axis=0)

    np.testing.assert_array_equal(
        await strategy.run(agreed), np.repeat(np.arange(WORKERS), 2).reshape(WORKERS, 2)
    )


@pytest.mark.parametrize("collective", ["all_gather", "gather", "broadcast"])
async def test_another_axis_or_source_on_one_worker_is_refused(
    make_strategy: MakeStrategy, collective: str
) -> None:
    """Workers gathering along other axes, or broadcasting from other source replicas (both
    sources on worker 0), get the same ValueError on every worker instead of an array laid
    out wrongly or another replica's value; the strategy goes on."""
    strategy = make_strategy(2)
    value = np.full((2, 2), float(RANK))

    async def step() -> Any:
        ctx = replica_context()
        if collective == "all_gather":
            return await ctx.all_gather(value, axis=RANK % 2)
        return await ctx.broadcast(value, source_replica=RANK % 2)

    async def call() -> Any:
        if collective == "gather":
            return await strategy.gather(PerReplica([value, value]), axis=RANK % 2)
        return await strategy.run(step)

    with pytest.raises(ValueError, match="the workers passed different values") as caught:
        await call()
    shown = "of replica 0.*of replica 1" if collective == "broadcast" else "axis 0.*axis 1"
    assert re.search(shown, str(caught.value)), str(caught.value)
    assert len(set(allgather(str(caught.value)))) == 1

    async def agreed() -> Any:
        return await replica_context().all_gather(np.full((1, 2), RANK), axis=0)

    result = strategy.experimental_local_results(await strategy.run(agreed))[0]
    np.testing.assert_array_equal(result, np.repeat(np.arange(WORKERS), 4).reshape(-1, 2))


@pytest.mark.parametrize("size", [2, 1000])
async def test_mappings_built_in_another_order_agree(
    make_strategy: MakeStrategy, size: int
) -> None:
    """Only the keys count, not the order a dict was built in: every worker gets the sums."""
    strategy = make_strategy(1)
    pairs = [("a", np.full(size, RANK + 1.0)), ("b", np.full(3, 10.0 * (RANK + 1)))]
    value = dict(pairs if RANK % 2 == 0 else reversed(pairs))

    async def step() -> Any:
        return await replica_context().all_reduce("sum", value)

    result = await strategy.run(step)
    total = WORKERS * (WORKERS + 1) / 2
    assert list(result) == list(value)  # each worker's own order
    np.testing.assert_array_equal(result["a"], np.full(size, total))
    np.testing.assert_array_equal(result["b"], np.full(3, 10 * total))


@pytest.mark.parametrize("size", [3, 5000])
async def test_broadcast_small_and_large_from_a_later_worker(
    make_strategy: MakeStrategy, size: int
) -> None:
    """A broadcast that fits in the workers' first message and one that does not: every
    replica gets the source's values, dtype and shape."""
    strategy = make_strategy(1)
    source = WORKERS - 1

    async def step() -> Any:
        mine = np.arange(size * 2, dtype=np.int16).reshape(size, 2) * (replica_id() + 1)
        return await replica_context().broadcast(mine, source_replica=source)

    got = await strategy.run(step)
    assert got.dtype == np.int16
    assert got.shape == (size, 2)
    np.testing.assert_array_equal(got, np.arange(size * 2).reshape(size, 2) * (source + 1))


#: A description longer than the workers' first message: it follows through MPI.
_WIDE_RECORD = np.dtype([(f"field_{i:03d}", "<i2") for i in range(60)])


@pytest.mark.parametrize(
    "source_value",
    [
        lambda: np.arange(6, dtype=np.int16).reshape(3, 2),
        lambda: np.arange(10_000.0).reshape(100, 100).astype(">f8"),
        lambda: np.ones(4, _WIDE_RECORD),
        lambda: np.ones(400, _WIDE_RECORD),
        lambda: np.array("text"),
        lambda: np.zeros((0, 5), np.complex64),
    ],
    ids=["small", "large", "wide record", "wide records", "str scalar", "empty"],
)
async def test_broadcast_ignores_what_the_other_workers_pass(
    make_strategy: MakeStrategy, source_value: Callable[[], Array]
) -> None:
    """As in one process, a broadcast gives every replica of every worker its source's array,
    shape and dtype, whatever the other replicas pass (another shape, dtype, a Python number),
    small enough to travel in the workers' first message or not, whatever its description's
    size; only the structure must match."""
    strategy = make_strategy(2)
    source = 2 * WORKERS - 1
    sent = source_value()

    async def step() -> Any:
        g = replica_id()
        mine = {"v": sent if g == source else [np.zeros(g + 1, np.float32), 1.5, np.int8(g)][g % 3]}
        return await replica_context().broadcast(mine, source_replica=source)

    for got in local_results(strategy, await strategy.run(step)):
        assert got["v"].dtype == sent.dtype
        assert got["v"].shape == sent.shape
        np.testing.assert_array_equal(got["v"], sent)
    assert not np.shares_memory(got["v"], sent)


COLLECTIVES: dict[str, Callable[[], Any]] = {
    "all_reduce": lambda: replica_context().all_reduce("sum", np.ones(2)),
    "all_gather": lambda: replica_context().all_gather(np.ones((1, 2)), axis=0),
    "broadcast": lambda: replica_context().broadcast(np.ones(2), source_replica=0),
    "barrier": lambda: replica_context().barrier(),
}


@pytest.mark.parametrize("extra", [False, True], ids=["another", "one more"])
@pytest.mark.parametrize("collective", list(COLLECTIVES))
async def test_workers_making_other_collectives_fail_alike(
    make_strategy: MakeStrategy, collective: str, extra: bool
) -> None:
    """Worker 0 makes ``collective`` where the others make another one (all_gather, or
    all_reduce for an all_gather), or none at all: every worker's run() raises the same
    ValueError naming both collectives, at once instead of hanging, and the strategy goes on."""
    strategy = make_strategy(1)
    other = "all_reduce" if collective == "all_gather" else "all_gather"

    async def step() -> Any:
        if RANK == 0:
            await COLLECTIVES[collective]()
        elif not extra:
            await COLLECTIVES[other]()
        return RANK

    started = time.monotonic()
    with pytest.raises(ValueError, match="made different collectives") as caught:
        await strategy.run(step)
    assert time.monotonic() - started < 5
    message = str(caught.value)
    assert collective.replace("_", "") in message.replace("_", "").lower(), message
    assert ("the end of run()" if extra else other) in message, message
    assert len({m.split(":", 1)[1] for m in allgather(message)}) == 1
    assert await strategy.run(lambda: RANK) == RANK


#: A cross-replica call made on worker 0 alone, and the collective of the same kind, dtype
#: and shape that the other workers make in a run() meanwhile.
CALLS_ON_ONE_WORKER: dict[str, tuple[Callable[[Any], Any], Callable[[], Any]]] = {
    "strategy.reduce": (
        lambda s: s.reduce("sum", 1.0, axis=None),
        lambda: replica_context().all_reduce("sum", 1.0),
    ),
    "extended.reduce_to": (
        lambda s: s.extended.reduce_to("sum", 1.0, "cpu:0"),
        lambda: replica_context().all_reduce("sum", 1.0),
    ),
    "extended.batch_reduce_to": (
        lambda s: s.extended.batch_reduce_to("sum", [(1.0, "cpu:0")]),
        lambda: replica_context().all_reduce("sum", 1.0),
    ),
    "strategy.gather": (
        lambda s: s.gather(np.ones((1, 2)), axis=0),
        lambda: replica_context().all_gather(np.ones((1, 2)), axis=0),
    ),
}


@pytest.mark.parametrize("call", list(CALLS_ON_ONE_WORKER))
async def test_a_call_on_one_worker_meets_a_step_as_a_disagreement(
    make_strategy: MakeStrategy, call: str
) -> None:
    """Worker 0 alone makes a cross-replica call (a reduce on the chief only, say) while the
    others run a step whose collective has the same kind, dtype and shape: every worker raises
    the same ValueError naming the call on worker 0, at once, rather than combine the two (the
    call's result and the step's would both hold the other's values). The workers lost
    different calls there (worker 0 its reduce, the others their step), so their programs
    are no longer at the same point: the strategy refuses the calls after it on every worker,
    rather than pair worker 0's next step with the others' step after it."""
    strategy = make_strategy(1)
    make_call, collective = CALLS_ON_ONE_WORKER[call]

    async def step() -> Any:
        return await collective()

    started = time.monotonic()
    with pytest.raises(ValueError, match="made different collectives") as caught:
        await (make_call(strategy) if RANK == 0 else strategy.run(step))
    assert time.monotonic() - started < 5
    message = str(caught.value)
    assert f"worker 0: {call}: all_" in message, message
    assert "worker 0 outside one, so they no longer pair their collectives" in message, message
    assert len(set(allgather(message))) == 1

    async def agreed() -> Any:
        return await replica_context().all_reduce("sum", RANK + 1.0)

    with pytest.raises(ClusterBroken, match="the workers fell out of step in all_"):
        await strategy.run(agreed)


def _in_a_step(call: Callable[[bool], Any]) -> Callable[[Any, bool], Any]:
    """A bad-input case made in a replica: ``call(bad)`` in every replica of one run()."""

    async def case(strategy: Any, bad: bool) -> Any:
        return await strategy.run(lambda: call(bad))

    return case


_X = np.arange(4.0)
_INTS = np.arange(4, dtype=np.int32)
#: Options of another type: a timeout in seconds where a ``CommunicationOptions`` belongs.
_NOT_OPTIONS: Any = 5.0

#: Bad input to a collective, and the error it raises: ``case(strategy, bad)`` makes the
#: collective with bad arguments (``bad``) or good ones; its name in the others' message.
BAD_INPUT: dict[str, tuple[Callable[[Any, bool], Any], type[Exception], str]] = {
    "MEAN of ints": (
        _in_a_step(lambda bad: replica_context().all_reduce("mean", _INTS if bad else _X)),
        TypeError,
        "all_reduce",
    ),
    "a string": (
        _in_a_step(lambda bad: replica_context().all_reduce("sum", "text" if bad else _X)),
        TypeError,
        "all_reduce",
    ),
    "unknown op": (
        _in_a_step(lambda bad: replica_context().all_reduce("bogus" if bad else "sum", _X)),
        ValueError,
        "all_reduce",
    ),
    "replica shapes": (
        _in_a_step(
            lambda bad: replica_context().all_reduce(
                "sum", np.ones(2 + (replica_id() % 2 if bad else 0))
            )
        ),
        ValueError,
        "all_reduce",
    ),
    "replica ops": (
        _in_a_step(
            lambda bad: replica_context().all_reduce(
                ["sum", "max"][replica_id() % 2] if bad else "sum", _X
            )
        ),
        ReplicaSyncError,
        "all_reduce",
    ),
    "broadcast source": (
        _in_a_step(lambda bad: replica_context().broadcast(_X, source_replica=99 if bad else 0)),
        ValueError,
        "broadcast",
    ),
    "all_gather axis": (
        _in_a_step(lambda bad: replica_context().all_gather(_X, axis=5 if bad else 0)),
        ValueError,
        "all_gather",
    ),
    "reduce_scatter op": (
        _in_a_step(lambda bad: replica_context().reduce_scatter("bogus" if bad else "sum", _X)),
        ValueError,
        "reduce_scatter",
    ),
    "all_reduce options": (
        _in_a_step(
            lambda bad: replica_context().all_reduce(
                "sum", _X, options=_NOT_OPTIONS if bad else None
            )
        ),
        TypeError,
        "all_reduce",
    ),
    "barrier options": (
        _in_a_step(lambda bad: replica_context().barrier(options=_NOT_OPTIONS if bad else None)),
        TypeError,
        "barrier",
    ),
    "all_gather bool axis": (
        _in_a_step(lambda bad: replica_context().all_gather(_X, axis=True if bad else 0)),
        TypeError,
        "all_gather",
    ),
    "strategy.reduce op": (
        lambda s, bad: s.reduce("bogus" if bad else "sum", PerReplica([_X, _X])),
        ValueError,
        "strategy.reduce",
    ),
    "strategy.reduce axis": (
        lambda s, bad: s.reduce("sum", PerReplica([_X, _X]), axis=5 if bad else 0),
        ValueError,
        "strategy.reduce",
    ),
    "strategy.gather axis": (
        lambda s, bad: s.gather(PerReplica([_X, _X]), axis=5 if bad else 0),
        ValueError,
        "strategy.gather",
    ),
    "reduce_to destination": (
        lambda s, bad: s.extended.reduce_to(
            "sum", PerReplica([_X, _X]), "cpu:9" if bad else "cpu:0"
        ),
        ValueError,
        "extended.reduce_to",
    ),
}


async def _still_in_step(strategy: Any) -> None:
    """The strategy still reduces across every worker."""

    async def step() -> Any:
        return await replica_context().all_reduce("sum", np.full(3, RANK + 1.0))

    for value in local_results(strategy, await strategy.run(step)):
        np.testing.assert_array_equal(value, np.full(3, 2 * WORKERS * (WORKERS + 1) / 2))


@pytest.mark.parametrize("case", list(BAD_INPUT))
async def test_bad_input_on_every_worker_breaks_nothing(
    make_strategy: MakeStrategy, case: str
) -> None:
    """Every worker passing a collective the same bad input raises the error it would raise in
    one process, at once, and the strategy goes on working (nothing moved, no worker failed)."""
    strategy = make_strategy(2)
    make, error, _ = BAD_INPUT[case]
    started = time.monotonic()
    with pytest.raises(error) as caught:
        await make(strategy, True)
    assert time.monotonic() - started < 5
    assert "worker" not in str(caught.value).split(";")[0], str(caught.value)
    await _still_in_step(strategy)


@pytest.mark.parametrize("case", list(BAD_INPUT))
async def test_bad_input_on_one_worker_raises_on_every_worker(
    make_strategy: MakeStrategy, case: str
) -> None:
    """One worker passing bad input raises its own error; every other worker's collective
    raises a ValueError naming that worker and its error, in step, and the strategy goes on
    working on every worker."""
    strategy = make_strategy(2)
    make, error, what = BAD_INPUT[case]
    bad = RANK == WORKERS - 1
    started = time.monotonic()
    with pytest.raises(error if bad else ValueError) as caught:
        await make(strategy, bad)
    assert time.monotonic() - started < 5
    if not bad:
        message = str(caught.value)
        refusing = f"worker {WORKERS - 1}: {what} refusing its arguments: {error.__name__}"
        assert refusing in message, message
    await _still_in_step(strategy)


async def test_reduce_of_a_global_length_per_replica_says_values_are_local(
    make_strategy: MakeStrategy,
) -> None:
    """strategy.reduce of a PerReplica with one value per global replica is a ValueError that
    says distributed values hold this worker's replicas only; the strategy goes on."""
    strategy = make_strategy(2)
    with pytest.raises(ValueError, match="this worker's replicas' values only") as caught:
        await strategy.reduce("sum", PerReplica([_X] * (2 * WORKERS)))
    assert f"has 2 replicas on this worker ({2 * WORKERS} over all workers" in str(caught.value)
    await _still_in_step(strategy)


async def test_records_in_an_allgather_beyond_the_direct_workers(
    make_strategy: MakeStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``_DIRECT_WORKERS`` workers the records travel in MPI's persistent Allgather
    instead of straight from worker to worker: the collectives give the same results, and
    workers that disagree still raise alike and stay in step."""
    monkeypatch.setattr(_cluster, "_DIRECT_WORKERS", WORKERS - 1)
    strategy = make_strategy(2)
    assert len(strategy._workers._exchange_request.requests) == 1  # the Allgather

    async def step() -> Any:
        ctx, g = replica_context(), replica_id()
        small = await ctx.all_reduce("sum", np.full(3, g + 1.0))
        large = await ctx.all_reduce("max", np.arange(5000.0) + g)
        rows = await ctx.all_gather(np.full((g % 3, 2), g), axis=0)
        source = await ctx.broadcast(np.array([g]), source_replica=2 * WORKERS - 1)
        await ctx.barrier()
        return small, large, rows, source

    replicas = range(2 * WORKERS)
    for small, large, rows, source in local_results(strategy, await strategy.run(step)):
        np.testing.assert_array_equal(small, np.full(3, sum(g + 1.0 for g in replicas)))
        np.testing.assert_array_equal(large, np.arange(5000.0) + 2 * WORKERS - 1)
        expected = np.concatenate([np.full((g % 3, 2), g) for g in replicas])
        np.testing.assert_array_equal(rows, expected)
        np.testing.assert_array_equal(source, [2 * WORKERS - 1])

    async def disagree() -> Any:
        return await replica_context().all_reduce("sum", np.ones(2 + RANK))

    with pytest.raises(ValueError, match="the workers passed different values"):
        await strategy.run(disagree)
    await _still_in_step(strategy)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("size", [3, 5000], ids=["in the records", "large"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
async def test_max_and_min_keep_a_nan_from_any_worker(
    make_strategy: MakeStrategy, op: str, size: int, dtype: type[np.floating[Any]]
) -> None:
    """A NaN on one worker is a NaN in the MAX or MIN, as NumPy's and the one-process
    reduction give, whatever the size (MPI's own ops may drop it); the other elements are
    reduced as usual, to the same bits on every worker (a zero's sign too)."""
    strategy = make_strategy(1)
    value = np.full(size, float(RANK), dtype)
    value[RANK % size] = np.nan  # each worker's NaN at its own place
    value[-1] = -0.0 if RANK % 2 else 0.0

    async def step() -> Any:
        return await replica_context().all_reduce(op, value)

    result = await strategy.run(step)
    want = np.full(size, float(WORKERS - 1 if op == "max" else 0), dtype)
    want[: min(WORKERS, size)] = np.nan
    np.testing.assert_array_equal(result[:-1], want[:-1], strict=True)
    assert result[-1] == 0.0
    assert_same_on_every_worker(result)


@pytest.mark.parametrize("other", ["all_reduce", "another axis"])
async def test_a_reduce_scatter_meets_only_its_like(
    make_strategy: MakeStrategy, other: str
) -> None:
    """A reduce_scatter on one worker meeting an all_reduce, or a reduce_scatter along
    another axis, on another gets the same ValueError on every worker, as in one process,
    instead of each worker keeping a result of its own kind; the strategy goes on."""
    strategy = make_strategy(1)
    value = np.arange(16.0).reshape(4, 4)

    async def step() -> Any:
        ctx = replica_context()
        if RANK % 2 == 0:
            return await ctx.reduce_scatter("sum", value, axis=0)
        if other == "all_reduce":
            return await ctx.all_reduce("sum", value)
        return await ctx.reduce_scatter("sum", value, axis=1)

    with pytest.raises(ValueError, match="the workers passed different values") as caught:
        await strategy.run(step)
    assert "reduce_scatter along axis 0" in str(caught.value)
    assert len(set(allgather(str(caught.value)))) == 1

    async def agreed() -> Any:
        return await replica_context().reduce_scatter("sum", value, axis=0)

    result = await strategy.run(agreed)
    np.testing.assert_array_equal(result, np.array_split(WORKERS * value, WORKERS)[RANK])


#: Calls whose cross-worker wait a timeout in CommunicationOptions bounds, given per call
#: (``call``) or as the strategy's (``strategy``), and how each is made (with its options, a
#: variable and an optimizer).
BOUNDED_CALLS: dict[str, tuple[str, Any]] = {
    "all_gather": (
        "call",
        lambda s, options, v, opt: s.run(
            lambda: replica_context().all_gather(np.ones(2), 0, options)
        ),
    ),
    "broadcast": (
        "strategy",
        lambda s, options, v, opt: s.run(lambda: replica_context().broadcast(np.ones(2), 1)),
    ),
    "apply_gradients": (
        "strategy",
        lambda s, options, v, opt: s.run(lambda: opt.apply_gradients([(np.ones(2), v)])),
    ),
    "strategy.gather": (
        "strategy",
        lambda s, options, v, opt: s.gather(PerReplica([np.ones(2)]), 0),
    ),
}


@pytest.mark.parametrize("case", list(BOUNDED_CALLS))
async def test_a_collective_timeout_bounds_the_wait_for_a_late_worker(
    make_strategy: MakeStrategy, case: str
) -> None:
    """``CommunicationOptions(timeout_seconds=T)``, the strategy's or the call's, bounds the
    cross-worker wait of every collective: a worker waiting for a late one raises
    ReplicaSyncError naming it after about T seconds (not when the late one comes)."""
    where, call = BOUNDED_CALLS[case]
    options = CommunicationOptions(timeout_seconds=0.5)
    strategy = make_strategy(1, communication_options=options if where == "strategy" else None)
    with strategy.scope():
        variable = Variable(np.zeros(2), name="v")
    await strategy.run(lambda: None)  # the variable synced: only the call is late
    late = WORKERS - 1
    if late == RANK:
        await anyio.sleep(2.0)
    started = time.monotonic()
    with anyio.fail_after(20), pytest.raises(ReplicaSyncError) as caught:
        await call(strategy, options, variable, SGD(0.1))
    if late != RANK:
        assert caught.value.workers == (late,)
        assert time.monotonic() - started < 1.8
    WORLD.Barrier()  # both done before either closes the strategy
