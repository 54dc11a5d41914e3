"""The reduction engine: one value per replica in, one result per replica out.

``ReductionEngine`` knows devices and options, never a strategy or a context. Replica-context
collectives (``ctx.all_reduce`` and friends) call it from their merge functions; the
strategy's cross-replica methods (``strategy.reduce``, ``extended.reduce_to``) call it and
wrap its lists as ``Mirrored`` at the public boundary; variables and optimizers call it
directly with their device objects. Every call goes through one core:

1. **check**: ``_leaves`` splits the value into one array per replica per leaf, each an array
   of the devices' backend, a NumPy array or a scalar (``None``, a string or another object is
   a ``TypeError`` naming the replicas that passed it; so is a CuPy array on host devices; a
   Python int that int64 cannot hold is a ``ValueError``, TF's out-of-range integer),
   placed on its replica's device (host data is copied there, on a GPU's own stream);
   ``_check_same_shapes`` (or ``_check_gather_shapes``) requires the same shape and dtype on
   every replica (``ValueError`` naming both replicas, the path, both shapes and dtypes), and
   ``_check_op`` a dtype the op can reduce (``TypeError``). Structures were compared when the
   merge arguments were regrouped (``regroup`` names the replicas and the key path). Nothing is
   computed before every leaf has passed. Callers that have checked their arrays already (an
   optimizer's gradients) enter after this step, at ``all_reduce_arrays``.
2. **pack** (``_reduce_leaves``): small leaves of one dtype are reduced together as one flat
   array of at most ``bytes_per_pack`` bytes (``_reduce_packed``) and handed back as views of
   it, so a hundred small gradients cost one reduction instead of a hundred. How to pack is the
   backend's: the host reduces each leaf straight into its part of one output (each input read
   once); GPUs join each replica's leaves and make one collective call.
3. **reduce** (``_reduce_arrays``, and ``_reduce_packed`` for packs) on the backend: host
   replicas share one read-only output; GPU replicas each get theirs (NCCL or on-device). A
   strategy spanning several workers adds its cross-worker step in these two, between the
   local reduction and the local result. A cross-replica call (``reduce``, ``gather``,
   ``reduce_to``, ``batch_reduce_to``) that takes several cross-worker collectives, or none (an
   empty structure), first makes the workers agree on the whole call (``_agree``), so that
   none makes one more than another.

A value passed in is a regrouped structure: a ``PerReplica`` leaf holds one component per
replica, any other leaf stands for the same value on every replica. A distributed leaf whose
components are structures, wherever it is, stands for the structure of per-replica values they
make (``_regrouped``).

While a trace is recorded (``aioreplica._trace``), each call's data movement (after the checks)
is a span named after the collective, with args ``op``, ``bytes`` (one replica's input) and
``devices``; with none, it costs one check of ``_trace.recorder``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import TYPE_CHECKING, Any, Final, NamedTuple, NoReturn, SupportsIndex, TypeVar

import numpy as np

from . import _trace, _tree
from ._backends import HOST_BACKEND, HOST_INLINE_BYTES, array_kind
from ._cluster import call_of, reductions_called
from ._errors import INT64_MAX, INT64_MIN, as_integer, checked_integer, replica_list
from ._options import DEFAULT_PACK_BYTES, ReduceOp
from ._values import DistributedValues, Mirrored, regroup

if TYPE_CHECKING:
    from collections.abc import Awaitable, Coroutine, Iterator, Sequence

    from ._backends import ArrayBackend, Device
    from ._cluster import Workers
    from ._options import CommunicationOptions

    #: ``strategy.reduce``'s ``axis``: one axis, or several (a tuple or list).
    Axes = SupportsIndex | Sequence[SupportsIndex]

__all__ = ["ReductionEngine", "reductions_for", "register_copied_type"]

T = TypeVar("T")


class _LeafArrays(NamedTuple):
    """One leaf of a collective's value: where it is, and its array on each replica."""

    path: _tree.KeyPath
    arrays: list[Any]


