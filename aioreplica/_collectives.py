"""Collectives: reduce, gather and broadcast nested values across replicas.

Replica-context collectives (``ctx.all_reduce`` and friends) are merge calls: every replica
hands in its value, the merge function runs once with all of them, and each replica resumes
with its own result. Cross-replica ones (``strategy.reduce``, ``strategy.gather``,
``strategy.extended.reduce_to``) take distributed values directly. Both go through one core:

1. **check**: the values of all replicas have the same structure (``regroup`` names the replicas
   and the key path otherwise), every leaf is an array or scalar of the strategy's backend
   (NumPy and CuPy mixed is a ``TypeError``), with the same shape and dtype on every replica
   (``ValueError`` naming both replicas, the path, both shapes and dtypes), and a dtype the op
   can reduce (``TypeError``). Nothing is computed before every leaf has passed.
2. **pack**: small leaves of one dtype are fused into flat buffers of at most
   ``bytes_per_pack`` bytes, reduced together, and handed back as views of the result, so a
   hundred small gradients cost one reduction instead of a hundred.
3. **reduce** on the backend (host: one shared read-only output; GPU: NCCL or on-device), then,
   where a strategy spans several workers, across workers (``cross_worker``: the seam the MPI
   strategy plugs into: local reduce, then across workers, then the local result).

Results have ``Mirrored`` semantics: each replica gets the same value on its own device. Host
replicas share one read-only array (no per-replica copies); GPU replicas each get theirs.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, Self

from . import _tree
from ._backends import Device, canonical_device_name
from ._context import ReplicaContext, context_state, merge_call_with_timeout
from ._values import DistributedValues, Mirrored, PerReplica

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ._backends import ArrayBackend
    from ._strategy import MirroredStrategy

__all__ = ["Choice", "CommunicationOptions", "Communicator", "CrossWorkerStage", "ReduceOp"]

#: Pack size when ``CommunicationOptions.bytes_per_pack`` is 0 (let aioreplica choose).
_DEFAULT_PACK_BYTES: Final = 4 << 20


class Choice(enum.StrEnum):
    """A string enum whose ``parse`` takes a member or its value in any case.

    The base of ``ReduceOp``, ``VariableSynchronization`` and ``VariableAggregation``: each
    member's value is its name in lower case, so names and values both parse.
    """

    @classmethod
    def parse(cls, value: Self | str) -> Self:
        """Return ``value`` as a member; strings are matched without regard to case.

        Raises:
            ValueError: ``value`` names no member; the message lists the valid ones.

        Example:
            >>> ReduceOp.parse("MEAN")
            <ReduceOp.MEAN: 'mean'>
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        what = re.sub(r"(?<!^)(?=[A-Z])", " ", cls.__name__).lower()  # ReduceOp: "reduce op"
        valid = ", ".join(repr(member.value) for member in cls)
        raise ValueError(f"unknown {what} {value!r}: use a {cls.__name__} or one of {valid}")


class ReduceOp(Choice):
    """How values are combined across replicas. Strings (``"sum"``, ...) are accepted too.

    Example:
        >>> ReduceOp.parse("mean")
        <ReduceOp.MEAN: 'mean'>
    """

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PROD = "prod"


