"""Distributed datasets at their edges: smaller batches mid-stream, refilled buffers and where
they are copied, given-up waits in async generators, iterators outliving their event loop or
going on in another, contexts, arrays as datasets, rounds that differ in structure, and
``DistributedDataset.reduce``.

Every async test runs on asyncio, uvloop and trio. Elements are small NumPy arrays whose values
say which pull made them.
"""

from __future__ import annotations

import contextvars
import re
import threading
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest
from messages import mentions

import aioreplica
from aioreplica import InputOptions, MirroredStrategy
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]

#: The longest a blocked pull waits for its release (far beyond any test's own waits).
BLOCK_S = 10.0
#: The timeout the tests put around a wait that cannot end by itself.
GIVE_UP_S = 0.05
#: Values in one row of a big batch: 2 MiB of float64, an array too big to copy on the loop.
BIG_ROW = 1 << 18

EPOCH: contextvars.ContextVar[str] = contextvars.ContextVar("EPOCH", default="unset")


def firsts(element: Any) -> list[int | None]:
    """Each replica's first value of an element of one leaf (None for an empty batch)."""
    return [int(part[0]) if len(part) else None for part in element.values]


def sizes(element: Any) -> int:
    """The rows of the global batch an element was cut from."""
    return sum(len(part) for part in element.values)


class CopyWatched(np.ndarray[Any, Any]):
    """An array that notes the thread each copy of it is made on, in ``copied_on``."""

    copied_on: list[int]

    def copy(self, *args: Any, **kwargs: Any) -> Any:
        self.copied_on.append(threading.get_ident())
        return np.asarray(self).copy(*args, **kwargs)


def watched(array: Array, copied_on: list[int]) -> Array:
    """``array`` as a ``CopyWatched`` view noting its copies' threads in ``copied_on``."""
    view = array.view(CopyWatched)
    view.copied_on = copied_on
    return view


def corners(element: Any) -> list[int]:
    """Each replica's first value of an element of one two-dimensional leaf."""
    return [int(part[0, 0]) for part in element.values]


def refilling(count: int, rows: int = 2) -> Iterator[Array]:
    """A loader that refills one buffer each time: pull ``i`` is ``rows`` values ``i``."""
    buffer = np.zeros(rows, np.int64)
    for i in range(count):
        buffer[:] = i
        yield buffer


class TestDropRemainder:
    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_only_a_last_smaller_batch_is_dropped(self, prefetch: int) -> None:
        """A batch smaller than the first in the middle of the data is split as any other;
        only the last one is dropped."""
        strategy = MirroredStrategy(host_devices(2))
        batches = [np.arange(k) + 100 * i for i, k in enumerate([4, 2, 4, 4, 3])]
        dist = strategy.distribute_dataset(batches, drop_remainder=True, prefetch=prefetch)
        assert [sizes(element) async for element in dist] == [4, 2, 4, 4]

    async def test_a_held_smaller_batch_keeps_its_values(self) -> None:
        """Without prefetching, a smaller batch kept while the next is pulled is not
        overwritten by a loader that refills one buffer."""
        strategy = MirroredStrategy(host_devices(2))

        def loader() -> Iterator[Array]:
            buffer = np.zeros(4, np.int64)
            for i, rows in enumerate([4, 2, 4]):
                buffer[:rows] = i
                yield buffer[:rows]

        dist = strategy.distribute_dataset(loader(), drop_remainder=True, prefetch=0)
        assert [firsts(element) async for element in dist] == [[0, 0], [1, 1], [2, 2]]