class ReductionEngine:
    """Collectives over one fixed list of devices, one per replica.

    Args:
        devices: the replicas' devices, in replica order (all of one backend).
        options: the default ``CommunicationOptions`` (packing, timeout).
        cluster: the workers, when the replicas span several processes: every reduction then
            adds a cross-worker step (host staging for GPUs), and replica ids are global
            (worker ``w``'s replica ``j`` is ``w * size + j``).

    Example:
        >>> from aioreplica._backends import host_device
        >>> options = aioreplica.CommunicationOptions()
        >>> engine = ReductionEngine([host_device(0), host_device(1)], options)
        >>> anyio.run(engine.all_reduce, ReduceOp.SUM, aioreplica.PerReplica([1.0, 2.0]))
        [array(3.), array(3.)]
    """

    __slots__ = ("backend", "cluster", "devices", "first_replica", "num_replicas", "options")

    def __init__(
        self,
        devices: Sequence[Device],
        options: CommunicationOptions,
        cluster: Workers | None = None,
    ) -> None:
        self.devices: tuple[Device, ...] = tuple(devices)
        self.backend: ArrayBackend = self.devices[0].backend
        self.options = options
        self.cluster = cluster
        workers = cluster.num_workers if cluster is not None else 1
        #: The global id of this worker's first replica.
        self.first_replica = cluster.worker_index * len(self.devices) if cluster else 0
        #: The replicas of every worker.
        self.num_replicas = workers * len(self.devices)
        self.backend.prepare(self.devices)

    @property
    def size(self) -> int:
        """The number of this worker's replicas (every replica with one process)."""
        return len(self.devices)

    # -- one result per replica ---------------------------------------------------------

    async def all_reduce(
        self, op: ReduceOp, value: Any, options: CommunicationOptions | None = None
    ) -> list[Any]:
        """Reduce ``value`` across replicas: the result structure, once per replica.

        Raises:
            ValueError: structures, shapes or dtypes that differ between replicas; a Python int
                that int64 cannot hold.
            TypeError: a leaf that is no number or array (``None``, a string); arrays of another
                backend; an op the dtype cannot do.
        """
        leaves, treedef = self._leaves("all_reduce", value)
        self._check_same_shapes("all_reduce", leaves)
        _check_op(op, leaves)
        opts = self.options.override(options)
        reducing = self._reduce_leaves(op, leaves, opts)
        if _trace.recorder is not None:
            reducing = self._traced(reducing, "all_reduce", op, leaves)
        with self._timeout(opts):
            return self._per_replica(treedef, await reducing)

    async def all_reduce_arrays(
        self, op: ReduceOp, arrays: Sequence[Sequence[Any]], options: CommunicationOptions
    ) -> list[list[Any]]:
        """Reduce leaves already checked: ``arrays[k]`` holds leaf ``k``'s array per replica,
        on its replica's device, every one of a shape and dtype ``op`` can reduce.

        Returns:
            Per leaf, one result per replica.
        """
        leaves = [_LeafArrays((), list(per_replica)) for per_replica in arrays]
        reducing = self._reduce_leaves(op, leaves, options)
        if _trace.recorder is not None:
            reducing = self._traced(reducing, "all_reduce", op, leaves)
        with self._timeout(options):
            return await reducing

    async def all_gather(
        self, value: Any, axis: SupportsIndex, options: CommunicationOptions | None = None
    ) -> list[Any]:
        """Concatenate every replica's ``value`` along ``axis``; once per replica (``options``
        over the engine's: their timeout bounds the cross-worker waits).

        Raises:
            ValueError: structures, dtypes or shapes off ``axis`` differ; ``axis`` out of range;
                a Python int that int64 cannot hold.
            TypeError: a leaf that is no number or array (``None``, a string); arrays of another
                backend.
        """
        leaves, treedef = self._leaves("all_gather", value)
        axes = [self._check_gather_shapes("all_gather", leaf, axis) for leaf in leaves]
        gathering = self._gather_leaves("all_gather", leaves, axes)
        if _trace.recorder is not None:
            gathering = self._traced(gathering, "all_gather", None, leaves)
        with self._timeout(self.options.override(options)):
            return self._per_replica(treedef, await gathering)

    async def _gather_leaves(
        self, what: str, leaves: list[_LeafArrays], axes: list[int]
    ) -> list[Any]:
        if self.cluster is not None:
            _check_crossing(what, leaves)
        return [
            await self._gather_arrays(leaf.arrays, axis, leaf.path)
            for leaf, axis in zip(leaves, axes, strict=True)
        ]

    async def _gather_arrays(
        self, arrays: list[Any], axis: int, path: _tree.KeyPath = ()
    ) -> list[Any]:
        """One leaf gathered on the backend, then (several workers) across the workers."""
        local = await self.backend.all_gather(arrays, axis, self.devices)
        cluster = self.cluster
        if cluster is None:
            return local
        # The workers' gather only reads this worker's part: a host result goes as it is (a
        # copy of a large one would hold the loop), a device's is staged on the host.
        mine = local[0]
        if self.backend is not HOST_BACKEND or not mine.flags.c_contiguous:
            mine = await self._staged(mine)
        staged = np.moveaxis(mine, axis, 0)
        where = " ".join(filter(None, (_where(path), f"along axis {axis}")))
        whole = np.moveaxis(await cluster.allgather_rows(staged, where), 0, axis)
        return await self._placed(np.asarray(whole, order="C"))

    async def broadcast(
        self,
        value: Any,
        source: int,
        what: str = "",
        matching: bool = True,
        options: CommunicationOptions | None = None,
    ) -> list[Any]:
        """Replica ``source``'s component of ``value``, once per replica on its device.
        ``what``: what the value is, which the workers compare too (a variable's write).
        ``matching``: whether every worker's leaves must have the shapes and dtypes of the
        source's (the workers compare them: a variable's value); else, as in one process,
        the other replicas' arrays are ignored (``ReplicaContext.broadcast``). ``options``
        over the engine's: their timeout bounds the cross-worker waits.

        Raises:
            ValueError: ``source`` is not a replica id; a Python int that int64 cannot hold.
            TypeError: ``source`` is not an int; a leaf that is no number or array (``None``,
                a string); arrays of another backend.
        """
        source = self.check_source(source)
        leaves, treedef = self._leaves("broadcast", value)
        if self.cluster is not None:
            sending = self._broadcast_across(leaves, source, what, matching)
        else:
            sending = self._broadcast_leaves([leaf.arrays[source] for leaf in leaves], self.devices)
        if _trace.recorder is not None:
            sending = self._traced(sending, "broadcast", None, leaves)
        with self._timeout(self.options.override(options)):
            return self._per_replica(treedef, await sending)

    async def _broadcast_leaves(
        self, arrays: list[Any], destinations: Sequence[Device]
    ) -> list[list[Any]]:
        return [await self.backend.broadcast(array, destinations) for array in arrays]

    async def _broadcast_across(
        self, leaves: list[_LeafArrays], source: int, what: str, matching: bool
    ) -> list[list[Any]]:
        """Global replica ``source``'s leaves from its worker to every worker's replicas."""
        assert self.cluster is not None
        root, local = divmod(source, self.size)
        sending = self.cluster.worker_index == root
        if sending:
            _check_crossing("broadcast", leaves, local)
        results = []
        for leaf in leaves:
            where = " ".join(filter(None, (what, f"of replica {source}", _where(leaf.path))))
            mine: np.ndarray[Any, Any] | None = None  # another worker's: ignored ...
            if sending:
                mine = await self._staged(leaf.arrays[local], local)
            elif matching:  # ... but for its shape and dtype, which the workers compare: an
                # array of those, whose data nobody reads (no copy off its device, which waits
                # for the device's work, and none of a broadcast view to write, say)
                mine = np.empty(leaf.arrays[0].shape, leaf.arrays[0].dtype)
            value = await self.cluster.broadcast(mine, root, where, matching)
            results.append(await self._placed(value))
        return results

    async def reduce_scatter(
        self,
        op: ReduceOp,
        value: Any,
        axis: SupportsIndex,
        options: CommunicationOptions | None = None,
    ) -> list[Any]:
        """Reduce across replicas; replica ``i`` gets the ``i``-th ``array_split`` chunk.

        Raises:
            ValueError: as ``all_reduce``, or ``axis`` out of range.
            TypeError: as ``all_reduce``.
        """
        leaves, treedef = self._leaves("reduce_scatter", value)
        self._check_same_shapes("reduce_scatter", leaves)
        _check_op(op, leaves)
        for leaf in leaves:
            _check_axis("reduce_scatter", leaf, axis)
        opts = self.options.override(options)
        # Across workers, what travels is an all-reduce's: named so that it meets no other.
        with reductions_for(f"a reduce_scatter along axis {int(axis)}"):
            reducing = self._reduce_leaves(op, leaves, opts)
            if _trace.recorder is not None:
                reducing = self._traced(reducing, "reduce_scatter", op, leaves)
            with self._timeout(opts), _reductions_named("reduce_scatter"):
                results = await reducing
        size, first, chunks = self.size, self.first_replica, self.num_replicas
        scattered = [
            [
                self.devices[i].xp.array_split(replicas[i], chunks, axis=axis)[first + i]
                for i in range(size)
            ]
            for replicas in results
        ]
        return self._per_replica(treedef, scattered)

    def check_source(self, source: object) -> int:
        """``source`` as a replica id (a Python int), or refused.

        Raises:
            TypeError: ``source`` is not an integer (a bool is not one).
            ValueError: it is not from 0 to ``size - 1``.
        """
        last = self.num_replicas - 1
        return checked_integer(
            source, f"source_replica must be a replica id from 0 to {last}", 0, last
        )

    def call(self, what: str) -> contextlib.AbstractAsyncContextManager[None]:
        """Across workers, the communicator held for a cross-replica call (``what``) from its
        first collective to its last (``Workers.call``); nothing in one process."""
        return call_of(self.cluster, what)

    async def refuse(self, what: str, error: BaseException) -> None:
        """Make ``what``'s refusal of its arguments (``error``, which the caller raises next)
        every worker's: across workers, the others' next collective raises ``WorkersDisagree``
        naming this worker and its error, in step (``Workers.refuse_in_step``), so bad input breaks
        nothing. Nothing to do in one process. When a peer fails or the cluster breaks
        meanwhile, the caller's error is still the one raised (the next call reports the
        rest)."""
        if self.cluster is not None:
            with contextlib.suppress(RuntimeError):  # ReplicaSyncError, ClusterBroken
                await self.cluster.refuse_in_step(what, error)

    def refusing(self, what: str, error: BaseException) -> None:
        """Note that a replica's own check of ``what``'s arguments raised ``error`` (which the
        caller raises next): across workers, a ``run()`` failing with it refuses it on every
        worker in step as it ends, as ``refuse`` does at once for the merge's checks (a
        replica cannot: its worker's other replicas may not have come that far). Nothing to
        do in one process."""
        if self.cluster is not None:
            self.cluster.refusing.append((what, error))

    async def barrier(self, options: CommunicationOptions) -> None:
        """Wait until every worker's replicas have reached this barrier (several workers),
        bounded by ``options``' timeout."""
        if self.cluster is None:
            return
        waiting = self.cluster.barrier("barrier")
        recorder = _trace.recorder
        if recorder is not None:
            waiting = recorder.timed(waiting, "barrier", {"devices": self.num_replicas})
        with self._timeout(options):
            await waiting

    # -- one result per destination ---------------------------------------------------

    async def reduce(self, op: ReduceOp, value: Any, axis: Axes | None) -> Any:
        """Reduce ``value`` across replicas (and along ``axis``), on the first device.

        With ``axis``, each component is reduced along it first; ``MEAN`` divides the total by
        the number of elements along ``axis`` over all replicas, so short and empty batches
        weigh what they hold.

        ``MEAN`` of integers is a float64 mean, as NumPy's and TF's ``strategy.reduce`` are
        (in replica context an integer mean stays refused: its result would change dtype).

        Raises:
            ValueError: shapes or dtypes that differ; ``axis`` out of range; a Python int that
                int64 cannot hold.
            TypeError: as ``all_reduce``.
        """
        leaves, treedef = self._leaves("reduce", value)
        axes = []
        if axis is None:
            self._check_same_shapes("reduce", leaves)
        else:
            axes = [self._check_along(leaf, axis) for leaf in leaves]
        _check_op(op, leaves, integer_mean=True)
        if op is ReduceOp.MEAN:
            leaves = [await self._as_float64(leaf) for leaf in leaves]
        if self.cluster is not None and (axis is not None or _several(leaves, self.options)):
            with self._timeout(self.options):
                await self._agree("reduce", op, leaves, axes)
        if axis is None:
            reducing = self._reduce_leaves(op, leaves, self.options)
            if _trace.recorder is not None:
                reducing = self._traced(reducing, "reduce", op, leaves)
            with self._timeout(self.options):
                return treedef.unflatten([replicas[0] for replicas in await reducing])
        along = self._reduce_leaves_along(op, leaves, axes)
        if _trace.recorder is not None:
            along = self._traced(along, "reduce", op, leaves)
        with self._timeout(self.options):
            return treedef.unflatten(await along)

    def _check_along(self, leaf: _LeafArrays, axis: Axes) -> tuple[tuple[int, ...], str]:
        """``strategy.reduce``'s ``axis`` for one leaf: its axes, checked, and how messages
        show them; every replica's component may differ along them only."""
        axes = _check_axes("reduce", leaf, axis)
        shown = f"axes {tuple(axis)}" if isinstance(axis, tuple | list) else f"axis {axis}"
        self._check_shapes_off("reduce", leaf, axes, shown)
        return axes, shown

    async def _as_float64(self, leaf: _LeafArrays) -> _LeafArrays:
        """An integer leaf's arrays (of one dtype: checked) as float64 for a mean, each made
        on its device (in its stream's order); other leaves as they are."""
        if getattr(leaf.arrays[0], "dtype", np.dtype(float)).kind not in "iu":
            return leaf
        arrays = [
            await device.compute(array.nbytes, _float64, array)
            for device, array in zip(self.devices, leaf.arrays, strict=True)
        ]
        return _LeafArrays(leaf.path, arrays)

    async def _reduce_leaves_along(
        self, op: ReduceOp, leaves: list[_LeafArrays], axes: list[tuple[tuple[int, ...], str]]
    ) -> list[Any]:
        return [
            await self._reduce_along(op, leaf, *along)
            for leaf, along in zip(leaves, axes, strict=True)
        ]

    async def gather(self, value: Any, axis: SupportsIndex) -> Any:
        """Concatenate ``value``'s components along ``axis``, on the first device.

        Raises:
            ValueError: as ``all_gather``.
            TypeError: as ``all_gather``.
        """
        leaves, treedef = self._leaves("gather", value)
        axes = [self._check_gather_shapes("gather", leaf, axis) for leaf in leaves]
        if self.cluster is not None and len(leaves) != 1:  # several collectives, or none
            _check_crossing("gather", leaves)  # bad input is refused before any exchange
            along = [((a,), f"axis {a}") for a in axes]
            with self._timeout(self.options):
                await self._agree("gather", None, leaves, along)
        gathering = self._gather_leaves("gather", leaves, axes)
        if _trace.recorder is not None:
            gathering = self._traced(gathering, "gather", None, leaves)
        with self._timeout(self.options):
            return treedef.unflatten([whole[0] for whole in await gathering])

    async def reduce_to(
        self,
        op: ReduceOp,
        value: Any,
        destinations: Sequence[Device],
        options: CommunicationOptions | None = None,
    ) -> list[Any]:
        """Reduce ``value`` across replicas; place it on ``destinations``.

        ``MEAN`` of integers is a float64 mean, as ``reduce``'s.

        Args:
            op: how to combine the replicas' components.
            value: the value to reduce (described in messages as ``reduce`` describes its
                value: the root is the value itself).
            destinations: where the result goes; every one is one of ``devices``.
            options: overrides the engine's options for this call.

        Returns:
            One result structure per destination, in the order given. Each destination takes
            the result the backend left on its own device (ordered there by the backend), not
            a copy of the first one's.

        Raises:
            ValueError: as ``all_reduce``.
            TypeError: as ``all_reduce``, but for ``MEAN`` of integers.
        """
        per_replica = await self._reduce_to("reduce_to", op, value, options)
        index = {device.name: i for i, device in enumerate(self.devices)}
        return [per_replica[index[device.name]] for device in destinations]

    async def batch_reduce_to(
        self,
        op: ReduceOp,
        pairs: Sequence[tuple[Any, Sequence[Device]]],
        options: CommunicationOptions | None = None,
    ) -> list[list[Any]]:
        """Reduce several values in as few reductions as possible; place each on its devices.

        Args:
            op: how to combine the replicas' components.
            pairs: ``(value, destinations)``; every destination is one of ``devices``.
            options: overrides the engine's options for this call.

        Returns:
            Per pair, what ``reduce_to`` returns for it, in the order given.

        Raises:
            ValueError: as ``reduce_to`` (messages name value ``k`` at ``[k]``).
            TypeError: as ``reduce_to``.
        """
        values = [value for value, _ in pairs]
        per_replica = await self._reduce_to("batch_reduce_to", op, values, options)
        index = {device.name: i for i, device in enumerate(self.devices)}
        return [
            [per_replica[index[device.name]][k] for device in destinations]
            for k, (_, destinations) in enumerate(pairs)
        ]

    async def _reduce_to(
        self, what: str, op: ReduceOp, value: Any, options: CommunicationOptions | None
    ) -> list[Any]:
        """``reduce_to``'s reduction (``what``, for messages): the result once per replica."""
        leaves, treedef = self._leaves(what, value)
        self._check_same_shapes(what, leaves)
        _check_op(op, leaves, integer_mean=True)
        if op is ReduceOp.MEAN:
            leaves = [await self._as_float64(leaf) for leaf in leaves]
        opts = self.options.override(options)
        if self.cluster is not None and _several(leaves, opts):
            with self._timeout(opts):
                await self._agree(what, op, leaves)
        reducing = self._reduce_leaves(op, leaves, opts)
        if _trace.recorder is not None:
            reducing = self._traced(reducing, "reduce_to", op, leaves)
        with self._timeout(opts):
            results = await reducing
        return self._per_replica(treedef, results)

    async def broadcast_to(self, value: Any, destinations: Sequence[Device]) -> list[Any]:
        """``value`` placed on every destination device, one structure per destination. A
        ``Mirrored`` leaf, one value on every replica, counts as that value.

        Raises:
            TypeError: a leaf that is no number or array (``None``, a string), or a
                ``PerReplica`` (one value per replica: which one to place?); nothing is placed.
            ValueError: a leaf is a Python int that int64 cannot hold; nothing is placed.
        """
        pairs, treedef = _tree.flatten_with_path(value)
        first = destinations[0]
        arrays = [self._placeable("broadcast_to", path, leaf, first) for path, leaf in pairs]
        sending = self._broadcast_leaves(arrays, destinations)
        if _trace.recorder is not None:
            recorder = _trace.recorder
            args = {"bytes": sum(a.nbytes for a in arrays), "devices": len(destinations)}
            sending = recorder.timed(sending, "broadcast_to", args)
        placed = await sending
        return [
            treedef.unflatten([results[d] for results in placed]) for d in range(len(destinations))
        ]

    def _placeable(self, what: str, path: _tree.KeyPath, leaf: Any, device: Device) -> Any:
        """One leaf of a value to place (``broadcast_to``) as an array on ``device``.

        Raises:
            TypeError: the leaf is no number or array, or is a ``PerReplica``.
            ValueError: the leaf is a Python int that int64 cannot hold.
        """
        at = f" at {_tree.format_path(path)}" if path else ""
        if isinstance(leaf, Mirrored):
            leaf = leaf.values[0]  # one value on every replica: it, as TF reads one
        elif isinstance(leaf, DistributedValues):
            raise TypeError(
                f"{what}: the value{at} is a {type(leaf).__name__} of {len(leaf.values)} "
                f"values, one per replica, but {what} places one value on every destination: "
                "reduce it first (strategy.extended.reduce_to), or pick one replica's "
                "(strategy.experimental_local_results(value)[i])"
            )
        if array_kind(leaf) != "scalar" and not hasattr(leaf, "shape"):
            raise TypeError(
                f"{what}: the value{at} is {_describe_component(leaf)}; {what} places numbers "
                f"and arrays: pass a number or a {self.backend.name} array instead"
            )
        _refuse_wide_ints(what, path, [leaf], False)
        array = device.asarray(leaf)
        if array.dtype.kind == "O":
            raise TypeError(
                f"{what}: the value{at} is no number or array of numbers ({leaf!r:.60} makes a "
                "NumPy array of objects)"
            )
        return array

    async def _agree(
        self,
        what: str,
        op: ReduceOp | None,
        leaves: list[_LeafArrays],
        along: Sequence[tuple[tuple[int, ...], str]] = (),
    ) -> None:
        """Across workers, before a call (``what``) of several collectives moves any data, or
        in place of a call of none (an empty structure): every worker makes the same call,
        with ``op``, on leaves at the same places with the same dtypes and shapes (free along
        the checked axes of ``along``, one entry per leaf, if given), or every worker raises
        ``WorkersDisagree`` alike (``Workers.agree``). Else a worker passing one leaf more
        would make a collective more, which would meet another worker's next call.

        Raises:
            WorkersDisagree: the workers' calls differ.
        """
        assert self.cluster is not None
        described = []
        for k, leaf in enumerate(leaves):
            first = leaf.arrays[0]
            free = along[k][0] if along else ()
            shape = tuple("*" if d in free else n for d, n in enumerate(first.shape))
            place = _tree.format_path(leaf.path) if leaf.path else "the value"
            shown = str(shape).replace("'", "")  # (*, 3), as a shape is shown
            described.append(f"{place} {first.dtype.newbyteorder('=')} {shown}")
        head = " ".join(filter(None, (what, f"({op.value})" if op else "", _reduction_of.get())))
        if along:
            head += " along " + along[0][1]
        count = {0: "no leaves", 1: "1 leaf"}.get(len(leaves), f"{len(leaves)} leaves")
        listed = f": {'; '.join(described)}" if described else ""
        await self.cluster.agree(what, f"{head} of {count}{listed}")

    # -- the core -------------------------------------------------------------------------

    def _traced(
        self,
        awaitable: Coroutine[Any, Any, T],
        name: str,
        op: ReduceOp | None,
        leaves: list[_LeafArrays],
    ) -> Coroutine[Any, Any, T]:
        """``awaitable`` as a span of the active trace (called only while one is recorded)."""
        recorder = _trace.recorder
        if recorder is None:
            return awaitable
        args: dict[str, Any] = {}
        if op is not None:
            args["op"] = op.value
        args["bytes"] = sum(int(getattr(leaf.arrays[0], "nbytes", 0)) for leaf in leaves)
        args["devices"] = self.size
        return recorder.timed(awaitable, name, args)

    def _per_replica(self, treedef: _tree.TreeDef, results: Sequence[Sequence[Any]]) -> list[Any]:
        """Per-leaf results (one per replica each) as one result structure per replica."""
        if treedef is _LEAF:
            return list(results[0])
        return [
            treedef.unflatten([leaf[replica] for leaf in results]) for replica in range(self.size)
        ]

    def _leaves(self, what: str, value: Any) -> tuple[list[_LeafArrays], _tree.TreeDef]:
        """Split a (regrouped) value into leaves with one array per replica, on its device."""
        size = len(self.devices)
        pairs: list[tuple[_tree.KeyPath, Any]]
        if isinstance(value, DistributedValues) or _tree.is_leaf(value):
            pairs, treedef = [((), value)], _LEAF  # the common case: one array per replica
        else:
            pairs, treedef = _tree.flatten_with_path(value)
        leaves = []
        for path, leaf in pairs:
            if isinstance(leaf, DistributedValues):
                if not _tree.is_leaf(leaf.values[0]):
                    # One structure per replica (``experimental_distribute_values_from_function``
                    # returning a dict, say): the structure of per-replica values it stands
                    # for, there; then the value again, leaf by leaf.
                    return self._leaves(what, _regrouped(what, pairs, treedef, self.first_replica))
                if len(leaf.values) != size:
                    local = (
                        f" on this worker ({self.num_replicas} over all workers: a distributed "
                        "value holds this worker's replicas' values only)"
                        if self.cluster is not None
                        else ""
                    )
                    raise ValueError(
                        f"{what}: the value at {_tree.describe_path(path)} is a "
                        f"{type(leaf).__name__} of {len(leaf.values)} values, but the strategy "
                        f"has {size} replicas{local}"
                    )
                components = list(leaf.values)
            elif isinstance(leaf, _copied_types):  # a variable: each replica its own copy
                components = _copies_of(what, path, leaf, size, self)
            else:
                components = [leaf] * size
            arrays = self._to_arrays(what, path, components, isinstance(leaf, DistributedValues))
            leaves.append(_LeafArrays(path, arrays))
        return leaves, treedef

    def _to_arrays(
        self, what: str, path: _tree.KeyPath, components: list[Any], per_replica: bool
    ) -> list[Any]:
        """One leaf's components as arrays on their replicas' devices, or a ``TypeError``."""
        backend = self.backend
        if backend.name == "numpy" and all(type(c) is np.ndarray for c in components):
            return components  # host arrays already: nothing to place
        kinds = {array_kind(component) for component in components}
        # Host data goes to any device, as TF converts host values: each replica's device
        # copies it onto itself, on its own stream for a GPU, so it is ready before its use.
        if not kinds <= {backend.name, "scalar", "numpy"}:
            if any(isinstance(c, _copied_types) for c in components):
                # Variables from some replicas (different ones, or beside arrays): each
                # replica's own copy, as for one variable from every replica (``_leaves``).
                size = len(components)
                copies = [
                    _copies_of(what, path, c, size, self)[i] if isinstance(c, _copied_types) else c
                    for i, c in enumerate(components)
                ]
                return self._to_arrays(what, path, copies, per_replica)
            _refuse_components(
                what, path, components, per_replica, backend.name, self.first_replica
            )
        _refuse_wide_ints(what, path, components, per_replica, self.first_replica)
        arrays = [device.asarray(c) for device, c in zip(self.devices, components, strict=True)]
        for replica, array in enumerate(arrays, start=self.first_replica):
            if array.dtype.kind == "O":
                raise TypeError(
                    f"{what}: replica {replica}'s value at {_tree.describe_path(path)} is no "
                    f"number or array of numbers ({components[replica - self.first_replica]!r:.60}"
                    " makes a NumPy array of objects: a number NumPy has no dtype for, such as "
                    "a Decimal, or values of mixed types?)"
                )
        return arrays

    def _check_same_shapes(self, what: str, leaves: list[_LeafArrays]) -> None:
        base = self.first_replica  # replicas are named by their ids in sync
        for leaf in leaves:
            first = leaf.arrays[0]
            for replica, other in enumerate(leaf.arrays[1:], start=base + 1):
                if other.shape != first.shape or other.dtype != first.dtype:
                    raise ValueError(
                        f"{what}: replica {replica}'s value at {_tree.describe_path(leaf.path)} "
                        f"has shape {tuple(other.shape)} and dtype {other.dtype}, replica "
                        f"{base}'s has shape {tuple(first.shape)} and dtype {first.dtype}; every "
                        "replica must pass the same shape and dtype"
                    )

    def _check_gather_shapes(self, what: str, leaf: _LeafArrays, axis: SupportsIndex) -> int:
        axis_ = _check_axis(what, leaf, axis)
        self._check_shapes_off(what, leaf, (axis_,), f"axis {axis}")
        return axis_

    def _check_shapes_off(
        self, what: str, leaf: _LeafArrays, axes: tuple[int, ...], shown: str
    ) -> None:
        """Every replica's component has the first's dtype and shape, except along ``axes``."""
        first = leaf.arrays[0]
        base = self.first_replica
        for replica, other in enumerate(leaf.arrays[1:], start=base + 1):
            same_rest = other.ndim == first.ndim and all(
                a == b
                for d, (a, b) in enumerate(zip(other.shape, first.shape, strict=True))
                if d not in axes
            )
            if not same_rest or other.dtype != first.dtype:
                raise ValueError(
                    f"{what}: replica {replica}'s value at {_tree.describe_path(leaf.path)} has "
                    f"shape {tuple(other.shape)} and dtype {other.dtype}, replica {base}'s has "
                    f"shape {tuple(first.shape)} and dtype {first.dtype}; they may differ only "
                    f"along {shown}"
                )

    async def _reduce_leaves(
        self, op: ReduceOp, leaves: list[_LeafArrays], opts: CommunicationOptions
    ) -> list[list[Any]]:
        """Reduce every leaf across replicas; small leaves of one dtype go in packs.

        Returns, per leaf, one result per replica.
        """
        limit = opts.bytes_per_pack or DEFAULT_PACK_BYTES
        if len(leaves) > 1 and _one_pack(leaves, limit):
            # The common case, the one pack the loop below would make.
            return await self._reduce_pack(op, leaves)
        results: list[list[Any] | None] = [None] * len(leaves)
        packs: dict[Any, list[list[int]]] = {}
        filled: dict[Any, int] = {}  # bytes in the last pack of each dtype
        for index, leaf in enumerate(leaves):
            first = leaf.arrays[0]
            if first.nbytes >= limit:
                results[index] = await self._reduce_arrays(op.value, leaf.arrays, leaf.path)
                continue
            groups = packs.setdefault(first.dtype, [[]])
            if filled.get(first.dtype, 0) + first.nbytes > limit:
                groups.append([])
                filled[first.dtype] = 0
            groups[-1].append(index)
            filled[first.dtype] = filled.get(first.dtype, 0) + first.nbytes
        for groups in packs.values():
            for group in groups:
                if len(group) == 1:
                    leaf = leaves[group[0]]
                    results[group[0]] = await self._reduce_arrays(op.value, leaf.arrays, leaf.path)
                else:
                    for index, reduced in zip(
                        group, await self._reduce_pack(op, [leaves[i] for i in group]), strict=True
                    ):
                        results[index] = reduced
        assert all(result is not None for result in results)
        return results  # type: ignore[return-value]

    async def _reduce_pack(self, op: ReduceOp, group: list[_LeafArrays]) -> list[list[Any]]:
        """Reduce the leaves as one flat array per replica, then view it as the leaves."""
        reduced = await self._reduce_packed(
            op.value, [leaf.arrays for leaf in group], [leaf.path for leaf in group]
        )
        shapes = [leaf.arrays[0].shape for leaf in group]
        offsets = [0]
        for shape in shapes:
            offsets.append(offsets[-1] + math.prod(shape))
        views_of: dict[int, list[Any]] = {}
        per_leaf: list[list[Any]] = [[] for _ in group]
        for flat in reduced:
            views = views_of.get(id(flat))
            if views is None:
                views = views_of[id(flat)] = [
                    flat[offsets[j] : offsets[j + 1]].reshape(shape)
                    for j, shape in enumerate(shapes)
                ]
            for j, view in enumerate(views):
                per_leaf[j].append(view)
        return per_leaf

    async def _reduce_packed(
        self, op: str, leaves: list[list[Any]], paths: Sequence[_tree.KeyPath] = ()
    ) -> list[Any]:
        """Reduce small leaves as one: per replica, one flat array of the reduced leaves end
        to end (the backend packs: the host reduces each leaf into its part of one output,
        GPUs join each replica's leaves and make one collective call).

        With ``_reduce_arrays``, the step a strategy spanning several workers extends.
        """
        if self.cluster is None:
            return await self.backend.all_reduce_packed(op, leaves, self.devices)
        local = await self._own_part(
            self.backend.all_reduce_packed(_local_op(op), leaves, self.devices)
        )
        shapes = [str(arrays[0].shape) for arrays in leaves]
        if any(paths):  # the workers compare where each leaf is in the value, too
            shapes = [f"{_where(path)} {shape}" for path, shape in zip(paths, shapes, strict=True)]
        return await self._across_workers(op, local, "leaves " + ", ".join(shapes))

    async def _reduce_arrays(
        self, op: str, inputs: list[Any], path: _tree.KeyPath = ()
    ) -> list[Any]:
        """Reduce one array per replica on the backend: one result per replica (``path``:
        where the array is in the value reduced, which the workers compare).

        The step a strategy spanning several workers extends: local reduction, across
        workers, the local result.
        """
        if self.cluster is None:
            return await self.backend.all_reduce(op, inputs, self.devices)
        if self.backend is HOST_BACKEND:
            first = np.asarray(inputs[0], order="C")
            if len(inputs) == 1 or first.nbytes * len(inputs) < HOST_INLINE_BYTES:
                # From the replicas' arrays straight into the output: one host replica's, as
                # a separate-buffer Allreduce does (a local copy first would read and write it
                # once more); several, reduced where the cluster sends them from, on the loop's
                # thread as the backend reduces so few bytes (no output of their own first).
                out = HOST_BACKEND.output(first.shape, first.dtype)
                send = first if len(inputs) == 1 else inputs  # (combined as they are)
                await self.cluster.allreduce(_local_op(op), send, out, _layout(op, _where(path)))
                if op == "mean":
                    np.divide(out, self.num_replicas, out=out)
                return [HOST_BACKEND.publish(out)] * self.size
        local = await self._own_part(self.backend.all_reduce(_local_op(op), inputs, self.devices))
        return await self._across_workers(op, local, _where(path))

    async def _own_part(self, local: Awaitable[T]) -> T:
        """``local``, this worker's own part of a cross-worker reduction, made before its
        collective: an error there (an overflow where NumPy's ``errstate`` raises) is refused
        in step (``Workers.refuse_own_part``), so the other workers raise ``WorkersDisagree``
        naming this worker instead of waiting for its collective."""
        try:
            return await local
        except Exception as error:
            assert self.cluster is not None
            with contextlib.suppress(RuntimeError):  # ReplicaSyncError, ClusterBroken (``refuse``)
                await self.cluster.refuse_own_part(reductions_called.get(), error)
            raise

    async def _across_workers(self, op: str, local: list[Any], layout: str = "") -> list[Any]:
        """The cross-worker step: this worker's reduction (``local``, one result per replica,
        summed for ``mean``) combined with every other worker's, one result per replica.
        ``layout``: the leaves packed in it, or where it is in the value reduced, which every
        worker must agree on too.

        Host replicas share one output from the pool, published read-only: it is reduced in
        place (``MPI.IN_PLACE``) before anyone else sees it. GPU results go through the host.
        """
        assert self.cluster is not None
        if self.backend is HOST_BACKEND:
            out = local[0]
            out.flags.writeable = True  # the pool's fresh output: nobody else holds it yet
            try:
                await self.cluster.allreduce(_local_op(op), None, out, _layout(op, layout))
                if op == "mean":
                    np.divide(out, self.num_replicas, out=out)
            finally:
                out.flags.writeable = False
            return local
        staged = await self._staged(local[0])
        await self.cluster.allreduce(_local_op(op), None, staged, _layout(op, layout))
        if op == "mean":
            np.divide(staged, self.num_replicas, out=staged)
        return await self._placed(staged)

    async def _staged(self, value: Any, replica: int = 0) -> np.ndarray[Any, Any]:
        """A writeable, contiguous host copy of a value on local replica ``replica``'s device
        (a result on the first, by default), once the device's work that made it is done
        (without blocking the event loop)."""
        return await self.backend.to_host(value, self.devices[replica])

    async def _placed(self, value: np.ndarray[Any, Any]) -> list[Any]:
        """A host array on every replica's device (host replicas share it, read-only)."""
        if self.backend is HOST_BACKEND:
            value.flags.writeable = False
            return [value] * self.size
        return await self.backend.broadcast(value, self.devices)

    @contextlib.contextmanager
    def _timeout(self, options: CommunicationOptions) -> Iterator[None]:
        """Bound the cross-worker waits in the block by ``options.timeout_seconds``."""
        timeout = options._timeout
        if self.cluster is None or timeout is None:
            yield
            return
        with self.cluster.timeout(timeout):
            yield

    async def _reduce_along(
        self, op: ReduceOp, leaf: _LeafArrays, axes: tuple[int, ...], shown: str
    ) -> Any:
        """``strategy.reduce`` with ``axis`` (checked: ``axes``, shown as ``shown``): within
        each replica, then across replicas.

        ``MEAN`` divides the total by the number of elements along ``axes`` over all
        replicas, so short and empty batches weigh what they hold.
        """
        inner = {"sum": "sum", "mean": "sum", "max": "max", "min": "min", "prod": "prod"}[op]
        rows = sum(math.prod(c.shape[a] for a in axes) for c in leaf.arrays)
        if self.cluster is not None:
            count = np.array([rows], np.int64)
            await self.cluster.allreduce("sum", None, count)
            rows = int(count[0])
        if op in (ReduceOp.MAX, ReduceOp.MIN) and rows == 0:
            raise ValueError(
                f"reduce: every replica's value at {_tree.describe_path(leaf.path)} is empty "
                f"along {shown}, so {op.name} has nothing to reduce"
            )

        async def reduced_within() -> list[Any]:
            return [
                await device.compute(
                    component.nbytes, _partial_reduction, device.xp, inner, component, axes
                )
                for device, component in zip(self.devices, leaf.arrays, strict=True)
            ]

        partials = await (
            reduced_within() if self.cluster is None else self._own_part(reduced_within())
        )
        # Across replicas through the backend, which orders the devices' streams.
        result = (await self._reduce_arrays(inner, partials, leaf.path))[0]
        if op is ReduceOp.MEAN:
            first = self.devices[0]
            result = await first.compute(result.nbytes, _divide, first.xp, result, rows)
        dtype = leaf.arrays[0].dtype
        if not dtype.isnative:  # reduced in this machine's byte order: the leaf's again
            result = result.astype(dtype)
        return result


