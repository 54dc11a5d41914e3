"""TF's names and calls that a migrating program meets: enum values in TF's spelling,
``CommunicationOptions.merge``, ``extended.update_non_slot``, the loss scaling functions of
``tf.nn``, and the refusal to mix two strategies that print alike."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioreplica
from aioreplica import (
    CommunicationImplementation,
    CommunicationOptions,
    MirroredStrategy,
    PerReplica,
    ReduceOp,
    VariableAggregation,
    compute_average_loss,
    scale_regularization_loss,
)

pytestmark = pytest.mark.anyio


class TestEnumsInTFSpelling:
    def test_constructors_take_any_case(self) -> None:
        """``ReduceOp("SUM")`` is ``ReduceOp.SUM``, as TF's, and so for every such enum."""
        members = [
            ReduceOp("SUM"),
            ReduceOp("Mean"),
            ReduceOp("max"),
            CommunicationImplementation("NCCL"),
            VariableAggregation("ONLY_FIRST_REPLICA"),
        ]
        assert members == [
            ReduceOp.SUM,
            ReduceOp.MEAN,
            ReduceOp.MAX,
            CommunicationImplementation.NCCL,
            VariableAggregation.ONLY_FIRST_REPLICA,
        ]

    @pytest.mark.parametrize("value", ["total", 3, None])
    def test_unknown_value_lists_the_valid_ones(self, value: Any) -> None:
        """A value that names no member raises parse's message, not enum's bare one."""
        with pytest.raises(ValueError, match=r"^unknown reduce op ") as info:
            ReduceOp(value)
        assert str(info.value) == (
            f"unknown reduce op {value!r}: use a ReduceOp or one of 'sum', 'mean', 'max', "
            "'min', 'prod'"
        )


class TestCommunicationOptionsMerge:
    def test_merge_is_override(self) -> None:
        """``merge`` (TF's name) takes the other options' non-default fields."""
        base = CommunicationOptions(bytes_per_pack=1024, timeout_seconds=5.0)
        other = CommunicationOptions(timeout_seconds=2.0, implementation="NCCL")
        assert base.merge(other) == base.override(other) == CommunicationOptions(1024, 2.0, "nccl")
        assert base.merge(None) is base

    def test_merge_refuses_what_is_no_options(self) -> None:
        """Anything but options or None is a TypeError naming it."""
        with pytest.raises(TypeError, match=r"^options must be a CommunicationOptions or None"):
            CommunicationOptions().merge({"bytes_per_pack": 1})  # type: ignore[arg-type]


