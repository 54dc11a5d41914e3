"""``tf.nest`` for aioreplica: flatten, pack, map over and compare nested structures.

The functions keep ``tf.nest``'s names, arguments and meanings, so code written against
``tf.nest`` reads and behaves the same (the differences are listed below); a JAX-style pair
that also hands out the structure's shape, and key-path tools for messages, sit beside them.
The ``map_structure_with_*paths``, "up to" and flat-path functions are TensorFlow's too, from
its ``nest`` module (``tensorflow.python.util.nest``) rather than the ``tf.nest`` namespace.

=========================================  ==============================================
tf.nest                                    aioreplica.nest
=========================================  ==============================================
``flatten(s)``                             ``flatten(s)``: the list of leaves
``pack_sequence_as(s, flat)``              ``pack_sequence_as(s, flat)``
``map_structure(f, *s)``                   ``map_structure(f, *s)``
``map_structure_with_paths(f, *s)``        ``map_structure_with_paths``: ``"a/0"``
``map_structure_with_tuple_paths(f, *s)``  ``map_structure_with_tuple_paths``: ``("a", 0)``
``assert_same_structure(a, b)``            ``assert_same_structure(a, b)``
``is_nested(x)``                           ``is_nested(x)``; its opposite ``is_leaf(x)``
``assert_shallow_structure(shallow, s)``   ``assert_shallow_structure(shallow, s)``
``flatten_up_to(shallow, s)``              ``flatten_up_to(shallow, s)``
``map_structure_up_to(shallow, f, *s)``    ``map_structure_up_to(shallow, f, *s)``
``yield_flat_paths(s)``                    ``yield_flat_paths(s)``: ``("a", 0)``, ...
``flatten_with_tuple_paths(s)``            ``flatten_with_tuple_paths(s)``
``flatten_with_joined_string_paths(s)``    ``flatten_with_joined_string_paths(s)``
=========================================  ==============================================

=========================================  ==============================================
jax.tree_util                              aioreplica.nest
=========================================  ==============================================
``tree_flatten(s)``                        ``flatten_with_treedef(s)``: (leaves, TreeDef)
``tree_unflatten(treedef, leaves)``        ``unflatten(treedef, leaves)``
``tree_flatten_with_path(s)[0]``           ``flatten_with_key_paths(s)``
``register_pytree_node``                   ``register_node``, ``register_dataclass``
``keystr(path)``                           ``format_path(path)``
=========================================  ==============================================

What is a container
    Lists, tuples, namedtuples, dicts and any other ``Mapping``, their subclasses, classes made
    with ``attrs`` (their fields, as in tf.nest), mapping views (``d.keys()``, ``d.values()``,
    ``d.items()``: their items, packed back as a list, as in tf.nest), and types registered with
    :func:`register_node` or :func:`register_dataclass`. Everything else is a leaf: ``None``,
    scalars, strings, bytes, arrays, sets, unregistered dataclasses. As in tf.nest,
    ``flatten(None) == [None]`` and a leaf alone flattens to ``[leaf]``, and containers are
    rebuilt with their own types: a ``MutableMapping`` made empty and filled key by key, any
    other ``Mapping`` from its ``(key, value)`` pairs, an attrs class from its fields in order.
    A type rebuilt otherwise joins with :func:`register_node`, which also replaces the automatic
    registration of an attrs class.

Order
    Depth first; mapping children by sorted key, so dicts built in different orders flatten
    alike; a mapping view's items in its iteration order, as in tf.nest. Rebuilding keeps the
    insertion order of the structure given. Where tf.nest refuses keys that cannot be sorted
    together (``1`` and ``"a"``), they are ordered by type name, then ``repr``; so are keys
    whose sorted order is not strict (frozensets, which compare as subsets), which tf.nest
    leaves in insertion order.

Matching types (``check_types``)
    As in tf.nest, with ``check_types=True`` (the default) two containers at the same place
    must be of the same type, except that any two mapping types match, any two list types
    match, and two namedtuple classes with the same name and fields match. With
    ``check_types=False`` a list, a tuple and a namedtuple of the same length match too. Either
    way lengths and mapping keys must agree (tf.nest skips the key check without
    ``check_types``; here a mapping never matches another set of keys), a registered type only
    matches itself, and results take the types of the first structure. The "up to" functions
    compare each container of the shallow structure with the input's by these rules and give
    results of the shallow structure's types; tf.nest's there also accepts an input container
    of a subclass of the shallow one's type (a namedtuple where the shallow structure has a
    tuple), which here needs ``check_types=False``.

Errors
    A mismatch raises ``ValueError`` (a container against a leaf, other lengths or keys) or
    ``TypeError`` (container types that do not match), as tf.nest does, with a message that
    names the key path where the structures part, e.g. ``structures differ at ['a'][1]: ...``.
    In the "up to" functions, an input leaf where the shallow structure has a container is a
    ``TypeError``, as in tf.nest.

``expand_composites``
    Accepted wherever tf.nest takes it; aioreplica has no composite tensors, so it changes
    nothing. As in tf.nest, it and ``check_types`` are converted with ``bool()``, so a value
    without a truth value (an array) raises ``TypeError``.

Example:
    >>> structure = {"b": [1, None], "a": ("text", 2)}
    >>> flatten(structure)
    ['text', 2, 1, None]
    >>> pack_sequence_as(structure, [10, 20, 30, 40])
    {'b': [30, 40], 'a': (10, 20)}
"""

