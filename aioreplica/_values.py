"""Distributed values, and moving between "one tree per replica" and "one tree of values".

A step function runs once per replica, so at a ``merge_call`` the scheduler holds one
structure per replica. :func:`regroup` turns that list into a single structure shaped like
replica 0's whose leaves are ``PerReplica`` (or ``Mirrored``) values, or a plain object when
every replica returned that same object. :func:`select_replica` undoes it for one replica,
which is how each replica gets its own slice of a merge result back.

The values themselves are small frozen dataclasses holding a tuple indexed by replica.
They compare by identity, because their payloads are usually arrays, whose ``==`` is
elementwise and would make value equality meaningless; for the same reason they are
hashable by identity. They do not forward attributes to their contents: code that wants
replica ``i``'s value reads ``.values[i]``. A ``Mirrored`` value, one value on every
replica, computes as that value (operators, indexing, NumPy's functions and ufuncs); a
``PerReplica`` has no one value, so NumPy refuses to convert it.

Containers are walked only through ``aioreplica._tree``, so the rules are the same as
everywhere else: ``None`` is a leaf, mapping keys may come in any order (they are matched
as sets and rebuilt in replica 0's insertion order), container types are kept on rebuild,
and a ``DistributedValues`` is itself a leaf.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Generic, NoReturn, TypeVar, final, overload

import numpy as np

from ._errors import ReplicaSyncError, as_integer, checked_integer, replica_list
from ._tree import (
    all_leaves,
    describe_path,
    find_mismatch,
    flatten,
    flatten_with_path,
    format_path,
    is_leaf,
)

__all__ = [
    "DistributedValues",
    "Mirrored",
    "PerReplica",
    "agreed",
    "misfit",
    "out_argument",
    "register_current_replica",
    "regroup",
    "select_replica",
    "select_replica_mirrored",
    "select_replicas",
    "shown_misfit",
    "structure_mismatch",
    "writes_first_argument",
]

T = TypeVar("T")


def _check_values(cls_name: str, values: Any) -> tuple[Any, ...]:
    if type(values) is tuple and values:
        return values  # the common cases, before the Sequence check (an ABC, so slower)
    if type(values) is list and values:
        return tuple(values)
    if not isinstance(values, Sequence) or isinstance(values, str | bytes | bytearray):
        raise TypeError(
            f"{cls_name}() needs a list or tuple with one value per replica, "
            f"got {type(values).__name__}"
        )
    if not values:
        raise ValueError(f"{cls_name}() needs a value for at least one replica, got none")
    return tuple(values)


def _refuse_setattr(self: DistributedValues[Any], name: str, value: Any) -> NoReturn:
    """Refuse every attribute write: a distributed value never changes after it is made."""
    raise dataclasses.FrozenInstanceError(
        f"cannot assign to {name!r} of a {type(self).__name__}: distributed values are "
        f"immutable; make a new {type(self).__name__} instead"
    )


def _refuse_delattr(self: DistributedValues[Any], name: str) -> NoReturn:
    """Refuse every attribute deletion, as ``_refuse_setattr`` refuses writes."""
    raise dataclasses.FrozenInstanceError(
        f"cannot delete {name!r} of a {type(self).__name__}: distributed values are immutable"
    )


_Frozen = TypeVar("_Frozen", bound=type)


def _immutable(cls: _Frozen) -> _Frozen:
    """``cls`` (a frozen slots dataclass) with ``__setattr__`` and ``__delattr__`` that refuse
    every name. The ones the dataclass decorator makes refer to the class it replaced to add
    the slots (CPython 3.11), so a write of any name but a field's raised a ``TypeError`` from
    ``super()`` instead of ``FrozenInstanceError`` (an ``AttributeError``), and so did
    ``PerReplica[float](...)``, whose typing alias sets ``__orig_class__`` on the instance
    and expects an ``AttributeError`` where it cannot."""
    type.__setattr__(cls, "__setattr__", _refuse_setattr)
    type.__setattr__(cls, "__delattr__", _refuse_delattr)
    return cls


@_immutable
@dataclasses.dataclass(frozen=True, slots=True, eq=False, repr=False)
class DistributedValues(Generic[T]):
    """One value per replica; the base class of :class:`PerReplica` and :class:`Mirrored`.

    Subclasses that add no fields pass ``init=False`` to the dataclass decorator, so they
    keep this constructor, which accepts any sequence (and type checkers know it), and are
    decorated with ``_immutable`` above it, as this class is.

    Attributes:
        values: The values, indexed by replica id. The constructor accepts a list or a
            tuple and stores a tuple.

    Raises:
        TypeError: `values` is not a list or tuple (a string, a generator, a scalar, ...).
        ValueError: `values` is empty.
        AttributeError: an attribute is set or deleted (``dataclasses.FrozenInstanceError``):
            a distributed value never changes.

    Example:
        >>> PerReplica([1, 2])
        PerReplica({0: 1, 1: 2})
        >>> PerReplica([1, 2]).values[1]
        2
        >>> PerReplica[float]([0.5, 1.5])
        PerReplica({0: 0.5, 1: 1.5})
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

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        """Refused (so NumPy's functions and ufuncs refuse it too): there is no one value to
        compute with, and ``np.asarray(x)`` would be a 0-d array of objects holding ``x``."""
        n = len(self.values)
        raise TypeError(
            f"a {type(self).__name__} holds {n} value{'' if n == 1 else 's'}, one per replica, "
            "so NumPy cannot convert it to one array; reduce it first (strategy.reduce), or "
            "take one replica's value (.values[i], strategy.experimental_local_results)"
        )


