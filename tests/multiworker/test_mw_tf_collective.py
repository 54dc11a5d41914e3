"""TensorFlow's multi-worker strategy tests, rewritten for MultiWorkerMirroredStrategy.

Cases from ``tensorflow/python/distribute/``: ``collective_all_reduce_strategy_test.py``,
``multi_worker_continuous_run_test.py``, the CollectiveOps parts of
``cross_device_ops_test.py`` and the multi-worker variants of ``strategy_common_test.py`` and
``strategy_gather_test.py``. Each rank builds the global data (seeded) and checks with NumPy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

from aioreplica import (
    CommunicationOptions,
    Mirrored,
    PerReplica,
    ReduceOp,
    Variable,
    VariableAggregation,
    VariableSynchronization,
)
from aioreplica.testing import replica_context, replica_id
from multiworker.mwtools import (
    RANK,
    WORKERS,
    allgather,
    assert_same_on_every_worker,
    each_replica,
    global_ids,
)

if TYPE_CHECKING:
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]


def local(values: list[Any]) -> Any:
    return PerReplica(values) if len(values) > 1 else values[0]


# --- collective_all_reduce_strategy_test.py ------------------------------------------------


@pytest.mark.parametrize("n_local", [1, 2])
def test_strategy_properties(make_strategy: MakeStrategy, n_local: int) -> None:
    """testNumReplicasInSync / testClusterResolverProperties: global replica count, TF's
    cluster_resolver names, a cluster_spec of one worker job with W tasks."""
    strategy = make_strategy(n_local)
    assert strategy.num_replicas_in_sync == WORKERS * n_local
    resolver = strategy.cluster_resolver
    assert resolver.task_type == "worker"
    assert resolver.task_id == RANK
    spec = resolver.cluster_spec()
    assert spec.jobs == ["worker"]
    assert spec.num_tasks("worker") == WORKERS
    assert spec.task_indices("worker") == list(range(WORKERS))
    assert resolver.num_accelerators() == {"GPU": 0} or resolver.num_accelerators() == {}
    assert len(strategy.extended.worker_devices) == n_local
    assert spec.as_dict().keys() == {"worker"}
    assert len(spec.as_dict()["worker"]) == WORKERS
    assert resolver.master() == ""
    assert resolver.rpc_layer is None


@pytest.mark.parametrize("n_local", [1, 2])
async def test_variable_initialization_random_per_worker(
    make_strategy: MakeStrategy, n_local: int
) -> None:
    """testVariableInitialization: a variable initialised randomly (another seed per worker)
    has the same value everywhere (the chief's)."""
    strategy = make_strategy(n_local)
    rng = np.random.default_rng(100 + RANK)
    with strategy.scope():
        v = Variable(rng.normal(size=(3, 4)).astype(np.float32), name="random")
        i = Variable(np.int32(RANK + 7), name="counter")

    async def step() -> Any:
        return v.value(), i.value()

    results = each_replica(strategy, await strategy.run(step))
    chief = allgather(np.random.default_rng(100).normal(size=(3, 4)).astype(np.float32))[0]
    for value, count in results:
        np.testing.assert_array_equal(np.asarray(value), chief)
        assert int(count) == 7
    assert_same_on_every_worker(v.numpy(), i.numpy())


async def test_variables_created_inside_run_are_refused(make_strategy: MakeStrategy) -> None:
    """TF's MWMS creates variables in the step with the chief's value via collectives; here
    making one in a replica is documented as a RuntimeError (every worker alike)."""
    strategy = make_strategy(2)

    async def step() -> None:
        with strategy.scope():
            Variable(np.zeros(2))

    with pytest.raises(RuntimeError):
        await strategy.run(step)


@pytest.mark.parametrize("n_local", [1, 2])
async def test_minimize_loss_like_one_process(make_strategy: MakeStrategy, n_local: int) -> None:
    """testMinimizeLoss: SGD on mean-of-replicas gradients equals NumPy over the global batch."""
    from aioreplica.optimizers import SGD

    strategy = make_strategy(n_local)
    n = WORKERS * n_local
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n * 4, 2))
    y = x @ np.array([2.0, -1.0])
    with strategy.scope():
        w = Variable(np.zeros(2), name="w")
    optimizer = SGD(0.1)

    async def step() -> None:
        g = replica_id()
        xs, ys = x[4 * g : 4 * g + 4], y[4 * g : 4 * g + 4]
        grad = 2.0 * xs.T @ (xs @ w.value() - ys) / len(x)
        await optimizer.apply_gradients([(grad, w)])

    expected = np.zeros(2)
    for _ in range(5):
        await strategy.run(step)
        expected = expected - 0.1 * 2.0 * x.T @ (x @ expected - y) / len(x)
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-12)
    assert_same_on_every_worker(w.numpy())


# --- strategy_common_test.py ------------------------------------------------------------


@pytest.mark.parametrize("op", ["sum", "mean"])
async def test_reduce_axis_zero_uneven_per_worker(make_strategy: MakeStrategy, op: str) -> None:
    """ReduceTest.testAxis on uneven data: worker 0's replicas hold 3 and 2 rows, worker 1's
    hold 1 and 0. SUM and MEAN along axis 0 equal NumPy's over the concatenation."""
    strategy = make_strategy(2)
    sizes = [3, 2, 1, 0] + [2] * (2 * WORKERS - 4)
    data = np.arange(sum(sizes) * 2, dtype=np.float64).reshape(-1, 2)
    parts = np.split(data, np.cumsum(sizes)[:-1])
    mine = [parts[g] for g in global_ids(2)]
    got = await strategy.reduce(op, PerReplica(mine), axis=0)
    expected = data.sum(axis=0) if op == "sum" else data.mean(axis=0)
    np.testing.assert_allclose(np.asarray(got), expected)


async def test_reduce_axis_zero_a_worker_with_no_rows(make_strategy: MakeStrategy) -> None:
    """MEAN along axis 0 where every replica of the last worker holds zero rows."""
    strategy = make_strategy(2)
    rows = 0 if RANK == WORKERS - 1 else 3
    mine = [np.full((rows, 2), float(g)) for g in global_ids(2)]
    got = await strategy.reduce("mean", PerReplica(mine), axis=0)
    everyone = [
        np.full((0 if w == WORKERS - 1 else 3, 2), float(g))
        for w in range(WORKERS)
        for g in global_ids(2, w)
    ]
    np.testing.assert_allclose(np.asarray(got), np.concatenate(everyone).mean(axis=0))


async def test_reduce_mean_of_integers_in_batch_reduce_to(make_strategy: MakeStrategy) -> None:
    """MEAN of int32 in cross-replica context is a float64 mean (docs: integer means)."""
    strategy = make_strategy(2)
    mine = PerReplica([np.array([g, 2 * g + 1], dtype=np.int32) for g in global_ids(2)])
    other = PerReplica([np.int64(g) for g in global_ids(2)])
    a, b = await strategy.extended.batch_reduce_to("mean", [(mine, "cpu:0"), (other, "cpu:0")])
    ids = np.arange(2 * WORKERS)
    np.testing.assert_allclose(np.asarray(a), [ids.mean(), (2 * ids + 1).mean()])
    assert np.asarray(a).dtype == np.float64
    assert float(b) == ids.mean()