def _regrouped(
    what: str, pairs: list[tuple[_tree.KeyPath, Any]], treedef: _tree.TreeDef, first_replica: int
) -> Any:
    """A value (flattened: ``pairs``, ``treedef``) with each distributed leaf whose components
    are structures as the structure of per-replica values it stands for (identical leaves stay
    as they are; ``first_replica``: the first component's replica id, for messages).

    Raises:
        ValueError: the replicas' structures differ (naming both, the distributed value's
            place and where in it).
        TypeError: containers of different types at the same place.
    """
    leaves = []
    for path, leaf in pairs:
        if isinstance(leaf, DistributedValues) and not _tree.is_leaf(leaf.values[0]):
            try:
                leaf = regroup(leaf.values, first_replica=first_replica)
            except (TypeError, ValueError) as exc:
                at = f"in the {type(leaf).__name__} at {_tree.format_path(path)}, " if path else ""
                raise type(exc)(f"{what}: {at}{exc}") from None
        leaves.append(leaf)
    return treedef.unflatten(leaves)


def _where(path: _tree.KeyPath) -> str:
    """Where a leaf is in a collective's value, as the workers compare it ("" for the value
    itself): ``{"a": x}`` on one worker and ``{"b": x}`` on another must not combine."""
    return f"at {_tree.format_path(path)}" if path else ""