@final
@_immutable
@dataclasses.dataclass(frozen=True, slots=True, eq=False, repr=False, init=False)
class PerReplica(DistributedValues[T]):
    """Values that may differ between replicas, e.g. each replica's loss or gradients.

    It has no one value to compute with: operators and NumPy refuse it.

    Raises:
        TypeError: converted by NumPy (``np.asarray(x)``, ``np.mean(x)``); the message says
            to reduce it or to take one replica's value.

    Example:
        >>> PerReplica((0.5, 0.25))
        PerReplica({0: 0.5, 1: 0.25})
    """


def _operand(value: Any) -> Any:
    """What a ``Mirrored`` operator computes with for its other operand ``value``: a
    ``Mirrored``'s value, ``NotImplemented`` for any other distributed value (a
    ``PerReplica`` has no one value to compute with), else ``value`` itself."""
    if isinstance(value, Mirrored):
        return value._value()
    if isinstance(value, DistributedValues):
        return NotImplemented
    return value


def _delegate(name: str, reflected: bool = False) -> Any:
    """A ``Mirrored`` operator computing ``name`` on its value (see ``Mirrored._value``)."""
    op = getattr(operator, name)

    def method(self: Mirrored[Any], other: Any) -> Any:
        other = _operand(other)
        if other is NotImplemented:
            return NotImplemented
        mine = self._value()
        return op(other, mine) if reflected else op(mine, other)

    method.__name__ = f"__r{name.strip('_')}__" if reflected else name
    return method


def _pow(self: Mirrored[Any], other: Any, modulo: Any = None) -> Any:
    """``m ** x`` and ``pow(m, x, modulo)``, computed with ``m``'s value."""
    other, modulo = _operand(other), _operand(modulo)
    if other is NotImplemented or modulo is NotImplemented:
        return NotImplemented
    mine = self._value()
    return pow(mine, other) if modulo is None else pow(mine, other, modulo)


def _unwrapped(value: Any) -> Any:
    """``value`` with each ``Mirrored`` in it (or in a list or tuple in it: what NumPy's
    functions take) replaced by its value, for NumPy's dispatch."""
    if isinstance(value, Mirrored):
        return value._value()
    if type(value) is list or type(value) is tuple:
        return type(value)(_unwrapped(item) for item in value)
    return value


def _check_out(out: Any, func: Any) -> None:
    """Refuse a distributed value as the ``out=`` of a NumPy function or ufunc ``func``.

    Raises:
        TypeError: ``out`` is (or holds) a ``DistributedValues``.
    """
    outs = out if type(out) is tuple else (out,)
    for target in outs:
        if isinstance(target, DistributedValues):
            raise TypeError(
                f"a {type(target).__name__} value cannot be the out= of "
                f"{getattr(func, '__name__', func)}: writing into one replica's copy would "
                "make the copies differ; compute a new value (without out=) instead"
            )


def _check_in_place(target: Any, what: str) -> None:
    """Refuse a distributed value as the array that ``what`` (``"copyto"``, ``"add.at"``)
    writes into in place.

    Raises:
        TypeError: ``target`` is a ``DistributedValues``.
    """
    if isinstance(target, DistributedValues):
        raise TypeError(
            f"a {type(target).__name__} value cannot be written in place by {what}: writing "
            "into one replica's copy would make the copies differ (and host replicas share "
            "one array); compute a new value instead (np.array(m) is a copy to write into)"
        )


#: NumPy's functions that write into their first argument.
_WRITE_FIRST: Final = frozenset(
    {np.copyto, np.put, np.place, np.putmask, np.put_along_axis, np.fill_diagonal}
)


