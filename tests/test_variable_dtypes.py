"""Variables and the dtypes of what is written to them: bools are no numbers, Python ints
beyond int64 need a dtype, ragged lists and badly typed write arguments are refused clearly.
Every refusal names the variable and changes nothing."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from aioreplica import MirroredStrategy, PerReplica, Variable
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

pytestmark = pytest.mark.anyio

OPS = ["assign", "assign_add", "assign_sub"]


def copies(v: Variable) -> list[Any]:
    """Every copy of ``v``, as nested lists."""
    return [np.asarray(copy).tolist() for copy in v.values]


def write(v: Variable, op: str) -> Callable[..., Awaitable[Any]]:
    write_fn: Callable[..., Awaitable[Any]] = getattr(v, op)
    return write_fn


class TestBoolValues:
    @pytest.mark.parametrize("dtype", ["float32", "int32", "uint8", "complex64"])
    @pytest.mark.parametrize("op", OPS)
    @pytest.mark.parametrize(
        "value", [np.array([True, False]), True, np.bool_(True)], ids=["array", "py", "np"]
    )
    async def test_a_bool_written_to_a_numeric_variable_is_refused(
        self, dtype: str, op: str, value: Any
    ) -> None:
        """A bool written to a numeric variable is a TypeError naming the variable (TF
        refuses bool for every other dtype); nothing changes."""
        v = Variable(np.ones(2, dtype), name="weights")
        message = (
            f"cannot write a bool value to variable 'weights' of dtype {dtype}: bools are no "
            f"numbers (as in TF); cast it first (e.g. value.astype({dtype}))"
        )
        with pytest.raises(TypeError, match=re.escape(message)):
            await write(v, op)(value)
        assert copies(v) == [[1, 1]]

    @pytest.mark.parametrize("op", ["assign", "assign_add"])
    async def test_a_bool_written_from_replicas_is_refused(self, op: str) -> None:
        """Inside run(), the refusal names the replica, and no copy changes."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.zeros(2, np.float32), name="w", aggregation="mean")

        async def step(value: Any) -> None:
            await write(v, op)(value)

        with pytest.raises(TypeError, match=r"variable 'w' of dtype float32 from replica \d"):
            await strategy.run(step, args=(PerReplica([np.array([True, False])] * 2),))
        assert copies(v) == [[0.0, 0.0]] * 2

    async def test_a_bool_variable_still_takes_bools(self) -> None:
        """A bool variable takes bools (and 0 and 1) as before."""
        v = Variable(np.zeros(2, bool), name="mask")
        await v.assign(np.array([True, False]))
        assert copies(v) == [[True, False]]
        await v.assign(1)
        assert copies(v) == [[True, True]]

    async def test_ints_still_go_into_float_variables(self) -> None:
        """An int value written to a float or complex variable is taken (as in TF)."""
        f = Variable(np.zeros(2, np.float32), name="f")
        c = Variable(np.zeros(1, np.complex64), name="c")
        await f.assign_add(np.array([1, 2], np.int64))
        await c.assign(3)
        assert (copies(f), copies(c)) == ([[1.0, 2.0]], [[3 + 0j]])

    @pytest.mark.parametrize("dtype", ["float32", "int64", "complex128"])
    @pytest.mark.parametrize("initial", [np.array([True, False]), True], ids=["array", "py"])
    def test_a_bool_initial_value_with_a_numeric_dtype_is_refused(
        self, dtype: str, initial: Any
    ) -> None:
        """``Variable(bools, dtype=<numeric>)`` is a TypeError naming the variable."""
        message = (
            f"variable 'mask': an initial value of dtype bool cannot make a variable of dtype "
            f"{dtype}: bools are no numbers"
        )
        with pytest.raises(TypeError, match=re.escape(message)):
            Variable(initial, dtype=dtype, name="mask")

    def test_a_bool_initial_value_makes_a_bool_variable(self) -> None:
        """Without a dtype (or with bool), bools make a bool variable."""
        assert Variable(np.array([True]), name="a").dtype == np.bool_
        assert Variable(True, dtype=bool, name="b").dtype == np.bool_


