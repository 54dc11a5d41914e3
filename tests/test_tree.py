"""Tests for aioreplica._tree and its public face aioreplica.nest."""

from __future__ import annotations

import collections
import dataclasses
import pickle
import re
import types
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import nested_strategies
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aioreplica
from aioreplica import _tree, nest
from aioreplica._tree import (
    AttrKey,
    MappingKey,
    SequenceKey,
    TreeDef,
    assert_same_structure,
    describe_path,
    find_mismatch,
    flatten,
    flatten_with_path,
    format_path,
    is_leaf,
    map_structure,
    map_structure_with_path,
    register_dataclass,
    register_node,
    unflatten,
)

Point = collections.namedtuple("Point", ["x", "y"])


# Two module-level namedtuple classes of one name (as tf.nest's test has), fields apart.
SameNameAB = collections.namedtuple("SameName", ["a", "b"])  # type: ignore[name-match]
SameNameAC = collections.namedtuple("SameName", ["a", "c"])  # type: ignore[name-match]


def make_point_class() -> type[Any]:
    """A new class named Point on every call, as a class defined in a step function is."""
    return collections.namedtuple("Point", ["x", "y"])


class Pair(NamedTuple):
    first: Any
    second: Any


class Spec(collections.namedtuple("Spec", ["mode", "loss", "extra"])):
    """A namedtuple whose ``__new__`` takes fewer arguments than it has fields."""

    def __new__(cls, mode: Any, loss: Any, extra: Any = None) -> Spec:
        return super().__new__(cls, mode, loss, "default" if extra is None else extra)


class MyList(list[Any]):
    pass


class MyTuple(tuple[Any, ...]):
    pass


class MyDict(dict[Any, Any]):
    pass


