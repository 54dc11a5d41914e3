"""Flatten, rebuild and compare nested containers ("trees").

This is the only module in aioreplica that looks inside containers. ``regroup``,
``select_replica``, merge arguments, dataset batches and checkpoints all go through it, so
every part of the library agrees on what a container is, how its children are ordered and
how a mismatch is reported.

What is a container
    * ``list`` and ``tuple``.
    * namedtuples: tuple subclasses with ``_fields`` (and ``_make``). They are rebuilt with
      ``type(x)._make(children)``, so a namedtuple with a custom ``__new__`` still rebuilds.
      Their path entries are ``.field``.
    * other ``list``/``tuple`` subclasses, rebuilt as ``type(x)(children)``.
    * mapping views (``d.keys()``, ``d.values()``, ``d.items()``), as in tf.nest: their items
      in iteration order (not sorted), path entries ``[i]``. A view cannot be made from
      values, so it is rebuilt as a ``list``, as tf.nest packs it.
    * ``dict`` and *any* ``collections.abc.Mapping``; the type is kept on rebuild, as tf.nest
      keeps it. A ``defaultdict`` keeps its ``default_factory``; any other
      ``MutableMapping`` (dict subclasses among them) is made empty, ``type(m)()``, and
      filled key by key; any other ``Mapping`` is given its ``(key, value)`` pairs,
      ``type(m)(pairs)`` (a ``MappingProxyType``, a dict). When that fails, or the result
      does not hold exactly the keys of the original, a ``TypeError`` names the type and
      advises :func:`register_node`.
    * types registered with :func:`register_node` or :func:`register_dataclass`. A
      registration covers that exact type, not its subclasses. Registered children get path
      entries ``[i]`` (their position), registered dataclass fields ``.name``.
    * classes made with ``attrs``, as in tf.nest: their fields in order, path entries
      ``.name``, rebuilt with the fields as positional arguments (registered on first sight).
      One with ``kw_only`` or ``init=False`` fields flattens, but rebuilding it raises a
      ``TypeError``: :func:`register_node` replaces the automatic registration.

Everything else is a leaf: arrays, scalars, strings, bytes, dataclass instances that were
not registered, and arbitrary objects. ``None`` is a leaf too (it counts as one leaf and is
handed to ``map_structure``'s function), unlike in jax where it is an empty container.
Empty containers are not leaves; they are containers with no children.

Mapping keys
    Key order does not matter: two mappings match when their keys are equal as sets. Leaves
    come out ordered by sorted key, so two replicas that build the same dict in different
    orders flatten to the same leaf order; when the keys are not mutually orderable (say
    ``1`` and ``'a'``), or sorting them gives no strict order (frozensets compare as subsets,
    so ``sorted`` leaves them in insertion order), they are sorted by
    ``(type(k).__qualname__, repr(k))``, and two of them alike by both are a ``TypeError``
    (no order would be canonical). Rebuilding keeps the insertion order of the reference
    (first) structure. Two ``TreeDef`` objects
    compare equal when they describe the same structure; insertion order and a
    ``defaultdict``'s ``default_factory`` only affect rebuilding and are not compared.

Key paths
    A path is a tuple of :class:`SequenceKey` (shown ``[1]``), :class:`MappingKey` (shown as
    the repr of the key, ``['c']``) and :class:`AttrKey` (shown ``.name``) entries;
    :func:`format_path` joins them, e.g. ``[1]['c']``. The root is the empty path and the
    empty string, shown in messages as ``<root>``.

Mismatches
    Containers of different types raise ``TypeError``; a container against a leaf, different
    lengths, different key sets, or a registered node with different aux data raise
    ``ValueError``. The message names the key path and what differs, e.g. ``structures differ
    at [1]['c']: the first has a list of 3 items, the second a tuple of 3 items``. Aux data
    must be hashable and compare to a bool with ``==`` and ``!=``; ones that do not (NumPy
    arrays) raise ``TypeError`` saying so.

Speed
    Flattening runs in the scheduler's hot path. The kind of container is decided once per
    ``type`` and cached in a dict, so the first sight of a type does the ``isinstance``
    checks and every later one is a dict lookup; a leaf at the root costs two lookups. list,
    tuple and dict are handled inline, and a structure is compared against another by
    comparing their ``TreeDef`` objects; the slow walk that finds the key path only runs
    once a mismatch is known.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import operator
import types
from collections.abc import (
    Callable,
    Hashable,
    Iterable,
    Iterator,
    Mapping,
    MappingView,
    MutableMapping,
    Sequence,
)
from typing import Any, Final, NamedTuple, TypeAlias, TypeVar

__all__ = [
    "AttrKey",
    "KeyEntry",
    "KeyPath",
    "MappingKey",
    "NodeLevel",
    "SequenceKey",
    "TreeDef",
    "all_leaves",
    "assert_same_structure",
    "describe_path",
    "find_mismatch",
    "flatten",
    "flatten_with_path",
    "format_path",
    "is_leaf",
    "map_structure",
    "map_structure_with_path",
    "node_level",
    "node_mismatch",
    "register_dataclass",
    "register_node",
    "short_repr",
    "unflatten",
]

_T = TypeVar("_T")


# ---------------------------------------------------------------------------------------------
# Key paths
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SequenceKey:
    """A position in a list, a tuple or a registered node: shown as ``[index]``.

    Raises:
        TypeError: `index` is not an int (NumPy's integers are, kept as a Python int; a bool
            is not).

    Example:
        >>> SequenceKey(1), str(SequenceKey(1))
        (SequenceKey(index=1), '[1]')
    """

    index: int

    def __post_init__(self) -> None:
        index = self.index
        if type(index) is not int:
            if isinstance(index, bool) or not hasattr(type(index), "__index__"):
                raise TypeError(
                    f"SequenceKey needs index to be an int, a position from 0, got "
                    f"{short_repr(index)} of type {type(index).__name__}"
                )
            object.__setattr__(self, "index", operator.index(index))

    def __str__(self) -> str:
        return f"[{self.index}]"


@dataclasses.dataclass(frozen=True, slots=True)
class MappingKey:
    """A key of a mapping: shown as ``[repr(key)]``, e.g. ``['c']``.

    Example:
        >>> MappingKey("c"), str(MappingKey("c"))
        (MappingKey(key='c'), "['c']")
    """

    key: Hashable

    def __str__(self) -> str:
        return f"[{self.key!r}]"


@dataclasses.dataclass(frozen=True, slots=True)
class AttrKey:
    """A namedtuple or registered dataclass field: shown as ``.name``.

    Raises:
        TypeError: `name` is not a string.

    Example:
        >>> AttrKey("x"), str(AttrKey("x"))
        (AttrKey(name='x'), '.x')
    """

    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(
                f"AttrKey needs name to be a str, a field's name, got {short_repr(self.name)} "
                f"of type {type(self.name).__name__}"
            )

    def __str__(self) -> str:
        return f".{self.name}"


KeyEntry: TypeAlias = SequenceKey | MappingKey | AttrKey
KeyPath: TypeAlias = tuple[KeyEntry, ...]


_NEEDS_KEY_PATH: Final = (
    "format_path() needs path to be a key path, a tuple of SequenceKey, MappingKey and AttrKey "
    "entries (as flatten_with_key_paths gives)"
)


def format_path(path: Iterable[KeyEntry]) -> str:
    """Format a key path the way error messages show it.

    Args:
        path: A key path, as given by :func:`flatten_with_path`: an iterable of
            :class:`SequenceKey`, :class:`MappingKey` and :class:`AttrKey` entries.

    Returns:
        The entries joined, e.g. ``[1]['c'].x``; the empty string for the root.

    Raises:
        TypeError: `path` is not iterable, or an entry is not a key entry (a tuple path of
            raw keys, as ``yield_flat_paths`` gives, among them); the message names it.

    Example:
        >>> format_path((SequenceKey(1), MappingKey("c"), AttrKey("x")))
        "[1]['c'].x"
        >>> format_path(())
        ''
    """
    try:
        if isinstance(path, str | bytes):
            raise TypeError  # iterable, but of characters: no key path
        entries = list(path)
    except TypeError:
        raise TypeError(
            f"{_NEEDS_KEY_PATH}, got {short_repr(path)} of type {type(path).__name__}"
        ) from None
    for position, entry in enumerate(entries):
        if not isinstance(entry, SequenceKey | MappingKey | AttrKey):
            raise TypeError(
                f"{_NEEDS_KEY_PATH}, got {short_repr(entry)} of type {type(entry).__name__} at "
                f"position {position}"
            )
    return "".join([str(entry) for entry in entries])


def describe_path(path: Iterable[KeyEntry]) -> str:
    """Format a key path for an error message: like :func:`format_path`, root as ``<root>``."""
    return format_path(path) or "<root>"


# ---------------------------------------------------------------------------------------------
# The per-type kind cache and the registry
# ---------------------------------------------------------------------------------------------

# Kinds of node. A type's kind is decided once (`_classify`) and cached in `_KINDS`.
_LEAF: Final = 0
_LIST: Final = 1
_TUPLE: Final = 2
_DICT: Final = 3
_NAMEDTUPLE: Final = 4
_SEQUENCE: Final = 5  # any other list or tuple subclass
_DEFAULTDICT: Final = 6
_MAPPING: Final = 7  # any other Mapping, dict subclasses included
_CUSTOM: Final = 8  # registered with register_node / register_dataclass
_VIEW: Final = 9  # a mapping view: keys(), values(), items()

_SEQUENCE_KINDS: Final = frozenset({_LIST, _TUPLE, _NAMEDTUPLE, _SEQUENCE, _VIEW})
_MAPPING_KINDS: Final = frozenset({_DICT, _DEFAULTDICT, _MAPPING})

_KINDS: dict[type, int] = {
    list: _LIST,
    tuple: _TUPLE,
    dict: _DICT,
    # The commonest leaves, so that even their first sight is one lookup.
    int: _LEAF,
    float: _LEAF,
    bool: _LEAF,
    str: _LEAF,
    bytes: _LEAF,
    type(None): _LEAF,
}

_BUILTIN_CONTAINERS: Final[frozenset[type]] = frozenset(
    {list, tuple, dict, collections.OrderedDict, collections.defaultdict}
)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Registration:
    flatten_fn: Callable[[Any], tuple[Iterable[Any], Hashable]]
    unflatten_fn: Callable[[Any, tuple[Any, ...]], Any]
    field_names: tuple[str, ...] | None  # set for dataclasses: path entries `.name`
    automatic: bool = False  # an attrs class registered on first sight: register_node may replace


_REGISTRY: dict[type, _Registration] = {}


def _classify(t: type) -> int:
    """Decide and cache the kind of `t`; runs once per type."""
    kind: int
    if issubclass(t, tuple):
        kind = _NAMEDTUPLE if hasattr(t, "_fields") and hasattr(t, "_make") else _SEQUENCE
    elif issubclass(t, list):
        kind = _SEQUENCE
    elif issubclass(t, MappingView):  # walked as tf.nest walks them, in iteration order
        kind = _VIEW
    elif issubclass(t, collections.defaultdict):
        kind = _DEFAULTDICT
    elif issubclass(t, Mapping):
        kind = _MAPPING
    elif hasattr(t, "__attrs_attrs__"):  # attrs classes are containers, as in tf.nest
        _register_attrs(t)
        kind = _CUSTOM
    else:
        kind = _LEAF
    _KINDS[t] = kind
    return kind


def _register_attrs(cls: type) -> None:
    """Walk an attrs class like a namedtuple, as tf.nest does: its fields in order, with
    path entries ``.name``, rebuilt positionally (without importing attrs)."""
    fields = tuple(cls.__attrs_attrs__)  # type: ignore[attr-defined]
    names = tuple(field.name for field in fields)
    # Fields that cls(*children) cannot fill: rebuilding then says so instead of failing in
    # the class's __init__ with a message that names neither the class nor the fix.
    not_positional = [
        (field.name, "init=False" if not getattr(field, "init", True) else "kw_only")
        for field in fields
        if not getattr(field, "init", True) or getattr(field, "kw_only", False)
    ]

    def flatten_fn(x: Any) -> tuple[list[Any], None]:
        return [getattr(x, name) for name in names], None

    def unflatten_fn(aux: Any, children: tuple[Any, ...]) -> Any:
        if not_positional:
            name = _type_name(cls)
            which = ", ".join(f"field {field!r} is {why}" for field, why in not_positional)
            raise TypeError(
                f"cannot rebuild attrs class {name} as {name}(*fields): {which}; register it "
                "with aioreplica.nest.register_node() to say how to rebuild it"
            )
        return cls(*children)

    _register(cls, flatten_fn, unflatten_fn, names, automatic=True)


def _kind(t: type) -> int:
    kind = _KINDS.get(t)
    return _classify(t) if kind is None else kind


def is_leaf(x: Any) -> bool:
    """Tell whether `x` is a leaf, i.e. not a container this module walks into.

    Args:
        x: Any object.

    Returns:
        ``True`` for leaves (``None``, scalars, strings, arrays, unregistered dataclasses,
        ...), ``False`` for containers (attrs classes and mapping views among them, as in
        tf.nest), empty ones included.

    Raises:
        Nothing.

    Example:
        >>> is_leaf(None), is_leaf("abc"), is_leaf([]), is_leaf({"a": 1})
        (True, True, False, False)
    """
    kind = _KINDS.get(type(x))
    if kind is None:
        kind = _classify(type(x))
    return kind == _LEAF


def all_leaves(items: Iterable[Any]) -> bool:
    """Tell whether every item is a leaf: the check that lets flat argument tuples skip the
    tree walk.

    Example:
        >>> all_leaves((1.0, "a", None)), all_leaves((1.0, [2.0]))
        (True, False)
    """
    kinds = _KINDS
    for t in set(map(type, items)):  # items mostly share a type or two: one lookup each
        kind = kinds.get(t)
        if kind is None:
            kind = _classify(t)
        if kind != _LEAF:
            return False
    return True


def register_node(
    nodetype: type[_T],
    flatten_fn: Callable[[_T], tuple[Iterable[Any], Hashable]],
    unflatten_fn: Callable[[Any, tuple[Any, ...]], _T],
) -> None:
    """Teach the tree functions to walk into instances of `nodetype`.

    The registration covers exactly `nodetype`, not its subclasses. It also overrides the
    built-in handling of a tuple, list or Mapping subclass, which is how to flatten a
    mapping that cannot be rebuilt as the module docstring says, and the automatic
    registration of an attrs class (which may already have been walked).

    Args:
        nodetype: The class to register.
        flatten_fn: ``flatten_fn(x) -> (children, aux_data)``: an iterable of children and
            hashable data that, with the children, is enough to rebuild `x`. Two nodes only
            match when their aux data are equal.
        unflatten_fn: ``unflatten_fn(aux_data, children_tuple) -> x``.

    Raises:
        TypeError: `nodetype` is not a class, or a function is not callable.
        ValueError: `nodetype` is a built-in container (list, tuple, dict, OrderedDict,
            defaultdict) or is already registered with :func:`register_node` or
            :func:`register_dataclass`.

    Example:
        >>> class Pair:
        ...     def __init__(self, a, b):
        ...         self.a, self.b = a, b
        >>> register_node(Pair, lambda p: ((p.a, p.b), None), lambda aux, ch: Pair(*ch))
        >>> flatten(Pair(1, [2, 3]))[0]
        [1, 2, 3]
    """
    _register(nodetype, flatten_fn, unflatten_fn, None)


def register_dataclass(cls: type[_T]) -> type[_T]:
    """Make instances of the dataclass `cls` containers whose children are its fields.

    Without registration a dataclass instance is a leaf. The children are the fields in
    definition order, with path entries ``.name``; rebuilding calls ``cls(**fields)``. Can be
    used as a class decorator.

    Args:
        cls: A dataclass whose fields are all ``init=True``.

    Returns:
        `cls` itself.

    Raises:
        TypeError: `cls` is not a dataclass type.
        ValueError: `cls` has ``init=False`` fields, or is already registered with
            :func:`register_node` or :func:`register_dataclass`.

    Example:
        >>> @register_dataclass
        ... @dataclasses.dataclass
        ... class Batch:
        ...     x: object
        ...     y: object
        >>> flatten_with_path(Batch(x=1, y=[2]))[0]
        [((AttrKey(name='x'),), 1), ((AttrKey(name='y'), SequenceKey(index=0)), 2)]
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(
            f"register_dataclass() needs a dataclass type, got {cls!r} of type {type(cls).__name__}"
        )
    fields = dataclasses.fields(cls)
    no_init = [f.name for f in fields if not f.init]
    if no_init:
        raise ValueError(
            f"cannot register dataclass {_type_name(cls)}: fields {no_init} are init=False, "
            "so it cannot be rebuilt with cls(**fields); use register_node() instead"
        )
    names = tuple(f.name for f in fields)

    def flatten_fn(x: Any) -> tuple[list[Any], None]:
        return [getattr(x, name) for name in names], None

    def unflatten_fn(aux: Any, children: tuple[Any, ...]) -> Any:
        return cls(**dict(zip(names, children, strict=True)))

    _register(cls, flatten_fn, unflatten_fn, names)
    return cls


