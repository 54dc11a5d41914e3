"""Tests for aioreplica.nest: tf.nest's functions and meanings, and the JAX-style pair."""

from __future__ import annotations

import collections
import dataclasses
import re
import types
from typing import Any, NamedTuple

import nested_strategies
import numpy as np
import pytest
from hypothesis import given, settings

from aioreplica import nest


class Point(NamedTuple):
    x: Any
    y: Any


@nest.register_dataclass
@dataclasses.dataclass
class Batch:
    features: Any
    label: Any


class ListWrapper(list[Any]):
    """A list subclass, as trackable wrappers in tf are."""


# tf.nest's test namedtuples: two classes of one name and fields, and two with other fields.
SameNameAB = collections.namedtuple("same_name", ("a", "b"))  # type: ignore[name-match]
SameNameAB2 = collections.namedtuple("same_name", ("a", "b"))  # type: ignore[name-match]
SameNameXY = collections.namedtuple("same_name", ("x", "y"))  # type: ignore[name-match]
ABTuple = collections.namedtuple("ab_tuple", "a, b")  # type: ignore[name-match]
OpTuple = collections.namedtuple("op_tuple", "add, mul")  # type: ignore[name-match]
Foo = collections.namedtuple("Foo", ["a", "b"])
Bar = collections.namedtuple("Bar", ["c", "d"])


ARRAY = np.arange(3)


def make_structure(array: np.ndarray[Any, Any] = ARRAY) -> dict[str, Any]:
    """A dict with unsorted keys holding a list, a tuple, a namedtuple, an empty tuple, None,
    an array leaf and a string leaf."""
    return {"zeta": [1, (2.5, None)], "alpha": Point(x="text", y=array), "mid": ()}


#: make_structure()'s leaves in flatten order: keys sorted (alpha, mid, zeta), depth first.
LEAVES: list[Any] = ["text", ARRAY, 1, 2.5, None]


def snapshot(x: Any) -> Any:
    """A comparable picture of `x`: container types, dict key order and leaves (arrays by id).

    ``==`` on the structures themselves would let a namedtuple equal a tuple, ignore dict order
    and fail on arrays.
    """
    if isinstance(x, dict):
        return (type(x), [(key, snapshot(value)) for key, value in x.items()])
    if isinstance(x, list | tuple):
        return (type(x), [snapshot(child) for child in x])
    if isinstance(x, Batch):
        return (Batch, snapshot(x.features), snapshot(x.label))
    if isinstance(x, np.ndarray):
        return ("array", id(x))
    return ("leaf", type(x), x)


def as_lists(x: Any) -> Any:
    """`x` with every list, tuple and namedtuple rebuilt as a list, at every depth."""
    if isinstance(x, dict):
        return {key: as_lists(value) for key, value in x.items()}
    if isinstance(x, list | tuple):
        return [as_lists(child) for child in x]
    return x


class TestFlatten:
    def test_returns_the_list_of_leaves(self) -> None:
        """Leaves come out depth first with dict keys sorted; None, arrays and strings are
        leaves; the empty tuple contributes none."""
        flat = nest.flatten(make_structure())
        assert type(flat) is list
        assert snapshot(flat) == snapshot(LEAVES)

    def test_iterating_the_result_visits_the_leaves(self) -> None:
        """``for x in nest.flatten(s)`` walks the leaves, not a (leaves, treedef) pair."""
        seen = []
        for leaf in nest.flatten([10, {"b": 30, "a": 20}]):
            seen.append(leaf)  # noqa: PERF402 (the for statement is what is tested)
        assert seen == [10, 20, 30]

    @pytest.mark.parametrize(
        "leaf",
        [None, 7, "abc", b"xy", ARRAY, Batch],
        ids=["none", "int", "str", "bytes", "array", "class"],
    )
    def test_a_leaf_alone_becomes_a_one_item_list(self, leaf: Any) -> None:
        """As tf.nest: ``flatten(None) == [None]``, ``flatten("abc") == ["abc"]``."""
        flat = nest.flatten(leaf)
        assert type(flat) is list
        assert len(flat) == 1
        assert flat[0] is leaf

    def test_empty_containers_have_no_leaves(self) -> None:
        """``[]``, ``()`` and ``{}`` flatten to nothing, however deep."""
        assert nest.flatten([(), {}, [[]]]) == []

    def test_registered_dataclass_fields_in_definition_order(self) -> None:
        """A registered dataclass is a container of its fields, in definition order."""
        assert nest.flatten(Batch(features=[1, 2], label={"b": 4, "a": 3})) == [1, 2, 3, 4]

    def test_expand_composites_is_accepted(self) -> None:
        """Code written for tf.nest may pass ``expand_composites``; nothing changes."""
        assert nest.flatten({"b": 1, "a": 2}, expand_composites=True) == [2, 1]