from __future__ import annotations

import reprlib
from typing import TYPE_CHECKING, Any, Never, TypeVar

from . import _tree
from ._tree import AttrKey as AttrKey
from ._tree import KeyEntry as KeyEntry
from ._tree import KeyPath as KeyPath
from ._tree import MappingKey as MappingKey
from ._tree import SequenceKey as SequenceKey
from ._tree import TreeDef as TreeDef
from ._tree import format_path as format_path
from ._tree import is_leaf as is_leaf

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

__all__ = [
    "AttrKey",
    "KeyEntry",
    "KeyPath",
    "MappingKey",
    "SequenceKey",
    "TreeDef",
    "assert_same_structure",
    "assert_shallow_structure",
    "flatten",
    "flatten_up_to",
    "flatten_with_joined_string_paths",
    "flatten_with_key_paths",
    "flatten_with_treedef",
    "flatten_with_tuple_paths",
    "format_path",
    "is_leaf",
    "is_nested",
    "map_structure",
    "map_structure_up_to",
    "map_structure_with_paths",
    "map_structure_with_tuple_paths",
    "pack_sequence_as",
    "register_dataclass",
    "register_node",
    "unflatten",
    "yield_flat_paths",
]

_T = TypeVar("_T")

#: What a structure mismatch is: the exception to raise, where, and what differs there.
_Mismatch = tuple[type[TypeError] | type[ValueError], KeyPath, str]

_CHECK_TYPES_HINT = (
    "; pass check_types=False to match a list, a tuple and a namedtuple of the same length"
)


# ---------------------------------------------------------------------------------------------
# tf.nest
# ---------------------------------------------------------------------------------------------


def flatten(structure: Any, expand_composites: bool = False) -> list[Any]:
    """Return the leaves of `structure` as a list, depth first, mappings by sorted key.

    Args:
        structure: Any nest of containers and leaves.
        expand_composites: Accepted for tf.nest compatibility; changes nothing.

    Returns:
        A new list of the leaves; ``[structure]`` when `structure` is itself a leaf (``None``
        included).

    Raises:
        TypeError: `expand_composites` has no truth value (an array).
        Whatever a registered ``flatten_fn`` raises.

    Example:
        >>> flatten({"b": [1, None], "a": ("text", 2)})
        ['text', 2, 1, None]
        >>> flatten(None), flatten("abc"), flatten([[], ()])
        ([None], ['abc'], [])
    """
    if expand_composites is not False:
        _flag("flatten", "expand_composites", expand_composites)
    return _tree.flatten(structure)[0]


def pack_sequence_as(
    structure: Any, flat_sequence: list[Any] | tuple[Any, ...], expand_composites: bool = False
) -> Any:
    """Build a structure shaped like `structure` from `flat_sequence`, given in flatten order.

    The leaves of `structure` are ignored; its containers are rebuilt with their own types
    and mappings keep its key order. ``pack_sequence_as(s, flatten(s))`` rebuilds `s`.

    Args:
        structure: The example structure.
        flat_sequence: A list or tuple with one item per leaf of `structure`; the items are
            placed as they are, containers included.
        expand_composites: Accepted for tf.nest compatibility; changes nothing.

    Returns:
        The packed structure; ``flat_sequence[0]`` when `structure` is a leaf.

    Raises:
        TypeError: `flat_sequence` is not a list or tuple; `expand_composites` has no truth
            value; or a container in `structure` cannot be rebuilt: a mapping type (see
            :func:`register_node`), an attrs class with ``kw_only`` or ``init=False`` fields.
        ValueError: `flat_sequence` does not have one item per leaf; the message gives both
            counts.

    Example:
        >>> pack_sequence_as({"b": [0, 0], "a": 0}, [1, 2, 3])
        {'b': [2, 3], 'a': 1}
        >>> pack_sequence_as(None, ["only"])
        'only'
        >>> pack_sequence_as([0, 0], [1])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: pack_sequence_as(): the structure has 2 leaves, but flat_sequence has 1 item...
    """
    if expand_composites is not False:
        _flag("pack_sequence_as", "expand_composites", expand_composites)
    if not isinstance(flat_sequence, list | tuple):
        raise TypeError(
            "pack_sequence_as() needs flat_sequence to be a list or tuple of leaves, got "
            f"{reprlib.repr(flat_sequence)} of type {type(flat_sequence).__name__}"
        )
    treedef = _tree.flatten(structure)[1]
    if len(flat_sequence) != treedef.num_leaves:
        raise ValueError(
            f"pack_sequence_as(): the structure has {_count(treedef.num_leaves, 'leaf', 'leaves')}"
            f", but flat_sequence has {_count(len(flat_sequence), 'item', 'items')}; pass one "
            f"item per leaf, in flatten() order (structure: {treedef!r})"
        )
    return treedef.unflatten(flat_sequence)