async def test_experimental_local_results_of_structures(make_strategy: MakeStrategy) -> None:
    """testExperimentalLocalResults: local values of a PerReplica, a Mirrored and a plain value."""
    strategy = make_strategy(2)

    async def step() -> Any:
        return {"id": replica_id(), "same": 5.0}

    result = await strategy.run(step)
    got = strategy.experimental_local_results(result)
    assert [r["id"] for r in got] == global_ids(2)
    assert [r["same"] for r in got] == [5.0, 5.0]
    assert strategy.experimental_local_results(3.0) == (3.0, 3.0)  # docs: once per replica


async def test_all_reduce_nested_mixed_dtypes(make_strategy: MakeStrategy) -> None:
    """ReplicaCtxAllReduceTest.testNestedInput with mixed dtypes, and packing."""
    strategy = make_strategy(2, communication_options=CommunicationOptions(bytes_per_pack=16))
    n = 2 * WORKERS

    async def step() -> Any:
        g = replica_id()
        value = {
            "a": np.full(3, g, dtype=np.int32),
            "b": (np.float16(g) / 2, [np.full((2, 2), g, dtype=np.float32), np.uint8(g == 1)]),
            "c": np.arange(5, dtype=np.int64) * g,
        }
        return await replica_context().all_reduce("sum", value)

    total = sum(range(n))
    for got in each_replica(strategy, await strategy.run(step)):
        assert got["a"].dtype == np.int32
        np.testing.assert_array_equal(got["a"], [total] * 3)
        assert np.asarray(got["b"][0]).dtype == np.float16
        assert float(got["b"][0]) == total / 2
        np.testing.assert_array_equal(got["b"][1][0], np.full((2, 2), total, np.float32))
        assert int(got["b"][1][1]) == 1
        np.testing.assert_array_equal(got["c"], np.arange(5) * total)


async def test_all_reduce_mean_float16_keeps_dtype(make_strategy: MakeStrategy) -> None:
    """testAllReduceMean on float16 across workers keeps float16."""
    strategy = make_strategy(2)

    async def step() -> Any:
        return await replica_context().all_reduce("mean", np.full(4, replica_id(), np.float16))

    for got in each_replica(strategy, await strategy.run(step)):
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, np.full(4, np.mean(range(2 * WORKERS)), np.float16))


async def test_all_reduce_mean_of_integers_in_replica_is_refused(
    make_strategy: MakeStrategy,
) -> None:
    """Docs: an integer MEAN in replica context is a TypeError saying to cast first."""
    strategy = make_strategy(2)

    async def step() -> Any:
        return await replica_context().all_reduce("mean", np.int32(replica_id()))

    with pytest.raises(TypeError, match="cast"):
        await strategy.run(step)


async def test_all_reduce_zero_size_arrays(make_strategy: MakeStrategy) -> None:
    """cross_device_ops_test: an all_reduce of an empty tensor gives an empty tensor."""
    strategy = make_strategy(2)

    async def step() -> Any:
        return await replica_context().all_reduce("sum", np.zeros((0, 3), np.float32))

    for got in each_replica(strategy, await strategy.run(step)):
        assert got.shape == (0, 3)
        assert got.dtype == np.float32


# --- strategy_gather_test.py ----------------------------------------------------------------


async def test_gather_diff_shape_at_axis_0(make_strategy: MakeStrategy) -> None:
    """testGatherDiffShapeAtAxis0: replicas with 1..n rows concatenate in global order."""
    strategy = make_strategy(2)
    mine = [np.full((g + 1, 2), float(g)) for g in global_ids(2)]
    got = await strategy.gather(PerReplica(mine), axis=0)
    expected = np.concatenate([np.full((g + 1, 2), float(g)) for g in range(2 * WORKERS)])
    np.testing.assert_array_equal(np.asarray(got), expected)


async def test_gather_diff_shape_at_axis_1(make_strategy: MakeStrategy) -> None:
    """testGatherDiffShapeAtAxis1: sizes differ along the gather axis 1 only."""
    strategy = make_strategy(2)
    mine = [np.full((2, g + 1), float(g)) for g in global_ids(2)]
    got = await strategy.gather(PerReplica(mine), axis=1)
    expected = np.concatenate([np.full((2, g + 1), float(g)) for g in range(2 * WORKERS)], 1)
    np.testing.assert_array_equal(np.asarray(got), expected)


async def test_all_gather_diff_shape_at_axis_1(make_strategy: MakeStrategy) -> None:
    """testAllGatherDiffShapeAtAxis1 in replica context."""
    strategy = make_strategy(2)

    async def step() -> Any:
        g = replica_id()
        return await replica_context().all_gather(np.full((2, g + 1, 1), g, np.int16), axis=1)

    expected = np.concatenate([np.full((2, g + 1, 1), g, np.int16) for g in range(2 * WORKERS)], 1)
    for got in each_replica(strategy, await strategy.run(step)):
        assert got.dtype == np.int16
        np.testing.assert_array_equal(got, expected)


async def test_all_gather_nest(make_strategy: MakeStrategy) -> None:
    """testAllGatherNest: a nested structure gathers leaf by leaf."""
    strategy = make_strategy(2)

    async def step() -> Any:
        g = replica_id()
        value = {"x": np.full((1, 2), g, np.float32), "y": [np.array([g, g], np.int64)]}
        return await replica_context().all_gather(value, axis=0)

    n = 2 * WORKERS
    for got in each_replica(strategy, await strategy.run(step)):
        np.testing.assert_array_equal(got["x"], np.repeat(np.arange(n), 2).reshape(n, 2))
        assert got["x"].dtype == np.float32
        np.testing.assert_array_equal(got["y"][0], np.repeat(np.arange(n), 2))


async def test_all_gather_a_worker_with_only_empty_values(make_strategy: MakeStrategy) -> None:
    """All replicas of the last worker pass zero rows: the result holds the others' rows."""
    strategy = make_strategy(2)

    async def step() -> Any:
        g = replica_id()
        rows = 0 if g >= 2 * (WORKERS - 1) else 2
        return await replica_context().all_gather(np.full((rows, 3), g, np.float64), axis=0)

    expected = np.concatenate(
        [
            np.full((0 if g >= 2 * (WORKERS - 1) else 2, 3), g, np.float64)
            for g in range(2 * WORKERS)
        ]
    )
    for got in each_replica(strategy, await strategy.run(step)):
        np.testing.assert_array_equal(got, expected)