class TestUpdateNonSlot:
    async def test_fn_runs_once_in_cross_replica_context(self) -> None:
        """fn runs once, in this strategy's cross-replica context, with the arguments given;
        its result comes back as fn returned it, or as local results with group=False."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        calls = []

        def fn(x: float, *, y: float) -> float:
            calls.append((aioreplica.get_cross_replica_context() is strategy, x, y))
            return x + y

        devices = strategy.extended.non_slot_devices([])
        grouped = await strategy.extended.update_non_slot(devices, fn, (1.0,), {"y": 2.0})
        local = await strategy.extended.update_non_slot(devices, fn, [3.0], {"y": 4.0}, False)
        assert (calls, grouped, local) == ([(True, 1.0, 2.0), (True, 3.0, 4.0)], 3.0, (7.0, 7.0))

    async def test_ungrouped_structure_holds_local_results_at_its_leaves(self) -> None:
        """With group=False each leaf of fn's result becomes its local results, as TF's
        update_regroup maps them over the structure: a dict stays a dict."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])

        def fn() -> dict[str, Any]:
            return {"step": 3, "ids": PerReplica([1, 2]), "pair": (4.0, 5.0)}

        devices = strategy.extended.non_slot_devices([])
        local = await strategy.extended.update_non_slot(devices, fn, group=False)
        assert local == {"step": (3, 3), "ids": (1, 2), "pair": ((4.0, 4.0), (5.0, 5.0))}

    async def test_async_fn_updates_a_variable_once(self) -> None:
        """An async fn may write a non-slot variable: every copy changes, once."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            steps = aioreplica.Variable(np.int64(0))

        async def count() -> None:
            await steps.assign_add(np.int64(1))

        await strategy.extended.update_non_slot(strategy.extended.non_slot_devices([steps]), count)
        assert [copy.tolist() for copy in steps.values] == [1, 1]

    async def test_refused_inside_a_replica(self) -> None:
        """In replica context it raises RuntimeError naming the replica; fn never runs."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        calls: list[int] = []

        async def step() -> None:
            await strategy.extended.update_non_slot(("cpu:0",), lambda: calls.append(1))

        with pytest.raises(RuntimeError) as info:
            await strategy.run(step)
        assert re.match(
            r"strategy\.extended\.update_non_slot\(\) was called inside replica [01]; it runs in "
            r"cross-replica context: call it outside run\(\), or in a merge_fn",
            str(info.value),
        ), info.value
        assert calls == []

    @pytest.mark.parametrize(
        ("colocate_with", "fn", "group", "error", "message"),
        [
            (
                ("cpu:5",),
                len,
                True,
                ValueError,
                "strategy.extended.update_non_slot(): colocate_with names the devices "
                "non_slot_devices() returns: destination 'cpu:5' is not one of this strategy's "
                "devices ['cpu:0', 'cpu:1']",
            ),
            (
                ("cpu:0",),
                "fn",
                True,
                TypeError,
                "strategy.extended.update_non_slot(): fn must be callable, got str 'fn'",
            ),
            (
                ("cpu:0",),
                len,
                "yes",
                TypeError,
                "strategy.extended.update_non_slot(): group must be True or False, got 'yes'",
            ),
        ],
        ids=["another device", "fn not callable", "group not a bool"],
    )
    async def test_bad_arguments_are_refused(
        self, colocate_with: Any, fn: Any, group: Any, error: type[Exception], message: str
    ) -> None:
        """Arguments that cannot be right are refused before fn runs."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with pytest.raises(error) as info:
            await strategy.extended.update_non_slot(colocate_with, fn, ([1],), group=group)
        assert str(info.value) == message


def migration_row(tf_name: str) -> str:
    """The row of the migration page whose TensorFlow cell names ``tf_name``."""
    lines = (Path(__file__).parents[1] / "docs" / "migration.md").read_text().splitlines()
    return next(
        line for line in lines if line.startswith("| ") and f"`{tf_name}" in line.split(" | ")[0]
    )


class TestMigrationNotes:
    @pytest.mark.parametrize(
        ("tf_name", "replacement"),
        [
            ("tf.distribute.experimental.CollectiveHints", "aioreplica.CommunicationOptions"),
            (
                "tf.distribute.experimental.CollectiveCommunication",
                "aioreplica.CommunicationImplementation",
            ),
        ],
    )
    def test_deprecated_aliases_name_their_replacement(
        self, tf_name: str, replacement: str
    ) -> None:
        """TF's deprecated aliases are not offered; the migration page names what replaces
        them, which is."""
        assert not hasattr(aioreplica, tf_name.rsplit(".", 1)[1])
        assert hasattr(aioreplica, replacement.removeprefix("aioreplica."))
        assert f"`{replacement}" in migration_row(tf_name)

    def test_in_place_change_of_a_batch_raises_the_error_the_page_quotes(self) -> None:
        """``x /= 2`` on a batch of ``batched`` raises NumPy's read-only error, which the
        migration page quotes with what to write instead."""
        x = next(iter(aioreplica.batched(np.arange(4.0), 2)))
        with pytest.raises(ValueError, match="read-only") as info:
            x /= 2
        row = migration_row("tf.data.Dataset.from_tensor_slices")
        assert f"`ValueError: {info.value}`" in row
        assert "`x = x / 2`" in row


class TestMixedStrategies:
    async def test_two_strategies_that_print_alike_are_told_apart(self) -> None:
        """A call of one strategy in the scope of another over the same devices says that
        the other is another object, instead of printing the same strategy twice."""
        first, second = MirroredStrategy(["cpu:0", "cpu:1"]), MirroredStrategy(["cpu:0", "cpu:1"])
        with second.scope(), pytest.raises(RuntimeError) as info:
            await first.reduce("sum", PerReplica([1.0, 2.0]))
        assert str(info.value) == (
            "strategy.reduce() of MirroredStrategy(devices=['cpu:0', 'cpu:1']) was called in the "
            "scope of another MirroredStrategy object with the same devices; strategies cannot "
            "be mixed: finish with one before using the other"
        )

    async def test_a_scope_entered_in_another_alike_tells_them_apart(self) -> None:
        """Entering one strategy's scope inside another's over the same devices, and writing a
        variable of one in the other's scope, name the other as another object."""
        first, second = MirroredStrategy(["cpu:0", "cpu:1"]), MirroredStrategy(["cpu:0", "cpu:1"])
        with first.scope():
            v = aioreplica.Variable(1.0, name="v")
        messages = []
        with second.scope():
            with pytest.raises(RuntimeError) as entered:
                first.scope().__enter__()
            messages.append(str(entered.value))
            with pytest.raises(RuntimeError) as written:
                await v.assign(2.0)
            messages.append(str(written.value))
        shown = "MirroredStrategy(devices=['cpu:0', 'cpu:1'])"
        other = "another MirroredStrategy object with the same devices"
        assert messages == [
            f"cannot enter the scope of {shown} while {other} is current; strategies cannot be "
            "mixed: finish with one before using the other",
            f"assign() of variable 'v', created in the scope of {shown}, was called in the scope "
            f'of {other}; strategies cannot be mixed (TF: "Mixing different tf.distribute.'
            "Strategy objects\"): write it outside that scope, or in its own strategy's",
        ]
        assert v.numpy() == 1.0