class TestCopiesOffTheEventLoop:
    async def test_a_loader_copies_each_item_on_its_thread_as_it_pulls(self) -> None:
        """With prefetching, the arrays a synchronous loader yields are copied on its loader
        thread, as part of the pull: the event loop never waits for the copy."""
        strategy = MirroredStrategy(host_devices(2))
        pulled_on: list[int] = []
        copied_on: list[int] = []

        def loader() -> Iterator[Array]:
            buffer = np.zeros(2)
            for i in range(3):
                buffer[:] = i
                pulled_on.append(threading.get_ident())
                yield watched(buffer, copied_on)

        dist = strategy.distribute_dataset(loader(), prefetch=2)
        assert [firsts(element) async for element in dist] == [[0, 0], [1, 1], [2, 2]]
        assert copied_on == pulled_on
        assert threading.get_ident() not in pulled_on

    async def test_big_arrays_of_an_async_generator_are_copied_off_the_loop(self) -> None:
        """With prefetching, big arrays an async generator yields are copied on a worker
        thread, not on the event loop's."""
        strategy = MirroredStrategy(host_devices(2))
        copied_on: list[int] = []

        async def batches() -> AsyncIterator[Array]:
            buffer = np.zeros(2 * BIG_ROW)
            for i in range(3):
                buffer[:] = i
                yield watched(buffer, copied_on)

        dist = strategy.distribute_dataset(batches(), prefetch=2)
        assert [firsts(element) async for element in dist] == [[0, 0], [1, 1], [2, 2]]
        loop = threading.get_ident()
        assert [thread == loop for thread in copied_on] == [False] * 3

    async def test_big_batches_without_prefetch_are_copied_off_the_loop(self) -> None:
        """Without prefetching too, the big batches an async generator yields are copied on a
        worker thread, and keep their values though it refills one buffer."""
        strategy = MirroredStrategy(host_devices(2))
        copied_on: list[int] = []

        async def batches() -> AsyncIterator[Array]:
            buffer = np.zeros((4, BIG_ROW))
            for i, rows in enumerate([4, 2, 4]):
                buffer[:rows] = i
                yield watched(buffer[:rows], copied_on)

        dist = strategy.distribute_dataset(batches(), drop_remainder=True, prefetch=0)
        assert [corners(element) async for element in dist] == [[0, 0], [1, 1], [2, 2]]
        loop = threading.get_ident()
        assert [thread == loop for thread in copied_on] == [False] * 3

    async def test_the_big_batches_of_a_round_are_copied_off_the_loop(self) -> None:
        """Without prefetching, the big batches of a round are copied on a worker thread,
        and each replica gets its own pull's values."""
        strategy = MirroredStrategy(host_devices(2))
        copied_on: list[int] = []

        def loader(_: aioreplica.InputContext) -> Iterator[Array]:
            buffer = np.zeros(2 * BIG_ROW)
            for i in range(4):
                buffer[:] = i
                yield watched(buffer, copied_on)

        dist = strategy.distribute_datasets_from_function(loader, prefetch=0)
        assert [firsts(element) async for element in dist] == [[0, 1], [2, 3]]
        loop = threading.get_ident()
        assert [thread == loop for thread in copied_on] == [False] * 4


class TestRoundsWithoutPrefetch:
    @pytest.mark.parametrize("replicas", [2, 3])
    async def test_each_replica_gets_its_own_pull_of_a_refilled_buffer(self, replicas: int) -> None:
        """With prefetch=0, every replica of a round gets the batch of its own pull, though
        the loader refills one buffer each time."""
        strategy = MirroredStrategy(host_devices(replicas))
        dist = strategy.distribute_datasets_from_function(
            lambda _: refilling(2 * replicas), prefetch=0
        )
        got = [firsts(element) async for element in dist]
        assert got == [list(range(replicas)), list(range(replicas, 2 * replicas))]


class TestRefilledWithoutPrefetch:
    @pytest.mark.parametrize("source", ["dataset", "function"])
    async def test_kept_elements_keep_their_values(self, source: str) -> None:
        """Elements kept over later pulls keep their rows though the loader refills one
        buffer each time, as elements kept with prefetching do."""
        strategy = MirroredStrategy(host_devices(2))
        if source == "dataset":
            dist = strategy.distribute_dataset(refilling(4, rows=2), prefetch=0)
        else:
            dist = strategy.distribute_datasets_from_function(
                lambda _: refilling(4, rows=1), prefetch=0
            )
        kept = [element async for element in dist]
        expected = [[0, 0], [1, 1], [2, 2], [3, 3]] if source == "dataset" else [[0, 1], [2, 3]]
        assert [firsts(element) for element in kept] == expected

    async def test_a_step_keeps_its_batch_while_the_next_is_pulled(self) -> None:
        """A caller pulling the next element while a step still reads its batch (its own
        prefetching) does not change that batch."""
        strategy = MirroredStrategy(host_devices(2))
        pulled = anyio.Event()
        seen: list[tuple[int, int]] = []

        async def step(x: Array) -> None:
            before = int(x[0])
            await pulled.wait()
            seen.append((before, int(x[0])))

        async with aiter(strategy.distribute_dataset(refilling(3), prefetch=0)) as it:
            element = await it.get_next()
            async with anyio.create_task_group() as tg:
                tg.start_soon(strategy.run, step, (element,))
                following = await it.get_next()
                pulled.set()
        assert seen == [(0, 0), (0, 0)]
        assert firsts(following) == [1, 1]


