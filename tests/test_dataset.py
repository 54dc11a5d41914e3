"""Distributed datasets: global batches split over replicas, prefetch, iterators, input helpers.

Every async test runs on asyncio, uvloop and trio. Datasets are small NumPy tables whose row i
holds the value i, so each replica's slice says which rows it got.
"""

from __future__ import annotations

import gc
import re
import threading
import warnings
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import sniffio
import trio
from messages import mentions

import aioreplica
from aioreplica import (
    DistributedDataset,
    DistributedIterator,
    InputContext,
    MirroredStrategy,
    PerReplica,
    ReduceOp,
    ValueContext,
    batched,
)
from aioreplica.testing import host_devices, replica_context

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator, Sequence

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]
Table = tuple[Array, Array]

SOURCES = ["list", "generator", "async generator"]


def table(rows: int, width: int = 3) -> Table:
    """Features (float32, ``width`` wide) and labels (int64) whose row i holds i."""
    x = np.repeat(np.arange(rows, dtype=np.float32)[:, None], width, axis=1)
    return x, np.arange(rows, dtype=np.int64)


def global_batches(rows: int, batch_size: int) -> list[Table]:
    x, y = table(rows)
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, rows, batch_size)]


def source(kind: str, batches: Sequence[Any]) -> Any:
    """The same batches as a list, a generator or an async generator."""
    if kind == "list":
        return list(batches)
    if kind == "generator":
        return (batch for batch in batches)

    async def agen() -> AsyncIterator[Any]:
        for batch in batches:
            yield batch

    return agen()


def parts(value: Any, replicas: int) -> tuple[Any, ...]:
    """Each replica's component of one regrouped leaf (the value itself for one replica)."""
    if replicas == 1:
        assert not isinstance(value, aioreplica.DistributedValues)
        return (value,)
    assert isinstance(value, PerReplica)
    assert len(value.values) == replicas
    return value.values


def rows_of(value: Any, replicas: int) -> list[list[int]]:
    """The label rows each replica got, for a leaf of labels."""
    return [part.tolist() for part in parts(value, replicas)]


async def collect(dataset: Any) -> list[Any]:
    return [element async for element in dataset]


async def consume(dataset: Any, seen: list[Any]) -> None:
    """Loop over ``dataset``, recording each element as it comes (they stay if the loop fails)."""
    async for element in dataset:
        seen.append(element)  # noqa: PERF401 - recorded one by one, not only at the end


def live_tasks() -> int:
    """Tasks alive on this loop; on trio, system tasks (which anyio does not list) included."""
    if sniffio.current_async_library() == "trio":
        return trio.lowlevel.current_statistics().tasks_living
    return len(anyio.get_running_tasks())


async def settle(until: Callable[[], bool]) -> None:
    """Wait until ``until()`` holds on an idle loop, or 5 s (the caller's asserts then fail).

    A task waiting for a worker thread counts as blocked, and the thread's result reaches the
    loop a moment later, so the condition is checked again each time the loop is idle.
    """
    with anyio.move_on_after(5):
        await anyio.wait_all_tasks_blocked()
        while not until():
            await anyio.sleep(0.005)
            await anyio.wait_all_tasks_blocked()


def most_ahead(events: list[tuple[str, int]]) -> int:
    """The most elements pulled beyond those asked for, at any point of ``events``."""
    ahead = most = 0
    for what, _ in events:
        ahead += {"pulled": 1, "asked": -1}.get(what, 0)
        most = max(most, ahead)
    return most


class TestDistributeDataset:
    @pytest.mark.parametrize(
        ("replicas", "batch_size"),
        [(1, 4), (1, 5), (2, 4), (2, 5), (3, 6), (3, 7), (3, 2), (8, 16), (8, 13), (8, 5)],
    )
    async def test_split_contiguous_larger_slices_first(
        self, replicas: int, batch_size: int
    ) -> None:
        """Each global batch splits into contiguous views in replica order, larger slices first."""
        batches = global_batches(3 * batch_size - 1, batch_size)
        strategy = MirroredStrategy(host_devices(replicas))
        elements = await collect(strategy.distribute_dataset(batches))
        assert len(elements) == len(batches)
        for (x, y), (x_parts, y_parts) in zip(batches, elements, strict=True):
            for whole, leaf in ((x, x_parts), (y, y_parts)):
                slices = parts(leaf, replicas)
                expected = np.array_split(whole, replicas)
                assert [s.shape for s in slices] == [e.shape for e in expected]
                assert [s.dtype for s in slices] == [whole.dtype] * replicas
                for got, want in zip(slices, expected, strict=True):
                    np.testing.assert_array_equal(got, want)
                assert all(np.shares_memory(s, whole) for s in slices if len(s))

    async def test_ten_rows_batch_four_four_replicas(self) -> None:
        """10 rows in batches of 4 over 4 replicas: 3 elements, the last 1, 1, 0, 0 rows."""
        strategy = MirroredStrategy(host_devices(4))
        seen = []
        async for x, y in strategy.distribute_dataset(batched(table(10), 4)):
            seen.append(
                [
                    (xs.shape, xs.dtype.name, ys.tolist(), ys.dtype.name)
                    for xs, ys in zip(parts(x, 4), parts(y, 4), strict=True)
                ]
            )

        def row(i: int) -> tuple[Any, ...]:
            return ((1, 3), "float32", [i], "int64")

        empty: tuple[Any, ...] = ((0, 3), "float32", [], "int64")
        assert seen == [
            [row(0), row(1), row(2), row(3)],
            [row(4), row(5), row(6), row(7)],
            [row(8), row(9), empty, empty],
        ]

    async def test_array_batches_give_one_per_replica(self) -> None:
        """A dataset of plain arrays gives one PerReplica per element."""
        strategy = MirroredStrategy(host_devices(2))
        elements = await collect(strategy.distribute_dataset([np.arange(5), np.arange(5, 8)]))
        assert [rows_of(element, 2) for element in elements] == [[[0, 1, 2], [3, 4]], [[5, 6], [7]]]

    async def test_dict_batches_keep_their_keys(self) -> None:
        """A dict batch comes out as a dict, in its key order, of per-replica slices."""
        x, y = table(4)
        strategy = MirroredStrategy(host_devices(2))
        (element,) = await collect(strategy.distribute_dataset([{"label": y, "image": x}]))
        assert list(element) == ["label", "image"]
        assert rows_of(element["label"], 2) == [[0, 1], [2, 3]]
        assert [part.shape for part in element["image"].values] == [(2, 3), (2, 3)]

    async def test_one_replica_gets_plain_arrays(self) -> None:
        """With one replica an element holds the arrays themselves, no PerReplica."""
        x, y = table(3)
        strategy = MirroredStrategy(host_devices(1))
        (element,) = await collect(strategy.distribute_dataset([(x, y)]))
        assert isinstance(element, tuple)
        assert [type(leaf) for leaf in element] == [np.ndarray, np.ndarray]
        assert np.shares_memory(element[0], x)
        assert element[1].tolist() == [0, 1, 2]

    async def test_drop_remainder_drops_the_final_partial_batch(self) -> None:
        """drop_remainder=True drops a global batch smaller than the first."""
        strategy = MirroredStrategy(host_devices(2))
        kept = await collect(strategy.distribute_dataset(global_batches(10, 4)))
        dropped = await collect(
            strategy.distribute_dataset(global_batches(10, 4), drop_remainder=True)
        )
        assert [rows_of(y, 2) for _, y in kept] == [
            [[0, 1], [2, 3]],
            [[4, 5], [6, 7]],
            [[8], [9]],
        ]
        assert [rows_of(y, 2) for _, y in dropped] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]

    async def test_drop_remainder_keeps_full_batches(self) -> None:
        """drop_remainder=True keeps a last batch as large as the first."""
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_dataset(global_batches(8, 4), drop_remainder=True)
        assert [rows_of(y, 2) for _, y in await collect(dist)] == [
            [[0, 1], [2, 3]],
            [[4, 5], [6, 7]],
        ]


