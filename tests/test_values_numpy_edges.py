"""Distributed values and variables at the edges of NumPy's protocols: writes in place
(``ufunc.at``, ``np.copyto``, a positional ``out``), ``copy=False``, generic aliases, frozen
attributes, ``copy.copy`` and pickle, and the writes a bool variable has no meaning for."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from aioreplica import (
    Mirrored,
    MirroredStrategy,
    MirroredVariable,
    PerReplica,
    SyncOnReadVariable,
    Variable,
)
from aioreplica._values import DistributedValues
from aioreplica.testing import StrategyFactory, host_devices, replica_id

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]

#: The kinds of variable, as the keyword arguments that make each in a strategy's scope
#: (``None``: an ordinary variable, made outside any scope).
KINDS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "mirrored": {},
    "sync_on_read": {"synchronization": "on_read", "aggregation": "mean"},
}
KIND_CLASSES = {"plain": Variable, "mirrored": MirroredVariable, "sync_on_read": SyncOnReadVariable}

#: NumPy calls that write into their target ``t`` in place, by name.
IN_PLACE: dict[str, Callable[[Any], Any]] = {
    "copyto": lambda t: np.copyto(t, np.ones(3)),
    "put": lambda t: np.put(t, [0], 7.0),
    "place": lambda t: np.place(t, np.array([True, False, False]), 7.0),
    "putmask": lambda t: np.putmask(t, np.array([True, False, False]), 7.0),
    "put_along_axis": lambda t: np.put_along_axis(t, np.array([0]), 7.0, 0),
    "fill_diagonal": lambda t: np.fill_diagonal(t, 7.0),
    "nan_to_num": lambda t: np.nan_to_num(t, copy=False),
    "nan_to_num_positional": lambda t: np.nan_to_num(t, False),
}


def make(strategy: MirroredStrategy, kind: str, initial: Any, name: str = "v") -> Variable:
    """A variable of ``kind`` (see ``KINDS``) holding ``initial``."""
    kwargs = KINDS[kind]
    if kwargs is None:
        return Variable(initial, name=name)
    with strategy.scope():
        return Variable(initial, name=name, **kwargs)


def copies(value: Variable | DistributedValues[Any]) -> list[list[Any]]:
    """Every copy of a variable or distributed value, as lists."""
    return [np.asarray(c).tolist() for c in value.values]


def in_place_name(call: str) -> str:
    """The NumPy function that the ``IN_PLACE`` call ``call`` makes."""
    return call.removesuffix("_positional")


class TestUfuncAtOnVariables:
    @pytest.mark.replicas(2)
    @pytest.mark.parametrize("kind", list(KINDS))
    @pytest.mark.parametrize("ufunc", [np.add, np.maximum])
    def test_refused_in_cross_replica_context(
        self, strategy_factory: StrategyFactory, kind: str, ufunc: np.ufunc
    ) -> None:
        """ufunc.at on a variable (which NumPy applies even to read-only arrays) raises a
        TypeError naming the variable and saying how to write it; no copy changes."""
        v = make(strategy_factory(), kind, np.zeros(3))
        with pytest.raises(
            TypeError,
            match=rf"^variable 'v' cannot be written in place by {ufunc.__name__}\.at; variables "
            r"change only through `await v\.assign\(\.\.\.\)`, `assign_add` or `assign_sub`, "
            rf"every copy or none: compute the new value on a copy \(x = v\.numpy\(\); "
            rf"np\.{ufunc.__name__}\.at\(x, \.\.\.\)\) and `await v\.assign\(x\)`$",
        ):
            ufunc.at(v, [0], 5.0)  # type: ignore[arg-type]
        assert copies(v) == [[0.0, 0.0, 0.0]] * len(v.values)

    @pytest.mark.replicas(2)
    @pytest.mark.parametrize("kind", ["mirrored", "sync_on_read"])
    async def test_refused_in_replicas(self, strategy_factory: StrategyFactory, kind: str) -> None:
        """In replica context every replica's ufunc.at is refused too: no replica writes the
        copy the host replicas share."""
        strategy = strategy_factory()
        v = make(strategy, kind, np.zeros(3))
        events: list[tuple[int, str]] = []

        async def step() -> None:
            try:
                np.add.at(v, [1], 1.0)
            except TypeError as exc:
                events.append((replica_id(), str(exc).split(";")[0]))

        await strategy.run(step)
        refused = "variable 'v' cannot be written in place by add.at"
        assert sorted(events) == [(0, refused), (1, refused)]
        assert copies(v) == [[0.0, 0.0, 0.0]] * 2

    def test_a_variable_as_the_values_is_read(self) -> None:
        """A variable that ufunc.at only reads (the values added) is its value."""
        target = np.zeros(3)
        np.add.at(target, [0, 0], Variable(2.0))
        assert target.tolist() == [4.0, 0.0, 0.0]


class TestInPlaceFunctionsOnVariables:
    @pytest.mark.replicas(2)
    @pytest.mark.parametrize("kind", list(KINDS))
    @pytest.mark.parametrize("call", list(IN_PLACE))
    def test_refused(self, strategy_factory: StrategyFactory, kind: str, call: str) -> None:
        """NumPy's functions that write into their first argument refuse a variable there
        with a TypeError naming it and how to write it; no copy changes."""
        shape = (3, 3) if call == "fill_diagonal" else (3,)
        v = make(strategy_factory(), kind, np.zeros(shape))
        with pytest.raises(
            TypeError,
            match=rf"^variable 'v' cannot be written in place by {in_place_name(call)}; "
            r"variables change only through `await v\.assign",
        ):
            IN_PLACE[call](v)
        assert copies(v) == [np.zeros(shape).tolist()] * len(v.values)

    def test_positional_out_refused(self) -> None:
        """A variable as the out of a NumPy function, given by position, is refused as out=
        is."""
        v = Variable(np.zeros(3))
        with pytest.raises(TypeError, match=r"^a variable cannot be the out= of mean; variables"):
            np.mean(np.ones((2, 3)), 0, None, v)  # type: ignore[call-overload]
        assert copies(v) == [[0.0, 0.0, 0.0]]

    @pytest.mark.replicas(2)
    def test_functions_still_read_variables(self, strategy_factory: StrategyFactory) -> None:
        """Functions that only read a variable compute with its value, and still write a
        plain array given as their target or out."""
        v = make(strategy_factory(), "mirrored", [1.0, -np.inf, 3.0])
        target = np.zeros(3)
        np.copyto(target, v)
        out = np.zeros(3)
        np.mean(np.stack([v, v]), 0, None, out)
        results = [
            target.tolist(),
            out.tolist(),
            np.nan_to_num(v).tolist(),
            np.concatenate([v, Mirrored([np.ones(1), np.ones(1)])]).tolist(),
            float(np.sum(v)),
        ]
        lowest = float(np.finfo(np.float64).min)
        assert results == [
            [1.0, -np.inf, 3.0],
            [1.0, -np.inf, 3.0],
            [1.0, lowest, 3.0],
            [1.0, -np.inf, 3.0, 1.0],
            -np.inf,
        ]
        assert copies(v) == [[1.0, -np.inf, 3.0]] * 2


class TestInPlaceOnMirrored:
    @pytest.mark.parametrize("call", list(IN_PLACE))
    def test_functions_refused(self, call: str) -> None:
        """NumPy's functions that write into their first argument refuse a Mirrored there
        (they would write replica 0's copy only); no copy changes."""
        shape = (3, 3) if call == "fill_diagonal" else (3,)
        m = Mirrored([np.zeros(shape), np.zeros(shape)])
        with pytest.raises(
            TypeError,
            match=rf"^a Mirrored value cannot be written in place by {in_place_name(call)}: "
            r"writing into one replica's copy would make the copies differ \(and host replicas "
            r"share one array\); compute a new value instead \(np\.array\(m\) is a copy to "
            r"write into\)$",
        ):
            IN_PLACE[call](m)
        assert copies(m) == [np.zeros(shape).tolist()] * 2

    def test_positional_out_refused(self) -> None:
        """A Mirrored as the out of a NumPy function, given by position, is refused as out=
        is."""
        m = Mirrored([np.zeros(3), np.zeros(3)])
        with pytest.raises(TypeError, match=r"^a Mirrored value cannot be the out= of mean: "):
            np.mean(np.ones((2, 3)), 0, None, m)  # type: ignore[call-overload]
        assert copies(m) == [[0.0, 0.0, 0.0]] * 2

    def test_ufunc_at_refused(self) -> None:
        """ufunc.at into a Mirrored is refused; a Mirrored as its values is read."""
        m = Mirrored([np.zeros(2), np.zeros(2)])
        with pytest.raises(
            TypeError, match=r"^a Mirrored value cannot be written in place by add\.at: "
        ):
            np.add.at(m, [0], 100.0)
        target = np.zeros(2)
        np.add.at(target, [1], Mirrored([3.0, 3.0]))
        assert (copies(m), target.tolist()) == ([[0.0, 0.0]] * 2, [0.0, 3.0])

    @pytest.mark.replicas(2)
    async def test_ufunc_at_refused_on_a_reduced_value(
        self, strategy_factory: StrategyFactory
    ) -> None:
        """ufunc.at (which ignores the read-only flag) does not change the shared, read-only
        copies of a value reduced by the strategy."""
        strategy = strategy_factory()
        m = await strategy.extended.reduce_to(
            "sum", PerReplica([np.ones(2), np.ones(2)]), host_devices(2)
        )
        with pytest.raises(TypeError, match=r"^a Mirrored value cannot be written in place"):
            np.add.at(m, [0], 100.0)
        assert copies(m) == [[2.0, 2.0]] * 2


class TestGenericAliasesAndAttributes:
    @pytest.mark.parametrize(
        "alias",
        [PerReplica[float], Mirrored[float], DistributedValues[float]],
        ids=["PerReplica", "Mirrored", "DistributedValues"],
    )
    def test_subscripted_constructor(self, alias: Any) -> None:
        """PerReplica[float](...) and its siblings make a value of the class."""
        value = alias([1.0, 2.0])
        assert (type(value), value.values) == (alias.__origin__, (1.0, 2.0))

    @pytest.mark.parametrize("cls", [PerReplica, Mirrored, DistributedValues])
    def test_attribute_writes_refused(self, cls: type[DistributedValues[Any]]) -> None:
        """Setting or deleting any attribute raises FrozenInstanceError (an AttributeError)
        naming it; the values stay."""
        value: Any = cls([1, 2])
        name = cls.__name__
        with pytest.raises(
            dataclasses.FrozenInstanceError,
            match=rf"^cannot assign to 'foo' of a {name}: distributed values are immutable; "
            rf"make a new {name} instead$",
        ):
            value.foo = 1
        with pytest.raises(AttributeError, match=rf"^cannot assign to 'values' of a {name}"):
            value.values = (3, 4)
        with pytest.raises(AttributeError, match=rf"^cannot delete 'values' of a {name}"):
            del value.values
        assert value.values == (1, 2)

    def test_copies_and_pickles(self) -> None:
        """Copies and pickles still make equal values."""
        value = PerReplica([1, 2])
        made = [copy.copy(value), copy.deepcopy(value), pickle.loads(pickle.dumps(value))]
        assert [(type(x), x.values) for x in made] == [(PerReplica, (1, 2))] * 3


class TestVariableCopyAndPickle:
    @pytest.mark.replicas(2)
    @pytest.mark.parametrize("kind", list(KINDS))
    async def test_copy_is_the_variable(self, strategy_factory: StrategyFactory, kind: str) -> None:
        """copy.copy(v) is v, as in TF: a write through either is the variable's."""
        v = make(strategy_factory(), kind, np.zeros(2))
        shallow = copy.copy(v)
        await shallow.assign(np.ones(2))
        assert (shallow is v, copies(v)) == (True, [[1.0, 1.0]] * len(v.values))

    @pytest.mark.replicas(2)
    @pytest.mark.parametrize("kind", list(KINDS))
    async def test_deepcopy_is_a_new_variable(
        self, strategy_factory: StrategyFactory, kind: str
    ) -> None:
        """copy.deepcopy(v) is still a new variable of the same kind, written on its own."""
        v = make(strategy_factory(), kind, np.zeros(2))
        deep = copy.deepcopy(v)
        await deep.assign(np.ones(2))
        assert (type(deep), copies(v)) == (KIND_CLASSES[kind], [[0.0, 0.0]] * len(v.values))

    @pytest.mark.replicas(2)
    @pytest.mark.parametrize("kind", list(KINDS))
    @pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
    def test_pickle_refused(
        self, strategy_factory: StrategyFactory, kind: str, protocol: int
    ) -> None:
        """Pickling a variable (alone or in a structure) raises a TypeError naming it and
        saying what to save instead."""
        v = make(strategy_factory(), kind, np.zeros(2), name="w")
        message = (
            rf"^cannot pickle variable 'w' \({KIND_CLASSES[kind].__name__}\): a variable lives "
            r"on its devices \(a distributed one with its strategy\) and takes its writes in "
            r"turn there, which does not travel between processes; pickle its value "
            r"\(v\.numpy\(\)\) and make a new Variable of it where it is loaded, or save "
            r"variables with aioreplica\.Checkpoint$"
        )
        with pytest.raises(TypeError, match=message):
            pickle.dumps(v, protocol)
        with pytest.raises(TypeError, match=message):
            pickle.dumps({"weights": [v]}, protocol)


class TestArrayCopyFalse:
    @pytest.mark.skipif(
        np.lib.NumpyVersion(np.__version__) < "2.0.0",
        reason="copy=False means a copy only where needed before NumPy 2",
    )
    @pytest.mark.replicas(2)
    @pytest.mark.parametrize("kind", list(KINDS))
    def test_dtype_change_refused(self, strategy_factory: StrategyFactory, kind: str) -> None:
        """np.array(v, dtype=other, copy=False) raises ValueError (NumPy 2's copy=False never
        copies) naming the variable, as a Mirrored's does; without a dtype change it is the
        stored array, and copy=None copies where needed."""
        v = make(strategy_factory(), kind, np.arange(3.0))
        with pytest.raises(
            ValueError,
            match=r"^variable 'v' has dtype float64, so NumPy needs a copy of it for dtype "
            r"float32, which copy=False refuses; leave copy out \(a copy where needed\), or "
            r"pass copy=True$",
        ):
            np.array(v, dtype=np.float32, copy=False)
        same = np.array(v, copy=False)
        converted = np.array(v, dtype=np.float32)
        assert (same.flags.writeable, same.tolist(), converted.dtype, converted.tolist()) == (
            False,
            [0.0, 1.0, 2.0],
            np.dtype(np.float32),
            [0.0, 1.0, 2.0],
        )


class TestBoolVariableWrites:
    @pytest.mark.replicas(2)
    @pytest.mark.parametrize(
        ("op", "hint"),
        [
            ("assign_add", "added to (TF has no bool AssignAdd either)"),
            ("assign_sub", "subtracted from (TF has no bool AssignSub either)"),
        ],
    )
    @pytest.mark.parametrize("kind", ["plain", "mirrored"])
    async def test_refused_in_cross_replica_context(
        self, strategy_factory: StrategyFactory, kind: str, op: str, hint: str
    ) -> None:
        """assign_add and assign_sub of a bool variable raise a TypeError naming it (NumPy's
        subtract raised its own, and add was a silent logical or); no copy changes."""
        v = make(strategy_factory(), kind, np.array([True, False]), name="flag")
        with pytest.raises(
            TypeError,
            match=rf"^{op}\(\) of variable 'flag': a bool variable cannot be "
            rf"{re.escape(hint)}; compute the new value and "
            r"assign\(\) it, e\.g\. `await v\.assign\(np\.logical_",
        ):
            await getattr(v, op)(np.array([True, True]))
        assert copies(v) == [[True, False]] * len(v.values)

    @pytest.mark.replicas(2)
    @pytest.mark.parametrize("op", ["assign_add", "assign_sub"])
    @pytest.mark.parametrize(
        "kwargs",
        [{}, {"synchronization": "on_read", "aggregation": "only_first_replica"}],
        ids=["mirrored", "sync_on_read"],
    )
    async def test_refused_in_replicas(
        self, strategy_factory: StrategyFactory, kwargs: dict[str, Any], op: str
    ) -> None:
        """Each replica's assign_add or assign_sub of a bool variable is refused, naming the
        variable and the replica; no copy changes."""
        strategy = strategy_factory()
        with strategy.scope():
            v = Variable(np.array([True, False]), name="flag", **kwargs)
        events: list[tuple[int, str]] = []

        async def step() -> None:
            try:
                await getattr(v, op)(np.array([True, True]))
            except TypeError as exc:
                events.append((replica_id(), str(exc).split(":")[0]))

        await strategy.run(step)
        assert sorted(events) == [
            (0, f"{op}() of variable 'flag' from replica 0"),
            (1, f"{op}() of variable 'flag' from replica 1"),
        ]
        assert copies(v) == [[True, False]] * 2

    async def test_assign_still_writes(self) -> None:
        """assign() of a bool variable still works."""
        v = Variable(np.array([True, False]), name="flag")
        await v.assign(np.logical_or(v, np.array([False, True])))
        assert copies(v) == [[True, True]]


class TestIntegerTooLargeForCreation:
    @pytest.mark.parametrize("initial", [2**70, [1, 2**70]], ids=["int", "list"])
    def test_message_says_why(self, initial: Any) -> None:
        """Variable(2**70) says what is wrong: the integer fits no NumPy integer dtype (a
        ValueError, as for one beyond int64; NumPy would make an array of objects)."""
        with pytest.raises(
            ValueError,
            match=r"^variable 'big': the initial value 1180591620717411303424 fits no NumPy "
            r"integer dtype \(int64 holds -9223372036854775808 to 9223372036854775807, uint64 0 "
            r"to 18446744073709551615\); pass it as a float if an approximation will do$",
        ):
            Variable(initial, name="big")


class TestFormatSpecs:
    @pytest.mark.parametrize("kind", list(KINDS))
    async def test_a_0d_variable_formats_as_its_number(self, kind: str) -> None:
        """``f"{loss:.4f}"`` on a 0-d variable formats its value as NumPy formats a 0-d
        array, in cross-replica context and in each replica (its own copy there)."""
        strategy = MirroredStrategy(host_devices(2))
        v = make(strategy, kind, np.float32(3.14159))
        assert (f"{v:.2f}", f"{v:>7.3f}", format(v, "e")) == (
            "3.14",
            "  3.142",
            format(np.array(np.float32(3.14159)), "e"),
        )

        async def step() -> str:
            return f"{v:.1f}"

        assert strategy.experimental_local_results(await strategy.run(step)) == ("3.1", "3.1")

    async def test_each_replica_formats_its_own_copy(self) -> None:
        """Copies that differ (a SUM sync-on-read variable each replica wrote on its own) are
        formatted each in its replica, and as their sum in cross-replica context."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.float32(0), synchronization="on_read", aggregation="sum", name="v")

        async def step() -> str:
            await v.assign(np.float32(replica_id() + 1))
            return f"{v:.1f}|{v:>5.2f}"

        results = strategy.experimental_local_results(await strategy.run(step))
        own = [float(c) for c in v.values]
        assert (results, f"{v:.1f}", own) == (("1.0| 1.00", "2.0| 2.00"), "3.0", [1.0, 2.0])

    async def test_a_spec_on_a_variable_of_more_dimensions_is_numpys_error(self) -> None:
        """A variable of more dimensions refuses a spec as a NumPy array does; an empty spec
        gives its str, as before."""
        strategy = MirroredStrategy(host_devices(2))
        v = make(strategy, "mirrored", np.arange(3.0))
        with pytest.raises(TypeError, match="unsupported format string"):
            f"{v:.2f}"
        assert f"{v}" == str(v)

    async def test_a_mirrored_value_formats_as_the_current_replicas_copy(self) -> None:
        """A ``Mirrored`` number or 0-d array takes a spec: replica 0's copy in cross-replica
        context, each replica's own in a replica."""
        strategy = MirroredStrategy(host_devices(2))
        m = Mirrored([np.array(2.5), np.array(2.5)])
        assert (f"{m:.1f}", f"{Mirrored([1.25, 1.25]):>6.2f}", f"{m}") == ("2.5", "  1.25", str(m))

        async def step(value: Mirrored[Any]) -> str:
            return f"{value:.2f}"

        results = strategy.experimental_local_results(await strategy.run(step, args=(m,)))
        assert results == ("2.50", "2.50")
        with pytest.raises(TypeError, match="unsupported format string"):
            f"{Mirrored([np.zeros(2), np.zeros(2)]):.1f}"
