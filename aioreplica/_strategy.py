"""``MirroredStrategy``: the facade, and the composition root of everything below it.

The constructor builds the parts and hands them down: the devices, the reduction engine
(``aioreplica._collectives``) and the scheduler. Its methods check the context, turn what users
pass (device names, op names) into what the engine takes (device objects, ``ReduceOp``), and
wrap the engine's one-result-per-device lists as ``Mirrored`` at this public boundary only.
Nothing below this module calls back into it: the default strategy is made here and reached
from below through ``aioreplica._context.register_default_context``.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import math
import os
import random
import sys
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Final,
    Literal,
    NoReturn,
    SupportsIndex,
    TypeAlias,
    TypeVar,
    final,
)

import anyio
import numpy as np

from . import _loops, _trace, _tree
from ._backends import (
    Device,
    HostDevice,
    array_kind,
    canonical_device_name,
    resolve_devices,
)
from ._backends._arrays import on_replica_devices
from ._collectives import ReductionEngine, reductions_for
from ._context import (
    ContextState,
    ReplicaContext,
    context_state,
    default_replica_context,
    default_scope_open,
    other_strategy,
    register_default_context,
)
from ._dataset import (
    DistributedDataset,
    InputContext,
    InputOptions,
    InputReplicationMode,
    ValueContext,
    checked_prefetch,
    distribute_values,
    interleaved,
)
from ._errors import add_note, as_integer, as_real
from ._options import CommunicationOptions, ReduceOp
from ._scheduler import Scheduler, SchedulerStatistics
from ._steps import MultiStepContext, run_steps, run_steps_on_iterator
from ._values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    misfit,
    regroup,
    select_replica,
    select_replicas,
)
from ._variables import SyncOnReadVariable, Variable, check_updated_by, update, variable_label

if TYPE_CHECKING:
    import threading

__all__ = ["MirroredStrategy", "StrategyExtended", "get_strategy", "has_strategy"]

_INTERLEAVES = ("ordered", "random")
#: ``options=None`` of the dataset functions: TF's defaults, without its buffer size of 1 (the
#: dataset functions' own ``prefetch`` default, 2, stands).
_DEFAULT_INPUT_OPTIONS: Final = InputOptions()
#: What leaving a scope resets: the context variable its entry set, and the token.
_ScopeToken: TypeAlias = "tuple[contextvars.ContextVar[Any], contextvars.Token[Any]]"
_T = TypeVar("_T")

#: What ``array_kind`` calls the values that stand for their device as a destination.
_ARRAY_KINDS: Final = ("numpy", "scalar", "cupy")


@final
class StrategyExtended:
    """Lower-level facts and operations of a strategy (``strategy.extended``), as in TF."""

    __slots__ = ("_strategy",)

    def __init__(self, strategy: MirroredStrategy) -> None:
        self._strategy = strategy

    def __reduce_ex__(self, protocol: SupportsIndex, /) -> NoReturn:
        """Refuse copies and pickles, as the strategy does (``MirroredStrategy.__reduce_ex__``).

        Raises:
            TypeError: always.

        Example:
            >>> import copy
            >>> copy.deepcopy(MirroredStrategy(["cpu:0"]).extended)
            Traceback (most recent call last):
            TypeError: cannot copy or pickle MirroredStrategy(devices=['cpu:0']).extended: ...
        """
        raise TypeError(_not_copied(self._strategy, ".extended"))

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The canonical device names of this worker's replicas, in replica order."""
        return self._strategy.devices

    @property
    def replica_devices(self) -> tuple[Device, ...]:
        """The device objects of the replicas, in replica order."""
        return self._strategy._device_objects

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where variables are placed: on every one of this worker's replica devices."""
        return self._strategy.devices

    def non_slot_devices(self, var_list: Sequence[Any]) -> tuple[str, ...]:
        """Where a variable that is not a slot of ``var_list``'s variables goes (TF 1's
        question): on every one of this worker's replica devices, as ``parameter_devices``.

        Example:
            >>> MirroredStrategy(["cpu:0", "cpu:1"]).extended.non_slot_devices([])
            ('cpu:0', 'cpu:1')
        """
        return self._strategy.devices

    @property
    def experimental_between_graph(self) -> bool:
        """Whether each worker runs its own copy of the program: across workers (``True``),
        or one process (``False``).

        Example:
            >>> MirroredStrategy().extended.experimental_between_graph
            False
        """
        return self._strategy._engine.cluster is not None

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker is the one that writes checkpoints: always with one process;
        across workers, the chief alone (``save`` is still called on every worker).

        Example:
            >>> MirroredStrategy().extended.should_checkpoint
            True
        """
        cluster = self._strategy._engine.cluster
        return cluster is None or cluster.is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker should write summaries (logs, metrics): as
        ``should_checkpoint``, so that one worker writes them.

        Example:
            >>> MirroredStrategy().extended.should_save_summary
            True
        """
        return self.should_checkpoint

    @property
    def experimental_should_init(self) -> bool:
        """Whether this worker initialises variables: every worker does (across workers,
        each then starts from the chief's values).

        Example:
            >>> MirroredStrategy().extended.experimental_should_init
            True
        """
        return True

    @property
    def experimental_require_static_shapes(self) -> bool:
        """Whether values must keep their shapes from step to step: never (``False``, as on
        TF's mirrored strategies); a replica's batch may be shorter, or empty.

        Example:
            >>> MirroredStrategy().extended.experimental_require_static_shapes
            False
        """
        return False

    def read_var(self, v: Variable) -> Any:
        """The value of ``v`` in cross-replica context, as TF's ``read_var``: a sync-on-read
        variable's aggregate over every replica (of every worker), a mirrored one's value.

        Raises:
            RuntimeError: called inside a replica.
            TypeError: ``v`` is not an ``aioreplica.Variable``.
            ValueError: ``v`` belongs to another strategy; a sync-on-read ``v`` has
                aggregation ``NONE``.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     seen = aioreplica.Variable(0, synchronization="on_read", aggregation="sum")
            >>> strategy.extended.read_var(seen)
            array(0)
        """
        strategy = self._strategy
        strategy._check_cross_replica("extended.read_var")
        if not isinstance(v, Variable):
            raise TypeError(
                f"extended.read_var() takes an aioreplica.Variable, got {type(v).__name__} "
                f"{v!r:.60}"
            )
        if v.distribute_strategy is not strategy:
            raise ValueError(
                f"extended.read_var() of {strategy!r} was given variable {v.name!r}, which "
                f"belongs to {v.distribute_strategy!r}; read it through its own strategy"
            )
        return v.read_value()

    async def call_for_each_replica(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """``strategy.run(fn, args, kwargs)`` (TF 1's spelling).

        Raises:
            Exception: as ``run`` (a closed strategy's error names this call).

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def step(x):
            ...     return x * 2
            >>> anyio.run(strategy.extended.call_for_each_replica, step, (3,))
            6
        """
        self._strategy._check_open("extended.call_for_each_replica()")
        return await self._strategy.run(fn, args, kwargs)

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` is a variable made in this strategy's ``scope()``: one this strategy
        owns, whose copies live on its devices.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     owned = aioreplica.Variable(0.0)
            >>> strategy.extended.variable_created_in_scope(owned)
            True
            >>> strategy.extended.variable_created_in_scope(aioreplica.Variable(0.0))
            False
        """
        return isinstance(v, Variable) and v.distribute_strategy is self._strategy

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Variable) -> Iterator[None]:
        """Make the variables created in the block where ``colocate_with_variable`` is.

        Every variable of a mirrored strategy has a copy on each of its devices, so they are
        all colocated already: the block checks its argument, as TF's mirrored strategies do,
        and changes nothing else.

        Raises:
            RuntimeError: called outside this strategy's ``scope()`` (or its replicas).
            ValueError: ``colocate_with_variable`` is not a variable made in this strategy's
                scope.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     kernel = aioreplica.Variable(np.ones(2))
            ...     with strategy.extended.colocate_vars_with(kernel):
            ...         bias = aioreplica.Variable(0.0)
            >>> bias.devices == kernel.devices
            True
        """
        strategy = self._strategy
        if get_strategy() is not strategy:
            raise RuntimeError(
                f"colocate_vars_with() needs the scope of {strategy!r}: call it inside "
                "`with strategy.scope():`, where the colocated variables are made"
            )
        if not self.variable_created_in_scope(colocate_with_variable):
            given = type(colocate_with_variable).__name__
            if isinstance(colocate_with_variable, Variable):  # its name (a repr would read it)
                given += f" {colocate_with_variable.name!r}"
            raise ValueError(
                f"colocate_vars_with() takes a variable made in the scope of {strategy!r}, "
                f"not a {given}"
            )
        yield

    def value_container(self, value: Any) -> Any:
        """The container that ``value`` belongs to: a variable or a distributed value is its
        own; any other value (such as one replica's copy, a plain array) is returned as it
        is, so ``value in experimental_local_results(value_container(value))`` holds for
        values that are not containers. It works in any context, as TF's does.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     v = aioreplica.Variable(1.0)
            >>> strategy.extended.value_container(v) is v
            True
        """
        return value

    async def reduce_to(
        self,
        reduce_op: ReduceOp | str,
        value: Any,
        destinations: Any,
        options: CommunicationOptions | None = None,
    ) -> Any:
        """Reduce a distributed ``value`` across replicas and place it on ``destinations``.

        Args:
            reduce_op: how to combine the replicas' components.
            value: a distributed value or a variable (or a nested structure of them): a
                sync-on-read variable's copies are reduced; a mirrored variable or a
                ``Mirrored`` value holds one value, which ``MEAN``, ``MAX`` and ``MIN`` leave
                as it is.
            destinations: a device name, a list of names, a distributed value or a variable
                (its devices: the strategy's own), or an array (its device: a CuPy array's
                GPU; for a NumPy array or NumPy scalar, the host: the strategy's first host
                device). A Python number, which is on no device, is refused, as in TF.
            options: overrides the strategy's ``CommunicationOptions`` for this call (its
                packing and, across workers, the timeout of the wait for the other workers).

        Returns:
            The reduced value on the one destination device, or a ``Mirrored`` over several
            (host devices share one read-only array). ``MEAN`` of integers is a float64 mean,
            as ``strategy.reduce``'s.

        Raises:
            ValueError: a destination is not one of the strategy's devices, is listed twice,
                is a variable of another strategy or is a Python number; shapes differ; a
                mirrored variable or a ``Mirrored`` value reduced with ``SUM`` or ``PROD``.
            TypeError: an op the dtype cannot do; a leaf that is no number or array.
            RuntimeError: called inside a replica, or in another strategy's scope (across
                workers every worker raises then, the others ``WorkersDisagree``); across
                workers, called from another task while a ``run()`` is in progress there.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> anyio.run(
            ...     strategy.extended.reduce_to, "sum", aioreplica.PerReplica([1.0, 2.0]), "cpu:0"
            ... )
            array(3.)
        """
        strategy = self._strategy
        engine = strategy._engine
        async with engine.call("extended.reduce_to"):
            try:
                op = await strategy._begin_reduction("extended.reduce_to", reduce_op)
                value = _variables_as_values(value, op, strategy)
                devices = strategy._destinations(destinations)
                with _for_variables(engine, [destinations]):
                    results = await engine.reduce_to(op, value, devices, options)
            except (TypeError, ValueError) as exc:
                await engine.refuse("extended.reduce_to", exc)
                raise
        return _grouped(results)

    async def batch_reduce_to(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Sequence[tuple[Any, Any]],
        options: CommunicationOptions | None = None,
    ) -> list[Any]:
        """``reduce_to`` for several values at once, packed into as few reductions as possible.

        Error messages name value ``k`` of the list at ``[k]``. ``options`` overrides the
        strategy's ``CommunicationOptions`` for this call, as ``reduce_to``'s does.

        Raises:
            ValueError: as ``reduce_to``.
            TypeError: as ``reduce_to``; an item that is not a ``(value, destinations)`` pair.
            RuntimeError: called inside a replica, or in another strategy's scope (across
                workers every worker raises then, the others ``WorkersDisagree``); across
                workers, called from another task while a ``run()`` is in progress there.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> pairs = [(aioreplica.PerReplica([1.0, 2.0]), "cpu:0")] * 2
            >>> anyio.run(strategy.extended.batch_reduce_to, "mean", pairs)
            [array(1.5), array(1.5)]
        """
        strategy = self._strategy
        engine = strategy._engine
        async with engine.call("extended.batch_reduce_to"):
            try:
                op = await strategy._begin_reduction("extended.batch_reduce_to", reduce_op)
                given = _value_destination_pairs(value_destination_pairs)
                pairs = [
                    (_variables_as_values(value, op, strategy), strategy._destinations(dest))
                    for value, dest in given
                ]
                with _for_variables(engine, [dest for _, dest in given]):
                    results = await engine.batch_reduce_to(op, pairs, options)
            except (TypeError, ValueError) as exc:
                await engine.refuse("extended.batch_reduce_to", exc)
                raise
        return [_grouped(per_destination) for per_destination in results]

    async def update(
        self,
        var: Variable,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Set every copy of ``var`` to ``fn(copy, *args, **kwargs)``, all or none, as in TF.

        ``fn`` runs once per copy with that copy's device current and the arguments selected
        for its replica, as in TF: ``Mirrored`` values unwrapped; a ``PerReplica`` value's
        component of that replica for a sync-on-read variable, whose copies differ, and for a
        mirrored one only when every replica's component is equal. It returns the copy's new
        value (unlike TF, where ``fn`` assigns to a component
        variable), so that no copy changes unless every one was computed. Copies that host
        replicas share are computed once. In replica context every replica must call it; it
        then takes one merge round. Across workers, outside a ``run()``, every worker calls it,
        and a mirrored variable takes the chief's new value on every worker.

        Args:
            var: a variable of this strategy (or an ordinary variable).
            fn: ``fn(copy, *args, **kwargs) -> new value`` of the copy's shape and dtype.
            args: positional arguments; plain, ``Mirrored`` or ``PerReplica`` values.
            kwargs: keyword arguments; as ``args``.
            group: return the new value grouped (a ``Mirrored``, or the one array host
                replicas share; a sync-on-read variable's copies, which may differ, as a
                ``PerReplica``); ``False``: a tuple with one entry per copy.

        Returns:
            The new copies, grouped as ``group`` says.

        Raises:
            TypeError: ``var`` is not a variable, ``fn`` is not callable or is async (or
                returns an awaitable), or an argument of a mirrored variable is a
                ``PerReplica`` whose components differ; ``group`` is not a bool.
            RuntimeError: called in another strategy's scope (across workers, outside a
                ``run()``, the other workers then raise ``WorkersDisagree`` naming it).
            ValueError: ``var`` belongs to another strategy, or ``fn`` returned the wrong
                shape or dtype; across workers, another worker refused its update
                (``WorkersDisagree``); nothing has changed.
            Exception: whatever ``fn`` raises; nothing has changed.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     v = aioreplica.Variable(np.ones(2))
            >>> anyio.run(strategy.extended.update, v, lambda copy, x: copy * x, (3.0,))
            array([3., 3.])
        """
        strategy = self._strategy
        engine = strategy._engine
        state = context_state.get()
        if state.replica is not None:
            try:
                _check_group(group)
            except TypeError as exc:
                engine.refusing("extended.update()", exc)  # on every worker alike
                raise
            copies = await update(strategy, var, fn, args, kwargs)
        else:
            async with engine.call("extended.update()"):
                try:
                    _check_group(group)
                    strategy._check_not_mixed("extended.update()", state)
                    if isinstance(var, Variable):  # else ``update`` says what it needs
                        check_updated_by(strategy, var)
                except (TypeError, ValueError, RuntimeError) as exc:
                    # Across workers, outside a run()'s step, the others raise it too (in a
                    # merge_fn an update is this worker's own, with no collective to meet).
                    workers = engine.cluster
                    if workers is not None and not workers.in_step:
                        await engine.refuse("extended.update()", exc)
                    raise
                copies = await update(strategy, var, fn, args, kwargs)
        if not group:
            return copies
        replica = context_state.get().replica
        if replica is not None:
            return copies[replica.local_replica_id]
        if all(copy is copies[0] for copy in copies):
            return copies[0]
        return (PerReplica if isinstance(var, SyncOnReadVariable) else Mirrored)(list(copies))

    async def update_non_slot(
        self,
        colocate_with: Any,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` on ``colocate_with`` devices, as TF's: the update of
        variables that are no slot of another (TF 1's non-slot variables, such as an
        optimizer's step count), placed on the devices ``non_slot_devices()`` returns.

        ``fn`` runs once, plain or async, in this strategy's cross-replica context (in its
        scope), with ``args`` and ``kwargs`` as given; a variable it writes changes on every
        device, as any write outside a replica does. TF's ``MirroredStrategy`` calls ``fn``
        once per device instead, each in an update context that confines its writes to that
        device's copy; there is no such context here, so the one call does what TF's calls do
        together (as TF's default strategy, whose one call ``testUpdateNonSlot`` expects).

        Args:
            colocate_with: devices returned by ``non_slot_devices()`` (names of this
                strategy's devices).
            fn: the function to run, plain or async.
            args: a tuple or list of positional arguments for ``fn``.
            kwargs: a dict of keyword arguments for ``fn``.
            group: ``True`` (the default): ``fn``'s result as it returned it; ``False``: the
                result's structure with each leaf replaced by its local results (a tuple, one
                per local replica, as ``experimental_local_results`` gives them), the shape of
                TF's ``update_regroup``: ``{"a": 1}`` gives ``{"a": (1, 1)}`` on two replicas,
                where TF gives a plain value's local results as a 1-tuple, ``{"a": (1,)}``.

        Returns:
            The result of ``fn``, grouped as ``group`` says.

        Raises:
            RuntimeError: called inside a replica (call it outside ``run()``, or in a
                ``merge_fn``), or in another strategy's scope.
            ValueError: ``colocate_with`` names a device that is not this strategy's.
            TypeError: ``fn`` is not callable, ``args`` not a tuple or list, ``kwargs`` not
                a mapping, or ``group`` not a bool.
            Exception: whatever ``fn`` raises.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     steps = aioreplica.Variable(0)
            >>> async def count(step):
            ...     await steps.assign_add(step)
            ...     return steps.numpy()
            >>> async def main():
            ...     devices = strategy.extended.non_slot_devices([steps])
            ...     return await strategy.extended.update_non_slot(devices, count, (1,))
            >>> anyio.run(main)
            array(1)
        """
        strategy = self._strategy
        what = "strategy.extended.update_non_slot()"
        state = context_state.get()
        replica = state.replica
        if replica is not None:
            raise RuntimeError(
                f"{what} was called inside replica {replica.replica_id_in_sync_group}; it runs "
                "in cross-replica context: call it outside run(), or in a merge_fn "
                "(ctx.merge_call)"
            )
        strategy._check_not_mixed(what, state)
        if not callable(fn):
            raise TypeError(f"{what}: fn must be callable, got {type(fn).__name__} {fn!r:.60}")
        if not isinstance(args, tuple | list):
            raise TypeError(
                f"{what}: args must be a tuple or list, got {type(args).__name__} {args!r:.60}"
            )
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise TypeError(
                f"{what}: kwargs must be a dict or None, got {type(kwargs).__name__} {kwargs!r:.60}"
            )
        _check_group(group, what)
        try:
            strategy._destinations(colocate_with)
        except ValueError as exc:
            raise ValueError(
                f"{what}: colocate_with names the devices non_slot_devices() returns: {exc}"
            ) from exc
        with strategy.scope():
            result = fn(*args, **(kwargs or {}))
            if inspect.isawaitable(result):
                result = await result
        if group:
            return result
        return _tree.map_structure(strategy.experimental_local_results, result)

    async def experimental_run_steps_on_iterator(
        self,
        fn: Callable[[MultiStepContext, Any], Any],
        iterator: Any,
        iterations: int = 1,
        initial_loop_values: Mapping[str, Any] | None = None,
    ) -> MultiStepContext:
        """Call ``fn(context, inputs)`` once per element of ``iterator``, ``iterations`` times,
        in this strategy's cross-replica context, as TF's does.

        ``fn`` calls ``strategy.run`` itself and records outputs in ``context`` (a
        ``MultiStepContext``). ``strategy.run_steps`` is the faster loop: it keeps the
        replicas alive between steps.

        Args:
            fn: ``fn(context, inputs)``, a plain or coroutine function.
            iterator: an async iterator of distributed elements.
            iterations: how many steps, at most (fewer if ``iterator`` ends first).
            initial_loop_values: the outputs ``context`` starts with.

        Returns:
            The ``MultiStepContext``, holding the last step's outputs.

        Raises:
            TypeError: ``fn`` is not callable; ``iterator`` is not an async iterator;
                ``initial_loop_values`` is not a mapping of output names (strings) to values;
                ``fn`` is a generator or async generator function (it has a ``yield``: at the
                first step).
            RuntimeError: ``close()`` closed the strategy.
            ValueError: ``iterations`` is negative; across workers, another worker refused
                its arguments, or the workers were given different ``iterations``
                (``WorkersDisagree``, on every worker, before any step).
            Exception: whatever ``fn`` raises.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def fn(context, inputs):
            ...     await context.set_last_step_output("rows", len(inputs.values[0]))
            >>> batches = aioreplica.batched(np.arange(6), 4)
            >>> async def main():
            ...     iterator = aiter(strategy.distribute_dataset(batches))
            ...     run = strategy.extended.experimental_run_steps_on_iterator
            ...     return (await run(fn, iterator, iterations=2)).last_step_outputs
            >>> anyio.run(main)
            {'rows': 1}
        """
        return await run_steps_on_iterator(
            self._strategy, fn, iterator, iterations, initial_loop_values
        )

    async def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Place ``tensor`` on every destination device (host devices share one read-only
        copy).

        ``tensor`` (TF's name) is one value (a number, an array, or a nested structure of
        them): a ``Mirrored`` leaf counts as its value, which every replica holds, but a
        ``PerReplica`` is refused (reduce it first with ``reduce_to``, or pick one replica's
        component).

        ``destinations`` are as ``reduce_to``'s.

        Raises:
            ValueError: a destination is not one of the strategy's devices, is listed twice,
                is a variable of another strategy or is a Python number.
            TypeError: a leaf that is no number or array (``None``, a string), or a
                ``PerReplica``; nothing is placed.
            RuntimeError: called inside a replica.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> anyio.run(strategy.extended.broadcast_to, np.zeros(2), ["cpu:0", "cpu:1"])
            Mirrored({0: array([0., 0.]), 1: array([0., 0.])})
        """
        strategy = self._strategy
        strategy._check_cross_replica("extended.broadcast_to")
        await anyio.lowlevel.checkpoint_if_cancelled()  # a checkpoint, as every other call
        devices = strategy._destinations(destinations)
        return _grouped(await strategy._engine.broadcast_to(tensor, devices))


class MirroredStrategy:
    """Run one step function on several replicas in sync, each a coroutine on one event loop.

    Args:
        devices: one device per replica: names such as ``"cpu:0"`` (TF spellings like
            ``"/device:CPU:1"`` are accepted) or objects implementing ``Device``. ``None``
            means one host device, ``cpu:0``.
        sync_timeout: seconds a replica may wait at a merge point for the others to arrive
            before the run fails with ``ReplicaSyncError``; ``None`` waits as long as it
            takes. It bounds the arrival only, never the merge function's own work.
        interleave: ``"ordered"`` starts replicas in id order; at every merge point the
            replica that completes the round carries on first and the others resume in the
            order they arrived, the same way on every run (on trio, tasks made ready together
            run in an order trio chooses, starts included). ``"random"`` shuffles both orders
            with a seeded generator, to hunt order-dependent bugs: one order per seed, the
            same on asyncio, uvloop and trio (of starts and merge points; other awaits
            between them follow each loop's scheduling).
        seed: the seed for ``interleave="random"``; ``None`` draws one (see ``.seed``).
        communication_options: defaults for collectives (packing, timeout).
        slow_merge_warning: seconds after which a merge point that still waits for replicas
            logs one warning (logger ``"aioreplica"``, level WARNING) naming the replicas
            that have not arrived; it comes while the merge point still waits, within a
            quarter of this past it. ``None`` disables it. It costs the merge path nothing: one
            process-wide daemon thread ("aioreplica watchdog") looks at running merge points.

    Raises:
        ValueError: a device is unknown, unavailable or repeated; ``interleave`` is not one of
            ``"ordered"``, ``"random"``; ``sync_timeout`` or ``slow_merge_warning`` is not
            positive and finite; ``seed`` is given with ``interleave="ordered"``.
        TypeError: ``devices`` is not a list of devices (a number of replicas, a string, one
            device, a set), the message showing the list to write; or it holds something
            that is not a device; ``sync_timeout`` or ``slow_merge_warning`` is not a number
            or None (a bool is not one); ``seed`` is not an int or None.

    Example:
        >>> import anyio, aioreplica
        >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
        >>> async def step(x):
        ...     ctx = aioreplica.get_replica_context()
        ...     return x * (ctx.replica_id_in_sync_group + 1)
        >>> anyio.run(strategy.run, step, (10,))
        PerReplica({0: 10, 1: 20})
    """

    def __init__(
        self,
        devices: Sequence[str | Device] | None = None,
        *,
        sync_timeout: float | None = None,
        interleave: Literal["ordered", "random"] = "ordered",
        seed: SupportsIndex | None = None,
        communication_options: CommunicationOptions | None = None,
        slow_merge_warning: float | None = 60.0,
    ) -> None:
        slow_merge_warning = _checked_slow_merge_warning(slow_merge_warning)
        self._device_objects = resolve_devices(devices)
        if communication_options is None:
            communication_options = CommunicationOptions()
        elif not isinstance(communication_options, CommunicationOptions):
            raise TypeError(
                "communication_options must be a CommunicationOptions, got "
                f"{type(communication_options).__name__}"
            )
        if interleave not in _INTERLEAVES:
            raise ValueError(f"interleave must be one of {_INTERLEAVES}, got {interleave!r}")
        if sync_timeout is not None:
            seconds = as_real(sync_timeout)
            requirement = "sync_timeout must be a positive number of seconds or None"
            if seconds is None:
                raise TypeError(
                    f"{requirement}, got {type(sync_timeout).__name__} {sync_timeout!r:.60}"
                )
            if not seconds > 0:  # (NaN is not)
                raise ValueError(f"{requirement}, got {sync_timeout!r}")
            if math.isinf(seconds):
                raise ValueError(
                    f"{requirement}, got {sync_timeout!r:.60}, which is infinite or too "
                    "large: for no timeout pass None"
                )
            sync_timeout = seconds
        seed_value = None if seed is None else as_integer(seed)
        if seed is not None and seed_value is None:
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__} {seed!r}")
        if seed is not None and interleave != "random":
            raise ValueError(
                "seed only applies to interleave='random'; pass interleave='random' with it"
            )
        self._engine = self._new_engine(self._device_objects, communication_options)
        self._interleave = interleave
        self._sync_timeout = sync_timeout
        self._seed: int | None = None
        rng: random.Random | None = None
        if interleave == "random":
            self._seed = seed_value if seed_value is not None else random.randrange(2**32)
            rng = random.Random(self._seed)
        self._scheduler = Scheduler(
            self,
            self._engine,
            sync_timeout=sync_timeout,
            rng=rng,
            slow_merge_warning=slow_merge_warning,
        )
        self._extended = StrategyExtended(self)
        # Open: claims its host devices' worker threads until close() (see close()).
        self._host_devices = tuple(d for d in self._device_objects if isinstance(d, HostDevice))
        self._closed = False
        self._is_default = False
        self._claim()

    def _new_engine(
        self, devices: tuple[Device, ...], options: CommunicationOptions
    ) -> ReductionEngine:
        """The reduction engine over ``devices`` (a multi-worker strategy adds its workers)."""
        return ReductionEngine(devices, options)

    async def _sync_new_variables(self) -> None:
        """Before a collective that reads variables: those made since the last one take the
        chief's values (a multi-worker strategy; nothing to do in one process)."""

    # -- facts ----------------------------------------------------------------------------

    @property
    def cluster_resolver(self) -> Any:
        """``None``, as in TF: one process has no cluster (``MultiWorkerMirroredStrategy``'s is
        its ``cluster``)."""
        return None

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas, one per device (of every worker)."""
        return self._engine.num_replicas

    @property
    def devices(self) -> tuple[str, ...]:
        """The canonical device names, in replica order."""
        return tuple(device.name for device in self._device_objects)

    @property
    def extended(self) -> StrategyExtended:
        """Lower-level facts and operations, as ``tf.distribute.Strategy.extended``."""
        return self._extended

    @property
    def sync_timeout(self) -> float | None:
        """Seconds a replica may wait at a merge point, or ``None``."""
        return self._sync_timeout

    @property
    def slow_merge_warning(self) -> float | None:
        """Seconds a merge point may wait before it logs a warning, or ``None``."""
        return self._scheduler.slow_merge_warning

    @property
    def interleave(self) -> str:
        """``"ordered"`` or ``"random"``."""
        return self._interleave

    @property
    def seed(self) -> int | None:
        """The seed of ``interleave="random"`` (drawn when not given: print it to replay)."""
        return self._seed

    async def reduce(
        self,
        reduce_op: ReduceOp | str,
        value: Any,
        axis: SupportsIndex | Sequence[SupportsIndex] | None = None,
    ) -> Any:
        """Reduce a distributed ``value`` across replicas, in cross-replica context.

        With ``axis``, each replica's component is reduced along ``axis`` first; ``MEAN`` then
        divides by the number of elements along ``axis`` over all replicas, so replicas with
        short or empty batches count for what they hold. ``axis`` may be a tuple or list of
        axes, as in TF: ``axis=(0, 1)`` reduces both, and ``MEAN`` divides by the elements
        of both over all replicas. ``MEAN`` of integers is a float64 mean (NumPy's and TF's);
        ``SUM`` and ``PROD`` keep the dtype.

        Args:
            reduce_op: ``ReduceOp.SUM``, ``MEAN``, ``MAX``, ``MIN``, ``PROD``, or its name.
            value: a distributed value, or a nested structure with distributed leaves (a plain
                leaf counts as the same value on every replica). A variable counts as its
                copies: a sync-on-read variable's are reduced; a mirrored variable holds one
                value, which ``MEAN``, ``MAX`` and ``MIN`` leave as it is (as they leave a
                ``Mirrored`` value).
            axis: also reduce along this axis (or these axes) of each component.

        Returns:
            The reduced value, on replica 0's device.

        Raises:
            RuntimeError: called inside a replica (use ``ctx.all_reduce`` there), or in
                another strategy's scope (across workers every worker raises then, the others
                ``WorkersDisagree``); across workers, called from another task while a
                ``run()`` is in progress there.
            ValueError: an unknown op; shapes or dtypes that differ; ``axis`` out of range or
                naming an axis twice; a mirrored variable or a ``Mirrored`` value reduced with
                ``SUM`` or ``PROD``; across workers, another worker passed another op, axis,
                structure, shape or dtype (every worker raises it; nothing was reduced).
            TypeError: an op the dtype cannot do; NumPy and CuPy arrays mixed; ``axis`` is
                neither an integer nor a tuple or list of integers.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> losses = aioreplica.PerReplica([np.array([1.0, 2.0, 3.0]), np.array([4.0])])
            >>> float(anyio.run(strategy.reduce, "mean", losses, 0))
            2.5
        """
        engine = self._engine
        async with engine.call("strategy.reduce"):
            try:
                op = await self._begin_reduction("reduce", reduce_op)
                return await engine.reduce(op, _variables_as_values(value, op, self), axis)
            except (TypeError, ValueError) as exc:
                await engine.refuse("strategy.reduce", exc)
                raise

    async def gather(self, value: Any, axis: SupportsIndex = 0) -> Any:
        """Concatenate a distributed ``value``'s components along ``axis``.

        Raises:
            RuntimeError: called inside a replica (use ``ctx.all_gather`` there), or in
                another strategy's scope (across workers every worker raises then, the others
                ``WorkersDisagree``); across workers, called from another task while a
                ``run()`` is in progress there.
            ValueError: dtypes or shapes off ``axis`` differ; ``axis`` out of range; across
                workers, another worker passed another axis, structure, dtype or other
                trailing dimensions (every worker raises it; nothing was gathered).
            TypeError: ``axis`` is not an integer.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> parts = aioreplica.PerReplica([np.array([1, 2]), np.array([3])])
            >>> anyio.run(strategy.gather, parts)
            array([1, 2, 3])
        """
        async with self._engine.call("strategy.gather"):
            try:
                await self._begin_cross_replica("gather")
                return await self._engine.gather(value, axis)
            except (TypeError, ValueError) as exc:
                await self._engine.refuse("strategy.gather", exc)
                raise

    async def _begin_reduction(self, what: str, reduce_op: ReduceOp | str) -> ReduceOp:
        """The op of a cross-replica reduction ``what``, once it may start: called outside a
        replica, and (across workers) the variables made since the last sync synced."""
        op = ReduceOp.parse(reduce_op)
        await self._begin_cross_replica(what)
        return op

    async def _begin_cross_replica(self, what: str) -> None:
        """Once a cross-replica call ``what`` that reads its value's variables may start:
        called outside a replica, and (across workers) the variables made since the last sync
        synced, so that each worker's copies hold the chief's values."""
        state = context_state.get()
        self._check_outside_replicas(what, state)
        try:
            self._check_not_mixed(f"strategy.{what}()", state)
        except RuntimeError as exc:  # as refused arguments: every worker raises, in step
            await self._engine.refuse(f"strategy.{what}", exc)
            raise
        if self._engine.cluster is not None:
            await self._sync_new_variables()

    def _check_cross_replica(self, what: str) -> None:
        state = context_state.get()
        self._check_outside_replicas(what, state)
        self._check_not_mixed(f"strategy.{what}()", state)

    def _check_outside_replicas(self, what: str, state: ContextState) -> None:
        """Refuse a cross-replica call ``what`` made inside a replica.

        Raises:
            RuntimeError: naming the replica and what to call there instead.
        """
        replica = state.replica
        if replica is not None:
            raise RuntimeError(
                f"strategy.{what}() was called inside replica "
                f"{replica.replica_id_in_sync_group}; it works on distributed values in "
                "cross-replica context: call it on run()'s result, or use the replica "
                f"context's collectives (ctx.all_reduce, ctx.all_gather) inside the step"
            )

    def _check_not_mixed(self, what: str, state: ContextState) -> None:
        """Refuse a call made in the scope (or a ``merge_fn``) of another strategy, as TF
        refuses to mix strategies. The default strategy's scope changes nothing here, as in
        TF, where another strategy's ``run()`` and reductions work inside it."""
        current = state.strategy
        if current is not None and current is not self:
            shown = self._shown()
            other = other_strategy(shown, current, current._shown())
            raise RuntimeError(
                f"{what} of {shown} was called in the scope of {other}; "
                "strategies cannot be mixed: finish with one before using the other"
            )

    def _destinations(self, destinations: Any) -> tuple[Device, ...]:
        """TF's destinations as device objects: a device name or object, a list of them, a
        distributed value or variable (meaning its devices: the strategy's own), or an array
        (meaning its device: a CuPy array's GPU; for a NumPy array or NumPy scalar, the host,
        which is the strategy's first host device). A Python number is on no device: refused,
        as TF's ``validate_destinations`` refuses it."""
        if destinations is None or isinstance(destinations, DistributedValues):
            return self._device_objects
        by_name = {device.name: device for device in self._device_objects}
        items: Sequence[Any]
        if isinstance(destinations, Variable):
            owner = destinations.distribute_strategy
            if owner is self:
                return destinations._devices
            if owner is not None:  # its devices are the other strategy's, whatever their names
                raise ValueError(
                    f"destination variable {destinations.name!r} belongs to {owner!r}, not to "
                    f"this strategy, whose devices are {list(by_name)}; pass a variable of "
                    "this strategy, or the names of its devices"
                )
            items = destinations.devices  # an ordinary variable: its device, as a name
        elif isinstance(destinations, list | tuple):
            items = destinations
        else:
            items = [destinations]
        devices = []
        for item in items:
            if isinstance(item, str):  # the strategy's own names as they are, else any spelling
                name = item if item in by_name else canonical_device_name(item)
            elif isinstance(item, Device):  # a Protocol check: slow, so strings go first
                name = item.name
            elif isinstance(item, bool | int | float | complex) and not isinstance(
                item, np.generic
            ):
                raise ValueError(
                    f"destination {item!r} is a Python {type(item).__name__}, which is on no "
                    "device; destinations are a device name (such as 'cpu:0'), a list of "
                    "names, a distributed value, a variable, or an array (its device)"
                )
            elif (kind := array_kind(item)) in _ARRAY_KINDS:
                name = self._array_device_name(item, kind)
            else:
                name = canonical_device_name(item)
            if name not in by_name:
                raise ValueError(
                    f"destination {_shown_destination(item, name)} is not one of this "
                    f"strategy's devices {list(by_name)}"
                )
            if by_name[name] in devices:
                raise ValueError(
                    f"destination {_shown_destination(item, name)} is listed twice in "
                    f"{destinations!r:.80}; name each device once"
                )
            devices.append(by_name[name])
        if not devices:
            raise ValueError("destinations must name at least one device")
        return tuple(devices)

    def _array_device_name(self, array: Any, kind: str) -> str:
        """The device an array as a destination means: a CuPy array's GPU; for host data, the
        strategy's first host device (``"cpu:0"`` when it has none, which it then refuses)."""
        if kind == "cupy":
            return f"gpu:{array.device.id}"
        return next((d.name for d in self._device_objects if d.name.startswith("cpu:")), "cpu:0")

    # -- input --------------------------------------------------------------------------

    def distribute_dataset(
        self,
        dataset: Any,
        options: InputOptions | None = None,
        *,
        drop_remainder: bool = False,
        prefetch: SupportsIndex | None = None,
    ) -> DistributedDataset:
        """Split each global batch of ``dataset`` across the replicas, prefetching ahead.

        Args:
            dataset: an iterable or async iterable of global batches: nested structures whose
                leaves are arrays sharing a leading batch dimension, e.g. ``(x, y)`` (with one
                replica in all, any elements: each goes whole, as in TF).
            options: TF's ``InputOptions``: ``experimental_fetch_to_device=False`` leaves the
                slices as the dataset made them; its buffer size is the default ``prefetch``.
            drop_remainder: drop a final global batch smaller than the first one.
            prefetch: elements pulled, split and placed ahead (0: on demand); by default 2,
                or the options' ``experimental_per_replica_buffer_size``.

        Returns:
            An async iterable whose elements are the replicas' slices regrouped (an array
            batch is one ``PerReplica``); replicas without rows in the last batch get
            zero-length arrays, so every replica takes the same number of steps.

        Raises:
            TypeError: ``dataset`` is not iterable, or is a string (whose items are
                characters, not batches); ``drop_remainder`` is not a bool; ``prefetch`` is not
                an int; ``options`` is not an ``InputOptions``.
            ValueError: ``prefetch`` is negative; ``options`` asks for ``PER_REPLICA`` input
                (``distribute_datasets_from_function`` only, as in TF).

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def sizes():
            ...     dist = strategy.distribute_dataset(aioreplica.batched(np.arange(5), 4))
            ...     return [len(x.values[1]) async for x in dist]
            >>> anyio.run(sizes)
            [2, 0]
        """
        options = _checked_input_options(options, "distribute_dataset")
        if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            raise ValueError(
                "distribute_dataset: InputReplicationMode.PER_REPLICA is only for "
                "distribute_datasets_from_function (as in TF), which makes one pipeline per "
                "replica"
            )
        _check_drop_remainder(drop_remainder)
        return DistributedDataset(
            dataset,
            self._device_objects,
            per_replica_source=False,
            drop_remainder=drop_remainder,
            prefetch=_prefetch(prefetch, options),
            place=options._placed,
            input_context=self._input_context(),
            workers=self._engine.cluster,
            first_replica=self._engine.first_replica,
        )

    def experimental_distribute_dataset(
        self,
        dataset: Any,
        options: InputOptions | None = None,
        *,
        drop_remainder: bool = False,
        prefetch: SupportsIndex | None = None,
    ) -> DistributedDataset:
        """TF's name for ``distribute_dataset`` (the same thing).

        Raises:
            TypeError: as ``distribute_dataset``.
            ValueError: as ``distribute_dataset``.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> dist = strategy.experimental_distribute_dataset(aioreplica.batched(np.arange(4), 4))
            >>> type(dist).__name__
            'DistributedDataset'
        """
        return self.distribute_dataset(
            dataset, options, drop_remainder=drop_remainder, prefetch=prefetch
        )

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Any],
        options: InputOptions | None = None,
        *,
        prefetch: SupportsIndex | None = None,
    ) -> DistributedDataset:
        """Build the input pipeline with ``dataset_fn(input_context)``; feed replicas from it.

        ``dataset_fn`` is called once per input pipeline (once in one process). Its dataset
        yields per-replica batches: replica ``r`` gets the ``r``-th batch of each round. When it
        runs out in the middle of a round, the other replicas get zero-length batches. As in
        TF, its elements may also be values without a batch dimension (numbers, tuples of
        them), which each replica gets as they are. With ``options`` asking for
        ``InputReplicationMode.PER_REPLICA``, ``dataset_fn`` is called once per replica, with
        an ``InputContext`` whose pipeline is that replica (its id in sync, of
        ``num_replicas_in_sync``), and each replica gets the elements of its own dataset.

        Args:
            dataset_fn: ``InputContext -> dataset`` (an iterable or async iterable).
            options: TF's ``InputOptions`` (see ``distribute_dataset``; ``PER_REPLICA`` too).
            prefetch: elements made ahead (0: on demand); by default 2, or the options'
                ``experimental_per_replica_buffer_size``.

        Raises:
            TypeError: ``dataset_fn`` is not callable, or is an ``async def`` function (it
                must return the dataset, not a coroutine); what it returned is not iterable;
                ``prefetch`` is not an int; ``options`` is not an ``InputOptions``; (while
                iterating) elements without a batch dimension ran out in the middle of a
                round, which leaves replicas without an element (there are no empty ones of
                them).
            ValueError: ``prefetch`` is negative.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> def dataset_fn(context):
            ...     size = context.get_per_replica_batch_size(8)
            ...     return aioreplica.batched(np.arange(16), size)
            >>> dist = strategy.distribute_datasets_from_function(dataset_fn)
            >>> async def first():
            ...     async for batch in dist:
            ...         return batch
            >>> anyio.run(first)
            PerReplica({0: array([0, 1, 2, 3]), 1: array([4, 5, 6, 7])})
        """
        if not callable(dataset_fn):
            raise TypeError(
                f"dataset_fn must be callable (InputContext -> dataset), got "
                f"{type(dataset_fn).__name__} {dataset_fn!r:.60}"
            )
        options = _checked_input_options(options, "distribute_datasets_from_function")
        count = checked_prefetch(_prefetch(prefetch, options))  # before dataset_fn makes any
        if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            first, size = self._engine.first_replica, self.num_replicas_in_sync
            contexts = [
                InputContext(num_input_pipelines=size, input_pipeline_id=first + j,
                             num_replicas_in_sync=size)
                for j in range(len(self._device_objects))
            ]  # fmt: skip
            dataset = interleaved([dataset_fn(context) for context in contexts])
        else:
            dataset = dataset_fn(self._input_context())
        return DistributedDataset(
            dataset,
            self._device_objects,
            per_replica_source=True,
            drop_remainder=False,
            prefetch=count,
            place=options._placed,
            input_context=self._input_context(),
            workers=self._engine.cluster,
            first_replica=self._engine.first_replica,
        )

    def experimental_distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Any],
        options: InputOptions | None = None,
        *,
        prefetch: SupportsIndex | None = None,
    ) -> DistributedDataset:
        """TF's older name for ``distribute_datasets_from_function`` (the same thing).

        Raises:
            TypeError: as ``distribute_datasets_from_function``.
            ValueError: as ``distribute_datasets_from_function``.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> dist = strategy.experimental_distribute_datasets_from_function(
            ...     lambda context: aioreplica.batched(np.arange(4), 2)
            ... )
            >>> type(dist).__name__
            'DistributedDataset'
        """
        return self.distribute_datasets_from_function(dataset_fn, options, prefetch=prefetch)

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> PerReplica[Any]:
        """A ``PerReplica`` of ``value_fn(ValueContext(i, n))`` for every replica ``i``.

        ``value_fn`` may return a structure (a dict, a tuple): ``run()`` passes each replica
        its own, and ``reduce``, ``gather`` and the other collectives take the ``PerReplica``
        of structures as the structure of per-replica values, leaf by leaf, wherever it sits
        in their value (as TF's dict of ``PerReplica`` values).

        Raises:
            TypeError: ``value_fn`` is not callable, or is an ``async def`` function (it must
                return each replica's value, not a coroutine).
            Exception: whatever ``value_fn`` raises.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> strategy.experimental_distribute_values_from_function(
            ...     lambda ctx: ctx.replica_id_in_sync_group * 10
            ... )
            PerReplica({0: 0, 1: 10})
        """
        if not callable(value_fn):
            raise TypeError(
                f"value_fn must be callable (ValueContext -> value), got "
                f"{type(value_fn).__name__} {value_fn!r:.60}"
            )
        engine = self._engine
        first = engine.first_replica
        return distribute_values(value_fn, engine.num_replicas, range(first, first + engine.size))

    def _input_context(self) -> InputContext:
        return InputContext(
            num_input_pipelines=1,
            input_pipeline_id=0,
            num_replicas_in_sync=self.num_replicas_in_sync,
        )

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """Return what each of this process's replicas holds of ``value``, as in TF.

        A distributed value gives its components (as many as it holds: a ``reduce_to``
        result has one per destination) and a variable its copies. A structure (a
        ``run()`` result that is a dict, list or tuple, say) gives one structure per replica,
        as TF's does: each distributed leaf is replaced by that replica's component, each
        variable by that replica's copy. A plain value stands for the same value on every
        replica (``run()`` returns one plain value where every replica returned the very same
        object, such as a host collective's shared result), so it comes once per replica.

        Args:
            value: a ``DistributedValues``, a variable, a structure holding them, or a plain
                value.

        Returns:
            A tuple with one entry per local replica (across workers: this worker's).

        Raises:
            ValueError: a distributed leaf or variable in a structure holds another number
                of values than this process has replicas.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> strategy.experimental_local_results(aioreplica.PerReplica([1, 2]))
            (1, 2)
            >>> strategy.experimental_local_results({"id": aioreplica.PerReplica([1, 2]), "n": 5})
            ({'id': 1, 'n': 5}, {'id': 2, 'n': 5})
            >>> strategy.experimental_local_results(5)
            (5, 5)
        """
        size = len(self._engine.devices)
        if isinstance(value, DistributedValues):
            return value.values  # as many as it holds (a reduce_to's: one per destination)
        if isinstance(value, Variable) and len(value.values) == size:
            return value.values
        pairs, treedef = _tree.flatten_with_path(value)
        for path, leaf in pairs:
            held = _held(leaf)
            ordinary = isinstance(leaf, Variable) and len(held or ()) == 1
            if held is not None and len(held) != size and not ordinary:
                raise ValueError(
                    f"experimental_local_results: the value at {_tree.describe_path(path)} "
                    f"holds {len(held)} values, but this strategy has {size} local replicas"
                )
        leaves = [leaf for _, leaf in pairs]
        return tuple(
            treedef.unflatten([_component(leaf, i) for leaf in leaves]) for i in range(size)
        )

    def statistics(self) -> SchedulerStatistics:
        """Return a snapshot: runs active, replicas waiting at merge points, merges and steps
        done, each replica's time spent waiting for the others, and which one is late.

        A merge round waits from its first replica's arrival until its last one's; every
        replica but the last is charged that wait (exactly its own for the first to arrive).
        ``wait_total`` and ``wait_max`` (tuples indexed by replica id, seconds) sum and
        maximise what each replica was charged over the completed merge rounds;
        ``slowest_replica`` is the replica that arrived last most often. Measuring costs two
        clock reads per merge round.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> strategy.statistics().slowest_replica is None  # no merge round yet
            True
            >>> async def step():
            ...     ctx = aioreplica.get_replica_context()
            ...     if ctx.replica_id_in_sync_group == 1:
            ...         await anyio.sleep(0.01)  # replica 1 is late
            ...     await ctx.barrier()
            >>> anyio.run(strategy.run, step)
            >>> stats = strategy.statistics()
            >>> stats.steps, stats.slowest_replica, stats.wait_total[0] >= 0.01
            (1, 1, True)
        """
        return self._scheduler.statistics()

    # -- tracing --------------------------------------------------------------------------

    def start_trace(self, path: str | os.PathLike[str]) -> None:
        """Start recording a timeline of this strategy's replicas; ``stop_trace`` writes it.

        The file is Chrome Trace Event JSON, which Perfetto (ui.perfetto.dev) and
        ``chrome://tracing`` open: one track per replica (``tid`` = replica id, named
        ``replica r``; ``pid`` = worker index) with spans ``compute``, ``merge wait``,
        ``merge_fn <name>``, each collective by its name, ``device.run <fn>``; and tracks
        ``main`` and ``prefetch`` for checkpoint saves and restores and dataset prefetches
        outside the replicas. See ``trace()`` for the format. One trace at a time per
        process; runs that start while it is recorded are traced. Closing the strategy
        (``close()``, ``aclose()``) stops the trace and writes its file; a strategy
        garbage-collected while its trace is recorded ends it without writing it.

        Args:
            path: the JSON file to write (its folder must exist). A worker of a strategy
                spanning several processes adds its index: ``run.json`` -> ``run.worker1.json``
                (worker 0 writes ``path`` itself).

        Raises:
            RuntimeError: a trace is already being recorded (by this strategy or another).
            TypeError: ``path`` is not a str or ``os.PathLike``.
            FileNotFoundError: ``path`` is empty, or its folder does not exist.
            IsADirectoryError: ``path`` is a folder, or ends with a path separator.
            OSError: the folder of ``path`` does not take a new file (read-only, no
                permission).

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> strategy.start_trace(tmp / "run.json")
            >>> anyio.run(strategy.run, lambda: 1)
            1
            >>> os.path.basename(strategy.stop_trace())
            'run.json'
        """
        self._start_trace(path)

    def stop_trace(self) -> str:
        """Stop the trace that ``start_trace`` started and write its file; return its path.

        The file is written atomically (complete, or not replaced at all) on the calling
        thread; ``async with strategy.trace(path):`` writes it in a worker thread instead.
        Spans still open (a run in progress) are left out.

        Raises:
            RuntimeError: no trace is being recorded, or another strategy's is.
            OSError: the file cannot be written.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0"])
            >>> strategy.stop_trace()  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            RuntimeError: no trace is being recorded by MirroredStrategy(...); start one with ...
        """
        return _trace.stop(self).write()

    @contextlib.asynccontextmanager
    async def trace(self, path: str | os.PathLike[str]) -> AsyncIterator[str]:
        """Record a timeline of this strategy's replicas while the block runs (Perfetto).

        The file is complete when the block exits (also by an exception or a cancellation):
        written atomically in a worker thread, so the event loop goes on meanwhile.

        Format (Chrome Trace Event JSON): ``{"traceEvents": [...], "displayTimeUnit": "ms",
        "otherData": {"aioreplica": version, "replicas": N, "worker": w}}``; metadata events
        ``process_name`` (``pid`` w, ``"worker w"``) and ``thread_name`` per track; spans are
        complete events ``{"ph": "X", "name", "pid", "tid", "ts", "dur", "args"}`` in
        microseconds since the trace started, nested per track:

        - on each replica's track (``tid`` r, ``replica r``): ``compute`` (replica code
          between merge points; args ``replica``), ``merge wait`` (from its arrival at a merge
          point until it resumes; args ``round``: the merge rounds of the trace counted from 1,
          ``merge``: the ``merge_call`` number within its run, ``replica``), ``merge_fn
          <name>`` on the track of the replica that ran the merge function (the last to
          arrive), and inside it each collective (``all_reduce``, ``all_gather``,
          ``broadcast``, ``reduce_scatter``, ``barrier``...; args ``op``, ``bytes`` of one
          replica's input, ``devices``); ``device.run <fn>`` inside ``compute``;
        - on tracks from ``tid`` N up, named ``main`` (tasks that are not replicas, such as
          the one calling ``run()``: ``checkpoint save``, ``checkpoint restore``, collectives
          of ``strategy.reduce``) and ``prefetch`` (``dataset prefetch``, one element pulled,
          split and placed); where spans would overlap without nesting (concurrent tasks,
          concurrent runs) they go on further tracks, ``main (2)``, ``replica 0 (2)``...

        Overhead: off, one check per place that records (nothing per replica per merge
        round); on, about a microsecond per span.

        Args:
            path: the JSON file to write, as for ``start_trace``.

        Yields:
            The path the file will be written to.

        Raises:
            RuntimeError: a trace is already being recorded.
            TypeError: ``path`` is not a str or ``os.PathLike``.
            FileNotFoundError: ``path`` is empty, or its folder does not exist.
            IsADirectoryError: ``path`` is a folder, or ends with a path separator.
            OSError: the folder of ``path`` does not take a new file (read-only, no
                permission).
            OSError: (at the end) the file cannot be written. If the block raised, its own
                exception comes out instead, with a note naming the trace that was lost.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def step():
            ...     return await aioreplica.get_replica_context().all_reduce("sum", 1.0)
            >>> async def main():
            ...     async with strategy.trace(tmp / "run.json") as path:
            ...         await strategy.run(step)
            ...     return path
            >>> import json
            >>> with open(anyio.run(main)) as file:
            ...     events = json.load(file)["traceEvents"]
            >>> sorted({e["name"] for e in events if e["ph"] == "X" and e["tid"] == 1})
            ['all_reduce', 'compute', 'merge wait', 'merge_fn _merge_all_reduce']
        """
        recorder = self._start_trace(path)
        raised: BaseException | None = None
        try:
            yield recorder.path
        except BaseException as exc:
            raised = exc
            raise
        finally:
            if _trace.recorder is recorder:  # not stopped by stop_trace() in the block
                _trace.stop(self)
                with anyio.CancelScope(shield=True):
                    try:
                        await anyio.to_thread.run_sync(recorder.write)
                    except OSError as error:
                        if raised is None:
                            raise
                        add_note(raised, f"while it was raised, {error}")  # it goes on

    def _start_trace(self, path: str | os.PathLike[str]) -> _trace.Recorder:
        if not isinstance(path, str | os.PathLike):
            raise TypeError(
                f"a trace path must be a str or os.PathLike, got {type(path).__name__} {path!r}"
            )
        target = os.fspath(path)
        if not isinstance(target, str):
            raise TypeError(f"a trace path must be text, not {type(target).__name__} {target!r}")
        target = _trace.trace_path(target, self._worker_index())
        if os.path.isdir(target):
            raise IsADirectoryError(f"the trace path {target!r} is a folder; name a file in it")
        folder = os.path.dirname(os.path.abspath(target))
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"the folder of the trace file {target!r} does not exist; create it first"
            )
        return _trace.start(
            target, self, self.num_replicas_in_sync, self._worker_index(), _version()
        )

    def _worker_index(self) -> int:
        """This process's worker index (0: one process), the ``pid`` of its trace."""
        return 0

    def __repr__(self) -> str:
        return f"MirroredStrategy(devices={list(self.devices)!r})"

    def _shown(self) -> str:
        """This strategy as messages name it: the default one as such, which its repr alone
        does not tell from a strategy made over ``cpu:0``."""
        return f"the default strategy, {self!r}" if self._is_default else repr(self)

    def __reduce_ex__(self, protocol: SupportsIndex, /) -> NoReturn:
        """Refuse ``copy.copy``, ``copy.deepcopy`` and ``pickle`` (each asks this first).

        A strategy owns its devices' claims, their worker threads and its scheduler: a copy
        sharing them would close them under the original (TF refuses a shallow copy too), and
        they cannot be pickled. Make a new strategy with the same arguments instead.

        Raises:
            TypeError: always.

        Example:
            >>> import copy
            >>> copy.copy(MirroredStrategy(["cpu:0", "cpu:1"]))
            Traceback (most recent call last):
            TypeError: cannot copy or pickle MirroredStrategy(devices=['cpu:0', 'cpu:1']): ...
        """
        raise TypeError(_not_copied(self))

    # -- contexts -------------------------------------------------------------------------

    def scope(self) -> contextlib.AbstractContextManager[MirroredStrategy]:
        """Enter cross-replica context of this strategy: ``get_strategy()`` returns it.

        Inside a replica of this same strategy it changes nothing, as in TF; nor does the
        default strategy's scope, which keeps the default replica context. As in TF, the
        object it returns may be entered again, and nested in itself.

        Returns:
            A context manager whose ``with`` block yields this strategy.

        Raises:
            RuntimeError: (on entering) another strategy's scope or replica is current (as in
                TF, which refuses to mix strategies); the default strategy's scope does not
                count, as in TF.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> with strategy.scope():
            ...     aioreplica.get_replica_context() is None
            True
        """
        return _Scope(self)

    def _enter_scope(self) -> _ScopeToken | None:
        """Enter this strategy's scope: what to reset on leaving, or None where it changes
        nothing.

        Raises:
            RuntimeError: another strategy's scope (not the default strategy's) or replica is
                current.
        """
        state = context_state.get()
        replica = state.replica
        current = replica.strategy if replica is not None else state.strategy
        if current is not None and current is not self:
            shown = self._shown()
            raise RuntimeError(
                f"cannot enter the scope of {shown} while "
                f"{other_strategy(shown, current, current._shown())} is current; strategies "
                "cannot be mixed: finish with one before using the other"
            )
        # The default strategy's scope keeps the default replica context and changes nothing:
        # as in TF (testScopeMostlyNoOp), another strategy's scope may be entered inside it.
        if self._is_default:  # only a variable made in another scope inside it is refused
            return (default_scope_open, default_scope_open.set(True))
        if replica is not None or current is self:
            return None
        return (context_state, context_state.set(ContextState(strategy=self, engine=self._engine)))

    # -- lifetime -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether ``close()`` (or the end of ``async with strategy:``) closed this strategy."""
        return self._closed

    def close(self) -> None:
        """Stop the worker threads of this strategy's host devices that no open strategy uses.

        Host devices are process-wide: strategies over the same ``cpu:i`` share its worker
        thread. A strategy is open from its construction; closing it releases its claim, and
        each of its host devices that no other open strategy claims gets its thread stopped,
        once the jobs already queued there have run. ``close()`` does not wait for that (it
        never blocks the event loop); ``aclose()`` and ``async with strategy:`` do.

        After ``close()``, ``run()``, ``run_steps()`` and
        ``extended.experimental_run_steps_on_iterator()`` raise ``RuntimeError``; ``async with
        strategy:`` reopens it. What else still uses the devices (reductions, variables,
        datasets, checkpoints) works and starts their threads again; closing again stops
        them. Calling it again is harmless. The default strategy is never closed: its
        ``close()`` only stops unclaimed threads.

        A trace of this strategy still being recorded (``start_trace``) is stopped and its
        file written, on the calling thread, as ``stop_trace()`` does.

        Raises:
            RuntimeError: a ``run()`` of this strategy is in progress (the threads would stop
                under it): let it finish or cancel it first. Nothing is closed then.
            OSError: the file of this strategy's trace cannot be written; the strategy is
                closed and the trace stopped all the same.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> anyio.run(strategy.run, lambda: 1)
            1
            >>> strategy.close()
            >>> strategy.closed
            True
        """
        self._stop_workers(None)
        trace = self._release_trace()
        if trace is not None:
            trace.write()

    async def aclose(self) -> None:
        """``close()``, then wait, without blocking the event loop, until the stopped worker
        threads have ended.

        A trace of this strategy still being recorded is stopped and its file written in a
        worker thread, as at the end of ``async with strategy.trace(path):``.

        Raises:
            RuntimeError: a ``run()`` of this strategy is in progress.
            OSError: the file of this strategy's trace cannot be written (as ``close()``).

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> anyio.run(strategy.aclose)
            >>> strategy.closed
            True
        """
        loop = _loops.current()
        waits = self._stop_workers(loop.thread_result)
        trace = self._release_trace()
        if trace is not None:
            with anyio.CancelScope(shield=True):  # complete, as trace()'s is
                await anyio.to_thread.run_sync(trace.write)
        for thread, done in waits:
            await done
            thread.join()  # it has set ``done`` on its way out: this returns at once

    async def __aenter__(self) -> MirroredStrategy:
        """Open the strategy (reopen a closed one); ``__aexit__`` closes it (``aclose()``).

        Example:
            >>> async def main():
            ...     async with MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
            ...         result = await strategy.run(lambda: 1)
            ...     return result, strategy.closed
            >>> anyio.run(main)
            (1, True)
        """
        if self._closed:
            self._claim()
            self._closed = False
            self._scheduler.resume_watching()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Close the strategy and wait for its unclaimed worker threads to end (``aclose()``).

        Raises:
            RuntimeError: a ``run()`` of this strategy is still in progress.
        """
        await self.aclose()

    def _stop_workers(
        self, make_result: Callable[[], _loops.ThreadResult] | None
    ) -> list[tuple[threading.Thread, _loops.ThreadResult]]:
        active = self._scheduler.statistics().runs_active
        if active:
            raise RuntimeError(
                f"close() was called on {self!r} while {active} run() call"
                f"{'s are' if active > 1 else ' is'} in progress; its devices' threads would "
                "stop under it: close the strategy after its runs have finished or been "
                "cancelled"
            )
        self._release_claims()
        self._scheduler.stop_watching()  # no slow merge warnings: it runs nothing
        if not self._is_default:
            self._closed = True
        waits = []
        for device in self._host_devices:
            done = make_result() if make_result is not None else None
            thread = device.stop_worker(done, unclaimed=True)
            if thread is not None and done is not None:
                waits.append((thread, done))
        return waits

    def _release_trace(self) -> _trace.Recorder | None:
        """Stop this strategy's trace, if it is recording one: the recorder, to write."""
        return None if self._is_default else _trace.release(self)

    def _claim(self) -> None:
        for device in self._host_devices:
            device.claim()
        # A strategy dropped without close() is no longer open: its claims go with it.
        self._claims: weakref.finalize[[tuple[HostDevice, ...]], MirroredStrategy] | None
        self._claims = weakref.finalize(self, _release_collected, self._host_devices)
        self._claims.atexit = False

    def _release_claims(self) -> None:
        if self._claims is not None:
            self._claims.detach()
            self._claims = None
            for device in self._host_devices:
                device.release()

    # -- running --------------------------------------------------------------------------

    async def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        options: None = None,
    ) -> Any:
        """Run ``fn`` once per replica and return the results regrouped.

        Each replica calls ``fn(*args, **kwargs)`` with ``PerReplica``/``Mirrored`` values in
        ``args``/``kwargs`` replaced by its own component (``select_replica``). ``fn`` may be
        a coroutine function, whose replicas meet at ``merge_call``s, or a plain function.

        Args:
            fn: the step function.
            args: positional arguments, possibly holding distributed values.
            kwargs: keyword arguments, possibly holding distributed values.
            options: TF's ``tf.distribute.RunOptions``, whose fields concern TF's graph
                compilation: only ``None``, TF's default, is taken.

        Returns:
            The replicas' return values regrouped: a value that differs between replicas
            becomes a ``PerReplica``; with one replica, the value itself.

        Raises:
            RuntimeError: called inside a replica; in another strategy's scope or
                ``merge_fn``; across workers, inside ``merge_fn`` (in one process a
                ``merge_fn`` may run the replicas again, as in TF).
            TypeError: ``fn`` is not callable, ``args`` is not a sequence (or is a string or
                bytes, whose characters are no arguments) or ``kwargs`` not a mapping; ``fn``
                is a generator or async generator function (it has a ``yield``); ``options``
                is not ``None``.
            ValueError: a distributed value in the arguments has a different number of
                components than the strategy has replicas.
            ReplicaSyncError: replicas made different merge calls, or one was left waiting
                longer than ``sync_timeout``.
            BaseException: the first exception a replica or ``merge_fn`` raised, itself, with
                a note naming where it came from; every replica has been cancelled by then.
                A later ``KeyboardInterrupt`` or ``SystemExit`` outranks it (which then
                becomes a note), as in a task group. Cancelled from outside, ``run()`` raises
                the cancellation (at once, before any replica starts, when the caller's scope
                is cancelled already), or the exception a replica raised while it was being
                cancelled, as a task group does. A ``StopIteration`` is a ``RuntimeError``
                naming the replica or ``merge_fn`` it came from.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def step(x):
            ...     ctx = aioreplica.get_replica_context()
            ...     return await ctx.merge_call(lambda s, v: sum(v.values), args=(x,))
            >>> anyio.run(strategy.run, step, (aioreplica.PerReplica([1, 2]),))
            3
        """
        parts = self._prepare_run(fn, args, kwargs, options)
        return regroup(await self._scheduler.run(fn, parts))

    def _check_open(self, what: str) -> None:
        """Refuse ``what`` (``run()``, say) on a closed strategy.

        Raises:
            RuntimeError: ``close()`` closed this strategy.
        """
        if self._closed:
            raise RuntimeError(
                f"{what} was called on {self!r} after close(); a closed strategy runs no "
                "replicas: reopen it with `async with strategy:` or make a new strategy"
            )

    def _prepare_run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        options: object = None,
    ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """``run()``'s checks, then each replica's arguments."""
        self._check_open("run()")
        if options is not None:
            raise TypeError(
                f"run() takes options=None only, got {type(options).__name__} {options!r:.60}: "
                "TF's RunOptions set how TF compiles a step (dynamic batch sizes, XLA), which "
                "has no counterpart here; leave options out"
            )
        state = context_state.get()
        replica = state.replica
        if replica is not None:
            raise RuntimeError(
                f"run() was called inside replica {replica.replica_id_in_sync_group} of "
                f"{replica.strategy!r}; replicas cannot start replicas: call run() from "
                "cross-replica code, outside the step function"
            )
        if state.merging and self._engine.cluster is not None:
            raise RuntimeError(
                "run() was called inside merge_fn; across workers a run cannot start inside "
                "another's merge function, whose collectives it would interleave with: return "
                "from merge_fn and call run() afterwards"
            )
        self._check_not_mixed("run()", state)
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__} {fn!r}")
        if isinstance(args, str | bytes | bytearray) or not isinstance(args, Sequence):
            raise TypeError(
                f"args must be a tuple of arguments, got {type(args).__name__} {args!r}; "
                f"for one argument write args=(value,)"
            )
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise TypeError(f"kwargs must be a mapping or None, got {type(kwargs).__name__}")
        return self._per_replica_arguments(tuple(args), dict(kwargs) if kwargs else {})

    async def _accepted(
        self, what: str, check: Callable[[], tuple[_T, int]], counted: str
    ) -> tuple[_T, int]:
        """``check()``: the arguments of ``what`` (``run_steps()``, say) checked before it
        starts, and its number of steps (the argument named ``counted``). A strategy spanning
        several workers checks them on every worker together, and compares the numbers.

        Raises:
            RuntimeError: ``close()`` closed this strategy (naming ``what``).
            Exception: what ``check()`` raises.
        """
        self._check_open(what)
        return check()

    async def run_steps(self, step_fn: Callable[[Any], Any], iterator: Any, steps: int) -> Any:
        """Run ``step_fn`` on the next ``steps`` elements of ``iterator``, starting the replicas
        once for all of them.

        Each replica is one task for the whole loop. At the top of every step one merge round
        takes the next element of ``iterator`` and hands each replica its slice, and the
        replica calls ``step_fn(slice)`` (awaited if it returns an awaitable). The same as
        ``for x in elements: await strategy.run(step_fn, args=(x,))``, with the start-up of a
        ``run()`` paid once (see ``devices/bench_scheduler.py``). An element with empty
        replicas (a short last batch) counts as a step.

        Args:
            step_fn: called in every replica with its slice of one element.
            iterator: an async iterator of distributed elements, e.g.
                ``aiter(strategy.distribute_dataset(...))`` (a distributed dataset is taken as
                a new pass over it). Exactly ``steps`` elements are taken from it.
            steps: how many steps, at most (fewer if ``iterator`` ends first, without error).

        Returns:
            The last step's results, regrouped as ``run()`` returns them; ``None`` after zero
            steps.

        Raises:
            TypeError: ``step_fn`` is not callable; ``iterator`` is not an async iterator;
                ``steps`` is not an int; ``step_fn`` is a generator or async generator
                function (it has a ``yield``: at the first step).
            ValueError: ``steps`` is negative.
            BaseException: as ``run()``: the first failure of any step ends the loop.

        Example:
            >>> strategy = MirroredStrategy(["cpu:0", "cpu:1"])
            >>> batches = aioreplica.batched(np.arange(8.0), 4)
            >>> async def loop():
            ...     iterator = aiter(strategy.distribute_dataset(batches))
            ...     return await strategy.run_steps(lambda x: float(x.sum()), iterator, 2)
            >>> anyio.run(loop)
            PerReplica({0: 9.0, 1: 13.0})
        """
        return await run_steps(self, step_fn, iterator, steps)

    def _per_replica_arguments(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """Each replica's ``(args, kwargs)``: distributed values replaced by its component, and
        on GPUs a CuPy array that lives on another GPU than the replica's copied onto its
        device."""
        devices = self._device_objects
        size = len(devices)
        if not args and not kwargs:
            return [(args, kwargs)] * size
        if not kwargs and _tree.all_leaves(args):  # positional leaves only: no tree walk
            leaves: Sequence[Any] = args
        else:
            leaves = _tree.flatten((args, kwargs))[0]
        distributed = [leaf for leaf in leaves if isinstance(leaf, DistributedValues)]
        if not distributed:
            parts = [(args, kwargs)] * size  # nothing differs: no rebuilds
        else:
            for leaf in distributed:
                if len(leaf.values) != size:
                    self._check_distributed_arguments(args, kwargs)  # raises, naming its path
            selected = select_replicas((args, kwargs), size)
            if selected is None:
                selected = [select_replica(i, (args, kwargs)) for i in range(size)]
            parts = selected
        if devices[0].kind == "gpu":  # host replicas read any host array: nothing to walk
            # As TF copies a step's inputs to each replica's device: a replica reading another
            # GPU's array would read it with nothing ordering the read after its writes.
            return on_replica_devices(parts, devices)
        return parts

    def _check_distributed_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        found = misfit((args, kwargs), len(self._device_objects))
        if found is not None:
            where, leaf = found
            name = "args" + where[3:] if where.startswith("[0]") else "kwargs" + where[3:]
            raise self._wrong_length(name, leaf)

    def _wrong_length(self, name: str, leaf: DistributedValues[Any]) -> ValueError:
        """The error for the argument ``name``, a distributed value of the wrong length."""
        return ValueError(
            f"{name} is a {type(leaf).__name__} of {len(leaf.values)} values, but {self!r} has "
            f"{len(self._device_objects)} replicas; give one value per replica"
        )


def _version() -> str:
    """aioreplica's ``__version__`` (the package is imported by the time a trace starts; read
    from ``sys.modules``: the facade does not import the package above it)."""
    version = getattr(sys.modules.get(__package__ or "aioreplica"), "__version__", None)
    return version if isinstance(version, str) else "unknown"


def _checked_slow_merge_warning(given: Any) -> float | None:
    if given is None:
        return None
    seconds = as_real(given)
    if seconds is None:
        raise TypeError(
            f"slow_merge_warning must be a number of seconds or None, got "
            f"{type(given).__name__} {given!r}"
        )
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(
            f"slow_merge_warning must be a positive, finite number of seconds (or None to "
            f"disable the warning), got {given!r:.60}"
        )
    return seconds


def _value_destination_pairs(pairs: Any) -> list[tuple[Any, Any]]:
    """``batch_reduce_to``'s pairs, each checked to be a ``(value, destinations)`` pair.

    Raises:
        TypeError: ``pairs`` is not an iterable of 2-item pairs (naming the first item that
            is not one).
    """
    if not hasattr(pairs, "__iter__") or isinstance(pairs, str | bytes | Mapping):
        raise TypeError(
            f"batch_reduce_to() takes a list of (value, destinations) pairs, got "
            f"{type(pairs).__name__} {pairs!r:.60}"
        )
    pairs = list(pairs)
    for i, pair in enumerate(pairs):
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise TypeError(
                f"batch_reduce_to(): item {i} must be a (value, destinations) pair, got "
                f"{type(pair).__name__} {pair!r:.60}"
            )
    return [(value, destinations) for value, destinations in pairs]


def _check_drop_remainder(drop_remainder: Any) -> None:
    """Refuse a ``drop_remainder`` that would be misread rather than fail: ``"no"`` is true.
    (A string dataset, which iterates as characters, is ``check_iterable``'s; a
    ``prefetch=True``, which counts as 1, is ``checked_prefetch``'s.)"""
    if not isinstance(drop_remainder, bool | np.bool_):
        raise TypeError(f"drop_remainder must be True or False, got {drop_remainder!r}")


@final
class _Scope:
    """What ``strategy.scope()`` returns: enters the strategy's scope on each ``with``, as
    often as asked (nested too, and from several tasks at once), and leaves it in the reverse
    order. What each entry must reset is kept in the entering context's own ``_entered``, so
    tasks sharing one scope object never take each other's."""

    __slots__ = ("_strategy",)

    def __init__(self, strategy: MirroredStrategy) -> None:
        self._strategy = strategy

    def __enter__(self) -> MirroredStrategy:
        entered = self._strategy._enter_scope()
        _entered.set((*_entered.get(), (self, entered)))
        return self._strategy

    def __exit__(self, *exc_info: object) -> None:
        stack = _entered.get()
        for position in range(len(stack) - 1, -1, -1):  # this context's latest entry of it
            scope, entered = stack[position]
            if scope is self:
                if position != len(stack) - 1:  # out of order: an ``ExitStack``, say
                    _entered.set(_left_out_of_order(stack, position))
                    return
                if entered is not None:
                    variable, token = entered
                    try:
                        variable.reset(token)
                    except ValueError:  # the token is of the context that entered the scope
                        # A task started inside the scope sees its entry, in a copy of the
                        # context: the scope stays entered where it was entered.
                        raise self._left_elsewhere() from None
                _entered.set(stack[:position] + stack[position + 1 :])
                return
        raise RuntimeError(
            f"the scope of {self._strategy!r} was exited, but this task holds no entry of it: "
            "it was not entered, or was exited already, here (or was entered in another task "
            "or thread); exit a scope once per entry, in the task that entered it (`with "
            "strategy.scope():` does); nothing was changed"
        )

    def _left_elsewhere(self) -> RuntimeError:
        return RuntimeError(
            f"the scope of {self._strategy!r} was left in a task or thread that did not enter "
            "it; a scope must be exited in the task that entered it (use `with "
            "strategy.scope():` within one task)"
        )


#: The scope entries of this context (task), innermost last: what each must reset on leaving.
_entered: contextvars.ContextVar[tuple[tuple[_Scope, _ScopeToken | None], ...]] = (
    contextvars.ContextVar("aioreplica.scopes_entered", default=())
)


def _left_out_of_order(
    stack: tuple[tuple[_Scope, _ScopeToken | None], ...], position: int
) -> tuple[tuple[_Scope, _ScopeToken | None], ...]:
    """The entries once the one at ``position`` is left while those after it stay open.

    What it set stays set until the scope entered next after it is left: that scope inherits
    what to reset when it holds nothing of its own (a scope of the same strategy, which
    changed nothing) or a later setting of the same variable (the default strategy's scope
    entered twice). Anything else it set is reset now (the default strategy's scope left
    while another strategy's, entered inside it, stays open)."""
    _, entered = stack[position]
    after, inherited = stack[position + 1]
    if entered is not None:
        if inherited is None or inherited[0] is entered[0]:
            return (*stack[:position], (after, entered), *stack[position + 2 :])
        variable, token = entered
        with contextlib.suppress(ValueError):  # the token of another context: nothing to undo
            variable.reset(token)
    return stack[:position] + stack[position + 1 :]


def _not_copied(strategy: MirroredStrategy, part: str = "") -> str:
    """The refusal of a copy or pickle of ``strategy`` (or its ``part``, such as
    ``.extended``)."""
    return (
        f"cannot copy or pickle {strategy._shown()}{part}: a strategy owns its devices, their "
        "worker threads and its scheduler, which a copy would share (closing either would "
        "close them under the other) and a pickle cannot carry; make a new strategy with the "
        f"same arguments instead ({type(strategy).__name__}(...)), or pass this one itself"
    )


def _release_collected(devices: tuple[HostDevice, ...]) -> None:
    """A collected strategy's claims released (its finalizer: any thread, any moment)."""
    for device in devices:
        device.release_collected()


def _default_context() -> ReplicaContext:
    """The default strategy's replica context (see ``aioreplica._context``)."""
    strategy = MirroredStrategy(["cpu:0"], slow_merge_warning=None)  # it never waits
    # Made once and never closed: it claims no device, so closing other strategies over
    # cpu:0 stops its thread (the next use starts it again).
    strategy._is_default = True
    strategy._release_claims()
    return ReplicaContext(strategy, strategy._engine, 0, None)


register_default_context(_default_context)


def get_strategy() -> MirroredStrategy:
    """Return the current strategy: of this replica, ``merge_fn`` or ``scope()``, else the default.

    Example:
        >>> get_strategy().num_replicas_in_sync
        1
    """
    state = context_state.get()
    if state.replica is not None:
        strategy: MirroredStrategy = state.replica.strategy
        return strategy
    if state.strategy is not None:
        current: MirroredStrategy = state.strategy
        return current
    default: MirroredStrategy = default_replica_context().strategy
    return default


def has_strategy() -> bool:
    """Return whether a strategy other than the default one is current.

    Example:
        >>> has_strategy()
        False
    """
    return get_strategy() is not default_replica_context().strategy


def _checked_input_options(options: InputOptions | None, what: str) -> InputOptions:
    """``options``, or TF's defaults for ``None``.

    Raises:
        TypeError: ``options`` is not an ``InputOptions``.
    """
    if options is None:
        return _DEFAULT_INPUT_OPTIONS
    if not isinstance(options, InputOptions):
        raise TypeError(
            f"{what}: options must be an aioreplica.InputOptions or None, got "
            f"{type(options).__name__} {options!r:.60}"
        )
    return options


def _prefetch(prefetch: SupportsIndex | None, options: InputOptions) -> SupportsIndex:
    """The elements made ahead: as given, else the options' buffer size, else 2."""
    if prefetch is not None:
        return prefetch
    if options is _DEFAULT_INPUT_OPTIONS:
        return 2
    return options.experimental_per_replica_buffer_size


def _held(leaf: Any) -> tuple[Any, ...] | None:
    """What a leaf holds per replica: a distributed value's values, a variable's copies (one
    for an ordinary variable); None for a plain value."""
    if isinstance(leaf, DistributedValues | Variable):
        return leaf.values
    return None


def _component(leaf: Any, replica: int) -> Any:
    """Local replica ``replica``'s part of a leaf (``experimental_local_results``): its value
    of a distributed value, its copy of a variable, a plain value (or an ordinary variable's
    one copy) as it is."""
    held = _held(leaf)
    if held is None:
        return leaf
    return held[replica] if len(held) > 1 else held[0]


def _variables_as_values(value: Any, op: ReduceOp, strategy: MirroredStrategy) -> Any:
    """``value`` with each variable as the distributed value it stands for, as in TF: a
    sync-on-read variable's copies are per replica; a mirrored variable's are one value,
    which ``SUM`` and ``PROD`` refuse, as they refuse a ``Mirrored`` value.

    Raises:
        ValueError: a variable of another strategy; a mirrored variable or a ``Mirrored``
            value with ``SUM`` or ``PROD``.
    """
    if isinstance(value, DistributedValues):  # the common case: no walk
        if type(value) is Mirrored and op in _COUNTING:
            _refuse_one_value("a Mirrored value", op)
        return value
    leaves, treedef = _tree.flatten(value)
    if op in _COUNTING and any(type(leaf) is Mirrored for leaf in leaves):
        pairs, _ = _tree.flatten_with_path(value)
        path = next(path for path, leaf in pairs if type(leaf) is Mirrored)
        _refuse_one_value(f"the Mirrored value at {_tree.describe_path(path)}", op)
    if not any(isinstance(leaf, Variable) for leaf in leaves):
        return value
    return treedef.unflatten([_variable_as_value(leaf, op, strategy) for leaf in leaves])


#: The ops that would count one value on every replica once per replica.
_COUNTING: Final = frozenset({ReduceOp.SUM, ReduceOp.PROD})


def _refuse_one_value(what: str, op: ReduceOp) -> NoReturn:
    """Refuse reducing ``what``, one value on every replica, with ``SUM`` or ``PROD`` (as TF
    refuses a mirrored value there).

    Raises:
        ValueError: always.
    """
    raise ValueError(
        f"cannot reduce {what} with {op.name}: it holds one value on every replica, which "
        f"{op.name} would count once per replica; read it as it is, or reduce it with MEAN"
    )


def _variable_as_value(leaf: Any, op: ReduceOp, strategy: MirroredStrategy) -> Any:
    if not isinstance(leaf, Variable):
        return leaf
    if leaf._strategy is not None and leaf._strategy is not strategy:
        raise ValueError(
            f"variable {leaf.name!r} belongs to {leaf._strategy!r}, not {strategy!r}; reduce "
            "it with its own strategy"
        )
    if isinstance(leaf, SyncOnReadVariable):
        return PerReplica(list(leaf._copies))
    if leaf._strategy is None:
        return leaf._copies[0]
    if op in _COUNTING:
        _refuse_one_value(f"mirrored variable {leaf.name!r}", op)
    return Mirrored(list(leaf._copies))


def _for_variables(
    engine: ReductionEngine, destinations: list[Any]
) -> contextlib.AbstractContextManager[None]:
    """Across workers, name the variables among ``destinations`` in the reductions made in the
    block (``reductions_for``): a ``merge_fn`` that reduces to another variable on one worker
    (and would then update that one) meets a disagreement on every worker, not a match."""
    if engine.cluster is None:
        return contextlib.nullcontext()
    variables = [
        variable_label(dest)
        for dest in destinations
        if isinstance(dest, Variable) and dest._number is not None
    ]
    if not variables:
        return contextlib.nullcontext()
    return reductions_for(f"a reduction to {', '.join(variables)}")


def _check_group(group: object, what: str = "extended.update()") -> None:
    """The ``group`` of ``extended.update`` (or of the call ``what`` names), or refused.

    Raises:
        TypeError: it is not a bool.
    """
    if not isinstance(group, bool | np.bool_):
        raise TypeError(f"{what}: group must be True or False, got {group!r:.60}")


def _grouped(per_destination: list[Any]) -> Any:
    """One result per destination as users see it: the value itself for one destination,
    else the same structure with a ``Mirrored`` at each leaf (one component per destination,
    as in TF, even where host destinations share one read-only array)."""
    if len(per_destination) == 1:
        return per_destination[0]
    leaves, treedef = _tree.flatten(per_destination[0])
    columns = [leaves] + [_tree.flatten(other)[0] for other in per_destination[1:]]
    return treedef.unflatten([Mirrored(list(column)) for column in zip(*columns, strict=True)])


def _shown_destination(item: Any, name: str) -> str:
    """A destination that is not one of the strategy's devices, as its error names it
    (``name``: the device it means)."""
    kind = array_kind(item)
    if kind in _ARRAY_KINDS:
        return f"{'a CuPy array' if kind == 'cupy' else 'a host value'} (on {name!r})"
    return repr(name) if isinstance(item, Device) else repr(item)