class TestLargePythonInts:
    @pytest.mark.parametrize(
        "initial",
        [2**63, [1, 2**63], [2**63, 1], [-1, 2**63], [[2**64 - 1], [-1]], [True, 2**63]],
    )
    def test_an_int_beyond_int64_needs_a_dtype(self, initial: Any) -> None:
        """A Python int beyond int64 with no dtype is a ValueError (as TF's out-of-range
        integer) saying which int and what to pass, not a silent uint64 or float64."""
        with pytest.raises(
            ValueError,
            match=r"variable 'counter': the initial value \d+ does not fit int64, which holds "
            r"-9223372036854775808 to 9223372036854775807 .* pass the dtype that holds it "
            r"\(e.g. dtype='uint64'\)",
        ):
            Variable(initial, name="counter")

    @pytest.mark.parametrize(
        ("initial", "want"),
        [([1.5, 2**63], [1.5, 2.0**63]), ([[0.5], [2**64 - 1]], [[0.5], [2.0**64]])],
    )
    def test_a_float_first_makes_floats(self, initial: Any, want: Any) -> None:
        """A value whose first number is a float makes a float64 variable whatever ints
        follow, as TF makes a float tensor of it (it takes the dtype from the first number)."""
        v = Variable(initial, name="c")
        assert (v.dtype, v.numpy().tolist()) == (np.dtype(np.float64), want)

    def test_a_list_of_floats_is_read_by_numpy_alone(self) -> None:
        """A list of floats with no dtype is read no more than NumPy reads it to make its
        array: a long one costs no Python loop over its items."""
        reads: list[str] = []

        class Rows(list[float]):
            def __iter__(self) -> Iterator[float]:
                reads.append("iter")
                return super().__iter__()

        np.asarray(Rows([0.5, 1.5]))
        by_numpy = list(reads)
        reads.clear()
        v = Variable(Rows([0.5, 1.5]), name="c")
        assert (reads, v.numpy().tolist()) == (by_numpy, [0.5, 1.5])

    async def test_a_uint64_dtype_takes_it(self) -> None:
        """With ``dtype="uint64"`` such an int makes the variable, and later writes of such
        ints stay exact."""
        v = Variable(2**63, dtype="uint64", name="counter")
        await v.assign_add(2**63 - 1)
        assert (v.dtype, int(v)) == (np.dtype(np.uint64), 2**64 - 1)
        await v.assign(2**64 - 2)
        assert int(v) == 2**64 - 2

    def test_ints_within_int64_and_numpy_uint64_are_taken(self) -> None:
        """Python ints within int64 make int64 as before; a NumPy uint64 keeps its dtype."""
        assert Variable([-(2**63), 2**63 - 1], name="a").dtype == np.int64
        assert Variable(np.uint64(2**63), name="b").dtype == np.uint64
        assert Variable([2**63, 0.5], dtype="float64", name="c").numpy().tolist() == [2**63, 0.5]


class TestIntsBeyond64Bits:
    """A Python int no NumPy integer holds (beyond uint64, below int64) stays a Python object
    in NumPy: a ValueError naming it, except into a float or complex dtype, which takes it
    as every int."""

    @pytest.mark.parametrize(
        ("initial", "dtype", "held"),
        [
            (2**70, None, "no NumPy integer dtype"),
            ([1, 2**70], None, "no NumPy integer dtype"),
            (np.array(2**70), None, "no NumPy integer dtype"),
            (-(2**63) - 1, None, "no NumPy integer dtype"),
            (2**70, "int8", "no NumPy integer dtype, nor dtype int8"),
            (2**64, "uint64", "no NumPy integer dtype, nor dtype uint64"),
        ],
    )
    def test_refused_at_creation(self, initial: Any, dtype: str | None, held: str) -> None:
        big = next(x for x in np.ravel(np.array(initial, dtype=object)) if abs(x) > 2**63)
        with pytest.raises(
            ValueError,
            match=rf"^variable 'c': the initial value {big} fits {held} \(int64 holds "
            r"-9223372036854775808 to 9223372036854775807, uint64 0 to 18446744073709551615\); "
            r"pass it as a float if an approximation will do$",
        ):
            Variable(initial, dtype=dtype, name="c")

    @pytest.mark.parametrize("dtype", ["float64", "float32", "complex128"])
    def test_a_float_or_complex_dtype_takes_it(self, dtype: str) -> None:
        v = Variable([1, 2**70], dtype=dtype, name="c")
        assert v.dtype == np.dtype(dtype)
        assert v.numpy().tolist() == np.array([1.0, 2.0**70], dtype=dtype).tolist()

    @pytest.mark.parametrize("value", [2**70, np.array(2**70), [2**70, 1]])
    async def test_a_write_to_an_integer_variable_is_refused(self, value: Any) -> None:
        v = Variable(np.zeros(2, np.uint64), name="u")
        with pytest.raises(
            ValueError,
            match=r"^cannot write 1180591620717411303424 to variable 'u' of dtype uint64: it fits "
            r"no NumPy integer dtype, nor this one; nothing was written$",
        ):
            await v.assign(value)
        assert copies(v) == [[0, 0]]

    @pytest.mark.parametrize("op", OPS)
    async def test_a_write_to_a_float_variable_takes_it(self, op: str) -> None:
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.zeros(2), name="f")
        await write(v, op)(2**70)
        want = -(2.0**70) if op == "assign_sub" else 2.0**70
        assert copies(v) == [[want, want]] * 2