class FrozenMapping(Mapping[Any, Any]):
    """A Mapping that is not a dict, built from a dict like TF's test class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._d = dict(*args, **kwargs)

    def __getitem__(self, key: Any) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and dict(self) == dict(other)

    __hash__ = None  # type: ignore[assignment]


class KeywordOnlyMapping(FrozenMapping):
    """A Mapping whose constructor does not accept a dict."""

    def __init__(self, *, items: tuple[tuple[Any, Any], ...]) -> None:
        super().__init__(items)


class TaggedDict(dict[Any, Any]):
    """A dict subclass whose first constructor parameter is not the items."""

    def __init__(self, tag: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tag = tag


class NoArgDict(dict[Any, Any]):
    """A dict subclass whose constructor takes no arguments."""

    def __init__(self) -> None:
        super().__init__()


class FactoryDict(collections.defaultdict[Any, Any]):
    """A defaultdict subclass that sets its own default_factory."""

    def __init__(self) -> None:
        super().__init__(list)


class PairsMapping(Mapping[Any, Any]):
    """A Mapping built from an iterable of (key, value) pairs, as tf.nest rebuilds one."""

    def __init__(self, pairs: Any = ()) -> None:
        self._d = {}
        for key, value in pairs:
            self._d[key] = value

    def __getitem__(self, key: Any) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


class UpperDict(dict[Any, Any]):
    """A dict subclass that changes the keys set on it."""

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key.upper(), value)


@dataclasses.dataclass
class Unregistered:
    a: int
    b: int


def _same(a: Any, b: Any) -> bool:
    """Equal, with the same container types and mapping insertion order everywhere."""
    return bool(a == b) and repr(a) == repr(b)


class TestFlatten:
    @pytest.mark.parametrize("leaf", [None, 1, 2.5, "abc", b"xy", object(), True])
    def test_leaf_root_is_its_only_leaf(self, leaf: Any) -> None:
        """A leaf at the root flattens to itself and the one-leaf treedef."""
        leaves, treedef = flatten(leaf)
        assert leaves == [leaf]
        assert leaves[0] is leaf
        assert isinstance(treedef, TreeDef)
        assert treedef.num_leaves == 1

    def test_none_is_a_leaf(self) -> None:
        """None counts as a leaf inside containers, unlike jax."""
        assert flatten([None, (None,), {"a": None}])[0] == [None, None, None]

    def test_strings_and_bytes_are_leaves(self) -> None:
        """Strings and bytes are not walked into."""
        assert flatten(["ab", b"cd"])[0] == ["ab", b"cd"]

    def test_array_is_a_leaf(self) -> None:
        """A numpy array is one leaf."""
        array = np.arange(3)
        leaves, _ = flatten({"w": array})
        assert len(leaves) == 1
        assert leaves[0] is array

    def test_dataclass_instance_is_a_leaf_unless_registered(self) -> None:
        """An unregistered dataclass instance is one leaf."""
        value = Unregistered(1, 2)
        assert flatten([value])[0] == [value]

    def test_leaves_come_depth_first(self) -> None:
        """Leaves come out depth first, left to right."""
        assert flatten((1, [2, (3, 4)], 5))[0] == [1, 2, 3, 4, 5]

    def test_mapping_leaves_ordered_by_sorted_key(self) -> None:
        """Mapping children come out in sorted-key order, whatever the insertion order."""
        assert flatten({"b": 1, "c": 2, "a": 3})[0] == [3, 1, 2]
        assert flatten({"c": 2, "a": 3, "b": 1})[0] == [3, 1, 2]

    def test_unorderable_keys_sorted_by_type_name_and_repr(self) -> None:
        """Keys that cannot be compared are sorted by (type name, repr)."""
        leaves, _ = flatten({"b": "str b", 2: "int 2", "a": "str a", 1: "int 1"})
        assert leaves == ["int 1", "int 2", "str a", "str b"]

    def test_unorderable_keys_alike_in_type_and_repr_are_refused(self) -> None:
        """Keys that neither compare nor differ by (type name, repr) have no canonical order:
        TypeError naming them, rather than pairing two dicts' values by insertion order."""

        @dataclasses.dataclass(frozen=True)
        class Key:
            name: str
            shard: int = dataclasses.field(repr=False)

        first, second = Key("k", 0), Key("k", 1)
        with pytest.raises(
            TypeError,
            match=r"^dict keys .*Key\(name='k'\) and .*Key\(name='k'\) cannot be put in order",
        ):
            flatten({first: 1, second: 2})
        assert flatten({first: 1})[0] == [1]

    def test_partially_ordered_keys_use_the_fallback_order(self) -> None:
        """Keys that sort without a strict order (frozensets: subset order) are ordered by
        (type name, repr), so dicts built in different orders flatten and pair alike."""
        f1, f2 = frozenset({1}), frozenset({2})
        assert flatten({f2: "two", f1: "one"})[0] == ["one", "two"]
        assert flatten({f1: "one", f2: "two"})[0] == ["one", "two"]
        paired = map_structure(lambda a, b: (a, b), {f1: 1, f2: 2}, {f2: 20, f1: 10})
        assert list(paired.items()) == [(f1, (1, 10)), (f2, (2, 20))]

    def test_partially_ordered_keys_alike_in_type_and_repr_are_refused(self) -> None:
        """Keys that neither order strictly nor differ by (type name, repr) are refused."""
        nan_a, nan_b = float("nan"), float("nan")
        with pytest.raises(TypeError, match=r"^dict keys nan and nan cannot be put in order"):
            flatten({nan_a: 1, nan_b: 2})

    def test_empty_containers_are_not_leaves(self) -> None:
        """Empty containers have no leaves but are kept in the treedef."""
        leaves, treedef = flatten([[], (), {}])
        assert leaves == []
        assert treedef.unflatten([]) == [[], (), {}]

    def test_container_kinds_are_walked(self) -> None:
        """namedtuples, list/tuple subclasses and any Mapping are containers."""
        structure = [
            Point(1, 2),
            MyList([3]),
            MyTuple((4,)),
            MyDict(a=5),
            FrozenMapping(b=6),
            collections.OrderedDict(c=7),
            collections.defaultdict(int, d=8),
        ]
        assert flatten(structure)[0] == [1, 2, 3, 4, 5, 6, 7, 8]

    def test_mapping_views_are_walked_in_iteration_order(self) -> None:
        """As tf.nest: keys(), values() and items() are containers of their items, in
        iteration order (not sorted); items are (key, value) tuples."""
        ordered = collections.OrderedDict([("d", 3), ("b", 1), ("a", 0)])
        assert flatten(ordered.keys())[0] == ["d", "b", "a"]
        assert flatten(ordered.values())[0] == [3, 1, 0]
        assert flatten({"k": ordered.items()})[0] == ["d", 3, "b", 1, "a", 0]
        pairs, _ = flatten_with_path({"y": 1, "x": [2]}.values())
        assert [(format_path(path), leaf) for path, leaf in pairs] == [("[0]", 1), ("[1][0]", 2)]

    def test_type_kind_is_cached_after_first_sight(self) -> None:
        """The first sight of a type records its kind, so later ones are a dict lookup."""

        class Fresh(list[Any]):
            pass

        assert Fresh not in _tree._KINDS
        flatten([Fresh([1])])
        assert _tree._KINDS[Fresh] == _tree._SEQUENCE


