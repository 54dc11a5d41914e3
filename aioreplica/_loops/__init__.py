"""One adapter per event loop: the only code that uses a loop's native primitives.

Library code talks to anyio. Invariant 7 (``docs/architecture.md``) names the one exception:
here, where a few microseconds per replica per round decide whether a merge round stays within
2x of the bare-asyncio floor. ``current()`` picks the adapter of the running loop once per loop
and caches it; ``_asyncio.py`` and ``_trio.py`` implement the same protocols under the same
section headings, as anyio's backends do:

- **replica tasks** (``replica_tasks``): spawn one task per replica, cancel them all on demand
  or when the caller is cancelled (and say so at once: a merge function the scheduler shields
  from a replica's own cancellation stops then), wait for all, let none outlive the call. The
  tasks take the cancellation as trio delivers it, at their next wait: on asyncio it is
  delivered at the loop's next turn, so a task not started yet starts, and one woken with its
  part of a merge round takes it.
- **gates** (``gate_factory``): where the replicas of one merge round park until the last one has
  run the merge function, and how they are woken in the order the scheduler asks for.
- **defer_cancellation**: keep a cancellation that reached a replica after its part of a
  merge round was committed for the replica's next checkpoint (trio's cancel scopes and anyio's
  do that by themselves, past any shield; on asyncio a bare one is requested again).
- **cancel_requests**: what counts the cancellations requested of a replica's task, so that a
  gate whose replicas share one waiter tells its own from a sibling's.
- **park_cancelled**: deliver a failing run's cancellation to a replica that would otherwise park
  (raised at once on asyncio, at the next checkpoint on trio); a replica inside an anyio shield,
  which no cancellation reaches, gets the exception the scheduler gives instead.
- **thread results** (``thread_result``): a worker thread hands a result to the waiting task
  without blocking until the loop gets round to it.
- **background tasks** (``spawn_background``): a task owned by an object (a dataset's
  prefetcher) rather than by a task group of the caller's.

Nothing outside this package asks which loop it is on, and the adapters never write into the
scheduler's objects: they return what the scheduler keeps.
"""

from __future__ import annotations

import asyncio
import sys
import weakref
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Sequence

__all__ = ["Background", "Gate", "Loop", "ReplicaTasks", "ThreadResult", "current"]


class Gate(Protocol):
    """Where the replicas of one merge round wait, identified by their replica ids.

    ``park(slot)`` is what a replica ``yield from``s to wait; ``open(slots)`` wakes the parked
    ones in that order (a slot that left, cancelled, is skipped), ``open(None)`` in the order
    they parked. A gate whose replicas all
    wait on one object (asyncio's ordered rounds: one future) also shows it as ``waiter``, so
    the scheduler's fast path parks without a call; other gates' ``waiter`` is ``None``.
    ``wake(slot)`` wakes a parked replica without opening the gate (others too, where they
    share one waiter): the scheduler looks at the round again and parks it again.

    If ``park`` raises, the scheduler hands the exception to ``interrupted``, with what
    ``Loop.cancel_requests`` counted as the replica parked; it returns when the exception was not
    meant for this replica (asyncio wakes everyone parked on a shared future when one of them is
    cancelled: the scheduler parks it again), or raises it.
    """

    @property
    def opened(self) -> bool: ...

    @property
    def waiter(self) -> Iterable[Any] | None: ...

    def park(self, slot: int) -> Iterable[Any]: ...

    def interrupted(self, exc: BaseException, requests: int) -> Generator[Any, Any, None]: ...

    def open(self, slots: Iterable[int] | None) -> None: ...

    def wake(self, slot: int) -> None: ...

    def hand_over(self, order: Sequence[int], slot: int) -> Generator[Any, Any, None]:
        """Called by the running replica ``slot`` (not parked): wake the parked ones and carry
        on, all in ``order`` (which holds ``slot``); returns when it is ``slot``'s turn.

        A gate made ``ordered`` wakes in park order and lets ``slot`` carry on first.
        """
        ...


class ReplicaTasks(Protocol):
    """The tasks of one ``run()``: ``wait`` runs them all to their end; ``cancel`` stops them
    (each at its next wait).

    If the caller of ``wait`` is cancelled, every task is cancelled and still awaited before
    the cancellation goes on, so none outlives ``wait``. Either way the tasks are cancelled,
    ``on_cancel`` (given to ``Loop.replica_tasks``) is called, once or more.
    """

    def cancel(self) -> None: ...

    def is_cancellation(self, exc: BaseException) -> bool:
        """Whether ``exc``, seen in a replica, is the cancellation of the run (``cancel`` or the
        caller's), rather than one the replica's own code raised."""
        ...

    async def wait(self) -> None: ...


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


