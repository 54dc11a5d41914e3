"""Many steps in one call: ``strategy.run_steps`` and ``experimental_run_steps_on_iterator``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

import aioreplica
from aioreplica import MirroredStrategy, MultiStepContext, PerReplica, ReplicaSyncError
from aioreplica.testing import host_devices, replica_context, replica_id

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.anyio


def batches(n_batches: int, size: int = 4) -> Any:
    return aioreplica.batched(np.arange(float(n_batches * size)), size)


class TestRunSteps:
    async def test_each_replica_gets_its_slice_of_each_element(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        seen: list[tuple[int, list[float]]] = []

        def step(x: Any) -> float:
            seen.append((replica_id(), list(x)))
            return float(x.sum())

        iterator = aiter(strategy.distribute_dataset(batches(3)))
        result = await strategy.run_steps(step, iterator, 3)
        # In each step the replica that completed the merge round runs first (``ordered``).
        assert sorted(seen[0:2]) + sorted(seen[2:4]) + sorted(seen[4:6]) == [
            (0, [0.0, 1.0]),
            (1, [2.0, 3.0]),
            (0, [4.0, 5.0]),
            (1, [6.0, 7.0]),
            (0, [8.0, 9.0]),
            (1, [10.0, 11.0]),
        ]
        # The last step's results, regrouped as run() returns them.
        assert isinstance(result, PerReplica)
        assert result.values == (17.0, 21.0)

    async def test_an_element_of_another_replica_count_is_refused(self) -> None:
        """An element holding a PerReplica of another length than the replicas (from
        another strategy's dataset, say) is a ValueError naming run_steps; the step before
        it ran, the step with it did not."""
        strategy = MirroredStrategy(host_devices(3))
        seen: list[Any] = []

        async def elements() -> Any:
            yield PerReplica([1, 2, 3])
            yield (PerReplica([4, 5]),)

        with pytest.raises(
            ValueError,
            match=r"^run_steps\(\): the iterator gave a PerReplica of 2 values at \[0\], but "
            r"MirroredStrategy\(.*\) has 3 replicas here; iterate a dataset distributed by",
        ):
            await strategy.run_steps(seen.append, elements(), 2)
        assert sorted(seen) == [1, 2, 3]

    async def test_an_async_generator_step_fn_is_refused(self) -> None:
        """A step_fn with a ``yield`` runs none of its code: the first step fails naming it,
        instead of the loop handing back a generator object as the last step's result."""
        strategy = MirroredStrategy(host_devices(2))
        ran: list[int] = []

        async def step(x: Any) -> Any:
            ran.append(replica_id())
            yield float(x.sum())

        iterator = aiter(strategy.distribute_dataset(batches(3)))
        with pytest.raises(
            TypeError,
            match=r"^run_steps' step_fn is an async generator function \(TestRunSteps\."
            r"test_an_async_generator_step_fn_is_refused\.<locals>\.step: it contains `yield`"
            r"\), so none of its code ran; a step function returns its result: write `return`",
        ):
            await strategy.run_steps(step, iterator, 3)
        assert ran == []

    async def test_the_same_results_as_run_once_per_step(self) -> None:
        strategy = MirroredStrategy(host_devices(3))

        async def step(x: Any) -> Any:
            return await replica_context().all_reduce("sum", x.sum())

        dist = strategy.distribute_dataset(batches(4, 6))
        expected = [await strategy.run(step, args=(x,)) async for x in dist]
        looped = await strategy.run_steps(step, aiter(dist), 4)
        assert looped == expected[-1]

    async def test_replicas_start_once_for_all_steps(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        tasks: set[Any] = set()

        def step(x: Any) -> None:
            tasks.add(anyio.get_current_task().id)

        await strategy.run_steps(step, aiter(strategy.distribute_dataset(batches(5))), 5)
        assert len(tasks) == 2  # one task per replica, not per replica and step

    async def test_takes_exactly_steps_elements(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        iterator = aiter(strategy.distribute_dataset(batches(5), prefetch=0))
        steps: list[int] = []
        await strategy.run_steps(lambda x: steps.append(replica_id()), iterator, 2)
        assert sorted(steps) == [0, 0, 1, 1]
        rest = [x async for x in iterator]
        assert [list(x.values[0]) for x in rest] == [[8.0, 9.0], [12.0, 13.0], [16.0, 17.0]]

    async def test_an_iterator_that_ends_early_just_stops(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        steps: list[int] = []

        def step(x: Any) -> int:
            steps.append(replica_id())
            return len(x)

        result = await strategy.run_steps(step, aiter(strategy.distribute_dataset(batches(2))), 9)
        assert sorted(steps) == [0, 0, 1, 1]
        assert result == 2

    async def test_a_partial_last_batch_with_empty_replicas_is_a_step(self) -> None:
        strategy = MirroredStrategy(host_devices(4))
        data = aioreplica.batched(np.arange(10.0), 8)  # 8 rows, then 2
        result = await strategy.run_steps(len, aiter(strategy.distribute_dataset(data)), 2)
        assert isinstance(result, PerReplica)
        assert result.values == (1, 1, 0, 0)

    async def test_zero_steps_returns_none(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        iterator = aiter(strategy.distribute_dataset(batches(1)))
        assert await strategy.run_steps(len, iterator, 0) is None

    async def test_a_failing_step_ends_the_loop_as_run_does(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        steps: list[tuple[int, int]] = []

        async def step(x: Any) -> None:
            steps.append((replica_id(), int(x[0])))
            if int(x[0]) == 6:
                raise ValueError("bad batch")
            await replica_context().merge_call(lambda s: None)

        with pytest.raises(ValueError, match="bad batch") as info:
            await strategy.run_steps(step, aiter(strategy.distribute_dataset(batches(4))), 4)
        assert info.value.__notes__ == [
            "raised in step 2 of run_steps()",
            "raised in replica 1 of 2 (device cpu:1)",
        ]
        # Step 1 ran on both; in step 2 replica 0 may be cancelled before it starts; no step 3.
        assert {(0, 0), (1, 2), (1, 6)} <= set(steps) <= {(0, 0), (1, 2), (0, 4), (1, 6)}

    async def test_an_iterators_error_says_which_step_pulled_it(self) -> None:
        """An error the iterator raises comes out of run_steps() itself, with a note naming
        the iterator and the step whose element it was pulling (not only the merge function
        that pulls it)."""
        strategy = MirroredStrategy(host_devices(2))
        seen: list[int] = []

        async def elements() -> AsyncIterator[Any]:
            for i in range(2):
                yield PerReplica([np.full(1, i), np.full(1, i)])
            raise OSError("the file went away")

        async def step(x: Any) -> None:
            seen.append(int(x[0]))

        with pytest.raises(OSError, match="the file went away") as info:
            await strategy.run_steps(step, elements(), 5)
        assert info.value.__notes__[0] == (
            "raised by run_steps()'s iterator (async_generator) pulling the element of step 3"
        )
        assert seen == [0, 0, 1, 1]

    async def test_steps_must_agree_on_merge_calls(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def step(x: Any) -> None:
            if replica_id() == 0:
                await replica_context().merge_call(lambda s: None)

        with pytest.raises(ReplicaSyncError):
            await strategy.run_steps(step, aiter(strategy.distribute_dataset(batches(2))), 2)

    async def test_bad_arguments(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_dataset(batches(2))
        with pytest.raises(TypeError, match="needs an async iterator"):
            await strategy.run_steps(len, [1, 2], 1)
        with pytest.raises(ValueError, match="steps must be >= 0"):
            await strategy.run_steps(len, aiter(dist), -1)
        with pytest.raises(TypeError, match="steps must be an int"):
            await strategy.run_steps(len, aiter(dist), True)
        with pytest.raises(TypeError, match="callable step_fn"):
            await strategy.run_steps(None, aiter(dist), 1)  # type: ignore[arg-type]

    async def test_a_distributed_dataset_itself_is_accepted(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        assert await strategy.run_steps(len, strategy.distribute_dataset(batches(2)), 2) == 2


class TestRunStepsOnIterator:
    async def test_fn_runs_in_cross_replica_context_once_per_step(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        calls: list[tuple[bool, Any]] = []

        async def fn(context: MultiStepContext, inputs: Any) -> None:
            calls.append((aioreplica.in_cross_replica_context(), aioreplica.get_strategy()))
            losses = await strategy.run(lambda x: float(x.sum()), args=(inputs,))
            await context.set_last_step_output("loss", losses, reduce_op="sum")
            await context.set_last_step_output("per_replica", losses)

        iterator = aiter(strategy.distribute_dataset(batches(3)))
        run = strategy.extended.experimental_run_steps_on_iterator
        context = await run(fn, iterator, iterations=3)
        assert calls == [(True, strategy)] * 3
        outputs = context.last_step_outputs
        assert sorted(outputs) == ["loss", "per_replica"]
        assert float(outputs["loss"]) == 8.0 + 9.0 + 10.0 + 11.0
        assert outputs["per_replica"].values == (17.0, 21.0)

    async def test_outputs_set_in_replica_context(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def fn(context: MultiStepContext, inputs: Any) -> None:
            async def step(x: Any) -> None:
                await context.set_last_step_output("rows", len(x) * (replica_id() + 1), "sum")
                await context.set_non_tensor_output("who", f"replica {replica_id()}")

            await strategy.run(step, args=(inputs,))

        run = strategy.extended.experimental_run_steps_on_iterator
        context = await run(fn, aiter(strategy.distribute_dataset(batches(2))), iterations=2)
        assert {k: int(v) for k, v in context.last_step_outputs.items()} == {"rows": 2 + 4}
        assert context.non_tensor_outputs == {"who": ("replica 0", "replica 1")}

    async def test_one_object_from_every_replica_is_one_output(self) -> None:
        """TF's testRunStepsWithOutputContext: the very same object from every replica is
        recorded once."""
        strategy = MirroredStrategy(host_devices(2))

        async def fn(context: MultiStepContext, inputs: Any) -> None:
            async def step(x: Any) -> None:
                await context.set_non_tensor_output("foo", "bar")

            await strategy.run(step, args=(inputs,))

        run = strategy.extended.experimental_run_steps_on_iterator
        context = await run(fn, aiter(strategy.distribute_dataset(batches(2))), iterations=1)
        assert context.non_tensor_outputs == {"foo": ("bar",)}

    async def test_replica_context_needs_a_reduce_op(self) -> None:
        strategy = MirroredStrategy(host_devices(2))

        async def fn(context: MultiStepContext, inputs: Any) -> None:
            async def step() -> None:
                await context.set_last_step_output("x", 1.0)

            await strategy.run(step)

        run = strategy.extended.experimental_run_steps_on_iterator
        with pytest.raises(ValueError, match="needs a reduce_op"):
            await run(fn, aiter(strategy.distribute_dataset(batches(1))), iterations=1)

    async def test_initial_loop_values_and_an_early_end(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        steps: list[int] = []

        def fn(context: MultiStepContext, inputs: Any) -> None:
            steps.append(len(steps))

        run = strategy.extended.experimental_run_steps_on_iterator
        context = await run(
            fn,
            aiter(strategy.distribute_dataset(batches(2))),
            iterations=5,
            initial_loop_values={"loss": 0.0},
        )
        assert steps == [0, 1]
        assert context.last_step_outputs == {"loss": 0.0}
