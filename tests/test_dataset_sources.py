"""What a distributed dataset takes as its source, and how a pass over one starts and ends:
mappings refused, ``iter()`` off the event loop, ``aclose`` while another task waits for an
async source, and lists inside batches.

Every async test runs on asyncio, uvloop and trio. Elements are small NumPy arrays whose values
say which pull made them.
"""

from __future__ import annotations

import collections
import threading
import types
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest
from messages import mentions

import aioreplica
from aioreplica import InputOptions, MirroredStrategy, batched
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]

#: The longest a blocked start or pull waits for its release (far beyond any test's own waits).
BLOCK_S = 10.0
#: The timeout the tests put around a wait that cannot end by itself.
GIVE_UP_S = 0.05
#: The longest any test below may take before it counts as a hang.
BOUND_S = 5.0


class TestMappingsAreRefused:
    @pytest.mark.parametrize("replicas", [1, 2])
    def test_a_dict_of_arrays_is_refused(self, replicas: int) -> None:
        """A dict passed as the dataset (tf.data's from_tensor_slices habit) is a TypeError
        saying that its items are its keys and what to pass instead, with any replica count."""
        strategy = MirroredStrategy(host_devices(replicas))
        data = {"x": np.arange(8.0), "y": np.arange(8)}
        with pytest.raises(
            TypeError,
            match=mentions(
                "got a dict",
                r"\['x', 'y'\]",
                "items are its keys, not batches",
                r"aioreplica\.batched\(\{\.\.\.\}, batch_size\)",
                "list of dict batches",
            ),
        ):
            strategy.distribute_dataset(data)

    @pytest.mark.parametrize("mode", ["per_worker", "per_replica"])
    @pytest.mark.parametrize(
        "made",
        [{"x": np.arange(4)}, types.MappingProxyType({"x": np.arange(4)})],
        ids=["dict", "mappingproxy"],
    )
    def test_a_mapping_from_a_dataset_function_is_refused(self, made: Any, mode: str) -> None:
        """A dataset function returning a mapping (for each replica with PER_REPLICA) is
        refused the same way, whatever the kind of mapping."""
        strategy = MirroredStrategy(host_devices(2))
        options = InputOptions(experimental_replication_mode=mode)
        with pytest.raises(
            TypeError, match=mentions(type(made).__name__, "items are its keys", "batched")
        ):
            strategy.distribute_datasets_from_function(lambda _: made, options)

    @pytest.mark.parametrize(
        ("made", "named"),
        [
            (collections.OrderedDict(x=np.arange(4)), "an OrderedDict"),
            (collections.UserDict(x=np.arange(4)), "a UserDict"),
        ],
        ids=["OrderedDict", "UserDict"],
    )
    def test_the_standard_mappings_are_refused(self, made: Any, named: str) -> None:
        """Every standard mapping iterates as its keys, and is refused, named with its
        article."""
        strategy = MirroredStrategy(host_devices(2))
        with pytest.raises(TypeError, match=mentions(f"got {named} with keys")):
            strategy.distribute_dataset(made)

    async def test_a_mapping_that_iterates_its_own_way_is_a_dataset(self) -> None:
        """A mapping class of the program's with its own ``__iter__`` (or an ``__aiter__``)
        is iterated as it says, as any dataset."""

        class Batches(dict[str, Array]):
            def __iter__(self) -> Iterator[Any]:
                return iter([{"x": np.arange(2.0)}, {"x": np.arange(2.0, 4.0)}])

        class AsyncBatches(dict[str, Array]):
            async def __aiter__(self) -> AsyncIterator[Any]:
                yield {"x": np.arange(2.0)}

        def firsts(element: Any) -> list[float]:
            return [float(part[0]) for part in element["x"].values]

        strategy = MirroredStrategy(host_devices(2))
        got = [firsts(e) async for e in strategy.distribute_dataset(Batches(a=np.zeros(1)))]
        assert got == [[0.0, 1.0], [2.0, 3.0]]
        dist = strategy.distribute_dataset(AsyncBatches(a=np.zeros(1)))
        assert [firsts(e) async for e in dist] == [[0.0, 1.0]]