class TestGivenUpWaitsWithoutPrefetch:
    async def test_an_async_generator_ended_by_a_cancel_is_an_error(self) -> None:
        """A given-up wait ends an async generator (the cancellation is raised in it): the
        next wait raises RuntimeError saying so, rather than ending the pass quietly."""
        strategy = MirroredStrategy(host_devices(2))
        never = anyio.Event()

        async def batches() -> AsyncIterator[Array]:
            yield np.arange(2)
            await never.wait()
            yield np.arange(2) + 10

        iterator = aiter(strategy.distribute_dataset(batches(), prefetch=0))
        first = await iterator.get_next()
        with anyio.move_on_after(GIVE_UP_S) as timeout:
            await iterator.get_next()
        with pytest.raises(RuntimeError, match=mentions("async generator", "batches", "ended")):
            await iterator.get_next()
        await iterator.aclose()
        assert (firsts(first), timeout.cancelled_caught) == ([0, 1], True)

    async def test_per_replica_pipelines_survive_a_given_up_wait(self) -> None:
        """With an async pipeline among PER_REPLICA pipelines, a wait given up while another
        pipeline's loader blocks loses nothing: every round comes, in order."""
        strategy = MirroredStrategy(host_devices(2))
        release = threading.Event()

        async def fast(pipeline: int) -> AsyncIterator[Array]:
            for i in range(3):
                yield np.full(2, 100 * pipeline + i)

        def slow(pipeline: int) -> Iterator[Array]:
            for i in range(3):
                if i == 1:
                    release.wait(BLOCK_S)
                yield np.full(2, 100 * pipeline + i)

        def pipelines(context: aioreplica.InputContext) -> Any:
            pipeline = context.input_pipeline_id
            return fast(pipeline) if pipeline == 0 else slow(pipeline)

        options = InputOptions(experimental_replication_mode="per_replica")
        dist = strategy.distribute_datasets_from_function(pipelines, options, prefetch=0)
        got = []
        try:
            async with aiter(dist) as iterator:
                got.append(firsts(await iterator.get_next()))
                with anyio.move_on_after(GIVE_UP_S) as timeout:
                    await iterator.get_next()
                release.set()
                got.extend([firsts(element) async for element in iterator])
        finally:
            release.set()
        assert timeout.cancelled_caught
        assert got == [[0, 100], [1, 101], [2, 102]]