class TestComputeAverageLoss:
    def test_sum_over_the_global_batch_size(self) -> None:
        """The losses' sum divided by global_batch_size, in their dtype; 0 for a global batch
        of 0, as TF's div_no_nan."""
        losses = np.array([1.0, 2.0, 3.0], dtype=np.float32)
        results = [
            compute_average_loss(losses, global_batch_size=12),
            compute_average_loss(losses, global_batch_size=np.int64(3)),
            compute_average_loss(losses, global_batch_size=0),
        ]
        assert results == [0.5, 2.0, 0.0]
        assert [type(result) for result in results] == [np.float32] * 3

    def test_integer_losses_divide_to_float64_as_tfs(self) -> None:
        """Integer losses are taken, as TF's div_no_nan takes them (TF's own test cases):
        the quotient is a float64, 0 for a global batch of 0."""
        results = [
            compute_average_loss([1, 2, 3, 4, 5], global_batch_size=10),
            compute_average_loss([1, 2, 3, 4, 5], global_batch_size=0),
            compute_average_loss(np.array([3, 4], dtype=np.int8), sample_weight=[1, 0]),
        ]
        assert results == [1.5, 0.0, 1.5]
        assert [type(result) for result in results] == [np.float64] * 3

    async def test_default_global_batch_counts_every_replica(self) -> None:
        """In a replica the default is the replica's batch times num_replicas_in_sync;
        outside any strategy there is one replica."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])

        async def step(losses: Any) -> Any:
            return compute_average_loss(losses)

        losses = PerReplica([np.array([1.0, 2.0]), np.array([3.0, 6.0])])
        result = await strategy.run(step, args=(losses,))
        assert strategy.experimental_local_results(result) == (0.75, 2.25)
        assert compute_average_loss(np.array([1.0, 2.0])) == 1.5

    @pytest.mark.parametrize(
        ("losses", "weights", "expected"),
        [
            ([1.0, 3.0], [2.0, 0.0], 1.0),
            ([1.0, 3.0], 0.5, 1.0),
            ([1.0, 3.0], [[2.0], [0.0]], 1.0),
            ([[1.0, 2.0], [3.0, 4.0]], [1.0, 0.0], 1.5),
        ],
        ids=["one per example", "one for all", "trailing 1 dropped", "one per row"],
    )
    def test_sample_weight_broadcasts_as_tfs(
        self, losses: Any, weights: Any, expected: float
    ) -> None:
        """Weights multiply the losses, shaped as TF shapes them: a trailing dimension of 1
        dropped, or one added so that a weight per example weights its row."""
        assert compute_average_loss(np.array(losses), weights) == expected

    async def test_cross_replica_context_needs_a_global_batch_size(self) -> None:
        """In a strategy's scope there is no replica batch: without global_batch_size it is a
        RuntimeError, as in TF, whatever the losses hold; with one it works."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            errors = []
            for losses in (np.array([1.0]), [2, 3], ["a"]):
                with pytest.raises(RuntimeError) as info:
                    compute_average_loss(losses)
                errors.append(str(info.value))
            given = compute_average_loss(np.array([1.0, 3.0]), global_batch_size=4)
        expected = (
            "compute_average_loss() was called without global_batch_size in the cross-replica "
            "context of MirroredStrategy(devices=['cpu:0', 'cpu:1']), where there is no replica "
            "batch to count: call it in the step function, or pass global_batch_size"
        )
        assert errors == [expected] * 3
        assert given == 1.0

    @pytest.mark.parametrize(
        ("losses", "kwargs", "error", "message"),
        [
            (np.float64(1.0), {}, ValueError, "per_example_loss must have at least one dimension"),
            (
                np.array([True, False]),
                {},
                TypeError,
                "per_example_loss must hold numbers, got bool array([ True, False])",
            ),
            (
                np.array([1.0, 2.0]),
                {"sample_weight": np.ones(3)},
                ValueError,
                "sample_weight of shape (3,) does not broadcast to per_example_loss of shape (2,)",
            ),
            (
                np.ones((2, 3)),
                {"sample_weight": np.ones(3)},
                ValueError,
                "sample_weight of shape (3,) does not broadcast to per_example_loss of shape "
                "(2, 3)",
            ),
            (
                np.array([1.0]),
                {"global_batch_size": [10]},
                ValueError,
                "global_batch_size must be scalar, got list [10] of shape (1,)",
            ),
            (
                np.array([1.0]),
                {"global_batch_size": 2.0},
                TypeError,
                "global_batch_size must be an int >= 0, got float 2.0",
            ),
            (
                np.array([1.0]),
                {"global_batch_size": -1},
                ValueError,
                "global_batch_size must be an int >= 0, got -1",
            ),
        ],
        ids=[
            "a scalar",
            "bools",
            "weights of another shape",
            "a weight per column",
            "a size in a list",
            "a float size",
            "a negative",
        ],
    )
    def test_bad_input_is_refused(
        self, losses: Any, kwargs: Any, error: type[Exception], message: str
    ) -> None:
        """TF's checks, each naming what is wrong."""
        with pytest.raises(error) as info:
            compute_average_loss(losses, **kwargs)
        assert str(info.value).startswith(f"compute_average_loss(): {message}"), info.value