class TestUnbatchedElements:
    """Elements without a batch dimension (numbers, tuples of them)."""

    @pytest.mark.parametrize("kind", SOURCES)
    async def test_one_replica_takes_unbatched_elements_whole(self, kind: str) -> None:
        """TF's testOneDeviceCPU: with one replica in all, distribute_dataset needs no batch
        dimension (there is nothing to cut); with two, an unbatched element is refused."""
        strategy = MirroredStrategy(host_devices(1))
        dist = strategy.experimental_distribute_dataset(source(kind, list(range(4))))
        assert [int(e) for e in await collect(dist)] == [0, 1, 2, 3]
        two = MirroredStrategy(host_devices(2))
        with pytest.raises(TypeError, match="which has no batch dimension"):
            await collect(two.experimental_distribute_dataset(source(kind, list(range(4)))))


class TestDatasetSources:
    @pytest.mark.parametrize("prefetch", [0, 2])
    @pytest.mark.parametrize("kind", SOURCES)
    async def test_every_kind_of_dataset(self, kind: str, prefetch: int) -> None:
        """Lists, generators and async generators give the same elements, prefetched or not."""
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_dataset(source(kind, global_batches(7, 3)), prefetch=prefetch)
        assert isinstance(dist, DistributedDataset)
        assert [rows_of(y, 2) for _, y in await collect(dist)] == [
            [[0, 1], [2]],
            [[3, 4], [5]],
            [[6], []],
        ]

    async def test_each_iteration_is_a_new_pass(self) -> None:
        """Iterating again over a re-iterable dataset starts from its first batch."""
        strategy = MirroredStrategy(host_devices(2))
        for dataset in (global_batches(5, 2), batched(table(5), 2)):
            dist = strategy.distribute_dataset(dataset)
            first = [rows_of(y, 2) for _, y in await collect(dist)]
            second = [rows_of(y, 2) for _, y in await collect(dist)]
            assert first == second == [[[0], [1]], [[2], [3]], [[4], []]]

    async def test_each_pass_over_shuffled_batches_is_a_new_epoch(self) -> None:
        """Over batched(shuffle=True), each pass is a fresh permutation of every row."""
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_dataset(batched(table(20), 6, shuffle=True, seed=3))
        epochs = []
        for _ in range(2):
            rows: list[int] = []
            async for x, y in dist:
                for x_part, y_part in zip(x.values, y.values, strict=True):
                    np.testing.assert_array_equal(x_part[:, 0], y_part)
                    rows.extend(y_part.tolist())
            epochs.append(rows)
        assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(20))
        assert epochs[0] != epochs[1]


class TestDatasetErrors:
    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_leading_sizes_differ(self, prefetch: int) -> None:
        """Leaves with different leading sizes are a ValueError naming the path and the sizes."""
        strategy = MirroredStrategy(host_devices(2))
        batch = {"a": np.zeros(5), "b": np.zeros((5, 2)), "c": np.zeros(7)}
        dist = strategy.distribute_dataset([batch], prefetch=prefetch)
        with pytest.raises(ValueError, match=mentions(r"\['c'\]", r"\b5\b", r"\b7\b")):
            await collect(dist)

    @pytest.mark.parametrize("prefetch", [0, 2])
    @pytest.mark.parametrize(("leaf", "type_name"), [(3, "int"), (np.array(2.0), "ndarray")])
    async def test_leaf_without_batch_dimension(
        self, leaf: object, type_name: str, prefetch: int
    ) -> None:
        """A leaf without a batch dimension is a TypeError naming its path and type."""
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_dataset([{"x": np.zeros(4), "step": leaf}], prefetch=prefetch)
        with pytest.raises(TypeError, match=mentions(r"\['step'\]", type_name)):
            await collect(dist)

    @pytest.mark.parametrize("prefetch", [0, 2])
    @pytest.mark.parametrize("kind", ["generator", "async generator"])
    async def test_dataset_error_comes_out_unchanged(self, kind: str, prefetch: int) -> None:
        """The dataset's own exception object ends the loop, after the elements before it."""
        strategy = MirroredStrategy(host_devices(2))
        boom = RuntimeError("loader failed")

        def loader() -> Iterator[Array]:
            yield np.arange(4)
            raise boom

        async def aloader() -> AsyncIterator[Array]:
            yield np.arange(4)
            raise boom

        dataset = loader() if kind == "generator" else aloader()
        dist = strategy.distribute_dataset(dataset, prefetch=prefetch)
        before = live_tasks()
        seen: list[Any] = []
        with pytest.raises(RuntimeError, match="loader failed") as info:
            await consume(dist, seen)
        assert info.value is boom
        assert [rows_of(batch, 2) for batch in seen] == [[[0, 1], [2, 3]]]
        await settle(lambda: live_tasks() <= before)
        assert live_tasks() == before

    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_get_next_raises_the_dataset_error(self, prefetch: int) -> None:
        """get_next raises the dataset's own exception object."""
        strategy = MirroredStrategy(host_devices(2))
        boom = KeyError("missing shard")

        async def aloader() -> AsyncIterator[Array]:
            raise boom
            yield np.arange(2)

        it = aiter(strategy.distribute_dataset(aloader(), prefetch=prefetch))
        with pytest.raises(KeyError, match="missing shard") as info:
            await it.get_next()
        assert info.value is boom
        await it.aclose()

    async def test_negative_prefetch(self) -> None:
        """prefetch below 0 is a ValueError."""
        strategy = MirroredStrategy(host_devices(2))
        with pytest.raises(ValueError, match="prefetch"):
            await collect(strategy.distribute_dataset([np.arange(2)], prefetch=-1))


