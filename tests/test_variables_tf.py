"""Variables where TF users expect TF's behaviour: what a SUM mirrored variable sums when
every replica passes one object, which variables made inside a run agree, writes that mix
strategies, and TF's constructor arguments. Every async test runs on every loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

from aioreplica import MirroredStrategy, Variable, get_replica_context
from aioreplica.testing import host_devices, replica_context, replica_id

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

pytestmark = pytest.mark.anyio

#: One NumPy zero that every replica passes: the same object everywhere.
SHARED_ZERO = np.float64(0.0)


def scoped(strategy: MirroredStrategy, initial: Any, **kwargs: Any) -> Variable:
    """A variable made in ``strategy``'s scope."""
    with strategy.scope():
        return Variable(initial, **kwargs)


def copies(v: Variable) -> list[Any]:
    """Every copy of ``v`` as nested lists, on the host."""
    return [np.asarray(c.get() if hasattr(c, "get") else c).tolist() for c in v.values]


class TestSumOfOneObjectPerReplica:
    """A SUM mirrored variable written from replicas sums one value per replica; the very
    same object from every replica is one value (refused, as TF refuses it) unless it stands
    for one value per replica, as TF's regroup and reduction take it."""

    @pytest.mark.parametrize("replicas", [2, 3])
    async def test_a_sync_on_read_variable_sums_each_replicas_copy(self, replicas: int) -> None:
        """TF's regroup keeps the variable and its reduction sums the replicas' own copies,
        as the MEAN path already averages them."""
        strategy = MirroredStrategy(host_devices(replicas))
        local = scoped(strategy, 0.0, synchronization="on_read", aggregation="sum")
        total = scoped(strategy, 10.0, aggregation="sum")
        mean = scoped(strategy, 0.0, aggregation="mean")

        async def step() -> None:
            await local.assign(float(replica_id() + 1))
            await total.assign_add(local)
            await mean.assign(local)

        await strategy.run(step)
        summed = float(sum(range(1, replicas + 1)))
        assert copies(total) == [10.0 + summed] * replicas
        assert copies(mean) == [summed / replicas] * replicas

    async def test_a_mirrored_variable_sums_each_replicas_copy(self) -> None:
        """A mirrored variable's copies are equal, so the sum counts its value once per
        replica, as TF sums the per-replica values of the regrouped variable."""
        strategy = MirroredStrategy(host_devices(2))
        source = scoped(strategy, np.array([1.0, 2.0]))
        total = scoped(strategy, np.zeros(2), aggregation="sum")
        await strategy.run(lambda: total.assign(source))
        assert copies(total) == [[2.0, 4.0]] * 2

    @pytest.mark.parametrize("replicas", [2, 4])
    async def test_a_host_collectives_shared_result_counts_once_per_replica(
        self, replicas: int
    ) -> None:
        """A host all_reduce hands every replica one read-only array; on GPUs each replica
        gets its own, which is summed: the host sums the shared one as many times."""
        strategy = MirroredStrategy(host_devices(replicas))
        total = scoped(strategy, 0.0, aggregation="sum")
        weights = scoped(strategy, np.array([0.5, 1.5]))
        grads = scoped(strategy, np.zeros(2), aggregation="sum")
        shared: list[bool] = []

        async def step() -> None:
            ctx = get_replica_context()
            assert ctx is not None
            g = await ctx.all_reduce("sum", np.float64(replica_id()))
            shared.append(not g.flags.writeable)
            await total.assign_add(g)
            await grads.assign_add(weights.value())  # a read of the host copy they share

        await strategy.run(step)
        assert shared == [True] * replicas
        assert copies(total) == [float(replicas * sum(range(replicas)))] * replicas
        assert copies(grads) == [[0.5 * replicas, 1.5 * replicas]] * replicas

    async def test_host_and_simulated_gpus_agree(self, cp: Any) -> None:
        """The same step gives the same sum on host replicas (one shared result) and on GPU
        replicas (a result each)."""
        results = []
        for devices in (host_devices(2), ["gpu:0", "gpu:1"]):
            strategy = MirroredStrategy(devices)
            total = scoped(strategy, 1.0, aggregation="sum")

            async def step(total: Variable = total) -> None:
                ctx = replica_context()
                x = ctx.device.asarray(np.float64(replica_id() + 2))
                await total.assign_add(await ctx.all_reduce("sum", x))

            await strategy.run(step)
            results.append(copies(total))
        assert results == [[11.0, 11.0], [11.0, 11.0]]

    @pytest.mark.parametrize(
        ("label", "write"),
        [
            ("assign(0.0)", lambda v: v.assign(0.0)),
            ("assign(0)", lambda v: v.assign(0)),
            ("assign_add(0)", lambda v: v.assign_add(0)),
            ("assign_sub(np.float64(0))", lambda v: v.assign_sub(SHARED_ZERO)),
        ],
    )
    async def test_a_plain_zero_is_accepted(
        self, label: str, write: Callable[[Variable], Awaitable[Variable]]
    ) -> None:
        """TF's reduce_non_distributed_value reduces a plain zero to zero, so assign(0.0)
        resets a SUM variable in replica context and adding zero leaves it as it is."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, 5.0, aggregation="sum")
        await strategy.run(lambda: write(v))
        expected = 0.0 if label.startswith("assign(") else 5.0
        assert copies(v) == [expected, expected]

    @pytest.mark.parametrize(
        "shared",
        [
            pytest.param(3, id="small int"),
            pytest.param(np.float64(2.0), id="numpy scalar"),
            pytest.param(np.array([1.0, 2.0]), id="writeable array"),
            pytest.param(1.5, id="float"),
        ],
    )
    async def test_one_object_is_still_refused(self, shared: Any) -> None:
        """A writeable array or a nonzero number that every replica shares is one value: TF
        refuses it, and so do we, with the variable unchanged and the fix in the message."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, np.array([1.0, 1.0]), aggregation="sum")

        with pytest.raises(ValueError, match="every replica passed the same object") as info:
            await strategy.run(lambda: v.assign_add(shared))
        message = str(info.value)
        assert "A non-DistributedValues value cannot be reduced" in message
        assert "an int from -5 to 256" in message
        assert "np.int64(n) or np.float64(n)" in message
        assert copies(v) == [[1.0, 1.0]] * 2

    async def test_a_count_made_as_numpy_in_each_replica_is_summed(self) -> None:
        """The fix the message gives: equal small counts, made as NumPy in each replica, are
        one value per replica."""
        strategy = MirroredStrategy(host_devices(2))
        seen = scoped(strategy, 0, aggregation="sum")
        batches = [np.zeros(3), np.zeros(3)]

        async def step() -> None:
            await seen.assign_add(np.int64(len(batches[replica_id()])))

        await strategy.run(step)
        assert copies(seen) == [6, 6]