class TestScaleRegularizationLoss:
    async def test_divides_the_sum_by_the_replicas(self) -> None:
        """In a replica the sum is divided by num_replicas_in_sync; outside any strategy by 1."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])

        async def step() -> Any:
            return scale_regularization_loss(np.array([1.0, 3.0]))

        result = await strategy.run(step)
        assert strategy.experimental_local_results(result) == (2.0, 2.0)
        assert scale_regularization_loss([0.5, 1.5]) == 2.0

    def test_refused_in_cross_replica_context(self) -> None:
        """In a strategy's scope it raises RuntimeError, as TF's does."""
        strategy = MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope(), pytest.raises(RuntimeError) as info:
            scale_regularization_loss(1.0)
        assert str(info.value) == (
            "scale_regularization_loss() was called in the cross-replica context of "
            "MirroredStrategy(devices=['cpu:0', 'cpu:1']); it scales a replica's term by the "
            "number of replicas: call it in the step function"
        )

    @pytest.mark.parametrize(
        ("loss", "shown"),
        [
            (None, "NoneType None (dtype object)"),
            (True, "bool True (dtype bool)"),
            ("x", "str 'x'"),
        ],
        ids=["None", "a bool", "a string"],
    )
    def test_what_is_not_a_number_is_refused(self, loss: Any, shown: str) -> None:
        """``None``, a bool or a string is a TypeError naming it, not a result (or an
        AttributeError from inside)."""
        with pytest.raises(TypeError) as info:
            scale_regularization_loss(loss)
        assert str(info.value).startswith(
            f"scale_regularization_loss(): regularization_loss must be a number or numbers, "
            f"got {shown}"
        ), info.value
