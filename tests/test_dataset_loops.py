"""Distributed datasets and the event loop: an iterator that outlives its loop keeps saying so,
big shuffled batches are gathered off the loop (in order, resumable), a wrong batch is named
without walking the rest of it, and the input and testing constructors check their arguments.

Every async test runs on asyncio, uvloop and trio. Row i of a table holds the value i, so a
batch says which rows it holds.
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest
from messages import mentions

import aioreplica
from aioreplica import (
    BatchedIterator,
    Checkpoint,
    DistributedDataset,
    MirroredStrategy,
    ValueContext,
    batched,
)
from aioreplica.testing import DeviceLog, FakeDevice, RecordingDevice, host_devices

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]

#: Values in one row of a big table: 2 MiB of float64, so a batch of two rows is a gather too
#: big to make on the event loop.
BIG_ROW = 1 << 18


class GatherWatched(np.ndarray[Any, Any]):
    """An array that notes, in ``gathered_on``, the thread each gather of its rows (indexing
    by an array of row numbers) is made on."""

    gathered_on: list[int]

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, np.ndarray):
            self.gathered_on.append(threading.get_ident())
        return np.asarray(self)[key]


class SizeWatched(np.ndarray[Any, Any]):
    """An array that notes, in ``events``, each read of its sizes (``itemsize``, ``nbytes``)."""

    events: list[str]

    @property
    def itemsize(self) -> int:
        self.events.append("itemsize read")
        return np.asarray(self).itemsize

    @property
    def nbytes(self) -> int:
        self.events.append("nbytes read")
        return np.asarray(self).nbytes

    def __getitem__(self, key: Any) -> Any:
        return np.asarray(self)[key]


def big_table(rows: int) -> GatherWatched:
    """``rows`` rows of ``BIG_ROW`` values, row i all i, that note where they are gathered."""
    table = np.repeat(np.arange(rows, dtype=np.float64), BIG_ROW).reshape(rows, BIG_ROW)
    watched = table.view(GatherWatched)
    watched.gathered_on = []
    return watched


def rows_of(element: Any) -> list[int]:
    """The rows an element of a big table holds, over all replicas."""
    return [int(row[0]) for part in element.values for row in part]


class TestIteratorAfterItsLoop:
    def test_every_later_wait_raises(self, anyio_backend: tuple[str, dict[str, Any]]) -> None:
        """An iterator whose prefetching stopped with its event loop raises RuntimeError at
        every later wait, in every later loop: never an end of the data it did not reach."""
        backend, options = anyio_backend
        strategy = MirroredStrategy(host_devices(2))
        pulled: list[int] = []

        async def source() -> AsyncIterator[Array]:
            for i in range(10):
                pulled.append(i)
                yield np.arange(2) + 10 * i

        iterator = aiter(strategy.distribute_dataset(source(), prefetch=2))
        outcomes: list[str] = []

        async def take() -> None:
            try:
                outcomes.append(f"rows {(await iterator.get_next()).values[0].tolist()}")
            except RuntimeError as exc:
                ended = re.search(mentions("event loop", "ended", r"aiter\("), str(exc))
                outcomes.append("RuntimeError: loop ended" if ended else f"RuntimeError: {exc}")
            # Until the prefetcher has filled its buffer of 2 and pulled the next, which
            # waits to be sent: the loop ends with two elements prefetched.
            while len(pulled) < 1 + 2 + 1:
                await anyio.lowlevel.checkpoint()

        async def iterate() -> None:
            try:
                async for element in iterator:
                    outcomes.append(f"rows {element.values[0].tolist()}")  # noqa: PERF401 - may fail
            except RuntimeError as exc:
                ended = re.search(mentions("event loop", "ended", r"aiter\("), str(exc))
                outcomes.append("async for: loop ended" if ended else f"async for: {exc}")

        for _ in range(5):
            anyio.run(take, backend=backend, backend_options=options)
        anyio.run(iterate, backend=backend, backend_options=options)
        # The first loop prefetched elements 1 and 2 behind element 0, which the next loops
        # hand out; then every wait says the prefetching ended.
        assert outcomes == [
            "rows [0]",
            "rows [10]",
            "rows [20]",
            "RuntimeError: loop ended",
            "RuntimeError: loop ended",
            "async for: loop ended",
        ]


class TestShuffledGathers:
    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_big_gathers_run_off_the_loop_in_order(self, prefetch: int) -> None:
        """A shuffled ``batched`` dataset of big rows gathers each batch on another thread than
        the event loop's, and hands the batches out in the order of its permutation."""
        table = big_table(6)
        strategy = MirroredStrategy(host_devices(2))
        dataset = batched(table, 2, shuffle=True, seed=5)
        order = np.random.default_rng(5).permutation(6).tolist()  # what seed 5 draws first
        got = [
            rows_of(element)
            async for element in strategy.distribute_dataset(dataset, prefetch=prefetch)
        ]
        assert got == [order[0:2], order[2:4], order[4:6]]
        loop_thread = threading.get_ident()
        assert [thread == loop_thread for thread in table.gathered_on] == [False] * 3

    async def test_small_gathers_stay_on_the_loop(self) -> None:
        """A small shuffled batch is gathered at once on the loop (cheaper than the hop)."""
        table = np.arange(6.0).reshape(6, 1).view(GatherWatched)
        table.gathered_on = []
        strategy = MirroredStrategy(host_devices(2))
        dataset = batched(table, 2, shuffle=True, seed=5)
        got = [rows_of(element) async for element in strategy.distribute_dataset(dataset)]
        assert sorted(row for rows in got for row in rows) == list(range(6))
        assert table.gathered_on == [threading.get_ident()] * 3

    async def test_batch_sizes_are_counted_once(self) -> None:
        """Where a shuffled batch is gathered depends on its size, which the dataset counts
        when it is made: a pass reads no leaf's sizes again, batch after batch."""
        events: list[str] = []
        leaves = [np.arange(6.0).reshape(6, 1).view(SizeWatched) for _ in range(3)]
        for leaf in leaves:
            leaf.events = events
        strategy = MirroredStrategy(host_devices(2))
        dataset = batched(leaves, 2, shuffle=True, seed=5)
        events.append("made")
        async for element in strategy.distribute_dataset(dataset):
            events.append(f"rows {rows_of(element[0])}")  # noqa: PERF401 - among the reads
        order = np.random.default_rng(5).permutation(6).tolist()  # what seed 5 draws first
        assert events[events.index("made") :] == [
            "made",
            f"rows {order[0:2]}",
            f"rows {order[2:4]}",
            f"rows {order[4:6]}",
        ]

    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_resumed_pass_equals_unbroken(self, tmp_path: Path, prefetch: int) -> None:
        """A pass over big shuffled batches saved after two elements and resumed in a fresh
        program sees the rest of the epoch, then a next epoch, as an unbroken run does."""

        def start() -> tuple[Checkpoint, DistributedDataset]:
            strategy = MirroredStrategy(host_devices(2))
            dist = strategy.distribute_dataset(
                batched(big_table(8), 2, shuffle=True, seed=11), prefetch=prefetch
            )
            return Checkpoint(data=aiter(dist)), dist

        async def epochs(ckpt: Checkpoint, dist: DistributedDataset) -> list[list[int]]:
            seen = [rows_of(element) async for element in ckpt.data]
            return seen + [rows_of(element) async for element in dist]

        unbroken = await epochs(*start())
        ckpt, _ = start()
        first = [rows_of(await ckpt.data.get_next()) for _ in range(2)]
        await ckpt.save(tmp_path / "c.npz")
        await ckpt.data.aclose()

        resumed, dist = start()
        await resumed.restore(tmp_path / "c.npz")
        assert first + await epochs(resumed, dist) == unbroken
        assert len(unbroken) == 8