class TestPackSequenceAs:
    def test_rebuilds_the_structure_from_leaves(self) -> None:
        """Leaves go back in flatten order; container types and dict key order are kept."""
        packed = nest.pack_sequence_as(make_structure(), ["T", "A", 10, 20, 30])
        expected = {"zeta": [10, (20, 30)], "alpha": Point(x="T", y="A"), "mid": ()}
        assert snapshot(packed) == snapshot(expected)

    def test_round_trip(self) -> None:
        """``pack_sequence_as(s, flatten(s))`` rebuilds `s`, leaves included."""
        structure = make_structure(np.ones(2))
        assert snapshot(nest.pack_sequence_as(structure, nest.flatten(structure))) == snapshot(
            structure
        )

    @settings(max_examples=100, deadline=None, database=None)
    @given(nested_strategies.structures(max_leaves=12))
    def test_round_trip_property(self, structure: Any) -> None:
        """The round trip holds for random lists, tuples, dicts and namedtuples."""
        assert snapshot(nest.pack_sequence_as(structure, nest.flatten(structure))) == snapshot(
            structure
        )

    def test_a_tuple_of_leaves_is_accepted(self) -> None:
        """`flat_sequence` may be a tuple; the leaves themselves may be containers."""
        assert nest.pack_sequence_as([0, (0,)], ([1, 2], {"a": 3})) == [[1, 2], ({"a": 3},)]

    def test_a_leaf_structure_takes_the_one_item(self) -> None:
        """As tf.nest: a non-nested structure packs a one-item sequence into its item."""
        assert nest.pack_sequence_as(None, ["x"]) == "x"
        assert nest.pack_sequence_as("template", [[1, 2]]) == [1, 2]

    def test_registered_dataclass(self) -> None:
        """Registered dataclasses are rebuilt with their own class."""
        packed = nest.pack_sequence_as(Batch(features=0, label=[0]), ["f", "l"])
        assert snapshot(packed) == snapshot(Batch(features="f", label=["l"]))

    @pytest.mark.parametrize(("count", "word"), [(4, "items"), (6, "items"), (1, "item")])
    def test_wrong_count_says_how_many(self, count: int, word: str) -> None:
        """Too few or too many leaves: ValueError naming the expected and the given count."""
        with pytest.raises(
            ValueError, match=rf"has 5 leaves, but flat_sequence has {count} {word}\b"
        ):
            nest.pack_sequence_as(make_structure(), list(range(count)))

    def test_a_leaf_structure_with_two_items_is_refused(self) -> None:
        """A leaf structure takes exactly one item."""
        with pytest.raises(ValueError, match="has 1 leaf, but flat_sequence has 2 items"):
            nest.pack_sequence_as(None, [1, 2])

    @pytest.mark.parametrize(
        "flat",
        [np.arange(2), 5, "ab", {"a": 1, "b": 2}, iter([1, 2])],
        ids=["array", "int", "str", "dict", "iterator"],
    )
    def test_flat_sequence_must_be_a_list_or_tuple(self, flat: Any) -> None:
        """A flat_sequence that is not a list or tuple: TypeError naming its type."""
        with pytest.raises(TypeError, match=rf"got .* of type {type(flat).__name__}"):
            nest.pack_sequence_as([0, 0], flat)


class TestMapStructure:
    def test_one_structure(self) -> None:
        """`func` sees each leaf once, in flatten order; the result keeps types and key order."""
        calls: list[Any] = []

        def describe(leaf: Any) -> str:
            calls.append(leaf)
            return type(leaf).__name__

        result = nest.map_structure(describe, make_structure())
        expected = {
            "zeta": ["int", ("float", "NoneType")],
            "alpha": Point(x="str", y="ndarray"),
            "mid": (),
        }
        assert snapshot(result) == snapshot(expected)
        assert snapshot(calls) == snapshot(LEAVES)

    def test_several_structures_pair_leaves_by_position_and_key(self) -> None:
        """Leaves at the same place are passed together; dict key order does not matter."""
        result = nest.map_structure(
            lambda a, b: a + b, {"b": [1, 2], "a": Point(3, 4)}, {"a": Point(30, 40), "b": [10, 20]}
        )
        assert snapshot(result) == snapshot({"b": [11, 22], "a": Point(33, 44)})

    def test_a_tuple_returned_by_func_is_a_leaf_of_the_result(self) -> None:
        """The result has the shape of the inputs, whatever `func` returns."""
        assert nest.map_structure(lambda a, b: (a, b), [1, None], ["x", "y"]) == [
            (1, "x"),
            (None, "y"),
        ]

    def test_a_leaf_structure(self) -> None:
        """A leaf on its own is mapped directly."""
        assert nest.map_structure(lambda a, b: a * b, 3, 4) == 12

    def test_different_lengths_name_the_path(self) -> None:
        """ValueError naming the structure and the key path where they differ."""
        with pytest.raises(
            ValueError, match=re.escape("structures[1] differs from structures[0] at ['a']")
        ):
            nest.map_structure(lambda a, b: a, {"a": [1, 2]}, {"a": [1]})

    def test_third_structure_named(self) -> None:
        """The message names which structure differs."""
        with pytest.raises(
            ValueError, match=re.escape("structures[2] differs from structures[0] at [1]")
        ):
            nest.map_structure(lambda *xs: 0, [1, [2]], [1, [2]], [1, 2])

    def test_check_types_refuses_a_list_against_a_tuple(self) -> None:
        """By default a list and a tuple of the same length do not match: TypeError."""
        with pytest.raises(
            TypeError, match=re.escape("at ['a']: structures[0] has a list of 2 items")
        ):
            nest.map_structure(lambda a, b: a, {"a": [1, 2]}, {"a": (1, 2)})

    def test_without_check_types_the_first_structure_decides_types(self) -> None:
        """``check_types=False``: sequences of the same length match; the result takes the
        first structure's types."""
        result = nest.map_structure(
            lambda a, b: a + b, [1, Point(2, 3)], (10, [20, 30]), check_types=False
        )
        assert snapshot(result) == snapshot([11, Point(22, 33)])

    def test_without_check_types_lengths_still_count(self) -> None:
        """``check_types=False`` does not let sequences of different lengths match."""
        with pytest.raises(
            ValueError,
            match=re.escape(
                "at <root>: structures[0] has a list of 2 items, structures[1] a tuple of 3 items"
            ),
        ):
            nest.map_structure(lambda a, b: a, [1, 2], (1, 2, 3), check_types=False)

    def test_func_never_runs_on_a_mismatch(self) -> None:
        """Structures are checked before `func` is called once."""
        calls: list[Any] = []
        with pytest.raises(ValueError, match="differs from structures"):
            nest.map_structure(calls.append, [1, 2, 3], [1, 2, [3]])
        assert calls == []

    def test_mapping_types_tf_counts_as_one_pair_by_key(self) -> None:
        """A dict and an OrderedDict with the same keys match; leaves pair by key and the
        result is a dict in the first structure's key order."""
        result = nest.map_structure(
            lambda a, b: (a, b), {"b": 1, "a": 2}, collections.OrderedDict(a=20, b=10)
        )
        assert snapshot(result) == snapshot({"b": (1, 10), "a": (2, 20)})

    @settings(max_examples=100, deadline=None, database=None)
    @given(nested_strategies.structures(max_leaves=12))
    def test_without_check_types_any_sequence_type_matches(self, structure: Any) -> None:
        """Turning every tuple and namedtuple into a list keeps the structure the same
        without check_types; the result keeps the first structure's types."""
        result = nest.map_structure(
            lambda a, b: b, structure, as_lists(structure), check_types=False
        )
        assert snapshot(result) == snapshot(structure)

    def test_needs_a_structure(self) -> None:
        """As tf.nest: no structure is a ValueError."""
        with pytest.raises(ValueError, match="at least one structure"):
            nest.map_structure(lambda: 0)

    @pytest.mark.parametrize("check_types", [True, False])
    def test_other_keyword_arguments_are_a_value_error(self, check_types: bool) -> None:
        """As tf.nest: a keyword other than its two flags raises ValueError with tf.nest's
        words, naming it and how to pass it to func; func never runs."""
        calls: list[Any] = []
        with pytest.raises(ValueError, match=r"^Only valid keyword arguments") as info:
            nest.map_structure(calls.append, [1, 2], check_types=check_types, foo="a")  # type: ignore[arg-type]
        assert str(info.value) == (
            "Only valid keyword arguments are `check_types` and `expand_composites`, not: "
            "`foo`; map_structure() passes no keyword arguments to func, so bind them first: "
            "map_structure(functools.partial(func, foo=...), *structures)"
        )
        with pytest.raises(ValueError, match="not: `foo`, `bar`; "):
            nest.map_structure(calls.append, [1], foo="a", bar=2)  # type: ignore[arg-type]
        assert calls == []

    def test_needs_a_callable(self) -> None:
        """As tf.nest: a func that is not callable is a TypeError, before anything runs."""
        with pytest.raises(TypeError, match="callable func, got 3 of type int"):
            nest.map_structure(3, [1])  # type: ignore[arg-type]


