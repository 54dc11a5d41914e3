"""Arguments of aioreplica.nest's key-path tools and of regroup: a wrong type is a TypeError
that names the argument, what was given and what is expected."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from aioreplica import Mirrored, PerReplica, nest, regroup

if TYPE_CHECKING:
    from collections.abc import Callable


class TestKeyEntries:
    @pytest.mark.parametrize(
        ("make", "message"),
        [
            (
                lambda: nest.SequenceKey("a"),  # type: ignore[arg-type]
                "SequenceKey needs index to be an int, a position from 0, got 'a' of type str",
            ),
            (
                lambda: nest.SequenceKey(True),
                "SequenceKey needs index to be an int, a position from 0, got True of type bool",
            ),
            (
                lambda: nest.AttrKey(3),  # type: ignore[arg-type]
                "AttrKey needs name to be a str, a field's name, got 3 of type int",
            ),
        ],
        ids=["SequenceKey-str", "SequenceKey-bool", "AttrKey-int"],
    )
    def test_field_of_another_type_is_refused(self, make: Any, message: str) -> None:
        """A key entry holds what its kind of container is indexed by; anything else raised
        nothing until a path was formatted or hashed."""
        with pytest.raises(TypeError) as caught:
            make()
        assert str(caught.value) == message

    def test_numpy_index_is_kept_as_an_int(self) -> None:
        """NumPy's integers index as ints do, so they are taken, as a Python int."""
        key = nest.SequenceKey(np.int64(2))  # type: ignore[arg-type]
        assert (type(key.index), key, str(key)) == (int, nest.SequenceKey(2), "[2]")


class TestFormatPath:
    @pytest.mark.parametrize(
        ("path", "got"),
        [
            (3, "3 of type int"),
            ("ab", "'ab' of type str"),
            (["a"], "'a' of type str at position 0"),
            ((nest.SequenceKey(0), 1), "1 of type int at position 1"),
        ],
        ids=["int", "str", "raw-key", "one-raw-key"],
    )
    def test_no_key_path_is_refused(self, path: Any, got: str) -> None:
        """format_path takes key entries; 3 raised "'int' object is not iterable", and raw
        keys (a tuple path) were joined as if they were entries."""
        with pytest.raises(TypeError) as caught:
            nest.format_path(path)
        assert str(caught.value) == (
            "format_path() needs path to be a key path, a tuple of SequenceKey, MappingKey and "
            f"AttrKey entries (as flatten_with_key_paths gives), got {got}"
        )

    def test_key_paths_from_any_iterable(self) -> None:
        """A list or generator of entries formats as the tuple does."""
        ((path, _),) = nest.flatten_with_key_paths({"a": [0]})
        assert [nest.format_path(path), nest.format_path(list(path))] == ["['a'][0]"] * 2
        assert nest.format_path(entry for entry in path) == "['a'][0]"


class TestUnflattenLeaves:
    def test_leaves_that_are_not_iterable(self) -> None:
        """TreeDef.unflatten(5) and nest.unflatten(treedef, 5) name leaves and the treedef,
        where they said "'int' object is not iterable"."""
        _, treedef = nest.flatten_with_treedef([1, [2, 3]])
        calls: list[Callable[[], Any]] = [
            lambda: treedef.unflatten(5),  # type: ignore[arg-type]
            lambda: nest.unflatten(treedef, 5),  # type: ignore[arg-type]
        ]
        messages = []
        for call in calls:
            with pytest.raises(TypeError) as caught:
                call()
            messages.append(str(caught.value))
        assert (
            messages
            == [
                "unflatten() needs leaves to be a list (or another iterable) of the 3 values to "
                "place in TreeDef([*, [*, *]]), in flatten order, got 5 of type int"
            ]
            * 2
        )
        assert treedef.unflatten(iter("abc")) == ["a", ["b", "c"]]

    def test_a_type_error_of_the_iterable_itself_passes_through(self) -> None:
        """A generator that raises TypeError while it is consumed is not blamed on leaves."""

        def leaves() -> Any:
            yield 1
            raise TypeError("from the generator")

        _, treedef = nest.flatten_with_treedef([1, 2])
        with pytest.raises(TypeError, match=r"^from the generator$"):
            treedef.unflatten(leaves())


class TestRegroupArguments:
    @pytest.mark.parametrize(
        ("kwargs", "error", "message"),
        [
            (
                {"wrap_class": list},
                TypeError,
                "regroup(): wrap_class must be a DistributedValues class (PerReplica or "
                "Mirrored), got type <class 'list'>",
            ),
            (
                {"first_replica": "a"},
                TypeError,
                "regroup(): first_replica must be a replica id, an int >= 0, got str 'a'",
            ),
            (
                {"first_replica": True},
                TypeError,
                "regroup(): first_replica must be a replica id, an int >= 0, got bool True",
            ),
            (
                {"first_replica": -1},
                ValueError,
                "regroup(): first_replica must be a replica id, an int >= 0, got -1",
            ),
        ],
        ids=["wrap_class-list", "first_replica-str", "first_replica-bool", "first_replica-neg"],
    )
    def test_bad_argument_is_refused(
        self, kwargs: dict[str, Any], error: type[Exception], message: str
    ) -> None:
        """regroup([1, 2], wrap_class=list, first_replica='a') returned [1, 2]."""
        with pytest.raises(error) as caught:
            regroup([1, 2], **kwargs)
        assert str(caught.value) == message

    def test_good_arguments_still_regroup(self) -> None:
        """Both classes wrap; a NumPy integer names the replicas as an int does."""
        mismatch = [{"a": 1}, {"b": 2}]
        with pytest.raises(ValueError, match=r"^replica 5's value differs from replica 4's"):
            regroup(mismatch, first_replica=np.int64(4))  # type: ignore[arg-type]
        results = [regroup([1, 2]), regroup([1, 2], Mirrored)]
        assert [(type(r), r.values) for r in results] == [(PerReplica, (1, 2)), (Mirrored, (1, 2))]