def map_structure(
    func: Callable[..., Any],
    *structures: Any,
    check_types: bool = True,
    expand_composites: bool = False,
    **kwargs: Never,
) -> Any:
    """Apply `func` to the leaves at the same place in each structure.

    Args:
        func: Called as ``func(leaf_of_structure_0, leaf_of_structure_1, ...)`` once per
            leaf, in flatten order.
        *structures: One or more structures of the same shape.
        check_types: Whether container types must match (see the module docstring); without
            it a list, a tuple and a namedtuple of the same length match.
        expand_composites: Accepted for tf.nest compatibility; changes nothing.
        **kwargs: Refused: as in tf.nest, any other keyword argument raises ``ValueError``
            (none is passed to `func`).

    Returns:
        A structure shaped like ``structures[0]`` (its types, its key order) holding the
        results.

    Raises:
        TypeError: `func` is not callable; `check_types` or `expand_composites` has no truth
            value (an array); two containers at the same path have types that do not match;
            or a container of ``structures[0]`` cannot be rebuilt (see
            :func:`pack_sequence_as`).
        ValueError: No structure was given, or a container faces a leaf, or lengths or keys
            differ. Mismatch messages name which of `structures` differs and the key path.
            Also a keyword argument other than `check_types` and `expand_composites`, with
            tf.nest's message ("Only valid keyword arguments are ...").

    Example:
        >>> map_structure(lambda x, y: x + y, {"a": 1, "b": [2]}, {"b": [20], "a": 10})
        {'a': 11, 'b': [22]}
        >>> map_structure(lambda x, y: x + y, [1, 2], (10, 20), check_types=False)
        [11, 22]
        >>> map_structure(lambda x: x, [1], foo="a")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Only valid keyword arguments are `check_types` and ...
    """
    if kwargs:
        names = "`, `".join(kwargs)
        first = next(iter(kwargs))
        raise ValueError(
            f"Only valid keyword arguments are `check_types` and `expand_composites`, not: "
            f"`{names}`; map_structure() passes no keyword arguments to func, so bind them "
            f"first: map_structure(functools.partial(func, {first}=...), *structures)"
        )
    check_types = _flags("map_structure", check_types, expand_composites)
    treedef, columns = _flatten_matching("map_structure", func, structures, check_types)
    return treedef.unflatten([func(*leaves) for leaves in zip(*columns, strict=True)])


def map_structure_with_paths(
    func: Callable[..., Any],
    *structures: Any,
    check_types: bool = True,
    expand_composites: bool = False,
    **kwargs: Any,
) -> Any:
    """Like :func:`map_structure`, but also pass each leaf's path as a ``/``-joined string.

    The path joins the mapping keys, sequence indices and field names from the root with
    ``/``, as tf.nest does: ``"a/0"`` for ``structure["a"][0]``, ``""`` for a leaf alone. As in
    tf.nest, the walk goes "up to" ``structures[0]``: where it has a leaf, a later structure
    may hold a whole subtree, passed to `func` as one value.

    Args:
        func: Called as ``func(path, leaf_of_structure_0, leaf_of_structure_1, ...,
            **kwargs)``.
        *structures: One or more structures of the same shape.
        check_types: As :func:`map_structure`.
        expand_composites: Accepted for tf.nest compatibility; changes nothing.
        **kwargs: Passed to every call of `func`, as tf.nest does.

    Returns:
        A structure shaped like ``structures[0]`` holding the results.

    Raises:
        TypeError: As :func:`map_structure`.
        ValueError: As :func:`map_structure`.

    Example:
        >>> map_structure_with_paths(lambda path, x: f"{path}={x}", {"a": [1, 2], "b": 3})
        {'a': ['a/0=1', 'a/1=2'], 'b': 'b=3'}
    """

    def with_string_path(path: tuple[Any, ...], *leaves: Any, **kwargs: Any) -> Any:
        return func("/".join([str(key) for key in path]), *leaves, **kwargs)

    check_types = _flags("map_structure_with_paths", check_types, expand_composites)
    return _map_structures(
        "map_structure_with_paths", func, with_string_path, structures, check_types, kwargs
    )


def map_structure_with_tuple_paths(
    func: Callable[..., Any],
    *structures: Any,
    check_types: bool = True,
    expand_composites: bool = False,
    **kwargs: Any,
) -> Any:
    """Like :func:`map_structure`, but also pass each leaf's path as a tuple.

    The path holds the mapping keys, sequence indices and field names from the root, as
    tf.nest does: ``("a", 0)`` for ``structure["a"][0]``, ``()`` for a leaf alone. The walk
    goes "up to" ``structures[0]``, as :func:`map_structure_with_paths` says.

    Args:
        func: Called as ``func(path, leaf_of_structure_0, leaf_of_structure_1, ...,
            **kwargs)``.
        *structures: One or more structures of the same shape.
        check_types: As :func:`map_structure`.
        expand_composites: Accepted for tf.nest compatibility; changes nothing.
        **kwargs: Passed to every call of `func`, as tf.nest does.

    Returns:
        A structure shaped like ``structures[0]`` holding the results.

    Raises:
        TypeError: As :func:`map_structure`.
        ValueError: As :func:`map_structure`.

    Example:
        >>> map_structure_with_tuple_paths(lambda path, x: (path, x), [1, {"k": 2}])
        [((0,), 1), {'k': ((1, 'k'), 2)}]
    """
    check_types = _flags("map_structure_with_tuple_paths", check_types, expand_composites)
    return _map_structures(
        "map_structure_with_tuple_paths", func, func, structures, check_types, kwargs
    )