def _register(
    nodetype: type,
    flatten_fn: Callable[[Any], tuple[Iterable[Any], Hashable]],
    unflatten_fn: Callable[[Any, tuple[Any, ...]], Any],
    field_names: tuple[str, ...] | None,
    *,
    automatic: bool = False,
) -> None:
    if not isinstance(nodetype, type):
        raise TypeError(
            f"register_node() needs a class, got {nodetype!r} of type {type(nodetype).__name__}"
        )
    if not callable(flatten_fn) or not callable(unflatten_fn):
        raise TypeError(
            f"register_node({_type_name(nodetype)}, ...) needs callable flatten_fn and "
            f"unflatten_fn, got {type(flatten_fn).__name__} and {type(unflatten_fn).__name__}"
        )
    if nodetype in _BUILTIN_CONTAINERS:
        raise ValueError(
            f"{_type_name(nodetype)} is a built-in container that aioreplica.nest already "
            "flattens; it cannot be registered"
        )
    existing = _REGISTRY.get(nodetype)
    if existing is not None and not existing.automatic:
        raise ValueError(f"{_type_name(nodetype)} is already registered as a tree node")
    _REGISTRY[nodetype] = _Registration(flatten_fn, unflatten_fn, field_names, automatic)
    _KINDS[nodetype] = _CUSTOM