@functools.cache
def _out_position(func: Any) -> int | None:
    """The position at which NumPy function ``func`` also takes its ``out`` argument, or
    ``None`` (no such argument, or keyword-only)."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # no signature to read: nothing to find by position
        return None
    for position, parameter in enumerate(parameters):
        if parameter.name == "out":
            return position if parameter.kind is parameter.POSITIONAL_OR_KEYWORD else None
    return None


def writes_first_argument(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether the NumPy function call ``func(*args, **kwargs)`` writes into its first
    argument: ``np.copyto``, ``np.put``, ``np.place``, ``np.putmask``, ``np.put_along_axis``,
    ``np.fill_diagonal``, and ``np.nan_to_num`` with ``copy=False``. With ``out_argument``,
    the rule by which distributed values and variables refuse to be written by NumPy.

    Example:
        >>> writes_first_argument(np.copyto, ("x", "y"), {})
        True
        >>> writes_first_argument(np.nan_to_num, ("x",), {})
        False
        >>> writes_first_argument(np.nan_to_num, ("x", False), {})
        True
    """
    if func is np.nan_to_num:
        return not kwargs.get("copy", args[1] if len(args) > 1 else True)
    return func in _WRITE_FIRST


def out_argument(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The ``out`` argument of the NumPy function call ``func(*args, **kwargs)``, by keyword
    or by position, or ``None``.

    Example:
        >>> out_argument(np.mean, ("x",), {"out": "y"})
        'y'
        >>> out_argument(np.mean, ("x", 0, None, "y"), {})
        'y'
        >>> out_argument(np.mean, ("x",), {}) is None
        True
    """
    out = kwargs.get("out")
    if out is None:
        position = _out_position(func)
        if position is not None and position < len(args):
            out = args[position]
    return out


def _delegate_unary(name: str) -> Any:
    op = getattr(operator, name)

    def method(self: Mirrored[Any]) -> Any:
        return op(self._value())

    method.__name__ = name
    return method


@final
@_immutable
@dataclasses.dataclass(frozen=True, slots=True, eq=False, repr=False, init=False)
class Mirrored(DistributedValues[T]):
    """Values that are the same on every replica, e.g. the result of an all-reduce.

    Each replica still has its own copy (on its own device), so ``values`` holds one per
    replica. As TF's, it computes as its value: arithmetic (``m + 1``, ``2 * m``, ``m @ x``,
    ``-m``, ``pow(m, 3, 10)``), comparisons other than ``==`` (which stays identity, as for
    every distributed value), indexing (``m[1]``), ``float(m)``, ``int(m)``, ``np.asarray(m)``
    and NumPy's functions and ufuncs (``np.mean(m)``) use the current replica's copy in a
    replica, else replica 0's. Attributes are not forwarded (``m.shape`` is an
    ``AttributeError``): ``np.shape(m)``, or ``m.values[i]`` for a copy.

    Raises:
        TypeError: computed with a ``PerReplica`` (which has no one value), given as
            the ``out=`` of a NumPy function or ufunc, or written in place by NumPy
            (``np.copyto(m, x)``, ``np.put(m, i, x)``, ``np.add.at(m, i, x)``); and as its
            value raises.

    Example:
        >>> Mirrored([3.0, 3.0])
        Mirrored({0: 3.0, 1: 3.0})
        >>> Mirrored([3.0, 3.0]) * 2
        6.0
        >>> m = Mirrored([np.arange(3.0), np.arange(3.0)])
        >>> float(np.mean(m)), float(m[1]), np.asarray(m)
        (1.0, 1.0, array([0., 1., 2.]))
    """

    def _value(self) -> T:
        """The copy this code computes with: the current replica's, else replica 0's."""
        index = _current_replica()
        values = self.values
        return values[index] if index is not None and index < len(values) else values[0]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        """Its value as a NumPy array (``dtype`` and ``copy`` as NumPy passes them)."""
        value: Any = self._value()
        if copy is None:  # NumPy 1 passes no copy
            return np.asarray(value, dtype=dtype)
        return np.array(value, dtype=dtype, copy=copy)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """A ufunc (``np.add(m, 1)``, ``np.ones(2) + m``, ``np.sum(m)``) of its value; but
        ``==`` and ``!=`` stay identity, as for every distributed value, when NumPy asks
        (``np.zeros(3) == m``, ``m in [array, m]``)."""
        if (ufunc is np.equal or ufunc is np.not_equal) and method == "__call__":
            same = len(inputs) == 2 and inputs[0] is inputs[1]
            return same if ufunc is np.equal else not same
        _check_out(kwargs.get("out"), ufunc)
        if method == "at":  # ufunc.at writes into its first operand, read-only or not
            _check_in_place(inputs[0], f"{ufunc.__name__}.at")
        return getattr(ufunc, method)(*_unwrapped(inputs), **kwargs)

    def __array_function__(
        self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A NumPy function (``np.mean(m)``, ``np.concatenate([m, x])``) of its value, which
        dispatches as the value does (a CuPy array's to CuPy); refused where it would write
        into a distributed value (``out=m``, ``np.copyto(m, x)``)."""
        _check_out(out_argument(func, args, kwargs), func)
        if writes_first_argument(func, args, kwargs):
            _check_in_place(args[0], func.__name__)
        return func(*_unwrapped(args), **{k: _unwrapped(v) for k, v in kwargs.items()})

    def __getitem__(self, key: Any) -> Any:
        """``m[key]``: an item or slice of its value, as TF's ``DistributedDelegate``."""
        value: Any = self._value()
        return value[key]

    def __float__(self) -> float:
        value: Any = self._value()
        return float(value)

    def __int__(self) -> int:
        value: Any = self._value()
        return int(value)

    def __format__(self, spec: str) -> str:
        """``f"{m:.4f}"``: its value formatted as the value formats itself (a 0-d array or a
        number with a spec; an array of more dimensions refuses one, as NumPy does); with no
        spec, ``str(m)``."""
        if not spec:
            return str(self)
        value: Any = self._value()
        return format(value, spec)

    __add__, __radd__ = _delegate("__add__"), _delegate("__add__", reflected=True)
    __sub__, __rsub__ = _delegate("__sub__"), _delegate("__sub__", reflected=True)
    __mul__, __rmul__ = _delegate("__mul__"), _delegate("__mul__", reflected=True)
    __truediv__, __rtruediv__ = _delegate("__truediv__"), _delegate("__truediv__", True)
    __floordiv__, __rfloordiv__ = _delegate("__floordiv__"), _delegate("__floordiv__", True)
    __mod__, __rmod__ = _delegate("__mod__"), _delegate("__mod__", reflected=True)
    __pow__, __rpow__ = _pow, _delegate("__pow__", reflected=True)
    __matmul__, __rmatmul__ = _delegate("__matmul__"), _delegate("__matmul__", True)
    __and__, __rand__ = _delegate("__and__"), _delegate("__and__", reflected=True)
    __or__, __ror__ = _delegate("__or__"), _delegate("__or__", reflected=True)
    __xor__, __rxor__ = _delegate("__xor__"), _delegate("__xor__", reflected=True)
    __lt__, __le__ = _delegate("__lt__"), _delegate("__le__")
    __gt__, __ge__ = _delegate("__gt__"), _delegate("__ge__")
    __neg__, __pos__ = _delegate_unary("__neg__"), _delegate_unary("__pos__")
    __abs__, __invert__ = _delegate_unary("__abs__"), _delegate_unary("__invert__")