class TestMapStructureWithPaths:
    def test_string_paths_joined_by_slash(self) -> None:
        """Paths are the keys, indices and field names from the root, joined by ``/``."""
        result = nest.map_structure_with_paths(lambda path, leaf: path, make_structure())
        expected = {
            "zeta": ["zeta/0", ("zeta/1/0", "zeta/1/1")],
            "alpha": Point(x="alpha/x", y="alpha/y"),
            "mid": (),
        }
        assert snapshot(result) == snapshot(expected)

    def test_tuple_paths(self) -> None:
        """Tuple paths hold the raw keys, indices and field names."""
        result = nest.map_structure_with_tuple_paths(lambda path, leaf: path, make_structure())
        expected = {
            "zeta": [("zeta", 0), (("zeta", 1, 0), ("zeta", 1, 1))],
            "alpha": Point(x=("alpha", "x"), y=("alpha", "y")),
            "mid": (),
        }
        assert snapshot(result) == snapshot(expected)

    def test_several_structures(self) -> None:
        """`func` gets the path, then one leaf from each structure."""
        result = nest.map_structure_with_paths(
            lambda path, a, b: f"{path}:{a + b}", {"k": [1, 2]}, {"k": [10, 20]}
        )
        assert result == {"k": ["k/0:11", "k/1:22"]}
        result = nest.map_structure_with_tuple_paths(
            lambda path, a, b: (path, a * b),
            Batch(features=2, label=[3]),
            Batch(features=5, label=[7]),
        )
        assert snapshot(result) == snapshot(
            Batch(features=(("features",), 10), label=[(("label", 0), 21)])
        )

    def test_root_leaf_has_the_empty_path(self) -> None:
        """A leaf alone has path ``""`` (string form) and ``()`` (tuple form)."""
        assert nest.map_structure_with_paths(lambda path, leaf: (path, leaf), 5) == ("", 5)
        assert nest.map_structure_with_tuple_paths(lambda path, leaf: (path, leaf), 5) == ((), 5)

    def test_check_types(self) -> None:
        """Both honour ``check_types`` as map_structure does."""
        for mapper in (nest.map_structure_with_paths, nest.map_structure_with_tuple_paths):
            with pytest.raises(TypeError, match=re.escape("at <root>")):
                mapper(lambda path, a, b: a, [1], (1,))
            assert mapper(lambda path, a, b: b, [1], (2,), check_types=False) == [2]

    def test_later_structures_may_go_deeper_than_the_first(self) -> None:
        """tf.nest maps the paths "up to" structures[0]: below one of its leaves, a later
        structure's whole subtree is one value."""
        assert nest.map_structure_with_paths(lambda p, x, y: (p, y), [1, 2], [[5, 6], 7]) == [
            ("0", [5, 6]),
            ("1", 7),
        ]
        assert nest.map_structure_with_tuple_paths(
            lambda p, x, y: (p, y), {"a": 1}, {"a": [1, 2]}
        ) == {"a": (("a",), [1, 2])}
        assert nest.map_structure_with_paths(lambda p, x, y: y, 0, [1, 2]) == [1, 2]

    def test_a_leaf_where_the_first_has_a_container_is_a_type_error(self) -> None:
        for mapper in (nest.map_structure_with_paths, nest.map_structure_with_tuple_paths):
            with pytest.raises(TypeError, match="structures\\[1\\] has a leaf of type int at"):
                mapper(lambda path, a, b: b, [1, 2], 5)
            with pytest.raises(TypeError, match="at \\[1\\]"):
                mapper(lambda path, a, b: b, [1, [2]], [1, 3])

    def test_other_keyword_arguments_go_to_func(self) -> None:
        """As tf.nest: keyword arguments besides the two flags are passed to every call."""
        assert nest.map_structure_with_paths(
            lambda path, x, scale: f"{path}={x * scale}", {"a": [1, 2]}, scale=10
        ) == {"a": ["a/0=10", "a/1=20"]}
        assert nest.map_structure_with_tuple_paths(
            lambda path, x, y, scale: (path, (x + y) * scale), [1], (2,), check_types=False, scale=3
        ) == [((0,), 9)]

    def test_mismatch_names_the_path(self) -> None:
        """A structure mismatch is reported with its key path."""
        for mapper in (nest.map_structure_with_paths, nest.map_structure_with_tuple_paths):
            with pytest.raises(
                ValueError, match=re.escape("at ['a']: keys differ: 'c' only in structures[1]")
            ):
                mapper(lambda path, a, b: a, {"a": {"b": 1}}, {"a": {"b": 1, "c": 2}})