#: What a cross-worker all-reduce is for, where it is not a plain ``all_reduce`` (its layout
#: says so, which the workers compare): set by ``reductions_for``.
_reduction_of: contextvars.ContextVar[str] = contextvars.ContextVar("_reduction_of", default="")


@contextlib.contextmanager
def _reductions_named(what: str) -> Iterator[None]:
    """Name the cross-worker all-reduces made in the block ``what`` in their errors and
    timeouts: the user's call (a ``reduce_scatter``), not ``all_reduce``."""
    token = reductions_called.set(what)
    try:
        yield
    finally:
        reductions_called.reset(token)


@contextlib.contextmanager
def reductions_for(what: str) -> Iterator[None]:
    """Name what the cross-worker reductions made in the block are for (``what``: an
    optimizer's step of its variables, a variable's write): the workers compare it with the
    rest of each reduction's description, so a worker reducing for another variable, or for
    the same variables in another order, meets a disagreement (``WorkersDisagree``, alike on
    every worker, before any data moves) rather than a match that would combine the two."""
    outer = _reduction_of.get()
    token = _reduction_of.set(" ".join(filter(None, (outer, f"for {what}"))))
    try:
        yield
    finally:
        _reduction_of.reset(token)


def _layout(op: str, layout: str) -> str:
    """``layout`` as the workers compare it for ``op``: a mean travels as a sum (``_local_op``),
    so a mean on one worker must not meet a sum on another unnoticed; nor a reduction for
    something (``reductions_for``: a reduce_scatter, a variable's write) another one."""
    purpose = _reduction_of.get()
    if op != "mean" and not purpose:
        return layout  # the common case, at once
    return " ".join(filter(None, (layout, "(a mean)" if op == "mean" else "", purpose)))


