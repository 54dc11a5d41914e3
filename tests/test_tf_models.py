"""TF's single-process model, metric, step and checkpoint tests (custom_training_loop_models_test,
metrics_v1_test, step_fn_test, checkpointing_test, reduce_util, numpy_dataset_test) rewritten
for ``aioreplica.MirroredStrategy``: the numbers a ported program expects, computed by hand in
NumPy. Every async test runs on every loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import aioreplica
from aioreplica import (
    Checkpoint,
    MirroredStrategy,
    PerReplica,
    ReduceOp,
    Variable,
    VariableAggregation,
    get_replica_context,
    in_cross_replica_context,
)
from aioreplica.optimizers import SGD, Adam, RMSprop
from aioreplica.testing import host_devices, replica_id

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio

ON_READ_SUM: dict[str, Any] = {"synchronization": "on_read", "aggregation": "sum"}
ON_READ_MEAN: dict[str, Any] = {"synchronization": "on_read", "aggregation": "mean"}

#: A small regression problem: 12 rows, 2 features, an intercept.
X = np.arange(24, dtype=float).reshape(12, 2) / 10
Y = X @ np.array([1.0, -2.0]) + 0.5


def scoped(strategy: MirroredStrategy | None, initial: Any, **kwargs: Any) -> Variable:
    """A variable made in ``strategy``'s scope (a plain one for ``None``)."""
    if strategy is None:
        return Variable(initial, **kwargs)
    with strategy.scope():
        return Variable(initial, **kwargs)


def copies(v: Variable) -> list[Any]:
    """Every copy of ``v`` as nested lists."""
    return [np.asarray(c).tolist() for c in v.values]


def split(a: np.ndarray, n: int) -> PerReplica[Any]:
    """``a`` cut into ``n`` consecutive shards, one per replica."""
    return PerReplica(np.array_split(a, n))


# --- custom_training_loop_models_test: state updated in the step -----------------------------