async def test_gather_of_a_mirrored_variable(make_strategy: MakeStrategy) -> None:
    """A mirrored variable gathers each replica's copy: W*L copies of the chief's value."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(np.array([1.0, 2.0]) + RANK, name="g")
    got = await strategy.gather(v, axis=0)
    np.testing.assert_array_equal(np.asarray(got), np.tile([1.0, 2.0], 2 * WORKERS))


async def test_gather_raises_on_different_rank(make_strategy: MakeStrategy) -> None:
    """testGatherRaiseDifferentRank: values of other ranks are refused on every worker."""
    strategy = make_strategy(2)
    mine = [np.ones((2, 2)) if RANK == 0 else np.ones((2, 2, 1)) for _ in range(2)]
    with pytest.raises(ValueError, match="different values"):
        await strategy.gather(PerReplica(mine), axis=0)


# --- cross_device_ops_test.py (CollectiveOps) ------------------------------------------------


async def test_batch_reduce_dense_sum_and_mean(make_strategy: MakeStrategy) -> None:
    """testBatchAllReduceDense: several values in one batch_reduce_to."""
    strategy = make_strategy(2)
    n = 2 * WORKERS
    a = PerReplica([np.full(3, float(g)) for g in global_ids(2)])
    b = PerReplica([np.full((2, 2), float(g + 1)) for g in global_ids(2)])
    for op in ("sum", "mean"):
        got = await strategy.extended.batch_reduce_to(op, [(a, a), (b, b)])
        div = n if op == "mean" else 1
        np.testing.assert_allclose(np.asarray(got[0]), np.full(3, sum(range(n)) / div))
        np.testing.assert_allclose(np.asarray(got[1]), np.full((2, 2), sum(range(1, n + 1)) / div))


async def test_collective_launch_order_of_concurrent_steps_in_a_replica(
    make_strategy: MakeStrategy,
) -> None:
    """testMultiThreadedCollectiveLaunchNoInterleave: several collectives launched
    concurrently within one replica (a task group) pair up correctly across workers."""
    strategy = make_strategy(1)
    results: dict[int, Any] = {}

    async def step() -> Any:
        ctx = replica_context()
        for k in range(4):
            results[k] = await ctx.all_reduce("sum", np.full(k + 1, float(replica_id() + k)))
        return None

    await strategy.run(step)
    for k in range(4):
        np.testing.assert_array_equal(
            results[k], np.full(k + 1, float(sum(range(WORKERS)) + WORKERS * k))
        )


async def test_timeout_then_the_strategy_is_broken_everywhere(
    make_strategy: MakeStrategy,
) -> None:
    """testTimeoutReduceDense: a collective a worker never joins times out (not a hang) on
    the waiting worker; afterwards TF needs a reset; here the strategy is done on both."""
    from aioreplica import ClusterBroken, ReplicaSyncError

    strategy = make_strategy(1, communication_options=CommunicationOptions(timeout_seconds=0.5))

    async def step() -> Any:
        return await replica_context().all_reduce("sum", np.ones(2))

    if RANK == 0:
        with anyio.fail_after(15), pytest.raises(ReplicaSyncError):
            await strategy.run(step)
    else:
        await anyio.sleep(1.5)
        with anyio.fail_after(15), pytest.raises((ReplicaSyncError, ClusterBroken)):
            await strategy.run(step)
    with anyio.fail_after(15), pytest.raises(ClusterBroken):
        await strategy.run(step)
    allgather(None)


@pytest.mark.timeout(60)
async def test_cancel_on_one_worker_fails_the_other(make_strategy: MakeStrategy) -> None:
    """testAbortCommunication: cancelling (aborting) a collective on one worker makes the
    other raise rather than hang; later calls raise ClusterBroken on both."""
    from aioreplica import ClusterBroken, ReplicaSyncError

    strategy = make_strategy(1)

    async def step() -> Any:
        return await replica_context().all_reduce("sum", np.ones(2))

    await strategy.run(step)
    if RANK == 1:
        with anyio.move_on_after(0.3) as scope:
            await strategy.run(step)  # waits for worker 0, which is late: aborted
        assert scope.cancelled_caught
    else:
        await anyio.sleep(1.0)
        with anyio.fail_after(15), pytest.raises(ReplicaSyncError) as caught:
            await strategy.run(step)
        assert caught.value.workers == (1,)
    with anyio.fail_after(15), pytest.raises(ClusterBroken):
        await strategy.run(step)
    allgather(None)


# --- mirrored variables: update across workers ----------------------------------------------


async def test_extended_update_in_run_with_reduced_values(make_strategy: MakeStrategy) -> None:
    """strategy_common_test's update in a merge_fn: reduce_to then update; every copy on
    every worker holds the global result."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(np.zeros(2), name="u")

    def merge(distribution: Any, grad: Any) -> Any:
        async def go() -> Any:
            total = await distribution.extended.reduce_to("sum", grad, v)
            return await distribution.extended.update(v, lambda x, d: x + d, args=(total,))

        return go()

    async def step() -> Any:
        return await replica_context().merge_call(merge, args=(np.full(2, float(replica_id())),))

    await strategy.run(step)
    np.testing.assert_array_equal(v.numpy(), np.full(2, float(sum(range(2 * WORKERS)))))
    assert_same_on_every_worker(*v.values)


async def test_sync_on_read_mean_with_uneven_workers(make_strategy: MakeStrategy) -> None:
    """A sync-on-read MEAN variable read in cross-replica context is the mean of every copy."""
    strategy = make_strategy(2)
    with strategy.scope():
        m = Variable(
            0.0,
            synchronization=VariableSynchronization.ON_READ,
            aggregation=VariableAggregation.MEAN,
            name="m",
        )

    async def step() -> None:
        await m.assign(float(replica_id() * 10))

    await strategy.run(step)
    assert float(m.numpy()) == pytest.approx(np.mean([g * 10 for g in range(2 * WORKERS)]))


# --- multi_worker_continuous_run_test.py ----------------------------------------------------


@pytest.mark.timeout(60)
async def test_all_reduce_continuous_run(make_strategy: MakeStrategy) -> None:
    """testAllReduceContinuousRun: many steps, each with a tensor of another size."""
    strategy = make_strategy(2)
    n = 2 * WORKERS
    sizes = np.random.default_rng(5).integers(1, 5000, size=40)

    async def step(size: int) -> Any:
        g = replica_id()
        return await replica_context().all_reduce("sum", np.full(size, float(g + 1), np.float32))

    for size in sizes:
        for got in each_replica(strategy, await strategy.run(step, args=(int(size),))):
            assert got.shape == (size,)
            np.testing.assert_array_equal(got, np.full(size, n * (n + 1) / 2, np.float32))


@pytest.mark.timeout(60)
async def test_variable_initialization_with_changing_shape(make_strategy: MakeStrategy) -> None:
    """testVariableInitializationWithChangingShape: each round a new variable of another
    shape, random on each worker, starts from the chief's value."""
    strategy = make_strategy(2)
    rng = np.random.default_rng(50 + RANK)
    chief = np.random.default_rng(50)
    for i in range(1, 12):
        with strategy.scope():
            v = Variable(rng.normal(size=(i, i)), name=f"v{i}")
        expected = chief.normal(size=(i, i))

        async def step(v: Variable = v) -> Any:
            return await replica_context().all_reduce("sum", v.value())

        for got in each_replica(strategy, await strategy.run(step)):
            np.testing.assert_allclose(got, expected * 2 * WORKERS)