#: The current replica's index among this process's replicas, or None outside a replica:
#: ``aioreplica._context`` registers it (``register_current_replica``); this layer is below.
def _no_replica() -> int | None:
    return None


_current_replica: Callable[[], int | None] = _no_replica


def register_current_replica(current: Callable[[], int | None]) -> None:
    """Say how ``Mirrored`` finds the current replica (the one registration point)."""
    global _current_replica
    _current_replica = current


def regroup(
    values: Sequence[Any],
    wrap_class: type[DistributedValues[Any]] = PerReplica,
    *,
    first_replica: int = 0,
) -> Any:
    """Turn one structure per replica into one structure of per-replica values.

    The result has replica 0's structure (its container types and mapping insertion order).
    Every other replica must have the same structure. At each leaf, if every replica holds
    the very same object (``is``), that object is kept as it is; otherwise the leaves are
    wrapped as ``wrap_class(tuple_of_leaves)``. With a single replica nothing is wrapped.

    Args:
        values: One structure per replica, indexed by replica id.
        wrap_class: The class that wraps differing leaves, ``PerReplica`` or ``Mirrored``.
        first_replica: the id in sync of ``values[0]``'s replica, by which messages name the
            replicas (a worker of a ``MultiWorkerMirroredStrategy`` holds later ones too).

    Returns:
        The regrouped structure, or a single leaf or ``wrap_class`` value.

    Raises:
        TypeError: `values` is not a list or tuple; `wrap_class` is not a
            ``DistributedValues`` class; `first_replica` is not an int (a bool is not one); or
            two replicas have containers of different types at the same key path.
        ValueError: `values` is empty; `first_replica` is negative; or a replica has a leaf
            where replica 0 has a container (or the reverse), or a different length or key
            set. The message names both replicas and the key path.

    Example:
        >>> regroup([{"loss": 1.0, "step": 7}, {"step": 7, "loss": 2.0}])
        {'loss': PerReplica({0: 1.0, 1: 2.0}), 'step': 7}
        >>> regroup([[1, 2], [1, 3]], Mirrored)
        [1, Mirrored({0: 2, 1: 3})]
    """
    replicas = _check_values("regroup", values)
    if wrap_class is not PerReplica and wrap_class is not Mirrored:
        _check_wrap_class(wrap_class)
    if type(first_replica) is not int or first_replica < 0:
        first_replica = checked_integer(
            first_replica, "regroup(): first_replica must be a replica id, an int >= 0", 0
        )
    first = replicas[0]
    if type(first) in _PLAIN:
        # The common case, merge arguments: tuples, lists and dicts of leaves, walked directly.
        try:
            return _regroup_plain(replicas, wrap_class)
        except _NotPlain:
            pass  # the general walk checks it and names what differs
    return _regroup_tree(replicas, wrap_class, first_replica)