def assert_same_structure(
    nest1: Any, nest2: Any, check_types: bool = True, expand_composites: bool = False
) -> None:
    """Check that `nest1` and `nest2` have the same nested structure (leaves may differ).

    Args:
        nest1: A structure.
        nest2: Another structure.
        check_types: Whether container types must match (see the module docstring); without
            it a list, a tuple and a namedtuple of the same length match.
        expand_composites: Accepted for tf.nest compatibility; changes nothing.

    Raises:
        TypeError: Two containers at the same path have types that do not match; or
            `check_types` or `expand_composites` has no truth value (an array); or registered
            aux data do not compare to a bool.
        ValueError: A container faces a leaf, or lengths, keys or registered aux data differ.
            Both messages name the key path and what differs.

    Example:
        >>> assert_same_structure({"a": [1, 2]}, {"a": [3, 4]})
        >>> assert_same_structure({"a": [1, 2]}, {"a": (3, 4)}, check_types=False)
        >>> assert_same_structure({"a": [1, 2]}, {"a": (3, 4)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: structures differ at ['a']: the first has a list of 2 items, ...
    """
    check_types = _flags("assert_same_structure", check_types, expand_composites)
    if _tree.flatten(nest1)[1] == _tree.flatten(nest2)[1]:
        return
    found = _find_difference(
        nest1, nest2, check_types=check_types, first="the first", second="the second"
    )
    if found is not None:
        exc, path, message = found
        raise exc(f"structures differ at {_tree.describe_path(path)}: {message}")


def is_nested(seq: Any) -> bool:
    """Tell whether `seq` is a container that the functions here walk into.

    Args:
        seq: Any object.

    Returns:
        ``True`` for lists, tuples, namedtuples, mappings, mapping views (``d.keys()``,
        ``d.values()``, ``d.items()``, as in tf.nest) and registered types, empty ones
        included; ``False`` for leaves: ``None``, scalars, strings, bytes, arrays, sets.

    Raises:
        Nothing.

    Example:
        >>> is_nested([]), is_nested({"a": 1}), is_nested("abc"), is_nested(None)
        (True, True, False, False)
        >>> is_nested({"a": 1}.keys())
        True
    """
    return not _tree.is_leaf(seq)


# ---------------------------------------------------------------------------------------------
# "Up to" a shallow structure, and flat paths (tensorflow.python.util.nest)
# ---------------------------------------------------------------------------------------------


def assert_shallow_structure(
    shallow_tree: Any, input_tree: Any, check_types: bool = True, expand_composites: bool = False
) -> None:
    """Check that `input_tree` is `shallow_tree` with some leaves replaced by subtrees.

    Every container of `shallow_tree` must face a matching container in `input_tree` (types
    under `check_types`, lengths, mapping keys, as :func:`assert_same_structure` compares
    them); where `shallow_tree` has a leaf, `input_tree` may hold anything.

    Args:
        shallow_tree: The shallow structure.
        input_tree: The structure checked against it.
        check_types: Whether container types must match (see the module docstring).
        expand_composites: Accepted for tf.nest compatibility; changes nothing.

    Raises:
        TypeError: `input_tree` has a leaf where `shallow_tree` has a container, or two
            containers have types that do not match; or a flag has no truth value.
        ValueError: Two containers differ in length or keys. Messages name the key path.

    Example:
        >>> assert_shallow_structure([0, 0], [1, [2, 3]])
        >>> assert_shallow_structure([0, [0, 0]], [1, 2])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: assert_shallow_structure(): input_tree has a leaf of type int at [1], ...
    """
    check_types = _flags("assert_shallow_structure", check_types, expand_composites)
    _flatten_up_to(
        "assert_shallow_structure",
        shallow_tree,
        input_tree,
        check_types,
        (),
        ("shallow_tree", "input_tree"),
    )


def flatten_up_to(
    shallow_tree: Any, input_tree: Any, check_types: bool = True, expand_composites: bool = False
) -> list[Any]:
    """Flatten `input_tree` only as deep as `shallow_tree` goes.

    The values of `input_tree` at the places of `shallow_tree`'s leaves, in flatten order;
    what lies below them stays whole. ``flatten_up_to(s, s) == flatten(s)``.

    Args:
        shallow_tree: The shallow structure.
        input_tree: A structure that :func:`assert_shallow_structure` accepts.
        check_types: Whether container types must match (see the module docstring).
        expand_composites: Accepted for tf.nest compatibility; changes nothing.

    Returns:
        A new list, one item per leaf of `shallow_tree`; ``[input_tree]`` when
        `shallow_tree` is a leaf.

    Raises:
        TypeError: As :func:`assert_shallow_structure`.
        ValueError: As :func:`assert_shallow_structure`.

    Example:
        >>> flatten_up_to([[True, True], [False, True]], [[[2, 2], [3, 3]], [[4, 9], [5, 5]]])
        [[2, 2], [3, 3], [4, 9], [5, 5]]
        >>> flatten_up_to({"a": 0, "b": 0}, {"b": {"c": 2}, "a": 1})
        [1, {'c': 2}]
        >>> flatten_up_to(0, [0, 1, 2])
        [[0, 1, 2]]
    """
    check_types = _flags("flatten_up_to", check_types, expand_composites)
    return _flatten_up_to(
        "flatten_up_to", shallow_tree, input_tree, check_types, (), ("shallow_tree", "input_tree")
    )


