"""Distributed values, and moving between "one tree per replica" and "one tree of values".

A step function runs once per replica, so at a ``merge_call`` the scheduler holds one
structure per replica. :func:`regroup` turns that list into a single structure shaped like
replica 0's whose leaves are ``PerReplica`` (or ``Mirrored``) values, or a plain object when
every replica returned that same object. :func:`select_replica` undoes it for one replica,
which is how each replica gets its own slice of a merge result back.

The values themselves are small frozen dataclasses holding a tuple indexed by replica.
They compare by identity, because their payloads are usually arrays, whose ``==`` is
elementwise and would make value equality meaningless; for the same reason they are
hashable by identity. They do not forward attributes or operators to their contents:
code that wants replica ``i``'s value reads ``.values[i]``.

Containers are walked only through ``aioreplica._tree``, so the rules are the same as
everywhere else: ``None`` is a leaf, mapping keys may come in any order (they are matched
as sets and rebuilt in replica 0's insertion order), container types are kept on rebuild,
and a ``DistributedValues`` is itself a leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, final, overload

from ._tree import describe_path, find_mismatch, flatten, flatten_with_path, is_leaf

__all__ = [
    "DistributedValues",
    "Mirrored",
    "PerReplica",
    "regroup",
    "select_replica",
    "select_replica_mirrored",
]

T = TypeVar("T")


def _check_values(cls_name: str, values: Any) -> tuple[Any, ...]:
    if not isinstance(values, Sequence) or isinstance(values, str | bytes | bytearray):
        raise TypeError(
            f"{cls_name}() needs a list or tuple with one value per replica, "
            f"got {type(values).__name__}"
        )
    if not values:
        raise ValueError(f"{cls_name}() needs a value for at least one replica, got none")
    return tuple(values)


@dataclasses.dataclass(frozen=True, slots=True, eq=False, repr=False)
class DistributedValues(Generic[T]):
    """One value per replica; the base class of :class:`PerReplica` and :class:`Mirrored`.

    Subclasses that add no fields pass ``init=False`` to the dataclass decorator, so they
    keep this constructor, which accepts any sequence (and type checkers know it).

    Attributes:
        values: The values, indexed by replica id. The constructor accepts a list or a
            tuple and stores a tuple.

    Raises:
        TypeError: `values` is not a list or tuple (a string, a generator, a scalar, ...).
        ValueError: `values` is empty.

    Example:
        >>> PerReplica([1, 2])
        PerReplica({0: 1, 1: 2})
        >>> PerReplica([1, 2]).values[1]
        2
    """

    values: tuple[T, ...]

    if TYPE_CHECKING:
        # The generated __init__ accepts any sequence; __post_init__ makes it a tuple.
        def __init__(self, values: Sequence[T]) -> None: ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", _check_values(type(self).__name__, self.values))

    def __repr__(self) -> str:
        items = ", ".join(f"{i}: {value!r}" for i, value in enumerate(self.values))
        return f"{type(self).__name__}({{{items}}})"


@final
@dataclasses.dataclass(frozen=True, slots=True, eq=False, repr=False, init=False)
class PerReplica(DistributedValues[T]):
    """Values that may differ between replicas, e.g. each replica's loss or gradients.

    Example:
        >>> PerReplica((0.5, 0.25))
        PerReplica({0: 0.5, 1: 0.25})
    """


@final
@dataclasses.dataclass(frozen=True, slots=True, eq=False, repr=False, init=False)
class Mirrored(DistributedValues[T]):
    """Values that are the same on every replica, e.g. the result of an all-reduce.

    Each replica still has its own copy (on its own device), so ``values`` holds one per
    replica.

    Example:
        >>> Mirrored([3.0, 3.0])
        Mirrored({0: 3.0, 1: 3.0})
    """


def regroup(values: Sequence[Any], wrap_class: type[DistributedValues[Any]] = PerReplica) -> Any:
    """Turn one structure per replica into one structure of per-replica values.

    The result has replica 0's structure (its container types and mapping insertion order).
    Every other replica must have the same structure. At each leaf, if every replica holds
    the very same object (``is``), that object is kept as it is; otherwise the leaves are
    wrapped as ``wrap_class(tuple_of_leaves)``. With a single replica nothing is wrapped.

    Args:
        values: One structure per replica, indexed by replica id.
        wrap_class: The class that wraps differing leaves, ``PerReplica`` or ``Mirrored``.

    Returns:
        The regrouped structure, or a single leaf or ``wrap_class`` value.

    Raises:
        TypeError: `values` is not a list or tuple; or two replicas have containers of
            different types at the same key path.
        ValueError: `values` is empty; or a replica has a leaf where replica 0 has a
            container (or the reverse), or a different length or key set. The message
            names both replicas and the key path.

    Example:
        >>> regroup([{"loss": 1.0, "step": 7}, {"step": 7, "loss": 2.0}])
        {'loss': PerReplica({0: 1.0, 1: 2.0}), 'step': 7}
        >>> regroup([[1, 2], [1, 3]], Mirrored)
        [1, Mirrored({0: 2, 1: 3})]
    """
    replicas = _check_values("regroup", values)
    first = replicas[0]
    if is_leaf(first) and all(is_leaf(v) for v in replicas):
        return first if all(v is first for v in replicas) else wrap_class(replicas)
    leaves, treedef = flatten(first)
    per_replica = [leaves]
    for replica_id in range(1, len(replicas)):
        other_leaves, other = flatten(replicas[replica_id])
        if other != treedef:
            _raise_regroup_mismatch(first, replicas[replica_id], replica_id)
        per_replica.append(other_leaves)
    regrouped = []
    for column in zip(*per_replica, strict=True):
        leaf = column[0]
        for other_leaf in column:
            if other_leaf is not leaf:
                regrouped.append(wrap_class(column))
                break
        else:
            regrouped.append(leaf)
    return treedef.unflatten(regrouped)


def _raise_regroup_mismatch(first: Any, other: Any, replica_id: int) -> None:
    found = find_mismatch(first, other, first="replica 0", second=f"replica {replica_id}")
    prefix = f"replica {replica_id}'s value differs from replica 0's"
    if found is None:
        # Only reachable when registered aux data compare unequal to themselves.
        raise ValueError(f"{prefix}: {flatten(other)[1]!r} against {flatten(first)[1]!r}")
    exc, path, message = found
    raise exc(
        f"{prefix} at {describe_path(path)}: {message}; every replica must return the "
        "same structure"
    )


def _select(value: DistributedValues[Any], replica_id: int) -> Any:
    values = value.values
    if 0 <= replica_id < len(values):
        return values[replica_id]
    raise IndexError(
        f"replica_id {replica_id} is out of range for {type(value).__name__} values of "
        f"{len(values)} replica{'' if len(values) == 1 else 's'}"
    )


@overload
def select_replica(replica_id: int, structure: DistributedValues[T]) -> T: ...
@overload
def select_replica(replica_id: int, structure: Any) -> Any: ...
def select_replica(replica_id: int, structure: Any) -> Any:
    """Take replica `replica_id`'s slice of a structure: undo :func:`regroup` for one replica.

    Every ``DistributedValues`` leaf becomes ``.values[replica_id]``; other leaves pass
    through unchanged; containers are rebuilt with their own types.

    Args:
        replica_id: Which replica, from 0.
        structure: A structure that may hold ``PerReplica`` and ``Mirrored`` leaves.

    Returns:
        The structure as replica `replica_id` sees it.

    Raises:
        IndexError: `replica_id` is out of range for a distributed value; the message names
            it and the number of replicas.

    Example:
        >>> merged = regroup([("a", None), ("b", None)])
        >>> merged
        (PerReplica({0: 'a', 1: 'b'}), None)
        >>> select_replica(1, merged)
        ('b', None)
    """
    if isinstance(structure, DistributedValues):
        return _select(structure, replica_id)
    if is_leaf(structure):
        return structure
    leaves, treedef = flatten(structure)
    return treedef.unflatten(
        [_select(x, replica_id) if isinstance(x, DistributedValues) else x for x in leaves]
    )


@overload
def select_replica_mirrored(replica_id: int, structure: Mirrored[T]) -> T: ...
@overload
def select_replica_mirrored(replica_id: int, structure: Any) -> Any: ...
def select_replica_mirrored(replica_id: int, structure: Any) -> Any:
    """Like :func:`select_replica`, but only allow ``Mirrored`` distributed values.

    Use it where every replica must see the same value, e.g. the result of an update.

    Args:
        replica_id: Which replica, from 0.
        structure: A structure whose distributed leaves are all ``Mirrored``.

    Returns:
        The structure as replica `replica_id` sees it.

    Raises:
        TypeError: A distributed leaf is not ``Mirrored``; the message names its key path
            and type.
        IndexError: `replica_id` is out of range for a distributed value.

    Example:
        >>> select_replica_mirrored(0, {"w": Mirrored([1.5, 1.5]), "lr": 0.1})
        {'w': 1.5, 'lr': 0.1}
    """
    if isinstance(structure, Mirrored):
        return _select(structure, replica_id)
    if is_leaf(structure) and not isinstance(structure, DistributedValues):
        return structure
    leaves, treedef = flatten(structure)
    selected = []
    for x in leaves:
        if isinstance(x, Mirrored):
            selected.append(_select(x, replica_id))
        elif isinstance(x, DistributedValues):
            _raise_not_mirrored(structure, x)
        else:
            selected.append(x)
    return treedef.unflatten(selected)


def _raise_not_mirrored(structure: Any, bad: DistributedValues[Any]) -> None:
    pairs, _ = flatten_with_path(structure)
    path = next(path for path, leaf in pairs if leaf is bad)
    raise TypeError(
        f"select_replica_mirrored() expected Mirrored values or plain leaves, got "
        f"{type(bad).__name__} at {describe_path(path)}; use select_replica() for values "
        "that differ between replicas"
    )
