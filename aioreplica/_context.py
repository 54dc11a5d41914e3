"""Replica and cross-replica contexts, and ``ReplicaContext``: a replica's view of its run.

Code runs in one of three contexts, each found from one ``ContextVar`` (never from the thread:
every replica is a task on one thread, and both asyncio and trio copy the context into each
task, so the replica travels with its coroutine and concurrent ``run()`` calls never see each
other):

- **replica context**: inside a replica of ``strategy.run``. ``get_replica_context()``
  returns that replica's ``ReplicaContext``.
- **cross-replica context**: inside ``merge_fn`` or ``with strategy.scope():``.
  ``get_replica_context()`` returns ``None`` and ``in_cross_replica_context()`` is true.
- **default context**: anywhere else. As in TensorFlow, there is a default single-replica
  strategy with a default ``ReplicaContext`` whose ``merge_call`` runs ``merge_fn`` at once,
  so code written for replicas also runs without any strategy.

Exactly one of ``get_replica_context() is not None`` and ``in_cross_replica_context()`` holds.

The strategy is the facade above this layer, so here it is an opaque object (typed ``Any``)
that is passed to merge functions and compared by identity. The default strategy is reached
through one registration point, ``register_default_context``, which the facade calls once at
import with a factory of the default replica context.

A ``ReplicaContext`` holds the reduction engine of its strategy; each of its collectives is one
merge call whose merge function calls the engine.
"""

from __future__ import annotations

import inspect
import reprlib
import types
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex, TypeVar, final

from . import _trace
from ._errors import ReplicaSyncError, made_by_yield, yielding_step
from ._merge import MERGE
from ._options import ReduceOp
from ._values import PerReplica, agreed, register_current_replica, select_replica

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Generator

    from ._backends import Device
    from ._collectives import ReductionEngine
    from ._merge import MergePoint, MergeRequest
    from ._options import CommunicationOptions