class TestAssertSameStructure:
    def test_same_structure_different_leaves(self) -> None:
        """Leaves may differ, in value and in type; dict insertion order does not matter."""
        other = {"mid": (), "alpha": Point(x=None, y="y"), "zeta": [ARRAY, ("leaf", "leaf")]}
        nest.assert_same_structure(make_structure(), other)

    def test_a_leaf_against_a_container_deep_down(self) -> None:
        """ValueError naming the path of the first difference, depth first."""
        other = {"mid": (), "alpha": Point(x=None, y="y"), "zeta": [ARRAY, ([1], {"k": 2})]}
        with pytest.raises(
            ValueError,
            match=re.escape(
                "at ['zeta'][1][0]: the first has a leaf 2.5 of type float, the second a list"
            ),
        ):
            nest.assert_same_structure(make_structure(), other)

    def test_leaf_against_container_is_a_value_error(self) -> None:
        """A string is a leaf: it does not match a list of characters."""
        with pytest.raises(
            ValueError,
            match=re.escape(
                "structures differ at <root>: the first has a leaf 'ab' of type str, "
                "the second a list of 2 items"
            ),
        ):
            nest.assert_same_structure("ab", ["a", "b"])

    def test_different_keys_are_a_value_error(self) -> None:
        """Mapping keys must be the same set."""
        with pytest.raises(
            ValueError, match=re.escape("at [0]: keys differ: 'b' only in the first")
        ):
            nest.assert_same_structure([{"a": 1, "b": 2}], [{"a": 1}])

    def test_list_against_tuple_is_a_type_error(self) -> None:
        """With check_types (the default) the path and both types are named, with the fix."""
        with pytest.raises(
            TypeError,
            match=re.escape(
                "structures differ at ['a'][1]: the first has a list of 2 items, "
                "the second a tuple of 2 items; pass check_types=False"
            ),
        ):
            nest.assert_same_structure({"a": [0, [1, 2]]}, {"a": [0, (1, 2)]})

    def test_without_check_types_sequences_match_by_length(self) -> None:
        """``check_types=False``: a list, a tuple and a namedtuple of one length match."""
        nest.assert_same_structure([1, Point(2, 3)], (1, [2, 3]), check_types=False)
        with pytest.raises(
            ValueError, match=r"the first has a list of 2 items, the second a tuple of 1 item$"
        ):
            nest.assert_same_structure([1, 2], (1,), check_types=False)

    def test_without_check_types_a_mapping_never_matches_a_sequence(self) -> None:
        """Only sequence types are relaxed: a dict against a list is still a TypeError."""
        with pytest.raises(
            TypeError, match=r"the first has a dict of 1 item, the second a list of 1 item$"
        ):
            nest.assert_same_structure({"a": 1}, [1], check_types=False)

    def test_types_tf_counts_as_the_same(self) -> None:
        """As tf.nest: two mapping types, two list types and two namedtuple classes with one
        name and the same fields all match, even with check_types."""
        SamePoint = collections.namedtuple("Point", ["x", "y"])  # type: ignore[name-match]
        nest.assert_same_structure({"a": [1]}, collections.OrderedDict(a=ListWrapper([2])))
        nest.assert_same_structure(Point(1, 2), SamePoint(3, 4))
        with pytest.raises(
            ValueError, match=re.escape("at <root>: keys differ: 'b' only in the second")
        ):
            nest.assert_same_structure({"a": 1}, collections.OrderedDict(a=1, b=2))
        with pytest.raises(
            ValueError,
            match=re.escape(
                "at <root>: the first has a list of 1 item, the second a ListWrapper of 2 items"
            ),
        ):
            nest.assert_same_structure([1], ListWrapper([1, 2]))

    def test_namedtuples_with_other_fields_differ(self) -> None:
        """Namedtuple classes with another name or other fields are other types."""
        Other = collections.namedtuple("Other", ["x", "y"])
        with pytest.raises(
            TypeError, match="the first has a Point of 2 items, the second an Other of 2 items"
        ):
            nest.assert_same_structure(Point(1, 2), Other(1, 2))

    def test_namedtuples_of_one_name_with_other_fields(self) -> None:
        """As tf.nest, classes of one name with other fields are other types; the message
        names the fields of each and says how to match them anyway."""
        nest.assert_same_structure(SameNameAB(0, 1), SameNameAB2(2, 3))
        with pytest.raises(TypeError) as info:
            nest.assert_same_structure(SameNameAB(0, 1), SameNameXY(2, 3))
        assert str(info.value) == (
            "structures differ at <root>: the first has a same_name of 2 items, the second a "
            "same_name of 2 items: two different classes, both test_nest.same_name; their "
            "fields differ: the first has fields ('a', 'b'), the second fields ('x', 'y'); "
            "pass check_types=False to match a list, a tuple and a namedtuple of the same "
            "length"
        )
        nest.assert_same_structure(SameNameAB(0, 1), SameNameXY(2, 3), check_types=False)

    def test_registered_dataclass_against_another_type(self) -> None:
        """A registered dataclass only matches its own class, whatever check_types says."""
        with pytest.raises(TypeError, match=re.escape("at <root>: the first has a Batch node")):
            nest.assert_same_structure(Batch(1, 2), Point(1, 2), check_types=False)

    def test_mismatch_inside_a_relaxed_container_names_the_path(self) -> None:
        """The walk goes on below containers whose types differ but count as the same."""
        with pytest.raises(
            ValueError, match=re.escape("at [1]['k']: the first has a list of 1 item")
        ):
            nest.assert_same_structure([0, {"k": [1]}], (0, {"k": [1, 2]}), check_types=False)


class TestIsNested:
    @pytest.mark.parametrize(
        "value",
        [
            [],
            (),
            {},
            [1],
            Point(1, 2),
            collections.OrderedDict(),
            ListWrapper(),
            Batch(1, 2),
            {"a": 1, "b": 2}.keys(),
            {"a": 1, "b": 2}.values(),
            {"a": 1, "b": 2}.items(),
        ],
        ids=[
            "list",
            "tuple",
            "dict",
            "list1",
            "namedtuple",
            "ordereddict",
            "listsub",
            "dataclass",
            "keys",
            "values",
            "items",
        ],
    )
    def test_containers_are_nested(self, value: Any) -> None:
        """Lists, tuples, mappings, namedtuples, registered nodes and mapping views (as in
        tf.nest's testIsNested), empty ones included."""
        assert nest.is_nested(value) is True

    @pytest.mark.parametrize(
        "value",
        [None, 1, 2.5, "abc", b"ab", ARRAY, {1, 2}, Batch],
        ids=["none", "int", "float", "str", "bytes", "array", "set", "class"],
    )
    def test_leaves_are_not_nested(self, value: Any) -> None:
        """Scalars, None, strings, bytes, arrays, sets and classes are leaves."""
        assert nest.is_nested(value) is False