# ---------------------------------------------------------------------------------------------
# One level: split a container into children, join children into a container
# ---------------------------------------------------------------------------------------------


def _type_name(t: type) -> str:
    """The qualified name of `t`, without the ``<locals>`` of classes made in functions."""
    return t.__qualname__.rpartition("<locals>.")[2]


def _fallback_key(key: Any) -> tuple[str, str]:
    return (type(key).__qualname__, repr(key))


def _sorted_keys(keys: list[Any]) -> list[Any]:
    """``keys`` in canonical order: sorted, else by type name and repr.

    The fallback order is used when the keys do not compare, and when sorting them gives no
    strict order (each key ``<`` the next): ``<`` may be a partial order (frozensets compare
    as subsets), and then ``sorted`` leaves the keys as they came, in insertion order.

    Raises:
        TypeError: two keys neither order strictly nor differ by type name and repr, so no
            order is canonical (two dicts' values would pair by insertion order).
    """
    try:
        ordered = sorted(keys)
        rest = iter(ordered)
        previous = next(rest, None)
        for key in rest:
            if not previous < key:
                break
            previous = key
        else:
            return ordered
    except TypeError:
        pass
    ordered = sorted(keys, key=_fallback_key)
    for a, b in itertools.pairwise(ordered):
        if _fallback_key(a) == _fallback_key(b):
            raise TypeError(
                f"dict keys {a!r} and {b!r} cannot be put in order: they do not compare as "
                "a strict order, and their types and reprs are the same; use keys of one "
                "sortable type, or keys whose reprs differ"
            ) from None
    return ordered