__all__ = [
    "COLLECTIVE_VALUES",
    "MERGE_CALLS",
    "ContextState",
    "ReplicaContext",
    "context_state",
    "default_replica_context",
    "default_scope_open",
    "get_cross_replica_context",
    "get_replica_context",
    "in_cross_replica_context",
    "register_default_context",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ContextState:
    """Where the running code is: in a replica, in cross-replica context, or neither.

    Attributes:
        replica: the replica whose code is running, or None.
        strategy: the strategy of the enclosing ``scope()`` or ``merge_fn``, or None.
        engine: that strategy's reduction engine (variables made in its scope use it).
        merging: true inside ``merge_fn`` (cross-replica, but ``run()`` may not nest there).
    """

    replica: ReplicaContext | None = None
    strategy: Any = None
    engine: ReductionEngine | None = None
    merging: bool = False


#: One variable, so entering a replica or a merge is one ``set`` and leaving it one ``reset``.
context_state: ContextVar[ContextState] = ContextVar(
    "aioreplica.context_state", default=ContextState()
)

#: Whether the default strategy's ``scope()`` is open. It changes nothing else (as in TF), but
#: a variable made in another strategy's scope entered inside it is refused, as TF's default
#: strategy's variable creator refuses it ("Mixing different tf.distribute.Strategy objects").
default_scope_open: ContextVar[bool] = ContextVar("aioreplica.default_scope_open", default=False)


@types.coroutine
def merge_trap(request: MergeRequest) -> Generator[Any, Any, Any]:
    """Yield ``request`` to the replica's driver; return the result the scheduler sends back."""
    return (yield request)


@final
class ReplicaContext:
    """The view of one replica from inside its code (``get_replica_context()``).

    ``strategy.run()`` makes one for each of its replicas; unlike TF's, it is not made by hand
    (it needs the strategy's reduction engine and the replica's place in its run): get it with
    ``get_replica_context()``. A constructor call with anything else raises ``TypeError``.

    Example:
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> async def step():
        ...     ctx = aioreplica.get_replica_context()
        ...     replica_id = ctx.replica_id_in_sync_group
        ...     return await ctx.merge_call(lambda s, v: sum(v.values), args=(replica_id,))
        >>> anyio.run(strategy.run, step)
        1
    """

    __slots__ = ("_device", "_engine", "_merge_point", "_replica_id", "_strategy")

    def __init__(
        self,
        strategy: Any,
        engine: ReductionEngine,
        replica_id: int,
        merge_point: MergePoint | None,
    ) -> None:
        devices = getattr(engine, "devices", None)
        if (
            not isinstance(devices, tuple | list)
            or type(replica_id) is not int
            or not 0 <= replica_id < len(devices)
        ):
            raise TypeError(
                f"ReplicaContext({strategy!r:.60}, {engine!r:.60}, {replica_id!r:.20}, ...) "
                "was called by hand; strategy.run() makes the ReplicaContext of each of its "
                "replicas (from the strategy's reduction engine and the replica's index): call "
                "aioreplica.get_replica_context() inside a replica instead (outside any, it "
                "returns the default single-replica context)"
            )
        self._strategy = strategy
        self._engine = engine
        self._replica_id = replica_id
        device: Device = devices[replica_id]
        self._device = device
        self._merge_point = merge_point

    @property
    def strategy(self) -> Any:
        """The strategy this replica belongs to (a ``MirroredStrategy``)."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id, ``0 <= id < num_replicas_in_sync`` (over all workers of a
        multi-worker strategy: worker ``w``'s local replica ``j`` is ``w * local + j``)."""
        return self._engine.first_replica + self._replica_id

    @property
    def local_replica_id(self) -> int:
        """This replica's index among its worker's replicas (its component of ``run()``'s
        arguments and results); the same as ``replica_id_in_sync_group`` in one process."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run in sync (over all workers)."""
        return self._engine.num_replicas

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
                the same function in the same round: the same code, and for a
                ``functools.partial`` or bound method equal bound arguments.
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
            ReplicaSyncError: (from ``run()``) replicas passed different merge functions.
            Exception: whatever ``merge_fn`` raises; ``run()`` then raises it once and cancels
                every replica.

        Example:
            >>> async def step():
            ...     ctx = aioreplica.get_replica_context()
            ...     return await ctx.merge_call(lambda strategy: "merged")
            >>> anyio.run(aioreplica.MirroredStrategy(["cpu:0", "cpu:1"]).run, step)
            'merged'
        """
        # A plain function returning a generator trap, not a coroutine: one frame less on the
        # hottest path there is, and a forgotten ``await`` still fails loudly (see Returns).
        if type(args) is not tuple:
            args = self._checked_args(args)
        if kwargs is not None and type(kwargs) is not dict:
            self._check_kwargs(kwargs)
        point = self._merge_point
        if point is None:
            return _merge_now(self._strategy, merge_fn, args, kwargs)
        if not point.in_own_coroutine or point.pending is not None:
            raise RuntimeError(point.misuse_message(merge_fn))
        request = point.pending = (MERGE, merge_fn, args, kwargs, None)
        return merge_trap(request)

    def _checked_args(self, args: Any) -> tuple[Any, ...]:
        if isinstance(args, list):
            return tuple(args)
        shown = reprlib.repr(args)
        raise TypeError(
            f"replica {self.replica_id_in_sync_group} passed merge_call args={shown} "
            f"({type(args).__name__}); args must be the tuple of merge_fn's positional "
            f"arguments: write args=({shown},)"
        )

    def _check_kwargs(self, kwargs: Any) -> None:
        if not isinstance(kwargs, Mapping):
            raise TypeError(
                f"replica {self.replica_id_in_sync_group} passed merge_call kwargs of type "
                f"{type(kwargs).__name__}; kwargs is a mapping of merge_fn's keyword arguments "
                "(or None)"
            )

    def _collective(
        self, merge_fn: Callable[..., Any], args: tuple[Any, ...], timeout: float | None
    ) -> Awaitable[Any]:
        """One merge round running ``merge_fn`` (which returns a ``PerReplica``), bounded by
        ``timeout`` seconds of waiting for the other replicas to arrive.

        ``merge_call``'s checks and request, with a timeout, returning the request's trap as
        ``merge_call`` does (no frame of its own); ``merge_call`` keeps its own copy of them so
        that the hottest path there is stays one frame.
        """
        point = self._merge_point
        if point is None:
            return _collective_now(self._strategy, merge_fn, args)
        if not point.in_own_coroutine or point.pending is not None:
            raise RuntimeError(point.misuse_message(merge_fn))
        request = point.pending = (MERGE, merge_fn, args, None, timeout)
        return merge_trap(request)

    # -- collectives (each one merge round; the engine does the work) ----------------------

    def _called(self, coroutine: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        """``coroutine``, a collective this replica called, kept until the replica ends: one
        never awaited took no part in its collective, and the replica is told so then (each
        collective is a coroutine made by a plain method, so it may be awaited later, in
        turn with others, or handed to a task as any coroutine)."""
        point = self._merge_point
        if point is not None:
            point.called(coroutine)
        return coroutine

    def all_reduce(
        self, reduce_op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None
    ) -> Coroutine[Any, Any, Any]:
        """Reduce ``value`` across replicas; every replica gets the result on its device.

        Every replica must call it. ``value`` is a nested structure of arrays or scalars, the
        same structure, shapes and dtypes on every replica. Small arrays are packed and
        reduced together. Host replicas share one read-only result (copy it to change it).

        Args:
            reduce_op: ``ReduceOp.SUM``, ``MEAN``, ``MAX``, ``MIN``, ``PROD``, or its name
                (TF's name for it, so ``all_reduce(reduce_op=..., value=...)`` works as in TF).
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
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def step():
            ...     ctx = aioreplica.get_replica_context()
            ...     return await ctx.all_reduce("sum", np.ones(3))
            >>> anyio.run(strategy.run, step)
            array([2., 2., 2.])
        """
        return self._called(self._all_reduce(reduce_op, value, options))

    async def _all_reduce(
        self, op: ReduceOp | str, value: Any, options: CommunicationOptions | None
    ) -> Any:
        engine = self._engine
        try:
            op = ReduceOp.parse(op)
        except ValueError as exc:
            engine.refusing("all_reduce", exc)
            raise
        options = self._options("all_reduce", options)
        return await self._collective(
            _merge_all_reduce, (engine, op, value, options), options._timeout
        )

    def all_gather(
        self, value: Any, axis: SupportsIndex = 0, options: CommunicationOptions | None = None
    ) -> Coroutine[Any, Any, Any]:
        """Concatenate every replica's ``value`` along ``axis``; every replica gets the whole.

        ``options`` overrides the strategy's ``CommunicationOptions`` for this call (its
        ``timeout_seconds`` bounds the wait for the other replicas and workers).

        Shapes may differ along ``axis`` (uneven batches), nowhere else.

        Raises:
            ValueError: structures, dtypes or shapes off ``axis`` differ; ``axis`` out of range.
            TypeError: NumPy and CuPy arrays mixed; ``axis`` is not an integer.

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def step():
            ...     ctx = aioreplica.get_replica_context()
            ...     return await ctx.all_gather(np.arange(2) + ctx.replica_id_in_sync_group)
            >>> anyio.run(strategy.run, step)
            array([0, 1, 1, 2])
        """
        return self._called(self._all_gather(value, axis, options))

    async def _all_gather(
        self, value: Any, axis: SupportsIndex, options: CommunicationOptions | None
    ) -> Any:
        engine = self._engine
        timeout = self._options("all_gather", options)._timeout
        return await self._collective(_merge_all_gather, (engine, value, axis, options), timeout)

    def broadcast(
        self,
        value: Any,
        source_replica: SupportsIndex = 0,
        options: CommunicationOptions | None = None,
    ) -> Coroutine[Any, Any, Any]:
        """Give every replica ``source_replica``'s ``value`` (the others' are ignored, across
        workers too: only the structure must be the same).

        ``options`` overrides the strategy's ``CommunicationOptions`` for this call (its
        ``timeout_seconds`` bounds the wait for the other replicas and workers).

        Raises:
            ValueError: ``source_replica`` is out of range, or structures differ.
            TypeError: ``source_replica`` is not an int (a bool is not one).

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def step():
            ...     ctx = aioreplica.get_replica_context()
            ...     mine = np.full(2, float(ctx.replica_id_in_sync_group))
            ...     return await ctx.broadcast(mine, source_replica=1)
            >>> anyio.run(strategy.run, step)
            array([1., 1.])
        """
        return self._called(self._broadcast(value, source_replica, options))

    async def _broadcast(
        self, value: Any, source_replica: SupportsIndex, options: CommunicationOptions | None
    ) -> Any:
        engine = self._engine
        try:
            source_replica = engine.check_source(source_replica)  # at once, in this replica
        except (TypeError, ValueError) as exc:
            engine.refusing("broadcast", exc)
            raise
        timeout = self._options("broadcast", options)._timeout
        return await self._collective(
            _merge_broadcast, (engine, value, source_replica, options), timeout
        )

    def reduce_scatter(
        self,
        op: ReduceOp | str,
        value: Any,
        axis: SupportsIndex = 0,
        options: CommunicationOptions | None = None,
    ) -> Coroutine[Any, Any, Any]:
        """Reduce across replicas, then give replica ``i`` the ``i``-th chunk along ``axis``.

        ``options`` overrides the strategy's ``CommunicationOptions`` for this call (its
        ``timeout_seconds`` bounds the wait for the other replicas and workers).

        Chunks are ``array_split`` parts: sizes differ by at most one, larger ones first.

        Raises:
            ValueError: as ``all_reduce``, or ``axis`` out of range.
            TypeError: as ``all_reduce``, or ``axis`` is not an integer.

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def step():
            ...     ctx = aioreplica.get_replica_context()
            ...     return await ctx.reduce_scatter("sum", np.arange(4.0))
            >>> anyio.run(strategy.run, step)
            PerReplica({0: array([0., 2.]), 1: array([4., 6.])})
        """
        return self._called(self._reduce_scatter(op, value, axis, options))

    async def _reduce_scatter(
        self,
        op: ReduceOp | str,
        value: Any,
        axis: SupportsIndex,
        options: CommunicationOptions | None,
    ) -> Any:
        engine = self._engine
        try:
            op = ReduceOp.parse(op)
        except ValueError as exc:
            engine.refusing("reduce_scatter", exc)
            raise
        options = self._options("reduce_scatter", options)
        return await self._collective(
            _merge_reduce_scatter, (engine, op, value, axis, options), options._timeout
        )

    def barrier(self, options: CommunicationOptions | None = None) -> Coroutine[Any, Any, None]:
        """Wait until every replica has reached this barrier.

        ``options`` overrides the strategy's ``CommunicationOptions`` for this call (its
        ``timeout_seconds`` bounds the wait for the other replicas and workers).

        Raises:
            ReplicaSyncError: (from ``run()``) replicas late past ``timeout_seconds``.

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def step():
            ...     ctx = aioreplica.get_replica_context()
            ...     arrived.append(ctx.replica_id_in_sync_group)
            ...     await ctx.barrier()
            ...     return sorted(arrived)  # every replica has arrived
            >>> arrived = []
            >>> anyio.run(strategy.run, step)
            [0, 1]
        """
        return self._called(self._barrier(options))

    async def _barrier(self, options: CommunicationOptions | None) -> None:
        options = self._options("barrier", options)
        await self._collective(_merge_barrier, (self._engine, options), options._timeout)

    def _options(self, what: str, options: Any) -> CommunicationOptions:
        """The strategy's communication options with the call's ``options`` over them.

        Raises:
            TypeError: ``options`` is not a ``CommunicationOptions`` or None (refused in step
                across workers, as a collective's other arguments are).
        """
        try:
            return self._engine.options.override(options)
        except TypeError as exc:
            self._engine.refusing(what, exc)
            raise

    def __reduce_ex__(self, protocol: SupportsIndex, /) -> NoReturn:
        """Refuse ``copy.copy``, ``copy.deepcopy`` and ``pickle``: a replica context belongs to
        one replica of one run, and its strategy cannot be copied either.

        Raises:
            TypeError: always.

        Example:
            >>> import copy
            >>> copy.copy(get_replica_context())
            Traceback (most recent call last):
            TypeError: cannot copy or pickle <ReplicaContext replica 0 of 1 on cpu:0>: ...
        """
        raise TypeError(
            f"cannot copy or pickle {self!r}: a replica context is valid only inside its own "
            "replica, and it holds its strategy, which is not copied; call "
            "get_replica_context() where the copy was to be used"
        )

    def __repr__(self) -> str:
        return (
            f"<ReplicaContext replica {self.replica_id_in_sync_group} of "
            f"{self.num_replicas_in_sync} on {self._device.name}>"
        )


# -- the collectives' merge functions (the engine is an argument: one object, kept plain) ---


def _agreed(engine: ReductionEngine, value: Any, what: str) -> Any:
    """``agreed``, naming this worker's replicas by their ids in sync."""
    return agreed(value, what, first_replica=engine.first_replica)


async def _merge_all_reduce(
    strategy: Any, engine: ReductionEngine, op: Any, value: Any, options: Any
) -> PerReplica[Any]:
    try:
        op = _agreed(engine, op, "the reduce op of all_reduce")
        options = _agreed(engine, options, "the communication options of all_reduce")
        return PerReplica(await engine.all_reduce(op, value, options))
    except _REFUSALS as exc:
        await engine.refuse("all_reduce", exc)
        raise


async def _merge_all_gather(
    strategy: Any, engine: ReductionEngine, value: Any, axis: Any, options: Any
) -> PerReplica[Any]:
    try:
        axis = _agreed(engine, axis, "the axis of all_gather")
        options = _agreed(engine, options, "the communication options of all_gather")
        return PerReplica(await engine.all_gather(value, axis, options))
    except _REFUSALS as exc:
        await engine.refuse("all_gather", exc)
        raise


async def _merge_broadcast(
    strategy: Any, engine: ReductionEngine, value: Any, source: Any, options: Any
) -> PerReplica[Any]:
    try:
        source = _agreed(engine, source, "the source_replica of broadcast")
        options = _agreed(engine, options, "the communication options of broadcast")
        return PerReplica(await engine.broadcast(value, source, matching=False, options=options))
    except _REFUSALS as exc:
        await engine.refuse("broadcast", exc)
        raise


async def _merge_reduce_scatter(
    strategy: Any, engine: ReductionEngine, op: Any, value: Any, axis: Any, options: Any
) -> PerReplica[Any]:
    try:
        op = _agreed(engine, op, "the reduce op of reduce_scatter")
        axis = _agreed(engine, axis, "the axis of reduce_scatter")
        options = _agreed(engine, options, "the communication options of reduce_scatter")
        return PerReplica(await engine.reduce_scatter(op, value, axis, options))
    except _REFUSALS as exc:
        await engine.refuse("reduce_scatter", exc)
        raise


#: The built-in collectives' merge functions, by the name a replica calls, and which of their
#: arguments (after the strategy) is the replicas' value: a structure that differs between
#: replicas is then named from that value's root (``_scheduler``).
COLLECTIVE_VALUES: dict[Callable[..., Any], tuple[str, int]] = {
    _merge_all_reduce: ("all_reduce", 2),
    _merge_all_gather: ("all_gather", 1),
    _merge_broadcast: ("broadcast", 1),
    _merge_reduce_scatter: ("reduce_scatter", 2),
}


#: What a collective's checks raise on bad arguments: across workers, the merge functions
#: refuse them on every worker in step (``ReductionEngine.refuse``) before raising.
_REFUSALS = (TypeError, ValueError, ReplicaSyncError)


def _merge_barrier(
    strategy: Any, engine: ReductionEngine, options: CommunicationOptions
) -> Awaitable[None] | None:
    if engine.cluster is not None:  # the other workers' replicas too
        return engine.barrier(options)
    recorder = _trace.recorder
    if recorder is not None:  # nothing to move: a mark of where the replicas met
        with recorder.span("barrier", {"devices": strategy.num_replicas_in_sync}):
            pass
    return None


#: The calls that the library's own merge functions stand for, by merge function: the
#: collectives here, and what other modules add (a variable's write, an optimizer step), so
#: that replicas making different ones are told which calls they made (``_scheduler``).
MERGE_CALLS: dict[Callable[..., Any], str] = {
    **{merge_fn: name for merge_fn, (name, _) in COLLECTIVE_VALUES.items()},
    _merge_barrier: "barrier",
}


# -- the default context ----------------------------------------------------------------------


async def _merge_now(
    strategy: Any,
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
    token = context_state.set(
        ContextState(strategy=strategy, engine=default_replica_context()._engine, merging=True)
    )
    try:
        result = merge_fn(strategy, *args, **(kwargs or {}))
        if inspect.isawaitable(result):
            result = await result
        elif made_by_yield(merge_fn, result):
            raise yielding_step("merge_fn", result, "a merge_fn")
        return result
    finally:
        context_state.reset(token)


async def _collective_now(
    strategy: Any, merge_fn: Callable[..., Any], args: tuple[Any, ...]
) -> Any:
    """A collective of the default single-replica context: the merge at once, replica 0's part."""
    return select_replica(0, await _merge_now(strategy, merge_fn, args, None))


def other_strategy(shown: str, other: Any, other_shown: str) -> str:
    """How a message refusing to mix strategies shows the other one: ``other_shown``, or,
    where it reads as this strategy's ``shown`` (two strategies over the same devices),
    ``another MirroredStrategy object with the same devices``."""
    if other_shown != shown:
        return other_shown
    return f"another {type(other).__name__} object with the same devices"


_default_context_factory: Callable[[], ReplicaContext] | None = None
_default_context: ReplicaContext | None = None


def register_default_context(factory: Callable[[], ReplicaContext]) -> None:
    """Say how to make the default replica context: the one registration point.

    The facade (``_strategy``) calls it once at import with a factory that builds the default
    single-replica strategy and returns its replica context; the context is made on first use.
    Imports point down only, so this layer never imports the facade.
    """
    global _default_context_factory
    _default_context_factory = factory


def default_replica_context() -> ReplicaContext:
    """The default single-replica context (its ``.strategy`` is the default strategy).

    Raises:
        RuntimeError: nothing was registered (``aioreplica._strategy`` was never imported).
    """
    global _default_context
    if _default_context is None:
        if _default_context_factory is None:  # pragma: no cover - the package imports _strategy
            raise RuntimeError("aioreplica._strategy was not imported")
        _default_context = _default_context_factory()
    return _default_context


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
    return default_replica_context()


def get_cross_replica_context() -> Any:
    """Return the current strategy in cross-replica context, else ``None`` (TF's name).

    Exactly one of ``get_replica_context()`` and ``get_cross_replica_context()`` is ``None``
    at any point, as in TF.

    Example:
        >>> get_cross_replica_context() is None
        True
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> with strategy.scope():
        ...     get_cross_replica_context() is strategy
        True
    """
    state = context_state.get()
    return state.strategy if state.replica is None else None


def in_cross_replica_context() -> bool:
    """Return whether the caller is in cross-replica context (``merge_fn`` or ``scope()``).

    Example:
        >>> in_cross_replica_context()
        False
    """
    state = context_state.get()
    return state.replica is None and state.strategy is not None


def _current_local_replica() -> int | None:
    """The running replica's index among this process's replicas (``Mirrored`` computes with
    its copy), or None outside a replica."""
    replica = context_state.get().replica
    return None if replica is None else replica.local_replica_id


register_current_replica(_current_local_replica)