def _check_wrap_class(wrap_class: object) -> None:
    """Refuse a ``wrap_class`` that is no ``DistributedValues`` class.

    Raises:
        TypeError: naming what was given.
    """
    if not (isinstance(wrap_class, type) and issubclass(wrap_class, DistributedValues)):
        raise TypeError(
            "regroup(): wrap_class must be a DistributedValues class (PerReplica or "
            f"Mirrored), got {type(wrap_class).__name__} {wrap_class!r:.60}"
        )


def _regroup_tree(
    replicas: Sequence[Any], wrap_class: type[DistributedValues[Any]], first_replica: int = 0
) -> Any:
    """``regroup`` by the general tree walk: any registered node, mismatches named."""
    first = replicas[0]
    if is_leaf(first) and all(is_leaf(v) for v in replicas):
        return first if all(v is first for v in replicas) else wrap_class(replicas)
    leaves, treedef = flatten(first)
    per_replica = [leaves]
    for replica_id in range(1, len(replicas)):
        other_leaves, other = flatten(replicas[replica_id])
        if other != treedef:
            _raise_regroup_mismatch(first, replicas[replica_id], first_replica, replica_id)
        per_replica.append(other_leaves)
    return treedef.unflatten(
        [_wrap(column, wrap_class) for column in zip(*per_replica, strict=True)]
    )


_PLAIN: Final = frozenset({tuple, list, dict})


class _NotPlain(Exception):
    """A value that the plain-container fast paths leave to the general tree walk."""


def _regroup_plain(column: tuple[Any, ...], wrap_class: type[DistributedValues[Any]]) -> Any:
    """``regroup`` of one value per replica made only of tuples, lists, dicts and leaves.

    Raises:
        _NotPlain: any other container, or replicas whose structures differ.
    """
    first = column[0]
    t = type(first)
    if t is tuple or t is list:
        size = len(first)
        for value in column:
            if type(value) is not t or len(value) != size:
                raise _NotPlain
        return t([_regroup_plain(items, wrap_class) for items in zip(*column, strict=True)])
    if t is dict:
        keys = first.keys()
        for value in column:
            if type(value) is not dict or value.keys() != keys:
                raise _NotPlain
        return {
            key: _regroup_plain(tuple([value[key] for value in column]), wrap_class) for key in keys
        }
    if not all_leaves(column):
        raise _NotPlain
    return _wrap(column, wrap_class)


def _select_plain(structure: Any, replica_id: int) -> Any:
    """``select_replica`` of a structure made only of tuples, lists, dicts and leaves.

    Raises:
        _NotPlain: any other container.
    """
    t = type(structure)
    if t is tuple or t is list:
        return t([_select_plain(x, replica_id) for x in structure])
    if t is dict:
        return {key: _select_plain(x, replica_id) for key, x in structure.items()}
    if isinstance(structure, DistributedValues):
        return _select(structure, replica_id)
    if not is_leaf(structure):
        raise _NotPlain
    return structure


def _wrap(column: tuple[Any, ...], wrap_class: type[DistributedValues[Any]]) -> Any:
    """One leaf of a regrouped structure: the object itself when every replica holds it."""
    leaf = column[0]
    for other_leaf in column:
        if other_leaf is not leaf:
            # A non-empty tuple already: set it as the constructor would, minus its checks.
            wrapped = _new(wrap_class)
            _set_field(wrapped, "values", column)
            return wrapped
    return leaf