class TestIteratorAcrossEventLoops:
    def test_prefetching_stopped_by_its_loop_ending_is_an_error(
        self, anyio_backend: tuple[str, dict[str, Any]]
    ) -> None:
        """An iterator whose prefetching stopped with its event loop hands out what it had
        prefetched in the next loop, then raises RuntimeError: never a quiet early end."""
        backend, options = anyio_backend
        strategy = MirroredStrategy(host_devices(2))
        pulled: list[int] = []

        async def source() -> AsyncIterator[Array]:
            for i in range(6):
                pulled.append(i)
                yield np.arange(4) + 10 * i

        iterator = aiter(strategy.distribute_dataset(source(), prefetch=2))
        rest: list[list[int | None]] = []

        async def first() -> list[int | None]:
            got = firsts(await iterator.get_next())
            # Until the prefetcher has filled its buffer of 2 and pulled the next, which
            # waits to be sent (so the two before it are in the buffer).
            for _ in range(10_000):
                if len(pulled) >= 1 + 2 + 1:
                    break
                await anyio.lowlevel.checkpoint()
            return got

        async def then() -> None:
            async for element in iterator:
                rest.append(firsts(element))  # noqa: PERF401 - kept as they come, the loop fails

        got = anyio.run(first, backend=backend, backend_options=options)
        with pytest.raises(RuntimeError, match=mentions("event loop", "ended", r"aiter\(")):
            anyio.run(then, backend=backend, backend_options=options)
        assert got == [0, 2]
        assert rest == [[10, 12], [20, 22]]

    @pytest.mark.parametrize(
        ("first_loop", "then_loop"),
        [("asyncio", "trio"), ("trio", "asyncio"), ("asyncio", "asyncio"), ("trio", "trio")],
    )
    def test_without_prefetch_an_iterator_goes_on_in_a_loop_of_another_kind(
        self, first_loop: str, then_loop: str
    ) -> None:
        """With prefetch=0 an iterator goes on in the next event loop, of either kind, after a
        wait given up there while its loader blocked: nothing is lost."""
        strategy = MirroredStrategy(host_devices(2))
        release = threading.Event()

        def loader() -> Iterator[Array]:
            for i in range(4):
                if i == 1:
                    release.wait(BLOCK_S)
                yield np.full(2, i)

        iterator = aiter(strategy.distribute_dataset(loader(), prefetch=0))

        async def first() -> tuple[list[int | None], bool]:
            got = firsts(await iterator.get_next())
            with anyio.move_on_after(GIVE_UP_S) as timeout:
                await iterator.get_next()
            return got, timeout.cancelled_caught

        async def then() -> list[list[int | None]]:
            release.set()
            return [firsts(element) async for element in iterator]

        try:
            got = anyio.run(first, backend=first_loop)
            rest = anyio.run(then, backend=then_loop)
        finally:
            release.set()
        assert got == ([0, 0], True)
        assert rest == [[1, 1], [2, 2], [3, 3]]

    @pytest.mark.parametrize(
        ("other_loop", "this_loop"),
        [("asyncio", "trio"), ("trio", "asyncio"), ("asyncio", "asyncio"), ("trio", "trio")],
    )
    def test_a_wait_while_another_loop_waits_is_an_error(
        self, other_loop: str, this_loop: str
    ) -> None:
        """With prefetch=0, a wait while a wait of another event loop (in another thread) is
        still in progress on the same iterator is a RuntimeError saying so; that wait ends
        as usual, and the iterator goes on after it."""
        strategy = MirroredStrategy(host_devices(2))
        pulling = threading.Event()
        release = threading.Event()

        def loader() -> Iterator[Array]:
            yield np.full(2, 0)
            pulling.set()
            release.wait(BLOCK_S)
            yield np.full(2, 1)
            yield np.full(2, 2)

        iterator = aiter(strategy.distribute_dataset(loader(), prefetch=0))
        got: list[list[int | None]] = []

        async def take_one() -> None:
            got.append(firsts(await iterator.get_next()))

        anyio.run(take_one, backend=this_loop)
        other = threading.Thread(target=anyio.run, args=(take_one,), kwargs={"backend": other_loop})
        other.start()
        try:
            assert pulling.wait(BLOCK_S)
            with pytest.raises(
                RuntimeError,
                match=mentions("another event loop", "one after another", r"aiter\(dataset\)"),
            ):
                anyio.run(take_one, backend=this_loop)
        finally:
            release.set()
            other.join(BLOCK_S)
        anyio.run(take_one, backend=this_loop)
        assert got == [[0, 0], [1, 1], [2, 2]]


class TestPrefetchContext:
    @pytest.mark.parametrize("kind", ["generator", "async generator"])
    async def test_the_dataset_runs_in_the_context_of_the_pass(self, kind: str) -> None:
        """With prefetching, the dataset's code sees the context variables of the task that
        started the pass (the strategy's scope included), on every loop."""
        strategy = MirroredStrategy(host_devices(2))
        seen: list[tuple[str, bool]] = []

        def batches() -> Iterator[Array]:
            for i in range(2):
                seen.append((EPOCH.get(), aioreplica.has_strategy()))
                yield np.full(2, i)

        async def async_batches() -> AsyncIterator[Array]:
            for batch in batches():
                yield batch

        dataset = batches() if kind == "generator" else async_batches()
        EPOCH.set("epoch 7")
        with strategy.scope():
            got = [firsts(e) async for e in strategy.distribute_dataset(dataset, prefetch=2)]
        assert got == [[0, 0], [1, 1]]
        assert seen == [("epoch 7", True), ("epoch 7", True)]


