"""The trio adapter: a nursery through anyio, ``wait_task_rescheduled``, the trio token.

Trio deliberately runs tasks woken together in a random order, so "ordered" rounds resume in
trio's order; cancellation reaches a parked replica through its cancel scope at the next
checkpoint, never through a sibling.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, final

import anyio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Sequence

__all__ = ["TrioLoop"]


# -- replica tasks --------------------------------------------------------------------------


@final
class _ReplicaTasks:
    """The replicas in one anyio task group (a trio nursery)."""

    __slots__ = ("_cancelled", "_mains", "_scope")

    def __init__(self, mains: Sequence[Callable[[], Coroutine[Any, Any, None]]]) -> None:
        self._mains = mains
        self._scope: anyio.CancelScope | None = None
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True
        if self._scope is not None:
            self._scope.cancel()

    async def wait(self) -> None:
        async with anyio.create_task_group() as group:
            self._scope = group.cancel_scope
            if self._cancelled:
                group.cancel_scope.cancel()
            for main in self._mains:
                group.start_soon(main)
        self._scope = None


# -- gates ----------------------------------------------------------------------------------


@final
class _TaskGate:
    """Each parked replica's task, rescheduled in the order the scheduler asks."""

    __slots__ = ("_lowlevel", "_tasks", "opened")

    waiter = None

    def __init__(self, lowlevel: Any) -> None:
        self._lowlevel = lowlevel
        self._tasks: dict[int, Any] = {}
        self.opened = False

    def park(self, slot: int) -> Iterable[Any]:
        lowlevel = self._lowlevel
        tasks = self._tasks
        tasks[slot] = lowlevel.current_task()

        def abort(_raise_cancel: object) -> object:
            tasks.pop(slot, None)
            return lowlevel.Abort.SUCCEEDED

        return lowlevel.wait_task_rescheduled(abort).__await__()  # type: ignore[no-any-return]

    def interrupted(self, exc: BaseException) -> Generator[Any, Any, None]:
        raise exc  # trio never wakes a task for another task's cancellation
        yield  # a generator, like the other gates' (never reached)

    def open(self, slots: Iterable[int] | None) -> None:
        self.opened = True
        reschedule = self._lowlevel.reschedule
        tasks = self._tasks
        for slot in list(tasks) if slots is None else slots:
            task = tasks.pop(slot, None)
            if task is not None:
                reschedule(task)


# -- thread results -------------------------------------------------------------------------


@final
class _ThreadResult:
    __slots__ = ("_cancelled", "_lowlevel", "_outcome", "_task", "_token")

    def __init__(self, lowlevel: Any) -> None:
        self._lowlevel = lowlevel
        self._token = lowlevel.current_trio_token()
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


# -- background tasks -----------------------------------------------------------------------


@final
class _Background:
    """A system task under its own cancel scope, so it belongs to no caller's nursery."""

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


# -- the adapter ----------------------------------------------------------------------------


@final
class TrioLoop:
    """The adapter of trio (one per process: it keeps no state of a run)."""

    __slots__ = ("_lowlevel", "_trio", "cancelled_class")

    def __init__(self, trio: Any) -> None:
        self._trio = trio
        self._lowlevel = trio.lowlevel
        self.cancelled_class: type[BaseException] = trio.Cancelled

    def replica_tasks(
        self,
        mains: Sequence[Callable[[], Coroutine[Any, Any, None]]],
        on_crash: Callable[[BaseException], None],
    ) -> _ReplicaTasks:
        # A crash of the scheduler itself propagates out of the task group as an exception
        # group; replica mains catch everything else.
        return _ReplicaTasks(mains)

    def gate_factory(self, ordered: bool) -> Callable[[], _TaskGate]:
        return functools.partial(_TaskGate, self._lowlevel)

    def yield_once(self) -> Iterable[Any]:
        return self._lowlevel.cancel_shielded_checkpoint().__await__()  # type: ignore[no-any-return]

    def park_cancelled(self) -> Iterable[Any]:
        # trio delivers the cancellation of the run's scope at the next checkpoint.
        lowlevel = self._lowlevel
        return lowlevel.wait_task_rescheduled(  # type: ignore[no-any-return]
            lambda _raise_cancel: lowlevel.Abort.SUCCEEDED
        ).__await__()

    def thread_result(self) -> _ThreadResult:
        return _ThreadResult(self._lowlevel)

    def spawn_background(self, fn: Callable[[], Awaitable[None]]) -> _Background:
        return _Background(self._trio, fn)