_new: Final = object.__new__
_set_field: Final = object.__setattr__  # what a frozen dataclass's own __init__ uses


def _raise_regroup_mismatch(first: Any, other: Any, first_id: int, index: int) -> None:
    """Raise the error for ``other``, the value at ``index``, whose structure differs from
    ``first``'s (the replicas are named by id: the first is ``first_id``)."""
    replica_id = first_id + index
    error = structure_mismatch(first, other, first_id, replica_id)
    if error is None:
        # Only reachable when registered aux data compare unequal to themselves.
        raise ValueError(
            f"replica {replica_id}'s value differs from replica {first_id}'s: "
            f"{flatten(other)[1]!r} against {flatten(first)[1]!r}"
        )
    raise error


def structure_mismatch(
    first: Any, other: Any, first_id: int, other_id: int, *, what: str = "", verb: str = "return"
) -> TypeError | ValueError | None:
    """The error for replica ``other_id``'s value, whose structure differs from replica
    ``first_id``'s (``first``), naming the place; ``None`` where they match. ``what``: the
    call the values were given to, ahead of the message; ``verb``: what every replica must
    do with the same structure (``return`` it, or ``pass`` it to a collective)."""
    found = find_mismatch(first, other, first=f"replica {first_id}", second=f"replica {other_id}")
    if found is None:
        return None
    exc, path, message = found
    ahead = f"{what}: " if what else ""
    return exc(
        f"{ahead}replica {other_id}'s value differs from replica {first_id}'s at "
        f"{describe_path(path)}: {message}; every replica must {verb} the same structure"
    )


def _select(value: DistributedValues[Any], replica_id: int) -> Any:
    values = value.values
    if 0 <= replica_id < len(values):
        return values[replica_id]
    raise IndexError(
        f"replica_id {replica_id} is out of range for {type(value).__name__} values of "
        f"{len(values)} replica{'' if len(values) == 1 else 's'}"
    )


def select_replicas(structure: Any, size: int) -> list[Any] | None:
    """``select_replica(i, structure)`` for every replica ``i`` of ``size``, at once.

    For a structure of tuples, lists, dicts and leaves whose distributed values all have
    ``size`` parts (what merge functions return): one walk instead of one per replica, each
    replica still getting containers of its own. ``None`` for anything else, which
    ``select_replica`` then handles (and reports) one replica at a time.

    Example:
        >>> select_replicas({"loss": PerReplica([1.0, 2.0]), "step": 3}, 2)
        [{'loss': 1.0, 'step': 3}, {'loss': 2.0, 'step': 3}]
    """
    try:
        return _split_plain(structure, size)
    except _NotPlain:
        return None


def misfit(structure: Any, size: int) -> tuple[str, DistributedValues[Any]] | None:
    """The first distributed value in ``structure`` that does not hold ``size`` values, with
    its path as messages show it (``""``: ``structure`` itself), or ``None``.

    Example:
        >>> misfit({"a": PerReplica([1, 2]), "b": PerReplica([1, 2, 3])}, 2)
        ("['b']", PerReplica({0: 1, 1: 2, 2: 3}))
    """
    for path, leaf in flatten_with_path(structure)[0]:
        if isinstance(leaf, DistributedValues) and len(leaf.values) != size:
            return format_path(path), leaf
    return None


def shown_misfit(found: tuple[str, DistributedValues[Any]]) -> str:
    """What ``misfit`` found, for a message: ``a PerReplica of 4 values at ['b']``."""
    where, leaf = found
    return f"a {type(leaf).__name__} of {len(leaf.values)} values{f' at {where}' if where else ''}"