class TestMappingViews:
    """tf.nest's testFlattenAndPackMappingViews: keys(), values() and items() are containers
    of their items in iteration order, packed back as lists."""

    def test_flatten_and_pack(self) -> None:
        ordered = collections.OrderedDict([("d", 3), ("b", 1), ("a", 0), ("c", 2)])
        assert nest.flatten(ordered.values()) == [3, 1, 0, 2]
        assert nest.flatten(ordered.keys()) == ["d", "b", "a", "c"]
        flat_items = nest.flatten(ordered.items())
        assert flat_items == ["d", 3, "b", 1, "a", 0, "c", 2]
        packed = nest.pack_sequence_as(ordered.items(), flat_items)
        assert snapshot(packed) == snapshot([("d", 3), ("b", 1), ("a", 0), ("c", 2)])

    def test_map_and_paths(self) -> None:
        """Mapping over a view gives a list; its items have index paths."""
        assert nest.map_structure(lambda x: x * 2, {"a": 1, "b": 2}.values()) == [2, 4]
        assert nest.flatten_with_tuple_paths({"x": {"k": 1}.items()}) == [
            (("x", 0, 0), "k"),
            (("x", 0, 1), 1),
        ]


class TestAssertShallowStructure:
    """tf.nest's testAssertShallowStructure."""

    def test_an_input_deeper_below_leaves_passes(self) -> None:
        nest.assert_shallow_structure(["a", "b"], [["c", "d"], {"e": 1}])
        nest.assert_shallow_structure(7, [1, [2]])
        inp_ab = collections.OrderedDict([("a", 1), ("b", (2, 3))])
        inp_ba = collections.OrderedDict([("b", (2, 3)), ("a", 1)])
        nest.assert_shallow_structure(inp_ab, inp_ba)

    def test_lengths_differ_is_a_value_error(self) -> None:
        with pytest.raises(ValueError, match=r"^assert_shallow_structure") as info:
            nest.assert_shallow_structure(["a", "b", "c"], ["a", "b"])
        assert str(info.value) == (
            "assert_shallow_structure(): input_tree differs from shallow_tree at <root>: "
            "shallow_tree has a list of 3 items, input_tree a list of 2 items"
        )

    def test_types_differ_is_a_type_error_unless_check_types_is_off(self) -> None:
        inp_ab1 = [(1, 1), (2, 2)]
        inp_ab2 = [[1, 1], [2, 2]]
        with pytest.raises(
            TypeError,
            match=re.escape(
                "input_tree differs from shallow_tree at [0]: shallow_tree has a list of 2 "
                "items, input_tree a tuple of 2 items"
            ),
        ):
            nest.assert_shallow_structure(inp_ab2, inp_ab1)
        nest.assert_shallow_structure(inp_ab2, inp_ab1, check_types=False)

    def test_keys_differ_is_a_value_error(self) -> None:
        inp_ab1 = {"a": (1, 1), "b": {"c": (2, 2)}}
        inp_ab2 = {"a": (1, 1), "b": {"d": (2, 2)}}
        with pytest.raises(
            ValueError,
            match=re.escape(
                "at ['b']: keys differ: 'd' only in shallow_tree, 'c' only in input_tree"
            ),
        ):
            nest.assert_shallow_structure(inp_ab2, inp_ab1)

    def test_namedtuples_of_one_name_and_fields_match(self) -> None:
        inp_shallow = SameNameAB(1, 2)
        inp_deep = SameNameAB2(1, [1, 2, 3])
        nest.assert_shallow_structure(inp_shallow, inp_deep, check_types=False)
        nest.assert_shallow_structure(inp_shallow, inp_deep, check_types=True)

    def test_a_leaf_where_the_shallow_tree_has_a_container(self) -> None:
        """As tf.nest: TypeError, here naming the path and both types."""
        with pytest.raises(TypeError) as info:
            nest.assert_shallow_structure({"k": [9, 8]}, {"k": "input_tree"})
        assert str(info.value) == (
            "assert_shallow_structure(): input_tree has a leaf of type str at ['k'], where "
            "shallow_tree has a list; it must hold at least shallow_tree's structure"
        )