class SlowStart:
    """A dataset whose ``iter()`` is slow (a data loader starting its workers): it waits for
    ``release`` (``BLOCK_S`` at most) and notes the thread it ran on, and when it returned."""

    def __init__(self, *, blocks: bool) -> None:
        self.release = threading.Event()
        self.returned = threading.Event()
        self.threads: list[int] = []
        self._blocks = blocks

    def __iter__(self) -> Iterator[Array]:
        self.threads.append(threading.get_ident())
        if self._blocks:
            self.release.wait(BLOCK_S)
        self.returned.set()
        return iter([np.arange(2), np.arange(2) + 10])


class TestPassesStartOffTheEventLoop:
    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_iter_runs_on_the_loader_thread(self, prefetch: int) -> None:
        """``iter(dataset)`` of a synchronous dataset runs on its loader thread, not on the
        event loop, prefetched or not; the pass gives every element."""
        strategy = MirroredStrategy(host_devices(2))
        dataset = SlowStart(blocks=False)
        dist = strategy.distribute_dataset(dataset, prefetch=prefetch)
        got = [[part.tolist() for part in element.values] async for element in dist]
        assert got == [[[0], [1]], [[10], [11]]]
        assert len(dataset.threads) == 1
        assert dataset.threads[0] != threading.get_ident()

    async def test_iter_of_a_pipeline_beside_an_async_one_runs_on_its_thread(self) -> None:
        """With PER_REPLICA pipelines of which one is asynchronous, the synchronous one's
        ``iter()`` runs on its loader thread too."""
        strategy = MirroredStrategy(host_devices(2))
        dataset = SlowStart(blocks=False)

        async def batches() -> AsyncIterator[Array]:
            for i in range(2):
                yield np.arange(2) + 100 * i

        def pipelines(context: aioreplica.InputContext) -> Any:
            return batches() if context.input_pipeline_id == 0 else dataset

        options = InputOptions(experimental_replication_mode="per_replica")
        dist = strategy.distribute_datasets_from_function(pipelines, options, prefetch=0)
        got = [[part.tolist() for part in element.values] async for element in dist]
        assert got == [[[0, 1], [0, 1]], [[100, 101], [10, 11]]]
        assert len(dataset.threads) == 1
        assert dataset.threads[0] != threading.get_ident()

    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_a_slow_start_can_be_given_up(self, prefetch: int) -> None:
        """A timeout around a pass whose ``iter()`` blocks fires at once: the event loop
        never waits for the start."""
        strategy = MirroredStrategy(host_devices(2))
        dataset = SlowStart(blocks=True)
        events: list[str] = []
        try:
            start = anyio.current_time()
            with anyio.move_on_after(GIVE_UP_S) as timeout:
                events.extend(
                    [
                        "element"
                        async for _ in strategy.distribute_dataset(dataset, prefetch=prefetch)
                    ]
                )
            events.append(f"gave up: {timeout.cancelled_caught}")
            took = anyio.current_time() - start
            dataset.release.set()
            assert await anyio.to_thread.run_sync(dataset.returned.wait, BOUND_S)
            events.append("iter() returned")
        finally:
            dataset.release.set()
        assert events == ["gave up: True", "iter() returned"]
        assert took < BOUND_S

    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_a_start_that_raises_is_the_first_waits_error(self, prefetch: int) -> None:
        """What ``iter(dataset)`` raises comes out of the first wait of the pass, unchanged."""
        strategy = MirroredStrategy(host_devices(2))
        boom = OSError("shard 3 is missing")

        class Unreadable:
            def __iter__(self) -> Iterator[Array]:
                raise boom

        with pytest.raises(OSError, match="shard 3 is missing") as info:
            [
                element
                async for element in strategy.distribute_dataset(Unreadable(), prefetch=prefetch)
            ]
        assert info.value is boom