def _local_op(op: str) -> str:
    """The op of the local step before the cross-worker one: a mean is summed, then divided
    by the replicas of every worker."""
    return "sum" if op == "mean" else op


def _one_pack(leaves: list[_LeafArrays], limit: int) -> bool:
    """Whether the leaves go in one pack of at most ``limit`` bytes (``_reduce_leaves``): few
    small leaves of one dtype, the common case."""
    dtype = leaves[0].arrays[0].dtype
    return sum(leaf.arrays[0].nbytes for leaf in leaves) < limit and all(
        leaf.arrays[0].dtype == dtype for leaf in leaves
    )


def _several(leaves: list[_LeafArrays], options: CommunicationOptions) -> bool:
    """Whether reducing the leaves (``_reduce_leaves``) may take other than one collective:
    then the workers agree on the whole call first (``ReductionEngine._agree``). One leaf, or
    one pack, says in its own collective's header all that the workers compare. No leaves
    make no collective: the agreement stands in for one, so that another worker's collective
    meets it rather than this worker's next call."""
    return len(leaves) != 1 and (
        not leaves or not _one_pack(leaves, options.bytes_per_pack or DEFAULT_PACK_BYTES)
    )


def _check_crossing(what: str, leaves: list[_LeafArrays], replica: int = 0) -> None:
    """Across workers, data travels as bytes: any dtype but Python objects, whose arrays hold
    references into this process. Checked on local replica ``replica``'s arrays (a
    broadcast's source, whose arrays alone travel).

    Raises:
        TypeError: a leaf holds Python objects (dtype ``object``).
    """
    for leaf in leaves:
        dtype = getattr(leaf.arrays[replica], "dtype", None)
        if dtype is not None and dtype.hasobject:
            at = f" at {_tree.describe_path(leaf.path)}" if leaf.path else ""
            raise TypeError(
                f"{what}{at}: arrays of Python objects (dtype {dtype}) cannot go from one "
                "worker to another, which holds only bytes; pass numbers, or strings as a "
                "fixed-width dtype (np.array(values, dtype=str))"
            )