class TestReplicasDataIsTheirs:
    @pytest.mark.parametrize("how", ["batched", "list", "from function", "one replica"])
    async def test_a_step_cannot_edit_the_datasets_arrays(self, how: str) -> None:
        """Host data reaches a replica as a read-only view: an in-place edit in the step raises
        NumPy's ValueError instead of changing the dataset's arrays (TF's tensors are
        immutable), so the next epoch sees the same data."""
        replicas = 1 if how == "one replica" else 2
        strategy = MirroredStrategy(host_devices(replicas))
        data = np.arange(8.0)
        if how == "batched":
            dist = strategy.distribute_dataset(aioreplica.batched(data, 4))
        elif how == "from function":
            dist = strategy.distribute_datasets_from_function(lambda ctx: [data[:2], data[2:4]])
        else:
            dist = strategy.distribute_dataset([data[:4], data[4:]])

        async def step(x: Array) -> None:
            x *= 10

        async with aiter(dist) as it:
            batch = await it.get_next()
            with pytest.raises(ValueError, match="read-only"):
                await strategy.run(step, args=(batch,))
        np.testing.assert_array_equal(data, np.arange(8.0))
        assert data.flags.writeable  # the dataset's own arrays keep their flags

    @pytest.mark.parametrize("kind", ["generator", "async generator"])
    async def test_an_iterator_refilling_one_buffer_is_read_as_it_was(self, kind: str) -> None:
        """With prefetching, elements are pulled while earlier ones are still in use: what an
        iterator yields is copied as it comes, so one that refills the same buffer each time
        still gives every element its own rows."""
        strategy = MirroredStrategy(host_devices(2))
        buffer = np.zeros(2)

        def refilled() -> Iterator[Array]:
            for i in range(5):
                buffer[:] = i
                yield buffer

        async def refilled_async() -> AsyncIterator[Array]:
            for item in refilled():
                yield item

        dataset = refilled() if kind == "generator" else refilled_async()
        seen: list[list[list[int]]] = []
        async with aiter(strategy.distribute_dataset(dataset, prefetch=2)) as it:
            async for batch in it:
                await anyio.wait_all_tasks_blocked()  # the prefetcher pulls ahead meanwhile
                seen.append(rows_of(batch, 2))
        assert seen == [[[float(i)], [float(i)]] for i in range(5)]


class TestPrefetch:
    @pytest.mark.parametrize("prefetch", [0, 2])
    @pytest.mark.parametrize("kind", SOURCES)
    async def test_break_leaves_no_task(self, kind: str, prefetch: int) -> None:
        """Breaking out of the loop mid-epoch leaves no task behind."""
        strategy = MirroredStrategy(host_devices(2))
        dataset = source(kind, global_batches(40, 4))
        dist = strategy.distribute_dataset(dataset, prefetch=prefetch)
        before = live_tasks()
        seen = []
        async for _, y in dist:
            seen.append(rows_of(y, 2))
            if len(seen) == 2:
                break
        await settle(lambda: live_tasks() <= before)
        assert seen == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
        assert live_tasks() == before
        if kind == "async generator":
            await dataset.aclose()  # the test owns it; trio warns about one dropped unfinished

    @pytest.mark.parametrize("prefetch", [0, 2])
    @pytest.mark.parametrize("kind", ["generator", "async generator"])
    async def test_cancel_mid_epoch_leaves_no_task(self, kind: str, prefetch: int) -> None:
        """Cancelling the loop while it waits for the next element leaves no task behind."""
        strategy = MirroredStrategy(host_devices(2))
        stalled = threading.Event()
        release = threading.Event()

        def loader() -> Iterator[Array]:
            yield np.arange(2)
            yield np.arange(2, 4)
            stalled.set()
            release.wait(5)

        async def aloader() -> AsyncIterator[Array]:
            yield np.arange(2)
            yield np.arange(2, 4)
            stalled.set()
            await anyio.sleep_forever()

        dataset = loader() if kind == "generator" else aloader()
        dist = strategy.distribute_dataset(dataset, prefetch=prefetch)
        before = live_tasks()
        seen: list[Any] = []
        async with anyio.create_task_group() as group:
            group.start_soon(consume, dist, seen)
            assert await anyio.to_thread.run_sync(stalled.wait, 5)
            await anyio.wait_all_tasks_blocked()
            group.cancel_scope.cancel()
            release.set()
        await settle(lambda: live_tasks() <= before)
        assert [rows_of(batch, 2) for batch in seen] == [[[0], [1]], [[2], [3]]]
        assert live_tasks() == before

    @pytest.mark.parametrize("prefetch", [0, 2])
    @pytest.mark.parametrize("kind", SOURCES)
    async def test_task_ends_with_the_epoch(self, kind: str, prefetch: int) -> None:
        """After a full pass no task is left."""
        strategy = MirroredStrategy(host_devices(3))
        before = live_tasks()
        dist = strategy.distribute_dataset(source(kind, global_batches(9, 3)), prefetch=prefetch)
        assert len(await collect(dist)) == 3
        await settle(lambda: live_tasks() <= before)
        assert live_tasks() == before

    @pytest.mark.parametrize("kind", ["generator", "async generator"])
    async def test_prefetch_zero_pulls_on_demand(self, kind: str) -> None:
        """With prefetch=0 each element is pulled when asked for, and no task is started."""
        strategy = MirroredStrategy(host_devices(2))
        events: list[tuple[str, int]] = []
        extra_tasks = []

        def loader() -> Iterator[Array]:
            for i in range(3):
                events.append(("pulled", i))
                yield np.full(2, i)

        async def aloader() -> AsyncIterator[Array]:
            for batch in loader():
                yield batch

        dataset = loader() if kind == "generator" else aloader()
        before = live_tasks()
        async for batch in strategy.distribute_dataset(dataset, prefetch=0):
            events.append(("consumed", int(batch.values[0][0])))
            extra_tasks.append(live_tasks() - before)
        assert events == [
            ("pulled", 0),
            ("consumed", 0),
            ("pulled", 1),
            ("consumed", 1),
            ("pulled", 2),
            ("consumed", 2),
        ]
        assert extra_tasks == [0, 0, 0]

    @pytest.mark.parametrize("prefetch", [1, 2, 3])
    @pytest.mark.parametrize("kind", ["generator", "async generator"])
    async def test_runs_ahead_at_most_prefetch_plus_one(self, kind: str, prefetch: int) -> None:
        """The loader runs ahead of the loop, at most prefetch + 1 past the elements asked for."""
        strategy = MirroredStrategy(host_devices(2))
        events: list[tuple[str, int]] = []
        pulled_ahead = threading.Event()

        def loader() -> Iterator[Array]:
            for i in range(8):
                events.append(("pulled", i))
                if i == 1:
                    pulled_ahead.set()
                yield np.full(2, i)

        async def aloader() -> AsyncIterator[Array]:
            for batch in loader():
                yield batch

        dataset = loader() if kind == "generator" else aloader()
        pulled_after_first = []
        async with aiter(strategy.distribute_dataset(dataset, prefetch=prefetch)) as it:
            for i in range(9):
                events.append(("asked", i))
                optional = await it.get_next_as_optional()
                if not optional.has_value():
                    break
                events.append(("got", int(optional.get_value().values[0][0])))
                if i == 0:
                    assert await anyio.to_thread.run_sync(pulled_ahead.wait, 5)
                    await anyio.wait_all_tasks_blocked()
                    pulled_after_first.append(sum(what == "pulled" for what, _ in events))
        assert 2 <= pulled_after_first[0] <= prefetch + 2
        assert [i for what, i in events if what == "pulled"] == list(range(8))
        assert [i for what, i in events if what == "got"] == list(range(8))
        assert most_ahead(events) <= prefetch + 1

    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_sync_loader_does_not_block_the_loop(self, prefetch: int) -> None:
        """A loader blocked on a threading.Event waits in a worker thread, not on the loop."""
        strategy = MirroredStrategy(host_devices(2))
        gate = threading.Event()
        events: list[str] = []

        def loader() -> Iterator[Array]:
            events.append(f"gate opened: {gate.wait(5)}")
            yield np.arange(2)

        async def open_gate() -> None:
            await anyio.wait_all_tasks_blocked()
            events.append("loop ran")
            gate.set()

        seen: list[Any] = []
        async with anyio.create_task_group() as group:
            group.start_soon(open_gate)
            await consume(strategy.distribute_dataset(loader(), prefetch=prefetch), seen)
        assert events == ["loop ran", "gate opened: True"]
        assert [rows_of(batch, 2) for batch in seen] == [[[0], [1]]]


