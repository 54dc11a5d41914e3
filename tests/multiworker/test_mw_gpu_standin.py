"""GPU replicas across workers, on the CuPy stand-in: every cross-worker step stages through the
host (device, host, MPI, host, device), ordered with the devices' streams.

Each rank has its own simulated machine with two GPUs (``cp``, from tests/simulated_gpus.py);
the stand-in raises ``RaceError`` on any access CUDA would not order, and fails the test on one
the library swallowed. Expected values come from NumPy over the global data.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import numpy as np
import pytest

import aioreplica
from aioreplica.testing import replica_context
from multiworker.mwtools import RANK, WORKERS, allgather, each_replica, shared_directory

pytestmark = pytest.mark.anyio

LOCAL = 2
GLOBAL = WORKERS * LOCAL


def _rows() -> np.ndarray[Any, Any]:
    """Row ``g`` is global replica ``g``'s input."""
    return np.random.default_rng(7).normal(size=(GLOBAL, 5)).astype(np.float32)


async def test_collectives_stage_through_the_host(cp: Any) -> None:
    strategy = aioreplica.MultiWorkerMirroredStrategy(["gpu:0", "gpu:1"])
    rows = _rows()

    async def step() -> Any:
        ctx = replica_context()
        g = ctx.replica_id_in_sync_group
        x = ctx.device.asarray(rows[g])
        total = await ctx.all_reduce("mean", {"x": x, "head": x[:2]})
        gathered = await ctx.all_gather(x[: g % 3 + 1])
        sent = await ctx.broadcast(x, source_replica=GLOBAL - 1)
        chunk = await ctx.reduce_scatter("sum", x)
        await ctx.barrier()
        return [cp.asnumpy(a) for a in (total["x"], total["head"], gathered, sent, chunk)]

    results = each_replica(strategy, await strategy.run(step))
    expected_gather = np.concatenate([rows[g][: g % 3 + 1] for g in range(GLOBAL)])
    chunks = np.array_split(rows.sum(axis=0), GLOBAL)
    for local, (mean, head, gathered, sent, chunk) in enumerate(results):
        g = RANK * LOCAL + local
        np.testing.assert_allclose(mean, rows.mean(axis=0), rtol=1e-6)
        np.testing.assert_allclose(head, rows.mean(axis=0)[:2], rtol=1e-6)
        np.testing.assert_array_equal(gathered, expected_gather)
        np.testing.assert_array_equal(sent, rows[GLOBAL - 1])
        np.testing.assert_allclose(chunk, chunks[g], rtol=1e-6)


async def test_a_broadcast_places_the_sources_array_on_every_gpu(cp: Any) -> None:
    """The source's array, shape and dtype, on every replica's own GPU of every worker,
    whatever the other replicas pass (their arrays are ignored, as in one process)."""
    strategy = aioreplica.MultiWorkerMirroredStrategy(["gpu:0", "gpu:1"])
    rows = _rows()

    async def step() -> Any:
        ctx = replica_context()
        g = ctx.replica_id_in_sync_group
        mine = rows[g] if g == 1 else np.zeros((g + 2, 3), np.int8)
        sent = await ctx.broadcast(ctx.device.asarray(mine), source_replica=1)
        assert sent.device.id == ctx.device.index
        return cp.asnumpy(sent)

    for sent in each_replica(strategy, await strategy.run(step)):
        assert sent.dtype == np.float32
        np.testing.assert_array_equal(sent, rows[1])


async def test_variables_start_from_the_chief_and_stay_identical(cp: Any) -> None:
    strategy = aioreplica.MultiWorkerMirroredStrategy(["gpu:0", "gpu:1"])
    rows = _rows()
    with strategy.scope():
        w = aioreplica.Variable(np.full(5, float(RANK + 1), np.float32), name="w")
        seen = aioreplica.Variable(0.0, synchronization="on_read", aggregation="sum")
    optimizer = aioreplica.optimizers.SGD(0.5, momentum=0.9)

    async def step() -> None:
        ctx = replica_context()
        grad = ctx.device.asarray(rows[ctx.replica_id_in_sync_group])
        await optimizer.apply_gradients([(grad, w)])
        await seen.assign_add(1.0)

    for _ in range(3):
        await strategy.run(step)
    copies = [cp.asnumpy(copy) for copy in w.values]
    assert all(np.array_equal(copy, copies[0]) for copy in copies)
    every_worker = allgather(copies[0].tobytes())
    assert len(set(every_worker)) == 1  # bitwise identical on every worker
    # The chief's initial 1.0, then SGD with momentum on the summed gradient.
    expected, velocity = np.ones(5, np.float32), np.zeros(5, np.float32)
    for _ in range(3):
        velocity = 0.9 * velocity - 0.5 * rows.sum(axis=0)
        expected = expected + velocity
    np.testing.assert_allclose(copies[0], expected, rtol=1e-5)
    assert float(seen) == 3.0 * GLOBAL


