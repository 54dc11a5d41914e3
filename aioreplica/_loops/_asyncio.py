"""The asyncio (and uvloop) adapter: plain tasks, futures, ``call_soon_threadsafe``.

Measured on the merge path: anyio task groups cost 17-20 µs per replica to start a step
against 4-5 µs for bare tasks; a future per waiter 1.22 µs per replica per round against
0.88 µs for one shared future. So replicas are plain ``loop.create_task`` tasks supervised
here, and the replicas of an ordered round all park on one future.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import TYPE_CHECKING, Any, Final, final

# anyio keeps each task's innermost cancel scope here; it offers no public way to ask it of
# another task (the scheduler's shield tests pin this). Imported once: an import in a function
# costs a microsecond on every call, and the merge path asks on every step.
from anyio._backends._asyncio import _task_states

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Sequence

__all__ = ["AsyncioLoop"]

_Future = asyncio.Future


# -- replica tasks --------------------------------------------------------------------------


@final
class _ReplicaTasks:
    """Plain tasks supervised by hand: about a quarter of an anyio task group's start cost."""

    __slots__ = (
        "_cancelled",
        "_cancelling",
        "_loop",
        "_mains",
        "_on_cancel",
        "_on_crash",
        "_tasks",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        mains: Sequence[Callable[[], Coroutine[Any, Any, None]]],
        on_crash: Callable[[BaseException], None],
        on_cancel: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._mains = mains
        self._on_crash = on_crash
        self._on_cancel = on_cancel
        self._tasks: list[asyncio.Task[None]] = []
        self._cancelling = False
        self._cancelled: set[asyncio.Task[None]] = set()  # the tasks cancel() has reached

    def cancel(self) -> None:
        if not self._cancelling:
            self._cancelling = True
            self._on_cancel()
            # At the loop's next turn, as trio delivers a cancellation at a task's next wait:
            # a replica not started yet runs until its first wait (a synchronous step runs
            # whole), and one already woken with its part of a merge round takes it, instead
            # of being told that a round it took part in did not happen.
            self._loop.call_soon(self._deliver_cancellation)

    def _deliver_cancellation(self) -> None:
        """Cancel every task, except one inside a shielded anyio cancel scope: that one is
        cancelled once the shield has closed, as trio and anyio's task groups do."""
        shielded = False
        for task in self._tasks:
            if task in self._cancelled or task.done():
                continue
            if _in_anyio_shield(task):
                shielded = True
            else:
                self._cancelled.add(task)
                task.cancel()
        if shielded:  # look again at the next turn of the loop, as anyio's own scopes do
            self._loop.call_soon(self._deliver_cancellation)

    def is_cancellation(self, exc: BaseException) -> bool:
        return self._cancelling and isinstance(exc, asyncio.CancelledError)

    async def wait(self) -> None:
        loop = self._loop
        remaining = len(self._mains)
        waiter: asyncio.Future[None] | None = None

        def on_done(task: asyncio.Task[None]) -> None:
            nonlocal remaining
            remaining -= 1
            if not task.cancelled():
                exc = task.exception()
                if exc is not None:  # replica mains catch everything but cancellation
                    self._on_crash(exc)
            if remaining == 0 and waiter is not None and not waiter.done():
                waiter.set_result(None)

        for main in self._mains:
            task = loop.create_task(main())
            task.add_done_callback(on_done)
            self._tasks.append(task)
        if self._cancelling:  # cancelled before the tasks existed
            self._cancelling = False
            self.cancel()
        caller_cancelled: BaseException | None = None
        while remaining:
            waiter = loop.create_future()
            try:
                await waiter
            except asyncio.CancelledError as exc:
                # The caller is cancelled: cancel every replica, and still wait for all of
                # them, so that none outlives run(); then let the cancellation through.
                caller_cancelled = exc
                self.cancel()
        self._tasks.clear()
        self._cancelled.clear()
        if caller_cancelled is not None:
            raise caller_cancelled


def _in_anyio_shield(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` is inside an ``anyio.CancelScope(shield=True)`` (``to_thread.run_sync``
    enters one too), which a cancellation from outside must not reach.

    anyio offers no public way to ask this of another task (``_task_states``).
    """
    state = _task_states.get(task)
    scope = state.cancel_scope if state is not None else None
    while scope is not None:
        if scope.shield:
            return True
        scope = scope._parent_scope
    return False


# -- gates ----------------------------------------------------------------------------------


@final
class _SharedGate:
    """An ordered round: every replica parks on one future, so one ``set_result`` wakes them
    all, in the order they parked.

    Cancelling a task cancels the future it waits on; when that is the shared one, every
    replica parked there wakes with ``CancelledError``, but only the one whose task was
    cancelled is meant: the one whose ``Task.cancelling()`` count went up while it was parked
    (not merely above 0: a replica in the ``finally`` of a cancelled scope, a cleanup
    ``merge_call`` in a shield, say, still counts that earlier cancellation). ``interrupted``
    returns for the others, which the scheduler parks again, on a new future.
    """

    __slots__ = ("opened", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.waiter: asyncio.Future[None] = _Future(loop=loop)
        self.opened = False

    def park(self, slot: int) -> Iterable[Any]:
        waiter = self.waiter
        if waiter.done() and not self.opened:  # cancelled with a replica, or set by ``wake``
            waiter = self.waiter = _Future(loop=waiter.get_loop())
        return waiter

    def interrupted(self, exc: BaseException, requests: int) -> Generator[Any, Any, None]:
        if isinstance(exc, asyncio.CancelledError):
            task = asyncio.current_task()
            if task is not None and task.cancelling() <= requests:
                return  # another replica's cancellation cancelled the shared future
            del task
        try:
            raise exc
        finally:
            del exc
        yield  # a generator, like the other gates' (never reached)

    def open(self, slots: Iterable[int] | None) -> None:
        # One set_result wakes every parked replica in the order it parked, whatever ``slots``.
        self.opened = True
        if not self.waiter.done():  # done: its replicas are awake already and see the round
            self.waiter.set_result(None)

    def wake(self, slot: int) -> None:
        if not self.waiter.done():  # every parked replica wakes, and parks again
            self.waiter.set_result(None)

    def hand_over(self, order: Sequence[int], slot: int) -> Generator[Any, Any, None]:
        self.open(None)  # park order; the caller carries on first
        return
        yield  # a generator, like the other gates' (never reached)


@final
class _FutureGate:
    """A shuffled round: a future per replica, set in the order the scheduler asks."""

    __slots__ = ("_futures", "_loop", "opened")

    waiter = None

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._futures: dict[int, asyncio.Future[None]] = {}
        self.opened = False

    def park(self, slot: int) -> Iterable[Any]:
        future: asyncio.Future[None] = _Future(loop=self._loop)
        self._futures[slot] = future
        return future

    def interrupted(self, exc: BaseException, requests: int) -> Generator[Any, Any, None]:
        try:
            raise exc
        finally:
            del exc
        yield  # a generator, like the other gates' (never reached)

    def open(self, slots: Iterable[int] | None) -> None:
        self.opened = True
        futures = self._futures
        for slot in list(futures) if slots is None else slots:
            future = futures.get(slot)
            if future is not None and not future.done():  # done: cancelled, leaving the round
                future.set_result(None)

    def wake(self, slot: int) -> None:
        future = self._futures.pop(slot, None)
        if future is not None and not future.done():
            future.set_result(None)

    def hand_over(self, order: Sequence[int], slot: int) -> Generator[Any, Any, None]:
        # asyncio runs ready tasks first in, first out: wake those before ``slot``, step behind
        # them once, then wake the rest, which run after ``slot``'s next wait.
        position = order.index(slot)
        self.open(order[:position])
        try:
            if position:
                yield None  # back of the ready queue
        finally:
            self.open(order[position + 1 :])


#: What a generator yields from to give the event loop one turn (``asyncio.sleep(0)``).
_ONE_TURN: tuple[None] = (None,)

#: How anyio's cancel scopes begin the message of the cancellations they deliver.
_ANYIO_CANCELLATION: Final = "Cancelled via cancel scope "


def _anyio_cancellation_pending(task: asyncio.Task[Any]) -> bool:
    """Whether an anyio cancel scope around ``task``'s current position, not behind a shield,
    is cancelled: anyio then (re)delivers that cancellation by itself, at the next wait."""
    state = _task_states.get(task)
    scope = state.cancel_scope if state is not None else None
    while scope is not None:
        if scope.cancel_called:
            return True
        if scope.shield:
            return False
        scope = scope._parent_scope
    return False


def _zero() -> int:
    return 0


# -- thread results -------------------------------------------------------------------------


@final
class _ThreadResult:
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


# -- background tasks -----------------------------------------------------------------------


@final
class _Background:
    """A task of its own, held until it is done: asyncio keeps only a weak reference to a
    task, and the owner's may go with the owner (a dataset iterator collected as part of a
    reference cycle cancels its task on the way out), which must not take the task with it
    before the task has run its cancellation."""

    __slots__ = ("_task",)

    def __init__(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], Awaitable[None]]) -> None:
        self._task = loop.create_task(_call(fn))
        _running.add(self._task)
        self._task.add_done_callback(_running.discard)

    @property
    def done(self) -> bool:
        return self._task.done()

    def cancel(self) -> None:
        self._task.cancel()

    async def wait(self) -> None:
        await asyncio.wait([self._task])


async def _call(fn: Callable[[], Awaitable[None]]) -> None:
    await fn()


#: The background tasks not yet done (``_Background``).
_running: set[asyncio.Task[None]] = set()


# -- the adapter ----------------------------------------------------------------------------


@final
class AsyncioLoop:
    """The adapter of one running asyncio (or uvloop) event loop."""

    cancelled_class: type[BaseException] = asyncio.CancelledError

    __slots__ = ("_loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def replica_tasks(
        self,
        mains: Sequence[Callable[[], Coroutine[Any, Any, None]]],
        on_crash: Callable[[BaseException], None],
        on_cancel: Callable[[], None],
        *,
        in_order: bool,
    ) -> _ReplicaTasks:
        # New tasks run first in, first out: always in order.
        return _ReplicaTasks(self._loop, mains, on_crash, on_cancel)

    def gate_factory(self, ordered: bool) -> Callable[[], _SharedGate | _FutureGate]:
        return functools.partial(_SharedGate if ordered else _FutureGate, self._loop)

    def park_cancelled(self, shielded: Callable[[], BaseException]) -> Iterable[Any]:
        # The run is failing and every replica has been cancelled: deliver it now. Waiting
        # for the task's cancellation instead would hang if the replica's code swallowed it.
        task = asyncio.current_task()
        in_shield = task is not None and _in_anyio_shield(task)
        del task  # what is raised holds this frame, which must not hold the task (a cycle)
        if in_shield:
            raise shielded()
        raise asyncio.CancelledError

    def defer_cancellation(self, exc: BaseException | None) -> Callable[[], Iterable[Any]]:
        task = asyncio.current_task()
        requests = task.cancelling() if task is not None else 0
        message = None
        if exc is not None and exc.args and isinstance(exc.args[0], str):
            message = exc.args[0]
        if task is None:
            return lambda: ()
        if exc is None or (message is not None and message.startswith(_ANYIO_CANCELLATION)):
            # anyio's scopes deliver their cancellation again at the task's next wait, once no
            # shield keeps it out: left to anyio, which counts its requests itself.
            def pending() -> Iterable[Any]:
                # A bare yield lets anyio's delivery, already queued, request it first: the
                # task's next step raises it (a merge_call is a checkpoint).
                return _ONE_TURN if _anyio_cancellation_pending(task) else ()

            return pending

        def again() -> Iterable[Any]:
            # Still requested (an expiring asyncio.timeout withdraws its request with
            # Task.uncancel() as it exits): request it once more, the count unchanged, so that
            # the next await raises it (a bare Task.cancel() passes anyio's shields).
            if not requests or task.cancelling() < requests:
                return ()
            task.uncancel()
            task.cancel(message)
            return _ONE_TURN  # a bare yield: the task's next step raises it

        return again

    def cancel_requests(self) -> Callable[[], int]:
        task = asyncio.current_task()
        return task.cancelling if task is not None else _zero

    def in_cancel_scope(self) -> bool:
        task = asyncio.current_task()
        state = _task_states.get(task) if task is not None else None
        return state is not None and state.cancel_scope is not None

    def cancelled(self) -> bool:
        task = asyncio.current_task()
        return task is not None and _anyio_cancellation_pending(task)

    def thread_result(self) -> _ThreadResult:
        return _ThreadResult(self._loop)

    def spawn_background(self, fn: Callable[[], Awaitable[None]]) -> _Background:
        return _Background(self._loop, fn)