@dataclass(frozen=True, slots=True)
class CommunicationOptions:
    """How collectives communicate; given to a strategy, or to one call to override it.

    Attributes:
        bytes_per_pack: small tensors are fused into packs of at most this many bytes and
            reduced together; 0 lets aioreplica choose (4 MiB).
        timeout_seconds: how long replicas wait at a collective for the others before the run
            fails with ``ReplicaSyncError`` naming the late replicas; ``None`` waits.

    Raises:
        ValueError: a negative ``bytes_per_pack`` or a non-positive ``timeout_seconds``.

    Example:
        >>> CommunicationOptions(bytes_per_pack=1 << 20, timeout_seconds=30.0).bytes_per_pack
        1048576
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise ValueError(
                f"bytes_per_pack must be an int >= 0 (0: automatic), got {self.bytes_per_pack!r}"
            )
        timeout = self.timeout_seconds
        if timeout is not None and not (
            isinstance(timeout, int | float) and timeout > 0 and not math.isnan(timeout)
        ):
            raise ValueError(f"timeout_seconds must be positive or None, got {timeout!r}")

    def override(self, other: CommunicationOptions | None) -> CommunicationOptions:
        """These options with the fields that ``other`` sets (non-default) taking precedence.

        Example:
            >>> CommunicationOptions(bytes_per_pack=1024).override(
            ...     CommunicationOptions(timeout_seconds=5.0)
            ... )
            CommunicationOptions(bytes_per_pack=1024, timeout_seconds=5.0)
        """
        if other is None:
            return self
        return CommunicationOptions(
            bytes_per_pack=other.bytes_per_pack or self.bytes_per_pack,
            timeout_seconds=(
                other.timeout_seconds if other.timeout_seconds is not None else self.timeout_seconds
            ),
        )


class CrossWorkerStage(Protocol):
    """Where several workers (processes) combine their local results: the MPI seam.

    ``all_reduce`` receives this worker's local result (already reduced over its replicas
    with ``op``, which is never ``"mean"``) and returns the result over every worker.
    """

    @property
    def num_workers(self) -> int: ...

    async def all_reduce(self, op: str, local: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class _Leaf:
    """One leaf of a collective's value: where it is, and its component on each replica."""

    path: _tree.KeyPath
    components: list[Any]