class TestModelsWithStateUpdatedInTheStep:
    async def test_batch_norm_moving_statistics_average_the_replicas(self) -> None:
        """A batch-norm layer's moving mean and variance (aggregation MEAN, not trainable) take
        the mean of every replica's update, two steps in a row."""
        strategy = MirroredStrategy(host_devices(2))
        moving_mean = scoped(strategy, np.zeros(2), aggregation="mean", trainable=False)
        moving_var = scoped(strategy, np.ones(2), aggregation="mean", trainable=False)
        shards = [np.array([[1.0, 2.0], [3.0, 5.0]]), np.array([[5.0, 6.0], [7.0, 9.0]])]

        async def step(x: np.ndarray) -> np.ndarray:
            await moving_mean.assign(moving_mean.value() * 0.9 + 0.1 * x.mean(0))
            await moving_var.assign(moving_var * 0.9 + 0.1 * x.var(0))
            mean: np.ndarray = x.mean(0)
            return mean

        for _ in range(2):
            await strategy.run(step, args=(PerReplica(shards),))

        mean, var = np.zeros(2), np.ones(2)
        for _ in range(2):
            mean = np.mean([mean * 0.9 + 0.1 * s.mean(0) for s in shards], axis=0)
            var = np.mean([var * 0.9 + 0.1 * s.var(0) for s in shards], axis=0)
        np.testing.assert_allclose(moving_mean.numpy(), mean)
        np.testing.assert_allclose(moving_var.numpy(), var)
        assert copies(moving_mean)[0] == copies(moving_mean)[1]

    async def test_rnn_like_loop_reads_the_state_it_wrote(self) -> None:
        """An RNN-like loop: each time step adds every replica's contribution to a SUM state
        and reads it back; every replica sees the running total after each step."""
        strategy = MirroredStrategy(host_devices(3))
        state = scoped(strategy, 0.0, aggregation="sum")
        weight = scoped(strategy, 2.0)

        async def step() -> list[float]:
            seen = []
            for t in range(4):
                await state.assign_add(np.float64(replica_id() + t) * weight)
                seen.append(float(state.value()))
            return seen

        out = await strategy.run(step)
        expected, total = [], 0.0
        for t in range(4):
            total += sum(2.0 * (r + t) for r in range(3))
            expected.append(total)
        assert [list(s.values) for s in out] == [[e] * 3 for e in expected]
        assert float(state.numpy()) == expected[-1]

    async def test_global_step_only_first_replica_counts_once(self) -> None:
        """A step counter with aggregation ONLY_FIRST_REPLICA goes up by one per step, not by
        one per replica."""
        strategy = MirroredStrategy(host_devices(3))
        global_step = scoped(strategy, np.int64(0), aggregation="only_first_replica")

        async def step() -> None:
            await global_step.assign_add(np.int64(1))

        for _ in range(4):
            await strategy.run(step)
        assert copies(global_step) == [4, 4, 4]

    async def test_sgd_momentum_over_several_runs_matches_one_big_batch(self) -> None:
        """``apply_gradients`` inside ``run``, several runs in a row: the same numbers as one
        replica on the whole batch (the loss scaled by the global batch)."""
        strategy = MirroredStrategy(host_devices(2))
        w = scoped(strategy, np.array([1.0, -1.0]))
        b = scoped(strategy, 0.5)
        optimizer = SGD(0.1, momentum=0.9)
        x, y = X[:4], Y[:4]

        async def step(x: np.ndarray, y: np.ndarray) -> float:
            err = x @ w.value() + b.value() - y
            await optimizer.apply_gradients([(2 * x.T @ err / 4, w), (2 * err.sum() / 4, b)])
            return float((err**2).sum() / 4)

        for _ in range(3):
            await strategy.run(step, args=(split(x, 2), split(y, 2)))

        ew, eb, vw, vb = np.array([1.0, -1.0]), 0.5, np.zeros(2), 0.0
        for _ in range(3):
            err = x @ ew + eb - y
            vw = 0.9 * vw - 0.1 * (2 * x.T @ err / 4)
            vb = 0.9 * vb - 0.1 * (2 * err.sum() / 4)
            ew, eb = ew + vw, eb + vb
        np.testing.assert_allclose(w.numpy(), ew)
        np.testing.assert_allclose(b.numpy(), eb)
        assert optimizer.iterations == 3

    async def test_rmsprop_sums_the_replicas_gradients(self) -> None:
        """Keras' RMSprop (rho 0.9, epsilon 1e-7) on the summed gradient."""
        strategy = MirroredStrategy(host_devices(2))
        w = scoped(strategy, np.array([1.0, -1.0]))
        optimizer = RMSprop(0.01)
        grads = [np.array([0.5, 1.0]), np.array([1.5, -3.0])]

        async def step(g: np.ndarray) -> None:
            await optimizer.apply_gradients([(g, w)])

        for _ in range(2):
            await strategy.run(step, args=(PerReplica(grads),))
        expected, ms, g = np.array([1.0, -1.0]), np.zeros(2), grads[0] + grads[1]
        for _ in range(2):
            ms = 0.9 * ms + 0.1 * g * g
            expected = expected - 0.01 * g / (np.sqrt(ms) + 1e-7)
        np.testing.assert_allclose(w.numpy(), expected)

    async def test_variables_built_lazily_in_the_first_run(self) -> None:
        """A Keras layer builds its kernel on its first call, inside the step: the replicas
        share it and train it together."""
        strategy = MirroredStrategy(host_devices(2))
        optimizer = SGD(0.5)
        layer: dict[str, Variable] = {}

        async def step(x: np.ndarray) -> None:
            if "kernel" not in layer:
                layer["kernel"] = Variable(np.ones(x.shape[1]), name="kernel")
            await optimizer.apply_gradients([(x.sum(0), layer["kernel"])])

        shards = PerReplica([np.ones((2, 3)), np.full((2, 3), 2.0)])
        await strategy.run(step, args=(shards,))
        await strategy.run(step, args=(shards,))
        assert isinstance(layer["kernel"], aioreplica.MirroredVariable)
        assert copies(layer["kernel"]) == [[1.0 - 2 * 0.5 * 6.0] * 3] * 2

    async def test_merge_fn_runs_in_cross_replica_context_and_reduces(self) -> None:
        """``merge_fn`` runs once, in cross-replica context, with no replica context, and may
        reduce its per-replica argument."""
        strategy = MirroredStrategy(host_devices(2))
        seen: list[Any] = []

        async def merge(strategy: MirroredStrategy, x: Any) -> Any:
            seen.append((in_cross_replica_context(), get_replica_context()))
            return await strategy.reduce("sum", x)

        async def step() -> Any:
            ctx = get_replica_context()
            assert ctx is not None
            return await ctx.merge_call(merge, args=(np.float64(replica_id() + 1),))

        assert float(await strategy.run(step)) == 3.0
        assert seen == [(True, None)]

    async def test_run_inside_merge_fn_runs_the_replicas_again(self) -> None:
        """A second ``run`` inside ``merge_fn`` (multiple runs per step): its writes land
        before the outer replicas resume."""
        strategy = MirroredStrategy(host_devices(2))
        counter = scoped(strategy, 0.0, aggregation="sum")

        async def inner() -> None:
            await counter.assign_add(np.float64(1.0))

        async def merge(strategy: MirroredStrategy) -> None:
            await strategy.run(inner)

        async def outer() -> float:
            ctx = get_replica_context()
            assert ctx is not None
            await ctx.merge_call(merge)
            return float(counter.value())

        out = await strategy.run(outer)
        assert list(out.values) == [2.0, 2.0]