@pytest.mark.timeout(60)
async def test_continuous_run_of_gathers_of_varying_rows(make_strategy: MakeStrategy) -> None:
    """Continuous all_gathers whose per-replica rows change every step (0 included)."""
    strategy = make_strategy(2)
    rng = np.random.default_rng(9)
    n = 2 * WORKERS
    for _ in range(30):
        rows = rng.integers(0, 4, size=n)

        async def step(rows: Any = rows) -> Any:
            g = replica_id()
            return await replica_context().all_gather(np.full((rows[g], 2), g, np.int32), 0)

        expected = np.concatenate([np.full((rows[g], 2), g, np.int32) for g in range(n)])
        for got in each_replica(strategy, await strategy.run(step)):
            np.testing.assert_array_equal(got, expected)


async def test_barrier_orders_the_workers(make_strategy: MakeStrategy) -> None:
    """multi_process_runner's barrier: what each worker recorded before the barrier is seen
    after it by every worker (through an all_gather)."""
    strategy = make_strategy(1)
    events: list[str] = []

    async def step() -> Any:
        ctx = replica_context()
        if RANK == WORKERS - 1:
            await anyio.sleep(0.3)
        events.append("before")
        await ctx.barrier()
        events.append("after")
        return await ctx.all_gather(np.array([RANK]), 0)

    got = each_replica(strategy, await strategy.run(step))
    assert events == ["before", "after"]
    np.testing.assert_array_equal(got[0], np.arange(WORKERS))


async def test_reduce_of_mirrored_value_sum_is_refused(make_strategy: MakeStrategy) -> None:
    """Docs: a Mirrored value reduced with SUM is a ValueError; MEAN leaves it as it is."""
    strategy = make_strategy(2)
    m = Mirrored([np.array([1.0, 2.0]), np.array([1.0, 2.0])])
    got = await strategy.reduce(ReduceOp.MEAN, m)
    np.testing.assert_array_equal(np.asarray(got), [1.0, 2.0])
    with pytest.raises(ValueError, match="Mirrored value with SUM"):
        await strategy.reduce(ReduceOp.SUM, m)


# --- more reduce/gather edges (strategy_common_test ReduceTest, cross_device_ops_test) -------


@pytest.mark.parametrize("op", ["max", "min", "prod"])
async def test_reduce_axis_zero_with_empty_replicas(make_strategy: MakeStrategy, op: str) -> None:
    """reduce_max/min/prod along axis 0 where some replicas hold zero rows: TF reduces each
    component (an empty one gives the identity: -inf, inf, 1) then across replicas, so the
    result is NumPy's over the concatenated rows."""
    strategy = make_strategy(2)
    sizes = [2, 0, 0, 3] + [1] * (2 * WORKERS - 4)
    data = np.random.default_rng(4).normal(size=(sum(sizes), 3))
    parts = np.split(data, np.cumsum(sizes)[:-1])
    got = await strategy.reduce(op, PerReplica([parts[g] for g in global_ids(2)]), axis=0)
    expected = {"max": data.max(axis=0), "min": data.min(axis=0), "prod": data.prod(axis=0)}[op]
    np.testing.assert_allclose(np.asarray(got), expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
async def test_reduce_mean_along_axis_keeps_float_dtype(
    make_strategy: MakeStrategy, dtype: Any
) -> None:
    """TF's reduce(MEAN, axis=0) of float32 values is float32 (reduce_sum / count in the
    value's dtype); NumPy's mean of float32 too."""
    strategy = make_strategy(2)
    sizes = [3, 1, 2, 2] + [1] * (2 * WORKERS - 4)
    data = np.arange(sum(sizes) * 2).reshape(-1, 2).astype(dtype)
    parts = np.split(data, np.cumsum(sizes)[:-1])
    got = await strategy.reduce("mean", PerReplica([parts[g] for g in global_ids(2)]), axis=0)
    assert np.asarray(got).dtype == dtype
    np.testing.assert_allclose(
        np.asarray(got, np.float64), data.astype(np.float64).mean(0), rtol=1e-3
    )
    plain = await strategy.reduce("mean", PerReplica([parts[g][:1] for g in global_ids(2)]))
    assert np.asarray(plain).dtype == dtype


async def test_reduce_along_a_negative_axis_uneven(make_strategy: MakeStrategy) -> None:
    """axis=-1 with each replica holding another number of columns."""
    strategy = make_strategy(2)
    mine = [np.full((2, g + 1), float(g + 1)) for g in global_ids(2)]
    full = np.concatenate([np.full((2, g + 1), float(g + 1)) for g in range(2 * WORKERS)], 1)
    got = await strategy.reduce("mean", PerReplica(mine), axis=-1)
    np.testing.assert_allclose(np.asarray(got), full.mean(-1))
    got = await strategy.reduce("sum", PerReplica(mine), axis=-1)
    np.testing.assert_allclose(np.asarray(got), full.sum(-1))


async def test_batch_reduce_mixed_dtypes(make_strategy: MakeStrategy) -> None:
    """batch_reduce_to of int32, float32 and float64 values in one call keeps each dtype."""
    strategy = make_strategy(2, communication_options=CommunicationOptions(bytes_per_pack=8))
    n = 2 * WORKERS
    ids = global_ids(2)
    values = [
        PerReplica([np.full(3, g, np.int32) for g in ids]),
        PerReplica([np.full(2, g + 0.5, np.float32) for g in ids]),
        PerReplica([np.full(1, g * 2, np.int32) for g in ids]),
        PerReplica([np.full(2, -g, np.float64) for g in ids]),
    ]
    got = await strategy.extended.batch_reduce_to("sum", [(v, "cpu:0") for v in values])
    total = sum(range(n))
    expect: list[Array] = [
        np.full(3, total, np.int32),
        np.full(2, total + 0.5 * n, np.float32),
        np.full(1, 2 * total, np.int32),
        np.full(2, -total, np.float64),
    ]
    for g, e in zip(got, expect, strict=True):
        assert np.asarray(g).dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(g), e)


async def test_all_reduce_packed_interleaved_dtypes(make_strategy: MakeStrategy) -> None:
    """Packing with interleaved dtypes puts each result back at its own place."""
    strategy = make_strategy(2, communication_options=CommunicationOptions(bytes_per_pack=32))
    n = 2 * WORKERS

    async def step() -> Any:
        g = replica_id()
        value = [np.full(k + 1, g * (k + 1), np.float32 if k % 2 else np.int64) for k in range(8)]
        return await replica_context().all_reduce("sum", value)

    total = sum(range(n))
    for got in each_replica(strategy, await strategy.run(step)):
        for k, leaf in enumerate(got):
            assert leaf.dtype == (np.float32 if k % 2 else np.int64)
            np.testing.assert_array_equal(leaf, np.full(k + 1, total * (k + 1)))


