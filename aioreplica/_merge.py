"""A merge request is data: what ``merge_call`` yields to the replica's driver.

``ReplicaContext.merge_call`` makes one immutable ``MergeRequest`` and returns the trap
(``aioreplica._context.merge_trap``), a generator that yields the request and returns what it
is sent back. The scheduler drives the replica's coroutine by hand, so the request reaches the
driver as the yielded value, the way trio's traps carry their payload and curio's requests are
the yield. Nothing else travels: the merge function, its arguments and a collective's timeout
are all in the request. ``MergePoint`` is what the replica's side of the scheduler shows
``merge_call`` to refuse misuse at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

__all__ = ["MergePoint", "MergeRequest"]


class MergeRequest(NamedTuple):
    """One replica's side of one merge round (a NamedTuple: it is made on every merge call).

    If it ever reaches an event loop, it was awaited somewhere the scheduler does not drive,
    and both asyncio and trio print its repr in their error: so the repr says what went wrong.

    Attributes:
        fn: the merge function, ``fn(strategy, *args, **kwargs)``.
        args: this replica's positional arguments.
        kwargs: this replica's keyword arguments, or ``None``.
        timeout: a collective's ``timeout_seconds`` for this round only, or ``None``.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] | None
    timeout: float | None

    def __repr__(self) -> str:
        return (
            "<aioreplica merge_call trap: merge_call() must be awaited by the replica's own "
            "coroutine, not by a task it spawned (a task group child, asyncio.shield, or "
            "asyncio.wait_for, which runs its argument in a new task on Python 3.11); to "
            "bound the wait use `with anyio.fail_after(seconds): await ctx.merge_call(...)` "
            "instead>"
        )


class MergePoint(Protocol):
    """The scheduler's side of one replica, as ``merge_call`` sees it.

    ``in_own_coroutine`` is true only while the scheduler runs this replica's own coroutine;
    ``pending`` is the request made and not yet received by the driver (``None`` otherwise):
    a second call before awaiting the first, or a replica that finishes with one pending, is
    a misuse that ``misuse_message`` explains.
    """

    in_own_coroutine: bool
    pending: MergeRequest | None

    def misuse_message(self) -> str: ...