class TestUnflatten:
    def test_round_trip_builtin_containers(self) -> None:
        """unflatten(treedef, leaves) rebuilds the flattened structure."""
        structure = {"a": [1, (2, None)], "b": ({"c": "x"},)}
        leaves, treedef = flatten(structure)
        assert _same(unflatten(treedef, leaves), structure)

    def test_accepts_an_example_structure(self) -> None:
        """An example structure stands in for its treedef; its own leaves are ignored."""
        assert unflatten([0, {"k": 0}], ["a", "b"]) == ["a", {"k": "b"}]

    def test_accepts_any_iterable_of_leaves(self) -> None:
        """Leaves may come from a generator."""
        _, treedef = flatten((0, 0))
        assert treedef.unflatten(x for x in "ab") == ("a", "b")

    @pytest.mark.parametrize(("count", "expected"), [(1, 2), (3, 2), (0, 1)])
    def test_wrong_leaf_count_names_expected_and_got(self, count: int, expected: int) -> None:
        """Too few or too many leaves raise ValueError naming both counts."""
        structure: Any = [0, 0] if expected == 2 else None
        with pytest.raises(ValueError, match=rf"expected {expected} leaves .* got {count}$"):
            unflatten(structure, list(range(count)))

    def test_namedtuple_with_custom_new_rebuilds_with_make(self) -> None:
        """A namedtuple whose __new__ takes other arguments is rebuilt with _make."""
        spec = Spec("train", 0.5)
        leaves, treedef = flatten(spec)
        assert leaves == ["train", 0.5, "default"]
        rebuilt = treedef.unflatten(["eval", 1.5, "given"])
        assert type(rebuilt) is Spec
        assert rebuilt == ("eval", 1.5, "given")

    def test_mapping_views_are_rebuilt_as_lists(self) -> None:
        """A view cannot be made from values: it is rebuilt as a list, as tf.nest packs it."""
        structure = {"k": {"b": 1, "a": (2, 3)}.items()}
        leaves, treedef = flatten(structure)
        assert leaves == ["b", 1, "a", 2, 3]
        assert _same(treedef.unflatten(leaves), {"k": [("b", 1), ("a", (2, 3))]})
        assert repr(treedef) == "TreeDef({'k': dict_items([(*, *), (*, (*, *))])})"

    def test_list_and_tuple_subclasses_keep_their_type(self) -> None:
        """Other list/tuple subclasses are rebuilt as type(x)(children)."""
        rebuilt = unflatten([MyList([0]), MyTuple((0, 0))], [1, 2, 3])
        assert type(rebuilt[0]) is MyList
        assert type(rebuilt[1]) is MyTuple
        assert rebuilt == [[1], (2, 3)]

    def test_dict_keeps_insertion_order_of_reference(self) -> None:
        """Rebuilding keeps the reference structure's key order, not the sorted order."""
        rebuilt = unflatten({"b": 0, "a": 0, "c": 0}, [1, 2, 3])
        assert list(rebuilt.items()) == [("b", 2), ("a", 1), ("c", 3)]

    def test_defaultdict_keeps_default_factory(self) -> None:
        """A defaultdict is rebuilt with its default_factory."""
        rebuilt = unflatten(collections.defaultdict(list, {"a": 0}), [1])
        assert type(rebuilt) is collections.defaultdict
        assert rebuilt.default_factory is list
        assert rebuilt["missing"] == []

    def test_mappings_keep_their_type(self) -> None:
        """dict subclasses and other Mappings keep their type and the reference's key order."""
        ordered = unflatten(collections.OrderedDict([("b", 0), ("a", 0)]), [1, 2])
        assert type(ordered) is collections.OrderedDict
        assert list(ordered.items()) == [("b", 2), ("a", 1)]
        assert type(unflatten(MyDict(a=0), [1])) is MyDict
        mapping = unflatten(FrozenMapping(a=0, b=0), [1, 2])
        assert type(mapping) is FrozenMapping
        assert dict(mapping) == {"a": 1, "b": 2}
        proxy = unflatten(types.MappingProxyType({"b": 0, "a": 0}), [1, 2])
        assert type(proxy) is types.MappingProxyType
        assert list(proxy.items()) == [("b", 2), ("a", 1)]

    def test_mutable_mapping_is_made_empty_then_filled(self) -> None:
        """A MutableMapping is rebuilt as type(m)() and filled key by key, in the reference's
        order, so a dict subclass whose constructor does not take the items keeps them."""
        tagged = TaggedDict("t", {"b": 0, "a": 0})
        rebuilt = unflatten(tagged, [1, 2])
        assert type(rebuilt) is TaggedDict
        assert list(rebuilt.items()) == [("b", 2), ("a", 1)]
        assert map_structure(lambda x: x + 1, TaggedDict("t", {"a": 1}))["a"] == 2
        no_arg = NoArgDict()
        no_arg["k"] = 0
        rebuilt_no_arg = unflatten(no_arg, [5])
        assert (type(rebuilt_no_arg), dict(rebuilt_no_arg)) == (NoArgDict, {"k": 5})

    def test_defaultdict_subclass_keeps_default_factory(self) -> None:
        """A defaultdict subclass is made empty, given the reference's default_factory and
        filled."""
        factory_dict = FactoryDict()
        factory_dict["a"] = 0
        factory_dict.default_factory = dict
        rebuilt = unflatten(factory_dict, [7])
        assert type(rebuilt) is FactoryDict
        assert (dict(rebuilt), rebuilt.default_factory) == ({"a": 7}, dict)

    def test_other_mapping_is_given_key_value_pairs(self) -> None:
        """A Mapping that is not mutable is rebuilt as type(m)(pairs), the (key, value)
        pairs in the reference's order (two-character keys are not split into pairs)."""
        rebuilt = map_structure(lambda x: x * 10, PairsMapping([("wb", 1), ("xy", 2)]))
        assert type(rebuilt) is PairsMapping
        assert list(rebuilt.items()) == [("wb", 10), ("xy", 20)]

    def test_rebuilt_mapping_with_other_keys_is_refused(self) -> None:
        """A mapping whose rebuild does not hold exactly the reference's keys raises TypeError
        naming the type, both key sets and the fix, instead of losing values."""
        upper = UpperDict()
        dict.__setitem__(upper, "a", 0)
        _, treedef = flatten(upper)
        with pytest.raises(
            TypeError,
            match=r"^cannot rebuild mapping type UpperDict: .* holds the keys 'A' instead of 'a'"
            r".*register_node",
        ):
            treedef.unflatten([1])

    def test_unbuildable_mapping_advises_register_node(self) -> None:
        """A Mapping whose constructor rejects a dict raises TypeError advising register_node."""
        leaves, treedef = flatten(KeywordOnlyMapping(items=(("a", 1),)))
        assert leaves == [1]
        with pytest.raises(TypeError, match=r"cannot rebuild .*KeywordOnlyMapping.*register_node"):
            treedef.unflatten([2])