async def test_all_reduce_python_scalars(make_strategy: MakeStrategy) -> None:
    """Python numbers all_reduce to the global number (TF converts them to tensors)."""
    strategy = make_strategy(2)

    async def step() -> Any:
        ctx = replica_context()
        return (
            await ctx.all_reduce("sum", replica_id()),
            await ctx.all_reduce("mean", float(replica_id())),
            await ctx.all_reduce("max", 1.5),
        )

    n = 2 * WORKERS
    for s, m, mx in each_replica(strategy, await strategy.run(step)):
        assert s == sum(range(n))
        assert m == pytest.approx(np.mean(range(n)))
        assert mx == 1.5


async def test_all_reduce_complex(make_strategy: MakeStrategy) -> None:
    """complex128 SUM and MEAN across workers."""
    strategy = make_strategy(2)

    async def step() -> Any:
        g = replica_id()
        v = np.array([g + 1j * g, 1 - 2j], np.complex128)
        ctx = replica_context()
        return await ctx.all_reduce("sum", v), await ctx.all_reduce("mean", v)

    n = 2 * WORKERS
    every = [np.array([g + 1j * g, 1 - 2j]) for g in range(n)]
    for s, m in each_replica(strategy, await strategy.run(step)):
        np.testing.assert_allclose(s, np.sum(every, 0))
        np.testing.assert_allclose(m, np.mean(every, 0))


async def test_reduce_scatter_uneven_across_workers(make_strategy: MakeStrategy) -> None:
    """reduce_scatter of 7 rows over W*L replicas: array_split chunks by global id."""
    strategy = make_strategy(2)
    n = 2 * WORKERS

    async def step() -> Any:
        g = replica_id()
        return await replica_context().reduce_scatter("sum", np.arange(14.0).reshape(7, 2) * g)

    full = np.arange(14.0).reshape(7, 2) * sum(range(n))
    chunks = np.array_split(full, n)
    for g, got in zip(global_ids(2), each_replica(strategy, await strategy.run(step)), strict=True):
        np.testing.assert_array_equal(got, chunks[g])


@pytest.mark.timeout(60)
async def test_all_reduce_above_the_threaded_size(make_strategy: MakeStrategy) -> None:
    """A 40 MiB all_reduce (posted on a worker thread) gives NumPy's sum, twice in a row."""
    strategy = make_strategy(1)
    size = 40 * 2**20 // 8

    async def step(k: float) -> Any:
        return await replica_context().all_reduce("sum", np.full(size, replica_id() + k))

    for k in (1.0, 2.0):
        got = each_replica(strategy, await strategy.run(step, args=(k,)))[0]
        assert got.shape == (size,)
        assert got[0] == got[-1] == sum(range(WORKERS)) + WORKERS * k


async def test_gather_of_empty_on_every_replica(make_strategy: MakeStrategy) -> None:
    """strategy.gather where every replica holds zero rows: a (0, 3) result."""
    strategy = make_strategy(2)
    got = await strategy.gather(PerReplica([np.zeros((0, 3), np.float32)] * 2), axis=0)
    assert np.asarray(got).shape == (0, 3)
    assert np.asarray(got).dtype == np.float32


async def test_reduce_mean_axis_of_all_empty_is_nan(make_strategy: MakeStrategy) -> None:
    """MEAN along axis 0 where every replica holds zero rows: TF's 0/0, nan."""
    strategy = make_strategy(2)
    got = await strategy.reduce("mean", PerReplica([np.zeros((0, 2))] * 2), axis=0)
    assert np.asarray(got).shape == (2,)
    assert np.isnan(np.asarray(got)).all()


async def test_barrier_with_a_timeout_names_the_late_worker(make_strategy: MakeStrategy) -> None:
    """ctx.barrier(CommunicationOptions(timeout_seconds=...)) bounds the wait."""
    from aioreplica import ReplicaSyncError

    strategy = make_strategy(1)
    options = CommunicationOptions(timeout_seconds=0.5)

    async def step() -> None:
        if RANK == WORKERS - 1:
            await anyio.sleep(2.0)
        await replica_context().barrier(options)

    with anyio.fail_after(20), pytest.raises(ReplicaSyncError) as caught:
        await strategy.run(step)
    if RANK != WORKERS - 1:
        assert caught.value.workers == (WORKERS - 1,)
    allgather(None)


async def test_barrier_timeout_zero_overrides_the_sync_timeout(make_strategy: MakeStrategy) -> None:
    """Docs: ``timeout_seconds=0`` waits as long as it takes, past the strategy's
    sync_timeout too. A barrier whose peer is 1.5 s late then completes on both workers."""
    strategy = make_strategy(1, sync_timeout=0.5)
    options = CommunicationOptions(timeout_seconds=0)
    events: list[str] = []

    async def step() -> None:
        if RANK == WORKERS - 1:
            await anyio.sleep(1.5)
        await replica_context().barrier(options)
        events.append("passed")

    with anyio.fail_after(20):
        await strategy.run(step)
    assert events == ["passed"]
    allgather(None)


def on_read(aggregation: VariableAggregation, name: str, value: Any = 0.0) -> Variable:
    return Variable(
        value,
        synchronization=VariableSynchronization.ON_READ,
        aggregation=aggregation,
        name=name,
    )


async def test_sync_on_read_reads_of_every_aggregation(make_strategy: MakeStrategy) -> None:
    """TF's sync-on-read reads in cross-replica context: SUM the sum of every copy of every
    worker, MEAN their mean, ONLY_FIRST_REPLICA global replica 0's; read_var and
    strategy.reduce agree."""
    strategy = make_strategy(2)
    with strategy.scope():
        s = on_read(VariableAggregation.SUM, "s")
        m = on_read(VariableAggregation.MEAN, "m")
        f = on_read(VariableAggregation.ONLY_FIRST_REPLICA, "f")

    async def step() -> None:
        g = float(replica_id() + 1)
        await s.assign(g)
        await m.assign(g * 10)
        await f.assign(g * 100)

    await strategy.run(step)
    n = 2 * WORKERS
    ids = np.arange(1, n + 1, dtype=np.float64)
    assert float(s.numpy()) == ids.sum()
    assert float(m.numpy()) == pytest.approx((ids * 10).mean())
    assert float(f.numpy()) == 100.0
    assert float(np.asarray(strategy.extended.read_var(s))) == ids.sum()
    assert float(np.asarray(await strategy.reduce("sum", s))) == ids.sum()