def _refuse_components(
    what: str,
    path: _tree.KeyPath,
    components: list[Any],
    per_replica: bool,
    backend: str,
    first_replica: int = 0,
) -> NoReturn:
    """Raise the ``TypeError`` for a leaf some of whose components this backend cannot take.

    Components that are no number or array at all (``None``, a string, any object without a
    ``shape``) are named first, grouped by replica; ``every replica`` when the leaf was one
    plain value standing for all of them; a replica by its id in sync (``first_replica`` is
    the first component's). Otherwise an array of another library is there
    (CuPy on host devices, a tensor): it has a shape, so the advice is to place
    it on the replica's device.
    """
    at = f" at {_tree.describe_path(path)}" if path else ""
    not_numbers: dict[str, list[int]] = {}  # what was passed -> the replicas that passed it
    for replica, component in enumerate(components, start=first_replica):
        if array_kind(component) != "scalar" and not hasattr(component, "shape"):
            not_numbers.setdefault(_describe_component(component), []).append(replica)
    if not_numbers:
        passed = ", ".join(
            f"{replica_list(replicas) if per_replica else 'every replica'} passed {value}"
            for value, replicas in not_numbers.items()
        )
        raise TypeError(
            f"{passed} to {what}{at}; collectives take numbers and arrays: pass a number or a "
            f"{backend} array instead"
        )
    kinds = {f"{type(c).__module__}.{type(c).__name__}" for c in components}
    if len(kinds) == 1:  # one foreign kind everywhere: nothing is mixed
        (kind,) = kinds
        passed = f"{'every replica passes' if per_replica else 'it is'} a {kind}"
        if per_replica and len(components) == 1:
            passed = f"replica {first_replica} passes a {kind}"
        raise TypeError(
            f"{what}: the value{at} is not a {backend} array ({passed}), but this strategy's "
            f"devices hold {backend} arrays; put each value on its replica's device with "
            "ctx.device.asarray(value)"
        )
    found = ", ".join(
        f"replica {i} passes {type(c).__module__}.{type(c).__name__}"
        for i, c in enumerate(components, start=first_replica)
    )
    raise TypeError(
        f"{what}: the value at {_tree.describe_path(path)} mixes array types ({found}), but "
        f"this strategy's devices hold {backend} arrays; put each value on its replica's "
        "device with ctx.device.asarray(value)"
    )


