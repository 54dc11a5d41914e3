"""Distributed variables: creation, reads, writes in every context, all-or-nothing, update."""

from __future__ import annotations

import contextlib
import copy as copy_module
import functools
import os
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import numpy as np
import pytest

from aioreplica import (
    Checkpoint,
    Mirrored,
    MirroredStrategy,
    MirroredVariable,
    PerReplica,
    ReplicaSyncError,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    VariableSynchronization,
)
from aioreplica.testing import (
    FakeDevice,
    StrategyFactory,
    host_devices,
    replica_context,
    replica_id,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence
    from pathlib import Path

pytestmark = pytest.mark.anyio

T = TypeVar("T")
Array = np.ndarray[Any, Any]

REPLICAS = [1, 2, 4]
OPS = ["assign", "assign_add", "assign_sub"]
WRITES: dict[str, Callable[[Variable, Any], Awaitable[Variable]]] = {
    "assign": Variable.assign,
    "assign_add": Variable.assign_add,
    "assign_sub": Variable.assign_sub,
}


def scoped(strategy: MirroredStrategy, initial: Any, **kwargs: Any) -> Variable:
    """A variable made in ``strategy``'s scope."""
    with strategy.scope():
        return Variable(initial, **kwargs)


def expected_write(op: str, old: Array, value: Any) -> Array:
    """What ``op`` makes of a copy holding ``old``, computed with NumPy."""
    if op == "assign":
        return np.broadcast_to(np.asarray(value, dtype=old.dtype), old.shape).copy()
    if op == "assign_add":
        result: Array = old + value
        return result.astype(old.dtype)
    result = old - value
    return result.astype(old.dtype)


def snapshot(v: Variable) -> list[Array]:
    """Host copies of every copy of ``v``, to compare against later."""
    return [np.array(copy) for copy in v.values]


def assert_copies(v: Variable, expected: Sequence[Any]) -> None:
    """Every copy of ``v`` equals its expected value exactly (shape and dtype too); read-only."""
    assert len(v.values) == len(expected)
    for copy, want in zip(v.values, expected, strict=True):
        assert isinstance(copy, np.ndarray)
        assert copy.flags.writeable is False
        np.testing.assert_array_equal(copy, np.asarray(want, dtype=v.dtype), strict=True)


def assert_all(v: Variable, want: Any) -> None:
    """Every copy of ``v`` equals ``want``."""
    assert_copies(v, [want] * len(v.values))


async def assert_distributed_refused_in_replicas(strategy: MirroredStrategy, v: Variable) -> None:
    """Every write of a PerReplica or Mirrored value from inside ``strategy``'s replicas to
    ``v`` raises a TypeError naming ``v`` and the replica and saying what to pass; no change."""
    old = snapshot(v)
    for value in (PerReplica([1.0, 2.0]), Mirrored([1.0, 1.0])):
        for op in OPS:

            async def step(op: str = op, value: Any = value) -> None:
                await WRITES[op](v, value)

            with pytest.raises(
                TypeError,
                match=rf"^cannot write a {type(value).__name__} value to variable {v.name!r} "
                r"from replica \d: a distributed value holds one value per replica and cannot "
                r"be written from a replica; pass this replica's own value \(run\(\) hands "
                r"each replica its own part of a PerReplica or Mirrored argument\)\n",
            ):
                await strategy.run(step)
    assert_copies(v, old)


class DeviceFailure(Exception):
    """What a GatedDevice raises when told to fail."""


@dataclass
class Gate:
    """Controls a set of GatedDevices and records the copies they were asked to compute."""

    blocked: anyio.Event
    calls: list[str] = field(default_factory=list)
    block: int | None = None
    fail: int | None = None


class GatedDevice(FakeDevice):
    """A device whose ``run`` is recorded and can block forever or fail, for one index."""

    def __init__(self, index: int, gate: Gate) -> None:
        super().__init__(f"cpu:{index}", index)
        self.gate = gate

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        gate = self.gate
        gate.calls.append(self.name)
        if gate.block == self.index:
            gate.blocked.set()
            await anyio.Event().wait()  # never set: only a cancellation ends this
        if gate.fail == self.index:
            raise DeviceFailure(f"{self.name} failed")
        return await super().run(fn, *args, **kwargs)


def gated_strategy(n: int) -> tuple[MirroredStrategy, Gate]:
    gate = Gate(blocked=anyio.Event())
    return MirroredStrategy([GatedDevice(i, gate) for i in range(n)]), gate


async def distinct_copies(v: Variable, value: Array) -> None:
    """Give every copy of ``v`` its own array holding ``value``, so each is computed apart.

    Host copies that are the same object are computed once; separate objects make a write
    go through every device's ``run``.
    """
    await v.assign(Mirrored([value.copy() for _ in v.values]))
    assert len({id(copy) for copy in v.values}) == len(v.values)


class TestEnums:
    def test_members_and_strings_parse(self) -> None:
        """Members, values and names in any case parse to the member."""
        for text in ("on_read", "ON_READ", "On_Read", VariableSynchronization.ON_READ):
            assert VariableSynchronization.parse(text) is VariableSynchronization.ON_READ
        for text in (
            "only_first_replica",
            "ONLY_FIRST_REPLICA",
            VariableAggregation.ONLY_FIRST_REPLICA,
        ):
            assert VariableAggregation.parse(text) is VariableAggregation.ONLY_FIRST_REPLICA
        assert VariableAggregation.parse("Mean") is VariableAggregation.MEAN

    def test_invalid_names_list_the_valid_ones(self) -> None:
        """An unknown name raises ValueError listing every member and its string."""
        with pytest.raises(
            ValueError,
            match=r"^unknown variable synchronization 'sometimes': use a "
            r"VariableSynchronization or one of 'auto', 'on_write', 'on_read', 'none'$",
        ):
            VariableSynchronization.parse("sometimes")
        with pytest.raises(
            ValueError,
            match=r"^unknown variable aggregation 'avg': use a VariableAggregation or one of "
            r"'none', 'sum', 'mean', 'only_first_replica'$",
        ):
            VariableAggregation.parse("avg")


class TestCreation:
    async def test_none_means_the_default_synchronization_and_aggregation(self) -> None:
        """``synchronization=None`` and ``aggregation=None`` are TF's spelling of the defaults
        (AUTO, NONE), in a scope, inside a replica and outside any strategy."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            scoped_v = Variable(1.0, synchronization=None, aggregation=None)
        plain = Variable(1.0, synchronization=None, aggregation=None)

        async def step() -> Variable:
            return Variable(2.0, name="made", synchronization=None, aggregation=None)

        made = await strategy.run(step)
        assert [(type(v), v.synchronization, v.aggregation) for v in (scoped_v, plain, made)] == [
            (MirroredVariable, VariableSynchronization.AUTO, VariableAggregation.NONE),
            (Variable, VariableSynchronization.AUTO, VariableAggregation.NONE),
            (MirroredVariable, VariableSynchronization.AUTO, VariableAggregation.NONE),
        ]

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize(
        "sync",
        [
            VariableSynchronization.AUTO,
            "auto",
            VariableSynchronization.ON_WRITE,
            "ON_WRITE",
            "On_Write",
        ],
    )
    def test_scope_makes_mirrored_variable(
        self, strategy_factory: StrategyFactory, replicas: int, sync: VariableSynchronization | str
    ) -> None:
        """AUTO/ON_WRITE in a scope: a MirroredVariable, one equal read-only copy per replica."""
        strategy = strategy_factory()
        with strategy.scope():
            v = Variable(np.array([1.0, 2.0]), name="w", synchronization=sync, aggregation="SUM")
        assert type(v) is MirroredVariable
        assert len(v.values) == replicas
        assert_all(v, [1.0, 2.0])
        assert v.devices == strategy.devices == tuple(host_devices(replicas))
        assert v.distribute_strategy is strategy
        assert v.synchronization is VariableSynchronization.parse(sync)
        assert v.aggregation is VariableAggregation.SUM
        assert (v.name, v.shape, v.dtype, v.trainable) == ("w", (2,), np.dtype(np.float64), True)

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("sync", [VariableSynchronization.ON_READ, "on_read", "ON_READ"])
    def test_scope_makes_sync_on_read_variable(
        self, strategy_factory: StrategyFactory, replicas: int, sync: VariableSynchronization | str
    ) -> None:
        """ON_READ in a scope: a SyncOnReadVariable, one equal read-only copy per replica."""
        strategy = strategy_factory()
        with strategy.scope():
            v = Variable(
                np.arange(3),
                name="count",
                synchronization=sync,
                aggregation=VariableAggregation.SUM,
            )
        assert type(v) is SyncOnReadVariable
        assert_all(v, np.arange(3))
        assert v.devices == tuple(host_devices(replicas))
        assert v.distribute_strategy is strategy
        assert v.synchronization is VariableSynchronization.ON_READ
        assert v.aggregation is VariableAggregation.SUM

    def test_outside_scope_makes_plain_variable(self) -> None:
        """Outside any scope the result is exactly a Variable with one read-only copy."""
        v = Variable([1.0, 2.0], name="b", trainable=False)
        assert type(v) is Variable
        assert_copies(v, [[1.0, 2.0]])
        assert v.devices == ("cpu:0",)
        assert v.distribute_strategy is None
        assert v.trainable is False
        assert v.synchronization is VariableSynchronization.AUTO
        assert v.aggregation is VariableAggregation.NONE

    def test_synchronization_none_outside_scope(self) -> None:
        """synchronization='none' is allowed for an ordinary variable."""
        v = Variable(1.0, synchronization="none")
        assert type(v) is Variable
        assert v.synchronization is VariableSynchronization.NONE

    @pytest.mark.parametrize("sync", ["none", "NONE", VariableSynchronization.NONE])
    def test_synchronization_none_in_scope_refused(
        self, sync: VariableSynchronization | str
    ) -> None:
        """synchronization NONE in a scope raises ValueError naming the allowed ones."""
        strategy = MirroredStrategy(host_devices(2))
        with (
            strategy.scope(),
            pytest.raises(
                ValueError,
                match=r"^variable 'w': synchronization NONE is not allowed in "
                r"MirroredStrategy\(devices=\['cpu:0', 'cpu:1'\]\)'s scope, .* use "
                r"synchronization='on_write' \(a MirroredVariable, the default\) or 'on_read' "
                r"\(a SyncOnReadVariable\)$",
            ),
        ):
            Variable(1.0, name="w", synchronization=sync)

    @pytest.mark.parametrize("agg", [None, "none", VariableAggregation.NONE])
    async def test_on_read_without_aggregation_is_one_value_per_replica(
        self, agg: VariableAggregation | str | None, tmp_path: Path
    ) -> None:
        """TF's default sync-on-read variable (aggregation NONE): each replica reads and
        writes its own copy, cross-replica writes reach every copy, and what would combine
        the copies (a cross-replica read, a checkpoint) raises ValueError, changing nothing;
        strategy.reduce combines them with the op it is given."""
        strategy = MirroredStrategy(host_devices(2))
        kwargs: dict[str, Any] = {} if agg is None else {"aggregation": agg}
        with strategy.scope():
            v = Variable(1.0, name="s", synchronization="on_read", **kwargs)
        assert type(v) is SyncOnReadVariable
        assert (v.aggregation, v.trainable) == (VariableAggregation.NONE, False)
        assert "value=<one per replica: aggregation NONE>" in repr(v)

        async def step() -> Any:
            await v.assign_add(float(replica_id() + 1))
            return v.read_value()

        assert strategy.experimental_local_results(await strategy.run(step)) == (2.0, 3.0)
        message = (
            r"^sync-on-read variable 's' has aggregation NONE, so its copies cannot be "
            r"combined in cross-replica context \(as in TF\): read it inside a replica"
        )
        for read in (v.value, v.numpy, lambda: float(v)):
            with pytest.raises(ValueError, match=message):
                read()
        saved = message.replace("^", r"^Checkpoint\.save: cannot save v: ", 1)
        with pytest.raises(ValueError, match=saved):
            await Checkpoint(v=v).save(str(tmp_path / "c.npz"))
        assert not os.listdir(tmp_path)
        assert_copies(v, [2.0, 3.0])
        assert await strategy.reduce("max", v) == 3.0
        await v.assign(7.0)
        await v.assign_add(1.0)
        assert_copies(v, [8.0, 8.0])

    @pytest.mark.parametrize("in_scope", [False, True])
    def test_invalid_synchronization_or_aggregation(self, in_scope: bool) -> None:
        """Invalid synchronization or aggregation strings raise ValueError in and out of scope."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope() if in_scope else contextlib.nullcontext():
            with pytest.raises(
                ValueError, match=r"^unknown variable synchronization 'mirrored': use a"
            ):
                Variable(1.0, synchronization="mirrored")
            with pytest.raises(ValueError, match=r"^unknown variable aggregation 'max': use a"):
                Variable(1.0, aggregation="max")

    def test_callable_initial_value_called_once(self) -> None:
        """A callable initial value is called exactly once, even with 4 replicas."""
        calls: list[str] = []

        def initial() -> Array:
            calls.append("called")
            return np.array([3.0, 4.0])

        strategy = MirroredStrategy(host_devices(4))
        with strategy.scope():
            v = Variable(initial, synchronization="on_write")
            s = Variable(initial, synchronization="on_read", aggregation="mean")
        plain = Variable(initial)
        assert calls == ["called", "called", "called"]
        assert_all(v, [3.0, 4.0])
        assert_all(s, [3.0, 4.0])
        assert_copies(plain, [[3.0, 4.0]])

    @pytest.mark.replicas(*REPLICAS)
    def test_dtype_casts(self, strategy_factory: StrategyFactory) -> None:
        """dtype= casts the initial value; without it, the initial value's dtype is kept."""
        strategy = strategy_factory()
        with strategy.scope():
            v = Variable([1, 2], dtype=np.float32)
            i = Variable(7)
            f = Variable(0.5)
        assert v.dtype == np.dtype(np.float32)
        assert_all(v, np.array([1.0, 2.0], dtype=np.float32))
        assert (i.dtype, i.shape) == (np.array(7).dtype, ())
        assert (f.dtype, f.shape) == (np.dtype(np.float64), ())
        with pytest.raises(
            TypeError, match="an initial value of dtype bool cannot make a variable of dtype int8"
        ):
            Variable([True, False], dtype=np.int8)

    @pytest.mark.parametrize(
        ("initial", "dtype", "error", "message"),
        [
            (
                1.7,
                np.int32,
                TypeError,
                "an initial value of dtype float64 does not cast to dtype int32 without losing "
                r"its kind of number \(a write refuses it too\); cast it first "
                r"\(e\.g\. np\.asarray\(value\)\.astype\(int32\)\)$",
            ),
            (
                np.array([1.7, -2.5]),
                np.int32,
                TypeError,
                "an initial value of dtype float64 "
                r"does not cast to dtype int32 .*\(e\.g\. value\.astype\(int32\)\)$",
            ),
            (
                np.float64(1.7),
                np.int32,
                TypeError,
                r"an initial value of dtype float64 does not cast to dtype int32",
            ),
            (
                np.array([1 + 2j]),
                np.float32,
                TypeError,
                "an initial value of dtype complex128 does not cast",
            ),
            (
                np.nan,
                bool,
                TypeError,
                "an initial value of dtype float64 does not cast to dtype bool",
            ),
            (2.5, bool, TypeError, "an initial value of dtype float64 does not cast to dtype bool"),
            (
                np.arange(2),
                np.uint8,
                TypeError,
                "an initial value of dtype int64 does not cast to dtype uint8",
            ),
            ("1.5", np.float32, TypeError, "the initial value has dtype <U3; variables hold"),
            (["1", "2"], np.int32, TypeError, "the initial value has dtype <U1; variables hold"),
            (b"3", np.int8, TypeError, r"the initial value has dtype \|S1; variables hold"),
            (
                np.array(["2020-01-01"], dtype="datetime64[D]"),
                np.int64,
                TypeError,
                r"the initial value has dtype datetime64\[D\]; variables hold",
            ),
            (1, str, TypeError, "dtype <U0 is not numeric or bool; variables hold numeric"),
            (1, "no such dtype", TypeError, "dtype 'no such dtype' is not a NumPy dtype: "),
            (
                np.array([2**40]),
                np.int32,
                ValueError,
                "the initial value 1099511627776 does not "
                "fit dtype int32, which holds -2147483648 to 2147483647; the cast would wrap it "
                "around: choose a wider dtype$",
            ),
            (
                300,
                np.uint8,
                ValueError,
                "the initial value 300 does not fit dtype uint8, which "
                "holds 0 to 255; the cast would wrap it around",
            ),
            ([1, -1], np.uint8, ValueError, "the initial value -1 does not fit dtype uint8"),
            (
                2,
                bool,
                ValueError,
                r"the initial value 2 does not fit dtype bool, which holds 0 "
                r"\(False\) and 1 \(True\); pass bools, or compare first \(value != 0\)$",
            ),
        ],
        ids=lambda x: x.__name__ if isinstance(x, type) else None,
    )
    def test_dtype_casts_as_a_write_does(
        self, initial: Any, dtype: Any, error: type[Exception], message: str
    ) -> None:
        """dtype= refuses what a write refuses: another kind of number (a float to an
        integer, a complex to a float, a number to bool), text and dates (TypeError), and
        integers the dtype cannot hold (ValueError), naming the variable, in a scope and out."""
        strategy = MirroredStrategy(host_devices(2))
        for context in (contextlib.nullcontext(), strategy.scope()):
            with context, pytest.raises(error, match=f"^variable 'w': {message}"):
                Variable(initial, name="w", dtype=dtype)

    @pytest.mark.parametrize(
        ("initial", "dtype", "expected"),
        [
            (1, "float32", np.array(1.0, np.float32)),
            (np.zeros(3), np.float32, np.zeros(3, np.float32)),
            ([1, 2], np.int8, np.array([1, 2], np.int8)),
            ([1, 2], np.uint8, np.array([1, 2], np.uint8)),
            (255, np.uint8, np.array(255, np.uint8)),
            ([0, 1], bool, np.array([False, True])),
            (1.5, np.complex64, np.array(1.5, np.complex64)),
            (np.int64(3), np.int8, np.array(3, np.int8)),
            (np.arange(3, dtype=np.uint64), np.int8, np.arange(3, dtype=np.int8)),
            ([], np.int8, np.zeros(0, np.int8)),
        ],
    )
    def test_dtype_takes_what_fits(self, initial: Any, dtype: Any, expected: Array) -> None:
        """Python numbers take the dtype where they fit (an int any integer, float or complex
        dtype, 0 and 1 bool); arrays cast within their kind of number when the values fit."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(initial, dtype=dtype)
        made = [(v.dtype, v.numpy().tolist()) for v in (v, Variable(initial, dtype=dtype))]
        assert made == [(expected.dtype, expected.tolist())] * 2

    @pytest.mark.parametrize("sync", ["on_write", "on_read"])
    def test_mean_with_integer_dtype_refused(self, sync: str) -> None:
        """aggregation MEAN with an integer dtype: a sync-on-read variable's mean would be
        fractional (TypeError); a mirrored or ordinary variable takes it, as in TF."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            if sync == "on_read":
                with pytest.raises(
                    TypeError,
                    match=r"^sync-on-read variable 'n' of dtype int32 cannot have aggregation "
                    r"MEAN, whose result is fractional; use a floating dtype, or aggregation "
                    r"'sum'$",
                ):
                    Variable(3, name="n", dtype=np.int32, synchronization=sync, aggregation="mean")
            else:
                v = Variable(3, name="n", dtype=np.int32, synchronization=sync, aggregation="mean")
                assert (type(v), v.dtype) == (MirroredVariable, np.dtype(np.int32))
        assert Variable(3, name="n", dtype=np.int32, aggregation="mean").numpy() == 3

    def test_sum_with_bool_refused(self) -> None:
        """aggregation SUM with a bool dtype raises TypeError."""
        with pytest.raises(
            TypeError, match=r"^variable 'flag' of dtype bool cannot have aggregation SUM"
        ):
            Variable(True, name="flag", aggregation="sum")

    @pytest.mark.parametrize(
        ("initial", "message"),
        [
            (
                "abc",
                r"^variable 'w': the initial value has dtype <U3; variables hold numeric or bool "
                r"arrays$",
            ),
            (None, r"^variable 'w': the initial value has dtype object; variables hold numeric"),
            (
                {"a": 1},
                r"^variable 'w': the initial value has dtype object; variables hold numeric",
            ),
            (
                [1, [2, 3]],
                r"^variable 'w': cannot make an array of the initial value list \[1, \[2, 3\]\]: ",
            ),
        ],
    )
    def test_non_numeric_initial_value_refused(self, initial: Any, message: str) -> None:
        """A non-numeric or ragged initial value raises TypeError, in a scope and outside."""
        with pytest.raises(TypeError, match=message):
            Variable(initial, name="w")
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope(), pytest.raises(TypeError, match=message):
            Variable(initial, name="w")

    @pytest.mark.replicas(*REPLICAS)
    def test_initial_array_is_copied(self, strategy_factory: StrategyFactory) -> None:
        """Changing the caller's array afterwards changes no copy; the caller's stays writeable."""
        initial = np.array([1.0, 2.0, 3.0])
        strategy = strategy_factory()
        with strategy.scope():
            v = Variable(initial)
        plain = Variable(initial)
        initial[0] = 99.0
        assert initial.flags.writeable is True
        assert_all(v, [1.0, 2.0, 3.0])
        assert_copies(plain, [[1.0, 2.0, 3.0]])

    def test_initial_value_from_variable(self) -> None:
        """A variable as initial value gives a new variable with its value."""
        strategy = MirroredStrategy(host_devices(2))
        source = Variable([5.0, 6.0])
        with strategy.scope():
            v = Variable(source)
        assert_all(v, [5.0, 6.0])
        assert all(copy is not source.values[0] for copy in v.values)

    @pytest.mark.parametrize("cls", [MirroredVariable, SyncOnReadVariable])
    def test_subclass_outside_scope_refused(self, cls: type[Variable]) -> None:
        """Calling MirroredVariable/SyncOnReadVariable outside a scope raises ValueError."""
        with pytest.raises(
            ValueError,
            match=rf"^{cls.__name__} 'w' must be created inside `with strategy\.scope\(\):`; "
            r"outside a scope, use aioreplica\.Variable for an ordinary variable$",
        ):
            cls(1.0, name="w", synchronization="on_read", aggregation="sum")

    def test_subclass_in_scope(self) -> None:
        """The subclasses can be called directly in a scope with a matching synchronization."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            m = MirroredVariable(1.0)
            s = SyncOnReadVariable(1.0, synchronization="on_read", aggregation="sum")
            with pytest.raises(
                ValueError,
                match=r"^SyncOnReadVariable 'x' cannot have synchronization AUTO; use "
                r"aioreplica\.Variable, which makes a MirroredVariable for it$",
            ):
                SyncOnReadVariable(1.0, name="x", aggregation="sum")
            with pytest.raises(
                ValueError,
                match=r"^MirroredVariable 'y' cannot have synchronization ON_READ; use "
                r"aioreplica\.Variable, which makes a SyncOnReadVariable for it$",
            ):
                MirroredVariable(1.0, name="y", synchronization="on_read", aggregation="sum")
        assert (type(m), type(s)) == (MirroredVariable, SyncOnReadVariable)
        assert_all(m, 1.0)
        assert_all(s, 1.0)

    def test_name(self) -> None:
        """The name defaults to 'Variable'; a name that is not a str raises TypeError."""
        assert Variable(1.0).name == "Variable"
        with pytest.raises(TypeError, match=r"^name must be a str or None, got int$"):
            Variable(1.0, name=3)  # type: ignore[arg-type]

    @pytest.mark.parametrize("trainable", ["no", 0, 1.0])
    def test_trainable_must_be_a_bool(self, trainable: Any) -> None:
        """trainable="no" would be true: refused, as any non-bool."""
        with pytest.raises(
            TypeError, match=f"^trainable must be True, False or None, got {trainable!r}$"
        ):
            Variable(1.0, trainable=trainable)
        assert Variable(1.0, trainable=np.bool_(False)).trainable is False  # type: ignore[arg-type]

    def test_repr(self) -> None:
        """The repr shows class, name, shape, dtype, devices and the cross-replica value."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.zeros(2), name="w")
        assert repr(v) == (
            "<aioreplica.MirroredVariable 'w' shape=(2,) dtype=float64 "
            "devices=['cpu:0', 'cpu:1'] value=array([0., 0.])>"
        )
        assert (
            repr(Variable(1.5, name="p"))
            == "<aioreplica.Variable 'p' shape=() dtype=float64 value=array(1.5)>"
        )


class TestCreatedInsideReplicas:
    """Variables made inside a replica are shared by the run's replicas, as TF's shared
    variable creator shares them: each replica's k-th ``Variable(...)`` is one variable."""

    @pytest.mark.parametrize("in_scope", [False, True])
    async def test_every_replica_gets_one_mirrored_variable(
        self, strategy_factory: StrategyFactory, in_scope: bool
    ) -> None:
        """TF's testSingleVariable: made once, whichever replica gets there first, and run()
        returns it; outside the scope too, as TF's run() enters the scope."""
        strategy = strategy_factory(3)
        made: list[tuple[int, Variable]] = []

        async def step() -> Variable:
            v = Variable(np.array([1.0, 2.0]), name="foo")
            made.append((replica_id(), v))
            await replica_context().merge_call(lambda _: None)
            return v

        with strategy.scope() if in_scope else contextlib.nullcontext():
            result = await strategy.run(step)
        assert sorted(r for r, _ in made) == [0, 1, 2]
        assert all(v is result for _, v in made)
        assert type(result) is MirroredVariable
        assert (result.name, result.distribute_strategy) == ("foo", strategy)
        assert_copies(result, [[1.0, 2.0]] * 3)

    async def test_variables_pair_up_in_creation_order(
        self, strategy_factory: StrategyFactory
    ) -> None:
        """TF's testMultipleVariables and testMultipleVariablesWithSameCanonicalName: the
        k-th variable of every replica is one variable, names repeated or not."""
        strategy = strategy_factory(2)
        names = ["a", "b", "a", "c"]

        async def step() -> list[Variable]:
            return [Variable(float(i), name=name) for i, name in enumerate(names)]

        made = await strategy.run(step)
        assert [v.name for v in made] == names
        assert len({id(v) for v in made}) == len(names)
        for i, v in enumerate(made):
            assert_copies(v, [float(i)] * 2)

    async def test_each_run_makes_its_own(self) -> None:
        """A variable made in a step is one per run(), as a step that builds a model on every
        call would expect; a step that keeps the first one keeps it (TF's
        testInitializedToSameValueInsideEagerRun: every copy starts equal)."""
        strategy = MirroredStrategy(host_devices(2))
        kept: list[Variable] = []
        rng = np.random.default_rng(3)

        async def step() -> Variable:
            return Variable(0.0)

        first, second = await strategy.run(step), await strategy.run(step)
        assert first is not second

        async def build() -> None:
            if not kept:
                kept.append(Variable(lambda: rng.normal(size=3)))

        await strategy.run(build)
        await strategy.run(build)
        assert len(kept) == 1
        np.testing.assert_array_equal(kept[0].values[0], kept[0].values[1])

    async def test_sync_on_read_variable_aggregates_the_replicas_writes(self) -> None:
        """TF's testSyncOnReadVariable: made inside the replicas, each writes its own copy and
        a cross-replica read sums them."""
        strategy = MirroredStrategy(host_devices(3))

        async def step() -> tuple[Variable, Variable]:
            total = Variable(0.0, synchronization="on_read", aggregation="sum")
            mean = Variable(1.0, aggregation="mean")
            await total.assign_add(float(replica_id() + 1))
            await mean.assign(float(replica_id()))
            return total, mean

        total, mean = await strategy.run(step)
        assert type(total) is SyncOnReadVariable
        assert float(total) == 6.0
        assert_copies(total, [1.0, 2.0, 3.0])
        assert_copies(mean, [1.0] * 3)

    async def test_variables_made_in_device_threads_are_shared(self) -> None:
        """Replicas that make their variables in their devices' threads, at the same time,
        still share one."""
        strategy = MirroredStrategy(host_devices(4))
        barrier = threading.Barrier(4, timeout=10)

        def build() -> Variable:
            barrier.wait()  # every replica's thread asks at once
            return Variable(np.ones(2), name="w")

        async def step() -> Variable:
            return await replica_context().device.run(build)

        made = await strategy.run(step)
        assert type(made) is MirroredVariable
        assert_copies(made, [[1.0, 1.0]] * 4)

    @pytest.mark.parametrize(
        ("second", "shown"),
        [
            (
                {"name": "b"},
                r"Variable 'b' of shape \(\) \(synchronization AUTO, aggregation NONE\)",
            ),
            (
                {"name": "a", "aggregation": "sum"},
                r"Variable 'a' of shape \(\) \(synchronization AUTO, aggregation SUM\)",
            ),
            (
                {"name": "a", "synchronization": "on_read", "aggregation": "sum"},
                r"Variable 'a' of shape \(\) \(synchronization ON_READ, aggregation SUM\)",
            ),
            (
                {"name": "a", "initial_value": np.zeros(3)},
                r"Variable 'a' of shape \(3,\) \(synchronization AUTO, aggregation NONE\)",
            ),
        ],
    )
    async def test_replicas_that_ask_for_different_variables(
        self, second: dict[str, Any], shown: str
    ) -> None:
        """Another name, synchronization, aggregation or initial shape in the same place of the
        order is a RuntimeError naming both replicas and both variables (TF: "mismatching
        name")."""
        strategy = MirroredStrategy(host_devices(2))
        made = anyio.Event()

        async def step() -> Variable:
            if replica_id() == 0:
                v = Variable(1.0, name="a")
                made.set()
                return v
            await made.wait()
            kwargs = dict(second)
            return Variable(kwargs.pop("initial_value", 1.0), **kwargs)

        with pytest.raises(
            RuntimeError,
            match=rf"^replica 1 asked for {shown} as its variable #1 in this run, but replica 0 "
            r"made MirroredVariable 'a' of shape \(\) \(synchronization AUTO, aggregation "
            r"NONE\) as its #1; "
            r"the replicas of a run share their variables, so every replica must create the "
            r"same variables in the same order\n",
        ):
            await strategy.run(step)

    async def test_names_and_synchronizations_that_mean_the_same(self) -> None:
        """An empty name is a name like any other; "auto" and "on_write" both make a mirrored
        variable, so replicas spelling them differently share one."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> Variable:
            sync = "auto" if replica_id() == 0 else "on_write"
            return Variable(0.0, name="", synchronization=sync)

        made = await strategy.run(step)
        assert (type(made), made.name) == (MirroredVariable, "")

    async def test_a_refused_initial_value_makes_nothing(self) -> None:
        """A bad initial value raises in the replica that passes it and leaves no variable
        behind: the next replica to ask makes the variable from its own value."""
        strategy = MirroredStrategy(host_devices(2))
        refused = anyio.Event()

        async def step() -> Variable:
            if replica_id() == 0:
                with pytest.raises(TypeError, match="the initial value has dtype"):
                    Variable("not a number", name="w")
                refused.set()
            else:
                await refused.wait()
            return Variable(float(replica_id()) + 5.0, name="w")

        made = await strategy.run(step)
        assert_copies(made, [5.0, 5.0])

    async def test_on_simulated_gpus(self, cp: Any) -> None:
        """On GPUs every device gets its copy, ordered with the replicas' streams."""
        strategy = MirroredStrategy(["gpu:0", "gpu:1"])

        async def step() -> Any:
            v = Variable(np.arange(3.0), name="w", aggregation="sum")
            await v.assign_add(replica_context().device.asarray(np.ones(3)))
            return v, v.value() * 2

        v, doubled = await strategy.run(step)
        assert [c.get().tolist() for c in v.values] == [[2.0, 3.0, 4.0]] * 2
        assert [d.get().tolist() for d in doubled.values] == [[4.0, 6.0, 8.0]] * 2


class TestIntegerMeanVariables:
    """TF's testAssignAggregationMeanDTypeNonFloat: a mirrored integer (or bool) variable with
    aggregation MEAN takes, in replica context, the one value every replica writes."""

    async def test_the_same_value_from_every_replica(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(1, aggregation="mean", dtype=np.int32)
            three = Variable(3, aggregation="sum", dtype=np.int32)
            flag = Variable(True, aggregation="mean")

        await strategy.run(lambda: v.assign(2))
        assert_copies(v, [2, 2])
        await strategy.run(lambda: v.assign(three))
        assert_copies(v, [3, 3])

        async def add() -> None:  # equal values computed in each replica
            await v.assign_add(np.int32(2 + 0 * replica_id()))

        await strategy.run(add)
        assert_copies(v, [5, 5])
        await strategy.run(lambda: flag.assign(False))
        assert_copies(flag, [False, False])
        with strategy.scope():
            await v.assign(4)
        assert_copies(v, [4, 4])
        assert v.dtype == np.dtype(np.int32)

    async def test_different_values_are_refused_and_change_nothing(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(1, name="n", aggregation="mean", dtype=np.int32)

        async def step() -> None:
            await v.assign(replica_id())

        with pytest.raises(
            ValueError,
            match=r"^cannot write MirroredVariable 'n' of dtype int32 with aggregation MEAN in "
            r"replica context: the replicas passed different values \(replica 1 passed another "
            r"than replica 0's 0\), whose mean the dtype cannot hold \(as in TF\)",
        ):
            await strategy.run(step)
        assert_copies(v, [1, 1])


class TestTFWriteArguments:
    @pytest.mark.parametrize("op", OPS)
    async def test_tfs_write_arguments_are_accepted(self, op: str) -> None:
        """TF code passes use_locking, name and read_value (by keyword or position): the write
        happens as without them and returns the variable, or None with read_value=False (as
        TF's eager writes do)."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, np.ones(2), aggregation="mean")
        write = getattr(v, op)
        assert await write(2.0, read_value=False, use_locking=True, name="w") is None
        assert await write(2.0, False, None, True) is v
        want = expected_write(op, expected_write(op, np.ones(2), 2.0), 2.0)
        assert_all(v, want)

        async def step() -> Any:
            return await write(1.0, False, None, False)

        assert await strategy.run(step) is None
        assert_all(v, expected_write(op, want, 1.0))


class TestReads:
    @pytest.mark.replicas(*REPLICAS)
    async def test_replica_reads_own_copy(
        self, strategy_factory: StrategyFactory, replicas: int
    ) -> None:
        """In replica context value(), numpy(), np.asarray and facts read the replica's copy."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros(2), name="s", synchronization="on_read", aggregation="sum")
        seen: list[tuple[Any, ...]] = []

        async def step() -> None:
            me = replica_id()
            await v.assign([me + 1.0, 10.0 * me])
            numpy = v.numpy()
            seen.append(
                (
                    me,
                    v.value().tolist(),
                    v.read_value().tolist(),
                    numpy.tolist(),
                    numpy.flags.writeable,
                    np.asarray(v).tolist(),
                    v.value() is v.values[me],
                    (v.name, v.shape, v.dtype, v.ndim, v.size),
                )
            )

        await strategy.run(step)
        facts = ("s", (2,), np.dtype(np.float64), 1, 2)
        assert sorted(seen) == [
            (
                i,
                [i + 1.0, 10.0 * i],
                [i + 1.0, 10.0 * i],
                [i + 1.0, 10.0 * i],
                True,
                [i + 1.0, 10.0 * i],
                True,
                facts,
            )
            for i in range(replicas)
        ]

    @pytest.mark.replicas(*REPLICAS)
    async def test_mirrored_cross_replica_reads_copy_0(
        self, strategy_factory: StrategyFactory, replicas: int
    ) -> None:
        """In cross-replica context a MirroredVariable reads its primary copy, in scope and out."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros(2), name="w")
        await v.assign(Mirrored([np.array([float(i), 1.0]) for i in range(replicas)]))
        for in_scope in (False, True):
            with strategy.scope() if in_scope else contextlib.nullcontext():
                assert v.value() is v.values[0]
                np.testing.assert_array_equal(v.numpy(), [0.0, 1.0], strict=True)
                np.testing.assert_array_equal(np.asarray(v), [0.0, 1.0], strict=True)

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize(
        ("agg", "reduce"),
        [
            ("sum", lambda xs: np.sum(xs, axis=0)),
            ("mean", lambda xs: np.mean(xs, axis=0)),
            ("only_first_replica", lambda xs: xs[0]),
        ],
    )
    async def test_sync_on_read_cross_replica_reads_aggregate(
        self,
        strategy_factory: StrategyFactory,
        replicas: int,
        agg: str,
        reduce: Callable[[list[Array]], Array],
    ) -> None:
        """In cross-replica context a SyncOnReadVariable reads the aggregate of its copies."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros(3), name="s", synchronization="on_read", aggregation=agg)
        parts = [np.array([1.0, 2.0, 4.0]) * (i + 1) for i in range(replicas)]

        async def step(x: Array) -> None:
            await v.assign(x)

        await strategy.run(step, (PerReplica(parts),))
        assert_copies(v, parts)
        want = reduce(parts)
        for in_scope in (False, True):
            with strategy.scope() if in_scope else contextlib.nullcontext():
                value = v.value()
                np.testing.assert_array_equal(value, want, strict=True)
                assert value.flags.writeable is False
                np.testing.assert_array_equal(v.numpy(), want, strict=True)
                np.testing.assert_array_equal(np.asarray(v), want, strict=True)
                np.testing.assert_array_equal(v + 0, want, strict=True)
        assert_copies(v, parts)

    async def test_sync_on_read_int_sum_is_exact(self) -> None:
        """An int SUM variable's cross-replica read is the integer sum, in its dtype."""
        strategy = MirroredStrategy(host_devices(4))
        v = scoped(
            strategy, 0, name="seen", dtype=np.int32, synchronization="on_read", aggregation="sum"
        )

        async def step(x: int) -> None:
            await v.assign_add(x)

        await strategy.run(step, (PerReplica([3, 4, 5, -2]),))
        np.testing.assert_array_equal(v.value(), np.array(10, dtype=np.int32), strict=True)
        assert int(v) == 10

    def test_value_is_read_only(self) -> None:
        """value() is read-only on the host; numpy() is a writeable copy that changes nothing."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, np.zeros(2))
        with pytest.raises(ValueError, match="read-only"):
            v.value()[0] = 1.0
        copy = v.numpy()
        assert copy.flags.writeable is True
        assert not np.shares_memory(copy, v.values[0])
        copy[0] = 5.0
        assert_all(v, [0.0, 0.0])

    async def test_replica_of_other_strategy_refused(self) -> None:
        """Reading a variable inside a replica of another strategy raises RuntimeError."""
        owner = MirroredStrategy(host_devices(2))
        other = MirroredStrategy(host_devices(1))
        v = scoped(owner, 1.0, name="w")

        async def step() -> None:
            np.asarray(v)

        with pytest.raises(
            RuntimeError,
            match=r"^variable 'w' was created in the scope of "
            r"MirroredStrategy\(devices=\['cpu:0', 'cpu:1'\]\), but replica 0 of "
            r"MirroredStrategy\(devices=\['cpu:0'\]\) tried to read it; use each variable only "
            r"with the strategy that created it\n",
        ):
            await other.run(step)

    async def test_plain_variable_reads_in_any_replica(self) -> None:
        """An ordinary variable reads its one copy inside any strategy's replicas."""
        strategy = MirroredStrategy(host_devices(2))
        v = Variable([1.0, 2.0])
        seen: list[tuple[int, list[float]]] = []

        async def step() -> None:
            seen.append((replica_id(), (v * 2).tolist()))

        await strategy.run(step)
        assert sorted(seen) == [(0, [2.0, 4.0]), (1, [2.0, 4.0])]


class TestOperators:
    @pytest.mark.replicas(*REPLICAS)
    async def test_replica_context_uses_own_copy(
        self, strategy_factory: StrategyFactory, replicas: int
    ) -> None:
        """Operators, indexing, len() and float() use the replica's own copy."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros(2), synchronization="on_read", aggregation="sum")
        t = scoped(strategy, 0.0, synchronization="on_read", aggregation="sum")
        x = np.array([1.0, 10.0])
        seen: list[tuple[Any, ...]] = []

        async def step() -> None:
            me = replica_id()
            await v.assign([me + 1.0, me + 2.0])
            await t.assign(me + 0.5)
            seen.append(
                (
                    me,
                    (v + 1).tolist(),
                    float(x @ v),
                    (-v).tolist(),
                    (v * v).tolist(),
                    float(v[0]),
                    len(v),
                    float(t),
                    (v == v).tolist(),
                )
            )

        await strategy.run(step)
        assert sorted(seen) == [
            (
                i,
                [i + 2.0, i + 3.0],
                (i + 1.0) + 10.0 * (i + 2.0),
                [-(i + 1.0), -(i + 2.0)],
                [(i + 1.0) ** 2, (i + 2.0) ** 2],
                i + 1.0,
                2,
                i + 0.5,
                [True, True],
            )
            for i in range(replicas)
        ]

    @pytest.mark.replicas(*REPLICAS)
    async def test_cross_replica_uses_aggregate(
        self, strategy_factory: StrategyFactory, replicas: int
    ) -> None:
        """In cross-replica context operators use the SyncOnRead aggregate."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros(2), synchronization="on_read", aggregation="sum")
        t = scoped(strategy, 0.0, synchronization="on_read", aggregation="sum")

        async def step() -> None:
            await v.assign([1.0, 2.0])
            await t.assign(0.5)

        await strategy.run(step)
        with strategy.scope():
            np.testing.assert_array_equal(v + 1, [replicas + 1.0, 2.0 * replicas + 1], strict=True)
            np.testing.assert_array_equal(np.array([1.0, 10.0]) @ v, np.float64(21.0 * replicas))
            np.testing.assert_array_equal(-v, [-1.0 * replicas, -2.0 * replicas], strict=True)
            np.testing.assert_array_equal(
                v * v, [replicas * replicas * 1.0, replicas * replicas * 4.0], strict=True
            )
            assert float(v[1]) == 2.0 * replicas
            assert float(t) == 0.5 * replicas

    def test_eq_is_elementwise_and_unhashable(self) -> None:
        """== is elementwise, and hash() raises TypeError, for plain and mirrored variables."""
        strategy = MirroredStrategy(host_devices(2))
        for v in (Variable([1, 5]), scoped(strategy, [1, 5])):
            np.testing.assert_array_equal(v == v, [True, True], strict=True)
            np.testing.assert_array_equal(v == np.array([1, 6]), [True, False], strict=True)
            with pytest.raises(TypeError, match=r"unhashable type: .*use v\.ref\(\) as a dict key"):
                hash(v)

    def test_ref_is_the_hashable_stand_in(self) -> None:
        """v.ref() is hashable, equal for one variable and different for two; deref() gives
        the variable back (TF's ref)."""
        strategy = MirroredStrategy(host_devices(2))
        a, b = scoped(strategy, [1.0]), Variable([1.0])
        table = {a.ref(): "a", b.ref(): "b"}
        assert (table[a.ref()], table[b.ref()]) == ("a", "b")
        assert a.ref() == a.ref()
        assert a.ref() != b.ref()
        assert a.ref() != a
        assert a.ref().deref() is a
        assert len({a.ref(), a.ref(), b.ref()}) == 2

    async def test_device_and_get_shape(self) -> None:
        """v.device is the copy the context reads: each replica's own, else the first;
        get_shape() is shape."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, np.zeros((2, 3)))
        assert (v.get_shape(), v.device) == ((2, 3), "cpu:0")

        async def step() -> str:
            return v.device

        assert strategy.experimental_local_results(await strategy.run(step)) == ("cpu:0", "cpu:1")

    def test_len_and_scalar_conversions(self) -> None:
        """len() of a vector is its length; of a 0-d variable TypeError; float/int/bool of 0-d."""
        assert len(Variable(np.zeros((3, 2)))) == 3
        with pytest.raises(TypeError, match=r"^len\(\) of the 0-d variable 'z'$"):
            len(Variable(1.0, name="z"))
        assert (float(Variable(2.5)), int(Variable(7)), bool(Variable(0))) == (2.5, 7, False)

    def test_iteration(self) -> None:
        """A variable iterates as its value does; a 0-d one is not iterable (as a 0-d array),
        rather than empty."""
        assert [x.tolist() for x in Variable(np.arange(4).reshape(2, 2))] == [[0, 1], [2, 3]]
        assert 2.0 in Variable([1.0, 2.0])
        with pytest.raises(TypeError, match=r"^iteration over the 0-d variable 'z'$"):
            list(Variable(1.0, name="z"))
        with pytest.raises(TypeError):
            1.0 in Variable(1.0)  # noqa: B015

    @pytest.mark.replicas(1, 2)
    def test_ufunc_out_refused(self, strategy_factory: StrategyFactory) -> None:
        """A ufunc with out=variable, or an in-place operator, raises TypeError; nothing changes."""
        strategy = strategy_factory()
        v = scoped(strategy, np.array([1.0, 2.0]), name="w")
        with pytest.raises(
            TypeError,
            match=r"^a variable cannot be the out= of add; variables change only through "
            r"`await v\.assign\(\.\.\.\)`, `assign_add` or `assign_sub`$",
        ):
            np.add(v, 1.0, out=v)  # type: ignore[call-overload]
        with pytest.raises(TypeError, match=r"^a variable cannot be the out= of multiply"):
            v *= 2.0
        assert_all(v, [1.0, 2.0])


class TestMirroredWrites:
    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("op", OPS)
    @pytest.mark.parametrize(
        ("agg", "reduce"),
        [
            ("sum", lambda xs: np.sum(xs, axis=0)),
            ("mean", lambda xs: np.mean(xs, axis=0)),
            ("only_first_replica", lambda xs: xs[0]),
            (VariableAggregation.SUM, lambda xs: np.sum(xs, axis=0)),
        ],
    )
    async def test_replica_write_aggregates(
        self,
        strategy_factory: StrategyFactory,
        replicas: int,
        op: str,
        agg: str,
        reduce: Callable[[list[Array]], Array],
    ) -> None:
        """Per-replica values are aggregated and written to every copy, in one merge round."""
        strategy = strategy_factory()
        initial = np.array([10.0, 20.0, 30.0])
        v = scoped(strategy, initial, name="w", aggregation=agg)
        parts = [np.array([1.0, 2.0, 4.0]) * (i + 1) for i in range(replicas)]
        rounds = strategy.statistics().merge_rounds_completed

        async def step(x: Array) -> Variable:
            return await WRITES[op](v, x)

        result = await strategy.run(step, (PerReplica(parts),))
        assert result is v
        assert strategy.statistics().merge_rounds_completed == rounds + 1
        assert_all(v, expected_write(op, initial, reduce(parts)))

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("op", OPS)
    @pytest.mark.parametrize("agg", ["sum", "only_first_replica"])
    async def test_replica_write_int_variable(
        self, strategy_factory: StrategyFactory, replicas: int, op: str, agg: str
    ) -> None:
        """Integer variables aggregate integer writes exactly and keep their dtype."""
        strategy = strategy_factory()
        initial = np.array([100, -100], dtype=np.int32)
        v = scoped(strategy, initial, name="n", aggregation=agg)
        parts = [np.array([i + 1, 3 * i - 5]) for i in range(replicas)]
        reduced = np.sum(parts, axis=0) if agg == "sum" else parts[0]

        async def step(x: Array) -> None:
            await WRITES[op](v, x)

        await strategy.run(step, (PerReplica(parts),))
        assert_all(v, expected_write(op, initial, reduced).astype(np.int32))

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("agg", ["sum", "mean", "only_first_replica"])
    async def test_replica_write_broadcasts_scalar(
        self, strategy_factory: StrategyFactory, replicas: int, agg: str
    ) -> None:
        """A scalar written from replica context is broadcast to the variable's shape."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros((2, 2)), aggregation=agg)

        async def step() -> None:
            await v.assign_add(float(replica_id() + 1))

        await strategy.run(step)
        want = {
            "sum": replicas * (replicas + 1) / 2,
            "mean": (replicas + 1) / 2,
            "only_first_replica": 1.0,
        }[agg]
        assert_all(v, np.full((2, 2), want))

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("op", OPS)
    async def test_replica_write_without_aggregation_takes_the_one_value(
        self, strategy_factory: StrategyFactory, replicas: int, op: str
    ) -> None:
        """Aggregation NONE in replica context (TF's testAssignMirroredVarReplicaContext-
        WithoutAggregationType): the value every replica writes goes to every copy."""
        strategy = strategy_factory()
        v = scoped(strategy, np.array([1.0, 2.0]), name="w")

        async def step() -> None:
            await WRITES[op](v, np.float64(5.0))  # made in each replica alike

        await strategy.run(step)
        assert_all(v, expected_write(op, np.array([1.0, 2.0]), 5.0))

    @pytest.mark.parametrize(
        ("dtype", "mine", "other", "same"),
        [
            (np.float64, np.nan, 1.0, False),
            (np.float64, np.nan, np.nan, True),
            (np.float64, -0.0, 0.0, True),
            (np.complex128, 1 + 2j, 1 + 2j, True),
            (np.complex128, 1 + 2j, 1 - 2j, False),
        ],
        ids=["nan vs number", "nan vs nan", "signed zeros", "complex", "complex differs"],
    )
    async def test_one_value_writes_compare_every_value(
        self, dtype: type, mine: Any, other: Any, same: bool
    ) -> None:
        """Without aggregation, the replicas' values must be the same for every dtype: a NaN
        beside a number differs, NaNs and zeros of either sign agree, complex numbers
        compare."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(dtype(0), name="w", aggregation="none")

        async def step() -> None:
            await v.assign(dtype(mine if replica_id() == 0 else other))

        if same:
            await strategy.run(step)
            assert [c.tobytes() for c in v.values] == [np.asarray(dtype(mine)).tobytes()] * 2
        else:
            with pytest.raises(ValueError, match=r"the replicas passed different values"):
                await strategy.run(step)
            assert_copies(v, [dtype(0)] * 2)

    @pytest.mark.replicas(2, 4)
    @pytest.mark.parametrize("op", OPS)
    async def test_replica_write_without_aggregation_of_different_values_refused(
        self, strategy_factory: StrategyFactory, replicas: int, op: str
    ) -> None:
        """Different values, which a variable without aggregation cannot combine, raise
        ValueError saying what to do; no copy changes."""
        strategy = strategy_factory()
        v = scoped(strategy, np.array([1.0, 2.0]), name="w")
        old = snapshot(v)

        async def step() -> None:
            await WRITES[op](v, float(replica_id()))

        with pytest.raises(
            ValueError,
            match=r"^cannot write MirroredVariable 'w' of dtype float64 with aggregation NONE in "
            r"replica context: the replicas passed different values \(replicas? [0-9, and]+ "
            r"passed another than replica 0's \[0\.0, 0\.0\]\), which it has no "
            r"aggregation to combine; pass the same value from every replica, give it "
            r"aggregation 'sum', 'mean' or 'only_first_replica', or write it in cross-replica "
            r"context",
        ):
            await strategy.run(step)
        assert_copies(v, old)

    async def test_a_long_value_is_shown_elided_in_the_refusal(self) -> None:
        """A long array in that refusal is shown elided in the middle, as an array, with its
        brackets balanced (not cut off as a list); no copy changes."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, np.zeros(1000), name="long")

        async def step() -> None:
            await v.assign(np.full(1000, float(replica_id())))

        with pytest.raises(
            ValueError,
            match=re.escape("(replica 1 passed another than replica 0's [0., 0., ..., 0., 0.]), "),
        ):
            await strategy.run(step)
        assert_copies(v, [np.zeros(1000)] * 2)

    @pytest.mark.parametrize("agg", ["none", "sum", "mean", "only_first_replica"])
    @pytest.mark.parametrize("how", ["assign_add", "update"])
    async def test_replicas_writing_different_variables_of_equal_value_refused(
        self, agg: str, how: str
    ) -> None:
        """Two variables are two, even when their values are equal (a 0-d variable's == is a
        plain True then): replicas writing different ones raise ReplicaSyncError naming the
        odd replica, and neither variable changes (the write must not land in replica 0's)."""
        strategy = MirroredStrategy(host_devices(2))
        a = scoped(strategy, 0.0, name="a", aggregation=agg)
        b = scoped(strategy, 0.0, name="b", aggregation=agg)

        async def step() -> None:
            mine = a if replica_id() == 0 else b
            if how == "update":
                await strategy.extended.update(mine, np.add, (1.0,))
            else:
                await mine.assign_add(np.float64(1.0))

        with pytest.raises(ReplicaSyncError, match="disagree on the variable") as info:
            await strategy.run(step)
        assert info.value.replicas == (1,)
        assert [a.numpy().tolist(), b.numpy().tolist()] == [0.0, 0.0]

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("op", OPS)
    @pytest.mark.parametrize("in_scope", [False, True])
    @pytest.mark.parametrize("agg", ["none", "sum"])
    async def test_cross_replica_write_every_copy(
        self, strategy_factory: StrategyFactory, op: str, in_scope: bool, agg: str
    ) -> None:
        """In cross-replica context a write applies the value to every copy and returns v."""
        strategy = strategy_factory()
        initial = np.array([1.0, 2.0, 3.0])
        v = scoped(strategy, initial, aggregation=agg)
        with strategy.scope() if in_scope else contextlib.nullcontext():
            result = await WRITES[op](v, [0.5, 1.0, -4.0])
        assert result is v
        assert_all(v, expected_write(op, initial, np.array([0.5, 1.0, -4.0])))

    @pytest.mark.replicas(*REPLICAS)
    async def test_cross_replica_broadcasts_scalar(self, strategy_factory: StrategyFactory) -> None:
        """A scalar written in cross-replica context is broadcast to every copy's shape."""
        strategy = strategy_factory()
        v = scoped(strategy, np.ones((2, 3)))
        await v.assign_sub(2)
        assert_all(v, np.full((2, 3), -1.0))

    async def test_write_inside_merge_fn(self) -> None:
        """A write inside merge_fn is cross-replica: applied once, to every copy."""
        strategy = MirroredStrategy(host_devices(3))
        v = scoped(strategy, np.zeros(2))

        async def merge(strategy: MirroredStrategy) -> None:
            await v.assign_add(1.0)

        async def step() -> None:
            await replica_context().merge_call(merge)

        await strategy.run(step)
        assert_all(v, [1.0, 1.0])

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("op", OPS)
    async def test_cross_replica_mirrored_value_per_copy(
        self, strategy_factory: StrategyFactory, replicas: int, op: str
    ) -> None:
        """A Mirrored value writes its component i into copy i."""
        strategy = strategy_factory()
        initial = np.array([1.0, 2.0])
        v = scoped(strategy, initial)
        parts = [np.array([float(i), -float(i)]) for i in range(replicas)]
        await WRITES[op](v, Mirrored(parts))
        assert_copies(v, [expected_write(op, initial, part) for part in parts])

    async def test_cross_replica_mirrored_value_wrong_count(self) -> None:
        """A Mirrored value with a different number of components raises ValueError."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, np.zeros(2), name="w")
        with pytest.raises(
            ValueError,
            match=r"^variable 'w' has 2 copies but the Mirrored value written to it has 3$",
        ):
            await v.assign(Mirrored([1.0, 2.0, 3.0]))
        assert_all(v, [0.0, 0.0])

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("op", OPS)
    async def test_cross_replica_per_replica_refused(
        self, strategy_factory: StrategyFactory, replicas: int, op: str
    ) -> None:
        """A PerReplica value in cross-replica context raises TypeError; nothing changes."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros(2), name="w", aggregation="sum")
        with pytest.raises(
            TypeError,
            match=r"^variable 'w' was written in cross-replica context with a PerReplica value, "
            r"which holds a different value per replica; reduce it first \(strategy\.reduce\) "
            r"or write it from replica context, inside run\(\)$",
        ):
            await WRITES[op](v, PerReplica([np.ones(2)] * replicas))
        assert_all(v, [0.0, 0.0])

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("op", OPS)
    async def test_cross_replica_wrong_shape_refused(
        self, strategy_factory: StrategyFactory, op: str
    ) -> None:
        """A value that does not broadcast raises ValueError naming the variable; no change."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros(3), name="w")
        with pytest.raises(
            ValueError,
            match=r"^cannot write a value of shape \(2,\) to variable 'w' of shape \(3,\); it must "
            r"broadcast to \(3,\)$",
        ):
            await WRITES[op](v, [1.0, 2.0])
        with pytest.raises(
            ValueError, match=r"^cannot write a value of shape \(2, 3\) to variable 'w'"
        ):
            await WRITES[op](v, np.ones((2, 3)))
        assert_all(v, [0.0, 0.0, 0.0])

    @pytest.mark.replicas(2, 4)
    @pytest.mark.parametrize("op", OPS)
    async def test_replica_wrong_shape_names_replica(
        self, strategy_factory: StrategyFactory, replicas: int, op: str
    ) -> None:
        """A replica passing a bad shape raises ValueError naming it and the variable; no change."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros(3), name="w", aggregation="sum")
        old = snapshot(v)
        parts = [np.ones(3)] * replicas
        parts[1] = np.ones(4)

        async def step(x: Array) -> None:
            await WRITES[op](v, x)

        with pytest.raises(
            ValueError,
            match=r"^cannot write a value of shape \(4,\) to variable 'w' of shape \(3,\) from "
            r"replica 1; it must broadcast to \(3,\)\n",
        ):
            await strategy.run(step, (PerReplica(parts),))
        assert_copies(v, old)

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("op", OPS)
    async def test_uncastable_dtype_refused(
        self, strategy_factory: StrategyFactory, op: str
    ) -> None:
        """A float written to an int variable raises TypeError in both contexts; no change."""
        strategy = strategy_factory()
        v = scoped(strategy, np.array([1, 2]), name="n", aggregation="sum")
        old = snapshot(v)
        with pytest.raises(
            TypeError,
            match=r"^cannot write a value of dtype float64 to variable 'n' of dtype int64; cast it "
            r"first \(e\.g\. value\.astype\(int64\)\)$",
        ):
            await WRITES[op](v, [1.5, 2.0])

        async def step() -> None:
            await WRITES[op](v, 1.5)

        with pytest.raises(
            TypeError,
            match=r"^cannot write a value of dtype float64 to variable 'n' of dtype int64 from "
            r"replica \d; cast it first \(e\.g\. value\.astype\(int64\)\)\n",
        ):
            await strategy.run(step)
        with pytest.raises(TypeError, match=r"^cannot write a value of dtype <U1 to variable 'n'"):
            await WRITES[op](v, "a")
        assert_copies(v, old)

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("op", OPS)
    async def test_integers_out_of_range_refused(
        self, strategy_factory: StrategyFactory, op: str
    ) -> None:
        """An integer the variable's dtype cannot hold would wrap around in the cast: a
        ValueError naming it (in both contexts), as is an int too large for any NumPy
        integer; values in range are written; no change on refusal."""
        strategy = strategy_factory()
        v = scoped(strategy, np.array([1, 2], np.int32), name="n", aggregation="sum")
        old = snapshot(v)
        with pytest.raises(
            ValueError,
            match=r"^cannot write 1099511627776 to variable 'n' of dtype int32, which holds "
            r"-2147483648 to 2147483647; the cast would wrap it around$",
        ):
            await WRITES[op](v, np.array([2**40, 1]))
        with pytest.raises(ValueError, match=r"^cannot write -2147483649 to variable 'n' from"):
            await strategy.run(lambda: WRITES[op](v, -(2**31) - 1))
        with pytest.raises(
            ValueError,
            match=r"^cannot write 1180591620717411303424 to variable 'n' of dtype int32: it "
            r"fits no NumPy integer dtype, nor this one; nothing was written$",
        ):
            await WRITES[op](v, 2**70)
        assert_copies(v, old)
        await v.assign(np.array([2**31 - 1, -(2**31)], np.int64))  # in range: written
        assert_all(v, np.array([2**31 - 1, -(2**31)], np.int32))

    @pytest.mark.parametrize("agg", ["sum", "only_first_replica"])
    async def test_replica_distributed_value_refused(self, agg: str) -> None:
        """A PerReplica or Mirrored value written inside a replica is refused with what to
        pass instead (it said the value was no array of numbers); no change."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, 0.0, name="w", aggregation=agg)
        await assert_distributed_refused_in_replicas(strategy, v)

    async def test_replica_python_ints_take_an_unsigned_dtype(self) -> None:
        """Python ints written from replicas to an unsigned variable take its dtype where
        they fit (as TF converts them); one out of range is a ValueError naming it."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, np.uint8(250), name="w", aggregation="sum")
        await strategy.run(lambda: v.assign_add(replica_id() + 1))
        assert_all(v, np.uint8(253))
        with pytest.raises(
            ValueError,
            match=r"^cannot write -\d to variable 'w' from replica \d of dtype uint8, which holds "
            r"0 to 255; the cast would wrap it around\n",
        ):
            await strategy.run(lambda: v.assign_sub(-1 - replica_id()))
        assert_all(v, np.uint8(253))

    async def test_replica_of_other_strategy_refused(self) -> None:
        """Writing inside a replica of another strategy raises RuntimeError; nothing changes."""
        owner = MirroredStrategy(host_devices(2))
        other = MirroredStrategy(host_devices(1))
        v = scoped(owner, 1.0, name="w", aggregation="sum")

        async def step() -> None:
            await v.assign_add(1.0)

        with pytest.raises(
            RuntimeError,
            match=r"^variable 'w' was created in the scope of MirroredStrategy\(devices=\['cpu:0', "
            r"'cpu:1'\]\), but replica 0 of MirroredStrategy\(devices=\['cpu:0'\]\) tried to "
            r"assign_add it; use each variable only with the strategy that created it\n",
        ):
            await other.run(step)
        assert_all(v, 1.0)

    @pytest.mark.parametrize("agg", ["sum", "mean", "only_first_replica"])
    async def test_replica_write_on_devices_with_custom_names(self, agg: str) -> None:
        """A replica-context write works on third-party devices whose names are not cpu:N."""
        strategy = MirroredStrategy([FakeDevice(f"fake:{i}", i) for i in range(2)])
        v = scoped(strategy, np.zeros(2), name="w", aggregation=agg)
        await v.assign([1.0, 1.0])  # cross-replica writes work on these devices

        async def step(x: float) -> None:
            await v.assign_add(x)

        await strategy.run(step, (PerReplica([1.0, 3.0]),))
        want = {"sum": 5.0, "mean": 3.0, "only_first_replica": 2.0}[agg]
        assert_all(v, [want, want])


class TestSyncOnReadWrites:
    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("op", OPS)
    @pytest.mark.parametrize("agg", ["sum", "mean", "only_first_replica"])
    async def test_replica_write_changes_local_copy(
        self, strategy_factory: StrategyFactory, replicas: int, op: str, agg: str
    ) -> None:
        """In replica context each replica writes its own copy only, and gets v back."""
        strategy = strategy_factory()
        initial = np.array([1.0, 2.0])
        v = scoped(strategy, initial, synchronization="on_read", aggregation=agg)
        rounds = strategy.statistics().merge_rounds_completed

        async def step() -> Variable:
            return await WRITES[op](v, [10.0 * (replica_id() + 1), 1.0])

        assert await strategy.run(step) is v
        assert strategy.statistics().merge_rounds_completed == rounds
        assert_copies(
            v,
            [expected_write(op, initial, np.array([10.0 * (i + 1), 1.0])) for i in range(replicas)],
        )

    @pytest.mark.parametrize("op", OPS)
    async def test_one_replica_writing_leaves_others(self, op: str) -> None:
        """A write by replica 2 alone changes copy 2 and no other."""
        strategy = MirroredStrategy(host_devices(4))
        v = scoped(strategy, np.array([1, 2]), synchronization="on_read", aggregation="sum")

        async def step() -> None:
            if replica_id() == 2:
                await WRITES[op](v, 5)

        await strategy.run(step)
        mine = expected_write(op, np.array([1, 2]), 5)
        assert_copies(v, [[1, 2], [1, 2], mine, [1, 2]])

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("in_scope", [False, True])
    async def test_cross_replica_assign_sum_splits_float(
        self, strategy_factory: StrategyFactory, replicas: int, in_scope: bool
    ) -> None:
        """assign() with SUM stores value / n in each float copy, so the aggregate is the value."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros(3), synchronization="on_read", aggregation="sum")
        x = np.array([8.0, -4.0, 2.0])
        with strategy.scope() if in_scope else contextlib.nullcontext():
            assert await v.assign(x) is v
            np.testing.assert_array_equal(v.value(), x, strict=True)
        assert_all(v, x / replicas)

    @pytest.mark.replicas(*REPLICAS, 3)
    async def test_cross_replica_assign_sum_splits_int(
        self, strategy_factory: StrategyFactory, replicas: int
    ) -> None:
        """An int SUM variable gets the quotient in each copy and the remainder on copy 0."""
        strategy = strategy_factory()
        v = scoped(
            strategy, np.zeros(5, dtype=np.int64), synchronization="on_read", aggregation="sum"
        )
        x = np.array([7, -7, 8, 0, 1])
        await v.assign(x)
        quotient, remainder = np.divmod(x, replicas)
        assert_copies(v, [quotient + remainder] + [quotient] * (replicas - 1))
        np.testing.assert_array_equal(np.sum(v.values, axis=0), x, strict=True)
        np.testing.assert_array_equal(v.value(), x, strict=True)

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("agg", ["mean", "only_first_replica"])
    async def test_cross_replica_assign_mean_first_each_copy(
        self, strategy_factory: StrategyFactory, agg: str
    ) -> None:
        """assign() with MEAN or ONLY_FIRST_REPLICA writes the value into every copy."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros(2), synchronization="on_read", aggregation=agg)
        await v.assign([3.0, 5.0])
        assert_all(v, [3.0, 5.0])
        np.testing.assert_array_equal(v.value(), [3.0, 5.0], strict=True)

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("op", ["assign_add", "assign_sub"])
    async def test_cross_replica_add_sub_with_sum_refused(
        self, strategy_factory: StrategyFactory, op: str
    ) -> None:
        """assign_add/assign_sub with SUM in cross-replica context raise ValueError; no change."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros(2), name="s", synchronization="on_read", aggregation="sum")
        with pytest.raises(
            ValueError,
            match=rf"^{op}\(\) on SyncOnReadVariable 's' in cross-replica context is not supported "
            r"with aggregation SUM \(it would change the sum by num_replicas times the value\); "
            r"call it in replica context, or assign\(\) the new total$",
        ):
            await WRITES[op](v, 1.0)
        assert_all(v, [0.0, 0.0])

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("op", ["assign_add", "assign_sub"])
    @pytest.mark.parametrize("agg", ["mean", "only_first_replica"])
    async def test_cross_replica_add_sub_every_copy(
        self, strategy_factory: StrategyFactory, replicas: int, op: str, agg: str
    ) -> None:
        """assign_add/assign_sub with MEAN or ONLY_FIRST_REPLICA apply to every copy."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros(2), synchronization="on_read", aggregation=agg)

        async def step() -> None:
            await v.assign([float(replica_id()), 1.0])

        await strategy.run(step)
        assert await WRITES[op](v, [2.0, 0.5]) is v
        assert_copies(
            v,
            [
                expected_write(op, np.array([float(i), 1.0]), np.array([2.0, 0.5]))
                for i in range(replicas)
            ],
        )

    async def test_replica_distributed_value_refused(self) -> None:
        """A PerReplica or Mirrored value written inside a replica is refused with what to
        pass instead; no copy changes."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, 0.0, name="s", synchronization="on_read", aggregation="sum")
        await assert_distributed_refused_in_replicas(strategy, v)

    async def test_replica_python_ints_take_an_unsigned_dtype(self) -> None:
        """A uint8 counter takes Python ints from its replicas (TF converts them to the
        variable's dtype); one out of range is a ValueError naming it; no change then."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, np.uint8(0), name="seen", synchronization="on_read", aggregation="sum")
        await strategy.run(lambda: v.assign_add(1))
        await strategy.run(lambda: v.assign_add(replica_id() + 1))
        assert_copies(v, [2, 3])
        assert int(v) == 5
        with pytest.raises(
            ValueError,
            match=r"^cannot write 256 to variable 'seen' from replica \d of dtype uint8, which "
            r"holds 0 to 255; the cast would wrap it around\n",
        ):
            await strategy.run(lambda: v.assign(256))
        assert_copies(v, [2, 3])

    async def test_cross_replica_per_replica_refused(self) -> None:
        """A PerReplica value in cross-replica context raises TypeError; nothing changes."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, 0.0, name="s", synchronization="on_read", aggregation="mean")
        with pytest.raises(
            TypeError, match=r"^variable 's' was written in cross-replica context with a PerReplica"
        ):
            await v.assign(PerReplica([1.0, 2.0]))
        assert_all(v, 0.0)

    @pytest.mark.parametrize("op", OPS)
    async def test_replica_bad_value_refused(self, op: str) -> None:
        """A bad shape or dtype from a replica raises an error naming it; no copy changes."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(
            strategy,
            np.zeros(2, dtype=np.int64),
            name="s",
            synchronization="on_read",
            aggregation="sum",
        )

        async def step(x: Any) -> None:
            if x is not None:  # the other replicas write nothing
                await WRITES[op](v, x)

        with pytest.raises(
            ValueError,
            match=r"^cannot write a value of shape \(3,\) to variable 's' of shape \(2,\) from "
            r"replica 0; it must broadcast to \(2,\)\n",
        ):
            await strategy.run(step, (PerReplica([[1, 2, 3], None]),))
        with pytest.raises(
            TypeError,
            match=r"^cannot write a value of dtype float64 to variable 's' of dtype int64 from "
            r"replica 1; cast it first \(e\.g\. value\.astype\(int64\)\)\n",
        ):
            await strategy.run(step, (PerReplica([None, 0.5]),))
        assert_copies(v, [[0, 0], [0, 0]])

    async def test_replica_of_other_strategy_refused(self) -> None:
        """Writing inside a replica of another strategy raises RuntimeError."""
        owner = MirroredStrategy(host_devices(2))
        other = MirroredStrategy(host_devices(1))
        v = scoped(owner, 1.0, name="s", synchronization="on_read", aggregation="sum")

        async def step() -> None:
            await v.assign(2.0)

        with pytest.raises(
            RuntimeError, match=r"^variable 's' was created in the scope of .* tried to assign it;"
        ):
            await other.run(step)
        assert_all(v, 1.0)


class TestPlainVariable:
    @pytest.mark.parametrize("op", OPS)
    async def test_write_in_default_context(self, op: str) -> None:
        """assign/assign_add/assign_sub work in the default context and return the variable."""
        v = Variable(np.array([1.0, 2.0]))
        assert await WRITES[op](v, [3.0, 5.0]) is v
        assert_copies(v, [expected_write(op, np.array([1.0, 2.0]), np.array([3.0, 5.0]))])

    @pytest.mark.replicas(*REPLICAS)
    @pytest.mark.parametrize("op", ["assign_add", "assign_sub"])
    async def test_write_inside_replicas(
        self, strategy_factory: StrategyFactory, replicas: int, op: str
    ) -> None:
        """Inside a strategy's replicas every replica's write applies to the one copy."""
        strategy = strategy_factory()
        v = Variable(100)

        async def step() -> None:
            await WRITES[op](v, replica_id() + 1)

        await strategy.run(step)
        total = replicas * (replicas + 1) // 2
        assert_copies(v, [100 + total if op == "assign_add" else 100 - total])

    async def test_assign_inside_replica(self) -> None:
        """assign() from a replica writes the one copy."""
        strategy = MirroredStrategy(host_devices(1))
        v = Variable(np.zeros(2))

        async def step() -> None:
            await v.assign([1.0, 2.0])

        await strategy.run(step)
        assert_copies(v, [[1.0, 2.0]])

    async def test_write_in_a_scope(self) -> None:
        """An ordinary variable is written in another strategy's cross-replica context too."""
        strategy = MirroredStrategy(host_devices(2))
        v = Variable(1.0)
        with strategy.scope():
            await v.assign_add(1.0)
        assert_copies(v, [2.0])

    async def test_bad_values_refused(self) -> None:
        """Bad shape, dtype or a PerReplica raise; nothing changes."""
        v = Variable(np.zeros(2, dtype=np.int32), name="p")
        with pytest.raises(
            ValueError,
            match=r"^cannot write a value of shape \(3,\) to variable 'p' of shape \(2,\); it",
        ):
            await v.assign([1, 2, 3])
        with pytest.raises(
            TypeError,
            match=r"^cannot write a value of dtype float64 to variable 'p' of dtype int32;",
        ):
            await v.assign_add(0.5)
        with pytest.raises(
            TypeError,
            match=r"^variable 'p' was written outside a replica with a PerReplica value, which "
            r"holds a different value per replica; reduce it first \(strategy\.reduce\), or "
            r"pass it to strategy\.run\(\) and write each replica's own part there$",
        ):
            await v.assign(PerReplica([1, 2]))
        assert_copies(v, [[0, 0]])

    @pytest.mark.parametrize("op", OPS)
    async def test_mirrored_value_written_as_its_value(self, op: str) -> None:
        """Outside a replica a Mirrored value writes its value (replica 0's copy)."""
        v = Variable(np.array([1.0, 2.0]), name="p")
        await WRITES[op](v, Mirrored([np.array([3.0, 5.0])] * 2))
        assert_copies(v, [expected_write(op, np.array([1.0, 2.0]), np.array([3.0, 5.0]))])

    async def test_replica_distributed_value_refused(self) -> None:
        """A PerReplica or Mirrored value written inside a replica is refused with what to
        pass instead; no change."""
        await assert_distributed_refused_in_replicas(
            MirroredStrategy(host_devices(2)), Variable(0.0, name="p")
        )

    async def test_python_ints_take_an_unsigned_or_bool_dtype(self) -> None:
        """A Python int has no dtype of its own: written to an unsigned or bool variable, it
        takes the variable's where it fits, as it does a signed one's (and as TF converts
        it); a float or a NumPy int64 is still refused there."""
        count = Variable(np.uint32(0), name="count")
        big = Variable(np.uint64(0), name="big")
        flag = Variable(True, name="flag")
        await count.assign_add(1)
        await count.assign_add(2**32 - 2)
        assert_copies(count, [np.uint32(2**32 - 1)])
        await count.assign_sub(2**32 - 1)
        assert_copies(count, [np.uint32(0)])
        await big.assign(2**64 - 1)
        assert_copies(big, [np.uint64(2**64 - 1)])
        await flag.assign(0)
        assert_copies(flag, [False])
        await flag.assign(1)
        assert_copies(flag, [True])
        with pytest.raises(TypeError, match=r"^cannot write a value of dtype float64 to var"):
            await count.assign(1.0)
        with pytest.raises(TypeError, match=r"^cannot write a value of dtype int64 to var"):
            await count.assign(np.int64(1))
        assert_copies(count, [np.uint32(0)])

    @pytest.mark.parametrize(
        ("initial", "value", "message"),
        [
            (np.uint8(7), -1, "-1 to variable 'v' of dtype uint8, which holds 0 to 255; the cast"),
            (np.uint8(7), 256, "256 to variable 'v' of dtype uint8, which holds 0 to 255; the"),
            (
                np.uint64(7),
                -(2**63),
                "-9223372036854775808 to variable 'v' of dtype uint64, which holds 0 to "
                "18446744073709551615; the cast would wrap it around",
            ),
            (
                True,
                2,
                "2 to variable 'v' of dtype bool, which holds 0 (False) and 1 (True); write a "
                "bool, or compare first (value != 0)",
            ),
            (True, -1, "-1 to variable 'v' of dtype bool, which holds 0 (False) and 1 (True)"),
        ],
        ids=["uint8-negative", "uint8-too-large", "uint64-negative", "bool-2", "bool-negative"],
    )
    async def test_python_ints_out_of_range_refused(
        self, initial: Any, value: int, message: str
    ) -> None:
        """A Python int an unsigned or bool variable cannot hold is a ValueError naming the
        value, the variable and its range, as for a signed one; no change."""
        v = Variable(initial, name="v")
        for write in WRITES.values():
            with pytest.raises(ValueError, match=f"^cannot write {re.escape(message)}"):
                await write(v, value)
        assert_copies(v, [initial])


class TestAllOrNothing:
    async def test_cancel_cross_replica_write(self) -> None:
        """A write cancelled while a copy is computed leaves every copy old; a later one works."""
        strategy, gate = gated_strategy(3)
        v = scoped(strategy, np.arange(3.0), name="w")
        gate.block = 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(v.assign, [5.0, 6.0, 7.0])
            await gate.blocked.wait()
            tg.cancel_scope.cancel()
        assert gate.calls == ["cpu:0", "cpu:1"]
        assert_all(v, [0.0, 1.0, 2.0])

        gate.block = None
        gate.calls.clear()
        await v.assign_add([5.0, 6.0, 7.0])
        assert gate.calls == ["cpu:0", "cpu:1", "cpu:2"]
        assert_all(v, [5.0, 7.0, 9.0])

    async def test_cancel_replica_write(self) -> None:
        """Cancelling a run while its merged write is computed leaves every copy old."""
        strategy, gate = gated_strategy(3)
        v = scoped(strategy, np.zeros(2), name="w", aggregation="sum")
        await distinct_copies(v, np.array([1.0, 2.0]))
        gate.calls.clear()
        gate.block = 2

        async def step(x: float) -> None:
            await v.assign_add(x)

        args = (PerReplica([1.0, 2.0, 3.0]),)
        async with anyio.create_task_group() as tg:
            tg.start_soon(strategy.run, step, args)
            await gate.blocked.wait()
            tg.cancel_scope.cancel()
        assert gate.calls == ["cpu:0", "cpu:1", "cpu:2"]
        assert_all(v, [1.0, 2.0])
        stats = strategy.statistics()
        assert (stats.runs_active, stats.replicas_waiting) == (0, 0)

        gate.block = None
        gate.calls.clear()
        await strategy.run(step, args)
        assert gate.calls == ["cpu:0", "cpu:1", "cpu:2"]
        assert_all(v, [7.0, 8.0])

    async def test_cancel_sync_on_read_cross_replica_write(self) -> None:
        """A cancelled cross-replica write of a SyncOnReadVariable leaves every copy old."""
        strategy, gate = gated_strategy(3)
        v = scoped(strategy, np.zeros(2), name="s", synchronization="on_read", aggregation="sum")
        gate.block = 2
        async with anyio.create_task_group() as tg:
            tg.start_soon(v.assign, [3.0, 6.0])
            await gate.blocked.wait()
            tg.cancel_scope.cancel()
        assert gate.calls == ["cpu:0", "cpu:1", "cpu:2"]
        assert_all(v, [0.0, 0.0])

    async def test_cancel_update(self) -> None:
        """A cancelled strategy.extended.update leaves every copy old."""
        strategy, gate = gated_strategy(3)
        v = scoped(strategy, np.zeros(2), name="w")
        await distinct_copies(v, np.array([1.0, 2.0]))
        gate.calls.clear()
        gate.block = 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(strategy.extended.update, v, np.add, (1.0,))
            await gate.blocked.wait()
            tg.cancel_scope.cancel()
        assert gate.calls == ["cpu:0", "cpu:1"]
        assert_all(v, [1.0, 2.0])

    async def test_device_failure_cross_replica(self) -> None:
        """A device failing on copy 2 fails the write with its error; no copy changes."""
        strategy, gate = gated_strategy(3)
        v = scoped(strategy, np.arange(3.0), name="w")
        gate.fail = 2
        with pytest.raises(DeviceFailure, match=r"^cpu:2 failed$"):
            await v.assign_add([1.0, 1.0, 1.0])
        assert gate.calls == ["cpu:0", "cpu:1", "cpu:2"]
        assert_all(v, [0.0, 1.0, 2.0])

    async def test_device_failure_replica_write(self) -> None:
        """A device failing on copy 2 fails the run with its error; no copy changes."""
        strategy, gate = gated_strategy(3)
        v = scoped(strategy, np.zeros(2), name="w", aggregation="mean")
        await distinct_copies(v, np.array([1.0, 2.0]))
        gate.calls.clear()
        gate.fail = 2

        async def step(x: float) -> None:
            await v.assign(x)

        with pytest.raises(DeviceFailure, match=r"^cpu:2 failed\n"):
            await strategy.run(step, (PerReplica([1.0, 2.0, 3.0]),))
        assert gate.calls == ["cpu:0", "cpu:1", "cpu:2"]
        assert_all(v, [1.0, 2.0])

    async def test_device_failure_update(self) -> None:
        """A device failing on copy 2 fails update with its error; no copy changes."""
        strategy, gate = gated_strategy(3)
        v = scoped(strategy, np.zeros(2), name="w")
        await distinct_copies(v, np.array([1.0, 2.0]))
        gate.calls.clear()
        gate.fail = 2
        with pytest.raises(DeviceFailure, match=r"^cpu:2 failed$"):
            await strategy.extended.update(v, np.multiply, (3.0,))
        assert gate.calls == ["cpu:0", "cpu:1", "cpu:2"]
        assert_all(v, [1.0, 2.0])


def scale_and_shift(copy: Array, factor: float, *, shift: float = 0.0) -> Array:
    result: Array = copy * factor + shift
    return result


class TestUpdate:
    async def test_an_async_fn_is_refused(self) -> None:
        """fn returns each copy's new value, so an async one (or one returning an awaitable)
        is a TypeError saying so, its coroutine closed (no never-awaited warning, which the
        suite makes an error); nothing changes."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, np.array([1.0, 2.0]), name="w")

        async def fn(copy: Array) -> Array:
            return copy + 1

        with pytest.raises(
            TypeError, match=r"^update\(\) of variable 'w': fn .* is async; fn must"
        ):
            await strategy.extended.update(v, fn)
        with pytest.raises(TypeError, match=r"fn returned coroutine <coroutine object .*fn must"):
            await strategy.extended.update(v, lambda copy: fn(copy))
        assert_all(v, [1.0, 2.0])

    async def test_tfs_assigning_fn_gets_a_hint(self) -> None:
        """A TF update function that assigns to its component fails on the array it gets;
        the AttributeError carries a note saying what to write instead."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, np.array([1.0, 2.0]), name="w")
        with pytest.raises(AttributeError, match="assign_sub") as info:
            await strategy.extended.update(v, lambda var, g: var.assign_sub(g), (1.0,))
        assert info.value.__notes__ == [
            "update()'s fn gets each copy's value (an array) and returns the copy's new value, "
            "where TF's assigns to a component variable: write `lambda v, g: v - g` for TF's "
            "`lambda v, g: v.assign_sub(g)`"
        ]
        assert_all(v, [1.0, 2.0])

    async def test_per_replica_partials_with_equal_arguments(self) -> None:
        """Each replica's own partial of one function with equal arguments is one update
        function: extended.update in replica context applies it once to every copy."""
        strategy = MirroredStrategy(host_devices(3))
        v = scoped(strategy, np.array([1.0, 2.0]))

        async def step() -> None:
            fn = functools.partial(scale_and_shift, shift=2.0)
            await strategy.extended.update(v, fn, (10.0,))

        await strategy.run(step)
        assert_all(v, [12.0, 22.0])

    async def test_per_replica_partials_with_different_arguments(self) -> None:
        """Partials whose bound arguments differ per replica are refused with ReplicaSyncError
        naming the odd replica; no copy changes (replica 0's partial does not silently win)."""
        strategy = MirroredStrategy(host_devices(3))
        v = scoped(strategy, np.array([1.0, 2.0]))

        async def step() -> None:
            fn = functools.partial(scale_and_shift, shift=float(replica_id() == 2))
            await strategy.extended.update(v, fn, (10.0,))

        with pytest.raises(ReplicaSyncError, match="disagree on the update function") as info:
            await strategy.run(step)
        assert (info.value.merge_number, info.value.replicas) == (1, (2,))
        assert_all(v, [1.0, 2.0])

    @pytest.mark.replicas(*REPLICAS)
    async def test_every_copy_becomes_fn_of_copy(self, strategy_factory: StrategyFactory) -> None:
        """Every copy becomes fn(copy, *args, **kwargs); shared host copies are computed once."""
        strategy = strategy_factory()
        v = scoped(strategy, np.array([1.0, 2.0]), name="w")
        calls: list[list[float]] = []

        def fn(copy: Array, factor: float, *, shift: float) -> Array:
            calls.append(copy.tolist())
            return scale_and_shift(copy, factor, shift=shift)

        result = await strategy.extended.update(v, fn, (3.0,), {"shift": 1.0})
        assert calls == [[1.0, 2.0]]
        np.testing.assert_array_equal(result, [4.0, 7.0], strict=True)
        assert_all(v, [4.0, 7.0])

    @pytest.mark.replicas(*REPLICAS)
    async def test_mirrored_args_unwrapped(
        self, strategy_factory: StrategyFactory, replicas: int
    ) -> None:
        """Mirrored args and kwargs give copy i component i; group=True returns a Mirrored."""
        strategy = strategy_factory()
        v = scoped(strategy, np.array([1.0, 2.0]))
        factors = Mirrored([float(i + 1) for i in range(replicas)])
        shifts = Mirrored([10.0 * i for i in range(replicas)])
        result = await strategy.extended.update(v, scale_and_shift, (factors,), {"shift": shifts})
        want = [np.array([1.0, 2.0]) * (i + 1) + 10.0 * i for i in range(replicas)]
        assert_copies(v, want)
        if replicas == 1:
            np.testing.assert_array_equal(result, want[0], strict=True)
        else:
            assert isinstance(result, Mirrored)
            assert all(got is copy for got, copy in zip(result.values, v.values, strict=True))

    @pytest.mark.replicas(*REPLICAS)
    async def test_group_false_returns_tuple(self, strategy_factory: StrategyFactory) -> None:
        """group=False returns a tuple with one entry per copy."""
        strategy = strategy_factory()
        v = scoped(strategy, np.array([1.0, 2.0]))
        result = await strategy.extended.update(v, scale_and_shift, (2.0,), group=False)
        assert isinstance(result, tuple)
        assert all(got is copy for got, copy in zip(result, v.values, strict=True))
        assert_all(v, [2.0, 4.0])

    @pytest.mark.parametrize("group", ["no", 0, None])
    async def test_group_must_be_a_bool(self, group: Any) -> None:
        """group="no" would be true: refused, as any non-bool, before fn runs; nothing
        changes."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, np.array([1.0, 2.0]))
        calls: list[str] = []

        def fn(copy: Array) -> Array:
            calls.append("fn")
            return copy * 2

        message = f"extended.update(): group must be True or False, got {group!r}"
        with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
            await strategy.extended.update(v, fn, group=group)
        assert calls == []
        assert_all(v, [1.0, 2.0])
        result = await strategy.extended.update(v, fn, group=np.bool_(False))  # type: ignore[arg-type]
        assert isinstance(result, tuple)
        assert_all(v, [2.0, 4.0])

    @pytest.mark.replicas(2, 4)
    @pytest.mark.parametrize("where", ["args", "kwargs"])
    async def test_per_replica_args_that_differ_refused(
        self, strategy_factory: StrategyFactory, replicas: int, where: str
    ) -> None:
        """A mirrored variable's PerReplica argument whose values differ raises TypeError
        naming where it is; nothing changes."""
        strategy = strategy_factory()
        v = scoped(strategy, np.array([1.0, 2.0]), name="w")
        per_replica = PerReplica([2.0 + i for i in range(replicas)])
        args: tuple[Any, ...] = (per_replica,) if where == "args" else (2.0,)
        kwargs = {"shift": per_replica} if where == "kwargs" else {}
        at = r"args\[0\]" if where == "args" else r"kwargs\['shift'\]"
        with pytest.raises(
            TypeError,
            match=rf"^update\(\) of variable 'w': {at} is a PerReplica whose values differ "
            r"between replicas, but a mirrored variable's copies stay equal; pass the same value "
            r"on every replica \(plain, Mirrored, or a PerReplica of equal values\), or reduce "
            r"it first$",
        ):
            await strategy.extended.update(v, scale_and_shift, args, kwargs)
        assert_all(v, [1.0, 2.0])

    async def test_the_per_replica_arg_that_differs_is_named(self) -> None:
        """Of several PerReplica arguments, the one whose values differ is named; equal NaNs
        are equal values."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, np.array([1.0, 2.0]), name="w")
        same, nan, differs = (
            PerReplica([1.0, 1.0]),
            PerReplica([np.nan, np.nan]),
            PerReplica([1.0, 2.0]),
        )
        with pytest.raises(TypeError, match=r"^update\(\) of variable 'w': args\[2\] is a "):
            await strategy.extended.update(v, lambda c, x, y, z: c + x, (same, nan, differs))
        await strategy.extended.update(v, lambda c, x, y: c + x, (same, nan))
        assert_all(v, [2.0, 3.0])

    @pytest.mark.replicas(*REPLICAS)
    async def test_per_replica_args_that_agree(
        self, strategy_factory: StrategyFactory, replicas: int
    ) -> None:
        """TF's ReplicaCtxUpdateTest: values made alike in each replica (a PerReplica of equal
        values) update a mirrored variable, in either context."""
        strategy = strategy_factory()
        v = scoped(strategy, np.array([1.0, 2.0]), name="w")
        await strategy.extended.update(v, scale_and_shift, (PerReplica([2.0] * replicas),))
        assert_all(v, [2.0, 4.0])

        async def step() -> None:
            await strategy.extended.update(v, scale_and_shift, (np.float64(3.0),))

        await strategy.run(step)
        assert_all(v, [6.0, 12.0])

    @pytest.mark.parametrize("aggregation", ["sum", "mean", "only_first_replica", "none"])
    async def test_sync_on_read_copies_take_their_replicas_values(self, aggregation: str) -> None:
        """TF's testStrategyExtendedUpdate: a sync-on-read variable's copy i takes replica i's
        value, and the grouped result is a PerReplica of the copies."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(0.0, synchronization="on_read", aggregation=aggregation)
        result = await strategy.extended.update(v, lambda c, x: x, (PerReplica([1.0, 2.0]),))
        assert isinstance(result, PerReplica)
        assert_copies(v, [1.0, 2.0])
        await strategy.extended.update(v, lambda c, x: c + x, (PerReplica([1.0, 2.0]),))
        assert_copies(v, [2.0, 4.0])
        with pytest.raises(
            ValueError,
            match=r"args\[0\] is a PerReplica of 3 values, but the variable has 2 copies here$",
        ):
            await strategy.extended.update(v, lambda c, x: x, (PerReplica([1.0, 2.0, 3.0]),))
        assert_copies(v, [2.0, 4.0])

    @pytest.mark.replicas(*REPLICAS)
    async def test_wrong_shape_or_dtype_refused(self, strategy_factory: StrategyFactory) -> None:
        """fn returning the wrong shape or an uncastable dtype raises ValueError; no change."""
        strategy = strategy_factory()
        v = scoped(strategy, np.array([1.0, 2.0]), name="w")
        with pytest.raises(
            ValueError,
            match=r"^update\(\) of variable 'w': fn returned shape \(3,\) and dtype float64, but "
            r"the variable has shape \(2,\) and dtype float64; fn must return the copy's new "
            r"value$",
        ):
            await strategy.extended.update(v, lambda copy: np.zeros(3))
        with pytest.raises(
            ValueError, match=r"^update\(\) of variable 'w': fn returned shape \(\) "
        ):
            await strategy.extended.update(v, lambda copy: 1.0)
        with pytest.raises(ValueError, match=r"fn returned shape \(2,\) and dtype complex128, but"):
            await strategy.extended.update(v, lambda copy: copy + 1j)
        assert_all(v, [1.0, 2.0])

    @pytest.mark.replicas(*REPLICAS)
    async def test_fn_raising_changes_nothing(
        self, strategy_factory: StrategyFactory, replicas: int
    ) -> None:
        """fn raising for the last copy propagates that exception; no copy changes."""
        strategy = strategy_factory()
        v = scoped(strategy, np.array([1.0, 2.0]))
        await distinct_copies(v, np.array([1.0, 2.0]))
        seen: list[int] = []

        def fn(copy: Array, index: int) -> Array:
            seen.append(index)
            if index == replicas - 1:
                raise ZeroDivisionError(f"copy {index}")
            result: Array = copy * 0
            return result

        with pytest.raises(ZeroDivisionError, match=rf"^copy {replicas - 1}$"):
            await strategy.extended.update(v, fn, (Mirrored(list(range(replicas))),))
        assert seen == list(range(replicas))
        assert_all(v, [1.0, 2.0])

    @pytest.mark.replicas(*REPLICAS)
    async def test_replica_context_one_merge_round(self, strategy_factory: StrategyFactory) -> None:
        """Called by every replica, update takes one merge round and updates every copy once."""
        strategy = strategy_factory()
        v = scoped(strategy, np.array([1.0, 2.0]))
        calls: list[list[float]] = []

        def fn(copy: Array, factor: float) -> Array:
            calls.append(copy.tolist())
            return scale_and_shift(copy, factor)

        async def step() -> Any:
            return await strategy.extended.update(v, fn, (3.0,))

        rounds = strategy.statistics().merge_rounds_completed
        result = await strategy.run(step)
        assert strategy.statistics().merge_rounds_completed == rounds + 1
        assert calls == [[1.0, 2.0]]
        np.testing.assert_array_equal(result, [3.0, 6.0], strict=True)
        assert_all(v, [3.0, 6.0])

    async def test_variable_of_other_strategy_refused(self) -> None:
        """A variable of another strategy raises ValueError; nothing changes."""
        owner = MirroredStrategy(host_devices(2))
        other = MirroredStrategy(host_devices(2))
        v = scoped(owner, np.array([1.0, 2.0]), name="w")
        with pytest.raises(
            ValueError,
            match=r"^update\(\) of MirroredStrategy\(devices=\['cpu:0', 'cpu:1'\]\) was given "
            r"variable 'w', which belongs to MirroredStrategy\(devices=\['cpu:0', 'cpu:1'\]\); "
            r"update it through its own strategy$",
        ):
            await other.extended.update(v, scale_and_shift, (2.0,))
        assert_all(v, [1.0, 2.0])

    async def test_other_strategy_replica_refused(self) -> None:
        """update called inside a replica of another strategy raises RuntimeError."""
        owner = MirroredStrategy(host_devices(2))
        other = MirroredStrategy(host_devices(1))
        v = scoped(owner, np.array([1.0, 2.0]))

        async def step() -> None:
            await owner.extended.update(v, scale_and_shift, (2.0,))

        with pytest.raises(
            RuntimeError,
            match=r"^update\(\) of MirroredStrategy\(devices=\['cpu:0', 'cpu:1'\]\) was called in "
            r"a replica of MirroredStrategy\(devices=\['cpu:0'\]\)\n",
        ):
            await other.run(step)
        assert_all(v, [1.0, 2.0])

    async def test_plain_variable(self) -> None:
        """An ordinary variable is updated through any strategy."""
        strategy = MirroredStrategy(host_devices(2))
        v = Variable(np.array([1.0, 2.0]))
        result = await strategy.extended.update(v, scale_and_shift, (2.0,))
        np.testing.assert_array_equal(result, [2.0, 4.0], strict=True)
        assert_copies(v, [[2.0, 4.0]])

    async def test_bad_arguments(self) -> None:
        """A non-variable or non-callable fn raises TypeError."""
        strategy = MirroredStrategy(host_devices(2))
        v = scoped(strategy, 1.0)
        with pytest.raises(
            TypeError, match=r"^update\(\) needs an aioreplica\.Variable, got ndarray$"
        ):
            await strategy.extended.update(np.zeros(2), scale_and_shift)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^update\(\) needs a callable fn, got int$"):
            await strategy.extended.update(v, 3)  # type: ignore[arg-type]
        assert_all(v, 1.0)

    @pytest.mark.replicas(*REPLICAS)
    def test_local_results_are_values(self, strategy_factory: StrategyFactory) -> None:
        """experimental_local_results(v) returns v.values."""
        strategy = strategy_factory()
        v = scoped(strategy, np.zeros(2))
        s = scoped(strategy, np.zeros(2), synchronization="on_read", aggregation="sum")
        assert strategy.experimental_local_results(v) is v.values
        assert strategy.experimental_local_results(s) is s.values


class TestAsInTF:
    """Behaviour a TensorFlow user relies on, where aioreplica used to differ."""

    async def test_sync_on_read_is_not_trainable_by_default(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            metric = Variable(0.0, synchronization="on_read", aggregation="sum")
            chosen = Variable(0.0, synchronization="on_read", aggregation="sum", trainable=True)
            weight = Variable(0.0)
        assert (metric.trainable, chosen.trainable, weight.trainable) == (False, True, True)
        assert Variable(0.0, synchronization="on_read", aggregation="sum").trainable is False

    @pytest.mark.parametrize("sync", ["on_write", "on_read"])
    async def test_deepcopy_makes_new_copies_under_the_same_strategy(self, sync: str) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.arange(3.0), name="w", synchronization=sync, aggregation="mean")
        w = copy_module.deepcopy(v)
        assert type(w) is type(v)
        assert (w.name, w.shape, w.dtype, w.trainable) == (v.name, v.shape, v.dtype, v.trainable)
        assert w.devices == v.devices
        assert w._strategy is strategy
        assert all(a is not b for a, b in zip(w.values, v.values, strict=True))
        await strategy.run(lambda: w.assign(np.full(3, 7.0)))
        assert np.all(w.numpy() == 7.0)
        assert np.all(v.numpy() == np.arange(3.0))
        assert all(not copy_.flags.writeable for copy_ in w.values)

    async def test_deepcopy_inside_a_structure_keeps_sharing(self) -> None:
        v = Variable(1.0)
        model: dict[str, Any] = {"a": v, "b": [v]}
        copied = copy_module.deepcopy(model)
        assert copied["a"] is copied["b"][0]
        assert copied["a"] is not v

    async def test_the_same_object_from_every_replica_is_not_summed(self) -> None:
        """``assign(5.0)`` in every replica of a SUM variable: TF raises, and so do we."""
        strategy = MirroredStrategy(host_devices(3))
        with strategy.scope():
            v = Variable(1.0, aggregation="sum")
        five = np.float64(5.0)

        async def step() -> None:
            await v.assign(five)

        with pytest.raises(ValueError, match="every replica passed the same object") as info:
            await strategy.run(step)
        assert "aggregation SUM" in str(info.value)
        assert float(v) == 1.0
        assert all(float(c) == 1.0 for c in v.values)

    async def test_equal_values_from_each_replica_are_summed(self) -> None:
        strategy = MirroredStrategy(host_devices(3))
        with strategy.scope():
            v = Variable(0.0, aggregation="sum")

        async def step() -> None:
            await v.assign_add(
                np.float64(replica_id() * 0 + 5.0)
            )  # equal, but made in each replica

        await strategy.run(step)
        assert float(v) == 15.0

    async def test_the_same_object_is_fine_for_mean_and_one_replica(self) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            mean = Variable(0.0, aggregation="mean")
            first = Variable(0.0, aggregation="only_first_replica")
        five = 5.0

        async def step() -> None:
            await mean.assign(five)
            await first.assign(five)

        await strategy.run(step)
        assert (float(mean), float(first)) == (5.0, 5.0)
        single = MirroredStrategy(host_devices(1))
        with single.scope():
            total = Variable(0.0, aggregation="sum")
        await single.run(lambda: total.assign(five))
        assert float(total) == 5.0