@pytest.mark.parametrize("aggregation", ["sum", "mean"])
async def test_sync_on_read_cross_replica_assign_reads_back(
    make_strategy: MakeStrategy, aggregation: str
) -> None:
    """A cross-replica assign(x) of a sync-on-read variable reads back x, across workers."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = on_read(VariableAggregation(aggregation), "v")
    await v.assign(12.0)
    assert float(v.numpy()) == pytest.approx(12.0)
    await strategy.run(lambda: None)
    assert float(v.numpy()) == pytest.approx(12.0)


async def test_call_for_each_replica_inside_merge_is_global(make_strategy: MakeStrategy) -> None:
    """extended.call_for_each_replica from cross-replica context runs the step like run()."""
    strategy = make_strategy(2)

    async def step() -> Any:
        return await replica_context().all_reduce("sum", float(replica_id()))

    got = await strategy.extended.call_for_each_replica(step)
    for value in each_replica(strategy, got):
        assert value == sum(range(2 * WORKERS))


async def test_gather_raises_on_different_trailing_shapes_between_workers(
    make_strategy: MakeStrategy,
) -> None:
    """testGatherRaiseDiffShapeAtNonAxis across workers: a ValueError on every worker."""
    strategy = make_strategy(2)
    width = 3 if RANK == 0 else 4
    with pytest.raises(ValueError, match="different values"):
        await strategy.gather(PerReplica([np.ones((2, width))] * 2), axis=0)


async def test_reduce_nested_structure_with_axis(make_strategy: MakeStrategy) -> None:
    """strategy.reduce of a dict of per-replica values with axis=0 and mixed dtypes."""
    strategy = make_strategy(2)
    ids = global_ids(2)
    value = {
        "f": PerReplica([np.full((g + 1, 2), float(g), np.float32) for g in ids]),
        "i": PerReplica([np.full((g + 1,), g, np.int64) for g in ids]),
    }
    got = await strategy.reduce("sum", value, axis=0)
    n = 2 * WORKERS
    f = np.concatenate([np.full((g + 1, 2), float(g), np.float32) for g in range(n)])
    i = np.concatenate([np.full((g + 1,), g, np.int64) for g in range(n)])
    np.testing.assert_array_equal(np.asarray(got["f"]), f.sum(0))
    assert np.asarray(got["f"]).dtype == np.float32
    assert int(np.asarray(got["i"])) == int(i.sum())
    assert np.asarray(got["i"]).dtype == np.int64


async def test_a_late_local_replica_times_out_on_every_worker(make_strategy: MakeStrategy) -> None:
    """A collective whose late participant is a local replica of worker 0 (not a worker):
    timeout_seconds ends the step on both workers with ReplicaSyncError, no hang."""
    from aioreplica import ReplicaSyncError

    strategy = make_strategy(2)
    options = CommunicationOptions(timeout_seconds=0.5)

    async def step() -> Any:
        if replica_id() == 1:
            await anyio.sleep(2.0)
        return await replica_context().all_reduce("sum", np.ones(2), options)

    with anyio.fail_after(20), pytest.raises(ReplicaSyncError):
        await strategy.run(step)
    allgather(None)


async def test_reduce_max_of_integers_with_an_empty_worker(make_strategy: MakeStrategy) -> None:
    """reduce(MAX/MIN, axis=0) of int32 where the last worker's replicas hold no rows."""
    strategy = make_strategy(2)
    rows = 0 if RANK == WORKERS - 1 else 2
    mine = [np.full((rows, 2), g * 3 - 1, np.int32) for g in global_ids(2)]
    every = np.concatenate(
        [
            np.full((0 if w == WORKERS - 1 else 2, 2), g * 3 - 1, np.int32)
            for w in range(WORKERS)
            for g in global_ids(2, w)
        ]
    )
    got_max = await strategy.reduce("max", PerReplica(mine), axis=0)
    got_min = await strategy.reduce("min", PerReplica(mine), axis=0)
    np.testing.assert_array_equal(np.asarray(got_max), every.max(0))
    np.testing.assert_array_equal(np.asarray(got_min), every.min(0))
    assert np.asarray(got_max).dtype == np.int32


async def test_an_axis_out_of_range_on_one_worker_is_refused_everywhere(
    make_strategy: MakeStrategy,
) -> None:
    """axis=1 valid for worker 0's rank-2 values, out of range for worker 1's rank-1 values:
    both workers raise a ValueError (one its own, the other naming it), no hang."""
    strategy = make_strategy(2)
    shape = (2, 2) if RANK == 0 else (4,)
    with anyio.fail_after(20), pytest.raises(ValueError, match=r"axis 1|worker 1 refused"):
        await strategy.reduce("sum", PerReplica([np.ones(shape)] * 2), axis=1)
    await strategy.run(lambda: None)  # still in step


async def test_gather_along_a_negative_axis_uneven(make_strategy: MakeStrategy) -> None:
    strategy = make_strategy(2)
    mine = [np.full((2, g % 2 + 1), g, np.int8) for g in global_ids(2)]
    got = await strategy.gather(PerReplica(mine), axis=-1)
    expected = np.concatenate(
        [np.full((2, g % 2 + 1), g, np.int8) for g in range(2 * WORKERS)], axis=-1
    )
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert np.asarray(got).dtype == np.int8


async def test_broadcast_nested_mixed_dtypes_from_the_last_worker(
    make_strategy: MakeStrategy,
) -> None:
    strategy = make_strategy(2)
    source = 2 * WORKERS - 1

    async def step() -> Any:
        g = replica_id()
        value = {"a": np.full(3, g, np.float16), "b": (np.int64(g), np.array([g, -g], np.int8))}
        return await replica_context().broadcast(value, source)

    for got in each_replica(strategy, await strategy.run(step)):
        np.testing.assert_array_equal(got["a"], np.full(3, source, np.float16))
        assert got["a"].dtype == np.float16
        assert int(got["b"][0]) == source
        np.testing.assert_array_equal(got["b"][1], np.array([source, -source], np.int8))


async def test_all_gather_bool_and_float16(make_strategy: MakeStrategy) -> None:
    strategy = make_strategy(2)

    async def step() -> Any:
        g = replica_id()
        ctx = replica_context()
        return (
            await ctx.all_gather(np.array([g % 2 == 0]), 0),
            await ctx.all_gather(np.array([g / 4], np.float16), 0),
        )

    n = 2 * WORKERS
    for b, h in each_replica(strategy, await strategy.run(step)):
        np.testing.assert_array_equal(b, [g % 2 == 0 for g in range(n)])
        assert b.dtype == np.bool_
        np.testing.assert_array_equal(h, np.array([g / 4 for g in range(n)], np.float16))


@pytest.mark.parametrize("aggregation", ["only_first_replica", "mean"])
async def test_global_step_update(make_strategy: MakeStrategy, aggregation: str) -> None:
    """testGlobalStepUpdate: an int64 step counter with ONLY_FIRST_REPLICA (or MEAN)
    aggregation, assign_add(1) on every replica, counts one per step on every worker."""
    strategy = make_strategy(2)
    with strategy.scope():
        step_counter = Variable(
            np.int64(0), aggregation=VariableAggregation(aggregation), name="global_step"
        )

    async def step() -> None:
        await step_counter.assign_add(np.int64(1))

    for _ in range(3):
        await strategy.run(step)
    assert int(step_counter.numpy()) == 3
    assert step_counter.numpy().dtype == np.int64
    assert_same_on_every_worker(*step_counter.values)