class Communicator:
    """Runs the collectives of one strategy (``strategy.extended.communicator``)."""

    def __init__(
        self,
        strategy: MirroredStrategy,
        devices: Sequence[Device],
        options: CommunicationOptions,
    ) -> None:
        self._strategy = strategy
        self._devices = tuple(devices)
        self._backend: ArrayBackend = devices[0].backend
        self.options = options
        #: Set by a multi-worker strategy: combines local results across workers.
        self.cross_worker: CrossWorkerStage | None = None

    # -- replica context ------------------------------------------------------------------

    async def all_reduce(
        self,
        ctx: ReplicaContext,
        op: ReduceOp | str,
        value: Any,
        options: CommunicationOptions | None,
    ) -> Any:
        op = ReduceOp.parse(op)
        opts = self.options.override(options)
        return await merge_call_with_timeout(
            ctx, self._merge_all_reduce, (op, value, opts), opts.timeout_seconds
        )

    async def all_gather(
        self, ctx: ReplicaContext, value: Any, axis: int, options: CommunicationOptions | None
    ) -> Any:
        opts = self.options.override(options)
        return await merge_call_with_timeout(
            ctx, self._merge_all_gather, (value, axis), opts.timeout_seconds
        )

    async def broadcast(
        self,
        ctx: ReplicaContext,
        value: Any,
        source_replica: int,
        options: CommunicationOptions | None,
    ) -> Any:
        size = len(self._devices)
        if not isinstance(source_replica, int) or not 0 <= source_replica < size:
            raise ValueError(
                f"source_replica must be a replica id from 0 to {size - 1}, got {source_replica!r}"
            )
        opts = self.options.override(options)
        return await merge_call_with_timeout(
            ctx, self._merge_broadcast, (value, source_replica), opts.timeout_seconds
        )

    async def reduce_scatter(
        self,
        ctx: ReplicaContext,
        op: ReduceOp | str,
        value: Any,
        axis: int,
        options: CommunicationOptions | None,
    ) -> Any:
        op = ReduceOp.parse(op)
        opts = self.options.override(options)
        return await merge_call_with_timeout(
            ctx, self._merge_reduce_scatter, (op, value, axis, opts), opts.timeout_seconds
        )

    async def barrier(self, ctx: ReplicaContext, options: CommunicationOptions | None) -> None:
        opts = self.options.override(options)
        await merge_call_with_timeout(ctx, _barrier, (), opts.timeout_seconds)

    # The merge functions: run once per collective, in cross-replica context.

    async def _merge_all_reduce(
        self, strategy: MirroredStrategy, op: Any, value: Any, opts: Any
    ) -> Any:
        op, opts = _agreed(op), _agreed(opts)
        leaves, treedef = self._leaves("all_reduce", value)
        self._check_same_shapes("all_reduce", leaves)
        _check_op(op, leaves)
        results = await self._reduce_leaves(op, leaves, opts)
        return treedef.unflatten([_mirrored(r) for r in results])

    async def _merge_all_gather(self, strategy: MirroredStrategy, value: Any, axis: Any) -> Any:
        axis = _agreed(axis)
        leaves, treedef = self._leaves("all_gather", value)
        gathered = []
        for leaf in leaves:
            axis_ = self._check_gather_shapes("all_gather", leaf, axis)
            gathered.append(
                _mirrored(await self._backend.all_gather(leaf.components, axis_, self._devices))
            )
        return treedef.unflatten(gathered)

    async def _merge_broadcast(self, strategy: MirroredStrategy, value: Any, source: Any) -> Any:
        source = _agreed(source)
        leaves, treedef = self._leaves("broadcast", value)
        results = [
            _mirrored(await self._backend.broadcast(leaf.components[source], self._devices))
            for leaf in leaves
        ]
        return treedef.unflatten(results)

    async def _merge_reduce_scatter(
        self,
        strategy: MirroredStrategy,
        op: Any,
        value: Any,
        axis: Any,
        opts: Any,
    ) -> Any:
        op, axis, opts = _agreed(op), _agreed(axis), _agreed(opts)
        leaves, treedef = self._leaves("reduce_scatter", value)
        self._check_same_shapes("reduce_scatter", leaves)
        _check_op(op, leaves)
        for leaf in leaves:
            _check_axis("reduce_scatter", leaf, axis)
        results = await self._reduce_leaves(op, leaves, opts)
        size = len(self._devices)
        scattered = []
        for replicas in results:
            parts = [
                self._devices[i].xp.array_split(replicas[i], size, axis=axis)[i]
                for i in range(size)
            ]
            scattered.append(PerReplica(parts) if size > 1 else parts[0])
        return treedef.unflatten(scattered)

    # -- cross-replica context ------------------------------------------------------------

    async def reduce(self, op: ReduceOp | str, value: Any, axis: int | None) -> Any:
        op = ReduceOp.parse(op)
        self._check_cross_replica("reduce")
        leaves, treedef = self._leaves("reduce", value)
        if axis is None:
            self._check_same_shapes("reduce", leaves)
            _check_op(op, leaves)
            results = await self._reduce_leaves(op, leaves, self.options)
            return treedef.unflatten([replicas[0] for replicas in results])
        _check_op(op, leaves)
        return treedef.unflatten([await self._reduce_along(op, leaf, axis) for leaf in leaves])

    async def gather(self, value: Any, axis: int) -> Any:
        self._check_cross_replica("gather")
        leaves, treedef = self._leaves("gather", value)
        gathered = []
        for leaf in leaves:
            axis_ = self._check_gather_shapes("gather", leaf, axis)
            whole = await self._backend.all_gather(leaf.components, axis_, self._devices)
            gathered.append(whole[0])
        return treedef.unflatten(gathered)

    async def reduce_to(
        self,
        op: ReduceOp | str,
        value: Any,
        destinations: Any,
        options: CommunicationOptions | None,
    ) -> Any:
        return (await self.batch_reduce_to(op, [(value, destinations)], options))[0]

    async def batch_reduce_to(
        self,
        op: ReduceOp | str,
        pairs: Sequence[tuple[Any, Any]],
        options: CommunicationOptions | None,
    ) -> list[Any]:
        op = ReduceOp.parse(op)
        self._check_cross_replica("batch_reduce_to")
        targets = [self._destinations(destinations) for _, destinations in pairs]
        leaves, treedef = self._leaves("batch_reduce_to", [value for value, _ in pairs])
        self._check_same_shapes("batch_reduce_to", leaves)
        _check_op(op, leaves)
        results = await self._reduce_leaves(op, leaves, self.options.override(options))
        # Each destination takes the result the backend left on its own device (ordered
        # there by the backend), not a copy of replica 0's.
        index = {device.name: i for i, device in enumerate(self._devices)}
        per_pair = [len(_tree.flatten(value)[0]) for value, _ in pairs]
        placed: list[Any] = []
        start = 0
        for count, devices in zip(per_pair, targets, strict=True):
            for replicas in results[start : start + count]:
                chosen = [replicas[index[device.name]] for device in devices]
                placed.append(chosen[0] if len(chosen) == 1 else _mirrored(chosen))
            start += count
        return list(treedef.unflatten(placed))

    async def broadcast_to(self, value: Any, destinations: Any) -> Any:
        self._check_cross_replica("broadcast_to")
        devices = self._destinations(destinations)
        leaves, treedef = _tree.flatten(value)
        placed = []
        for leaf in leaves:
            results = await self._backend.broadcast(devices[0].asarray(leaf), devices)
            placed.append(results[0] if len(devices) == 1 else _mirrored(results))
        return treedef.unflatten(placed)

    # -- the core -------------------------------------------------------------------------

    def _leaves(self, what: str, value: Any) -> tuple[list[_Leaf], _tree.TreeDef]:
        """Split a (regrouped) value into leaves with one array per replica, on its device."""
        size = len(self._devices)
        pairs, treedef = _tree.flatten_with_path(value)
        leaves = []
        for path, leaf in pairs:
            if isinstance(leaf, DistributedValues):
                if len(leaf.values) != size:
                    raise ValueError(
                        f"{what}: the value at {_tree.describe_path(path)} is a "
                        f"{type(leaf).__name__} of {len(leaf.values)} values, but the strategy "
                        f"has {size} replicas"
                    )
                components = list(leaf.values)
            else:
                components = [leaf] * size
            leaves.append(_Leaf(path, self._to_arrays(what, path, components)))
        return leaves, treedef

    def _to_arrays(self, what: str, path: _tree.KeyPath, components: list[Any]) -> list[Any]:
        backend = self._backend
        kinds = {_array_kind(component) for component in components}
        foreign = kinds - {backend.name, "scalar"}
        if foreign:
            where = _tree.describe_path(path)
            found = ", ".join(
                f"replica {i} passes {type(c).__module__}.{type(c).__name__}"
                for i, c in enumerate(components)
            )
            raise TypeError(
                f"{what}: the value at {where} mixes array types ({found}), but this "
                f"strategy's devices hold {backend.name} arrays; put each value on its "
                "replica's device with ctx.device.asarray(value)"
            )
        return [device.asarray(c) for device, c in zip(self._devices, components, strict=True)]

    def _check_same_shapes(self, what: str, leaves: list[_Leaf]) -> None:
        for leaf in leaves:
            first = leaf.components[0]
            for replica, other in enumerate(leaf.components[1:], start=1):
                if other.shape != first.shape or other.dtype != first.dtype:
                    raise ValueError(
                        f"{what}: replica {replica}'s value at {_tree.describe_path(leaf.path)} "
                        f"has shape {tuple(other.shape)} and dtype {other.dtype}, replica 0's "
                        f"has shape {tuple(first.shape)} and dtype {first.dtype}; every replica "
                        "must pass the same shape and dtype"
                    )

    def _check_gather_shapes(self, what: str, leaf: _Leaf, axis: int) -> int:
        first = leaf.components[0]
        axis_ = _check_axis(what, leaf, axis)
        for replica, other in enumerate(leaf.components[1:], start=1):
            same_rest = other.ndim == first.ndim and all(
                a == b
                for d, (a, b) in enumerate(zip(other.shape, first.shape, strict=True))
                if d != axis_
            )
            if not same_rest or other.dtype != first.dtype:
                raise ValueError(
                    f"{what}: replica {replica}'s value at {_tree.describe_path(leaf.path)} has "
                    f"shape {tuple(other.shape)} and dtype {other.dtype}, replica 0's has shape "
                    f"{tuple(first.shape)} and dtype {first.dtype}; they may differ only along "
                    f"axis {axis}"
                )
        return axis_

    async def _reduce_leaves(
        self, op: ReduceOp, leaves: list[_Leaf], opts: CommunicationOptions
    ) -> list[list[Any]]:
        """Reduce every leaf across replicas; small leaves of one dtype go in packs.

        Returns, per leaf, one result per replica.
        """
        limit = opts.bytes_per_pack or _DEFAULT_PACK_BYTES
        results: list[list[Any] | None] = [None] * len(leaves)
        packs: dict[Any, list[list[int]]] = {}
        filled: dict[Any, int] = {}  # bytes in the last pack of each dtype
        for index, leaf in enumerate(leaves):
            first = leaf.components[0]
            if first.nbytes >= limit:
                results[index] = await self._reduce_arrays(op.value, leaf.components)
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
                    results[group[0]] = await self._reduce_arrays(
                        op.value, leaves[group[0]].components
                    )
                else:
                    for index, reduced in zip(
                        group, await self._reduce_pack(op, [leaves[i] for i in group]), strict=True
                    ):
                        results[index] = reduced
        assert all(result is not None for result in results)
        return results  # type: ignore[return-value]

    async def _reduce_pack(self, op: ReduceOp, group: list[_Leaf]) -> list[list[Any]]:
        """Fuse the leaves of each replica into one flat buffer, reduce it, split it back."""
        packed = []
        for r, device in enumerate(self._devices):
            parts = [leaf.components[r].reshape(-1) for leaf in group]
            packed.append(await _on(device, device.xp.concatenate, parts))
        reduced = await self._reduce_arrays(op.value, packed)
        shapes = [leaf.components[0].shape for leaf in group]
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

    async def _reduce_arrays(self, op: str, inputs: list[Any]) -> list[Any]:
        """Reduce one array per replica: locally, then across workers where there are any."""
        cross = self.cross_worker
        if cross is None:
            return await self._backend.all_reduce(op, inputs, self._devices)
        local_op = "sum" if op == "mean" else op
        local = await self._backend.all_reduce(local_op, inputs, self._devices)
        combined = await cross.all_reduce(local_op, local[0])
        if op == "mean":
            combined = await _on(
                self._devices[0], _divide, combined, len(inputs) * cross.num_workers
            )
        return await self._backend.broadcast(combined, self._devices)

    async def _reduce_along(self, op: ReduceOp, leaf: _Leaf, axis: int) -> Any:
        """``strategy.reduce`` with ``axis``: within each replica, then across replicas.

        ``MEAN`` divides the total by the number of elements along ``axis`` over all replicas,
        so short and empty batches weigh what they hold.
        """
        axis_ = self._check_gather_shapes("reduce", leaf, axis)
        inner = {"sum": "sum", "mean": "sum", "max": "max", "min": "min", "prod": "prod"}[op]
        empty = [component.shape[axis_] == 0 for component in leaf.components]
        if op in (ReduceOp.MAX, ReduceOp.MIN) and all(empty):
            raise ValueError(
                f"reduce: every replica's value at {_tree.describe_path(leaf.path)} is empty "
                f"along axis {axis}, so {op.name} has nothing to reduce"
            )
        partials = [
            await _on(device, _partial, device.xp, inner, component, axis_)
            for device, component in zip(self._devices, leaf.components, strict=True)
        ]
        # Across replicas through the backend, which orders the devices' streams.
        result = (await self._reduce_arrays(inner, partials))[0]
        if op is ReduceOp.MEAN:
            count = sum(component.shape[axis_] for component in leaf.components)
            result = await _on(self._devices[0], _divide, result, count)
        return result

    def _destinations(self, destinations: Any) -> tuple[Device, ...]:
        """TF's destinations: a device name or object, a list of them, or a distributed value
        (meaning the strategy's own devices)."""
        if destinations is None or isinstance(destinations, DistributedValues):
            return self._devices
        items = destinations if isinstance(destinations, list | tuple) else [destinations]
        by_name = {device.name: device for device in self._devices}
        devices = []
        for item in items:
            if isinstance(item, str):  # the strategy's own names as they are, else any spelling
                name = item if item in by_name else canonical_device_name(item)
            elif isinstance(item, Device):  # a Protocol check: slow, so strings go first
                name = item.name
            else:
                name = canonical_device_name(item)
            if name not in by_name:
                raise ValueError(
                    f"destination {item!r} is not one of this strategy's devices {list(by_name)}"
                )
            devices.append(by_name[name])
        if not devices:
            raise ValueError("destinations must name at least one device")
        return tuple(devices)

    def _check_cross_replica(self, what: str) -> None:
        replica = context_state.get().replica
        if replica is not None:
            raise RuntimeError(
                f"strategy.{what}() was called inside replica "
                f"{replica.replica_id_in_sync_group}; it works on distributed values in "
                "cross-replica context: call it on run()'s result, or use the replica "
                f"context's collectives (ctx.all_reduce, ctx.all_gather) inside the step"
            )