class TestCreatedInsideReplicasAgree:
    """Replicas that make their k-th variable with another dtype or ``trainable`` ask for
    another variable: refused, as another name or shape is."""

    @pytest.mark.parametrize(
        ("second", "shown", "made"),
        [
            (
                {"initial_value": np.zeros(2, np.float32)},
                "dtype float32",
                "dtype float64",
            ),
            ({"initial_value": np.zeros(2), "dtype": "float16"}, "dtype float16", "dtype float64"),
            (
                {"initial_value": np.zeros(2), "trainable": False},
                "trainable False",
                "trainable True",
            ),
            ({"args": (np.zeros(2), False)}, "trainable False", "trainable True"),
        ],
    )
    async def test_another_dtype_or_trainable_is_refused(
        self, second: dict[str, Any], shown: str, made: str
    ) -> None:
        """Whichever replica gets there first, the other's request is refused, naming what
        differs on both sides."""
        strategy = MirroredStrategy(host_devices(2))
        first_made = anyio.Event()

        async def step() -> Variable:
            if replica_id() == 0:
                v = Variable(np.zeros(2), name="z")
                first_made.set()
                return v
            await first_made.wait()
            kwargs = dict(second)
            args = kwargs.pop("args", None) or (kwargs.pop("initial_value"),)
            return Variable(*args, name="z", **kwargs)

        with pytest.raises(
            RuntimeError,
            match=rf"^replica 1 asked for Variable 'z' of shape \(2,\) \(synchronization AUTO, "
            rf"aggregation NONE, {shown}\) as its variable #1 in this run, but replica 0 made "
            rf"MirroredVariable 'z' of shape \(2,\) \(synchronization AUTO, aggregation NONE, "
            rf"{made}\) as its #1; ",
        ):
            await strategy.run(step)

    async def test_the_same_dtype_and_trainable_spelled_otherwise_agree(self) -> None:
        """A Python float and a float64 array, and trainable left out or given as its
        default, ask for the same variable."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Variable:
            if replica_id() == 0:
                return Variable(1.0, name="w")
            return Variable(np.float64(1.0), True, name="w", dtype="float64")

        made = await strategy.run(step)
        assert isinstance(made, Variable)
        assert (made.dtype, made.trainable) == (np.dtype("float64"), True)


class TestMixedStrategies:
    """A cross-replica write of one strategy's variable in another strategy's scope or
    merge_fn is refused, as that strategy's replicas refuse it (TF: "Mixing different
    tf.distribute.Strategy objects"); nothing is written."""

    @pytest.mark.parametrize("sync", ["on_write", "on_read"])
    async def test_a_write_in_another_strategys_scope(self, sync: str) -> None:
        """Under the other strategy's scope: RuntimeError naming both; under its own, the
        same write works."""
        first = MirroredStrategy(host_devices(2))
        second = MirroredStrategy(["cpu:2", "cpu:3"])
        v = scoped(first, 1.0, name="m", synchronization=sync, aggregation="mean")

        with second.scope(), pytest.raises(RuntimeError) as info:
            await v.assign(7.0)
        assert str(info.value) == (
            f"assign() of variable 'm', created in the scope of {first!r}, was called in the "
            f'scope of {second!r}; strategies cannot be mixed (TF: "Mixing different '
            'tf.distribute.Strategy objects"): write it outside that scope, or in its own '
            "strategy's"
        )
        assert copies(v) == [1.0, 1.0]
        with first.scope():
            await v.assign(7.0)
        assert copies(v) == [7.0, 7.0]

    async def test_a_write_in_another_strategys_merge_fn(self) -> None:
        """In the other strategy's merge_fn (cross-replica context of that strategy)."""
        first = MirroredStrategy(host_devices(2))
        second = MirroredStrategy(["cpu:2", "cpu:3"])
        v = scoped(first, 1.0, name="m")
        events: list[str] = []

        async def merge(strategy: Any) -> None:
            try:
                await v.assign_add(1.0)
            except RuntimeError as exc:
                events.append("refused" if "strategies cannot be mixed" in str(exc) else "?")

        await second.run(lambda: replica_context().merge_call(merge))
        assert events == ["refused"]
        assert copies(v) == [1.0, 1.0]


class TestTFConstructorArguments:
    """``Variable(initial_value, trainable, ..., shape=...)`` as TF's."""

    async def test_trainable_is_the_second_positional_argument(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        assert Variable(1.0, False).trainable is False
        assert scoped(strategy, 1.0).trainable is True
        with strategy.scope():
            assert Variable(np.zeros(2), False, name="w").trainable is False

    async def test_shape_is_checked_against_the_initial_value(self) -> None:
        """A matching shape (a tuple, a list or an int) makes the variable; another one is a
        ValueError and makes nothing."""
        fractional: Any = [1.5]
        assert Variable(np.zeros((2, 3)), shape=(2, 3)).shape == (2, 3)
        assert Variable(np.zeros(3), shape=[3]).shape == (3,)
        assert Variable(np.zeros(3), shape=3).shape == (3,)
        with pytest.raises(
            ValueError,
            match=r"^variable 'w': shape \(3, 1\) was given, but the initial value has shape "
            r"\(3,\); ",
        ):
            Variable(np.zeros(3), name="w", shape=(3, 1))
        with pytest.raises(TypeError, match="shape must be an int, a sequence of ints or None"):
            Variable(np.zeros(3), shape=fractional)