# --- metrics_v1_test: metric variables as sync-on-read ---------------------------------------


class TestMetricsAsSyncOnReadVariables:
    async def test_mean_metric_over_uneven_batches(self) -> None:
        """A ``Mean`` metric (total and count, SUM sync-on-read) over uneven per-replica
        batches, two runs: the mean of every element."""
        strategy = MirroredStrategy(host_devices(3))
        total = scoped(strategy, 0.0, **ON_READ_SUM)
        count = scoped(strategy, 0.0, **ON_READ_SUM)
        batches = [
            PerReplica([np.array([1.0, 2.0]), np.array([3.0]), np.array([4.0, 5.0, 6.0])]),
            PerReplica([np.array([7.0]), np.array([]), np.array([8.0, 9.0])]),
        ]

        async def update(values: np.ndarray) -> float:
            await total.assign_add(values.sum())
            await count.assign_add(float(len(values)))
            return float(total.value())  # this replica's own copy

        first = await strategy.run(update, args=(batches[0],))
        assert list(first.values) == [3.0, 3.0, 15.0]
        await strategy.run(update, args=(batches[1],))
        assert float(total.numpy() / count.numpy()) == np.mean(np.arange(1.0, 10.0))
        assert [float(v) for v in strategy.experimental_local_results(total)] == [10.0, 3.0, 32.0]

    async def test_accuracy_metric_counts_in_int64(self) -> None:
        """An accuracy metric's counts in int64 SUM sync-on-read variables."""
        strategy = MirroredStrategy(host_devices(2))
        correct = scoped(strategy, np.int64(0), **ON_READ_SUM)
        seen = scoped(strategy, np.int64(0), **ON_READ_SUM)
        labels = PerReplica([np.array([1, 0, 1]), np.array([0, 0])])
        predictions = PerReplica([np.array([1, 1, 1]), np.array([0, 1])])

        async def update(labels: np.ndarray, predictions: np.ndarray) -> None:
            await correct.assign_add(np.int64((labels == predictions).sum()))
            await seen.assign_add(np.int64(len(labels)))

        await strategy.run(update, args=(labels, predictions))
        assert (int(correct.numpy()), int(seen.numpy())) == (3, 5)
        assert correct.numpy().dtype == np.int64

    async def test_reset_in_cross_replica_context(self) -> None:
        """``reset_states`` assigns 0 in cross-replica context; a later assign of a value
        makes the cross-replica read that value (each copy its share, as TF's SUM)."""
        strategy = MirroredStrategy(host_devices(3))
        total = scoped(strategy, 0.0, **ON_READ_SUM)

        async def update() -> None:
            await total.assign_add(float(replica_id() + 1))

        await strategy.run(update)
        await strategy.run(update)
        assert float(total.numpy()) == 12.0
        await total.assign(0.0)
        assert copies(total) == [0.0, 0.0, 0.0]
        await strategy.run(update)
        assert float(total.numpy()) == 6.0
        await total.assign(6.0)
        assert (float(total.numpy()), copies(total)) == (6.0, [2.0, 2.0, 2.0])

    async def test_sum_metric_refuses_assign_add_in_cross_replica_context(self) -> None:
        """TF: SyncOnReadVariable SUM refuses ``assign_add`` in cross-replica context; MEAN adds
        to every copy."""
        strategy = MirroredStrategy(host_devices(3))
        total = scoped(strategy, 1.0, **ON_READ_SUM)
        mean = scoped(strategy, 1.0, **ON_READ_MEAN)
        with pytest.raises(ValueError, match="cross-replica"):
            await total.assign_add(2.0)
        assert float(total.numpy()) == 3.0
        await mean.assign_add(2.0)
        assert (float(mean.numpy()), copies(mean)) == (3.0, [3.0, 3.0, 3.0])

    async def test_strategy_reduce_of_a_metric_reduces_its_copies(self) -> None:
        strategy = MirroredStrategy(host_devices(3))
        total = scoped(strategy, 0.0, **ON_READ_SUM)

        async def update() -> float:
            await total.assign_add(float(replica_id() + 1))
            return float(total.value())

        out = await strategy.run(update)
        assert list(out.values) == [1.0, 2.0, 3.0]
        assert float(await strategy.reduce("sum", total)) == 6.0
        assert float(await strategy.reduce("mean", total)) == 2.0
        assert float(await strategy.reduce("max", total)) == 3.0

    async def test_metric_variables_made_inside_the_step(self) -> None:
        """tf.compat.v1.metrics make their variables inside the step: the replicas share
        them, and the cross-replica read sums every replica's update."""
        strategy = MirroredStrategy(host_devices(3))
        made: list[Variable] = []

        async def step(x: np.ndarray) -> None:
            total = Variable(0.0, name="total", **ON_READ_SUM)
            made.append(total)
            await total.assign_add(x.sum())

        x = PerReplica([np.array([1.0, 2.0]), np.array([3.0]), np.array([4.0, 5.0, 6.0])])
        await strategy.run(step, args=(x,))
        assert all(v is made[0] for v in made)
        assert isinstance(made[0], aioreplica.SyncOnReadVariable)
        assert float(made[0].numpy()) == 21.0

    async def test_float32_metric_keeps_its_dtype(self) -> None:
        strategy = MirroredStrategy(host_devices(3))
        total = scoped(strategy, np.float32(0), **ON_READ_SUM)

        async def update() -> None:
            await total.assign_add(np.float64(replica_id()) + 0.5)

        await strategy.run(update)
        assert total.numpy().dtype == np.float32
        assert float(total.numpy()) == 4.5