class TestFlattenUpTo:
    """tf.nest's testFlattenUpTo."""

    def test_shallow_tree_ends_at_scalars_and_strings(self) -> None:
        input_tree: Any = [[[2, 2], [3, 3]], [[4, 9], [5, 5]]]
        shallow_tree: Any = [[True, True], [False, True]]
        assert nest.flatten_up_to(shallow_tree, input_tree) == [[2, 2], [3, 3], [4, 9], [5, 5]]
        assert nest.flatten_up_to(shallow_tree, shallow_tree) == [True, True, False, True]

        input_tree = [[("a", 1), [("b", 2), [("c", 3), [("d", 4)]]]]]
        shallow_tree = [["level_1", ["level_2", ["level_3", ["level_4"]]]]]
        assert nest.flatten_up_to(shallow_tree, input_tree) == [
            ("a", 1),
            ("b", 2),
            ("c", 3),
            ("d", 4),
        ]
        assert nest.flatten(input_tree) == ["a", 1, "b", 2, "c", 3, "d", 4]

    def test_dicts_give_values_and_namedtuples_fields(self) -> None:
        input_tree = {"a": 1, "b": {"c": 2}, "d": [3, (4, 5)]}
        shallow_tree = {"a": 0, "b": 0, "d": [0, 0]}
        assert nest.flatten_up_to(shallow_tree, input_tree) == [1, {"c": 2}, 3, (4, 5)]
        assert nest.flatten_up_to(ABTuple(a=0, b=1), ABTuple(a=[0, 1], b=2)) == [[0, 1], 2]

    def test_nested_dicts_ordered_dicts_and_namedtuples(self) -> None:
        input_tree = collections.OrderedDict(
            [
                ("a", ABTuple(a=[0, {"b": 1}], b=2)),
                ("c", {"d": 3, "e": collections.OrderedDict([("f", 4)])}),
            ]
        )
        assert nest.flatten_up_to(input_tree, input_tree) == [0, 1, 2, 3, 4]
        shallow_tree: Any = collections.OrderedDict([("a", 0), ("c", {"d": 3, "e": 1})])
        assert snapshot(nest.flatten_up_to(shallow_tree, input_tree)) == snapshot(
            [ABTuple(a=[0, {"b": 1}], b=2), 3, collections.OrderedDict([("f", 4)])]
        )
        shallow_tree = collections.OrderedDict([("a", 0), ("c", 0)])
        assert snapshot(nest.flatten_up_to(shallow_tree, input_tree)) == snapshot(
            [
                ABTuple(a=[0, {"b": 1}], b=2),
                {"d": 3, "e": collections.OrderedDict([("f", 4)])},
            ]
        )

    @pytest.mark.parametrize(
        ("shallow_tree", "input_tree"),
        [
            ("shallow_tree", ["input_tree"]),
            ("shallow_tree", ["input_tree_0", "input_tree_1"]),
            (9, [0]),
            (9, [0, 1]),
            ("shallow_tree", "input_tree"),
            (0, 0),
        ],
    )
    def test_a_shallow_leaf_takes_the_whole_input(self, shallow_tree: Any, input_tree: Any) -> None:
        assert nest.flatten_up_to(shallow_tree, input_tree) == [input_tree]
        assert nest.flatten_up_to(shallow_tree, shallow_tree) == [shallow_tree]

    @pytest.mark.parametrize(
        ("shallow_tree", "input_tree"),
        [
            (["shallow_tree"], "input_tree"),
            (["shallow_tree_9", "shallow_tree_8"], "input_tree"),
            ([9], 0),
            ([9, 8], 0),
        ],
    )
    def test_an_input_leaf_under_a_shallow_container(
        self, shallow_tree: Any, input_tree: Any
    ) -> None:
        """TypeError naming the input's type; the shallow tree flattens up to itself."""
        kind = type(input_tree).__name__
        with pytest.raises(
            TypeError, match=f"^flatten_up_to\\(\\): input_tree has a leaf of type {kind} at"
        ):
            nest.flatten_up_to(shallow_tree, input_tree)
        assert nest.flatten_up_to(shallow_tree, shallow_tree) == shallow_tree

    def test_lengths_and_keys_must_match(self) -> None:
        """As tf.nest, an input with more items than the shallow tree is a ValueError."""
        with pytest.raises(ValueError, match="a list of 2 items, input_tree a list of 3 items"):
            nest.flatten_up_to([(1,), (2,)], [(1,), (2,), 3])
        with pytest.raises(ValueError, match="keys differ: 'b', 'd' only in input_tree"):
            nest.flatten_up_to({"c": 1, "a": 2}, {"c": "c", "d": "d", "b": "b", "a": "a"})


class TestMapStructureUpTo:
    """tf.nest's testMapStructureUpTo."""

    def test_namedtuples_lists_and_dicts(self) -> None:
        inp_val: Any = ABTuple(a=2, b=3)
        inp_ops: Any = ABTuple(a=OpTuple(add=1, mul=2), b=OpTuple(add=2, mul=3))
        out = nest.map_structure_up_to(
            inp_val, lambda val, ops: (val + ops.add) * ops.mul, inp_val, inp_ops
        )
        assert snapshot(out) == snapshot(ABTuple(a=6, b=15))

        data_list = [[2, 4, 6, 8], [[1, 3, 5, 7, 9], [3, 5, 7]]]
        name_list = ["evens", ["odds", "primes"]]
        out = nest.map_structure_up_to(
            name_list, lambda name, sec: f"first_{len(sec)}_{name}", name_list, data_list
        )
        assert out == ["first_4_evens", ["first_5_odds", "first_3_primes"]]

        inp_val = {"a": 2, "b": 3}
        for inp_ops in (
            {"a": {"add": 1, "mul": 2}, "b": {"add": 2, "mul": 3}},
            types.MappingProxyType({"a": {"add": 1, "mul": 2}, "b": {"add": 2, "mul": 3}}),
        ):
            out = nest.map_structure_up_to(
                inp_val, lambda val, ops: (val + ops["add"]) * ops["mul"], inp_val, inp_ops
            )
            assert out == {"a": 6, "b": 15}

    def test_keys_not_in_the_input_are_a_value_error(self) -> None:
        inp_val = {"a": 2, "b": 3}
        for inp_ops in (
            {"a": {"add": 1, "mul": 2}, "c": {"add": 2, "mul": 3}},
            types.MappingProxyType({"a": {"add": 1, "mul": 2}, "c": {"add": 2, "mul": 3}}),
        ):
            with pytest.raises(
                ValueError,
                match=re.escape(
                    "map_structure_up_to(): inputs[1] differs from shallow_tree at <root>: "
                    "keys differ: 'b' only in shallow_tree, 'c' only in inputs[1]"
                ),
            ):
                nest.map_structure_up_to(inp_val, lambda val, ops: 0, inp_val, inp_ops)

    def test_result_takes_the_shallow_tree_types(self) -> None:
        """The result is shaped like the shallow tree, whatever the inputs' types are."""
        out = nest.map_structure_up_to(
            (0, 0), lambda x, y: (x, y), [1, [2]], ([3], 4), check_types=False
        )
        assert snapshot(out) == snapshot(((1, [3]), ([2], 4)))

    def test_other_keyword_arguments_go_to_func(self) -> None:
        out = nest.map_structure_up_to([0], lambda x, scale: x * scale, [[1, 2]], scale=2)
        assert out == [[1, 2, 1, 2]]

    def test_every_input_is_checked_before_func_runs(self) -> None:
        calls: list[Any] = []
        with pytest.raises(TypeError, match=r"inputs\[2\] has a leaf of type int at \[1\]"):
            nest.map_structure_up_to([0, [0]], calls.append, [1, [2]], [3, [4]], [5, 6])
        assert calls == []

    def test_needs_an_input_and_a_callable(self) -> None:
        with pytest.raises(ValueError, match=r"^map_structure_up_to\(\) needs at least one"):
            nest.map_structure_up_to([0], lambda: 0)
        with pytest.raises(TypeError, match="callable func, got 3 of type int"):
            nest.map_structure_up_to([0], 3, [1])  # type: ignore[arg-type]