def map_structure_up_to(
    shallow_tree: Any,
    func: Callable[..., Any],
    *inputs: Any,
    check_types: bool = True,
    expand_composites: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply `func` to the inputs flattened up to `shallow_tree`, shaped like `shallow_tree`.

    Each input is flattened as :func:`flatten_up_to` does; `func` gets the values at the
    same place in each. Every input is checked before `func` first runs.

    Args:
        shallow_tree: The shallow structure: it sets the places `func` is applied at and the
            shape (types, key order) of the result.
        func: Called as ``func(value_of_input_0, value_of_input_1, ..., **kwargs)`` once per
            leaf of `shallow_tree`, in flatten order.
        *inputs: One or more structures that :func:`assert_shallow_structure` accepts.
        check_types: Whether container types must match (see the module docstring).
        expand_composites: Accepted for tf.nest compatibility; changes nothing.
        **kwargs: Passed to every call of `func`, as tf.nest does.

    Returns:
        A structure shaped like `shallow_tree` holding the results.

    Raises:
        TypeError: `func` is not callable; a flag has no truth value; or an input has a
            leaf where `shallow_tree` has a container, or a container of a type that does not
            match. Messages name which of `inputs` and the key path.
        ValueError: No input was given, or containers differ in length or keys.

    Example:
        >>> map_structure_up_to([None, None], lambda x: 2 * x, [1, [2, 3]])
        [2, [2, 3, 2, 3]]
        >>> names, data = ["evens", ["odds"]], [[2, 4, 6], [[1, 3]]]
        >>> map_structure_up_to(names, lambda n, d: f"{len(d)} {n}", names, data)
        ['3 evens', ['2 odds']]
    """
    check_types = _flags("map_structure_up_to", check_types, expand_composites)
    _check_func("map_structure_up_to", func, inputs)

    def without_path(path: tuple[Any, ...], *values: Any, **kwargs: Any) -> Any:
        return func(*values, **kwargs)

    named = [(f"inputs[{index}]", tree) for index, tree in enumerate(inputs)]
    return _map_up_to(
        "map_structure_up_to",
        without_path,
        ("shallow_tree", shallow_tree),
        named,
        check_types,
        kwargs,
    )


def yield_flat_paths(nest: Any, expand_composites: bool = False) -> Iterator[tuple[Any, ...]]:
    """Return an iterator over the tuple path of each leaf of `nest`, in flatten order.

    A tuple path holds the mapping keys, sequence indices and field names from the root, as
    in :func:`map_structure_with_tuple_paths`; a leaf alone has the path ``()``. The
    structure is walked when this is called, not as the iterator is consumed.

    Args:
        nest: Any nest of containers and leaves.
        expand_composites: Accepted for tf.nest compatibility; changes nothing.

    Returns:
        An iterator of tuples.

    Raises:
        TypeError: `expand_composites` has no truth value (an array).
        Whatever a registered ``flatten_fn`` raises.

    Example:
        >>> list(yield_flat_paths({"a": [3], "b": {"c": 4}}))
        [('a', 0), ('b', 'c')]
        >>> list(yield_flat_paths(5))
        [()]
    """
    if expand_composites is not False:
        _flag("yield_flat_paths", "expand_composites", expand_composites)
    return iter([_tuple_path(path) for path, _ in _tree.flatten_with_path(nest)[0]])


def flatten_with_tuple_paths(
    structure: Any, expand_composites: bool = False
) -> list[tuple[tuple[Any, ...], Any]]:
    """Return each leaf of `structure` with its tuple path, in :func:`flatten` order.

    Args:
        structure: Any nest of containers and leaves.
        expand_composites: Accepted for tf.nest compatibility; changes nothing.

    Returns:
        A list of ``(tuple_path, leaf)`` pairs; the paths are :func:`yield_flat_paths`'s.

    Raises:
        TypeError: `expand_composites` has no truth value (an array).
        Whatever a registered ``flatten_fn`` raises.

    Example:
        >>> flatten_with_tuple_paths({"a": [3, 4], "b": 5})
        [(('a', 0), 3), (('a', 1), 4), (('b',), 5)]
    """
    if expand_composites is not False:
        _flag("flatten_with_tuple_paths", "expand_composites", expand_composites)
    return [(_tuple_path(path), leaf) for path, leaf in _tree.flatten_with_path(structure)[0]]


def flatten_with_joined_string_paths(
    structure: Any, separator: str = "/", expand_composites: bool = False
) -> list[tuple[str, Any]]:
    """Return each leaf of `structure` with its path as a string, in :func:`flatten` order.

    The path joins the entries of the tuple path (:func:`yield_flat_paths`), each made a
    string with ``str()``, with `separator`: ``"a/0"`` for ``structure["a"][0]``, ``""`` for
    a leaf alone.

    Args:
        structure: Any nest of containers and leaves.
        separator: The string put between the entries of a path.
        expand_composites: Accepted for tf.nest compatibility; changes nothing.

    Returns:
        A list of ``(string_path, leaf)`` pairs.

    Raises:
        TypeError: `separator` is not a string, or `expand_composites` has no truth value.
        Whatever a registered ``flatten_fn`` raises.

    Example:
        >>> flatten_with_joined_string_paths({"a": [3, 4], "b": 5})
        [('a/0', 3), ('a/1', 4), ('b', 5)]
        >>> flatten_with_joined_string_paths([[1]], separator=".")
        [('0.0', 1)]
    """
    if not isinstance(separator, str):
        raise TypeError(
            "flatten_with_joined_string_paths() needs separator to be a string, got "
            f"{reprlib.repr(separator)} of type {type(separator).__name__}"
        )
    if expand_composites is not False:
        _flag("flatten_with_joined_string_paths", "expand_composites", expand_composites)
    return [
        (separator.join([str(key) for key in _tuple_path(path)]), leaf)
        for path, leaf in _tree.flatten_with_path(structure)[0]
    ]


# ---------------------------------------------------------------------------------------------
# The JAX-style pair and key paths
# ---------------------------------------------------------------------------------------------


def flatten_with_treedef(structure: Any) -> tuple[list[Any], TreeDef]:
    """Split `structure` into its leaves and a :class:`TreeDef` that can rebuild it.

    Like ``jax.tree_util.tree_flatten``. The treedef is hashable and compares equal for
    structures of the same shape; :func:`unflatten` rebuilds from it.

    Args:
        structure: Any nest of containers and leaves.

    Returns:
        ``(leaves, treedef)``, the leaves as :func:`flatten` gives them.

    Raises:
        Whatever a registered ``flatten_fn`` raises.

    Example:
        >>> leaves, treedef = flatten_with_treedef({"b": [1, None], "a": (2,)})
        >>> leaves, treedef
        ([2, 1, None], TreeDef({'b': [*, *], 'a': (*,)}))
        >>> unflatten(treedef, ["x", "y", "z"])
        {'b': ['y', 'z'], 'a': ('x',)}
    """
    return _tree.flatten(structure)


def unflatten(treedef: TreeDef, leaves: Iterable[Any]) -> Any:
    """Build a structure from `treedef` and `leaves`, given in flatten order.

    Like ``jax.tree_util.tree_unflatten``. To pack leaves into the shape of an example
    structure instead, use :func:`pack_sequence_as`.

    Args:
        treedef: A :class:`TreeDef` from :func:`flatten_with_treedef`.
        leaves: Exactly ``treedef.num_leaves`` values.

    Returns:
        The rebuilt structure.

    Raises:
        TypeError: `treedef` is not a :class:`TreeDef`, `leaves` is not iterable, or a
            container cannot be rebuilt (see :func:`pack_sequence_as`).
        ValueError: The number of leaves is wrong; the message names expected and got.

    Example:
        >>> _, treedef = flatten_with_treedef([0, (0, 0)])
        >>> unflatten(treedef, ["a", "b", "c"])
        ['a', ('b', 'c')]
    """
    if not isinstance(treedef, TreeDef):
        raise TypeError(
            "unflatten() needs a TreeDef (from flatten_with_treedef), got a value of type "
            f"{type(treedef).__name__}; to pack leaves into the shape of an example structure, "
            "use pack_sequence_as(structure, leaves)"
        )
    return treedef.unflatten(leaves)


def flatten_with_key_paths(structure: Any) -> list[tuple[KeyPath, Any]]:
    """Return each leaf with its key path, in :func:`flatten` order.

    Like the first item of ``jax.tree_util.tree_flatten_with_path``; the treedef, when
    needed, comes from :func:`flatten_with_treedef`. A key path is a tuple of
    :class:`SequenceKey`, :class:`MappingKey` and :class:`AttrKey` entries, which
    :func:`format_path` shows as ``[1]['c'].x``; the path of a leaf alone is ``()``.

    Args:
        structure: Any nest of containers and leaves.

    Returns:
        A list of ``(key_path, leaf)`` pairs.

    Raises:
        Whatever a registered ``flatten_fn`` raises.

    Example:
        >>> [(format_path(path), leaf) for path, leaf in flatten_with_key_paths([1, {"c": 2}])]
        [('[0]', 1), ("[1]['c']", 2)]
    """
    return _tree.flatten_with_path(structure)[0]


def register_node(
    nodetype: type[_T],
    flatten_fn: Callable[[_T], tuple[Iterable[Any], Any]],
    unflatten_fn: Callable[[Any, tuple[Any, ...]], _T],
) -> None:
    """Make instances of `nodetype` containers for every function here (and for aioreplica).

    Like ``jax.tree_util.register_pytree_node``. The registration covers exactly `nodetype`,
    not its subclasses; it also overrides the built-in handling of a list, tuple or Mapping
    subclass, which is how to walk a mapping whose constructor does not take a dict.

    Args:
        nodetype: The class to register.
        flatten_fn: ``flatten_fn(x) -> (children, aux_data)``: an iterable of children and
            hashable data that, with the children, is enough to rebuild `x`. Two nodes only
            match when their aux data are equal.
        unflatten_fn: ``unflatten_fn(aux_data, children_tuple) -> x``.

    Raises:
        TypeError: `nodetype` is not a class, or a function is not callable.
        ValueError: `nodetype` is a built-in container (list, tuple, dict, OrderedDict,
            defaultdict) or is already registered.

    Example:
        >>> class Pair:
        ...     def __init__(self, a, b):
        ...         self.a, self.b = a, b
        >>> register_node(Pair, lambda p: ((p.a, p.b), None), lambda aux, kids: Pair(*kids))
        >>> flatten(Pair(1, [2, 3]))
        [1, 2, 3]
    """
    _tree.register_node(nodetype, flatten_fn, unflatten_fn)


def register_dataclass(cls: type[_T]) -> type[_T]:
    """Make instances of the dataclass `cls` containers whose children are its fields.

    Without registration a dataclass instance is a leaf. The children are the fields in
    definition order, with tuple-path entries the field names; rebuilding calls
    ``cls(**fields)``. Can be used as a class decorator.

    Args:
        cls: A dataclass whose fields are all ``init=True``.

    Returns:
        `cls` itself.

    Raises:
        TypeError: `cls` is not a dataclass type.
        ValueError: `cls` has ``init=False`` fields, or is already registered.

    Example:
        >>> import dataclasses
        >>> @register_dataclass
        ... @dataclasses.dataclass
        ... class Example:
        ...     x: object
        ...     y: object
        >>> map_structure_with_paths(lambda path, v: path, Example(x=1, y=[2]))
        Example(x='x', y=['y/0'])
    """
    return _tree.register_dataclass(cls)


# ---------------------------------------------------------------------------------------------
# Matching structures under tf.nest's type rules
# ---------------------------------------------------------------------------------------------


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _flag(caller: str, name: str, value: object) -> bool:
    """`value` converted with ``bool()``, as tf.nest converts its flags on entry."""
    try:
        return bool(value)
    except Exception as exc:
        raise TypeError(
            f"{caller}() needs {name} to be a bool, got {reprlib.repr(value)} of type "
            f"{type(value).__name__}, which has no truth value ({type(exc).__name__}: {exc})"
        ) from exc


def _flags(caller: str, check_types: object, expand_composites: object) -> bool:
    """`check_types` as a bool, after checking both flags of `caller`."""
    if expand_composites is not False:
        _flag(caller, "expand_composites", expand_composites)
    return check_types if check_types is True else _flag(caller, "check_types", check_types)


def _map_structures(
    caller: str,
    func: Callable[..., Any],
    call: Callable[..., Any],
    structures: tuple[Any, ...],
    check_types: bool,
    kwargs: dict[str, Any],
) -> Any:
    """:func:`_map_up_to` with ``structures[0]`` as the shallow structure, as tf.nest's
    ``map_structure_with_*paths`` do."""
    _check_func(caller, func, structures)
    named = [(f"structures[{index}]", tree) for index, tree in enumerate(structures)]
    return _map_up_to(caller, call, named[0], named, check_types, kwargs)


def _map_up_to(
    caller: str,
    call: Callable[..., Any],
    shallow: tuple[str, Any],
    inputs: list[tuple[str, Any]],
    check_types: bool,
    kwargs: dict[str, Any],
) -> Any:
    """Map `call(tuple_path, *values, **kwargs)` over `inputs` flattened up to `shallow`.

    As in tf.nest, the shallow structure sets the structure walked: where it has a leaf, an
    input may hold a whole subtree, passed to `call` as one value. `shallow` and each input
    come as ``(name, structure)``, the name for messages. Every input is checked before
    `call` first runs.
    """
    shallow_name, shallow_tree = shallow
    pairs, treedef = _tree.flatten_with_path(shallow_tree)
    leaves = [leaf for _, leaf in pairs]
    columns = [
        leaves
        if tree is shallow_tree
        else _flatten_up_to(caller, shallow_tree, tree, check_types, (), (shallow_name, name))
        for name, tree in inputs
    ]
    paths = [_tuple_path(path) for path, _ in pairs]
    return treedef.unflatten(
        [call(path, *values, **kwargs) for path, *values in zip(paths, *columns, strict=True)]
    )


def _flatten_up_to(
    caller: str,
    shallow: Any,
    deep: Any,
    check_types: bool,
    path: KeyPath,
    names: tuple[str, str],
) -> list[Any]:
    """`deep`'s values at the leaves of `shallow`, in flatten order (tf.nest's "up to").

    `names` says how messages name `shallow` and `deep`: ``("shallow_tree", "input_tree")``.
    """
    level = _tree.node_level(shallow)
    if level is None:
        return [deep]
    shallow_name, deep_name = names
    where = f"{caller}(): {deep_name}"
    deep_level = _tree.node_level(deep)
    if deep_level is None:
        raise TypeError(
            f"{where} has a leaf of type {type(deep).__name__} at "
            f"{_tree.describe_path(path)}, where {shallow_name} has a "
            f"{type(shallow).__name__}; it must hold at least {shallow_name}'s structure"
        )
    # Containers must match as in map_structure (types under `check_types`, lengths, mapping
    # keys); only below a leaf of the shallow structure may the deep one hold more.
    found = _top_level_difference(
        shallow, deep, level, deep_level, check_types, shallow_name, deep_name
    )
    if found is not None:
        exc, message = found
        raise exc(f"{where} differs from {shallow_name} at {_tree.describe_path(path)}: {message}")
    children = deep_level.children  # in flatten order, as `level`'s: equal keys sort alike
    out: list[Any] = []
    for key, child, deep_child in zip(level.keys, level.children, children, strict=True):
        out += _flatten_up_to(caller, child, deep_child, check_types, (*path, key), names)
    return out


def _tuple_path(path: KeyPath) -> tuple[Any, ...]:
    """tf.nest's form of a key path: the raw keys, indices and field names."""
    return tuple(
        [
            entry.index
            if isinstance(entry, SequenceKey)
            else entry.key
            if isinstance(entry, MappingKey)
            else entry.name
            for entry in path
        ]
    )


