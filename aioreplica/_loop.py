"""The scheduler's adapter to the running event loop: the one place that uses native primitives.

Library code talks to anyio. The exception (DESIGN invariant 7) is here, on the merge path,
where a few microseconds per replica per round decide whether aioreplica stays within 2x of the
bare-asyncio floor:

- **spawn**: on asyncio the replicas are plain ``loop.create_task`` tasks that ``run_tasks``
  supervises itself (cancel all on failure or when the caller is cancelled, wait for all, let
  none outlive the call) instead of an anyio task group, which costs about 4x as much per
  replica to start; on trio they run in an anyio task group (a trio nursery).
- **wake from a thread**: a host device's worker thread hands its result to the waiting task
  with ``call_soon_threadsafe`` (asyncio) or the trio token's ``run_sync_soon``, without
  blocking the worker until the loop gets round to it (anyio's ``from_thread`` would).
- **background tasks**: a dataset's prefetcher belongs to its iterator, which may be dropped
  at a ``break`` without being closed, so it cannot live in a task group of the caller's: it is
  a plain task (asyncio) or a system task under its own cancel scope (trio), cancelled by its
  owner when the iteration ends, breaks, or is cancelled.
- **park/wake**: a parked replica waits on a future of its own (asyncio) or in
  ``wait_task_rescheduled`` (trio), so waking N replicas costs N callbacks and cancelling one
  replica (its own ``anyio.fail_after`` around a merge point) wakes only that one.

Each loop provides ``park(replica)`` (what to ``yield from`` to wait), ``park_cancelled`` (the
same, in a run that is failing: it raises the replica's cancellation), ``wake(replicas)``,
``yield_once()`` (let tasks woken before us run first, used to resume replicas in order) and
``run_tasks(mains, run)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio

if TYPE_CHECKING:
    from ._scheduler import _Replica, _Run

__all__ = ["Background", "Loop", "ThreadResult", "current"]

_Future = asyncio.Future
_Main = Callable[[], Coroutine[Any, Any, None]]
_YIELD_NONE = (None,)


class Loop(Protocol):
    cancelled_class: type[BaseException]
    #: Where parking is waiting on a fresh future stored as ``replica.waker`` (asyncio), a
    #: factory for it, so the scheduler's hot path can park without a call into the adapter.
    new_future: Callable[[], Any] | None

    def park(self, replica: _Replica) -> Iterable[Any]: ...

    def park_cancelled(self, replica: _Replica) -> Iterable[Any]: ...

    def wake(self, replicas: Iterable[_Replica]) -> None: ...

    def current_task_cancelling(self) -> bool: ...

    def yield_once(self) -> Iterable[Any]: ...

    async def run_tasks(self, mains: Sequence[_Main], run: _Run) -> None: ...

    def thread_result(self) -> ThreadResult: ...

    def spawn_background(self, fn: Callable[[], Awaitable[None]]) -> Background: ...


class Background(Protocol):
    """A task that belongs to an object rather than to a task group (a dataset's prefetcher).

    Its owner cancels it when it is done with it (``cancel`` may be called any number of
    times, from the loop thread) and may wait for it to end; ``fn`` must not raise.
    """

    @property
    def done(self) -> bool: ...

    def cancel(self) -> None: ...

    async def wait(self) -> None: ...


class _AsyncioBackground:
    __slots__ = ("_task",)

    def __init__(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], Awaitable[None]]) -> None:
        self._task = loop.create_task(_call(fn))

    @property
    def done(self) -> bool:
        return self._task.done()

    def cancel(self) -> None:
        self._task.cancel()

    async def wait(self) -> None:
        await asyncio.wait([self._task])


async def _call(fn: Callable[[], Awaitable[None]]) -> None:
    await fn()


class _TrioBackground:
    __slots__ = ("_done", "_scope")

    def __init__(self, trio: Any, fn: Callable[[], Awaitable[None]]) -> None:
        self._scope = trio.CancelScope()
        self._done = trio.Event()
        trio.lowlevel.spawn_system_task(self._main, fn)

    async def _main(self, fn: Callable[[], Awaitable[None]]) -> None:
        try:
            with self._scope:
                await fn()
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return bool(self._done.is_set())

    def cancel(self) -> None:
        self._scope.cancel()

    async def wait(self) -> None:
        await self._done.wait()


class ThreadResult(Protocol):
    """A result that a worker thread hands to a task waiting on the event loop.

    Made on the loop thread; ``set`` may be called once from any thread; awaiting it (once)
    on the loop returns the value or raises the error. ``cancelled`` tells the worker that the
    waiting task gave up, so a job that has not started yet can be skipped.
    """

    @property
    def cancelled(self) -> bool: ...

    def set(self, value: Any, error: BaseException | None) -> None: ...

    def __await__(self) -> Generator[Any, Any, Any]: ...


class _AsyncioThreadResult:
    __slots__ = ("_future", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._future: asyncio.Future[Any] = loop.create_future()

    @property
    def cancelled(self) -> bool:
        return self._future.cancelled()

    def set(self, value: Any, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(self._deliver, value, error)

    def _deliver(self, value: Any, error: BaseException | None) -> None:
        if self._future.done():  # the waiter was cancelled
            return
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(value)

    def __await__(self) -> Generator[Any, Any, Any]:
        return self._future.__await__()


class _AsyncioLoop:
    cancelled_class: type[BaseException] = asyncio.CancelledError

    __slots__ = ("_loop", "new_future")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.new_future: Callable[[], Any] | None = functools.partial(_Future, loop=loop)

    def park(self, replica: _Replica) -> Iterable[Any]:
        future: asyncio.Future[None] = _Future(loop=self._loop)
        replica.waker = future
        return future

    def park_cancelled(self, replica: _Replica) -> Iterable[Any]:
        # The run is failing and every replica has been cancelled: deliver it now. Waiting
        # for the task's cancellation instead would hang if the replica's code swallowed it.
        raise asyncio.CancelledError

    def wake(self, replicas: Iterable[_Replica]) -> None:
        for replica in replicas:
            try:  # noqa: SIM105 - contextlib.suppress costs more on this hot path
                replica.waker.set_result(None)
            except asyncio.InvalidStateError:  # cancelled, and about to leave the round
                pass

    def current_task_cancelling(self) -> bool:
        task = asyncio.current_task()
        return task is not None and task.cancelling() > 0

    def yield_once(self) -> Iterable[Any]:
        # Yielding None (a bare ``yield``) makes the task reschedule itself behind the callbacks
        # already queued; a constant tuple does it without making a generator.
        return _YIELD_NONE

    async def run_tasks(self, mains: Sequence[_Main], run: _Run) -> None:
        loop = self._loop
        tasks: list[asyncio.Task[None]] = []
        remaining = len(mains)
        waiter: asyncio.Future[None] | None = None
        cancelling = False

        def on_done(task: asyncio.Task[None]) -> None:
            nonlocal remaining
            remaining -= 1
            if not task.cancelled():
                exc = task.exception()
                if exc is not None:  # replica mains catch everything but cancellation
                    run.fail(exc, "raised by the scheduler")
            if remaining == 0 and waiter is not None and not waiter.done():
                waiter.set_result(None)

        def cancel_all() -> None:
            nonlocal cancelling
            if not cancelling:
                cancelling = True
                for task in tasks:
                    task.cancel()

        run.cancel_all = cancel_all
        for main in mains:
            task = loop.create_task(main())
            task.add_done_callback(on_done)
            tasks.append(task)
        caller_cancelled: BaseException | None = None
        while remaining:
            waiter = loop.create_future()
            try:
                await waiter
            except asyncio.CancelledError as exc:
                # The caller is cancelled: cancel every replica, and still wait for all of
                # them, so that none outlives run(); then let the cancellation through.
                caller_cancelled = exc
                cancel_all()
        if caller_cancelled is not None:
            raise caller_cancelled

    def thread_result(self) -> ThreadResult:
        return _AsyncioThreadResult(self._loop)

    def spawn_background(self, fn: Callable[[], Awaitable[None]]) -> Background:
        return _AsyncioBackground(self._loop, fn)


class _TrioThreadResult:
    __slots__ = ("_cancelled", "_lowlevel", "_outcome", "_task", "_token")

    def __init__(self, trio: Any) -> None:
        self._lowlevel = trio.lowlevel
        self._token = trio.lowlevel.current_trio_token()
        self._task: Any = None
        self._outcome: Any = None
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def set(self, value: Any, error: BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # trio.RunFinishedError: nobody is waiting
            self._token.run_sync_soon(self._deliver, value, error)

    def _deliver(self, value: Any, error: BaseException | None) -> None:
        import outcome  # trio's own dependency, imported only under trio

        self._outcome = outcome.Error(error) if error is not None else outcome.Value(value)
        if self._task is not None:
            self._lowlevel.reschedule(self._task, self._outcome)
            self._task = None

    def __await__(self) -> Generator[Any, Any, Any]:
        if self._outcome is not None:
            yield from self._lowlevel.checkpoint().__await__()
            return self._outcome.unwrap()
        self._task = self._lowlevel.current_task()

        def abort(_raise_cancel: object) -> object:
            self._task = None
            self._cancelled = True
            return self._lowlevel.Abort.SUCCEEDED

        return (yield from self._lowlevel.wait_task_rescheduled(abort).__await__())


class _TrioLoop:
    __slots__ = ("_lowlevel", "cancelled_class")

    new_future: Callable[[], Any] | None = None

    def __init__(self, trio: Any) -> None:
        self._lowlevel = trio.lowlevel
        self.cancelled_class: type[BaseException] = trio.Cancelled

    def park(self, replica: _Replica) -> Iterable[Any]:
        lowlevel = self._lowlevel
        replica.waker = lowlevel.current_task()

        def abort(_raise_cancel: object) -> object:
            replica.waker = None
            return lowlevel.Abort.SUCCEEDED

        return lowlevel.wait_task_rescheduled(abort).__await__()  # type: ignore[no-any-return]

    def wake(self, replicas: Iterable[_Replica]) -> None:
        reschedule = self._lowlevel.reschedule
        for replica in replicas:
            task = replica.waker
            if task is not None:
                replica.waker = None
                reschedule(task)

    def park_cancelled(self, replica: _Replica) -> Iterable[Any]:
        # trio delivers the cancellation of the run's scope at every checkpoint.
        return self.park(replica)

    def current_task_cancelling(self) -> bool:
        return False  # trio never wakes a task for another task's cancellation

    def yield_once(self) -> Iterable[Any]:
        return self._lowlevel.cancel_shielded_checkpoint().__await__()  # type: ignore[no-any-return]

    async def run_tasks(self, mains: Sequence[_Main], run: _Run) -> None:
        async with anyio.create_task_group() as group:
            run.cancel_all = group.cancel_scope.cancel
            for main in mains:
                group.start_soon(main)

    def thread_result(self) -> ThreadResult:
        return _TrioThreadResult(sys.modules["trio"])

    def spawn_background(self, fn: Callable[[], Awaitable[None]]) -> Background:
        return _TrioBackground(sys.modules["trio"], fn)


def current() -> Loop:
    """The adapter for the event loop running the caller.

    Raises:
        RuntimeError: no asyncio or trio event loop is running.
    """
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            pass
        else:
            return _TrioLoop(trio)
    try:
        return _AsyncioLoop(asyncio.get_running_loop())
    except RuntimeError:
        raise RuntimeError(
            "strategy.run() must be awaited inside a running asyncio or trio event loop, "
            "e.g. anyio.run(main) or asyncio.run(main())"
        ) from None
