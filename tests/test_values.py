"""Tests for aioreplica._values: distributed values, regroup and select_replica."""

from __future__ import annotations

import collections
import dataclasses
import operator
import re
from collections.abc import Iterator, Mapping
from typing import Any

import nested_strategies
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioreplica import CommunicationOptions, MirroredStrategy, ReplicaSyncError, Variable, _values
from aioreplica._tree import flatten, register_node
from aioreplica._values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    agreed,
    regroup,
    select_replica,
    select_replica_mirrored,
)
from aioreplica.testing import host_devices, replica_id


def _nested_value(d: str) -> tuple[Any, ...]:
    return ("a" + d, ["b" + d, {"c": "d" + d, "e": "f" + d}, "g" + d], "h" + d)


def _assert_distributed(
    result: Any, expected: Any, klass: type[DistributedValues[Any]] = PerReplica
) -> None:
    assert isinstance(result, klass)
    assert result.values == tuple(expected)


class TestDistributedValues:
    def test_list_is_stored_as_a_tuple(self) -> None:
        """The constructor accepts a list and stores a tuple."""
        value = PerReplica([1, 2])
        assert value.values == (1, 2)
        assert type(value.values) is tuple

    def test_tuple_is_kept(self) -> None:
        """A tuple is stored as given."""
        assert Mirrored((1.0, 1.0)).values == (1.0, 1.0)

    def test_empty_raises_value_error(self) -> None:
        """At least one replica's value is needed."""
        with pytest.raises(ValueError, match=r"^PerReplica\(\) needs a value for at least one"):
            PerReplica([])

    @pytest.mark.parametrize(
        ("values", "type_name"),
        [("ab", "str"), ((x for x in [1]), "generator"), (3, "int"), (b"xy", "bytes")],
    )
    def test_non_sequence_raises_type_error_naming_the_type(
        self, values: Any, type_name: str
    ) -> None:
        """Strings, generators and scalars are rejected with their type named."""
        with pytest.raises(TypeError, match=rf"needs a list or tuple .*, got {type_name}$"):
            Mirrored(values)

    def test_repr_maps_replica_to_value(self) -> None:
        """repr shows {replica_id: value}."""
        assert repr(PerReplica([1, "x"])) == "PerReplica({0: 1, 1: 'x'})"
        assert repr(Mirrored([None])) == "Mirrored({0: None})"

    def test_equality_is_identity_and_values_are_hashable(self) -> None:
        """Equal payloads do not make equal values; array payloads hash fine."""
        a = PerReplica([np.zeros(2), np.ones(2)])
        b = PerReplica(list(a.values))
        assert a == a
        assert a != b
        assert len({a, b}) == 2

    def test_frozen(self) -> None:
        """values cannot be reassigned."""
        value = PerReplica([1])
        with pytest.raises(dataclasses.FrozenInstanceError):
            value.values = (2,)  # type: ignore[misc]

    def test_slots(self) -> None:
        """Instances have no __dict__."""
        assert not hasattr(PerReplica([1]), "__dict__")

    def test_generic_and_final(self) -> None:
        """PerReplica and Mirrored are generic, final subclasses of the open base."""
        value: PerReplica[int] = PerReplica([1])
        assert value.values == (1,)
        assert PerReplica[int].__origin__ is PerReplica  # type: ignore[attr-defined]
        assert issubclass(PerReplica, DistributedValues)
        assert issubclass(Mirrored, DistributedValues)
        assert getattr(PerReplica, "__final__", False)
        assert getattr(Mirrored, "__final__", False)
        assert not getattr(DistributedValues, "__final__", False)