class TestRaggedValues:
    @pytest.mark.parametrize("op", OPS)
    async def test_a_ragged_list_names_the_variable(self, op: str) -> None:
        """A ragged nested list written to a variable is a TypeError naming the variable and
        NumPy's reason, as the constructor's; nothing changes."""
        v = Variable(np.zeros((2, 2), np.float32), name="weights")
        with pytest.raises(
            TypeError,
            match=re.escape(
                "cannot write list [[1, 2], [3]] to variable 'weights': it makes "
                "no array: setting an array element with a sequence"
            ),
        ):
            await write(v, op)([[1, 2], [3]])
        assert copies(v) == [[[0.0, 0.0], [0.0, 0.0]]]

    async def test_a_ragged_list_in_a_replica_names_it(self) -> None:
        """Inside run(), the refusal names the variable and the replica."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.zeros((2, 2)), name="weights", aggregation="mean")

        async def step() -> None:
            await v.assign([[1, 2], [3]])

        with pytest.raises(TypeError, match=r"variable 'weights' from replica \d: it makes no"):
            await strategy.run(step)
        assert copies(v) == [[[0.0, 0.0], [0.0, 0.0]]] * 2

    @pytest.mark.parametrize("op", ["assign", "assign_add"])
    async def test_a_value_making_its_own_array_raises_its_own_error(self, op: str) -> None:
        """A value that makes its own array raises its own error, unchanged: a sync-on-read
        variable with aggregation NONE written to another variable raises its cross-replica
        read's ValueError; nothing changes."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            source = Variable(np.ones(2), name="src", synchronization="on_read", aggregation="none")
            target = Variable(np.zeros(2), name="dst")
        with pytest.raises(
            ValueError,
            match=re.escape(
                "sync-on-read variable 'src' has aggregation NONE, so its copies cannot be "
                "combined in cross-replica context"
            ),
        ):
            await write(target, op)(source)
        assert copies(target) == [[0.0, 0.0]] * 2


class TestWriteArguments:
    @pytest.mark.parametrize("op", OPS)
    @pytest.mark.parametrize(
        ("arguments", "message"),
        [
            ({"read_value": "no"}, "read_value must be True or False, got str 'no'"),
            ({"read_value": None}, "read_value must be True or False, got NoneType None"),
            ({"use_locking": "x"}, "use_locking must be True, False or None, got str 'x'"),
            ({"use_locking": 1}, "use_locking must be True, False or None, got int 1"),
            ({"name": 5}, "name must be a str or None, got int 5"),
        ],
    )
    async def test_badly_typed_arguments_are_refused(
        self, op: str, arguments: dict[str, Any], message: str
    ) -> None:
        """``use_locking`` must be a bool or None, ``read_value`` a bool and ``name`` a str or
        None: a TypeError naming the write, the variable and the argument; nothing is
        written."""
        v = Variable(1.0, name="v")
        with pytest.raises(
            TypeError,
            match=re.escape(f"{op}() of variable 'v': {message}; nothing was written"),
        ):
            await write(v, op)(2.0, **arguments)
        assert copies(v) == [1.0]

    @pytest.mark.parametrize(
        ("op", "want"), [("assign", [2.0]), ("assign_add", [3.0]), ("assign_sub", [-1.0])]
    )
    @pytest.mark.parametrize("use_locking", [None, True, np.bool_(False)])
    async def test_use_locking_none_or_a_bool_is_taken(
        self, op: str, want: list[float], use_locking: Any
    ) -> None:
        """``use_locking=None`` (TF's default, which Keras' AutoCastVariable passes on) is
        taken as a bool is, and the write made."""
        v = Variable(np.ones(1), name="v")
        assert await write(v, op)(2.0, use_locking=use_locking, name="w") is v
        assert copies(v) == [want]