async def test_all_reduce_of_variables_in_replica(make_strategy: MakeStrategy) -> None:
    """ReplicaCtxAllReduceTest with variables: a mirrored variable's value summed over
    every replica; a sync-on-read variable's local copy summed over every replica."""
    strategy = make_strategy(2)
    with strategy.scope():
        w = Variable(np.array([1.0, 2.0]) * (RANK + 1), name="w")
        r = on_read(VariableAggregation.SUM, "r")

    async def step() -> Any:
        await r.assign(float(replica_id()))
        ctx = replica_context()
        return await ctx.all_reduce("sum", w), await ctx.all_reduce("sum", r)

    n = 2 * WORKERS
    for gw, gr in each_replica(strategy, await strategy.run(step)):
        np.testing.assert_array_equal(np.asarray(gw), np.array([1.0, 2.0]) * n)
        assert float(np.asarray(gr)) == sum(range(n))


async def test_local_results_of_a_namedtuple(make_strategy: MakeStrategy) -> None:
    """testTupleOrNamedTuple: a namedtuple result gives one namedtuple per local replica."""
    from collections import namedtuple

    Pair = namedtuple("Pair", ["id", "none"])
    strategy = make_strategy(2)

    async def step() -> Any:
        return Pair(replica_id(), None)

    got = strategy.experimental_local_results(await strategy.run(step))
    assert got == (Pair(global_ids(2)[0], None), Pair(global_ids(2)[1], None))
    assert all(type(p) is Pair for p in got)


