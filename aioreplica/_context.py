"""Replica and cross-replica contexts.

Code runs in one of three contexts, each found from two ``ContextVar``s (never from the
thread: every replica is a task on one thread, and both asyncio and trio copy the context into
each task, so the replica id travels with its coroutine and concurrent ``run()`` calls never
see each other):

- **replica context**: inside a replica of ``strategy.run``. ``get_replica_context()``
  returns that replica's ``ReplicaContext``.
- **cross-replica context**: inside ``merge_fn`` or ``with strategy.scope():``.
  ``get_replica_context()`` returns ``None`` and ``in_cross_replica_context()`` is true.
- **default context**: anywhere else. As in TensorFlow, there is a default single-replica
  strategy with a default ``ReplicaContext`` whose ``merge_call`` runs ``merge_fn`` at once,
  so code written for replicas also runs without any strategy.

Exactly one of ``get_replica_context() is not None`` and ``in_cross_replica_context()`` holds.
"""

from __future__ import annotations

import inspect
import types
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, final

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Generator, Mapping

    from ._backends import Device
    from ._collectives import CommunicationOptions, ReduceOp
    from ._strategy import MirroredStrategy

__all__ = [
    "ReplicaContext",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]


@dataclass(frozen=True, slots=True)
class ContextState:
    """Where the running code is: in a replica, in cross-replica context, or neither.

    Attributes:
        replica: the replica whose code is running, or None.
        strategy: the strategy of the enclosing ``scope()`` or ``merge_fn``, or None.
        merging: true inside ``merge_fn`` (cross-replica, but ``run()`` may not nest there).
    """

    replica: ReplicaContext | None = None
    strategy: MirroredStrategy | None = None
    merging: bool = False


#: One variable, so entering a replica or a merge is one ``set`` and leaving it one ``reset``.
context_state: ContextVar[ContextState] = ContextVar(
    "aioreplica.context_state", default=ContextState()
)

_default_strategy: MirroredStrategy | None = None
_default_strategy_factory: Callable[[], MirroredStrategy] | None = None


class MergePoint(Protocol):
    """The scheduler's side of one replica: where ``merge_call`` leaves its request.

    ``merge_call`` checks ``stepping`` (true only while the scheduler is running this
    replica's own coroutine) and that no earlier request is pending (``merge_fn is None``),
    stores its request here and returns the trap; awaiting the trap yields ``MERGE`` to the
    scheduler, which runs the round, clears the request and sends the replica its result.
    """

    stepping: bool
    merge_fn: Callable[..., Any] | None
    merge_args: tuple[Any, ...]
    merge_kwargs: Mapping[str, Any] | None

    def set_merge_timeout(self, timeout: float) -> None: ...

    def misuse_message(self) -> str: ...