class TestArraysAsDatasets:
    async def test_an_array_is_refused(self) -> None:
        """A NumPy array passed as the dataset is a TypeError: its items would be rows."""
        strategy = MirroredStrategy(host_devices(2))
        x = np.arange(12.0).reshape(6, 2)
        with pytest.raises(
            TypeError,
            match=mentions(
                r"numpy\.ndarray", r"\(6, 2\)", "rows, not batches", "array_split", "batched"
            ),
        ):
            strategy.distribute_dataset(x)

    async def test_an_array_from_a_dataset_function_is_refused(self) -> None:
        """A dataset function returning an array is refused the same way, in either mode."""
        strategy = MirroredStrategy(host_devices(2))
        options = InputOptions(experimental_replication_mode="per_replica")
        for given in (None, options):
            with pytest.raises(TypeError, match=mentions(r"numpy\.ndarray", "rows, not batches")):
                strategy.distribute_datasets_from_function(lambda _: np.zeros((4, 2)), given)


class TestRoundStructures:
    @pytest.mark.parametrize(
        ("elements", "said"),
        [
            ([{"a": np.arange(2)}, (np.arange(2),)], "a dict of 1 item, replica 1's a tuple"),
            ([{"a": np.arange(2)}, {"b": np.arange(2)}], "'a' only in replica 0's element"),
            ([np.arange(2), (np.arange(2), np.arange(2))], "replica 1's a tuple of 2 items"),
        ],
        ids=["dict vs tuple", "keys", "leaf vs tuple"],
    )
    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_elements_of_a_round_that_differ_are_named(
        self, elements: list[Any], said: str, prefetch: int
    ) -> None:
        """A round whose elements differ in structure is a ValueError naming the dataset
        elements and where they differ, whatever the difference."""
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_datasets_from_function(lambda _: elements, prefetch=prefetch)
        with pytest.raises(
            ValueError,
            match=mentions(
                "distribute_datasets_from_function",
                "dataset elements of one step",
                "<root>",
                re.escape(said),
                "same structure",
            ),
        ):
            [element async for element in dist]


class TestReduce:
    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_reduce_folds_one_pass(self, prefetch: int) -> None:
        """reduce applies reduce_func to each element in order, from initial_state, and each
        call is a new pass."""
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_dataset(aioreplica.batched(np.arange(10), 4), prefetch=prefetch)

        def gather(state: list[list[int | None]], element: Any) -> list[list[int | None]]:
            return [*state, firsts(element)]

        expected = [[0, 2], [4, 6], [8, 9]]
        assert await dist.reduce([], gather) == expected
        assert await dist.reduce([], gather) == expected

    async def test_an_empty_dataset_gives_the_initial_state(self) -> None:
        """Over no elements, reduce returns initial_state itself."""
        strategy = MirroredStrategy(host_devices(2))
        state = object()
        assert await strategy.distribute_dataset([]).reduce(state, lambda s, _: s + 1) is state

    async def test_an_error_of_reduce_func_comes_out_and_closes_the_pass(self) -> None:
        """What reduce_func raises comes out unchanged, and the dataset is closed."""
        strategy = MirroredStrategy(host_devices(2))
        events: list[str] = []

        def batches() -> Iterator[Array]:
            try:
                for i in range(5):
                    events.append(f"pulled {i}")
                    yield np.full(2, i)
            finally:
                events.append("closed")

        def fail_on_second(state: int, element: Any) -> int:
            if state == 1:
                raise KeyError("second")
            return state + 1

        dist = strategy.distribute_dataset(batches(), prefetch=0)
        with pytest.raises(KeyError, match="second"):
            await dist.reduce(0, fail_on_second)
        assert events == ["pulled 0", "pulled 1", "closed"]

    async def test_a_reduce_func_that_is_not_a_plain_function_is_refused(self) -> None:
        """A reduce_func that is not callable, or returns a coroutine, is a TypeError."""
        strategy = MirroredStrategy(host_devices(2))
        dist = strategy.distribute_dataset([np.arange(2)])

        async def coroutine_fn(state: int, element: Any) -> int:
            return state

        with pytest.raises(TypeError, match=mentions("reduce_func must be callable", "int 3")):
            await dist.reduce(0, 3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=mentions("returned a coroutine", "plain function")):
            await dist.reduce(0, coroutine_fn)