@pytest.mark.timeout(60)
async def test_continuous_results_held_across_steps_stay_intact(
    make_strategy: MakeStrategy,
) -> None:
    """Continuous run: results of every step, held (some only as views), stay as they were
    while later steps reduce into buffers of the same shape."""
    strategy = make_strategy(2)
    held: list[tuple[int, Any]] = []
    size = 300_000  # 2.4 MiB of float64

    async def step(k: int) -> Any:
        return await replica_context().all_reduce("sum", np.full(size, float(k + replica_id())))

    n = 2 * WORKERS
    for k in range(12):
        got = each_replica(strategy, await strategy.run(step, args=(k,)))[0]
        held.append((k, got if k % 2 else got[size // 2 :]))
        del got
    for k, value in held:
        assert float(value[0]) == float(value[-1]) == n * k + sum(range(n))


@pytest.mark.parametrize("where", ["all_reduce", "batch_reduce_to"])
async def test_per_call_packing_that_differs_between_workers(
    make_strategy: MakeStrategy, where: str
) -> None:
    """A call's CommunicationOptions(bytes_per_pack) that differs between workers: either the
    right sums on every worker, or the same ValueError on every worker; never wrong numbers
    or a hang."""
    strategy = make_strategy(2)
    options = CommunicationOptions(bytes_per_pack=16 if RANK == 0 else 0)
    n = 2 * WORKERS
    leaves = 6

    def values(g: int) -> list[Any]:
        return [np.full(k + 1, g + k, np.float32 if k % 3 else np.int32) for k in range(leaves)]

    expected = [sum(np.asarray(values(g)[k], np.float64) for g in range(n)) for k in range(leaves)]
    outcome: Any
    try:
        with anyio.fail_after(20):
            if where == "all_reduce":

                async def step() -> Any:
                    return await replica_context().all_reduce("sum", values(replica_id()), options)

                got = each_replica(strategy, await strategy.run(step))[0]
            else:
                per = [PerReplica([values(g)[k] for g in global_ids(2)]) for k in range(leaves)]
                got = await strategy.extended.batch_reduce_to(
                    "sum", [(p, "cpu:0") for p in per], options
                )
        for k in range(leaves):
            np.testing.assert_array_equal(np.asarray(got[k], np.float64), expected[k])
        outcome = "ok"
    except ValueError:
        outcome = "ValueError"
    assert allgather(outcome) == [outcome] * WORKERS


@pytest.mark.parametrize(
    ("aggregation", "dtype"),
    [
        ("mean", np.int64),
        ("none", np.float64),
        ("only_first_replica", np.float64),
        ("mean", np.float64),
    ],
)
async def test_a_replica_write_that_differs_only_between_workers(
    make_strategy: MakeStrategy, aggregation: str, dtype: Any
) -> None:
    """Every replica of a worker writes the same value, but worker 1's differs from worker
    0's. Whatever the aggregation, the copies must stay identical across workers: MEAN of
    floats is the global mean, ONLY_FIRST_REPLICA takes global replica 0's (the chief's),
    and NONE / integer MEAN (one value every replica must write) raise on every worker."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(np.zeros((), dtype), aggregation=VariableAggregation(aggregation), name="d")
    await strategy.run(lambda: None)

    async def step() -> None:
        await v.assign(dtype(5 + RANK))

    try:
        with anyio.fail_after(20):
            await strategy.run(step)
        outcome = "ok"
    except ValueError:
        outcome = "ValueError"
    assert allgather(outcome) == [outcome] * WORKERS
    if outcome == "ok":
        assert_same_on_every_worker(*v.values)
        expected = {"mean": 5 + (WORKERS - 1) / 2, "only_first_replica": 5.0}[aggregation]
        assert float(v.numpy()) == expected
    else:
        assert aggregation == "none" or dtype is np.int64


@pytest.mark.parametrize("collective", ["barrier", "all_reduce"])
async def test_a_worker_failing_before_a_collective_fails_the_waiting_one(
    make_strategy: MakeStrategy, collective: str
) -> None:
    """A worker whose replica raises before the collective: the other worker, waiting in
    it, raises ReplicaSyncError naming it within seconds (no sync_timeout set)."""
    import time

    from aioreplica import ReplicaSyncError

    strategy = make_strategy(1)

    async def step() -> None:
        ctx = replica_context()
        if RANK == WORKERS - 1:
            await anyio.sleep(0.2)
            raise KeyError("boom")
        if collective == "barrier":
            await ctx.barrier()
        else:
            await ctx.all_reduce("sum", np.ones(2))

    started = time.monotonic()
    expected = KeyError if RANK == WORKERS - 1 else ReplicaSyncError
    with anyio.fail_after(15), pytest.raises(expected) as caught:
        await strategy.run(step)
    if RANK != WORKERS - 1:
        assert caught.value.workers == (WORKERS - 1,)  # type: ignore[attr-defined]
        assert time.monotonic() - started < 5
    allgather(None)


async def test_cancel_in_a_barrier_on_one_worker_fails_the_other(
    make_strategy: MakeStrategy,
) -> None:
    """testAbortCommunication with a barrier: worker 1 cancels its run while in the barrier
    (worker 0 is late); worker 0 then raises ReplicaSyncError naming it, not a hang."""
    from aioreplica import ReplicaSyncError

    strategy = make_strategy(1)

    async def step() -> None:
        if RANK == 0:
            await anyio.sleep(1.0)
        await replica_context().barrier()

    if RANK == 1:
        with anyio.move_on_after(0.3) as scope:
            await strategy.run(step)
        assert scope.cancelled_caught
    else:
        with anyio.fail_after(15), pytest.raises(ReplicaSyncError) as caught:
            await strategy.run(step)
        assert caught.value.workers == (1,)
    allgather(None)


def test_input_context_per_replica_batch_size(make_strategy: MakeStrategy) -> None:
    """InputContext.get_per_replica_batch_size uses the global replica count; a global
    batch not divisible by it is a ValueError, as in TF."""
    from aioreplica import InputContext

    strategy = make_strategy(2)
    n = strategy.num_replicas_in_sync
    context = InputContext(
        num_input_pipelines=WORKERS, input_pipeline_id=RANK, num_replicas_in_sync=n
    )
    assert context.get_per_replica_batch_size(8 * n) == 8
    with pytest.raises(ValueError, match="not divisible"):
        context.get_per_replica_batch_size(8 * n + 1)


async def test_reduction_to_every_kind_of_destination(make_strategy: MakeStrategy) -> None:
    """CollectiveAllReduceTest._test_reduction: reduce_to and batch_reduce_to of [g] per
    replica, MEAN and SUM, to a Mirrored destination, a device string and a variable, in
    every pair; every destination copy holds the global result."""
    strategy = make_strategy(2)
    ids = global_ids(2)
    n = 2 * WORKERS
    per_replica = PerReplica([np.array([float(g)]) for g in ids])
    per_replica_2 = PerReplica([np.array([g + 1.0]) for g in ids])
    mean = (n - 1) / 2
    with strategy.scope():
        var = Variable(np.array([1.0]), name="dest")
    destinations = [Mirrored([np.array([1.0])] * 2), "cpu:1", var, ["cpu:0", "cpu:1"]]

    def copies(result: Any) -> list[float]:
        values = result.values if isinstance(result, Mirrored) else (result,)
        return [float(np.asarray(v)[0]) for v in values]

    for d in destinations:
        assert set(copies(await strategy.extended.reduce_to("mean", per_replica, d))) == {mean}
        assert set(copies(await strategy.extended.reduce_to("sum", per_replica_2, d))) == {
            (mean + 1) * n
        }
    for d1 in destinations:
        for d2 in destinations:
            a, b = await strategy.extended.batch_reduce_to(
                "sum", [(per_replica, d1), (per_replica_2, d2)]
            )
            assert set(copies(a)) == {mean * n}
            assert set(copies(b)) == {(mean + 1) * n}


@pytest.mark.parametrize("batch", [False, True])
async def test_reduce_distributed_variable_mean(make_strategy: MakeStrategy, batch: bool) -> None:
    """testReduceDistributedVariable: MEAN of a mirrored variable to itself is its value on
    every copy (each worker's initial value differs: the chief's)."""
    strategy = make_strategy(2)
    with strategy.scope():
        v = Variable(1.0 + RANK, name="rv")
    if batch:
        (result,) = await strategy.extended.batch_reduce_to("mean", [(v, v)])
    else:
        result = await strategy.extended.reduce_to("mean", v, v)
    values = result.values if isinstance(result, Mirrored) else (result,)
    assert [float(x) for x in values] == [1.0] * len(values)
    assert len(values) == 2


async def test_a_reduce_scatter_timeout_names_reduce_scatter(make_strategy: MakeStrategy) -> None:
    """The timeout of a reduce_scatter waiting for a late worker names the call the user
    made (as all_gather's and broadcast's do), not the all_reduce beneath it."""
    from aioreplica import ReplicaSyncError

    strategy = make_strategy(1)
    options = CommunicationOptions(timeout_seconds=0.5)

    async def step() -> Any:
        if RANK == WORKERS - 1:
            await anyio.sleep(1.5)
        return await replica_context().reduce_scatter("sum", np.ones(4), 0, options)

    with anyio.fail_after(20), pytest.raises(ReplicaSyncError) as caught:
        await strategy.run(step)
    waiting = allgather(str(caught.value))[0]  # worker 0's: the one that waited
    assert "in reduce_scatter" in waiting, waiting


@pytest.mark.timeout(90)
async def test_large_and_small_collectives_alternate_in_one_step(
    make_strategy: MakeStrategy,
) -> None:
    """Collectives above the threaded size (posted on a worker thread) and small ones (polled
    on the loop) alternate in one step and in a gather of uneven rows; each pairs with its
    own across workers."""
    strategy = make_strategy(2)
    big = 5 * 2**20  # float64: 40 MiB
    n = 2 * WORKERS

    async def step() -> Any:
        ctx = replica_context()
        g = replica_id()
        a = await ctx.all_reduce("sum", np.full(big, float(g)))
        b = await ctx.all_reduce("sum", np.full(3, float(g + 1)))
        c = await ctx.all_gather(np.full((big // 2 if g == 0 else 1,), float(g)), 0)
        d = await ctx.all_reduce("max", np.full(2, float(g)))
        return float(a[0]), float(a[-1]), b, c.shape, float(c[-1]), d

    total = float(sum(range(n)))
    for a0, a1, b, c_shape, c_last, d in each_replica(strategy, await strategy.run(step)):
        assert (a0, a1) == (total, total)
        np.testing.assert_array_equal(b, np.full(3, total + n))
        assert c_shape == (big // 2 + n - 1,)
        assert c_last == n - 1
        np.testing.assert_array_equal(d, np.full(2, n - 1.0))


async def test_reduce_and_gather_of_a_shared_all_reduce_result(make_strategy: MakeStrategy) -> None:
    """strategy_common_test: strategy.reduce(SUM) and gather of what run() returned when each
    replica returned its all_reduce result (one shared host array here, a tensor per replica
    in TF): the total counted once per replica of every worker."""
    strategy = make_strategy(2)
    n = 2 * WORKERS

    async def step() -> Any:
        return await replica_context().all_reduce("sum", np.array([float(replica_id())]))

    result = await strategy.run(step)
    total = float(sum(range(n)))
    assert np.asarray(await strategy.reduce("sum", result)).tolist() == [total * n]
    assert np.asarray(await strategy.reduce("mean", result)).tolist() == [total]
    gathered = np.asarray(await strategy.gather(result, axis=0))
    np.testing.assert_array_equal(gathered, np.full(n, total))

    constant = await strategy.run(lambda: 5.0)
    assert float(np.asarray(await strategy.reduce("sum", constant))) == 5.0 * n


async def test_all_gather_axis_out_of_range_on_one_worker(make_strategy: MakeStrategy) -> None:
    """all_gather along axis 1 of rank-2 values on worker 0, rank-1 on worker 1: a
    ValueError on every worker (its own, or one naming the other), no hang; still in step."""
    strategy = make_strategy(1)
    shape = (2, 2) if RANK == 0 else (4,)

    async def step() -> Any:
        return await replica_context().all_gather(np.ones(shape), 1)

    with anyio.fail_after(20), pytest.raises(ValueError, match=r"axis 1|worker 1 refused"):
        await strategy.run(step)
    await strategy.run(lambda: None)