#: How many times each ``CountedNode`` was flattened (its ``flatten_fn`` called), by name.
FLATTENED: dict[int, int] = {}


class CountedNode:
    """A registered container of one leaf that counts its flattens in ``FLATTENED``."""

    def __init__(self, name: int, leaf: Any) -> None:
        self.name = name
        self.leaf = leaf


def _flatten_counted(node: CountedNode) -> tuple[list[Any], int]:
    FLATTENED[node.name] = FLATTENED.get(node.name, 0) + 1
    return [node.leaf], node.name


aioreplica.nest.register_node(
    CountedNode, _flatten_counted, lambda name, children: CountedNode(name, children[0])
)


class TestWrongBatch:
    async def test_first_leaf_without_rows_is_named_after_one_pass(self) -> None:
        """A batch whose first leaf is a number is refused naming that leaf, and the rest of
        the batch is walked once only (each node flattened once, the first one's on the way
        to its leaf again): a batch of many numbers is refused at once."""
        FLATTENED.clear()
        batch = [CountedNode(i, 1.0) for i in range(100)]
        strategy = MirroredStrategy(host_devices(2))
        with pytest.raises(
            TypeError, match=mentions(re.escape("[0][0]"), "a float", "no batch dimension")
        ):
            async for _ in strategy.distribute_dataset([batch], prefetch=0):
                pass
        flattened = dict(FLATTENED)
        assert flattened == {0: 2} | dict.fromkeys(range(1, 100), 1)

    async def test_a_later_leaf_without_rows_is_named(self) -> None:
        """The first leaf without rows is named, however deep and wherever it lies."""
        batch = {"a": np.ones(4), "b": [np.ones(4), {"c": np.ones(4), "d": [3.0]}]}
        strategy = MirroredStrategy(host_devices(2))
        with pytest.raises(TypeError, match=mentions(re.escape("['b'][1]['d'][0]"), "a float")):
            async for _ in strategy.distribute_dataset([batch], prefetch=0):
                pass


