"""``run_steps`` and ``experimental_run_steps_on_iterator`` at their edges: what their messages
name, non-tensor outputs every replica passes as one object, and initial loop values."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest
from log_records import Records, recorded

import aioreplica
from aioreplica import MirroredStrategy, MultiStepContext
from aioreplica.testing import host_devices, replica_id

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

pytestmark = pytest.mark.anyio

#: Seconds any one wait of these tests may take before it counts as a hang.
PATIENCE = 10.0


def batches(n_batches: int, size: int = 4) -> Any:
    return aioreplica.batched(np.arange(float(n_batches * size)), size)


@pytest.fixture
def warnings() -> Iterator[Records]:
    with recorded(logging.WARNING) as handler:
        yield handler


class TestRunStepsMessages:
    async def test_a_slow_step_is_logged_as_run_steps_pulling_its_element(
        self, warnings: Records
    ) -> None:
        """Replica 0 is late for the element of step 2: the warning names that call, not the
        function that pulls it."""
        strategy = MirroredStrategy(host_devices(2), slow_merge_warning=0.05)
        go = anyio.Event()

        async def step(x: Any) -> None:
            if replica_id() == 0 and x[0] == 0:
                await go.wait()  # late for step 2's element

        async def release() -> None:
            assert await anyio.to_thread.run_sync(warnings.first.wait, PATIENCE)
            go.set()

        try:
            with anyio.fail_after(PATIENCE):
                async with anyio.create_task_group() as group:
                    group.start_soon(release)
                    await strategy.run_steps(
                        step, aiter(strategy.distribute_dataset(batches(3))), 3
                    )
        finally:
            strategy.close()
        (message,) = [record.getMessage() for record in warnings.records]
        assert message.startswith(
            "run_steps pulling the element of step 2 (merge_call #2) of a run() on "
            "MirroredStrategy(devices=['cpu:0', 'cpu:1']) has waited "
        ), message
        assert "for replica 0, which has not arrived (replica 1 waiting)" in message

    async def test_a_failing_step_says_which_step_it_was(self) -> None:
        """A step_fn that raises in step 3 on replica 1: the failure's notes say the step and
        the replica."""
        strategy = MirroredStrategy(host_devices(2))

        async def step(x: Any) -> None:
            if replica_id() == 1 and x[0] == 10:
                raise RuntimeError("bad batch")

        with pytest.raises(RuntimeError, match=r"^bad batch") as caught:
            await strategy.run_steps(step, aiter(strategy.distribute_dataset(batches(4))), 4)
        assert caught.value.__notes__ == [
            "raised in step 3 of run_steps()",
            "raised in replica 1 of 2 (device cpu:1)",
        ]


class TestNonTensorOutputs:
    @pytest.mark.parametrize(
        ("shared", "made"),
        [
            ({"k": 1}, ({"k": 1},)),
            ([1, "a"], ([1, "a"],)),
            ("x", ("x",)),
        ],
    )
    async def test_the_same_object_from_every_replica_is_one_value(
        self, shared: Any, made: tuple[Any, ...]
    ) -> None:
        """As in TF: merge_call regroups the replicas' values, collapsing what every replica
        passed as one object, and the output is the local results of that: a 1-tuple."""
        strategy = MirroredStrategy(host_devices(2))
        context = MultiStepContext()

        async def step() -> None:
            await context.set_non_tensor_output("shared", shared)

        await strategy.run(step)
        assert context.non_tensor_outputs == {"shared": made}

    async def test_values_that_differ_are_one_per_replica(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        context = MultiStepContext()

        async def step() -> None:
            await context.set_non_tensor_output("own", {"k": replica_id()})

        await strategy.run(step)
        assert context.non_tensor_outputs == {"own": ({"k": 0}, {"k": 1})}


class TestInitialLoopValues:
    @pytest.mark.parametrize("values", [5, [1, 2], [("loss", 1.0)], "loss"])
    async def test_anything_but_a_mapping_is_refused_before_a_step(self, values: Any) -> None:
        """Not a mapping of output names: a TypeError saying what it takes, before any element
        is pulled or fn called."""
        strategy = MirroredStrategy(host_devices(2))
        events: list[str] = []

        async def elements() -> AsyncIterator[Any]:
            events.append("pulled")
            yield strategy.experimental_distribute_values_from_function(lambda ctx: 1.0)

        def fn(context: MultiStepContext, inputs: Any) -> None:
            events.append("fn")

        run = strategy.extended.experimental_run_steps_on_iterator
        with pytest.raises(TypeError) as caught:
            await run(fn, elements(), 1, initial_loop_values=values)
        assert str(caught.value).startswith(
            "experimental_run_steps_on_iterator() takes initial_loop_values as a mapping of "
            "output names to values (a dict, such as {'loss': 0.0}: the last_step_outputs "
            f"before the first step) or None, got {type(values).__name__} "
        ), caught.value
        assert events == []

    async def test_a_mapping_is_the_outputs_before_the_first_step(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        run = strategy.extended.experimental_run_steps_on_iterator
        iterator = aiter(strategy.distribute_dataset(batches(1)))
        context = await run(lambda c, i: None, iterator, 0, initial_loop_values={"loss": 2.0})
        assert context.last_step_outputs == {"loss": 2.0}