class TestFlatPaths:
    """tf.nest's testYieldFlatStringPaths, testFlattenWithStringPaths and
    testFlattenWithTuplePaths."""

    @pytest.mark.parametrize(
        ("inputs", "expected"),
        [
            ([], []),
            (3, [()]),
            ([3], [(0,)]),
            ({"a": 3}, [("a",)]),
            ({"a": {"b": 4}}, [("a", "b")]),
            ([{"a": 2}], [(0, "a")]),
            ([{"a": [2]}], [(0, "a", 0)]),
            ([{"a": [(23, 42)]}], [(0, "a", 0, 0), (0, "a", 0, 1)]),
            ([{"a": ([23], 42)}], [(0, "a", 0, 0), (0, "a", 1)]),
            ({"a": {"a": 2}, "c": [[[4]]]}, [("a", "a"), ("c", 0, 0, 0)]),
            ({"0": [{"1": 23}]}, [("0", 0, "1")]),
        ],
    )
    def test_yield_flat_paths(self, inputs: Any, expected: list[tuple[Any, ...]]) -> None:
        paths = nest.yield_flat_paths(inputs)
        assert iter(paths) is paths
        assert list(paths) == expected

    @pytest.mark.parametrize(
        ("inputs", "expected"),
        [
            ([], []),
            ([23, "42"], [("0", 23), ("1", "42")]),
            ([[[[108]]]], [("0/0/0/0", 108)]),
            (Foo(a=3, b=Bar(c=23, d=42)), [("a", 3), ("b/c", 23), ("b/d", 42)]),
            (
                Foo(a=Bar(c=23, d=42), b=Bar(c=0, d="thing")),
                [("a/c", 23), ("a/d", 42), ("b/c", 0), ("b/d", "thing")],
            ),
            (Bar(c=42, d=43), [("c", 42), ("d", 43)]),
            (Bar(c=[42], d=43), [("c/0", 42), ("d", 43)]),
        ],
    )
    def test_flatten_with_joined_string_paths(
        self, inputs: Any, expected: list[tuple[str, Any]]
    ) -> None:
        assert nest.flatten_with_joined_string_paths(inputs, separator="/") == expected
        assert nest.flatten_with_joined_string_paths(inputs) == expected

    @pytest.mark.parametrize(
        ("inputs", "expected"),
        [
            ([], []),
            ([23, "42"], [((0,), 23), ((1,), "42")]),
            ([[[[108]]]], [((0, 0, 0, 0), 108)]),
            (Foo(a=3, b=Bar(c=23, d=42)), [(("a",), 3), (("b", "c"), 23), (("b", "d"), 42)]),
            (
                Foo(a=Bar(c=23, d=42), b=Bar(c=0, d="thing")),
                [(("a", "c"), 23), (("a", "d"), 42), (("b", "c"), 0), (("b", "d"), "thing")],
            ),
            (Bar(c=42, d=43), [(("c",), 42), (("d",), 43)]),
            (Bar(c=[42], d=43), [(("c", 0), 42), (("d",), 43)]),
        ],
    )
    def test_flatten_with_tuple_paths(
        self, inputs: Any, expected: list[tuple[tuple[Any, ...], Any]]
    ) -> None:
        assert nest.flatten_with_tuple_paths(inputs) == expected

    def test_other_separators(self) -> None:
        """Any string separates the entries; anything else is a TypeError."""
        assert nest.flatten_with_joined_string_paths({"a": [1]}, separator=".") == [("a.0", 1)]
        with pytest.raises(TypeError, match="needs separator to be a string, got 0 of type int"):
            nest.flatten_with_joined_string_paths([1], separator=0)  # type: ignore[arg-type]


class TestJaxStylePair:
    def test_flatten_with_treedef_and_unflatten(self) -> None:
        """``flatten_with_treedef`` returns (leaves, TreeDef); ``unflatten`` rebuilds."""
        leaves, treedef = nest.flatten_with_treedef(make_structure())
        assert isinstance(treedef, nest.TreeDef)
        assert snapshot(leaves) == snapshot(LEAVES)
        rebuilt = nest.unflatten(treedef, leaves)
        assert snapshot(rebuilt) == snapshot(make_structure())

    def test_unflatten_needs_a_treedef(self) -> None:
        """An example structure instead of a TreeDef: TypeError pointing at pack_sequence_as."""
        with pytest.raises(
            TypeError, match=r"needs a TreeDef .* got a value of type list; .*pack_sequence_as"
        ):
            nest.unflatten([0, 0], [1, 2])  # type: ignore[arg-type]

    def test_unflatten_wrong_count(self) -> None:
        """The wrong number of leaves: ValueError naming both counts."""
        _, treedef = nest.flatten_with_treedef([0, 0])
        with pytest.raises(ValueError, match=r"expected 2 leaves .* got 3"):
            nest.unflatten(treedef, [1, 2, 3])

    def test_flatten_with_key_paths(self) -> None:
        """A list of (KeyPath, leaf) pairs, in flatten order; format_path shows each path."""
        pairs = nest.flatten_with_key_paths(make_structure())
        assert [nest.format_path(path) for path, _ in pairs] == [
            "['alpha'].x",
            "['alpha'].y",
            "['zeta'][0]",
            "['zeta'][1][0]",
            "['zeta'][1][1]",
        ]
        assert pairs[0][0] == (nest.MappingKey("alpha"), nest.AttrKey("x"))
        assert pairs[2][0] == (nest.MappingKey("zeta"), nest.SequenceKey(0))
        assert snapshot([leaf for _, leaf in pairs]) == snapshot(LEAVES)
        assert nest.flatten_with_key_paths(7) == [((), 7)]

    def test_is_leaf(self) -> None:
        """``is_leaf`` is the opposite of ``is_nested``."""
        values: list[Any] = [[], None, "s", ARRAY]
        assert [nest.is_leaf(x) for x in values] == [False, True, True, True]

    def test_register_node(self) -> None:
        """A registered class is walked into by every function."""

        class Pair:
            def __init__(self, first: Any, second: Any) -> None:
                self.first, self.second = first, second

        nest.register_node(
            Pair, lambda p: ((p.first, p.second), None), lambda aux, kids: Pair(*kids)
        )
        assert nest.flatten(Pair(1, [2])) == [1, 2]
        assert nest.is_nested(Pair(1, 2))
        packed = nest.pack_sequence_as(Pair(0, [0]), ["a", "b"])
        assert (type(packed), packed.first, packed.second) == (Pair, "a", ["b"])
        assert nest.map_structure_with_paths(lambda path, x: path, [Pair(1, 2)])[0].second == "0/1"


