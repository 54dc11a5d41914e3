"""A blocking synchronous loader never holds cancellation hostage, and is never re-entered.

A synchronous dataset is pulled on a daemon thread that its iterator owns. Giving up a wait for
the next element (a timeout, a cancelled task, leaving ``async with``, closing the iterator,
ending the event loop) returns at once while the pull runs on; the element it makes goes to the
next wait (once the iterator is closed, that wait gets the end instead), and no second pull
starts beside it. Every wait below is bounded, so a hang fails.

Each loader here blocks on a ``threading.Event`` that the test sets at the end, so its thread
can finish; the wait is itself bounded (``BLOCK_S``), so that code which waits for the loader
fails by a timeout instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest
import sniffio
import trio
from messages import mentions

from aioreplica import MirroredStrategy
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]

ROOT = Path(__file__).resolve().parent.parent
#: The longest any step below may take before the test counts it as a hang.
BOUND_S = 5.0
#: The longest a blocked pull waits for its release (far beyond ``BOUND_S``).
BLOCK_S = 10.0
#: The timeout the tests put around a wait for a blocked pull.
GIVE_UP_S = 0.2


class Loader:
    """A synchronous loader: pull ``i`` gives ``np.full(2, i)`` (row ``i`` for each of two
    replicas); pulls from ``block_from`` on first wait for ``release``.

    ``events`` records the start and end of every pull, from whichever thread runs it, so two
    pulls that overlap show as two starts in a row.
    """

    def __init__(self, *, block_from: int, length: int | None = None) -> None:
        self.release = threading.Event()
        self.blocked = threading.Event()  # a pull is waiting for ``release``
        self.events: list[tuple[str, int]] = []
        self._block_from = block_from
        self._length = length
        self._pulls = itertools.count()

    def pull(self, i: int) -> Array:
        self.events.append(("start", i))
        if i >= self._block_from:
            self.blocked.set()
            self.release.wait(BLOCK_S)
        self.events.append(("end", i))
        return np.full(2, i)

    def generator(self) -> Iterator[Array]:
        """The loader as a generator: the code between two ``yield``s is one pull."""
        for i in itertools.count() if self._length is None else range(self._length):
            yield self.pull(i)

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> Array:
        """The loader as a plain iterator (no ``close``, no re-entry guard of its own)."""
        i = next(self._pulls)
        if self._length is not None and i >= self._length:
            raise StopIteration
        return self.pull(i)


@contextlib.contextmanager
def bounded() -> Iterator[None]:
    """``fail_after(BOUND_S)``, which also fails when the time ran out inside a shield (a
    shielded wait cannot be cancelled, and nothing may be left to notice the deadline)."""
    start = anyio.current_time()
    with anyio.fail_after(BOUND_S):
        yield
    assert anyio.current_time() - start < BOUND_S, f"took over {BOUND_S} s inside a shield"


def live_tasks() -> int:
    """Tasks alive on this loop; on trio, system tasks (which anyio does not list) included."""
    if sniffio.current_async_library() == "trio":
        return trio.lowlevel.current_statistics().tasks_living
    return len(anyio.get_running_tasks())


def one_after_another(pulls: int) -> list[tuple[str, int]]:
    """The events of ``pulls`` pulls that never overlap."""
    return [(what, i) for i in range(pulls) for what in ("start", "end")]


def row(element: Any) -> int:
    """Which pull an element came from (both replicas get that pull's row)."""
    first, second = element.values
    assert first.tolist() == second.tolist()
    return int(first[0])


class _Collect(logging.Handler):
    """Keeps the message of every record at WARNING or above."""

    def __init__(self, found: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.found = found

    def emit(self, record: logging.LogRecord) -> None:
        self.found.append(record.getMessage())


@pytest.fixture
def strays(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """What would otherwise pass unnoticed: records logged at WARNING or above, from any thread
    (asyncio's "Task exception was never retrieved"), and unraisable exceptions. The test
    asserts the list is empty once what it dropped has been collected (``settled_strays``)."""
    found: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: found.append(repr(info.exc_value)))
    handler = _Collect(found)
    logging.getLogger().addHandler(handler)
    yield found
    logging.getLogger().removeHandler(handler)


def settled_strays(found: list[str]) -> list[str]:
    """``found`` once every object the test dropped has been collected."""
    gc.collect()
    return found


class TestCancellationIsPrompt:
    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_move_on_after_leaves_the_loop(self, prefetch: int, strays: list[str]) -> None:
        """``move_on_after`` around ``async for`` fires while the loader blocks, and the
        prefetch task (if any) ends with the loop."""
        loader = Loader(block_from=1)
        dist = MirroredStrategy(host_devices(2)).distribute_dataset(
            loader.generator(), prefetch=prefetch
        )
        before = live_tasks()
        seen = []
        try:
            with bounded():
                with anyio.move_on_after(GIVE_UP_S) as timeout:
                    async for element in dist:
                        seen.append(row(element))  # noqa: PERF401 - kept as they come, the loop is cut short
                await anyio.wait_all_tasks_blocked()
                left = live_tasks() - before
        finally:
            loader.release.set()
        assert timeout.cancelled_caught
        assert (seen, left) == ([0], 0)
        assert settled_strays(strays) == []

    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_leaving_async_with(self, prefetch: int, strays: list[str]) -> None:
        """Leaving ``async with aiter(dist)`` after a given-up wait returns at once, with the
        prefetch task (if any) ended."""
        loader = Loader(block_from=1)
        dist = MirroredStrategy(host_devices(2)).distribute_dataset(
            loader.generator(), prefetch=prefetch
        )
        before = live_tasks()
        try:
            with bounded():
                async with aiter(dist) as iterator:
                    first = row(await iterator.get_next())
                    with anyio.move_on_after(GIVE_UP_S) as timeout:
                        await iterator.get_next()
                left = live_tasks() - before
        finally:
            loader.release.set()
        assert timeout.cancelled_caught
        assert (first, left) == (0, 0)
        assert settled_strays(strays) == []

    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_aclose_while_another_task_waits(self, prefetch: int, strays: list[str]) -> None:
        """``aclose`` returns at once while another task waits for a blocked pull. That task
        gets the end of the iteration, not the item being pulled: the pass is closed.
        """
        loader = Loader(block_from=1)
        dist = MirroredStrategy(host_devices(2)).distribute_dataset(
            loader.generator(), prefetch=prefetch
        )
        iterator = aiter(dist)
        got: list[int | None] = []

        async def wait_for_next() -> None:
            optional = await iterator.get_next_as_optional()
            got.append(row(optional.get_value()) if optional.has_value() else None)

        try:
            with bounded():
                assert row(await iterator.get_next()) == 0
                async with anyio.create_task_group() as group:
                    group.start_soon(wait_for_next)
                    assert await anyio.to_thread.run_sync(loader.blocked.wait, BOUND_S)
                    await anyio.wait_all_tasks_blocked()
                    await iterator.aclose()  # while the loader blocks: at once
                    loader.release.set()
        finally:
            loader.release.set()
        assert got == [None]
        assert settled_strays(strays) == []

    @pytest.mark.parametrize("prefetch", [0, 2])
    def test_the_event_loop_ends_at_once(
        self, anyio_backend: tuple[str, dict[str, Any]], prefetch: int, strays: list[str]
    ) -> None:
        """A whole ``anyio.run`` whose loop gave up on a blocked loader ends at once, and
        nothing is logged: no task left with "generator already executing"."""
        backend, options = anyio_backend
        loader = Loader(block_from=1)
        outcome: list[str] = []

        async def main() -> None:
            dist = MirroredStrategy(host_devices(2)).distribute_dataset(
                loader.generator(), prefetch=prefetch
            )
            with anyio.move_on_after(GIVE_UP_S) as timeout:
                async for element in dist:
                    outcome.append(f"row {row(element)}")  # noqa: PERF401 - kept as they come, the loop is cut short
            outcome.append(f"cancelled: {timeout.cancelled_caught}")

        def run() -> None:
            anyio.run(main, backend=backend, backend_options=options)
            outcome.append("loop ended")

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        runner.join(BOUND_S)
        ended_in_time = not runner.is_alive()
        loader.release.set()
        runner.join(BLOCK_S)
        assert ended_in_time
        assert outcome == ["row 0", "cancelled: True", "loop ended"]
        assert settled_strays(strays) == []


_BLOCKED_FOREVER = """
import json, sys, threading
import anyio, numpy as np
import aioreplica


def loader():
    yield np.arange(2)
    threading.Event().wait()  # never returns
    yield np.arange(2)


async def main():
    strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
    for prefetch in (0, 2):
        dist = strategy.distribute_dataset(loader(), prefetch=prefetch)
        with anyio.move_on_after(0.2) as timeout:
            async for _ in dist:
                pass
        print(f"prefetch={prefetch} cancelled={timeout.cancelled_caught}", flush=True)


backend, options = json.loads(sys.argv[1])
anyio.run(main, backend=backend, backend_options=options)
"""


@pytest.mark.timeout(60)
def test_a_loader_that_never_returns_does_not_keep_the_process_alive(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    """A process whose loader blocks forever exits once the loop has given up on it: the
    thread that pulls the loader is a daemon thread."""
    result = subprocess.run(
        [sys.executable, "-c", _BLOCKED_FOREVER, json.dumps(anyio_backend)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (result.returncode, result.stdout.splitlines(), result.stderr) == (
        0,
        ["prefetch=0 cancelled=True", "prefetch=2 cancelled=True"],
        "",
    )


async def test_an_iterator_collected_in_a_reference_cycle_closes_its_dataset(
    strays: list[str],
) -> None:
    """An iterator that goes as garbage in a reference cycle (a cancelled ``run_steps`` leaves
    one in its traceback's frames) stops its prefetch task, which closes the dataset as it
    ends: on asyncio, which holds a task only weakly, the task must not go with the
    iterator, pending, leaving the dataset open."""
    closed, buffered = threading.Event(), threading.Event()

    def generator() -> Iterator[np.ndarray[Any, Any]]:
        try:
            for i in range(20):
                if i == 3:  # one taken, two in the buffer, the next pulled
                    buffered.set()
                yield np.full(2, float(i))
        finally:
            closed.set()

    dist = MirroredStrategy(host_devices(2)).distribute_dataset(generator(), prefetch=2)
    with bounded():
        iterator = aiter(dist)
        await iterator.get_next()
        assert await anyio.to_thread.run_sync(buffered.wait, BLOCK_S / 2)
        await anyio.wait_all_tasks_blocked()  # the prefetch task waits for room
        cycle: list[Any] = [iterator]
        cycle.append(cycle)
        del iterator, cycle
        gc.collect()
        assert await anyio.to_thread.run_sync(closed.wait, BLOCK_S / 2)
    assert settled_strays(strays) == []


class TestNeverReEntered:
    async def test_later_waits_take_the_running_pull(self, strays: list[str]) -> None:
        """After a given-up wait (prefetch=0), the next wait takes the pull still running, and
        a wait beside it queues a new pull behind it: one pull at a time, nothing lost."""
        loader = Loader(block_from=1)
        iterator = aiter(MirroredStrategy(host_devices(2)).distribute_dataset(loader, prefetch=0))
        got: dict[str, int] = {}

        async def take(name: str) -> None:
            got[name] = row(await iterator.get_next())

        try:
            with bounded():
                got["first"] = row(await iterator.get_next())
                with anyio.move_on_after(GIVE_UP_S) as timeout:
                    await iterator.get_next()  # pull 1 blocks; this wait gives up
                async with anyio.create_task_group() as group:
                    group.start_soon(take, "after the timeout")
                    await anyio.wait_all_tasks_blocked()
                    group.start_soon(take, "beside it")
                    await anyio.wait_all_tasks_blocked()
                    loader.release.set()
                await iterator.aclose()
        finally:
            loader.release.set()
        assert timeout.cancelled_caught
        assert got == {"first": 0, "after the timeout": 1, "beside it": 2}
        assert loader.events == one_after_another(3)
        assert settled_strays(strays) == []

    async def test_a_new_pass_continues_a_one_shot_loader(self, strays: list[str]) -> None:
        """A new pass over a generator whose last pass gave up a wait (prefetch=0) gets the
        element that pass was waiting for, then the rest; the pulls never overlap."""
        loader = Loader(block_from=1, length=3)
        dist = MirroredStrategy(host_devices(2)).distribute_dataset(loader.generator(), prefetch=0)
        first_pass: list[int] = []
        try:
            with bounded():
                with anyio.move_on_after(GIVE_UP_S) as timeout:
                    async for element in dist:
                        first_pass.append(row(element))  # noqa: PERF401 - kept as they come, the loop is cut short
                loader.release.set()
                second_pass = [row(element) async for element in dist]
        finally:
            loader.release.set()
        assert timeout.cancelled_caught
        assert (first_pass, second_pass) == ([0], [1, 2])
        assert loader.events == one_after_another(3)
        assert settled_strays(strays) == []

    async def test_a_round_of_per_replica_batches_goes_on(self, strays: list[str]) -> None:
        """A wait given up in the middle of a round of per-replica batches (prefetch=0) loses
        none of the round: the next wait completes it, replica r still getting batch r."""
        loader = Loader(block_from=1)
        dist = MirroredStrategy(host_devices(2)).distribute_datasets_from_function(
            lambda context: loader.generator(), prefetch=0
        )
        try:
            with bounded():
                async with aiter(dist) as iterator:
                    with anyio.move_on_after(GIVE_UP_S) as timeout:
                        await iterator.get_next()  # batch 0 pulled, batch 1 blocks
                    loader.release.set()
                    element = await iterator.get_next()
        finally:
            loader.release.set()
        assert timeout.cancelled_caught
        assert [part.tolist() for part in element.values] == [[0, 0], [1, 1]]
        assert loader.events == one_after_another(2)
        assert settled_strays(strays) == []

    async def test_after_a_given_up_wait_prefetching_says_it_stopped(self) -> None:
        """With prefetch>0 a given-up wait ends the prefetching; the next wait on that iterator
        is a RuntimeError saying so and what to do, not a silent end."""
        loader = Loader(block_from=1)
        dist = MirroredStrategy(host_devices(2)).distribute_dataset(loader.generator(), prefetch=2)
        try:
            with bounded():
                async with aiter(dist) as iterator:
                    await iterator.get_next()
                    with anyio.move_on_after(GIVE_UP_S):
                        await iterator.get_next()
                    with pytest.raises(
                        RuntimeError, match=mentions("cancelled", "prefetch=0", r"aiter\(")
                    ):
                        await iterator.get_next()
        finally:
            loader.release.set()


class TestSyncIteration:
    @pytest.mark.parametrize("what", ["dataset", "iterator"])
    def test_for_says_use_async_for(self, what: str) -> None:
        """``for`` over a distributed dataset or its iterator is a TypeError naming the object
        and saying to use ``async for``."""
        dist = MirroredStrategy(host_devices(2)).distribute_dataset([np.arange(2)])
        target: Any = dist if what == "dataset" else aiter(dist)
        name = "DistributedDataset" if what == "dataset" else "DistributedIterator"
        with pytest.raises(TypeError, match=mentions(name, "async for")):
            for _ in target:
                pass