def _split(x: Any, kind: int, t: type) -> tuple[Sequence[Any], Any, Any]:
    """Return (children in canonical order, compared aux data, rebuild-only extra data)."""
    if kind in _SEQUENCE_KINDS:
        return x, None, None
    if kind in _MAPPING_KINDS:
        order = list(x)
        skeys = _sorted_keys(order)
        aux = tuple(skeys)
        extra: Any = tuple(order)
        if extra == aux:
            extra = None
        if kind == _DEFAULTDICT:
            extra = (extra, x.default_factory)
        return [x[k] for k in skeys], aux, extra
    registration = _REGISTRY[t]
    children, custom_aux = registration.flatten_fn(x)
    return tuple(children), custom_aux, registration


def _join(node: _Node, values: list[Any]) -> Any:
    """Build a container of `node`'s type from its children's values (a fresh list)."""
    kind = node.kind
    if kind == _LIST:
        return values
    if kind == _TUPLE:
        return tuple(values)
    t: Any = node.type
    if kind == _NAMEDTUPLE:
        return t._make(values)
    if kind == _SEQUENCE:
        return t(values)
    if kind == _CUSTOM:
        return node.extra.unflatten_fn(node.aux, tuple(values))
    if kind == _VIEW:  # a view cannot be made from values: tf.nest packs it as a list
        return values
    items = dict(zip(node.aux, values, strict=True))
    order = node.extra[0] if kind == _DEFAULTDICT else node.extra
    if order is not None:
        items = {k: items[k] for k in order}
    if kind == _DICT:
        return items
    if t is collections.OrderedDict or t is types.MappingProxyType:
        return t(items)
    if t is collections.defaultdict:
        return t(node.extra[1], items)
    return _rebuild_mapping(node, items)


def _rebuild_mapping(node: _Node, items: dict[Any, Any]) -> Any:
    """A mapping of `node`'s type holding `items`, in their order, rebuilt as tf.nest does.

    A ``MutableMapping`` (dict subclasses among them) is made empty, ``type(m)()``, and filled
    key by key, so a constructor that does not take the items first loses none; a
    ``defaultdict`` subclass gets the reference's ``default_factory`` back. Any other
    ``Mapping`` is given the ``(key, value)`` pairs, ``type(m)(pairs)``. The result must hold
    exactly the reference's keys.
    """
    t: Any = node.type
    name = _type_name(t)
    mutable = issubclass(t, MutableMapping)
    how = f"{name}() filled with m[key] = value" if mutable else f"{name}(key_value_pairs)"
    advice = (
        "a MutableMapping is rebuilt empty with no arguments and then filled, any other "
        "Mapping from one argument, an iterable of (key, value) pairs; register the type with "
        "aioreplica.nest.register_node() to say how to rebuild it"
    )
    try:
        if mutable:
            rebuilt = t()
            if node.kind == _DEFAULTDICT:
                rebuilt.default_factory = node.extra[1]
            for key, value in items.items():
                rebuilt[key] = value
        else:
            rebuilt = t(list(items.items()))
        same_keys = len(rebuilt) == len(items) and all(key in rebuilt for key in items)
    except Exception as exc:
        raise TypeError(
            f"cannot rebuild mapping type {name}: {how} raised {type(exc).__name__}: {exc}; "
            f"{advice}"
        ) from exc
    if not same_keys:
        raise TypeError(
            f"cannot rebuild mapping type {name}: {how} holds the keys "
            f"{_keys_repr(list(rebuilt))} instead of {_keys_repr(list(items))}; {advice}"
        )
    return rebuilt


def _aux_equal(kind: int, t: type, aux_a: Any, aux_b: Any) -> bool:
    """Whether two nodes of type `t` hold the same compared data (registered aux data,
    mapping keys).

    Raises:
        TypeError: ``!=`` on them raised or gave something without a truth value (NumPy
            arrays); the message names the type and what aux data must be.
    """
    if aux_a is aux_b:
        return True
    try:
        if aux_a != aux_b:
            return False
    except Exception as exc:
        raise _aux_error(kind, t, aux_a, aux_b, exc) from exc
    return True


def _aux_error(kind: int, t: type, aux_a: Any, aux_b: Any, exc: Exception) -> TypeError:
    what = "aux data" if kind == _CUSTOM else "keys"
    rule = (
        "aux data that register_node's flatten_fn returns must be hashable and compare to a "
        "bool with == and != (a tuple, a string, a number; an array as tuple(array.tolist()))"
        if kind == _CUSTOM
        else "mapping keys must compare to a bool with == and !="
    )
    return TypeError(
        f"cannot compare the {what} of two {_type_name(t)} nodes, {short_repr(aux_a)} and "
        f"{short_repr(aux_b)}: != raised {type(exc).__name__}: {exc}; {rule}"
    )