def gated(name: str, free: int, release: anyio.Event, events: list[str]) -> AsyncIterator[Array]:
    """An async generator that yields ``free`` items at once, then waits for ``release``
    before each next one; item ``i`` is ``np.full(2, i)``. Its ``finally`` notes that it ran."""

    async def batches() -> AsyncIterator[Array]:
        try:
            for i in range(free + 2):
                if i >= free:
                    await release.wait()
                yield np.full(2, i)
        finally:
            events.append(f"{name} closed")

    return batches()


def gated_dataset(
    how: str, strategy: MirroredStrategy, release: anyio.Event, events: list[str]
) -> aioreplica.DistributedDataset:
    """A distributed dataset over gated async generators whose first element comes at once
    and whose second waits for ``release``: one generator cut into global batches, one whose
    rounds of per-replica batches take two pulls each (the second round's first pull is made
    at once, its second waits), or PER_REPLICA pipelines of which pipeline 0 waits."""
    if how == "dataset":
        return strategy.distribute_dataset(gated("generator", 1, release, events), prefetch=0)
    if how == "rounds of one generator":
        return strategy.distribute_datasets_from_function(
            lambda _: gated("generator", 3, release, events), prefetch=0
        )

    def pipeline(context: aioreplica.InputContext) -> AsyncIterator[Array]:
        number = context.input_pipeline_id
        return gated(f"pipeline {number}", 1 if number == 0 else 2, release, events)

    options = InputOptions(experimental_replication_mode="per_replica")
    return strategy.distribute_datasets_from_function(pipeline, options, prefetch=0)


class Gate:
    """An async iterator (not a generator) whose items after the first wait for ``release``;
    its ``aclose`` notes that it ran."""

    def __init__(self, release: anyio.Event, events: list[str]) -> None:
        self._release = release
        self._events = events
        self._pulls = 0

    def __aiter__(self) -> Gate:
        return self

    async def __anext__(self) -> Array:
        self._pulls += 1
        if self._pulls > 1:
            await self._release.wait()
        return np.full(2, self._pulls)

    async def aclose(self) -> None:
        self._events.append("iterator closed")


async def close_while_another_waits(
    iterator: aioreplica.DistributedIterator, release: anyio.Event, events: list[str]
) -> None:
    """Take ``iterator``'s first element, then ``aclose`` it while another task waits for the
    next (whose pull waits for ``release``), and set ``release``; ``events`` records when
    ``aclose`` returned and what the waiter got."""

    async def wait_for_next() -> None:
        optional = await iterator.get_next_as_optional()
        events.append("waiter got an element" if optional.has_value() else "waiter: end")

    await iterator.get_next()
    async with anyio.create_task_group() as group:
        group.start_soon(wait_for_next)
        await anyio.wait_all_tasks_blocked()
        await iterator.aclose()
        events.append("aclose returned")
        release.set()