class TestDistributedIterator:
    async def test_get_next_until_stop(self) -> None:
        """get_next returns the elements in order, then raises StopAsyncIteration."""
        strategy = MirroredStrategy(host_devices(2))
        it = aiter(strategy.distribute_dataset(global_batches(6, 4)))
        assert isinstance(it, DistributedIterator)
        first = await it.get_next()
        second = await it.get_next()
        with pytest.raises(StopAsyncIteration):
            await it.get_next()
        await it.aclose()
        assert [rows_of(y, 2) for _, y in (first, second)] == [[[0, 1], [2, 3]], [[4], [5]]]

    @pytest.mark.parametrize("prefetch", [0, 2])
    @pytest.mark.parametrize("kind", [*SOURCES, "batched"])
    async def test_tasks_sharing_an_iterator_take_each_element_once(
        self, kind: str, prefetch: int
    ) -> None:
        """Several tasks calling get_next on one iterator each get whole elements, every
        element once, and all of them StopAsyncIteration at the end (with prefetch=0 they pull
        in turn rather than into one another's pull)."""
        strategy = MirroredStrategy(host_devices(2))
        if kind == "batched":
            data: Any = aioreplica.batched(table(12), 2)
        else:
            data = source(kind, global_batches(12, 2))
        it = aiter(strategy.distribute_dataset(data, prefetch=prefetch))
        got: list[list[list[int]]] = []
        ended: list[str] = []

        async def take(name: str) -> None:
            while True:
                try:
                    _, y = await it.get_next()
                except StopAsyncIteration:
                    ended.append(name)
                    return
                got.append(rows_of(y, 2))
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            for name in ("a", "b", "c"):
                tg.start_soon(take, name)
        await it.aclose()
        assert sorted(ended) == ["a", "b", "c"]
        assert sorted(got) == [[[i], [i + 1]] for i in range(0, 12, 2)]

    async def test_get_next_as_optional(self) -> None:
        """get_next_as_optional holds each element, then an empty optional."""
        strategy = MirroredStrategy(host_devices(2))
        async with aiter(strategy.distribute_dataset([np.arange(3)])) as it:
            present = await it.get_next_as_optional()
            empty = await it.get_next_as_optional()
        assert present.has_value()
        assert rows_of(present.get_value(), 2) == [[0, 1], [2]]
        assert not empty.has_value()
        with pytest.raises(ValueError, match=r"(?i)no value|empty"):
            empty.get_value()

    @pytest.mark.parametrize("kind", SOURCES)
    async def test_async_with_stops_the_prefetch_task(self, kind: str) -> None:
        """Leaving ``async with aiter(dist)`` mid-epoch ends the prefetch task before it returns."""
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_dataset(source(kind, global_batches(40, 4)), prefetch=2)
        before = live_tasks()
        async with aiter(dist) as it:
            _, y = await it.get_next()
        assert live_tasks() == before
        assert rows_of(y, 2) == [[0, 1], [2, 3]]

    async def test_aclose_stops_the_prefetch_task(self) -> None:
        """aclose mid-epoch ends the prefetch task before it returns."""
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_dataset(source("async generator", global_batches(40, 4)))
        before = live_tasks()
        it = aiter(dist)
        await it.get_next()
        await anyio.wait_all_tasks_blocked()
        await it.aclose()
        assert live_tasks() == before


class TestRunOnElements:
    async def test_step_sees_its_own_slice(self) -> None:
        """strategy.run on an element gives each replica its own slice of the global batch."""
        strategy = MirroredStrategy(host_devices(3))

        async def step(batch: Table) -> tuple[int, Array]:
            x, y = batch
            return x.shape[0], y

        sizes = []
        async for x, y in strategy.distribute_dataset(batched(table(10), 4)):
            size, labels = await strategy.run(step, args=((x, y),))
            sizes.append(list(size.values))
            assert all(got is mine for got, mine in zip(labels.values, y.values, strict=True))
        assert sizes == [[2, 1, 1], [2, 1, 1], [1, 1, 0]]


