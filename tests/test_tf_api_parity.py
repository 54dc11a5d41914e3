"""Parity with TF's public ``tf.distribute`` API as a migrating program calls it: the context
functions in each context, the default strategy and replica context, ``InputContext`` and
``InputOptions``, ``ReduceOp.from_variable_aggregation``, device properties, and the keyword
names of TF's signatures (a TF program calling by keyword must keep working)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aioreplica
from aioreplica import (
    InputContext,
    InputOptions,
    InputReplicationMode,
    MirroredStrategy,
    PerReplica,
    ReduceOp,
    VariableAggregation,
)
from aioreplica.testing import replica_context

pytestmark = pytest.mark.anyio


def _context_state() -> tuple[Any, ...]:
    return (
        aioreplica.in_cross_replica_context(),
        aioreplica.has_strategy(),
        aioreplica.get_strategy(),
        aioreplica.get_cross_replica_context(),
        aioreplica.get_replica_context(),
    )


class TestContextFunctions:
    def test_outside_any_strategy(self) -> None:
        """TF's default mode: not cross-replica, no strategy, cross-replica context None and a
        default replica context (replica 0 of 1, of the default strategy)."""
        in_cross, has, strategy, cross, replica = _context_state()
        assert (in_cross, has, cross) == (False, False, None)
        assert replica is not None
        assert (replica.replica_id_in_sync_group, replica.num_replicas_in_sync) == (0, 1)
        assert replica.strategy is strategy is aioreplica.get_strategy()

    def test_inside_scope(self) -> None:
        """In ``scope()``: cross-replica, the strategy current, no replica context."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            state = _context_state()
        assert state == (True, True, strategy, strategy, None)

    async def test_in_replica_and_merge_fn(self) -> None:
        """In a replica: replica context, strategy current, no cross-replica context; in
        ``merge_fn``: the reverse, as in TF."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        events: list[tuple[Any, ...]] = []

        def merge_fn(s: Any) -> None:
            events.append(("merge", s is strategy, *_context_state()))

        async def step() -> None:
            in_cross, has, current, cross, ctx = _context_state()
            events.append(
                ("replica", ctx.replica_id_in_sync_group, in_cross, has, current is strategy, cross)
            )
            await ctx.merge_call(merge_fn)

        await strategy.run(step)
        # (trio starts the replicas in an order of its own: sorted)
        assert sorted(events[:2]) == [
            ("replica", 0, False, True, True, None),
            ("replica", 1, False, True, True, None),
        ]
        assert events[2:] == [("merge", True, True, True, strategy, strategy, None)]

    def test_scope_of_another_strategy_inside_scope_is_runtime_error(self) -> None:
        """TF: "Mixing different tf.distribute.Strategy objects" is a RuntimeError."""
        first = MirroredStrategy(["cpu:0", "cpu:1"])
        second = MirroredStrategy(["cpu:0"])
        with first.scope():
            with pytest.raises(RuntimeError), second.scope():
                pass
            assert aioreplica.get_strategy() is first


class TestDefaultStrategy:
    def test_default_strategy_has_one_replica(self) -> None:
        """TF's default strategy: one replica in sync, one worker and parameter device."""
        default = aioreplica.get_strategy()
        assert default.num_replicas_in_sync == 1
        assert len(default.extended.worker_devices) == 1
        assert default.extended.parameter_devices == default.extended.worker_devices

    async def test_default_replica_context_merge_call_and_all_reduce(self) -> None:
        """TF's default replica context: merge_fn gets the default strategy, and an
        all-reduce over its one replica gives the value back."""
        ctx = aioreplica.get_replica_context()
        assert ctx is not None  # outside any strategy: the default one's replica context
        merged = await ctx.merge_call(lambda s, x: (s is aioreplica.get_strategy(), x), args=(3,))
        reduced = await ctx.all_reduce(ReduceOp.SUM, np.array([1.0, 2.0]))
        assert merged == (True, 3)
        np.testing.assert_array_equal(reduced, [1.0, 2.0])

    async def test_default_strategy_run_and_reduce(self) -> None:
        """``get_strategy().run`` calls fn once; its ``reduce`` of a value is that value."""
        default = aioreplica.get_strategy()
        assert await default.run(lambda x: x + 1, args=(1,)) == 2
        assert float(await default.reduce("sum", np.array(2.0))) == 2.0


class TestMirroredStrategyProperties:
    def test_devices_refused_as_tf_refuses_them(self) -> None:
        """TF: "Must specify at least one device" and "No duplicates allowed" (ValueError)."""
        with pytest.raises(ValueError, match="at least one device"):
            MirroredStrategy([])
        with pytest.raises(ValueError, match="appears twice"):
            MirroredStrategy(["cpu:0", "cpu:0"])

    def test_extended_properties(self) -> None:
        """MirroredExtended: worker and parameter devices are the strategy's devices; one
        process (not between-graph); it checkpoints, summarises and initialises; no cluster
        resolver, no static shapes required."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        ext = strategy.extended
        assert ext.worker_devices == ext.parameter_devices == ("cpu:0", "cpu:1")
        assert (
            ext.experimental_between_graph,
            ext.should_checkpoint,
            ext.should_save_summary,
            ext.experimental_should_init,
            ext.experimental_require_static_shapes,
            strategy.cluster_resolver,
        ) == (False, True, True, True, False, None)

    async def test_replica_context_id_and_devices(self) -> None:
        """``replica_id_in_sync_group`` is an int; ``devices`` is a 1-tuple of the replica's
        device, as TF's mirrored replica context gives."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])

        def step() -> tuple[type, int, tuple[str, ...], int]:
            ctx = replica_context()
            rid = ctx.replica_id_in_sync_group
            return type(rid), rid, tuple(ctx.devices), ctx.num_replicas_in_sync

        results = strategy.experimental_local_results(await strategy.run(step))
        assert results == ((int, 0, ("cpu:0",), 2), (int, 1, ("cpu:1",), 2))

    async def test_strategy_reduce_in_replica_is_runtime_error(self) -> None:
        """TF: "Method requires being in cross-replica context" (RuntimeError)."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        errors: list[type] = []

        async def step() -> None:
            try:
                await strategy.reduce("sum", 1.0)
            except RuntimeError as exc:
                errors.append(type(exc))

        await strategy.run(step)
        assert errors == [RuntimeError, RuntimeError]

    async def test_values_from_function_context(self) -> None:
        """value_fn gets each replica's id and the count, as TF's ValueContext."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        seen: list[tuple[int, int]] = []

        def value_fn(ctx: aioreplica.ValueContext) -> int:
            seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
            return ctx.replica_id_in_sync_group * 10

        value = strategy.experimental_distribute_values_from_function(value_fn)
        assert seen == [(0, 2), (1, 2)]
        assert isinstance(value, PerReplica)
        assert strategy.experimental_local_results(value) == (0, 10)