def _flatten_matching(
    caller: str, func: object, structures: tuple[Any, ...], check_types: bool
) -> tuple[TreeDef, list[list[Any]]]:
    """Flatten each structure after checking the arguments of `caller`.

    Returns ``structures[0]``'s treedef and one list of leaves per structure, all aligned:
    structures that match under tf.nest's rules flatten to leaves in the same order.
    """
    _check_func(caller, func, structures)
    leaves, treedef = _tree.flatten(structures[0])
    columns = [leaves]
    for i in range(1, len(structures)):
        other_leaves, other_treedef = _tree.flatten(structures[i])
        if other_treedef != treedef:
            _check_matches(caller, structures[0], structures[i], i, check_types)
        columns.append(other_leaves)
    return treedef, columns


def _check_func(caller: str, func: object, structures: tuple[Any, ...]) -> None:
    """Raise unless `func` is callable and there is a structure to map it over."""
    if not callable(func):
        raise TypeError(
            f"{caller}() needs a callable func, got {reprlib.repr(func)} of type "
            f"{type(func).__name__}"
        )
    if not structures:
        raise ValueError(f"{caller}() needs at least one structure after func")


def _check_matches(caller: str, first: Any, other: Any, index: int, check_types: bool) -> None:
    """Raise unless `other` (``structures[index]``) matches `first` under tf.nest's rules."""
    name = f"structures[{index}]"
    found = _find_difference(
        first, other, check_types=check_types, first="structures[0]", second=name
    )
    if found is not None:
        exc, path, message = found
        raise exc(
            f"{caller}(): {name} differs from structures[0] at {_tree.describe_path(path)}: "
            f"{message}"
        )