class Background(Protocol):
    """A task that belongs to an object rather than to a task group (a dataset's prefetcher).

    Its owner cancels it when it is done with it (``cancel`` may be called any number of
    times, from the loop thread) and may wait for it to end; ``fn`` must not raise.
    """

    @property
    def done(self) -> bool: ...

    def cancel(self) -> None: ...

    async def wait(self) -> None: ...


class Loop(Protocol):
    """The adapter of one running event loop (see the module docstring)."""

    #: The exception a cancelled task sees (``asyncio.CancelledError``, ``trio.Cancelled``).
    cancelled_class: type[BaseException]

    def replica_tasks(
        self,
        mains: Sequence[Callable[[], Coroutine[Any, Any, None]]],
        on_crash: Callable[[BaseException], None],
        on_cancel: Callable[[], None],
        *,
        in_order: bool,
    ) -> ReplicaTasks:
        """Tasks running ``mains``; with ``in_order`` they start in that order, each once the
        one before has run up to its first wait (a seeded interleave is one order per seed).
        ``on_cancel`` is called as they are cancelled (``ReplicaTasks``)."""
        ...

    def gate_factory(self, ordered: bool) -> Callable[[], Gate]:
        """What makes the gate of each round, chosen once per run. An unordered gate wakes
        replicas in exactly the order given, one after another, on every loop."""
        ...

    def park_cancelled(self, shielded: Callable[[], BaseException]) -> Iterable[Any]:
        """Deliver the failing run's cancellation to the calling replica, or raise
        ``shielded()`` if it is inside an anyio shield (where waiting would never end)."""
        ...

    def defer_cancellation(self, exc: BaseException | None) -> Callable[[], Iterable[Any]]:
        """The cancellation ``exc`` reached the calling replica after its part of a merge round
        was committed: the replica takes its part, and the cancellation is to fire at its next
        checkpoint instead, as trio does for an operation that completed. ``None``: whatever
        cancellation a shield (the one around the merge function the replica ran) held off.

        Returns what the scheduler calls at the replica's next step. It requests the
        cancellation again where the loop needs that (asyncio's bare ``Task.cancel()`` fires
        once), unless its requester withdrew it meanwhile (an expiring ``asyncio.timeout`` does,
        as it exits); trio's cancel scopes and anyio's stay cancelled by themselves, and reach
        the replica only where no shield keeps them out. It returns a checkpoint, which the
        scheduler yields from when that step is a ``merge_call`` (which the loop never sees):
        it raises the cancellation if it still holds there.
        """
        ...

    def cancel_requests(self) -> Callable[[], int]:
        """What counts the cancellations requested of the calling task so far (asyncio's
        ``Task.cancelling``; always 0 on trio, where no sibling's cancellation wakes a task)."""
        ...

    def in_cancel_scope(self) -> bool:
        """Whether the calling task (a replica's) may be inside a cancel scope of its own,
        which a shield must then keep out of its merge function: on asyncio, whether it is in
        any anyio scope (a task that entered none can only be cancelled with its run, or by a
        bare ``Task.cancel()``, which no shield stops); always on trio, whose shields are
        cheap."""
        ...

    def cancelled(self) -> bool:
        """Whether the calling task may be cancelled at its next checkpoint: a cancelled anyio
        scope around it, not behind a shield, on asyncio (as ``anyio.lowlevel
        .checkpoint_if_cancelled`` asks, in a fraction of its time); always on trio. When
        ``False``, ``checkpoint_if_cancelled()`` would do nothing."""
        ...

    def thread_result(self) -> ThreadResult: ...

    def spawn_background(self, fn: Callable[[], Awaitable[None]]) -> Background: ...


_asyncio_adapters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Loop] = (
    weakref.WeakKeyDictionary()
)
_trio_adapter: list[Loop] = []


def current() -> Loop:
    """The adapter for the event loop running the caller, made once per loop.

    Raises:
        RuntimeError: no asyncio or trio event loop is running.

    Example:
        >>> async def which():
        ...     return type(current()).__module__
        >>> anyio.run(which)
        'aioreplica._loops._asyncio'
    """
    loop = asyncio._get_running_loop()
    if loop is not None:
        adapter = _asyncio_adapters.get(loop)
        if adapter is None:
            from ._asyncio import AsyncioLoop

            adapter = _asyncio_adapters[loop] = AsyncioLoop(loop)
        return adapter
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            pass
        else:
            if not _trio_adapter:
                from ._trio import TrioLoop

                _trio_adapter.append(TrioLoop(trio))
            return _trio_adapter[0]
    raise RuntimeError(
        "strategy.run() must be awaited inside a running asyncio or trio event loop, "
        "e.g. anyio.run(main) or asyncio.run(main())"
    )