class _Level(NamedTuple):
    """One level of a container, as given by :func:`_level`."""

    children: tuple[Any, ...]
    """The children, in canonical order (mappings: sorted by key)."""
    keys: KeyPath
    """The path entry of each child, in the same order."""
    rebuild: Callable[[Iterable[Any]], Any]
    """Build a container like the original from new children given in the same order."""


def _level(x: Any) -> _Level | None:
    """Split one level of the container `x`, or return ``None`` when `x` is a leaf.

    How ``find_mismatch`` walks containers level by level.
    ``_level(x).rebuild(_level(x).children)`` equals `x`.

    Args:
        x: Any object.

    Returns:
        ``_Level(children, keys, rebuild)``, or ``None`` for a leaf.

    Raises:
        Whatever a registered ``flatten_fn`` raises.

    Example:
        >>> n = _level({"b": 1, "a": 2})
        >>> n.children, format_path(n.keys[:1]), n.rebuild([20, 10])
        ((2, 1), "['a']", {'b': 10, 'a': 20})
    """
    t = type(x)
    kind = _KINDS.get(t)
    if kind is None:
        kind = _classify(t)
    if kind == _LEAF:
        return None
    children, aux, extra = _split(x, kind, t)
    n = len(children)
    level = _Node(kind, t, aux, extra, (None,) * n, n)
    return _Level(tuple(children), _node_keys(level), functools.partial(_rebuild_level, level))


def _rebuild_level(level: _Node, values: Iterable[Any]) -> Any:
    values = list(values)
    if len(values) != level.num_leaves:
        raise ValueError(
            f"rebuilding {with_article(_type_name(level.type))} needs {level.num_leaves} "
            f"children, got {len(values)}"
        )
    return _join(level, values)


# ---------------------------------------------------------------------------------------------
# TreeDef
# ---------------------------------------------------------------------------------------------


class _Node:
    """One container in a TreeDef; a leaf is ``None`` in ``children``."""

    __slots__ = ("_hash", "aux", "children", "extra", "kind", "num_leaves", "type")

    def __init__(
        self,
        kind: int,
        type_: type,
        aux: Any,
        extra: Any,
        children: tuple[_Node | None, ...],
        num_leaves: int,
    ) -> None:
        self.kind = kind
        self.type = type_
        self.aux = aux  # compared: sorted mapping keys, registered aux data
        self.extra = extra  # not compared: insertion order, default_factory, registration
        self.children = children
        self.num_leaves = num_leaves
        self._hash: int | None = None

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _Node):
            return NotImplemented
        if self.type is not other.type or self.num_leaves != other.num_leaves:
            return False
        aux, other_aux = self.aux, other.aux
        if aux is not other_aux:
            try:
                if aux != other_aux:
                    return False
            except Exception as exc:
                raise _aux_error(self.kind, self.type, aux, other_aux, exc) from exc
        return self.children == other.children

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((self.type, self.aux, self.children))
        return self._hash

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.kind, self.type, self.aux, self.extra, self.children, self.num_leaves)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        # The cached hash is left out: hashes of types differ between processes.
        self.kind, self.type, self.aux, self.extra, self.children, self.num_leaves = state
        self._hash = None


class TreeDef:
    """The shape of a structure without its leaves: what :func:`flatten` returns beside them.

    Immutable and hashable; two treedefs are equal when they describe the same structure
    (see the module docstring for what is compared). ``repr`` draws the structure with
    ``*`` for each leaf.

    Example:
        >>> leaves, treedef = flatten((1, [2, {"c": 3}]))
        >>> treedef
        TreeDef((*, [*, {'c': *}]))
        >>> treedef.num_leaves, treedef.unflatten(["a", "b", "c"])
        (3, ('a', ['b', {'c': 'c'}]))
    """

    __slots__ = ("_root",)
    _root: _Node | None

    def __init__(self, root: _Node | None) -> None:
        object.__setattr__(self, "_root", root)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("TreeDef is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("TreeDef is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (TreeDef, (self._root,))

    @property
    def num_leaves(self) -> int:
        """How many leaves the structure has."""
        root = self._root
        return 1 if root is None else root.num_leaves

    def unflatten(self, leaves: Iterable[Any]) -> Any:
        """Build a structure of this shape from `leaves`, given in flatten order.

        Args:
            leaves: Exactly :attr:`num_leaves` values.

        Returns:
            The rebuilt structure; containers keep their types and mappings the insertion
            order of the structure this treedef came from.

        Raises:
            ValueError: The number of leaves is wrong.
            TypeError: `leaves` is not iterable; or a mapping type or an attrs class cannot be
                rebuilt (see the module docstring).

        Example:
            >>> flatten({"b": 0, "a": 0})[1].unflatten([1, 2])
            {'b': 2, 'a': 1}
        """
        if not isinstance(leaves, list | tuple):
            try:
                iterator = iter(leaves)
            except TypeError:
                raise TypeError(
                    f"unflatten() needs leaves to be a list (or another iterable) of the "
                    f"{self.num_leaves} values to place in {self!r}, in flatten order, got "
                    f"{short_repr(leaves)} of type {type(leaves).__name__}"
                ) from None
            leaves = list(iterator)
        root = self._root
        if len(leaves) != (1 if root is None else root.num_leaves):
            raise ValueError(
                f"unflatten() expected {self.num_leaves} leaves for {self!r}, got {len(leaves)}"
            )
        if root is None:
            return leaves[0]
        return _build(root, iter(leaves))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TreeDef):
            return NotImplemented
        return self._root == other._root

    def __hash__(self) -> int:
        return hash(self._root)

    def __repr__(self) -> str:
        return f"TreeDef({_node_repr(self._root)})"


_LEAF_TREEDEF: Final = TreeDef(None)


def _build(n: _Node, leaves: Iterator[Any]) -> Any:
    values = [next(leaves) if c is None else _build(c, leaves) for c in n.children]
    return _join(n, values)


def _node_keys(n: _Node) -> KeyPath:
    kind = n.kind
    if kind == _NAMEDTUPLE:
        return tuple([AttrKey(f) for f in n.type._fields])  # type: ignore[attr-defined]
    if kind in _MAPPING_KINDS:
        return tuple([MappingKey(k) for k in n.aux])
    if kind == _CUSTOM and n.extra.field_names is not None:
        return tuple([AttrKey(f) for f in n.extra.field_names])
    return tuple([SequenceKey(i) for i in range(len(n.children))])