def _find_difference(
    a: Any, b: Any, *, check_types: bool, first: str, second: str
) -> _Mismatch | None:
    """Find the first place, depth first, where `b`'s structure differs from `a`'s.

    `_tree.find_mismatch` with tf.nest's type rules: only called once the treedefs differ,
    which may still be a match when container types differ in ways tf.nest accepts.
    """
    level_a, level_b = _tree.node_level(a), _tree.node_level(b)
    found = _top_level_difference(a, b, level_a, level_b, check_types, first, second)
    if found is not None:
        return found[0], (), found[1]
    if level_a is None or level_b is None:  # two leaves
        return None
    for key, child_a, child_b in zip(level_a.keys, level_a.children, level_b.children, strict=True):
        deeper = _find_difference(
            child_a, child_b, check_types=check_types, first=first, second=second
        )
        if deeper is not None:
            return deeper[0], (key, *deeper[1]), deeper[2]
    return None


def _top_level_difference(
    a: Any,
    b: Any,
    level_a: _tree.NodeLevel | None,
    level_b: _tree.NodeLevel | None,
    check_types: bool,
    first: str,
    second: str,
) -> tuple[type[TypeError] | type[ValueError], str] | None:
    """How `a` and `b` differ at their own level, their children aside."""
    found = _tree.node_mismatch(a, b, first=first, second=second)
    if found is None or type(a) is type(b) or level_a is None or level_b is None:
        return found
    if not _types_match(a, b, level_a.kind, level_b.kind, check_types):
        exc, message = found
        if check_types and level_a.kind == level_b.kind == "sequence":
            message += _CHECK_TYPES_HINT
        return exc, message
    # Types tf.nest counts as one: what they hold must still agree.
    if level_a.kind == "mapping":
        return _tree.node_mismatch(dict.fromkeys(a), dict.fromkeys(b), first=first, second=second)
    if len(level_a.children) != len(level_b.children):
        return ValueError, found[1]
    return None


def _types_match(a: Any, b: Any, kind_a: str, kind_b: str, check_types: bool) -> bool:
    """Whether tf.nest counts the different container types of `a` and `b` as one."""
    if kind_a != kind_b or kind_a == "registered":
        return False
    if kind_a == "mapping" or not check_types:
        return True
    if isinstance(a, list) and isinstance(b, list):
        return True
    signature = _namedtuple_signature(a)
    return signature is not None and signature == _namedtuple_signature(b)


def _namedtuple_signature(x: Any) -> tuple[str, tuple[str, ...]] | None:
    """A namedtuple's name and fields, which is all tf.nest compares of its class."""
    fields = getattr(type(x), "_fields", None)
    return None if fields is None else (type(x).__name__, tuple(fields))