class TestMirroredComputesAsItsValue:
    """TF's MirroredTest.testAddOp: a Mirrored value's operators use its value."""

    def test_operators(self) -> None:
        m = Mirrored([3.0, 3.0])
        assert (m + m, m + 1, 1 + m, m - 1, 10 - m, m * 2, m / 2, 7 // m, m % 2) == (
            6.0, 4.0, 4.0, 2.0, 7.0, 6.0, 1.5, 2.0, 1.0,
        )  # fmt: skip
        assert (m**2, 2**m, -m, +m, abs(Mirrored([-2.0])), float(m), int(m)) == (
            9.0, 8.0, -3.0, 3.0, 2.0, 3.0, 3,
        )  # fmt: skip
        assert (m > 2, m >= 4, m < 2, operator.lt(2, m)) == (True, False, False, True)
        flags = Mirrored([np.array([True, False])] * 2)
        assert (~flags).tolist() == [False, True]
        assert (flags & np.array([True, True])).tolist() == [True, False]

    def test_with_arrays_either_side(self) -> None:
        """NumPy defers to the Mirrored value's operators, so arrays combine either way."""
        a = Mirrored([np.arange(2.0), np.arange(2.0)])
        assert (np.ones(2) + a).tolist() == [1.0, 2.0]
        assert (a @ np.ones(2), np.ones(2) @ a) == (1.0, 1.0)
        assert type(np.ones(2) * a) is np.ndarray

    def test_equality_stays_identity(self) -> None:
        """== is identity, as for every distributed value (they are not hashed by value)."""
        a, b = Mirrored([1.0, 1.0]), Mirrored([1.0, 1.0])
        assert a == a
        assert a != b

    def test_equality_stays_identity_when_numpy_compares(self) -> None:
        """NumPy's side of == and != (an array or NumPy scalar first, np.equal) is identity
        too, so a Mirrored value in a list of arrays is found by identity, not elementwise."""
        m = Mirrored([np.zeros(3), np.zeros(3)])
        three = Mirrored([3.0, 3.0])
        seen = [
            np.zeros(3) == m,
            np.zeros(3) != m,
            np.float64(3.0) == three,
            np.float64(3.0) != three,
            bool(np.equal(m, m)),
            m in [np.zeros(3), m],
            m in [np.zeros(3)],
        ]
        assert seen == [False, True, False, True, True, True, False]

    def test_per_replica_values_have_no_one_value(self) -> None:
        with pytest.raises(TypeError, match="unsupported operand"):
            Mirrored([1.0, 1.0]) + PerReplica([1.0, 2.0])

    def test_pow_with_a_modulo_and_indexing(self) -> None:
        """pow(m, x, modulo) and m[key] use its value, as TF's DistributedDelegate does."""
        m = Mirrored([7, 7])
        assert (pow(m, 3, 10), pow(m, 2, Mirrored([5, 5])), m**2, 2**m) == (3, 4, 49, 128)
        rows = Mirrored([np.arange(6).reshape(2, 3)] * 2)
        assert (rows[1, 2], rows[0].tolist(), rows[:, 1].tolist()) == (5, [0, 1, 2], [1, 4])
        with pytest.raises(IndexError):
            rows[2]
        with pytest.raises(TypeError, match="unsupported operand"):
            pow(m, 2, PerReplica([5, 6]))

    def test_attributes_are_not_forwarded(self) -> None:
        """Attributes stay its own (the module's rule): np.shape(m), not m.shape."""
        m = Mirrored([np.zeros((2, 3))] * 2)
        with pytest.raises(AttributeError, match="shape"):
            m.shape  # type: ignore[attr-defined]  # noqa: B018
        assert np.shape(m) == (2, 3)

    def test_numpy_converts_it_to_its_value(self) -> None:
        """np.asarray(m) is its value (TF converts a Mirrored to its tensor), with the dtype
        and copy keywords NumPy passes."""
        value = np.arange(3.0)
        m = Mirrored([value, value.copy()])
        assert np.asarray(m) is value  # no copy unless asked
        copied = np.array(m)
        assert copied is not value
        assert copied.tolist() == [0.0, 1.0, 2.0]
        assert np.asarray(m, dtype=np.float32).dtype == np.float32
        if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
            assert np.asarray(m, copy=False) is value
            with pytest.raises(ValueError, match="copy"):
                np.asarray(m, dtype=np.int64, copy=False)
        assert np.asarray(Mirrored([2.5, 2.5])).tolist() == 2.5
        assert np.asarray([Mirrored([1, 1]), 2]).tolist() == [1, 2]

    def test_numpy_functions_and_ufuncs_use_its_value(self) -> None:
        """np.mean(m), np.dot(m, m), np.sum(m), ufuncs: as on its value (each was a 0-d
        object array's result, or a TypeError)."""
        m = Mirrored([np.arange(3.0), np.arange(3.0)])
        results = [np.mean(m), np.dot(m, m), np.sum(m), np.max(m), np.add.reduce(m)]
        assert results == [1.0, 5.0, 3.0, 2.0, 3.0]
        assert all(np.ndim(r) == 0 for r in results)
        assert np.add(m, 1).tolist() == [1.0, 2.0, 3.0]
        assert np.multiply(m, m).tolist() == [0.0, 1.0, 4.0]
        assert np.concatenate([m, np.ones(1)]).tolist() == [0.0, 1.0, 2.0, 1.0]
        assert np.where(np.greater(m, 0.5), m, -1.0).tolist() == [-1.0, 1.0, 2.0]
        assert type(np.sin(m)) is np.ndarray

    def test_numpy_dispatches_as_its_value_does(self) -> None:
        """A value with NumPy dispatch of its own (a CuPy array) handles the functions and
        ufuncs called on the Mirrored value."""
        calls: list[tuple[str, tuple[Any, ...]]] = []

        class Recording:
            def __array_function__(
                self, func: Any, types: Any, args: Any, kwargs: dict[str, Any]
            ) -> str:
                calls.append((func.__name__, args))
                return "function"

            def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kw: Any) -> str:
                calls.append((f"{ufunc.__name__}.{method}", inputs))
                return "ufunc"

        value = Recording()
        m = Mirrored([value, value])
        results: tuple[Any, ...] = (
            np.mean(m),
            np.concatenate([m, m]),
            np.add(m, 1),
            np.add.reduce(m),
        )
        assert results == (
            "function", "function", "ufunc", "ufunc",
        )  # fmt: skip
        assert calls == [
            ("mean", (value,)),
            ("concatenate", ([value, value],)),
            ("add.__call__", (value, 1)),
            ("add.reduce", (value,)),
        ]

    def test_numpy_out_is_refused(self) -> None:
        """A Mirrored value as NumPy's out= would change one copy: a TypeError, no change."""
        m: Any = Mirrored([np.zeros(2), np.zeros(2)])
        with pytest.raises(
            TypeError,
            match=r"^a Mirrored value cannot be the out= of add: writing into one replica's "
            r"copy would make the copies differ; compute a new value \(without out=\) instead$",
        ):
            np.add(np.ones(2), 1, out=m)
        with pytest.raises(TypeError, match="cannot be the out= of sum"):
            np.sum(np.ones((2, 2)), axis=0, out=m)
        assert [c.tolist() for c in m.values] == [[0.0, 0.0], [0.0, 0.0]]

    @pytest.mark.parametrize(
        "use",
        [np.asarray, np.mean, np.sum, lambda x: np.ones(2) + x, lambda x: np.add(x, 1)],
        ids=["asarray", "mean", "sum", "array_plus", "add"],
    )
    def test_numpy_refuses_a_per_replica(self, use: Any) -> None:
        """A PerReplica has no one value: NumPy refuses it with a TypeError saying what to do
        (np.asarray made a 0-d array of objects of it)."""
        per_replica = PerReplica([np.ones(2), np.zeros(2)])
        with pytest.raises(
            TypeError,
            match=r"^a PerReplica holds 2 values, one per replica, so NumPy cannot convert it to "
            r"one array; reduce it first \(strategy\.reduce\), or take one replica's value "
            r"\(\.values\[i\], strategy\.experimental_local_results\)$",
        ):
            use(per_replica)
        with pytest.raises(TypeError, match=r"^a PerReplica holds 2 values"):
            np.add(Mirrored([np.ones(2)] * 2), per_replica)

    @pytest.mark.anyio
    async def test_each_replica_computes_with_its_copy(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        m = Mirrored([np.full(2, 1.0), np.full(2, 2.0)])  # one copy per replica

        async def step() -> Any:
            return m * 10

        result = await strategy.run(step)
        assert [r.tolist() for r in strategy.experimental_local_results(result)] == [
            [10.0, 10.0],
            [20.0, 20.0],
        ]
        assert (m * 10).tolist() == [10.0, 10.0]  # outside a replica: replica 0's

    @pytest.mark.anyio
    async def test_numpy_in_a_replica_uses_its_copy(self) -> None:
        """np.asarray(m), NumPy's functions and m[i] take the current replica's copy."""
        strategy = MirroredStrategy(host_devices(2))
        m = Mirrored([np.full(2, 1.0), np.full(2, 2.0)])

        async def step() -> Any:
            return [np.asarray(m).tolist(), float(np.sum(m)), float(m[0]), float(np.add(m, 1)[1])]

        result = await strategy.run(step)
        assert strategy.experimental_local_results(result) == (
            [[1.0, 1.0], 2.0, 1.0, 2.0],
            [[2.0, 2.0], 4.0, 2.0, 3.0],
        )


class TestRegroup:
    def test_nested(self) -> None:
        """Ported testNested: leaves that differ become PerReplica, containers are kept."""
        result = regroup((_nested_value("1"), _nested_value("2")))
        assert isinstance(result, tuple)
        assert len(result) == 3
        _assert_distributed(result[0], ["a1", "a2"])
        _assert_distributed(result[2], ["h1", "h2"])

        assert isinstance(result[1], list)
        assert len(result[1]) == 3
        _assert_distributed(result[1][0], ["b1", "b2"])
        _assert_distributed(result[1][2], ["g1", "g2"])

        assert isinstance(result[1][1], dict)
        assert set(result[1][1]) == {"c", "e"}
        _assert_distributed(result[1][1]["c"], ["d1", "d2"])
        _assert_distributed(result[1][1]["e"], ["f1", "f2"])

        assert select_replica(0, result) == _nested_value("1")
        assert select_replica(1, result) == _nested_value("2")
        with pytest.raises(TypeError, match="got PerReplica"):
            select_replica_mirrored(0, result)
        with pytest.raises(TypeError, match="got PerReplica"):
            select_replica_mirrored(1, result)

    def test_keeps_dict_based_class(self) -> None:
        """Ported testRegroupKeepsDictBasedClass: a dict subclass keeps its type."""

        class DictBasedClass(dict[str, Any]):
            """Dummy class inherited from a dict."""

        result = regroup((DictBasedClass(a="a1", b="b1"), DictBasedClass(a="a2", b="b2")))
        assert isinstance(result, DictBasedClass)
        _assert_distributed(result["a"], ["a1", "a2"])
        _assert_distributed(result["b"], ["b1", "b2"])

    def test_keeps_collections_mapping_class(self) -> None:
        """Ported testRegroupCollectionsMapping: a Mapping that is not a dict keeps its type."""

        class CollectionsMappingBasedClass(Mapping[str, Any]):
            """Class inherited from collections.abc.Mapping."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self._d = dict(*args, **kwargs)

            def __getitem__(self, key: str) -> Any:
                return self._d[key]

            def __iter__(self) -> Iterator[str]:
                return iter(self._d)

            def __len__(self) -> int:
                return len(self._d)

        result = regroup(
            (
                CollectionsMappingBasedClass(a="a1", b="b1"),
                CollectionsMappingBasedClass(a="a2", b="b2"),
            )
        )
        assert isinstance(result, CollectionsMappingBasedClass)
        _assert_distributed(result["a"], ["a1", "a2"])
        _assert_distributed(result["b"], ["b1", "b2"])

    def test_wrap_class(self) -> None:
        """Ported testWrapClass: Mirrored wraps the leaves, and select_replica_mirrored works."""
        result = regroup((_nested_value("1"), _nested_value("2")), Mirrored)
        assert isinstance(result, tuple)
        assert len(result) == 3
        _assert_distributed(result[0], ["a1", "a2"], Mirrored)
        _assert_distributed(result[2], ["h1", "h2"], Mirrored)

        assert isinstance(result[1], list)
        assert len(result[1]) == 3
        _assert_distributed(result[1][0], ["b1", "b2"], Mirrored)
        _assert_distributed(result[1][2], ["g1", "g2"], Mirrored)

        assert isinstance(result[1][1], dict)
        assert set(result[1][1]) == {"c", "e"}
        _assert_distributed(result[1][1]["c"], ["d1", "d2"], Mirrored)
        _assert_distributed(result[1][1]["e"], ["f1", "f2"], Mirrored)

        assert select_replica(0, result) == _nested_value("1")
        assert select_replica(1, result) == _nested_value("2")
        assert select_replica_mirrored(0, result) == _nested_value("1")
        assert select_replica_mirrored(1, result) == _nested_value("2")

    def test_wrap_a_list_of_two_tuples(self) -> None:
        """Ported testWrapAListOfTwoTuples: the outer list indexes replicas."""
        result = regroup([("1", "2"), ("3", "4")])
        assert isinstance(result, tuple)
        assert len(result) == 2
        _assert_distributed(result[0], ("1", "3"))
        _assert_distributed(result[1], ("2", "4"))

    def test_same_id(self) -> None:
        """Ported testSameId: the same object in every replica stays unwrapped."""
        foo = object()
        result = regroup((("a", foo), ("b", foo)))
        assert isinstance(result, tuple)
        assert len(result) == 2
        _assert_distributed(result[0], ["a", "b"])
        assert result[1] is foo

        result_0 = select_replica(0, result)
        assert isinstance(result_0, tuple)
        assert len(result_0) == 2
        assert result_0[0] == "a"
        assert result_0[1] is foo
        result_1 = select_replica(1, result)
        assert isinstance(result_1, tuple)
        assert len(result_1) == 2
        assert result_1[0] == "b"
        assert result_1[1] is foo

    def test_equal_but_distinct_objects_are_wrapped(self) -> None:
        """Only identity (is) keeps a leaf unwrapped, not equality."""
        result = regroup([[np.zeros(1)], [np.zeros(1)]])
        assert isinstance(result[0], PerReplica)

    def test_one_device(self) -> None:
        """Ported testOneDevice: with one replica regroup and select_replica are identity."""
        result = regroup((_nested_value("1"),))
        assert result == _nested_value("1")
        assert select_replica(0, result) == _nested_value("1")

    def test_namedtuple(self) -> None:
        """Ported testNamedTuple: a namedtuple with a custom __new__ is rebuilt with _make."""

        class Scaffold:
            pass

        class EstimatorSpec(
            collections.namedtuple("EstimatorSpec", ["mode", "loss", "train_op", "scaffold"])
        ):
            def __new__(
                cls, mode: Any, loss: Any, train_op: Any, scaffold: Any = None
            ) -> EstimatorSpec:
                return super().__new__(
                    cls, mode=mode, loss=loss, train_op=train_op, scaffold=scaffold or Scaffold()
                )

        train = "train"
        created_estimator_specs = [
            EstimatorSpec(mode=train, loss=device_id / 2, train_op=object())
            for device_id in range(3)
        ]
        merged_estimator_spec = regroup(created_estimator_specs)

        assert isinstance(merged_estimator_spec, EstimatorSpec)
        assert merged_estimator_spec.mode == train
        for device_id in range(3):
            spec = created_estimator_specs[device_id]
            assert merged_estimator_spec.loss.values[device_id] == spec.loss
            assert merged_estimator_spec.train_op.values[device_id] is spec.train_op
            assert merged_estimator_spec.scaffold.values[device_id] is spec.scaffold
            assert isinstance(spec.scaffold, Scaffold)
            assert select_replica(device_id, merged_estimator_spec) == spec

    def test_replicas_may_order_dict_keys_differently(self) -> None:
        """Dict keys are matched as sets; the result keeps replica 0's order."""
        result = regroup([{"b": 1, "a": 2}, {"a": 3, "b": 4}])
        assert list(result) == ["b", "a"]
        _assert_distributed(result["a"], [2, 3])
        _assert_distributed(result["b"], [1, 4])

    def test_containers_keep_their_types(self) -> None:
        """OrderedDict, defaultdict and list/tuple subclasses keep their types."""
        ordered = collections.OrderedDict([("b", 1), ("a", 2)])
        factory_dict = collections.defaultdict[str, Any](list, x=1)
        result = regroup([[ordered, factory_dict], [ordered.copy(), factory_dict.copy()]])
        assert type(result[0]) is collections.OrderedDict
        assert list(result[0]) == ["b", "a"]
        assert type(result[1]) is collections.defaultdict
        assert result[1].default_factory is list

    def test_registered_node_rebuilt_through_unflatten(self) -> None:
        """A registered node is split with flatten_fn and rebuilt with unflatten_fn."""

        class Grads:
            def __init__(self, name: str, *tensors: Any) -> None:
                self.name, self.tensors = name, tensors

        register_node(Grads, lambda g: (g.tensors, g.name), lambda name, ch: Grads(name, *ch))
        result = regroup([Grads("g", 1, 2), Grads("g", 3, 2)])
        assert type(result) is Grads
        assert result.name == "g"
        _assert_distributed(result.tensors[0], [1, 3])
        assert result.tensors[1] == 2

    def test_leaf_root(self) -> None:
        """Leaf roots: one object is kept, differing ones are wrapped."""
        shared = object()
        assert regroup([shared, shared, shared]) is shared
        assert regroup([None, None]) is None
        _assert_distributed(regroup([1.5, 2.5], Mirrored), [1.5, 2.5], Mirrored)

    def test_distributed_values_are_leaves(self) -> None:
        """PerReplica values inside replica values are not walked into."""
        inner = PerReplica([1, 2])
        assert regroup([[inner], [inner]]) == [inner]

    def test_container_types_differ_names_both_replicas(self) -> None:
        """A container of another type raises TypeError naming both replicas and the path."""
        message = (
            "replica 2's value differs from replica 0's at [1]['c']: "
            "replica 0 has a list of 3 items, replica 2 a tuple of 3 items"
        )
        good = (0, {"c": [1, 2, 3]})
        with pytest.raises(TypeError, match=re.escape(message)):
            regroup([good, good, (0, {"c": (1, 2, 3)})])

    def test_lengths_differ_names_both_replicas(self) -> None:
        """A list of another length raises ValueError naming both replicas."""
        message = (
            "replica 1's value differs from replica 0's at [0]: "
            "replica 0 has a list of 2 items, replica 1 a list of 3 items"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            regroup([[[1, 2]], [[1, 2, 3]]])

    def test_keys_differ_names_both_replicas(self) -> None:
        """Different key sets raise ValueError naming the keys and the replicas."""
        message = "at <root>: keys differ: 'x' only in replica 0, 'y' only in replica 1"
        with pytest.raises(ValueError, match=re.escape(message)):
            regroup([{"x": 1}, {"y": 1}])

    def test_leaf_against_container_raises(self) -> None:
        """A leaf where replica 0 has a container, or the reverse, raises ValueError."""
        with pytest.raises(ValueError, match=r"replica 0 has a list of 1 item, replica 1 a leaf"):
            regroup([[1], 5])
        with pytest.raises(
            ValueError, match=r"at <root>: replica 0 has a leaf None of type NoneType"
        ):
            regroup([None, None, {}])

    def test_message_advises_same_structure(self) -> None:
        """The mismatch message says what every replica must do."""
        with pytest.raises(ValueError, match=r"every replica must return the same structure$"):
            regroup([[1], [1, 2]])

    def test_empty_raises_value_error(self) -> None:
        """regroup needs at least one replica's value."""
        with pytest.raises(ValueError, match=r"^regroup\(\) needs a value for at least one"):
            regroup([])

    def test_non_sequence_raises_type_error(self) -> None:
        """values must be a list or tuple indexed by replica."""
        with pytest.raises(TypeError, match=r"needs a list or tuple .*, got dict"):
            regroup({0: 1})  # type: ignore[arg-type]


class TestSelectReplica:
    def test_plain_leaves_pass_through(self) -> None:
        """Leaves that are not distributed come out as they are."""
        marker = object()
        assert select_replica(1, [marker, None, 3])[0] is marker
        assert select_replica(0, None) is None

    def test_distributed_leaf_at_root(self) -> None:
        """A PerReplica or Mirrored root becomes that replica's value."""
        assert select_replica(1, PerReplica(["a", "b"])) == "b"
        assert select_replica(0, Mirrored([7, 7])) == 7

    def test_leaf_fast_path_skips_flatten(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A leaf structure is answered without flattening."""

        def no_flatten(structure: Any) -> Any:
            raise AssertionError("flatten() called for a leaf")

        monkeypatch.setattr(_values, "flatten", no_flatten)
        assert select_replica(0, None) is None
        assert select_replica(1, PerReplica([1, 2])) == 2
        assert select_replica_mirrored(1, Mirrored([1, 2])) == 2
        assert select_replica_mirrored(0, "leaf") == "leaf"

    def test_containers_keep_their_types(self) -> None:
        """Containers are rebuilt with their own types and key order."""
        point = collections.namedtuple("point", ["x", "y"])
        structure = {
            "p": point(PerReplica([1, 2]), 0),
            "o": collections.OrderedDict([("z", Mirrored([3, 4])), ("a", 5)]),
        }
        selected = select_replica(1, structure)
        assert list(selected) == ["p", "o"]
        assert type(selected["p"]) is point
        assert selected["p"] == (2, 0)
        assert type(selected["o"]) is collections.OrderedDict
        assert list(selected["o"].items()) == [("z", 4), ("a", 5)]

    @pytest.mark.parametrize("replica_id", [2, 5, -1])
    def test_out_of_range_names_id_and_replica_count(self, replica_id: int) -> None:
        """An id outside 0..n-1 raises IndexError naming it and the number of replicas."""
        message = f"replica_id {replica_id} is out of range for PerReplica values of 2 replicas"
        with pytest.raises(IndexError, match=re.escape(message)):
            select_replica(replica_id, [PerReplica([1, 2])])
        with pytest.raises(IndexError, match=re.escape(message)):
            select_replica(replica_id, PerReplica([1, 2]))

    @pytest.mark.parametrize("replica_id", [None, "0", 1.5, True])
    @pytest.mark.parametrize("select", [select_replica, select_replica_mirrored])
    def test_replica_id_of_another_type(self, select: Any, replica_id: Any) -> None:
        """A replica_id that is no int (True is not 1) is a TypeError naming it, whatever
        the structure; NumPy's integers are ids."""
        message = (
            f"{select.__name__}(): replica_id must be an int, a replica's id from 0, got "
            f"{type(replica_id).__name__} {replica_id!r}"
        )
        for structure in (Mirrored([1, 2]), [Mirrored([1, 2]), 3], 3):
            with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
                select(replica_id, structure)
        assert select(np.int64(1), [Mirrored([1, 2]), 3]) == [2, 3]


class TestSelectReplicaMirrored:
    def test_mirrored_and_plain_leaves(self) -> None:
        """Mirrored leaves are sliced and plain leaves pass through."""
        structure = {"w": Mirrored([1.5, 2.5]), "lr": 0.1, "n": None}
        assert select_replica_mirrored(1, structure) == {"w": 2.5, "lr": 0.1, "n": None}

    def test_per_replica_raises_with_path_and_type(self) -> None:
        """A PerReplica leaf raises TypeError naming its key path and type."""
        message = (
            "select_replica_mirrored() expected Mirrored values or plain leaves, got PerReplica "
            "at [1]['g']"
        )
        with pytest.raises(TypeError, match=re.escape(message)):
            select_replica_mirrored(0, [Mirrored([1]), {"g": PerReplica([2])}])

    def test_per_replica_at_root(self) -> None:
        """A PerReplica root is reported at <root>."""
        with pytest.raises(TypeError, match=r"got PerReplica at <root>; use select_replica\(\)"):
            select_replica_mirrored(0, PerReplica([1]))

    def test_other_distributed_subclass_raises(self) -> None:
        """Any DistributedValues other than Mirrored is refused, subclasses included."""

        @dataclasses.dataclass(frozen=True, slots=True, eq=False, repr=False, init=False)
        class SyncOnRead(DistributedValues[int]):
            pass

        with pytest.raises(TypeError, match=r"got SyncOnRead at \[0\]"):
            select_replica_mirrored(0, (SyncOnRead([1]),))

    def test_out_of_range(self) -> None:
        """An id outside 0..n-1 raises IndexError."""
        with pytest.raises(IndexError, match=r"replica_id 1 is out of range .* 1 replica$"):
            select_replica_mirrored(1, [Mirrored([1])])


structures = nested_strategies.structures(max_leaves=10)


class TestProperties:
    @settings(max_examples=150, deadline=None, database=None)
    @given(structures, st.integers(1, 5), st.data())
    def test_select_replica_inverts_regroup(
        self, structure: Any, num_replicas: int, data: st.DataObject
    ) -> None:
        """select_replica(i, regroup(vs)) == vs[i] for every replica i."""
        leaves, treedef = flatten(structure)
        replicas = [structure]
        for _ in range(1, num_replicas):
            # Each leaf is either the very object replica 0 has, or a fresh value.
            size = len(leaves)
            fresh = data.draw(st.lists(nested_strategies.leaves, min_size=size, max_size=size))
            keep = data.draw(st.lists(st.booleans(), min_size=size, max_size=size))
            replicas.append(
                treedef.unflatten(
                    [old if k else new for old, new, k in zip(leaves, fresh, keep, strict=True)]
                )
            )
        merged = regroup(replicas)
        for i, expected in enumerate(replicas):
            selected = select_replica(i, merged)
            assert selected == expected
            assert repr(selected) == repr(expected)
        if num_replicas == 1:
            assert merged == structure

    @settings(max_examples=200, deadline=None, database=None)
    @given(st.lists(structures, min_size=1, max_size=4), st.data())
    def test_fast_paths_agree_with_the_tree_walk(
        self, replicas: list[Any], data: st.DataObject
    ) -> None:
        """regroup and select_replica walk plain tuples, lists and dicts directly; whatever
        the replicas hold (equal or different structures, namedtuples inside), they give what
        the general tree walk gives: the same value, or the same error and message."""
        if data.draw(st.booleans()):  # often the same structure, to reach the regroup result
            replicas = [replicas[0]] * len(replicas)
        error: Exception | None = None
        try:
            expected: Any = _values._regroup_tree(replicas, PerReplica)
        except (TypeError, ValueError) as exc:
            error = exc
        if error is not None:
            with pytest.raises(type(error)) as info:
                regroup(replicas)
            assert str(info.value) == str(error)
            return
        merged = regroup(replicas)
        assert repr(merged) == repr(expected)
        for i in range(len(replicas)):
            assert repr(select_replica(i, merged)) == repr(_values._select_tree(merged, i))

    @settings(max_examples=150, deadline=None, database=None)
    @given(structures, st.integers(1, 4), st.data())
    def test_select_replicas_is_select_replica_for_each(
        self, structure: Any, num_replicas: int, data: st.DataObject
    ) -> None:
        """select_replicas gives every replica what select_replica gives it, in containers of
        its own; it declines (None) what it does not walk, and select_replica handles that."""
        leaves, treedef = flatten(structure)
        sizes = data.draw(
            st.lists(
                st.sampled_from([0, num_replicas, num_replicas + 1]),
                min_size=len(leaves),
                max_size=len(leaves),
            )
        )
        merged = treedef.unflatten(
            [
                leaf if size == 0 else PerReplica([(leaf, j) for j in range(size)])
                for leaf, size in zip(leaves, sizes, strict=True)
            ]
        )
        parts = _values.select_replicas(merged, num_replicas)
        if parts is None:
            return
        assert len(parts) == num_replicas
        for i, part in enumerate(parts):
            assert repr(part) == repr(select_replica(i, merged))
        if num_replicas > 1 and isinstance(merged, list | dict):
            assert parts[0] is not parts[1]

    def test_select_replicas_declines_a_distributed_value_of_another_size(self) -> None:
        """A part count that is not the replicas' is select_replica's to report."""
        assert _values.select_replicas((PerReplica([1, 2, 3]),), 2) is None
        assert _values.select_replicas([nested_strategies.Point(1, PerReplica([1, 2]))], 2) is None


class Opaque:
    """Prints the same for every instance and compares by identity."""

    def __repr__(self) -> str:
        return "Opaque()"


def disagreement(values: list[Any], what: str = "the value") -> ReplicaSyncError:
    """The error ``agreed`` raises for one value per replica (the test fails if none)."""
    with pytest.raises(ReplicaSyncError) as info:
        agreed(PerReplica(values), what)
    return info.value


class TestAgreed:
    """``agreed`` names the replicas that differ from the largest group, with both values."""

    def test_equal_values_give_replica_0s(self) -> None:
        """Equal values (by ==) from every replica are one value: replica 0's."""
        first, second = [1, 2], [1, 2]
        assert agreed(PerReplica([first, second]), "the list") is first

    def test_names_the_odd_one_out_and_the_majority(self) -> None:
        """Replica 1 alone passing 'max' is named against replicas 0 and 2's 'sum'."""
        error = disagreement(["sum", "max", "sum"], "the reduce op")
        assert error.replicas == (1,)
        assert str(error) == (
            "replicas disagree on the reduce op: replica 1 passed 'max', while replicas 0 "
            "and 2 passed 'sum'; every replica must pass the same value in the same "
            "merge_call"
        )

    def test_the_majority_need_not_include_replica_0(self) -> None:
        """When replica 0 is the odd one, it is the one named."""
        error = disagreement(["max", "sum", "sum"])
        assert error.replicas == (0,)
        assert "replica 0 passed 'max', while replicas 1 and 2 passed 'sum'" in str(error)

    def test_without_a_majority_the_first_group_is_the_reference(self) -> None:
        """All different: every replica after replica 0 is named, each with its value."""
        error = disagreement([1, 2, 3])
        assert error.replicas == (1, 2)
        assert "replica 1 passed 2 and replica 2 passed 3, while replica 0 passed 1" in (str(error))

    def test_two_variables_with_one_name(self) -> None:
        """A different variable also named 'v' is called that, with the advice to pass one
        variable object from every replica."""
        strategy = MirroredStrategy(host_devices(3))
        with strategy.scope():
            v = Variable(np.zeros(2), name="v")
            other = Variable(np.zeros(2), name="v")
        error = disagreement([v, v, other], "the variable to update")
        assert error.replicas == (2,)
        message = str(error)
        assert message.startswith(
            "replicas disagree on the variable to update: replica 2 passed a different "
            "variable also named 'v', while replicas 0 and 1 passed variable 'v'; "
        )
        assert "pass the same variable object from every replica" in message

    def test_variables_with_one_name_show_what_differs(self) -> None:
        """Two variables named 'v' of different shapes show their shapes."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.zeros(2), name="v")
            other = Variable(np.zeros(3), name="v")
        assert (
            "replica 1 passed variable 'v' of shape (3,), while replica 0 passed "
            "variable 'v' of shape (2,)"
        ) in str(disagreement([v, other]))

    def test_objects_that_print_the_same(self) -> None:
        """Two unequal objects that print alike are said to be different objects."""
        message = str(disagreement([Opaque(), Opaque()]))
        assert (
            "replica 1 passed Opaque() (a different Opaque object that prints the same but is "
            "not equal), while replica 0 passed Opaque()"
        ) in message

    def test_long_values_show_where_they_differ(self) -> None:
        """Values whose shortened forms match are shown around their first difference."""
        message = str(disagreement(["x" * 80 + "a", "x" * 80 + "b"]))
        xs = "x" * 40
        assert f"replica 1 passed ...{xs}b', while replica 0 passed ...{xs}a';" in message

    def test_long_values_that_differ_early_are_marked_as_cut(self) -> None:
        """A long value shortened to its first 60 characters ends in "...", so the message
        does not read as if the value stopped there."""
        options = [CommunicationOptions(timeout_seconds=t) for t in (5.0, 5.0, 6.0)]
        message = str(disagreement(options, "the options"))
        start = "CommunicationOptions(bytes_per_pack=0, timeout_seconds="
        assert (
            f"replica 2 passed {start}6.0, ..., while replicas 0 and 1 passed {start}5.0, ...; "
        ) in message

    @pytest.mark.anyio
    async def test_a_write_to_a_different_variable_with_the_same_name(self) -> None:
        """Replica 2 writing its own variable 'v' fails the run naming replica 2 alone;
        neither variable changes."""
        strategy = MirroredStrategy(host_devices(3))
        with strategy.scope():
            v = Variable(np.zeros(2), name="v", aggregation="sum")
            other = Variable(np.zeros(2), name="v", aggregation="sum")

        async def step() -> None:
            await (other if replica_id() == 2 else v).assign_add(np.ones(2))

        with pytest.raises(ReplicaSyncError) as info:
            await strategy.run(step)
        assert (info.value.replicas, info.value.merge_number) == ((2,), 1)
        assert "replica 2 passed a different variable also named 'v'" in str(info.value)
        assert [c.tolist() for c in v.values + other.values] == [[0.0, 0.0]] * 6