def _node_repr(n: _Node | None) -> str:
    if n is None:
        return "*"
    kids = [_node_repr(c) for c in n.children]
    kind = n.kind
    name = _type_name(n.type)
    if kind == _LIST:
        return "[" + ", ".join(kids) + "]"
    if kind == _TUPLE:
        return "(" + ", ".join(kids) + ("," if len(kids) == 1 else "") + ")"
    if kind in (_SEQUENCE, _VIEW):
        return f"{name}([{', '.join(kids)}])"
    fields = n.type._fields if kind == _NAMEDTUPLE else None  # type: ignore[attr-defined]
    if kind == _CUSTOM:
        fields = n.extra.field_names
    if fields is not None:
        return f"{name}(" + ", ".join(f"{f}={v}" for f, v in zip(fields, kids, strict=True)) + ")"
    if kind == _CUSTOM:
        return f"{name}[{n.aux!r}](" + ", ".join(kids) + ")"
    by_key = dict(zip(n.aux, kids, strict=True))
    order = n.extra[0] if kind == _DEFAULTDICT else n.extra
    body = "{" + ", ".join(f"{k!r}: {by_key[k]}" for k in order or n.aux) + "}"
    if kind == _DICT:
        return body
    if kind == _DEFAULTDICT:
        factory = n.extra[1]
        return f"{name}({getattr(factory, '__qualname__', repr(factory))}, {body})"
    return f"{name}({body})"


# ---------------------------------------------------------------------------------------------
# Flatten / unflatten
# ---------------------------------------------------------------------------------------------


def _flatten_into(x: Any, leaves: list[Any]) -> _Node | None:
    t = type(x)
    kind = _KINDS.get(t)
    if kind is None:
        kind = _classify(t)
    if kind == _LEAF:
        leaves.append(x)
        return None
    start = len(leaves)
    if kind in (_LIST, _TUPLE):
        values: Sequence[Any] = x
        aux = extra = None
    else:
        values, aux, extra = _split(x, kind, t)
    children: list[_Node | None] = []
    for child in values:
        child_kind = _KINDS.get(type(child))
        if child_kind == _LEAF:
            leaves.append(child)
            children.append(None)
        else:
            children.append(_flatten_into(child, leaves))
    return _Node(kind, t, aux, extra, tuple(children), len(leaves) - start)


def flatten(structure: Any) -> tuple[list[Any], TreeDef]:
    """Split `structure` into its leaves and a :class:`TreeDef` that can rebuild it.

    Args:
        structure: Any nest of containers and leaves.

    Returns:
        ``(leaves, treedef)``: the leaves depth first, mapping children by sorted key.

    Raises:
        Whatever a registered ``flatten_fn`` raises.

    Example:
        >>> flatten({"b": [1, None], "a": (2,)})
        ([2, 1, None], TreeDef({'b': [*, *], 'a': (*,)}))
    """
    if _KINDS.get(type(structure)) == _LEAF:
        return [structure], _LEAF_TREEDEF
    leaves: list[Any] = []
    root = _flatten_into(structure, leaves)
    return leaves, (_LEAF_TREEDEF if root is None else TreeDef(root))


def unflatten(treedef_or_structure: TreeDef | Any, leaves: Iterable[Any]) -> Any:
    """Build a structure from `leaves`, given in flatten order.

    Args:
        treedef_or_structure: A :class:`TreeDef`, or an example structure whose treedef is
            used (its own leaves are ignored).
        leaves: Exactly as many values as the structure has leaves.

    Returns:
        The rebuilt structure.

    Raises:
        ValueError: The number of leaves is wrong; the message names expected and got.
        TypeError: `leaves` is not iterable; or a mapping type or an attrs class cannot be
            rebuilt (see the module docstring).

    Example:
        >>> unflatten([0, (0, 0)], ["a", "b", "c"])
        ['a', ('b', 'c')]
    """
    if isinstance(treedef_or_structure, TreeDef):
        return treedef_or_structure.unflatten(leaves)
    return flatten(treedef_or_structure)[1].unflatten(leaves)


def flatten_with_path(structure: Any) -> tuple[list[tuple[KeyPath, Any]], TreeDef]:
    """Like :func:`flatten`, but pair each leaf with its key path.

    Args:
        structure: Any nest of containers and leaves.

    Returns:
        ``([(path, leaf), ...], treedef)``, in the same order as :func:`flatten`.

    Raises:
        Whatever a registered ``flatten_fn`` raises.

    Example:
        >>> pairs, _ = flatten_with_path([1, {"c": 2}])
        >>> [(format_path(path), leaf) for path, leaf in pairs]
        [('[0]', 1), ("[1]['c']", 2)]
    """
    leaves, treedef = flatten(structure)
    return list(zip(_leaf_paths(treedef), leaves, strict=True)), treedef


def _leaf_paths(treedef: TreeDef) -> list[KeyPath]:
    out: list[KeyPath] = []

    def walk(n: _Node | None, prefix: KeyPath) -> None:
        if n is None:
            out.append(prefix)
            return
        for key, child in zip(_node_keys(n), n.children, strict=True):
            walk(child, (*prefix, key))

    walk(treedef._root, ())
    return out


# ---------------------------------------------------------------------------------------------
# Comparing structures
# ---------------------------------------------------------------------------------------------


def with_article(name: str) -> str:
    """``name`` with its indefinite article, as it is read out: ``a list``, ``an
    OrderedDict``, ``a uint8``, ``a UserDict``, ``an ndarray``."""
    lower = name.lower()
    vowel = lower[:1] in "aeiou" and not lower.startswith(_READ_AS_YOU)
    return ("an " if vowel or lower.startswith("nd") else "a ") + name


#: The beginnings of names whose "u" is read as "you".
_READ_AS_YOU: Final = ("uint", "use", "uni", "usu")