def _barrier(strategy: MirroredStrategy) -> None:
    return None


def _agreed(setting: Any) -> Any:
    """A collective's setting (op, axis, options) as the replicas passed it.

    Replicas that build equal settings as separate objects arrive regrouped as a
    ``PerReplica``; replica 0's stands for all (they must agree, as in TF).
    """
    return setting.values[0] if isinstance(setting, DistributedValues) else setting


async def _on(device: Device, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run array work of one replica's values with its device (and CUDA stream) current.

    Merge functions run on the loop thread with no replica's device current; on a GPU that
    would launch kernels on whatever device is current, unordered with the replicas' streams.
    Host devices have no current device, and this small work is cheaper inline than handed to a
    worker thread.
    """
    if device.has_context:
        return await device.run(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def _partial(xp: Any, inner: str, component: Any, axis: int) -> Any:
    """One replica's reduction along ``axis``; an empty batch gives the op's identity, so it
    changes nothing when the replicas' partials are combined."""
    if component.shape[axis] or inner in ("sum", "prod"):
        return getattr(xp, inner)(component, axis=axis)
    shape = component.shape[:axis] + component.shape[axis + 1 :]
    dtype = component.dtype
    if dtype.kind == "f":
        identity: Any = -xp.inf if inner == "max" else xp.inf
    elif dtype.kind in "iu":
        info = xp.iinfo(dtype)
        identity = info.min if inner == "max" else info.max
    else:  # bool
        identity = inner == "min"
    return xp.full(shape, identity, dtype=dtype)


def _divide(value: Any, by: int) -> Any:
    if by == 0:
        return value * float("nan")  # nothing to average: NaN, as np.mean of nothing
    return value / by


def _mirrored(results: list[Any]) -> Any:
    """One result per replica as a leaf of a merge result: shared object, else ``Mirrored``."""
    first = results[0]
    if all(result is first for result in results):
        return first
    return Mirrored(results)


def _array_kind(value: object) -> str:
    module = type(value).__module__.partition(".")[0]
    if module == "numpy" and hasattr(value, "shape"):
        return "numpy" if type(value).__name__ == "ndarray" else "scalar"
    if module == "cupy":
        return "cupy"
    if isinstance(value, bool | int | float | complex):
        return "scalar"
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _check_axis(what: str, leaf: _Leaf, axis: int) -> int:
    ndim = leaf.components[0].ndim
    if not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(
            f"{what}: axis {axis!r} is out of range for the value at "
            f"{_tree.describe_path(leaf.path)}, which has {ndim} dimension"
            f"{'' if ndim == 1 else 's'}"
        )
    return int(axis % ndim)


def _check_op(op: ReduceOp, leaves: list[_Leaf]) -> None:
    """Refuse a reduction the dtype cannot do, before anything is computed."""
    for leaf in leaves:
        dtype = leaf.components[0].dtype
        kind = dtype.kind
        where = _tree.describe_path(leaf.path)
        if kind in "biufc" and not (
            (kind == "b" and op not in (ReduceOp.MAX, ReduceOp.MIN))
            or (kind in "iu" and op is ReduceOp.MEAN)
            or (kind == "c" and op in (ReduceOp.MAX, ReduceOp.MIN))
        ):
            continue
        advice = {
            "b": "bool values reduce with MAX (any) or MIN (all); cast to an integer to count",
            "i": "cast to a floating dtype first, or use SUM and divide",
            "u": "cast to a floating dtype first, or use SUM and divide",
            "c": "complex values have no order; reduce their absolute values instead",
        }.get(kind, "only numeric arrays can be reduced")
        raise TypeError(f"cannot {op.name} values of dtype {dtype} (at {where}): {advice}")