class TestInputContextAndOptions:
    def test_input_context_defaults(self) -> None:
        """TF's ``InputContext()``: one pipeline, id 0, one replica."""
        ctx = InputContext()
        assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (
            1,
            0,
            1,
        )

    def test_per_replica_batch_size(self) -> None:
        """Divisible sizes divide; others are TF's ValueError ("is not divisible by")."""
        ctx = InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=2)
        assert ctx.get_per_replica_batch_size(8) == 4
        assert ctx.get_per_replica_batch_size(0) == 0
        with pytest.raises(ValueError, match="not divisible"):
            ctx.get_per_replica_batch_size(7)

    def test_input_options_defaults(self) -> None:
        """TF's defaults: fetch to device None (on), PER_WORKER, not on device, buffer 1."""
        opts = InputOptions()
        assert (
            opts.experimental_fetch_to_device,
            opts.experimental_replication_mode,
            opts.experimental_place_dataset_on_device,
            opts.experimental_per_replica_buffer_size,
        ) == (None, InputReplicationMode.PER_WORKER, False, 1)


class TestReduceOpFromVariableAggregation:
    def test_sum_and_mean_convert(self) -> None:
        assert ReduceOp.from_variable_aggregation(VariableAggregation.SUM) is ReduceOp.SUM
        assert ReduceOp.from_variable_aggregation(VariableAggregation.MEAN) is ReduceOp.MEAN

    @pytest.mark.parametrize(
        "aggregation", [VariableAggregation.NONE, VariableAggregation.ONLY_FIRST_REPLICA]
    )
    def test_others_are_value_error(self, aggregation: VariableAggregation) -> None:
        """TF: "Could not convert from `tf.VariableAggregation` ..." (ValueError)."""
        with pytest.raises(ValueError, match="cannot convert"):
            ReduceOp.from_variable_aggregation(aggregation)


class TestTFKeywordNames:
    """TF programs call these by keyword; the keyword names are TF's."""

    async def test_all_reduce_takes_reduce_op_keyword(self) -> None:
        """TF: ``ReplicaContext.all_reduce(self, reduce_op, value, options=None)``."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])

        async def step() -> Any:
            ctx = replica_context()
            return await ctx.all_reduce(reduce_op=ReduceOp.SUM, value=np.array(1.0))

        results = strategy.experimental_local_results(await strategy.run(step))
        assert [float(r) for r in results] == [2.0, 2.0]

    async def test_run_takes_options_keyword(self) -> None:
        """TF: ``Strategy.run(self, fn, args=(), kwargs=None, options=None)``; ``options=None``
        (no ``tf.distribute.RunOptions``) changes nothing."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        result = await strategy.run(lambda x: x * 2, args=(3,), kwargs=None, options=None)
        assert strategy.experimental_local_results(result) == (6, 6)

    @pytest.mark.parametrize("positional", [False, True])
    async def test_run_refuses_other_options(self, positional: bool) -> None:
        """``RunOptions`` (how TF compiles a step) have no counterpart: anything but ``None``
        is a ``TypeError`` saying so, before any replica runs; the strategy goes on."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        ran: list[int] = []

        def step() -> int:
            ran.append(1)
            return 1

        options: Any = object()
        call = (
            strategy.run(step, (), None, options)
            if positional
            else strategy.run(step, options=options)
        )
        with pytest.raises(
            TypeError, match=r"^run\(\) takes options=None only, got object <object object at"
        ):
            await call
        assert ran == []
        assert strategy.experimental_local_results(await strategy.run(step)) == (1, 1)

    async def test_broadcast_to_takes_tensor_keyword(self) -> None:
        """TF: ``StrategyExtended.broadcast_to(self, tensor, destinations)``."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        result = await strategy.extended.broadcast_to(
            tensor=np.ones(2), destinations=strategy.extended.worker_devices
        )
        for copy in strategy.experimental_local_results(result):
            np.testing.assert_array_equal(copy, [1.0, 1.0])

    async def test_distributed_dataset_reduce_takes_reduce_func_keyword(self) -> None:
        """TF: ``DistributedDataset.reduce(self, initial_state, reduce_func)``."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        dataset = strategy.experimental_distribute_dataset([np.arange(4.0), np.arange(4.0)])
        count = await dataset.reduce(initial_state=0, reduce_func=lambda state, _: state + 1)
        assert count == 2