class TestDistributeDatasetsFromFunction:
    async def test_called_once_with_an_input_context(self) -> None:
        """dataset_fn is called once, with one pipeline for all the strategy's replicas."""
        strategy = MirroredStrategy(host_devices(3))
        calls: list[InputContext] = []

        def dataset_fn(context: InputContext) -> list[Array]:
            calls.append(context)
            size = context.get_per_replica_batch_size(6)
            return [np.arange(i * size, (i + 1) * size) for i in range(3)]

        dist = strategy.distribute_datasets_from_function(dataset_fn)
        assert [rows_of(element, 3) for element in await collect(dist)] == [
            [[0, 1], [2, 3], [4, 5]]
        ]
        assert [
            (c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in calls
        ] == [(1, 0, 3)]
        assert all(isinstance(c, InputContext) for c in calls)

    @pytest.mark.parametrize("prefetch", [0, 2])
    @pytest.mark.parametrize("kind", SOURCES)
    async def test_replica_r_gets_the_rth_batch_of_each_round(
        self, kind: str, prefetch: int
    ) -> None:
        """Per-replica batches go round-robin: replica r gets the r-th of each round."""
        strategy = MirroredStrategy(host_devices(2))
        batches = global_batches(8, 2)
        dist = strategy.distribute_datasets_from_function(
            lambda context: source(kind, batches), prefetch=prefetch
        )
        assert [rows_of(y, 2) for _, y in await collect(dist)] == [
            [[0, 1], [2, 3]],
            [[4, 5], [6, 7]],
        ]

    async def test_runs_out_mid_round(self) -> None:
        """The replicas past the end of the last round get zero rows shaped like the last batch."""
        strategy = MirroredStrategy(host_devices(3))
        batches = global_batches(8, 2)
        elements = await collect(strategy.distribute_datasets_from_function(lambda c: batches))
        assert [rows_of(y, 3) for _, y in elements] == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [], []]]
        last_x, last_y = elements[-1]
        assert [(p.shape, p.dtype.name) for p in last_x.values] == [
            ((2, 3), "float32"),
            ((0, 3), "float32"),
            ((0, 3), "float32"),
        ]
        assert [(p.shape, p.dtype.name) for p in last_y.values] == [
            ((2,), "int64"),
            ((0,), "int64"),
            ((0,), "int64"),
        ]

    async def test_runs_out_at_a_round_boundary(self) -> None:
        """A dataset that ends with a full round ends the iteration there."""
        strategy = MirroredStrategy(host_devices(2))
        batches = [np.arange(2 * i, 2 * i + 2) for i in range(4)]
        elements = await collect(strategy.distribute_datasets_from_function(lambda c: batches))
        assert [rows_of(element, 2) for element in elements] == [
            [[0, 1], [2, 3]],
            [[4, 5], [6, 7]],
        ]

    async def test_one_replica_gets_each_batch(self) -> None:
        """With one replica each batch is one element, as plain arrays."""
        strategy = MirroredStrategy(host_devices(1))
        batches = [np.arange(2), np.arange(2, 5)]
        elements = await collect(strategy.distribute_datasets_from_function(lambda c: batches))
        assert [rows_of(element, 1) for element in elements] == [[[0, 1]], [[2, 3, 4]]]

    @pytest.mark.parametrize("kind", SOURCES)
    async def test_elements_without_a_batch_dimension(self, kind: str) -> None:
        """TF's testReplicateDataset: elements need no batch dimension (numbers, tuples of
        them): replica r gets the r-th element of each round, placed on its device."""
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_datasets_from_function(
            lambda context: source(kind, [(i, i * i) for i in range(6)])
        )
        got = [strategy.experimental_local_results(e) for e in await collect(dist)]
        assert [[(int(a), int(b)) for a, b in element] for element in got] == [
            [(0, 0), (1, 1)],
            [(2, 4), (3, 9)],
            [(4, 16), (5, 25)],
        ]
        assert all(isinstance(a, np.ndarray) for element in got for a, _ in element)

    async def test_elements_without_a_batch_dimension_running_out_mid_round(self) -> None:
        """Replicas left without such an element cannot get an empty batch: TypeError saying
        so, after the full rounds."""
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_datasets_from_function(lambda context: range(3))
        got: list[Any] = []

        async def take() -> None:
            async for element in dist:
                got.append(strategy.experimental_local_results(element))  # noqa: PERF401

        with pytest.raises(
            TypeError,
            match=r"^distribute_datasets_from_function: the dataset ran out after 1 of this "
            r"round's elements, and its elements have no batch dimension \(one is 2\), so the "
            r"replicas left without data cannot get empty batches; give every replica an "
            r"element in every round, or batch the elements$",
        ):
            await take()
        assert [[int(x) for x in element] for element in got] == [[0, 1]]

    @pytest.mark.parametrize(
        ("prefetch", "error"), [(-1, ValueError), (True, TypeError), (1.5, TypeError)]
    )
    async def test_bad_prefetch(self, prefetch: Any, error: type[Exception]) -> None:
        """prefetch below 0, or not an int, is refused before dataset_fn makes anything."""
        strategy = MirroredStrategy(host_devices(2))
        calls: list[InputContext] = []

        def dataset_fn(context: InputContext) -> list[Array]:
            calls.append(context)
            return [np.arange(2)]

        with pytest.raises(error, match=f"prefetch must be an int >= 0, got {prefetch!r}"):
            strategy.distribute_datasets_from_function(dataset_fn, prefetch=prefetch)
        assert calls == []

    def test_dataset_fn_must_be_callable(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with pytest.raises(
            TypeError, match=r"dataset_fn must be callable \(InputContext -> dataset\), got list"
        ):
            strategy.distribute_datasets_from_function([np.arange(2)])  # type: ignore[arg-type]


async def pulls_ahead(strategy: MirroredStrategy, make: Callable[[Any], Any]) -> int:
    """How many elements a pass has pulled once its first is taken and its prefetching has
    stopped: ``make(source)`` makes the distributed dataset."""
    pulled: list[int] = []

    async def numbers() -> AsyncIterator[Array]:
        for i in range(20):
            pulled.append(i)
            yield np.arange(2)

    iterator = aiter(make(numbers()))
    await anext(iterator)
    await anyio.wait_all_tasks_blocked()
    await iterator.aclose()
    return len(pulled)


class TestInputOptions:
    """TF's tf.distribute.InputOptions, passed as the dataset functions' ``options``."""

    async def test_per_replica_pipelines(self) -> None:
        """PER_REPLICA: dataset_fn is called once per replica, with that replica's pipeline,
        and each replica gets its own dataset's elements (a shorter one gets empty batches)."""
        strategy = MirroredStrategy(host_devices(3))
        contexts: list[InputContext] = []

        def dataset_fn(context: InputContext) -> list[Array]:
            contexts.append(context)
            r = context.input_pipeline_id
            return [np.full(2, 10 * r + i) for i in range(3 if r < 2 else 2)]

        options = aioreplica.InputOptions(
            experimental_replication_mode=aioreplica.InputReplicationMode.PER_REPLICA
        )
        got = [
            [part.tolist() for part in strategy.experimental_local_results(element)]
            async for element in strategy.distribute_datasets_from_function(dataset_fn, options)
        ]
        assert [(c.num_input_pipelines, c.input_pipeline_id) for c in contexts] == [
            (3, 0),
            (3, 1),
            (3, 2),
        ]
        assert got == [
            [[0, 0], [10, 10], [20, 20]],
            [[1, 1], [11, 11], [21, 21]],
            [[2, 2], [12, 12], []],
        ]

    @pytest.mark.parametrize("kind", SOURCES)
    async def test_per_replica_pipelines_of_any_source(self, kind: str) -> None:
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_datasets_from_function(
            lambda c: source(kind, [np.array([c.input_pipeline_id, i]) for i in range(2)]),
            aioreplica.InputOptions(experimental_replication_mode="per_replica"),
        )
        got = [[p.tolist() for p in strategy.experimental_local_results(e)] async for e in dist]
        assert got == [[[0, 0], [1, 0]], [[0, 1], [1, 1]]]

    async def test_per_replica_pipelines_every_epoch(self) -> None:
        """Each pass over a PER_REPLICA dataset starts every replica's dataset over, as a
        PER_WORKER pass does."""
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_datasets_from_function(
            lambda c: [np.full(1, 10 * c.input_pipeline_id + i) for i in range(2)],
            aioreplica.InputOptions(experimental_replication_mode="per_replica"),
        )
        epochs = [[strategy.experimental_local_results(e) for e in await collect(dist)]]
        epochs.append([strategy.experimental_local_results(e) for e in await collect(dist)])
        assert [[[int(p[0]) for p in e] for e in epoch] for epoch in epochs] == [
            [[0, 10], [1, 11]]
        ] * 2

    @pytest.mark.parametrize("kind", SOURCES)
    @pytest.mark.parametrize(
        ("lengths", "last"),
        [((3, 2, 3), [[2], [], [22]]), ((2, 3, 3), [[], [12], [22]]), ((3, 3, 2), [[2], [12], []])],
    )
    async def test_per_replica_pipelines_go_on_while_any_has_data(
        self, kind: str, lengths: tuple[int, ...], last: list[list[int]]
    ) -> None:
        """Replicas' datasets of different lengths: every batch reaches its replica, whichever
        ran out first; a replica whose dataset ended gets empty batches until all have."""
        strategy = MirroredStrategy(host_devices(3))

        def dataset_fn(context: InputContext) -> Any:
            r = context.input_pipeline_id
            return source(kind, [np.full(1, 10 * r + i) for i in range(lengths[r])])

        dist = strategy.distribute_datasets_from_function(
            dataset_fn, aioreplica.InputOptions(experimental_replication_mode="per_replica")
        )
        got = [rows_of(element, 3) for element in await collect(dist)]
        assert got == [[[0], [10], [20]], [[1], [11], [21]], last]

    async def test_a_blocking_loader_beside_an_async_one_leaves_the_loop_free(self) -> None:
        """PER_REPLICA datasets of both kinds: the synchronous one is pulled on a loader
        thread, so the event loop runs on while it blocks."""
        strategy = MirroredStrategy(host_devices(2))
        started, release = threading.Event(), threading.Event()
        events: list[str] = []

        async def fast() -> AsyncIterator[Array]:
            for i in range(2):
                yield np.full(1, i)

        def slow() -> Iterator[Array]:
            for i in range(2):
                events.append(f"pull {i}")
                started.set()
                release.wait(2)  # bounded: a blocked loop fails the test instead of hanging
                yield np.full(1, 10 + i)

        async def release_the_loader() -> None:
            await settle(started.is_set)
            events.append("the loop ran")
            release.set()

        dist = strategy.distribute_datasets_from_function(
            lambda c: fast() if c.input_pipeline_id == 0 else slow(),
            aioreplica.InputOptions(experimental_replication_mode="per_replica"),
            prefetch=0,
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(release_the_loader)
            got = [rows_of(element, 2) for element in await collect(dist)]
        assert events == ["pull 0", "the loop ran", "pull 1"]
        assert got == [[[0], [10]], [[1], [11]]]

    @pytest.mark.parametrize("mode", ["per_worker", "per_replica"])
    def test_an_async_dataset_fn_is_refused(self, mode: str) -> None:
        """A dataset_fn that is a coroutine function: a TypeError saying what to do, and its
        coroutines closed (no "never awaited" warning)."""
        strategy = MirroredStrategy(host_devices(2))

        async def dataset_fn(context: InputContext) -> list[Array]:
            return [np.arange(2)]

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(
                TypeError,
                match=mentions(
                    "got a coroutine",
                    "dataset_fn must return the dataset",
                    "not a coroutine function",
                ),
            ):
                strategy.distribute_datasets_from_function(
                    dataset_fn, aioreplica.InputOptions(experimental_replication_mode=mode)
                )
            gc.collect()
        assert [str(w.message) for w in caught] == []

    @pytest.mark.parametrize("mode", ["per_worker", "per_replica"])
    @pytest.mark.parametrize("made", [5, "ab", b"ab"], ids=["a number", "a string", "bytes"])
    def test_what_dataset_fn_returns_is_checked(self, made: Any, mode: str) -> None:
        """What dataset_fn returns (for each replica with PER_REPLICA) is checked at once:
        something not iterable, or a string, whose items are characters, not batches."""
        strategy = MirroredStrategy(host_devices(2))
        with pytest.raises(TypeError, match="a dataset must be an iterable or async iterable"):
            strategy.distribute_datasets_from_function(
                lambda c: made, aioreplica.InputOptions(experimental_replication_mode=mode)
            )

    async def test_buffer_size_is_the_default_prefetch(self) -> None:
        """experimental_per_replica_buffer_size makes as many elements ahead as the same
        prefetch; an explicit prefetch wins; no options keep the default of 2."""
        strategy = MirroredStrategy(host_devices(2))

        def with_options(size: int) -> Callable[[Any], Any]:
            options = aioreplica.InputOptions(experimental_per_replica_buffer_size=size)
            return lambda data: strategy.distribute_dataset(data, options)

        def with_prefetch(size: int) -> Callable[[Any], Any]:
            return lambda data: strategy.distribute_dataset(data, prefetch=size)

        for size in (0, 1, 4):
            assert await pulls_ahead(strategy, with_options(size)) == await pulls_ahead(
                strategy, with_prefetch(size)
            )
        explicit = aioreplica.InputOptions(experimental_per_replica_buffer_size=4)
        assert await pulls_ahead(
            strategy, lambda data: strategy.distribute_dataset(data, explicit, prefetch=0)
        ) == await pulls_ahead(strategy, lambda data: strategy.distribute_dataset(data, prefetch=0))
        assert await pulls_ahead(strategy, strategy.distribute_dataset) == await pulls_ahead(
            strategy, lambda data: strategy.distribute_dataset(data, prefetch=2)
        )

    async def test_fetch_to_device_on_simulated_gpus(self, cp: Any) -> None:
        """By default each replica's slice is placed on its GPU; with
        experimental_fetch_to_device=False it stays a host array."""
        strategy = MirroredStrategy(["gpu:0", "gpu:1"])
        batches = [np.arange(4.0)]
        placed = [e async for e in strategy.experimental_distribute_dataset(batches)]
        kept = [
            e
            async for e in strategy.experimental_distribute_dataset(
                batches, aioreplica.InputOptions(experimental_fetch_to_device=False)
            )
        ]
        assert [type(p).__module__.split(".")[0] for p in placed[0].values] == ["cupy"] * 2
        assert [type(p) for p in kept[0].values] == [np.ndarray] * 2
        assert [p.tolist() for p in kept[0].values] == [[0.0, 1.0], [2.0, 3.0]]

    @pytest.mark.parametrize(
        ("kwargs", "error", "message"),
        [
            (
                {"experimental_place_dataset_on_device": True},
                ValueError,
                "needs experimental_replication_mode=InputReplicationMode.PER_REPLICA",
            ),
            (
                {
                    "experimental_place_dataset_on_device": True,
                    "experimental_replication_mode": "per_replica",
                    "experimental_fetch_to_device": True,
                },
                ValueError,
                "cannot go with experimental_fetch_to_device=True",
            ),
            ({"experimental_replication_mode": "x"}, ValueError, "unknown input replication"),
            ({"experimental_per_replica_buffer_size": -1}, ValueError, "must be >= 0, got -1"),
            ({"experimental_per_replica_buffer_size": 1.5}, TypeError, "must be an int"),
            ({"experimental_fetch_to_device": 1}, TypeError, "must be a bool or None, got 1"),
        ],
    )
    def test_bad_options(self, kwargs: dict[str, Any], error: type, message: str) -> None:
        with pytest.raises(error, match=re.escape(message)):
            aioreplica.InputOptions(**kwargs)

    def test_options_the_dataset_functions_refuse(self) -> None:
        """PER_REPLICA is for distribute_datasets_from_function only; options of another
        type are a TypeError; both before anything is pulled or made."""
        strategy = MirroredStrategy(host_devices(2))
        per_replica = aioreplica.InputOptions(experimental_replication_mode="per_replica")
        with pytest.raises(ValueError, match=r"PER_REPLICA is only for distribute_datasets_from"):
            strategy.experimental_distribute_dataset([np.arange(2)], per_replica)
        calls: list[InputContext] = []
        with pytest.raises(TypeError, match=r"options must be an aioreplica.InputOptions or None"):
            strategy.distribute_datasets_from_function(calls.append, {"x": 1})  # type: ignore[arg-type]
        assert calls == []


class TestInputContext:
    def test_defaults(self) -> None:
        """By default there is one pipeline, number 0, for one replica."""
        context = InputContext()
        assert (
            context.num_input_pipelines,
            context.input_pipeline_id,
            context.num_replicas_in_sync,
        ) == (1, 0, 1)

    def test_per_replica_batch_size(self) -> None:
        """The global batch size divides evenly over the replicas."""
        context = InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=4)
        assert context.get_per_replica_batch_size(64) == 16

    def test_str_and_repr(self) -> None:
        """str() says what TF's does; repr() names every field."""
        context = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
        assert str(context) == "InputContext(input pipeline id 1, total: 2)"
        assert repr(context) == (
            "InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)"
        )

    @pytest.mark.parametrize(
        ("fields", "error", "message"),
        [
            ({"num_replicas_in_sync": 0}, ValueError, "num_replicas_in_sync must be an int >= 1"),
            ({"num_input_pipelines": -1}, ValueError, "num_input_pipelines must be an int >= 1"),
            ({"num_replicas_in_sync": 2.0}, TypeError, "num_replicas_in_sync must be an int"),
            (
                {"num_input_pipelines": 2, "input_pipeline_id": 2},
                ValueError,
                "input_pipeline_id must be an int from 0 to 1",
            ),
            ({"input_pipeline_id": True}, TypeError, "input_pipeline_id must be an int"),
        ],
    )
    def test_bad_fields(self, fields: dict[str, Any], error: type, message: str) -> None:
        """Counts below one, a pipeline id out of range, or fields that are not ints."""
        with pytest.raises(error, match=re.escape(message)):
            InputContext(**fields)

    @pytest.mark.parametrize(
        ("size", "error"), [(8.0, TypeError), (True, TypeError), ("8", TypeError), (-8, ValueError)]
    )
    def test_bad_global_batch_size(self, size: Any, error: type) -> None:
        """A global batch size that is not an int >= 0 is refused, naming it."""
        with pytest.raises(error, match=re.escape("global_batch_size must be an int >= 0, got")):
            InputContext(num_replicas_in_sync=2).get_per_replica_batch_size(size)

    def test_numpy_integers_are_ints(self) -> None:
        """NumPy's integers count as ints, and become Python ints."""
        replicas: Any = np.int64(2)
        context = InputContext(num_replicas_in_sync=replicas)
        assert type(context.num_replicas_in_sync) is int
        assert context.get_per_replica_batch_size(np.int64(8)) == 4  # type: ignore[arg-type]

    def test_batch_size_not_divisible(self) -> None:
        """A global batch size the replicas do not divide is a ValueError naming both numbers."""
        context = InputContext(num_replicas_in_sync=4)
        with pytest.raises(ValueError, match=mentions(r"\b10\b", r"\b4\b")):
            context.get_per_replica_batch_size(10)


class TestDistributeValuesFromFunction:
    def test_value_fn_must_be_callable(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with pytest.raises(
            TypeError, match=r"value_fn must be callable \(ValueContext -> value\), got list"
        ):
            strategy.experimental_distribute_values_from_function([1, 2])  # type: ignore[arg-type]

    async def test_one_value_per_replica(self) -> None:
        """value_fn is called once per replica, in order, with that replica's ValueContext."""
        strategy = MirroredStrategy(host_devices(3))
        calls: list[tuple[int, int]] = []

        def value_fn(context: ValueContext) -> Array:
            assert isinstance(context, ValueContext)
            calls.append((context.replica_id_in_sync_group, context.num_replicas_in_sync))
            return np.full(2, context.replica_id_in_sync_group * 10)

        values = strategy.experimental_distribute_values_from_function(value_fn)
        assert isinstance(values, PerReplica)
        assert [v.tolist() for v in values.values] == [[0, 0], [10, 10], [20, 20]]
        assert calls == [(0, 3), (1, 3), (2, 3)]

    async def test_step_sees_its_value(self) -> None:
        """strategy.run passes each replica the value made for it."""
        strategy = MirroredStrategy(host_devices(2))
        values = strategy.experimental_distribute_values_from_function(
            lambda context: f"replica {context.replica_id_in_sync_group}"
        )

        def step(value: str) -> str:
            return value.upper()

        result = await strategy.run(step, args=(values,))
        assert result.values == ("REPLICA 0", "REPLICA 1")

    async def test_structures_reduce_and_gather_leaf_by_leaf(self) -> None:
        """A value_fn returning a structure: reduce, gather and a step's all_reduce take the
        PerReplica of structures as the structure of per-replica values, leaf by leaf."""
        strategy = MirroredStrategy(host_devices(2))
        values = strategy.experimental_distribute_values_from_function(
            lambda context: {
                "id": np.array([float(context.replica_id_in_sync_group)]),
                "rows": (np.full((context.replica_id_in_sync_group + 1, 2), 2.0),),
            }
        )
        total = await strategy.reduce(ReduceOp.SUM, values, axis=0)
        assert total["id"].tolist() == 1.0
        assert total["rows"][0].tolist() == [6.0, 6.0]
        gathered = await strategy.gather(values, axis=0)
        assert gathered["id"].tolist() == [0.0, 1.0]
        assert gathered["rows"][0].tolist() == [[2.0, 2.0]] * 3

        async def step(value: dict[str, Any]) -> Any:
            return await replica_context().all_reduce(ReduceOp.MAX, value["id"])

        results = strategy.experimental_local_results(await strategy.run(step, args=(values,)))
        assert [r.tolist() for r in results] in ([[1.0]], [[1.0]] * 2)  # one when shared

    async def test_structures_that_differ_are_refused(self) -> None:
        """Replicas whose structures differ: a ValueError naming the collective, both
        replicas and the keys."""
        strategy = MirroredStrategy(host_devices(2))
        values = PerReplica([{"a": np.ones(1)}, {"b": np.ones(1)}])
        with pytest.raises(ValueError, match=mentions("reduce", "replica 1", "'a'", "'b'")):
            await strategy.reduce(ReduceOp.SUM, values, axis=None)

    def test_an_async_value_fn_is_refused(self) -> None:
        """A coroutine function as value_fn: a TypeError saying what to do, and its coroutine
        closed (no "never awaited" warning)."""
        strategy = MirroredStrategy(host_devices(2))

        async def value_fn(context: ValueContext) -> int:
            return context.replica_id_in_sync_group

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(
                TypeError,
                match=mentions(
                    "value_fn returned a coroutine for replica 0",
                    "not a coroutine function",
                ),
            ):
                strategy.experimental_distribute_values_from_function(value_fn)
            gc.collect()
        assert [str(w.message) for w in caught] == []

    def test_value_context_fields(self) -> None:
        """ValueContext holds the replica id and the replica count."""
        context = ValueContext(2, 4)
        assert (context.replica_id_in_sync_group, context.num_replicas_in_sync) == (2, 4)


class TestBatched:
    def test_consecutive_views(self) -> None:
        """Batches are consecutive views of at most batch_size rows, the last one smaller."""
        x, y = table(10)
        batches = list(batched((x, y), 4))
        assert [b_y.tolist() for _, b_y in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        assert all(np.shares_memory(b_x, x) and np.shares_memory(b_y, y) for b_x, b_y in batches)
        np.testing.assert_array_equal(batches[2][0], x[8:])

    @pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffle"])
    def test_batches_are_read_only(self, shuffle: bool) -> None:
        """A step cannot change the data of later epochs through a batch: batches are
        read-only, shuffled or not, and the caller's arrays stay writable."""
        x = np.arange(6.0)
        data = batched(x, 3, shuffle=shuffle, seed=0 if shuffle else None)
        refused = []
        for batch in data:
            with pytest.raises(ValueError, match="read-only") as info:
                batch -= batch.mean()
            refused.append(info.type)
        assert (refused, x.tolist(), x.flags.writeable) == (
            [ValueError, ValueError],
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
            True,
        )

    def test_nested_structure(self) -> None:
        """Nested structures come out with the same containers and keys."""
        x, y = table(3)
        batches = list(batched({"inputs": (x,), "labels": y}, 2))
        assert [list(b) for b in batches] == [["inputs", "labels"]] * 2
        assert [(b["inputs"][0].shape, b["labels"].tolist()) for b in batches] == [
            ((2, 3), [0, 1]),
            ((1, 3), [2]),
        ]

    def test_batch_larger_than_the_data(self) -> None:
        """A batch size above the row count gives one batch of every row."""
        assert [b.tolist() for b in batched(np.arange(3), 10)] == [[0, 1, 2]]

    def test_each_iteration_is_an_epoch(self) -> None:
        """Iterating again starts a new epoch from the first row."""
        data = batched(np.arange(5), 2)
        assert [b.tolist() for b in data] == [b.tolist() for b in data] == [[0, 1], [2, 3], [4]]

    def test_shuffle_each_epoch_a_fresh_permutation(self) -> None:
        """With shuffle=True each epoch covers every row once, rows kept aligned, order new."""
        data = batched(table(20), 6, shuffle=True, seed=11)
        epochs = []
        for _ in range(2):
            rows: list[int] = []
            sizes = []
            for x, y in data:
                np.testing.assert_array_equal(x[:, 0], y)
                rows.extend(y.tolist())
                sizes.append(len(y))
            assert sizes == [6, 6, 6, 2]
            assert sorted(rows) == list(range(20))
            epochs.append(rows)
        assert epochs[0] != epochs[1]

    def test_same_seed_same_epochs(self) -> None:
        """The same seed gives the same sequence of epochs."""

        def epochs(seed: int) -> list[list[int]]:
            data = batched(np.arange(12), 5, shuffle=True, seed=seed)
            return [[row for b in data for row in b.tolist()] for _ in range(3)]

        assert epochs(4) == epochs(4)
        assert epochs(4) != epochs(5)

    def test_shuffle_without_seed_covers_every_row(self) -> None:
        """shuffle=True with no seed still gives every row once per epoch."""
        rows = [row for b in batched(np.arange(9), 4, shuffle=True) for row in b.tolist()]
        assert sorted(rows) == list(range(9))

    @pytest.mark.parametrize("shuffle", ["yes", 1, None])
    def test_shuffle_must_be_a_bool(self, shuffle: Any) -> None:
        """shuffle="no" would shuffle (a non-empty string is true): refused."""
        with pytest.raises(TypeError, match=f"shuffle must be True or False, got {shuffle!r}"):
            batched(np.arange(4), 2, shuffle=shuffle)

    @pytest.mark.parametrize("batch_size", [0, -1])
    def test_batch_size_below_one(self, batch_size: int) -> None:
        """batch_size below 1 is a ValueError."""
        with pytest.raises(ValueError, match=f"^batch_size must be an int >= 1, got {batch_size}$"):
            list(batched(np.arange(4), batch_size))

    @pytest.mark.parametrize("batch_size", [True, 2.0, "2", None])
    def test_batch_size_of_another_type(self, batch_size: Any) -> None:
        """A batch_size that is no int (a bool, an int to Python, included) is a TypeError."""
        shown = re.escape(f"got {type(batch_size).__name__} {batch_size!r}")
        with pytest.raises(TypeError, match=f"^batch_size must be an int >= 1, {shown}$"):
            batched(np.arange(4), batch_size)

    @pytest.mark.parametrize(
        ("seed", "error", "shown"),
        [
            (-1, ValueError, "-1"),
            (True, TypeError, "bool True"),
            (1.5, TypeError, "float 1.5"),
            ("x", TypeError, "str 'x'"),
            ([1], TypeError, "list [1]"),
        ],
    )
    def test_seed_must_be_an_int(self, seed: Any, error: type[Exception], shown: str) -> None:
        """A seed is an int >= 0 or None, as NumPy's generator takes (a bool is no int)."""
        with pytest.raises(
            error, match=f"^seed must be an int >= 0 or None, got {re.escape(shown)}$"
        ):
            batched(np.arange(4), 2, shuffle=True, seed=seed)

    def test_numpy_integer_seeds(self) -> None:
        """NumPy's integers and 0-d integer arrays seed as the int they hold."""
        orders = [
            [b.tolist() for b in batched(np.arange(6), 2, shuffle=True, seed=seed)]
            for seed in (3, np.int64(3), np.array(3))
        ]
        assert orders[1:] == [orders[0]] * 2

    def test_seed_without_shuffle_refused(self) -> None:
        """A seed with shuffle=False would seed nothing: refused, as MirroredStrategy refuses
        a seed without interleave='random'."""
        with pytest.raises(
            ValueError,
            match=r"^seed=3 only applies to shuffle=True, whose permutations it seeds; pass "
            r"shuffle=True with it, or no seed$",
        ):
            batched(np.arange(4), 2, seed=3)

    def test_leading_sizes_differ(self) -> None:
        """Arrays with different leading sizes are a ValueError naming the sizes."""
        with pytest.raises(ValueError, match=mentions(r"\b10\b", r"\b9\b")):
            list(batched((np.zeros(10), np.zeros(9)), 4))