def short_repr(x: Any, limit: int = 40) -> str:
    try:
        text = repr(x)
    except Exception:
        return f"<{_type_name(type(x))} object>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe_node(x: Any) -> str:
    """What `x` is, for a structure mismatch: ``a list of 2 items``, ``a leaf 3 of type int``."""
    t = type(x)
    kind = _kind(t)
    name = _type_name(t)
    if kind == _LEAF:
        return f"a leaf {short_repr(x)} of type {name}"
    if kind == _CUSTOM:
        return f"{with_article(name)} node"
    n = len(x)
    return f"{with_article(name)} of {n} item{'' if n == 1 else 's'}"


def _same_name_classes(ta: type, tb: type, first: str, second: str) -> str:
    """Why two classes that print with one name differ, and, for the usual cause, the fix."""
    full_a = f"{ta.__module__}.{ta.__qualname__}"
    full_b = f"{tb.__module__}.{tb.__qualname__}"
    fields_a, fields_b = getattr(ta, "_fields", None), getattr(tb, "_fields", None)
    fields = ""
    if fields_a != fields_b:
        fields = (
            f"; their fields differ: {first} has {_fields_repr(fields_a)}, "
            f"{second} {_fields_repr(fields_b)}"
        )
    if full_a != full_b:
        return f"two different classes with the same name, {full_a} and {full_b}{fields}"
    if fields:
        # Two namedtuple calls with one name, not one definition run twice: no hint about
        # classes made inside functions.
        return f"two different classes, both {full_a}{fields}"
    return (
        f"two different classes, both {full_a} (a class or namedtuple made inside a function "
        "is a new class on every call: define it once, at module level)"
    )


def _fields_repr(fields: Any) -> str:
    """A namedtuple's fields for a message: ``fields ('a', 'b')``, or ``no fields``."""
    return "no fields" if fields is None else f"fields {tuple(fields)!r}"


def _keys_repr(keys: list[Any]) -> str:
    return ", ".join(short_repr(k) for k in _sorted_keys(keys))


def _node_mismatch(
    a: Any, b: Any, *, first: str = "the first", second: str = "the second"
) -> tuple[type[TypeError] | type[ValueError], str] | None:
    """Compare the top level of `a` and `b` (not their children).

    Args:
        a: The reference value.
        b: The value compared with it.
        first: How the message names `a`.
        second: How the message names `b`.

    Returns:
        ``None`` when both are leaves or containers that match at this level, else
        ``(exception_class, message)``: ``TypeError`` for containers of different types,
        ``ValueError`` for a container against a leaf, different lengths, different key sets
        or different registered aux data. The message does not name a path.

    Raises:
        Whatever a registered ``flatten_fn`` raises.

    Example:
        >>> _node_mismatch({"x": 1}, {"y": 1})
        (<class 'ValueError'>, "keys differ: 'x' only in the first, 'y' only in the second")
    """
    ta, tb = type(a), type(b)
    ka, kb = _kind(ta), _kind(tb)
    if ka == _LEAF and kb == _LEAF:
        return None
    if ka == _LEAF or kb == _LEAF or ta is not tb:
        exc = ValueError if ka == _LEAF or kb == _LEAF else TypeError
        message = f"{first} has {_describe_node(a)}, {second} {_describe_node(b)}"
        if ta is not tb and _type_name(ta) == _type_name(tb):
            message += f": {_same_name_classes(ta, tb, first, second)}"
        return exc, message
    if ka in _MAPPING_KINDS:
        keys_a, keys_b = set(a), set(b)
        if keys_a == keys_b:
            return None
        parts = []
        if keys_a - keys_b:
            parts.append(f"{_keys_repr(list(keys_a - keys_b))} only in {first}")
        if keys_b - keys_a:
            parts.append(f"{_keys_repr(list(keys_b - keys_a))} only in {second}")
        return ValueError, "keys differ: " + ", ".join(parts)
    if ka in _SEQUENCE_KINDS:
        if len(a) == len(b):
            return None
        return ValueError, f"{first} has {_describe_node(a)}, {second} {_describe_node(b)}"
    registration = _REGISTRY[ta]
    children_a, aux_a = registration.flatten_fn(a)
    children_b, aux_b = registration.flatten_fn(b)
    name = with_article(_type_name(ta))
    if not _aux_equal(ka, ta, aux_a, aux_b):
        return ValueError, (
            f"{first} has {name} node with aux data {short_repr(aux_a)}, "
            f"{second} with aux data {short_repr(aux_b)}"
        )
    len_a, len_b = len(tuple(children_a)), len(tuple(children_b))
    if len_a != len_b:
        return ValueError, (f"{first} has {name} node with {len_a} children, {second} with {len_b}")
    return None


def find_mismatch(
    a: Any, b: Any, *, first: str = "the first", second: str = "the second"
) -> tuple[type[TypeError] | type[ValueError], KeyPath, str] | None:
    """Find the first place, depth first, where `b`'s structure differs from `a`'s.

    This is the slow walk behind every mismatch message; call it once a cheap check
    (comparing treedefs) has said the structures differ.

    Args:
        a: The reference structure.
        b: The structure compared with it.
        first: How the message names `a`.
        second: How the message names `b`.

    Returns:
        ``None`` when the structures match, else ``(exception_class, path, message)``; see
        :func:`_node_mismatch`.

    Raises:
        Whatever a registered ``flatten_fn`` raises.

    Example:
        >>> exc, path, message = find_mismatch([1, {"c": [1, 2, 3]}], [1, {"c": (1, 2, 3)}])
        >>> exc.__name__, format_path(path), message
        ('TypeError', "[1]['c']", 'the first has a list of 3 items, the second a tuple of 3 items')
    """
    found = _node_mismatch(a, b, first=first, second=second)
    if found is not None:
        return found[0], (), found[1]
    level_a = _level(a)
    if level_a is None:
        return None
    level_b = _level(b)
    assert level_b is not None  # node_mismatch found both to be containers
    for key, child_a, child_b in zip(level_a.keys, level_a.children, level_b.children, strict=True):
        deeper = find_mismatch(child_a, child_b, first=first, second=second)
        if deeper is not None:
            return deeper[0], (key, *deeper[1]), deeper[2]
    return None


class NodeLevel(NamedTuple):
    """One level of a container, as :func:`node_level` gives it."""

    kind: str
    """``"sequence"`` (a list, tuple, namedtuple or subclass), ``"mapping"`` or ``"registered"``."""
    keys: KeyPath
    """The path entry of each child, in flatten order."""
    children: tuple[Any, ...]
    """The children, in flatten order (mappings: sorted by key)."""


