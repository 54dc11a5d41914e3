"""The trio adapter: a nursery through anyio, ``wait_task_rescheduled``, the trio token.

Trio deliberately runs tasks woken together in a random order, so "ordered" rounds resume in
trio's order, and seeded ones wake one replica at a time; cancellation reaches a parked replica
through its cancel scope at the next checkpoint, never through a sibling.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import deque
from typing import TYPE_CHECKING, Any, final

import anyio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Sequence

__all__ = ["TrioLoop"]


# -- replica tasks --------------------------------------------------------------------------


@final
class _ReplicaTasks:
    """The replicas in one anyio task group (a trio nursery).

    trio runs the tasks made ready together in an order of its own choosing, new ones too, so
    ``in_order`` tasks are started one by one: each starts the next as it begins, and that one
    runs once this one first waits.

    The caller waits in the task group's body until every replica has ended, rather than in
    the task group's exit, so that it sees its own cancellation and says so (``on_cancel``).
    """

    __slots__ = ("_cancelled", "_ended", "_in_order", "_left", "_mains", "_on_cancel", "_scope")

    def __init__(
        self,
        mains: Sequence[Callable[[], Coroutine[Any, Any, None]]],
        on_cancel: Callable[[], None],
        in_order: bool,
    ) -> None:
        self._mains = mains
        self._on_cancel = on_cancel
        self._in_order = in_order
        self._scope: anyio.CancelScope | None = None
        self._cancelled = False
        self._left = len(mains)  # replicas that have not ended
        self._ended = anyio.Event()

    def cancel(self) -> None:
        self._cancelled = True
        self._on_cancel()
        if self._scope is not None:
            self._scope.cancel()

    def is_cancellation(self, exc: BaseException) -> bool:
        # trio raises Cancelled only through a cancel scope; replica code cannot make its own.
        return True

    async def wait(self) -> None:
        try:
            async with anyio.create_task_group() as group:
                self._scope = group.cancel_scope
                if self._cancelled:
                    group.cancel_scope.cancel()
                if self._in_order:
                    group.start_soon(self._start_in_order, group, 0)
                else:
                    for main in self._mains:
                        group.start_soon(self._main, main)
                if self._left:
                    try:
                        await self._ended.wait()
                    except BaseException:
                        # The caller is cancelled (or interrupted): every replica is cancelled,
                        # and the task group waits for them all.
                        self.cancel()
                        raise
        except BaseExceptionGroup as group:
            # Replica mains catch everything, so what comes out is the caller's own (trio
            # delivers Ctrl-C to the main task, waiting here) or a crash: raise it as itself,
            # as asyncio does, so that ``except KeyboardInterrupt:`` sees it.
            failure = _first_of(group)
        else:
            return
        finally:
            self._scope = None
        raise failure

    async def _start_in_order(self, group: anyio.abc.TaskGroup, index: int) -> None:
        if index + 1 < len(self._mains):
            group.start_soon(self._start_in_order, group, index + 1)
        await self._main(self._mains[index])

    async def _main(self, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        try:
            await main()
        finally:
            self._left -= 1
            if not self._left:
                self._ended.set()


def _first_of(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception in ``group`` (nested groups opened), noting any others on it."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            pending[:0] = exc.exceptions
        else:
            leaves.append(exc)
    first = leaves[0]
    for other in leaves[1:]:
        with contextlib.suppress(TypeError):  # its own code made __notes__ no list: as it is
            first.add_note(f"also raised: {type(other).__name__}: {other}")
    return first


def _zero() -> int:
    return 0


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

    def interrupted(self, exc: BaseException, requests: int) -> Generator[Any, Any, None]:
        try:
            raise exc  # trio never wakes a task for another task's cancellation
        finally:
            del exc
        yield  # a generator, like the other gates' (never reached)

    def open(self, slots: Iterable[int] | None) -> None:
        self.opened = True
        reschedule = self._lowlevel.reschedule
        tasks = self._tasks
        for slot in list(tasks) if slots is None else slots:
            task = tasks.pop(slot, None)
            if task is not None:
                reschedule(task)

    def wake(self, slot: int) -> None:
        task = self._tasks.pop(slot, None)
        if task is not None:  # None: it is already running, or left the round
            self._lowlevel.reschedule(task)

    def hand_over(self, order: Sequence[int], slot: int) -> Generator[Any, Any, None]:
        self.open(None)  # trio's order; the caller carries on first
        return
        yield  # a generator, like the other gates' (never reached)


@final
class _ChainGate:
    """Wakes the parked replicas one at a time, in exactly the order given.

    trio runs tasks made ready together in an order of its own, so a seeded order cannot wake
    them together: each woken replica wakes the next as it resumes, and that one runs once
    this one waits again. It costs a pass of trio's loop per replica, paid only with
    ``interleave="random"``.
    """

    __slots__ = ("_chain", "_lowlevel", "_tasks", "opened")

    waiter = None

    def __init__(self, lowlevel: Any) -> None:
        self._lowlevel = lowlevel
        self._tasks: dict[int, Any] = {}
        self._chain: deque[int] = deque()
        self.opened = False

    def park(self, slot: int) -> Iterable[Any]:
        self._tasks[slot] = self._lowlevel.current_task()
        return self._wait(slot)

    def _wait(self, slot: int) -> Generator[Any, Any, None]:
        tasks = self._tasks

        def abort(_raise_cancel: object) -> object:
            tasks.pop(slot, None)
            return self._lowlevel.Abort.SUCCEEDED

        yield from self._lowlevel.wait_task_rescheduled(abort).__await__()
        self._wake_next()

    def _wake_next(self) -> None:
        chain, tasks = self._chain, self._tasks
        while chain:
            task = tasks.pop(chain.popleft(), None)
            if task is not None:  # None: it left the round, cancelled
                self._lowlevel.reschedule(task)
                return

    def interrupted(self, exc: BaseException, requests: int) -> Generator[Any, Any, None]:
        try:
            raise exc
        finally:
            del exc
        yield  # a generator, like the other gates' (never reached)

    def open(self, slots: Iterable[int] | None) -> None:
        self.opened = True
        self._chain.extend(list(self._tasks) if slots is None else slots)
        self._wake_next()

    def wake(self, slot: int) -> None:
        task = self._tasks.pop(slot, None)
        if task is not None:  # None: it is already running, or left the round
            self._lowlevel.reschedule(task)

    def hand_over(self, order: Sequence[int], slot: int) -> Generator[Any, Any, None]:
        self.opened = True
        position = order.index(slot)
        tasks = self._tasks
        if not any(ahead in tasks for ahead in order[:position]):
            # First in ``order``, or those ahead of it left the round (cancelled): it carries
            # on, and the rest run once it waits.
            self._chain.extend(order[position + 1 :])
            self._wake_next()
            return
        self._chain.extend(order)
        # Wakes the first one ahead still parked, before the caller parks: the running task
        # is never rescheduled. Its predecessor in ``order`` wakes it.
        self._wake_next()
        yield from self.park(slot)


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
        on_cancel: Callable[[], None],
        *,
        in_order: bool,
    ) -> _ReplicaTasks:
        # A crash of the scheduler itself propagates out of the task group; replica mains
        # catch everything else.
        return _ReplicaTasks(mains, on_cancel, in_order)

    def gate_factory(self, ordered: bool) -> Callable[[], _TaskGate | _ChainGate]:
        return functools.partial(_TaskGate if ordered else _ChainGate, self._lowlevel)

    def park_cancelled(self, shielded: Callable[[], BaseException]) -> Iterable[Any]:
        # trio delivers the cancellation of the run's scope at the next checkpoint, unless a
        # shield keeps it out: then nothing would ever wake this replica.
        if self._trio.current_effective_deadline() != -math.inf:
            raise shielded()
        lowlevel = self._lowlevel
        return lowlevel.wait_task_rescheduled(  # type: ignore[no-any-return]
            lambda _raise_cancel: lowlevel.Abort.SUCCEEDED
        ).__await__()

    def defer_cancellation(self, exc: BaseException | None) -> Callable[[], Iterable[Any]]:
        # The cancel scope that raised it stays cancelled: the next checkpoint raises again
        # (unless a shield keeps it out there).
        return self._checkpoint_if_cancelled

    def cancel_requests(self) -> Callable[[], int]:
        return _zero

    def in_cancel_scope(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return True  # trio's own check is cheap, and knows a pending KeyboardInterrupt too

    def _checkpoint_if_cancelled(self) -> Generator[Any, Any, None]:
        yield from self._lowlevel.checkpoint_if_cancelled().__await__()

    def thread_result(self) -> _ThreadResult:
        return _ThreadResult(self._lowlevel)

    def spawn_background(self, fn: Callable[[], Awaitable[None]]) -> _Background:
        return _Background(self._trio, fn)