def _refuse_wide_ints(
    what: str, path: _tree.KeyPath, components: list[Any], per_replica: bool, first_replica: int = 0
) -> None:
    """Refuse a leaf with a Python int outside int64 among its components, as TF refuses an
    out-of-range integer (NumPy makes one from 2**63 to 2**64 - 1 a uint64, which wraps when
    summed, and a larger one an array of objects), before anything is converted
    (``first_replica``: the first component's replica id, for the message).

    Raises:
        ValueError: a component is such an int; the message names its replica (when the
            components are per replica) and the leaf's path.
    """
    for replica, component in enumerate(components, start=first_replica):
        if isinstance(component, int) and not INT64_MIN <= component <= INT64_MAX:
            who = f"replica {replica}'s value" if per_replica else "the value"
            raise ValueError(
                f"{what}: {who} at {_tree.describe_path(path)} is the int {component}, which "
                f"does not fit int64 ({INT64_MIN} to {INT64_MAX}), the dtype of Python ints "
                "here (TF refuses it as an out-of-range integer); NumPy would make it uint64, "
                "whose sums wrap around, or an array of objects: pass a NumPy value of the "
                "dtype meant (np.uint64 holds up to 2**64 - 1), or a float"
            )


def _describe_component(value: Any) -> str:
    """A value a collective cannot take, briefly: ``None (NoneType)``, ``'abc' (str)``."""
    try:
        shown = f"{value!r:.60}"
    except Exception:  # a repr that fails still leaves the type to name
        shown = "an object"
    return f"{shown} ({type(value).__name__})"