class TestTreeDef:
    def test_equal_treedefs_for_equal_structures(self) -> None:
        """Same structure, different leaves: equal treedefs with equal hashes."""
        a = flatten({"x": [1, 2], "y": (3,)})[1]
        b = flatten({"x": ["p", "q"], "y": (None,)})[1]
        assert a == b
        assert hash(a) == hash(b)
        assert len({a, b}) == 1

    def test_mapping_insertion_order_is_not_compared(self) -> None:
        """Mappings with the same keys in another order give equal treedefs."""
        assert flatten({"a": 1, "b": 2})[1] == flatten({"b": 2, "a": 1})[1]

    @pytest.mark.parametrize(
        ("a", "b"),
        [
            ([1, 2], (1, 2)),
            ([1, 2], [1]),
            ({"a": 1}, {"b": 1}),
            (Point(1, 2), (1, 2)),
            ([1], [[1]]),
            ({"a": 1}, MyDict(a=1)),
        ],
    )
    def test_different_structures_give_unequal_treedefs(self, a: Any, b: Any) -> None:
        """Container type, length, keys and nesting are all compared."""
        assert flatten(a)[1] != flatten(b)[1]

    def test_not_equal_to_other_objects(self) -> None:
        """A treedef is never equal to a non-treedef."""
        assert flatten([1])[1] != [1]

    def test_is_immutable(self) -> None:
        """Attributes cannot be set or deleted."""
        treedef = flatten([1])[1]
        with pytest.raises(AttributeError, match="immutable"):
            treedef._root = None
        with pytest.raises(AttributeError, match="immutable"):
            del treedef._root

    def test_num_leaves(self) -> None:
        """num_leaves counts every leaf, None included."""
        assert flatten([1, (None, {"a": 2})])[1].num_leaves == 3
        assert flatten([])[1].num_leaves == 0

    @pytest.mark.parametrize(
        ("structure", "text"),
        [
            (1, "TreeDef(*)"),
            ([1, (2,), {"b": 3, "a": None}], "TreeDef([*, (*,), {'b': *, 'a': *}])"),
            (Point(1, [2]), "TreeDef(Point(x=*, y=[*]))"),
            (MyList([1]), "TreeDef(MyList([*]))"),
            (collections.OrderedDict(a=1), "TreeDef(OrderedDict({'a': *}))"),
            (collections.defaultdict[str, Any](list, a=1), "TreeDef(defaultdict(list, {'a': *}))"),
        ],
    )
    def test_repr_draws_the_structure(self, structure: Any, text: str) -> None:
        """repr shows containers with * for each leaf."""
        assert repr(flatten(structure)[1]) == text

    def test_pickles(self) -> None:
        """A treedef of built-in containers survives pickling."""
        treedef = flatten({"a": [1, Point(2, 3)], "b": collections.OrderedDict(c=4)})[1]
        restored = pickle.loads(pickle.dumps(treedef))
        assert restored == treedef
        assert hash(restored) == hash(treedef)
        assert repr(restored) == repr(treedef)


class TestFlattenWithPath:
    def test_paths_for_every_container_kind(self) -> None:
        """Sequences give [i], mappings [repr(key)], namedtuples .field."""
        pairs, _ = flatten_with_path([10, {"c": Point(20, (30,))}])
        assert pairs == [
            ((SequenceKey(0),), 10),
            ((SequenceKey(1), MappingKey("c"), AttrKey("x")), 20),
            ((SequenceKey(1), MappingKey("c"), AttrKey("y"), SequenceKey(0)), 30),
        ]

    def test_order_and_treedef_match_flatten(self) -> None:
        """Leaves come in the same order, with the same treedef, as flatten."""
        structure = {"b": [1, 2], "a": {"d": 3, "c": 4}}
        pairs, treedef = flatten_with_path(structure)
        leaves, expected = flatten(structure)
        assert [leaf for _, leaf in pairs] == leaves
        assert treedef == expected

    def test_root_leaf_has_the_empty_path(self) -> None:
        """A leaf at the root has path ()."""
        assert flatten_with_path(None) == ([((), None)], flatten(None)[1])


class TestFormatPath:
    def test_joins_entries(self) -> None:
        """Entries are shown as [i], [repr(key)] and .name."""
        path = (SequenceKey(1), MappingKey("c"), MappingKey(2), AttrKey("x"))
        assert format_path(path) == "[1]['c'][2].x"

    def test_root_is_the_empty_string(self) -> None:
        """The root path formats to the empty string."""
        assert format_path(()) == ""

    def test_messages_show_the_root_as_root(self) -> None:
        """describe_path shows the root as <root>."""
        assert describe_path(()) == "<root>"
        assert describe_path((SequenceKey(0),)) == "[0]"