class TestConstructorChecks:
    @pytest.mark.parametrize(
        ("make", "error", "said"),
        [
            pytest.param(
                lambda: BatchedIterator(3),  # type: ignore[arg-type]
                TypeError,
                ["BatchedIterator", "batched", "int 3"],
                id="BatchedIterator(3)",
            ),
            pytest.param(
                lambda: ValueContext(-1, 0),
                ValueError,
                ["num_replicas_in_sync", ">= 1", "0"],
                id="ValueContext(-1, 0)",
            ),
            pytest.param(
                lambda: ValueContext("0", 1),  # type: ignore[arg-type]
                TypeError,
                ["replica_id_in_sync_group", "str '0'"],
                id='ValueContext("0", 1)',
            ),
            pytest.param(
                lambda: ValueContext(0.5, 2),  # type: ignore[arg-type]
                TypeError,
                ["replica_id_in_sync_group", "0.5"],
                id="ValueContext(0.5, 2)",
            ),
            pytest.param(
                lambda: ValueContext(2, 2),
                ValueError,
                ["replica_id_in_sync_group", "from 0 to 1"],
                id="ValueContext(2, 2)",
            ),
            pytest.param(
                lambda: ValueContext(0, True),
                TypeError,
                ["num_replicas_in_sync", "bool True"],
                id="ValueContext(0, True)",
            ),
            pytest.param(
                lambda: RecordingDevice(0, None),  # type: ignore[arg-type]
                TypeError,
                ["log", "DeviceLog", "None"],
                id="RecordingDevice(0, None)",
            ),
            pytest.param(
                lambda: FakeDevice("x", -1),
                ValueError,
                ["index", ">= 0", "-1"],
                id='FakeDevice("x", -1)',
            ),
            pytest.param(
                lambda: FakeDevice("x", 1.5),  # type: ignore[arg-type]
                TypeError,
                ["index", "float 1.5"],
                id='FakeDevice("x", 1.5)',
            ),
            pytest.param(
                lambda: FakeDevice("x", inline="y"),  # type: ignore[arg-type]
                TypeError,
                ["inline", "'y'"],
                id='FakeDevice("x", inline="y")',
            ),
            pytest.param(
                lambda: FakeDevice(3),  # type: ignore[arg-type]
                TypeError,
                ["name", "int 3"],
                id="FakeDevice(3)",
            ),
            pytest.param(
                lambda: FakeDevice(""),
                ValueError,
                ["name", "empty"],
                id='FakeDevice("")',
            ),
            pytest.param(
                lambda: RecordingDevice(-1, DeviceLog()),
                ValueError,
                ["RecordingDevice", "index"],
                id="RecordingDevice(-1, DeviceLog())",
            ),
        ],
    )
    def test_bad_arguments_are_refused(
        self, make: Callable[[], object], error: type[Exception], said: list[str]
    ) -> None:
        """Each constructor refuses a bad argument with an error naming it and the value."""
        with pytest.raises(error, match=mentions(*map(re.escape, said))):
            make()

    def test_good_arguments_are_kept(self) -> None:
        """NumPy integers are ints; the values are kept as Python ints."""
        context = ValueContext(np.int64(1), np.int64(3))  # type: ignore[arg-type]
        device = FakeDevice("f", np.int64(2), inline=True)  # type: ignore[arg-type]
        assert (context, device.index, device.inline) == (ValueContext(1, 3), 2, True)
        assert type(context.replica_id_in_sync_group) is int