@final
class _MergeTrapMarker:
    """What a replica coroutine yields to its driver at a merge point.

    It only ever reaches an event loop when a trap is awaited somewhere the scheduler does not
    drive, and both asyncio and trio then print its repr in their error: so the repr says what
    went wrong.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return (
            "<aioreplica merge_call trap: merge_call() must be awaited by the replica's own "
            "coroutine, not by a task it spawned (a task group child, asyncio.shield, or "
            "asyncio.wait_for, which runs its argument in a new task on Python 3.11); to "
            "bound the wait use `with anyio.fail_after(seconds): await ctx.merge_call(...)` "
            "instead>"
        )


MERGE: Final = _MergeTrapMarker()


@types.coroutine
def _merge_trap() -> Generator[Any, Any, Any]:
    """The one private primitive a replica awaits: the scheduler sends back its result."""
    return (yield MERGE)


@final
class ReplicaContext:
    """The view of one replica from inside its code (``get_replica_context()``).

    Example:
        >>> import anyio, aioreplica
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> async def step():
        ...     ctx = aioreplica.get_replica_context()
        ...     replica_id = ctx.replica_id_in_sync_group
        ...     return await ctx.merge_call(lambda s, v: sum(v.values), args=(replica_id,))
        >>> anyio.run(strategy.run, step)
        1
    """

    __slots__ = ("_device", "_merge_point", "_replica_id", "_strategy")

    def __init__(
        self,
        strategy: MirroredStrategy,
        replica_id: int,
        device: Device,
        merge_point: MergePoint | None,
    ) -> None:
        self._strategy = strategy
        self._replica_id = replica_id
        self._device = device
        self._merge_point = merge_point

    @property
    def strategy(self) -> MirroredStrategy:
        """The strategy this replica belongs to."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id, ``0 <= id < num_replicas_in_sync``."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run in sync."""
        return self._strategy.num_replicas_in_sync

    @property
    def device(self) -> Device:
        """The device this replica runs on."""
        return self._device

    @property
    def devices(self) -> tuple[str, ...]:
        """The canonical names of this replica's devices (one device per replica)."""
        return (self._device.name,)

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Awaitable[Any]:
        """Wait for every replica, run ``merge_fn`` once, and return this replica's part.

        When every replica of the step has reached its ``merge_call``, the ``args`` and
        ``kwargs`` of all replicas are regrouped (a value that differs between replicas becomes
        a ``PerReplica``), ``merge_fn(strategy, *args, **kwargs)`` runs once in cross-replica
        context (awaited if it returns an awaitable), and each replica resumes with
        ``select_replica(its_id, result)``.

        Args:
            merge_fn: called as ``merge_fn(strategy, *args, **kwargs)``; every replica must pass
                the same function (the same code) in the same round.
            args: this replica's positional arguments for ``merge_fn``.
            kwargs: this replica's keyword arguments for ``merge_fn``.

        Returns:
            An awaitable of this replica's slice of ``merge_fn``'s result. Await it at once,
            in the replica's own coroutine: the request is made when ``merge_call`` is called,
            and a replica that calls it again, or finishes, without awaiting it fails with
            ``RuntimeError``.

        Raises:
            RuntimeError: called outside this replica's own coroutine: from cross-replica
                context, after ``run()`` returned, or from a task the replica spawned (such as
                ``asyncio.wait_for`` on Python 3.11; use ``anyio.fail_after`` instead); or
                called again before the previous call was awaited.
            Exception: whatever ``merge_fn`` raises; ``run()`` then raises it once and cancels
                every replica.

        Example:
            >>> async def step():
            ...     ctx = aioreplica.get_replica_context()
            ...     return await ctx.merge_call(lambda strategy: "merged")
        """
        # A plain function returning a generator trap, not a coroutine: one frame less on the
        # hottest path there is, and a forgotten ``await`` still fails loudly (see Returns).
        point = self._merge_point
        if point is None:
            return _merge_now(merge_fn, args, kwargs)
        if not point.stepping or point.merge_fn is not None:
            raise RuntimeError(point.misuse_message())
        point.merge_fn = merge_fn
        point.merge_args = args
        point.merge_kwargs = kwargs
        return _merge_trap()

    # -- collectives (each one merge call; see aioreplica._collectives) -------------------

    async def all_reduce(
        self, op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None
    ) -> Any:
        """Reduce ``value`` across replicas; every replica gets the result on its device.

        Every replica must call it. ``value`` is a nested structure of arrays or scalars, the
        same structure, shapes and dtypes on every replica. Small arrays are packed and
        reduced together. Host replicas share one read-only result (copy it to change it).

        Args:
            op: ``ReduceOp.SUM``, ``MEAN``, ``MAX``, ``MIN``, ``PROD``, or its name.
            value: this replica's contribution.
            options: overrides the strategy's ``CommunicationOptions`` for this call.

        Returns:
            The reduced structure (arrays on this replica's device).

        Raises:
            ValueError: an unknown op; structures, shapes or dtypes that differ between
                replicas (naming the replicas and the key path).
            TypeError: NumPy and CuPy arrays mixed, or an op the dtype cannot do.
            ReplicaSyncError: (from ``run()``) replicas late past ``timeout_seconds``.

        Example:
            >>> async def step():
            ...     ctx = aioreplica.get_replica_context()
            ...     return await ctx.all_reduce("sum", np.ones(3))
        """
        return await self._strategy.extended.communicator.all_reduce(self, op, value, options)

    async def all_gather(
        self, value: Any, axis: int = 0, options: CommunicationOptions | None = None
    ) -> Any:
        """Concatenate every replica's ``value`` along ``axis``; every replica gets the whole.

        Shapes may differ along ``axis`` (uneven batches), nowhere else.

        Raises:
            ValueError: structures, dtypes or shapes off ``axis`` differ; ``axis`` out of range.
            TypeError: NumPy and CuPy arrays mixed.

        Example:
            >>> async def step():
            ...     ctx = aioreplica.get_replica_context()
            ...     return await ctx.all_gather(np.arange(2) + ctx.replica_id_in_sync_group)
        """
        return await self._strategy.extended.communicator.all_gather(self, value, axis, options)

    async def broadcast(
        self, value: Any, source_replica: int = 0, options: CommunicationOptions | None = None
    ) -> Any:
        """Give every replica ``source_replica``'s ``value`` (the others' are ignored).

        Raises:
            ValueError: ``source_replica`` is out of range, or structures differ.

        Example:
            >>> async def step():
            ...     ctx = aioreplica.get_replica_context()
            ...     return await ctx.broadcast(np.random.default_rng().random(3))
        """
        return await self._strategy.extended.communicator.broadcast(
            self, value, source_replica, options
        )

    async def reduce_scatter(
        self,
        op: ReduceOp | str,
        value: Any,
        axis: int = 0,
        options: CommunicationOptions | None = None,
    ) -> Any:
        """Reduce across replicas, then give replica ``i`` the ``i``-th chunk along ``axis``.

        Chunks are ``array_split`` parts: sizes differ by at most one, larger ones first.

        Raises:
            ValueError: as ``all_reduce``, or ``axis`` out of range.
            TypeError: as ``all_reduce``.

        Example:
            >>> async def step():
            ...     ctx = aioreplica.get_replica_context()
            ...     return await ctx.reduce_scatter("sum", np.arange(8.0))
        """
        return await self._strategy.extended.communicator.reduce_scatter(
            self, op, value, axis, options
        )

    async def barrier(self, options: CommunicationOptions | None = None) -> None:
        """Wait until every replica has reached this barrier.

        Raises:
            ReplicaSyncError: (from ``run()``) replicas late past ``timeout_seconds``.

        Example:
            >>> async def step():
            ...     await aioreplica.get_replica_context().barrier()
        """
        await self._strategy.extended.communicator.barrier(self, options)

    def __repr__(self) -> str:
        return (
            f"<ReplicaContext replica {self._replica_id} of {self.num_replicas_in_sync} "
            f"on {self._device.name}>"
        )