class TestAssertSameStructure:
    def test_same_structure_passes(self) -> None:
        """Different leaves and mapping key order do not matter."""
        assert_same_structure({"a": [1, None], "b": 2}, {"b": "x", "a": ["y", 3.0]})

    def test_container_types_differ_is_type_error(self) -> None:
        """Different container types raise TypeError naming the path and both types."""
        message = (
            "structures differ at [1]['c']: the first has a list of 3 items, "
            "the second a tuple of 3 items"
        )
        with pytest.raises(TypeError, match=re.escape(message)):
            assert_same_structure([0, {"c": [1, 2, 3]}], [0, {"c": (1, 2, 3)}])

    def test_namedtuple_against_tuple_is_type_error(self) -> None:
        """A namedtuple and a plain tuple are different container types."""
        with pytest.raises(TypeError, match=r"at \['p'\]: the first has a Point of 2 items"):
            assert_same_structure({"p": Point(1, 2)}, {"p": (1, 2)})

    def test_classes_from_one_definition_run_twice(self) -> None:
        """Two namedtuple classes made by one function print alike; the message says they are
        different classes and how to make them one."""
        first, second = make_point_class(), make_point_class()
        with pytest.raises(TypeError) as info:
            assert_same_structure([first(1, 2)], [second(1, 2)])
        assert str(info.value) == (
            "structures differ at [0]: the first has a Point of 2 items, the second a Point of "
            "2 items: two different classes, both test_tree.Point (a class or namedtuple made "
            "inside a function is a new class on every call: define it once, at module level)"
        )

    def test_different_classes_with_one_name(self) -> None:
        """Classes of one name from different places are named in full."""
        other = collections.namedtuple("Point", ["x", "y"])  # type: ignore[name-match]
        other.__module__ = "elsewhere"
        with pytest.raises(TypeError) as info:
            assert_same_structure(Point(1, 2), other(1, 2))
        assert str(info.value).endswith(
            "the first has a Point of 2 items, the second a Point of 2 items: two different "
            "classes with the same name, test_tree.Point and elsewhere.Point"
        )

    def test_namedtuples_of_one_name_with_other_fields(self) -> None:
        """Two namedtuple classes of one name defined apart: the message names the fields
        of each, without the hint about classes made inside functions."""
        with pytest.raises(TypeError) as info:
            assert_same_structure([SameNameAB(0, 1)], [SameNameAC(2, 3)])
        assert str(info.value) == (
            "structures differ at [0]: the first has a SameName of 2 items, the second a "
            "SameName of 2 items: two different classes, both test_tree.SameName; their fields "
            "differ: the first has fields ('a', 'b'), the second fields ('a', 'c')"
        )

    def test_replicas_returning_namedtuples_with_other_fields(self) -> None:
        """regroup, which run() results go through, names the replicas and their fields."""
        with pytest.raises(TypeError) as info:
            aioreplica.regroup((SameNameAB(0, 1), SameNameAC(2, 3)))
        assert str(info.value) == (
            "replica 1's value differs from replica 0's at <root>: replica 0 has a SameName of "
            "2 items, replica 1 a SameName of 2 items: two different classes, both "
            "test_tree.SameName; their fields differ: replica 0 has fields ('a', 'b'), "
            "replica 1 fields ('a', 'c'); every replica must return the same structure"
        )

    def test_different_classes_with_one_name_and_other_fields(self) -> None:
        """Classes of one name from different places, fields apart: both are said."""
        other = collections.namedtuple("Point", ["x", "z"])  # type: ignore[name-match]
        other.__module__ = "elsewhere"
        with pytest.raises(TypeError) as info:
            assert_same_structure(Point(1, 2), other(1, 2))
        assert str(info.value).endswith(
            "two different classes with the same name, test_tree.Point and elsewhere.Point; "
            "their fields differ: the first has fields ('x', 'y'), the second fields ('x', 'z')"
        )

    def test_lengths_differ_is_value_error(self) -> None:
        """Different lengths raise ValueError naming both lengths."""
        message = (
            "structures differ at [0]: the first has a list of 2 items, the second a list of 1 item"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            assert_same_structure([[1, 2]], [[1]])

    def test_container_against_leaf_is_value_error(self) -> None:
        """A container facing a leaf raises ValueError, whichever side has the leaf."""
        with pytest.raises(
            ValueError,
            match=re.escape("the first has a list of 1 item, the second a leaf 5 of type int"),
        ):
            assert_same_structure([[1]], [5])
        with pytest.raises(
            ValueError,
            match=re.escape("the first has a leaf None of type NoneType, the second a dict"),
        ):
            assert_same_structure([None], [{}])

    def test_keys_differ_names_keys_on_each_side(self) -> None:
        """Different key sets raise ValueError naming the keys only on each side."""
        message = (
            "structures differ at [1]: keys differ: 'x' only in the first, 'y' only in the second"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            assert_same_structure([0, {"x": 1, "k": 2}], [0, {"k": 2, "y": 1}])

    def test_keys_missing_on_one_side_only(self) -> None:
        """Keys only in the second are listed alone."""
        with pytest.raises(ValueError, match=r"keys differ: 'a', 'b' only in the second$"):
            assert_same_structure({}, {"b": 1, "a": 2})

    def test_root_is_shown_as_root(self) -> None:
        """A mismatch at the root is reported at <root>."""
        with pytest.raises(TypeError, match=r"^structures differ at <root>: "):
            assert_same_structure([1], (1,))

    def test_registered_aux_data_differ_is_value_error(self) -> None:
        """Registered nodes with different aux data do not match."""

        class Tagged:
            def __init__(self, tag: str, value: Any) -> None:
                self.tag, self.value = tag, value

        register_node(Tagged, lambda t: ((t.value,), t.tag), lambda tag, ch: Tagged(tag, *ch))
        with pytest.raises(
            ValueError,
            match=r"at \[0\]: the first has a Tagged node with aux data 'a', "
            r"the second with aux data 'b'$",
        ):
            assert_same_structure([Tagged("a", 1)], [Tagged("b", 1)])

    def test_aux_data_that_do_not_compare_to_a_bool_are_named(self) -> None:
        """Registered aux data whose == gives no bool (an array) raise TypeError saying what
        aux data must be, not NumPy's ambiguous-truth error."""

        class Meta:
            def __init__(self, meta: Any, value: Any) -> None:
                self.meta, self.value = meta, value

        register_node(Meta, lambda m: ((m.value,), m.meta), lambda meta, ch: Meta(meta, *ch))
        first, second = Meta(np.array([1, 2]), 1), Meta(np.array([1, 3]), 2)
        message = r"cannot compare the aux data of two Meta nodes.*hashable.*a tuple"
        with pytest.raises(TypeError, match=message):
            assert_same_structure([first], [second])
        with pytest.raises(TypeError, match=message):
            find_mismatch(first, second)


class TestMapStructure:
    def test_maps_a_single_structure(self) -> None:
        """fn is applied to each leaf, None included, and the structure is kept."""
        result = map_structure(repr, {"a": [1, None], "b": Point("x", ())})
        assert _same(result, {"a": ["1", "None"], "b": Point("'x'", ())})

    def test_maps_several_structures_leaf_by_leaf(self) -> None:
        """Leaves at the same place are passed together."""
        assert map_structure(lambda a, b, c: a + b + c, [1, (2,)], [10, (20,)], [100, (200,)]) == [
            111,
            (222,),
        ]

    def test_mapping_key_order_does_not_matter(self) -> None:
        """Mappings are matched by key; the result keeps the first one's order."""
        result = map_structure(lambda a, b: (a, b), {"b": 1, "a": 2}, {"a": "A", "b": "B"})
        assert list(result.items()) == [("b", (1, "B")), ("a", (2, "A"))]

    def test_mismatch_names_argument_position_and_path(self) -> None:
        """A structure that differs names its position among the structures and the path."""
        message = (
            "map_structure(): structures[2] differs from structures[0] at [1]['c']: "
            "structures[0] has a list of 2 items, structures[2] a list of 1 item"
        )
        good = [0, {"c": [1, 2]}]
        with pytest.raises(ValueError, match=re.escape(message)):
            map_structure(lambda *xs: xs, good, good, [0, {"c": [1]}])

    def test_container_type_mismatch_is_type_error(self) -> None:
        """Containers of different types at the same path raise TypeError."""
        with pytest.raises(
            TypeError, match=r"structures\[1\] differs from structures\[0\] at <root>"
        ):
            map_structure(lambda a, b: a, [1], (1,))

    def test_needs_at_least_one_structure(self) -> None:
        """Calling with fn alone raises TypeError."""
        with pytest.raises(TypeError, match="needs at least one structure"):
            map_structure(repr)


class TestMapStructureWithPath:
    def test_fn_gets_the_key_path_tuple(self) -> None:
        """fn receives the key path as a tuple of entries, then the leaves."""
        result = map_structure_with_path(
            lambda path, a, b: f"{format_path(path)}:{a}{b}", [1, {"c": 2}], [3, {"c": 4}]
        )
        assert result == ["[0]:13", {"c": "[1]['c']:24"}]

    def test_root_leaf_gets_the_empty_path(self) -> None:
        """A leaf at the root is passed the path ()."""
        assert map_structure_with_path(lambda path, x: (path, x), 7) == ((), 7)

    def test_mismatch_names_the_function(self) -> None:
        """The mismatch message names map_structure_with_path."""
        with pytest.raises(ValueError, match=r"^map_structure_with_path\(\): structures\[1\]"):
            map_structure_with_path(lambda path, a, b: a, [1], [1, 2])


class TestRegisterNode:
    def test_registered_type_flattens_and_rebuilds(self) -> None:
        """Children come from flatten_fn and the node is rebuilt by unflatten_fn."""

        class Box:
            def __init__(self, scale: int, *items: Any) -> None:
                self.scale, self.items = scale, items

        register_node(Box, lambda b: (b.items, b.scale), lambda scale, ch: Box(scale, *ch))
        leaves, treedef = flatten([Box(3, 1, [2])])
        assert leaves == [1, 2]
        assert repr(treedef) == "TreeDef([Box[3](*, [*])])"
        rebuilt = treedef.unflatten(["a", "b"])[0]
        assert type(rebuilt) is Box
        assert (rebuilt.scale, rebuilt.items) == (3, ("a", ["b"]))

    def test_registered_children_have_positional_paths(self) -> None:
        """Registered children are shown as [i]."""

        class Two:
            def __init__(self, a: Any, b: Any) -> None:
                self.a, self.b = a, b

        register_node(Two, lambda t: ((t.a, t.b), None), lambda _, ch: Two(*ch))
        pairs, _ = flatten_with_path({"t": Two(1, 2)})
        assert [format_path(path) for path, _ in pairs] == ["['t'][0]", "['t'][1]"]

    def test_registering_twice_raises(self) -> None:
        """A type can be registered only once."""

        class Once:
            pass

        register_node(Once, lambda o: ((), None), lambda _, ch: Once())
        with pytest.raises(ValueError, match="Once is already registered"):
            register_node(Once, lambda o: ((), None), lambda _, ch: Once())

    @pytest.mark.parametrize(
        "container",
        [list, tuple, dict, collections.OrderedDict, collections.defaultdict],
    )
    def test_builtin_container_cannot_be_registered(self, container: type) -> None:
        """Registering a built-in container raises ValueError."""
        with pytest.raises(ValueError, match=f"{container.__qualname__} is a built-in container"):
            register_node(container, lambda x: ((), None), lambda _, ch: container())

    def test_non_class_raises_type_error(self) -> None:
        """Only classes can be registered."""
        with pytest.raises(TypeError, match="needs a class, got 3 of type int"):
            register_node(3, lambda x: ((), None), lambda _, ch: 3)  # type: ignore[arg-type]

    def test_non_callable_functions_raise_type_error(self) -> None:
        """flatten_fn and unflatten_fn must be callable."""

        class Bad:
            pass

        with pytest.raises(TypeError, match="needs callable flatten_fn and unflatten_fn"):
            register_node(Bad, None, None)  # type: ignore[arg-type]

    def test_registration_does_not_cover_subclasses(self) -> None:
        """A subclass of a registered type is still a leaf."""

        class Base:
            pass

        class Derived(Base):
            pass

        register_node(Base, lambda b: ((), None), lambda _, ch: Base())
        assert not is_leaf(Base())
        assert is_leaf(Derived())

    def test_type_seen_as_leaf_before_registering_becomes_a_node(self) -> None:
        """Registration overrides a kind cached from an earlier sight."""

        class Late:
            def __init__(self, v: Any) -> None:
                self.v = v

        assert is_leaf(Late(1))
        register_node(Late, lambda x: ((x.v,), None), lambda _, ch: Late(*ch))
        assert flatten(Late(5))[0] == [5]

    def test_mapping_with_unusual_constructor_can_be_registered(self) -> None:
        """Registering a Mapping subclass replaces the built-in mapping handling."""

        class Odd(KeywordOnlyMapping):
            pass

        register_node(
            Odd,
            lambda m: (tuple(m.values()), tuple(m)),
            lambda keys, ch: Odd(items=tuple(zip(keys, ch, strict=True))),
        )
        rebuilt = map_structure(lambda v: v * 10, Odd(items=(("a", 1), ("b", 2))))
        assert type(rebuilt) is Odd
        assert dict(rebuilt) == {"a": 10, "b": 20}


class TestRegisterDataclass:
    def test_fields_become_children_with_attribute_paths(self) -> None:
        """The fields, in order, are the children, with paths .name."""

        @dataclasses.dataclass
        class Batch:
            y: Any
            x: Any

        assert register_dataclass(Batch) is Batch
        pairs, treedef = flatten_with_path(Batch(y=[1], x=2))
        assert [(format_path(p), leaf) for p, leaf in pairs] == [(".y[0]", 1), (".x", 2)]
        assert repr(treedef) == "TreeDef(Batch(y=[*], x=*))"
        assert treedef.unflatten([3, 4]) == Batch(y=[3], x=4)

    def test_works_as_a_decorator_on_frozen_dataclasses(self) -> None:
        """A frozen dataclass is rebuilt through its constructor."""

        @register_dataclass
        @dataclasses.dataclass(frozen=True)
        class Params:
            w: Any
            b: Any = 0

        assert map_structure(lambda v: v + 1, Params(w=1, b=2)) == Params(w=2, b=3)

    def test_non_dataclass_raises_type_error(self) -> None:
        """Only dataclass types can be registered this way."""
        with pytest.raises(TypeError, match=r"needs a dataclass type, got .* of type Unregistered"):
            register_dataclass(Unregistered(1, 2))  # type: ignore[arg-type]

    def test_init_false_field_raises_value_error(self) -> None:
        """A field that the constructor does not take cannot be rebuilt."""

        @dataclasses.dataclass
        class Cached:
            a: int
            total: int = dataclasses.field(init=False, default=0)

        with pytest.raises(ValueError, match=r"fields \['total'\] are init=False.*register_node"):
            register_dataclass(Cached)

    def test_registering_twice_raises(self) -> None:
        """A dataclass can be registered only once."""

        @dataclasses.dataclass
        class Twice:
            a: int

        register_dataclass(Twice)
        with pytest.raises(ValueError, match="Twice is already registered"):
            register_dataclass(Twice)


class TestIsLeaf:
    @pytest.mark.parametrize(
        "value",
        [None, 0, 1.5, "s", b"b", np.zeros(2), Unregistered(1, 2), object(), {1, 2}],
    )
    def test_leaves(self, value: Any) -> None:
        """Non-containers are leaves, sets and unregistered dataclasses included."""
        assert is_leaf(value)

    @pytest.mark.parametrize(
        "value", [[], (), {}, Point(1, 2), MyList(), FrozenMapping(), collections.OrderedDict()]
    )
    def test_containers(self, value: Any) -> None:
        """Containers are not leaves, even when empty."""
        assert not is_leaf(value)


class TestMismatchHelpers:
    def test_node_mismatch_uses_the_given_names(self) -> None:
        """The names given for each side appear in the message."""
        assert _tree._node_mismatch([1], (1,), first="replica 0", second="replica 3") == (
            TypeError,
            "replica 0 has a list of 1 item, replica 3 a tuple of 1 item",
        )

    def test_node_mismatch_ignores_children(self) -> None:
        """Only the top level is compared."""
        assert _tree._node_mismatch([[1]], [(1,)]) is None
        assert _tree._node_mismatch(1, "a") is None

    def test_find_mismatch_returns_path(self) -> None:
        """The first difference, depth first, comes with its path."""
        found = find_mismatch({"a": [1, {"b": 1}]}, {"a": [1, {"c": 1}]})
        assert found == (
            ValueError,
            (MappingKey("a"), SequenceKey(1)),
            "keys differ: 'b' only in the first, 'c' only in the second",
        )
        assert find_mismatch([1, {"a": 2}], [3, {"a": 4}]) is None


class TestNestModule:
    def test_jax_style_pair_is_the_tree_walk(self) -> None:
        """aioreplica.nest's JAX-style functions give what _tree's give; its tf.nest functions
        are built on them (tested in test_nest.py)."""
        structure = {"b": [1, None], "a": Point(2, "s")}
        assert nest.flatten_with_treedef(structure) == flatten(structure)
        assert nest.flatten_with_key_paths(structure) == flatten_with_path(structure)[0]
        assert nest.flatten(structure) == flatten(structure)[0]
        treedef = flatten(structure)[1]
        assert nest.unflatten(treedef, [5, 6, 7, 8]) == unflatten(treedef, [5, 6, 7, 8])
        for name in ("AttrKey", "MappingKey", "SequenceKey", "TreeDef", "format_path", "is_leaf"):
            assert getattr(nest, name) is getattr(_tree, name)


structures = nested_strategies.structures(max_leaves=12)


class TestProperties:
    @settings(max_examples=150, deadline=None, database=None)
    @given(structures)
    def test_unflatten_inverts_flatten(self, structure: Any) -> None:
        """unflatten(treedef, flatten(x)[0]) == x, types and key order included."""
        leaves, treedef = flatten(structure)
        assert treedef.num_leaves == len(leaves)
        assert _same(unflatten(treedef, leaves), structure)

    @settings(max_examples=100, deadline=None, database=None)
    @given(structures)
    def test_paths_match_leaves(self, structure: Any) -> None:
        """Each path from flatten_with_path leads to its leaf."""
        pairs, _ = flatten_with_path(structure)
        for path, leaf in pairs:
            value = structure
            for entry in path:
                if isinstance(entry, SequenceKey):
                    value = value[entry.index]
                elif isinstance(entry, MappingKey):
                    value = value[entry.key]
                else:
                    value = getattr(value, entry.name)
            assert value is leaf

    @settings(max_examples=100, deadline=None, database=None)
    @given(structures, st.randoms(use_true_random=False))
    def test_mapping_order_never_matters(self, structure: Any, random: Any) -> None:
        """Shuffling every dict's insertion order keeps the treedef and the leaf order."""

        def shuffle(x: Any) -> Any:
            if isinstance(x, dict):
                items = [(k, shuffle(v)) for k, v in x.items()]
                random.shuffle(items)
                return dict(items)
            level = _tree._level(x)
            return x if level is None else level.rebuild(shuffle(c) for c in level.children)

        shuffled = shuffle(structure)
        assert flatten(shuffled) == flatten(structure)
        assert_same_structure(structure, shuffled)

    @settings(max_examples=50, deadline=None, database=None)
    @given(structures)
    def test_treedef_equality_agrees_with_assert_same_structure(self, structure: Any) -> None:
        """A structure with one leaf wrapped in a list differs, and is reported at a path."""
        leaves, treedef = flatten(structure)
        if not leaves:
            return
        changed = treedef.unflatten([[leaves[0]], *leaves[1:]])
        assert flatten(changed)[1] != treedef
        with pytest.raises(ValueError, match=r"^structures differ at "):
            assert_same_structure(structure, changed)