class TestAcloseWhileAnotherTaskWaits:
    @pytest.mark.parametrize("how", ["dataset", "rounds of one generator", "per-replica pipelines"])
    async def test_the_waiter_gets_the_end_and_the_generator_is_closed(self, how: str) -> None:
        """``aclose`` while another task waits for a pull of an async generator returns at
        once (closing at once only the generators not being pulled); once the pull ends its
        generator is closed (its ``finally`` runs), and the waiting task gets the end of the
        iteration, not the element (nor part of one)."""
        strategy = MirroredStrategy(host_devices(2))
        release = anyio.Event()
        events: list[str] = []
        iterator = aiter(gated_dataset(how, strategy, release, events))
        with anyio.fail_after(BOUND_S):
            await close_while_another_waits(iterator, release, events)
            later = await iterator.get_next_as_optional()
            await iterator.aclose()
        expected = ["aclose returned", "generator closed", "waiter: end"]
        if how == "per-replica pipelines":
            expected = ["pipeline 1 closed", "aclose returned", "pipeline 0 closed", "waiter: end"]
        assert events == expected
        assert not later.has_value()

    async def test_a_pull_that_raises_after_aclose_gives_the_waiter_the_end(self) -> None:
        """The pull in flight when ``aclose`` came raises: the waiting task gets the end of
        the iteration, as for an element, not the closed source's exception."""
        strategy = MirroredStrategy(host_devices(2))
        release = anyio.Event()
        events: list[str] = []

        async def failing() -> AsyncIterator[Array]:
            yield np.arange(2.0)
            await release.wait()
            raise OSError("the disk is gone")

        iterator = aiter(strategy.distribute_dataset(failing(), prefetch=0))
        with anyio.fail_after(BOUND_S):
            await close_while_another_waits(iterator, release, events)
        assert events == ["aclose returned", "waiter: end"]

    async def test_a_pull_cancelled_after_aclose_closes_the_source(self) -> None:
        """An async iterator is not closed while another task's pull of it runs: that pull
        closes it as it ends, by a cancellation too."""
        strategy = MirroredStrategy(host_devices(2))
        release = anyio.Event()
        events: list[str] = []
        iterator = aiter(strategy.distribute_dataset(Gate(release, events), prefetch=0))
        with anyio.fail_after(BOUND_S):
            await iterator.get_next()
            async with anyio.create_task_group() as group:
                group.start_soon(iterator.get_next)
                await anyio.wait_all_tasks_blocked()
                await iterator.aclose()
                events.append("aclose returned")
                group.cancel_scope.cancel()
            events.append(f"waiter cancelled: {group.cancel_scope.cancelled_caught}")
        assert events == ["aclose returned", "iterator closed", "waiter cancelled: True"]


class TestListsInBatches:
    @pytest.mark.parametrize(
        ("batch", "where"),
        [
            ({"features": [[1.0, 2.0], [3.0, 4.0]], "label": [0, 1]}, r"\['features'\]"),
            (([1.0, 2.0, 3.0], np.zeros(3)), r"\[0\]"),
        ],
        ids=["a dict of lists", "a tuple holding a list"],
    )
    async def test_a_leaf_in_a_list_says_to_make_the_list_an_array(
        self, batch: Any, where: str
    ) -> None:
        """A leaf without a batch dimension inside a list that a generator yields names that
        list, says a list is taken as a structure (tf.data would make it one tensor) and to
        wrap it in np.asarray(...)."""
        strategy = MirroredStrategy(host_devices(2))
        with pytest.raises(
            TypeError,
            match=mentions(
                "no batch dimension",
                f"the list at {where} is taken as a structure",
                "tf.data",
                r"np\.asarray\(\.\.\.\)",
            ),
        ):
            [element async for element in strategy.distribute_dataset(b for b in [batch])]

    async def test_a_ragged_list_is_told_to_take_one_shape(self) -> None:
        """A list whose items differ in shape (an array beside a number) cannot become one
        array: the message says so, instead of advising an np.asarray(...) that would fail."""
        strategy = MirroredStrategy(host_devices(2))
        batch = {"x": [np.zeros((4, 2)), 1.0]}
        with pytest.raises(
            TypeError,
            match=mentions(
                r"the list at \['x'\] is taken as a structure",
                "its items differ in shape",
                "give them all one shape",
            ),
        ) as info:
            [element async for element in strategy.distribute_dataset([batch])]
        assert "wrap it in" not in str(info.value)
        with pytest.raises(ValueError, match="inhomogeneous"):
            np.asarray(batch["x"])

    def test_batched_over_a_list_says_the_same(self) -> None:
        """batched over a list of numbers names the list (the root) the same way."""
        with pytest.raises(
            TypeError, match=mentions(r"the list at <root> is taken as a structure", "np.asarray")
        ):
            batched([1.0, 2.0, 3.0, 4.0], 2)

    async def test_a_leaf_outside_any_list_gets_no_list_advice(self) -> None:
        """A number in a tuple or dict (structures in tf.data too) gets the plain message."""
        strategy = MirroredStrategy(host_devices(2))
        with pytest.raises(TypeError, match="no batch dimension") as info:
            [e async for e in strategy.distribute_dataset([(np.zeros(4), {"step": 3.0})])]
        assert "list" not in str(info.value)