def node_level(x: Any) -> NodeLevel | None:
    """Split one level of `x`, for walks that compare structures by rules of their own.

    ``aioreplica.nest`` walks two structures this way where ``tf.nest`` counts two container
    types as one (a dict and an OrderedDict; a list and a tuple with ``check_types=False``).

    Args:
        x: Any object.

    Returns:
        ``NodeLevel(kind, keys, children)``, or ``None`` for a leaf.

    Raises:
        Whatever a registered ``flatten_fn`` raises.

    Example:
        >>> node_level({"a": [2]})
        NodeLevel(kind='mapping', keys=(MappingKey(key='a'),), children=([2],))
        >>> node_level("text") is None
        True
    """
    level = _level(x)
    if level is None:
        return None
    kind = _kind(type(x))
    if kind in _SEQUENCE_KINDS:
        name = "sequence"
    elif kind in _MAPPING_KINDS:
        name = "mapping"
    else:
        name = "registered"
    return NodeLevel(name, level.keys, level.children)


def node_mismatch(
    a: Any, b: Any, *, first: str = "the first", second: str = "the second"
) -> tuple[type[TypeError] | type[ValueError], str] | None:
    """How the top levels of `a` and `b` differ: :func:`find_mismatch` without the descent.

    For walks that decide by rules of their own whether two children match.

    Args:
        a: The reference value.
        b: The value compared with it.
        first: How the message names `a`.
        second: How the message names `b`.

    Returns:
        ``None`` when both are leaves or containers that match at this level (their children
        are not compared), else ``(exception_class, message)`` as :func:`find_mismatch` gives
        them, without a path.

    Raises:
        Whatever a registered ``flatten_fn`` raises.

    Example:
        >>> node_mismatch([1, [2]], [3, (4,)]) is None
        True
        >>> node_mismatch([1], (1,))
        (<class 'TypeError'>, 'the first has a list of 1 item, the second a tuple of 1 item')
    """
    return _node_mismatch(a, b, first=first, second=second)


def _raise_mismatch(a: Any, b: Any, *, first: str, second: str, prefix: str) -> None:
    found = find_mismatch(a, b, first=first, second=second)
    if found is None:
        # Only reachable when registered aux data compare unequal to themselves.
        raise ValueError(f"{prefix}: {first} is {flatten(a)[1]!r}, {second} {flatten(b)[1]!r}")
    exc, path, message = found
    raise exc(f"{prefix} at {describe_path(path)}: {message}")


def assert_same_structure(a: Any, b: Any) -> None:
    """Check that `a` and `b` have the same nested structure (leaves may differ).

    Args:
        a: A structure.
        b: Another structure.

    Raises:
        TypeError: Two containers at the same path have different types.
        ValueError: A container faces a leaf, or lengths, key sets or registered aux data
            differ. Both messages name the key path and what differs.

    Example:
        >>> assert_same_structure({"a": [1, 2]}, {"a": [3, 4]})
        >>> try:
        ...     assert_same_structure({"a": [1, 2]}, {"a": (3, 4)})
        ... except TypeError as exc:
        ...     print(exc)
        structures differ at ['a']: the first has a list of 2 items, the second a tuple of 2 items
    """
    if flatten(a)[1] != flatten(b)[1]:
        _raise_mismatch(a, b, first="the first", second="the second", prefix="structures differ")


def _flatten_all(structures: tuple[Any, ...], caller: str) -> tuple[TreeDef, list[list[Any]]]:
    if not structures:
        raise TypeError(f"{caller}() needs at least one structure after fn")
    leaves, treedef = flatten(structures[0])
    all_leaves = [leaves]
    for i in range(1, len(structures)):
        other_leaves, other = flatten(structures[i])
        if other != treedef:
            name = f"structures[{i}]"
            _raise_mismatch(
                structures[0],
                structures[i],
                first="structures[0]",
                second=name,
                prefix=f"{caller}(): {name} differs from structures[0]",
            )
        all_leaves.append(other_leaves)
    return treedef, all_leaves


def map_structure(fn: Callable[..., Any], *structures: Any) -> Any:
    """Apply `fn` to the leaves at the same place in each structure.

    Args:
        fn: Called as ``fn(leaf_of_structure_0, leaf_of_structure_1, ...)`` once per leaf.
        *structures: One or more structures of the same shape.

    Returns:
        A structure shaped like ``structures[0]`` holding the results.

    Raises:
        TypeError: No structure was given, or two containers at the same path have
            different types.
        ValueError: A container faces a leaf, or lengths or key sets differ. The message
            names which of `structures` differs from ``structures[0]`` and the key path.

    Example:
        >>> map_structure(lambda x, y: x + y, {"a": 1, "b": [2]}, {"b": [20], "a": 10})
        {'a': 11, 'b': [22]}
    """
    treedef, all_leaves = _flatten_all(structures, "map_structure")
    if len(all_leaves) == 1:
        return treedef.unflatten([fn(x) for x in all_leaves[0]])
    return treedef.unflatten([fn(*xs) for xs in zip(*all_leaves, strict=True)])


def map_structure_with_path(fn: Callable[..., Any], *structures: Any) -> Any:
    """Like :func:`map_structure`, but also pass each leaf's key path to `fn`.

    The path is a tuple of key entries (``SequenceKey``, ``MappingKey``, ``AttrKey``), not a
    string; :func:`format_path` turns it into one.

    Args:
        fn: Called as ``fn(path, leaf_of_structure_0, leaf_of_structure_1, ...)``.
        *structures: One or more structures of the same shape.

    Returns:
        A structure shaped like ``structures[0]`` holding the results.

    Raises:
        TypeError: As :func:`map_structure`.
        ValueError: As :func:`map_structure`.

    Example:
        >>> map_structure_with_path(lambda path, x: f"{format_path(path)}={x}", [1, {"c": 2}])
        ['[0]=1', {'c': "[1]['c']=2"}]
    """
    treedef, all_leaves = _flatten_all(structures, "map_structure_with_path")
    paths = _leaf_paths(treedef)
    return treedef.unflatten([fn(path, *xs) for path, *xs in zip(paths, *all_leaves, strict=True)])
