"""A merge request is data: what ``merge_call`` yields to the replica's driver.

``ReplicaContext.merge_call`` makes one immutable request and returns the trap
(``aioreplica._context.merge_trap``), a generator that yields the request and returns what it
is sent back. The scheduler drives the replica's coroutine by hand, so the request reaches the
driver as the yielded value, the way trio's traps carry their payload and curio's requests are
the yield. Nothing else travels: the merge function, its arguments and a collective's timeout
are all in the request.

The request is the plain tuple ``(MERGE, fn, args, kwargs, timeout)``, read by the positions
below. It is made on every merge call, the hottest path there is, and the shape was measured:
at 64 replicas a bare merge round cost 1.56 µs per replica with the old mailbox fields, 1.61 µs
with this tuple and 1.76 µs with a ``NamedTuple`` (a tuple subclass is allocated and copied by
``tuple.__new__``; a slotted class pays a Python ``__init__``). ``MERGE`` first marks it as
ours; if the request ever reaches an event loop, it was awaited somewhere the scheduler does
not drive, and both asyncio and trio print its repr in their error, so ``MERGE``'s repr says
what went wrong.

``MergePoint`` is what the replica's side of the scheduler shows ``merge_call``, so that misuse
is refused at once, and ``Variable``, which finds there the variables the run's replicas share
(``VariableCreations``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias, final

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Mapping

__all__ = [
    "ARGS",
    "FN",
    "KWARGS",
    "MERGE",
    "TIMEOUT",
    "MergePoint",
    "MergeRequest",
    "VariableCreations",
]


@final
class _MergeMarker:
    """The first item of every merge request."""

    __slots__ = ()

    def __repr__(self) -> str:
        return (
            "<aioreplica merge_call trap: merge_call() must be awaited by the replica's own "
            "coroutine, not by a task it spawned (a task group child, asyncio.shield, or "
            "asyncio.wait_for, which runs its argument in a new task on Python 3.11); to "
            "bound the wait use `with anyio.fail_after(seconds): await ctx.merge_call(...)` "
            "instead>"
        )


MERGE: Final = _MergeMarker()

#: ``(MERGE, fn, args, kwargs, timeout)``: the merge function ``fn(strategy, *args, **kwargs)``,
#: this replica's positional and keyword arguments (``kwargs`` may be ``None``), and a
#: collective's ``timeout_seconds`` for this round only, or ``None``.
MergeRequest: TypeAlias = tuple[
    _MergeMarker, "Callable[..., Any]", tuple[Any, ...], "Mapping[str, Any] | None", float | None
]

# Positions in a MergeRequest.
FN: Final = 1
ARGS: Final = 2
KWARGS: Final = 3
TIMEOUT: Final = 4


class MergePoint(Protocol):
    """The scheduler's side of one replica, as ``merge_call`` sees it.

    ``in_own_coroutine`` is true only while the scheduler runs this replica's own coroutine;
    ``pending`` is the request made and not yet received by the driver (``None`` otherwise):
    a second call before awaiting the first, or a replica that finishes with one pending, is
    a misuse that ``misuse_message`` explains, as is one that finishes with a collective it
    called (``called``) and never awaited.
    """

    in_own_coroutine: bool
    pending: MergeRequest | None

    def misuse_message(self, merge_fn: Callable[..., Any] | None = None) -> str: ...

    def called(self, collective: Coroutine[Any, Any, Any]) -> None:
        """Keep ``collective``, a coroutine of a collective this replica called, until the
        replica ends: one still unstarted then was never awaited."""
        ...

    def variable_creations(self) -> VariableCreations:
        """The variables made inside this replica's ``run()`` (one record per run)."""
        ...


@final
class VariableCreations:
    """The variables made inside the replicas of one ``run()``, shared as TF shares them:
    every replica's ``k``-th ``Variable(...)`` call returns the run's ``k``-th variable, made by
    the first replica to get there.

    ``variables`` holds each with the id in sync of the replica that made it; ``made`` counts,
    per local replica, the calls it has made. ``lock`` (reentrant: an initial value may make a
    variable of its own) guards both, for replicas that make variables in device threads.
    """

    __slots__ = ("lock", "made", "variables")

    def __init__(self, size: int) -> None:
        self.variables: list[tuple[Any, int]] = []
        self.made = [0] * size
        self.lock = threading.RLock()