async def test_a_checkpoint_of_gpu_variables_holds_the_global_values(cp: Any) -> None:
    strategy = aioreplica.MultiWorkerMirroredStrategy(["gpu:0", "gpu:1"])
    with strategy.scope():
        w = aioreplica.Variable(np.arange(3.0, dtype=np.float32) + RANK, name="w")
        count = aioreplica.Variable(0, synchronization="on_read", aggregation="sum")

    async def step() -> None:
        await count.assign_add(replica_context().replica_id_in_sync_group)

    await strategy.run(step)
    checkpoint = aioreplica.Checkpoint(w=w, count=count)
    with shared_directory() as directory:
        path = await checkpoint.save(f"{directory}/gpu.npz")
        with np.load(path) as saved:  # every worker reads it as soon as save() returns
            arrays = sorted(k for k in saved.files if k != "manifest.json")
            values = [saved[k] for k in arrays]
        await count.assign(0)
        await checkpoint.restore(path)
    assert any(np.array_equal(v, np.arange(3.0)) for v in values)
    assert sum(range(GLOBAL)) in [int(v) for v in values if v.ndim == 0]
    np.testing.assert_array_equal(w.numpy(), np.arange(3.0))
    assert int(count.numpy()) == sum(range(GLOBAL))


async def test_cross_replica_reductions_of_gpu_values(cp: Any) -> None:
    """``strategy.reduce`` (with and without an axis), ``gather``, ``reduce_to`` and
    ``batch_reduce_to`` of GPU results combine every worker's, through the host."""
    strategy = aioreplica.MultiWorkerMirroredStrategy(["gpu:0", "gpu:1"])
    rows = _rows()

    async def step() -> Any:
        ctx = replica_context()
        g = ctx.replica_id_in_sync_group
        return ctx.device.asarray(rows[g][: g + 1])  # uneven: replica g holds g + 1 values

    parts = await strategy.run(step)
    flat = np.concatenate([rows[g][: g + 1] for g in range(GLOBAL)])
    total = await strategy.reduce("sum", parts, axis=0)
    mean = await strategy.reduce("mean", parts, axis=0)
    gathered = await strategy.gather(parts)
    np.testing.assert_allclose(cp.asnumpy(total), flat.sum(), rtol=1e-5)
    np.testing.assert_allclose(cp.asnumpy(mean), flat.mean(), rtol=1e-5)  # by real rows
    np.testing.assert_array_equal(cp.asnumpy(gathered), flat)

    whole = await strategy.run(lambda: replica_context().device.asarray(rows[RANK]))
    reduced = await strategy.extended.reduce_to("max", whole, "gpu:1")
    assert reduced.device.id == 1
    np.testing.assert_array_equal(cp.asnumpy(reduced), rows[:WORKERS].max(axis=0))
    pairs = [(whole, whole), (whole, "gpu:0")]
    both, one = await strategy.extended.batch_reduce_to("sum", pairs)
    for part in each_replica(strategy, both):
        np.testing.assert_allclose(cp.asnumpy(part), LOCAL * rows[:WORKERS].sum(axis=0), rtol=1e-5)
    np.testing.assert_allclose(cp.asnumpy(one), LOCAL * rows[:WORKERS].sum(axis=0), rtol=1e-5)