async def _merge_now(
    merge_fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None,
) -> Any:
    """The default replica context's merge: with one replica, merge at once."""
    if in_cross_replica_context():
        raise RuntimeError(
            "merge_call() was called in cross-replica context (inside merge_fn or "
            "strategy.scope()); call it from replica code, or call the merge function "
            "directly"
        )
    strategy = get_default_strategy()
    token = context_state.set(ContextState(strategy=strategy, merging=True))
    try:
        result = merge_fn(strategy, *args, **(kwargs or {}))
        if inspect.isawaitable(result):
            result = await result
        return result
    finally:
        context_state.reset(token)


def merge_call_with_timeout(
    ctx: ReplicaContext,
    merge_fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout: float | None,
) -> Awaitable[Any]:
    """``ctx.merge_call(merge_fn, args)`` whose round fails after ``timeout`` seconds.

    Collectives use it for ``CommunicationOptions.timeout_seconds``: when replicas wait at this
    merge point longer than that for the others, the run fails with ``ReplicaSyncError``
    naming the late replicas.
    """
    awaitable = ctx.merge_call(merge_fn, args)
    point = ctx._merge_point
    if timeout is not None and point is not None:
        point.set_merge_timeout(timeout)
    return awaitable


def set_default_strategy_factory(factory: Callable[[], MirroredStrategy]) -> None:
    """Let ``_strategy`` say how to make the default strategy (imports point down only)."""
    global _default_strategy_factory
    _default_strategy_factory = factory


def get_default_strategy() -> MirroredStrategy:
    """The process-wide default single-replica strategy, made on first use."""
    global _default_strategy
    if _default_strategy is None:
        if _default_strategy_factory is None:  # pragma: no cover - _strategy is always imported
            raise RuntimeError("aioreplica._strategy was not imported")
        _default_strategy = _default_strategy_factory()
    return _default_strategy


_default_replica_context: ReplicaContext | None = None


def _get_default_replica_context() -> ReplicaContext:
    global _default_replica_context
    if _default_replica_context is None:
        strategy = get_default_strategy()
        _default_replica_context = ReplicaContext(
            strategy, 0, strategy.extended.replica_devices[0], None
        )
    return _default_replica_context


def get_replica_context() -> ReplicaContext | None:
    """Return the current replica's context, or ``None`` in cross-replica context.

    Returns:
        Inside a replica of ``strategy.run``: that replica's ``ReplicaContext``. Inside
        ``merge_fn`` or ``with strategy.scope():``: ``None``. Anywhere else: the default
        single-replica context, whose ``merge_call`` runs ``merge_fn`` at once.

    Example:
        >>> get_replica_context().num_replicas_in_sync
        1
    """
    state = context_state.get()
    if state.replica is not None:
        return state.replica
    if state.strategy is not None:
        return None
    return _get_default_replica_context()


def in_cross_replica_context() -> bool:
    """Return whether the caller is in cross-replica context (``merge_fn`` or ``scope()``).

    Example:
        >>> in_cross_replica_context()
        False
    """
    state = context_state.get()
    return state.replica is None and state.strategy is not None


def get_strategy() -> MirroredStrategy:
    """Return the current strategy: of this replica, ``merge_fn`` or ``scope()``, else the default.

    Example:
        >>> get_strategy().num_replicas_in_sync
        1
    """
    state = context_state.get()
    if state.replica is not None:
        return state.replica.strategy
    return state.strategy if state.strategy is not None else get_default_strategy()


def has_strategy() -> bool:
    """Return whether a strategy other than the default one is current.

    Example:
        >>> has_strategy()
        False
    """
    return get_strategy() is not get_default_strategy()