# --- checkpointing: save in one strategy, restore into another -------------------------------


async def saved_metric(tmp_path: Path, aggregation: str, replicas: int = 3) -> str:
    """A checkpoint of a sync-on-read variable whose copies were 1, 2, ... (``replicas``)."""
    strategy = MirroredStrategy(host_devices(replicas))
    v = scoped(strategy, 0.0, synchronization="on_read", aggregation=aggregation)

    async def step() -> None:
        await v.assign(float(replica_id() + 1))

    await strategy.run(step)
    return await Checkpoint(v=v).save(tmp_path / f"{aggregation}.npz")


class TestCheckpointAcrossReplicaCounts:
    @pytest.mark.parametrize(
        ("aggregation", "value"), [("sum", 6.0), ("mean", 2.0), ("only_first_replica", 1.0)]
    )
    @pytest.mark.parametrize("replicas", [1, 2, 4])
    async def test_sync_on_read_restores_its_aggregate(
        self, tmp_path: Path, aggregation: str, value: float, replicas: int
    ) -> None:
        """TF saves a sync-on-read variable's aggregate and restores it so that reading gives
        it back (a SUM variable's copies get value / replicas)."""
        path = await saved_metric(tmp_path, aggregation)
        strategy = MirroredStrategy(host_devices(replicas))
        v = scoped(strategy, 0.0, synchronization="on_read", aggregation=aggregation)
        await Checkpoint(v=v).restore(path)
        assert float(v.numpy()) == value
        if aggregation == "sum":
            assert copies(v) == [value / replicas] * replicas

    async def test_sum_metric_into_a_plain_variable_and_back(self, tmp_path: Path) -> None:
        path = await saved_metric(tmp_path, "sum")
        plain = Variable(0.0)
        await Checkpoint(v=plain).restore(path)
        assert float(plain.numpy()) == 6.0
        back = await Checkpoint(v=plain).save(tmp_path / "plain.npz")
        strategy = MirroredStrategy(host_devices(4))
        v = scoped(strategy, 0.0, **ON_READ_SUM)
        await Checkpoint(v=v).restore(back)
        assert (float(v.numpy()), copies(v)) == (6.0, [1.5] * 4)

    async def test_int_sum_metric_splits_without_losing_counts(self, tmp_path: Path) -> None:
        """An integer count restored into a replica count that does not divide it still sums
        to the count."""
        strategy = MirroredStrategy(host_devices(3))
        v = scoped(strategy, np.int64(0), **ON_READ_SUM)

        async def step() -> None:
            await v.assign_add(np.int64(replica_id() + 1))

        await strategy.run(step)
        path = await Checkpoint(v=v).save(tmp_path / "count.npz")
        for replicas in (2, 4):
            other = MirroredStrategy(host_devices(replicas))
            w = scoped(other, np.int64(0), **ON_READ_SUM)
            await Checkpoint(v=w).restore(path)
            assert int(w.numpy()) == 6
            assert sum(copies(w)) == 6
            assert w.numpy().dtype == np.int64

    async def test_sum_metric_into_a_mirrored_variable_and_back(self, tmp_path: Path) -> None:
        path = await saved_metric(tmp_path, "sum")
        strategy = MirroredStrategy(host_devices(2))
        mirrored = scoped(strategy, 0.0)
        await Checkpoint(v=mirrored).restore(path)
        assert copies(mirrored) == [6.0, 6.0]
        again = await Checkpoint(v=mirrored).save(tmp_path / "mirrored.npz")
        metric = scoped(strategy, 0.0, **ON_READ_SUM)
        await Checkpoint(v=metric).restore(again)
        assert (float(metric.numpy()), copies(metric)) == (6.0, [3.0, 3.0])

    async def test_save_inside_merge_fn_snapshots_the_metric(self, tmp_path: Path) -> None:
        strategy = MirroredStrategy(host_devices(2))
        total = scoped(strategy, 0.0, **ON_READ_SUM)
        checkpoint = Checkpoint(v=total)

        async def merge(strategy: MirroredStrategy) -> str:
            return await checkpoint.save(tmp_path / "in_merge.npz")

        async def step() -> None:
            await total.assign_add(float(replica_id() + 1))
            ctx = get_replica_context()
            assert ctx is not None
            await ctx.merge_call(merge)
            await total.assign_add(100.0)

        await strategy.run(step)
        restored = scoped(strategy, 0.0, **ON_READ_SUM)
        await Checkpoint(v=restored).restore(tmp_path / "in_merge.npz")
        assert float(restored.numpy()) == 3.0

    @pytest.mark.parametrize("replicas", [None, 1, 4])
    async def test_adam_training_resumes_on_another_replica_count(
        self, tmp_path: Path, replicas: int | None
    ) -> None:
        """Two steps on 2 replicas, saved; the third on another layout (or none): the same
        weights, bias and step count as three steps on one."""

        def model(strategy: MirroredStrategy | None) -> tuple[Variable, Variable]:
            return scoped(strategy, np.zeros(2)), scoped(strategy, 0.0)

        async def train(
            strategy: MirroredStrategy | None, w: Variable, b: Variable, opt: Adam, batches: Any
        ) -> None:
            async def step(x: np.ndarray, y: np.ndarray) -> None:
                err = x @ w.value() + b.value() - y
                await opt.apply_gradients([(2 * x.T @ err / 4, w), (2 * err.sum() / 4, b)])

            for x, y in batches:
                if strategy is None:
                    await step(x, y)
                else:
                    n = strategy.num_replicas_in_sync
                    await strategy.run(step, args=(split(x, n), split(y, n)))

        batches = [(X[i : i + 4], Y[i : i + 4]) for i in range(0, 12, 4)]
        w0, b0 = model(None)
        opt0 = Adam(0.1)
        await train(None, w0, b0, opt0, batches)

        two = MirroredStrategy(host_devices(2))
        w, b = model(two)
        opt = Adam(0.1)
        await train(two, w, b, opt, batches[:2])
        path = await Checkpoint(w=w, b=b, opt=opt).save(tmp_path / "adam.npz")

        other = None if replicas is None else MirroredStrategy(host_devices(replicas))
        w2, b2 = model(other)
        opt2 = Adam(0.1)
        await Checkpoint(w=w2, b=b2, opt=opt2).restore(path)
        await train(other, w2, b2, opt2, batches[2:])
        np.testing.assert_allclose(w2.numpy(), w0.numpy())
        np.testing.assert_allclose(b2.numpy(), b0.numpy())
        assert opt2.iterations == 3

    async def test_iterator_resumes_on_another_replica_count(self, tmp_path: Path) -> None:
        rows = np.arange(14)

        def flat(strategy: MirroredStrategy, element: Any) -> list[int]:
            return [int(r) for c in strategy.experimental_local_results(element) for r in c]

        two = MirroredStrategy(host_devices(2))
        iterator = aiter(two.distribute_dataset(aioreplica.batched(rows, 4, shuffle=True, seed=1)))
        await anext(iterator)
        path = await Checkpoint(data=iterator).save(tmp_path / "data.npz")
        rest = [flat(two, e) async for e in iterator]

        three = MirroredStrategy(host_devices(3))
        resumed = aiter(three.distribute_dataset(aioreplica.batched(rows, 4, shuffle=True, seed=1)))
        await Checkpoint(data=resumed).restore(path)
        assert [flat(three, e) async for e in resumed] == rest