async def test_a_dataset_pass_places_every_workers_slices_on_its_gpus(cp: Any) -> None:
    """Each worker's slices of every global batch land on its own GPUs; in the partial last
    batch, replicas without rows get zero-row GPU arrays of the right dtype."""
    strategy = aioreplica.MultiWorkerMirroredStrategy(["gpu:0", "gpu:1"])
    data = np.arange(2 * GLOBAL + 1, dtype=np.float32).reshape(-1, 1)
    batches = [data[: 2 * GLOBAL], data[2 * GLOBAL :]]  # the last: one row, for replica 0
    seen = []
    async for batch in strategy.distribute_dataset(batches):
        for local, part in enumerate(strategy.experimental_local_results(batch)):
            assert isinstance(part, cp.ndarray)
            assert part.device.id == local
            assert part.dtype == np.float32
            seen.append(cp.asnumpy(part).ravel().tolist())
    g0 = RANK * LOCAL
    first = [[2.0 * (g0 + j), 2.0 * (g0 + j) + 1] for j in range(LOCAL)]
    last = [[2.0 * GLOBAL] if g0 + j == 0 else [] for j in range(LOCAL)]
    assert seen == first + last


async def test_writes_outside_run_take_the_chiefs_value_on_gpus(cp: Any) -> None:
    """A write and an update outside run(), each worker passing its own value: every copy on
    every GPU of every worker holds the chief's (staged through the host like a broadcast)."""
    strategy = aioreplica.MultiWorkerMirroredStrategy(["gpu:0", "gpu:1"])
    with strategy.scope():
        w = aioreplica.Variable(np.zeros(3, np.float32), name="w")
    await w.assign(np.full(3, RANK + 1.0, np.float32))
    await strategy.extended.update(w, lambda copy, x: copy * x, args=(RANK + 2.0,))
    copies = [cp.asnumpy(copy) for copy in w.values]
    for copy in copies:
        np.testing.assert_array_equal(copy, np.full(3, 2.0, np.float32))  # the chief's: 1 * 2
    assert (
        allgather([c.tobytes() for c in copies])
        == [[np.full(3, 2.0, np.float32).tobytes()] * LOCAL] * WORKERS
    )


async def test_cross_worker_work_never_synchronizes_the_host(cp: Any) -> None:
    """Invariant 4 across workers: staging through the host copies device to host
    asynchronously, awaited through the stream, never with a host synchronization on the loop
    thread. Under ``cupyx.allow_synchronize(False)`` (what CuPy raises ``DeviceSynchronized``
    under), variables' first sync, every collective, an optimizer step, sync-on-read writes and
    a checkpoint save all run, and give the global values."""
    import cupyx

    strategy = aioreplica.MultiWorkerMirroredStrategy(["gpu:0", "gpu:1"])
    rows = _rows()
    with strategy.scope():
        w = aioreplica.Variable(np.full(5, float(RANK + 1), np.float32), name="w")
        seen = aioreplica.Variable(0.0, synchronization="on_read", aggregation="sum")
    optimizer = aioreplica.optimizers.SGD(0.5)

    async def step() -> Any:
        ctx = replica_context()
        x = ctx.device.asarray(rows[ctx.replica_id_in_sync_group])
        total = await ctx.all_reduce("sum", x)
        gathered = await ctx.all_gather(x[:2])
        sent = await ctx.broadcast(x, source_replica=GLOBAL - 1)
        await optimizer.apply_gradients([(x, w)])
        await seen.assign_add(1.0)
        return total, gathered, sent

    with shared_directory() as directory, contextlib.ExitStack() as disallowed:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # allow_synchronize warns that it is deprecated
            disallowed.enter_context(cupyx.allow_synchronize(False))
        result = await strategy.run(step)
        path = await aioreplica.Checkpoint(w=w, seen=seen).save(f"{directory}/gpu.npz")
        with np.load(path) as saved:
            values = {k: saved[k] for k in saved.files if k != "manifest.json"}
    for total, gathered, sent in each_replica(strategy, result):
        np.testing.assert_allclose(cp.asnumpy(total), rows.sum(axis=0), rtol=1e-6)
        np.testing.assert_array_equal(cp.asnumpy(gathered), np.concatenate([r[:2] for r in rows]))
        np.testing.assert_array_equal(cp.asnumpy(sent), rows[GLOBAL - 1])
    expected = np.ones(5, np.float32) - 0.5 * rows.sum(axis=0)  # from the chief's 1.0
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-6)
    assert sorted(float(v) for v in values.values() if v.ndim == 0) == [float(GLOBAL)]
    assert any(np.allclose(v, expected, rtol=1e-6) for v in values.values() if v.ndim == 1)