def _split_plain(structure: Any, size: int) -> list[Any]:
    t = type(structure)
    if t is tuple or t is list:
        if not structure:
            return [t() for _ in range(size)]
        columns = [_split_plain(x, size) for x in structure]
        return [t(row) for row in zip(*columns, strict=True)]
    if t is dict:
        if not structure:
            return [{} for _ in range(size)]
        keys = list(structure)
        columns = [_split_plain(structure[key], size) for key in keys]
        return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]
    if isinstance(structure, DistributedValues):
        if len(structure.values) != size:
            raise _NotPlain
        return list(structure.values)
    if not is_leaf(structure):
        raise _NotPlain
    return [structure] * size


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
        TypeError: `replica_id` is not an integer (NumPy's integers are; a bool is not).
        IndexError: `replica_id` is out of range for a distributed value; the message names
            it and the number of replicas.

    Example:
        >>> merged = regroup([("a", None), ("b", None)])
        >>> merged
        (PerReplica({0: 'a', 1: 'b'}), None)
        >>> select_replica(1, merged)
        ('b', None)
    """
    if type(replica_id) is not int:
        replica_id = _replica_id("select_replica", replica_id)
    if type(structure) in _PLAIN:
        try:
            return _select_plain(structure, replica_id)
        except _NotPlain:
            pass
    return _select_tree(structure, replica_id)


def _replica_id(caller: str, replica_id: object) -> int:
    """``replica_id`` as a Python int, or a TypeError (``caller``: for the message).

    Raises:
        TypeError: it is not an integer (a bool is not one).
    """
    index = as_integer(replica_id)
    if index is None:
        raise TypeError(
            f"{caller}(): replica_id must be an int, a replica's id from 0, got "
            f"{type(replica_id).__name__} {replica_id!r:.60}"
        )
    return index


def _select_tree(structure: Any, replica_id: int) -> Any:
    """``select_replica`` by the general tree walk."""
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
            and type. `replica_id` is not an integer (a bool is not one).
        IndexError: `replica_id` is out of range for a distributed value.

    Example:
        >>> select_replica_mirrored(0, {"w": Mirrored([1.5, 1.5]), "lr": 0.1})
        {'w': 1.5, 'lr': 0.1}
    """
    if type(replica_id) is not int:
        replica_id = _replica_id("select_replica_mirrored", replica_id)
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


def agreed(value: Any, what: str, *, first_replica: int = 0) -> Any:
    """The one value every replica passed for ``what``: the rule wherever replicas must agree.

    A value every replica passed as the very same object arrives plain (``regroup`` keeps it)
    and is returned as it is. Otherwise ``value`` is a ``PerReplica`` whose components must be
    equal: plain values by ``==`` (an array, or anything whose ``==`` is not a plain bool,
    only by identity), callables by the same code and equal bound arguments (a
    ``functools.partial`` compares its function, args and keywords; a bound method its
    function and ``self``; a lambda or closure made in each replica its code).

    Args:
        value: a merge argument, regrouped.
        what: what the value is, for the message (``"the reduce op"``).
        first_replica: the id in sync of the replica whose value comes first (the message
            names replicas by their ids: on a worker of several, not from 0).

    Returns:
        Replica 0's value.

    Raises:
        ReplicaSyncError: replicas passed different values. The replicas are grouped by equal
            values; the largest group (the earliest on a tie) is the reference, and every
            other replica is named as odd, with its value and the reference's. Values that
            print alike are told apart (a different variable with the same name, its shape,
            the part of a long value where they differ). Its ``merge_number`` is filled in by
            the scheduler when it comes out of a merge function.

    Example:
        >>> agreed(PerReplica(["sum", "sum"]), "the reduce op")
        'sum'
        >>> agreed(PerReplica(["sum", "sum", "max"]), "the reduce op")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        aioreplica.ReplicaSyncError: replicas disagree on the reduce op: replica 2 passed 'max', \
while replicas 0 and 1 passed 'sum'; ...
    """
    if not isinstance(value, DistributedValues):
        return value
    values = value.values
    first = values[0]
    if all(other is first or _same(first, other) for other in values):
        return first
    _raise_disagreement(values, what, first_replica)


def _raise_disagreement(values: Sequence[Any], what: str, first_replica: int) -> NoReturn:
    groups: list[list[int]] = []  # replicas with equal values, in order of their first replica
    for replica, other in enumerate(values):  # by index in ``values``; named by id below
        for group in groups:
            if _same(values[group[0]], other):
                group.append(replica)
                break
        else:
            groups.append([replica])
    reference = max(groups, key=len)  # the first of the largest groups
    odd_groups = [group for group in groups if group is not reference]
    reference_value = values[reference[0]]
    reference_text = shown = _describe_value(reference_value)
    odd_parts = []
    same_name = False
    for group in odd_groups:
        odd_value = values[group[0]]
        odd_text = _describe_value(odd_value)
        if odd_text == shown:  # they would print alike: say what tells them apart
            told_reference, odd_text = _tell_apart(reference_value, odd_value, shown)
            same_name = same_name or odd_text.startswith("a different variable")
            if reference_text == shown:
                reference_text = told_reference
        odd_parts.append(f"{replica_list([first_replica + i for i in group])} passed {odd_text}")
    advice = (
        "variables are told apart by identity, not by name: create each variable once (in "
        "strategy.scope(), outside the step function) and pass the same variable object from "
        "every replica; "
        if same_name
        else ""
    )
    raise ReplicaSyncError(
        f"replicas disagree on {what}: {_and_join(odd_parts)}, while "
        f"{replica_list([first_replica + i for i in reference])} passed {reference_text}; "
        f"{advice}every replica must pass "
        "the same value in the same merge_call",
        merge_number=None,
        replicas=[first_replica + replica for group in odd_groups for replica in group],
        waiting=range(first_replica, first_replica + len(values)),
    )


def _and_join(parts: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _same(a: Any, b: Any) -> bool:
    """Whether two replicas' values count as the same (see ``agreed``)."""
    if a is b:
        return True
    if _is_variable(a) or _is_variable(b):
        return False  # two variables, even of equal values (their == compares elementwise)
    if isinstance(a, functools.partial):
        return (
            isinstance(b, functools.partial)
            and _same(a.func, b.func)
            and len(a.args) == len(b.args)
            and all(map(_same, a.args, b.args))
            and a.keywords.keys() == b.keywords.keys()
            and all(_same(v, b.keywords[k]) for k, v in a.keywords.items())
        )
    if isinstance(a, types.MethodType):
        return (
            isinstance(b, types.MethodType)
            and _same(a.__func__, b.__func__)
            and _same(a.__self__, b.__self__)
        )
    code = getattr(a, "__code__", None)
    if code is not None:
        return getattr(b, "__code__", None) is code
    try:
        equal = a == b
    except Exception:  # an == that cannot answer: not the same
        return False
    return equal is True or (isinstance(equal, np.bool_) and bool(equal))


def _describe_value(value: Any) -> str:
    """A replica's value, briefly, for a disagreement message."""
    if isinstance(value, functools.partial):
        bound = [f"{arg!r:.40}" for arg in value.args]
        bound += [f"{key}={arg!r:.40}" for key, arg in value.keywords.items()]
        return f"partial({', '.join([_describe_value(value.func), *bound])})"
    code = getattr(getattr(value, "__func__", value), "__code__", None)
    if code is not None:
        name = getattr(value, "__qualname__", type(value).__qualname__)
        return f"{name} ({code.co_filename}:{code.co_firstlineno})"
    if _is_variable(value):
        return f"variable {value.name!r}"
    text = _safe_repr(value)
    return text if len(text) <= 60 else f"{text[:60]}..."


def _variable_facts(variable: Any) -> list[str]:
    """What can tell two variables with one name apart, in the order it is looked for."""
    return [
        f"({type(variable).__name__})",
        f"of shape {variable.shape}",
        f"of dtype {variable.dtype}",
        f"on devices {list(variable.devices)}",
    ]


def _tell_apart(reference: Any, odd: Any, shown: str) -> tuple[str, str]:
    """Descriptions of two unequal values that ``_describe_value`` shows alike as ``shown``."""
    if _is_variable(reference) and _is_variable(odd):
        for fact_reference, fact_odd in zip(
            _variable_facts(reference), _variable_facts(odd), strict=True
        ):
            if fact_reference != fact_odd:
                return f"{shown} {fact_reference}", f"{shown} {fact_odd}"
        return shown, f"a different variable also named {odd.name!r}"
    full_reference, full_odd = _safe_repr(reference), _safe_repr(odd)
    if full_reference != full_odd:  # shortened alike: show where they differ
        at = next(
            (i for i, (x, y) in enumerate(zip(full_reference, full_odd, strict=False)) if x != y),
            min(len(full_reference), len(full_odd)),
        )
        return _around(full_reference, at), _around(full_odd, at)
    type_reference, type_odd = type(reference).__qualname__, type(odd).__qualname__
    if type_reference != type_odd:
        return f"{shown} ({type_reference})", f"{shown} ({type_odd})"
    if (
        isinstance(reference, types.MethodType)
        and isinstance(odd, types.MethodType)
        and reference.__func__ is odd.__func__
    ):  # one method of two objects: an object made in each replica, an optimizer say
        owner = type(odd.__self__).__name__
        return shown, (
            f"{shown} of another {owner} object (each replica made its own {owner}: one made "
            "inside the step function is one per replica; make it once, outside run())"
        )
    return shown, (f"{shown} (a different {type_odd} object that prints the same but is not equal)")


def _is_variable(value: Any) -> bool:
    return isinstance(getattr(value, "name", None), str) and type(value).__name__.endswith(
        "Variable"
    )


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # a repr that fails: the type still says something
        return f"<{type(value).__qualname__} object>"


def _around(text: str, at: int, width: int = 60) -> str:
    """``width`` characters of ``text`` from a little before ``at``, with ``...`` for cuts."""
    start = max(0, at - 2 * width // 3)
    head = "..." if start else ""
    tail = "..." if start + width < len(text) else ""
    return f"{head}{text[start : start + width]}{tail}"