# --- step_fn_test, reduce_util, numpy_dataset_test -------------------------------------------


class TestStepsReduceOpsAndNumpyInput:
    async def test_run_steps_on_iterator_minimises_the_loss(self) -> None:
        """TF's StandardSingleLossStep: ``experimental_run_steps_on_iterator`` with a loss
        recorded per step, the same weights and last loss as a plain loop."""
        strategy = MirroredStrategy(host_devices(2))
        w = scoped(strategy, np.zeros(2))
        optimizer = SGD(0.05)

        async def replica(x: np.ndarray, y: np.ndarray) -> float:
            err = x @ w.value() - y
            await optimizer.apply_gradients([(2 * x.T @ err / 4, w)])
            return float((err**2).sum() / 4)

        async def fn(context: aioreplica.MultiStepContext, inputs: Any) -> None:
            losses = await strategy.run(replica, args=inputs)
            await context.set_last_step_output("loss", losses, ReduceOp.SUM)

        iterator = aiter(strategy.distribute_dataset(aioreplica.batched((X, Y), 4)))
        context = await strategy.extended.experimental_run_steps_on_iterator(fn, iterator, 3)

        expected, loss = np.zeros(2), 0.0
        for i in range(0, 12, 4):
            err = X[i : i + 4] @ expected - Y[i : i + 4]
            loss = (err**2).sum() / 4
            expected = expected - 0.05 * 2 * X[i : i + 4].T @ err / 4
        np.testing.assert_allclose(w.numpy(), expected)
        np.testing.assert_allclose(float(context.last_step_outputs["loss"]), loss)

    async def test_run_steps_with_metrics(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        w = scoped(strategy, np.zeros(2))
        total = scoped(strategy, 0.0, **ON_READ_SUM)
        count = scoped(strategy, 0.0, **ON_READ_SUM)
        optimizer = SGD(0.05)

        async def step(batch: Any) -> None:
            x, y = batch
            err = x @ w.value() - y
            await total.assign_add((err**2).sum())
            await count.assign_add(float(len(x)))
            await optimizer.apply_gradients([(2 * x.T @ err / 4, w)])

        iterator = aiter(strategy.distribute_dataset(aioreplica.batched((X, Y), 4)))
        await strategy.run_steps(step, iterator, 3)
        expected, squared = np.zeros(2), 0.0
        for i in range(0, 12, 4):
            err = X[i : i + 4] @ expected - Y[i : i + 4]
            squared += (err**2).sum()
            expected = expected - 0.05 * 2 * X[i : i + 4].T @ err / 4
        np.testing.assert_allclose(w.numpy(), expected)
        np.testing.assert_allclose(float(total.numpy() / count.numpy()), squared / 12)

    def test_reduce_op_from_variable_aggregation(self) -> None:
        assert ReduceOp.from_variable_aggregation(VariableAggregation.SUM) is ReduceOp.SUM
        assert ReduceOp.from_variable_aggregation(VariableAggregation.MEAN) is ReduceOp.MEAN
        for aggregation in (VariableAggregation.NONE, VariableAggregation.ONLY_FIRST_REPLICA):
            with pytest.raises(ValueError, match="aggregation"):
                ReduceOp.from_variable_aggregation(aggregation)
        assert ReduceOp("SUM") is ReduceOp.SUM
        assert ReduceOp("MEAN") is ReduceOp.MEAN

    async def test_numpy_input_of_dicts_splits_per_replica(self) -> None:
        """numpy_dataset_test: NumPy arrays in a dict become batches split over replicas."""
        strategy = MirroredStrategy(host_devices(2))
        data = {"a": np.arange(8), "b": np.arange(16.0).reshape(8, 2)}
        seen = [
            [
                {k: np.asarray(v).tolist() for k, v in shard.items()}
                for shard in strategy.experimental_local_results(element)
            ]
            async for element in strategy.distribute_dataset(aioreplica.batched(data, 4))
        ]
        assert seen == [
            [
                {"a": [0, 1], "b": [[0.0, 1.0], [2.0, 3.0]]},
                {"a": [2, 3], "b": [[4.0, 5.0], [6.0, 7.0]]},
            ],
            [
                {"a": [4, 5], "b": [[8.0, 9.0], [10.0, 11.0]]},
                {"a": [6, 7], "b": [[12.0, 13.0], [14.0, 15.0]]},
            ],
        ]


class TestMetricReductionsAndNesting:
    async def test_vector_metric_reduced_along_an_axis(self) -> None:
        """A vector SUM sync-on-read metric reduced along axis 0: over every element of every
        copy, as TF's reduce with axis."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, np.zeros(2), **ON_READ_SUM)

        async def step() -> None:
            await v.assign(np.array([1.0, 2.0]) * (replica_id() + 1))

        await strategy.run(step)
        assert float(await strategy.reduce("mean", v, axis=0)) == 2.25
        assert float(await strategy.reduce("sum", v, axis=0)) == 9.0
        assert np.asarray(await strategy.gather(v, axis=0)).tolist() == [1.0, 2.0, 2.0, 4.0]
        assert v.numpy().tolist() == [3.0, 6.0]

    async def test_merge_call_inside_merge_fn_is_a_clear_error(self) -> None:
        """TF requires a replica context for ``merge_call``; inside ``merge_fn`` there is none."""
        strategy = MirroredStrategy(host_devices(2))
        contexts: list[Any] = []

        def inner(strategy: MirroredStrategy, x: Any) -> Any:
            return x

        async def outer(strategy: MirroredStrategy, x: Any) -> Any:
            return await contexts[0].merge_call(inner, args=(x,))

        async def step() -> Any:
            ctx = get_replica_context()
            contexts.append(ctx)
            assert ctx is not None
            return await ctx.merge_call(outer, args=(np.float64(replica_id()),))

        with pytest.raises(RuntimeError, match="merge functions cannot nest"):
            await strategy.run(step)