class TestModule:
    def test_all_is_exact_and_sorted(self) -> None:
        """The public names: tf.nest's, the JAX-style pair and the key-path tools."""
        assert nest.__all__ == [
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


class _Field:
    def __init__(self, name: str, *, init: bool = True, kw_only: bool = False) -> None:
        self.name, self.init, self.kw_only = name, init, kw_only


class AttrsPair:
    """What an ``attrs`` class shows the tree walk (``__attrs_attrs__``), without attrs."""

    __attrs_attrs__ = (_Field("x"), _Field("y"))

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AttrsPair) and (self.x, self.y) == (other.x, other.y)

    __hash__ = None  # type: ignore[assignment]


class TestAttrsClasses:
    """tf.nest walks into attrs classes like namedtuples: fields in order, named paths."""

    def test_flatten_pack_and_paths(self) -> None:
        pair = AttrsPair([1, 2], 3)
        assert nest.is_nested(pair)
        assert nest.flatten(pair) == [1, 2, 3]
        assert nest.pack_sequence_as(pair, [4, 5, 6]) == AttrsPair([4, 5], 6)
        assert nest.map_structure_with_paths(lambda path, v: path, pair) == AttrsPair(
            ["x/0", "x/1"], "y"
        )
        assert nest.map_structure(lambda v: v * 10, pair) == AttrsPair([10, 20], 30)

    def test_register_node_replaces_the_automatic_registration(self) -> None:
        """An attrs class already walked can still be registered with register_node, once."""

        class Seen:
            __attrs_attrs__ = (_Field("a"),)

            def __init__(self, a: Any) -> None:
                self.a = a

        assert nest.flatten(Seen(1)) == [1]
        nest.register_node(Seen, lambda s: ((s.a, s.a), "both"), lambda aux, kids: Seen(kids))
        assert nest.flatten(Seen(2)) == [2, 2]
        assert nest.map_structure(lambda v: v * 10, Seen(3)).a == (30, 30)
        with pytest.raises(ValueError, match="Seen is already registered"):
            nest.register_node(Seen, lambda s: ((s.a,), None), lambda aux, kids: Seen(*kids))

    @pytest.mark.parametrize(
        "field", [_Field("a", kw_only=True), _Field("a", init=False)], ids=["kw_only", "no_init"]
    )
    def test_fields_not_positional_name_the_class_and_register_node(self, field: _Field) -> None:
        """An attrs class with kw_only or init=False fields flattens, but rebuilding it
        raises TypeError naming the class, the field and register_node."""

        class KeywordOnly:
            __attrs_attrs__ = (field,)

            def __init__(self, *, a: Any) -> None:
                self.a = a

        structure = {"k": [KeywordOnly(a=1)]}
        assert nest.flatten(structure) == [1]
        with pytest.raises(
            TypeError,
            match=r"^cannot rebuild attrs class KeywordOnly as KeywordOnly\(\*fields\): "
            r"field 'a' is .*register_node",
        ):
            nest.map_structure(lambda v: v * 2, structure)


class TestFlagArguments:
    """As tf.nest, check_types and expand_composites are converted with bool() on entry."""

    @pytest.mark.parametrize(
        "call",
        [
            lambda **kw: nest.assert_same_structure([1], [2], **kw),
            lambda **kw: nest.map_structure(lambda x: x, [1], **kw),
            lambda **kw: nest.map_structure_with_paths(lambda p, x: x, [1], **kw),
            lambda **kw: nest.map_structure_with_tuple_paths(lambda p, x: x, [1], **kw),
            lambda **kw: nest.assert_shallow_structure([1], [2], **kw),
            lambda **kw: nest.flatten_up_to([1], [2], **kw),
            lambda **kw: nest.map_structure_up_to([1], lambda x: x, [2], **kw),
        ],
        ids=[
            "assert_same_structure",
            "map_structure",
            "with_paths",
            "with_tuple_paths",
            "assert_shallow_structure",
            "flatten_up_to",
            "map_structure_up_to",
        ],
    )
    @pytest.mark.parametrize("flag", ["check_types", "expand_composites"])
    def test_a_flag_without_a_truth_value_is_a_type_error(self, call: Any, flag: str) -> None:
        """An array flag raises TypeError naming the argument, not NumPy's error."""
        with pytest.raises(TypeError, match=rf"\(\) needs {flag} to be a bool, got array"):
            call(**{flag: np.ones(2)})

    def test_flatten_and_pack_check_expand_composites(self) -> None:
        """flatten and pack_sequence_as convert expand_composites too."""
        with pytest.raises(TypeError, match=r"^flatten\(\) needs expand_composites"):
            nest.flatten([1], expand_composites=np.ones(2))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^pack_sequence_as\(\) needs expand_composites"):
            nest.pack_sequence_as([1], [2], expand_composites=np.ones(2))  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        "name", ["yield_flat_paths", "flatten_with_tuple_paths", "flatten_with_joined_string_paths"]
    )
    def test_path_functions_check_expand_composites(self, name: str) -> None:
        """The flat-path functions convert expand_composites too, when called."""
        with pytest.raises(TypeError, match=rf"^{name}\(\) needs expand_composites"):
            getattr(nest, name)([1], expand_composites=np.ones(2))

    def test_flags_with_a_truth_value_are_accepted(self) -> None:
        """Values bool() accepts work as their truth value, as in tf.nest."""
        nest.assert_same_structure([1], (2,), check_types=0)  # type: ignore[arg-type]
        mapped = nest.map_structure(
            lambda x: x,
            [1],
            check_types=1,  # type: ignore[arg-type]
            expand_composites=None,  # type: ignore[arg-type]
        )
        assert mapped == [1]