def _float64(array: Any) -> Any:
    return array.astype(np.float64)


def _partial_reduction(xp: Any, inner: str, component: Any, axes: tuple[int, ...]) -> Any:
    """One replica's reduction along ``axes``; an empty batch gives the op's identity, so it
    changes nothing when the replicas' partials are combined."""
    if inner in ("sum", "prod"):  # in the component's dtype, as TF's (NumPy widens ints)
        dtype = component.dtype
        # A ufunc's dtype names no byte order: the other one's is its type (in this
        # machine's order, which ``_reduce_along`` gives back).
        return getattr(xp, inner)(
            component, axis=axes, dtype=dtype if dtype.isnative else dtype.type
        )
    if all(component.shape[a] for a in axes):
        return getattr(xp, inner)(component, axis=axes)
    shape = tuple(n for d, n in enumerate(component.shape) if d not in axes)
    dtype = component.dtype
    if dtype.kind == "f":
        identity: Any = -xp.inf if inner == "max" else xp.inf
    elif dtype.kind in "iu":
        info = xp.iinfo(dtype)
        identity = info.min if inner == "max" else info.max
    else:  # bool
        identity = inner == "min"
    return xp.full(shape, identity, dtype=dtype)


def _divide(xp: Any, value: Any, by: int) -> Any:
    """``value / by`` as an array of ``xp`` (NumPy makes a 0-d quotient a scalar)."""
    if by == 0:
        return xp.asarray(value * float("nan"))  # nothing to average: NaN, as np.mean
    return xp.asarray(value / by)


def _check_axis(what: str, leaf: _LeafArrays, axis: SupportsIndex) -> int:
    """``axis`` as a non-negative axis of the leaf's components (any integer: NumPy's too).

    Raises:
        TypeError: ``axis`` is not an integer (a bool is not one, as for NumPy).
        ValueError: ``axis`` is out of range.
    """
    index = as_integer(axis)
    if index is None:
        raise TypeError(f"{what}: axis must be an integer, got {type(axis).__name__} {axis!r}")
    ndim: int = leaf.arrays[0].ndim
    if not -ndim <= index < ndim:
        raise ValueError(
            f"{what}: axis {axis!r} is out of range for the value at "
            f"{_tree.describe_path(leaf.path)}, which has {ndim} dimension"
            f"{'' if ndim == 1 else 's'}"
        )
    return index % ndim


def _check_axes(what: str, leaf: _LeafArrays, axis: Axes) -> tuple[int, ...]:
    """``axis`` (an integer, or a tuple or list of them, as for NumPy and TF) as distinct
    non-negative axes of the leaf's components.

    Raises:
        TypeError: ``axis`` is neither an integer nor a tuple or list of integers.
        ValueError: an axis is out of range, or given twice.
    """
    given = list(axis) if isinstance(axis, tuple | list) else [axis]
    indices = [as_integer(a) for a in given]
    if None in indices:
        raise TypeError(
            f"{what}: axis must be an integer or a tuple of integers, got "
            f"{type(axis).__name__} {axis!r}"
        )
    axes = tuple(_check_axis(what, leaf, index) for index in indices if index is not None)
    if len(set(axes)) != len(axes):
        raise ValueError(
            f"{what}: axis {tuple(given)!r} names an axis twice (the value at "
            f"{_tree.describe_path(leaf.path)} has {leaf.arrays[0].ndim} dimensions); name each "
            "once"
        )
    return axes


#: Classes whose instances hold one copy per replica in ``.values``: ``Variable``, which
#: ``aioreplica._variables`` registers (this layer does not import it). A collective in replica
#: context takes each replica's copy, as TF reads a variable there.
_copied_types: tuple[type, ...] = ()


def register_copied_type(cls: type) -> None:
    """Make collectives read instances of ``cls`` as their copies (see ``_copied_types``)."""
    global _copied_types
    _copied_types = (*_copied_types, cls)


def _copies_of(
    what: str, path: _tree.KeyPath, leaf: Any, size: int, engine: ReductionEngine
) -> list[Any]:
    """A variable's copies as a leaf's components: one per replica (an ordinary variable's
    one copy for every replica).

    Raises:
        ValueError: the variable belongs to another strategy (whose engine it keeps).
    """
    owner = getattr(leaf, "_engine", None)
    if owner is not None and owner is not engine:
        raise ValueError(
            f"{what}: the variable at {_tree.describe_path(path)} ({leaf.name!r}) belongs to "
            f"another strategy; pass a variable of this strategy, or an ordinary one"
        )
    copies = list(leaf.values)
    return copies if len(copies) == size else copies * size  # an ordinary variable: one copy


#: The structure of a single leaf: what ``_leaves`` gives a value that is one leaf.
_LEAF: Final = _tree.flatten(None)[1]


def _check_op(op: ReduceOp, leaves: list[_LeafArrays], integer_mean: bool = False) -> None:
    """Refuse a reduction the dtype cannot do, before anything is computed (``integer_mean``:
    the caller takes ``MEAN`` of integers as a float64 mean, ``_as_float64``)."""
    for leaf in leaves:
        dtype = leaf.arrays[0].dtype
        kind = dtype.kind
        if kind in "biufc" and not (
            (kind == "b" and op not in (ReduceOp.MAX, ReduceOp.MIN))
            or (kind in "iu" and op is ReduceOp.MEAN and not integer_mean)
            or (kind == "c" and op in (ReduceOp.MAX, ReduceOp.MIN))
        ):
            continue
        advice = {
            "b": "bool values reduce with MAX (any) or MIN (all); cast to an integer to count",
            "i": "cast to a floating dtype first, or use SUM and divide",
            "u": "cast to a floating dtype first, or use SUM and divide",
            "c": "complex values have no order; reduce their absolute values instead",
        }.get(kind, "only numeric arrays can be reduced")
        where = _tree.describe_path(leaf.path)
        raise TypeError(f"cannot {op.name} values of dtype {dtype} (at {where}): {advice}")
