"""What collectives and the loss functions refuse: Python ints that int64 cannot hold (TF's
"out-of-range integer"), and loss arguments that hold no numbers or make no array."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from aioreplica import MirroredStrategy, PerReplica, compute_average_loss, scale_regularization_loss
from aioreplica.testing import host_devices, replica_context, replica_id

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

pytestmark = pytest.mark.anyio

#: Python ints just outside int64 on either side, the last that uint64 holds, and beyond it.
OUT_OF_RANGE = [2**63, 2**64 - 1, 2**64, -(2**63) - 1]


def refusal(what: str, who: str, path: str, number: int) -> str:
    """The start of the message for ``number`` refused by ``what``."""
    return (
        f"{what}: {who} at {path} is the int {number}, which does not fit int64 "
        f"(-9223372036854775808 to 9223372036854775807), the dtype of Python ints here (TF "
        "refuses it as an out-of-range integer)"
    )


class TestIntsBeyondInt64:
    @pytest.mark.parametrize("number", OUT_OF_RANGE)
    async def test_cross_replica_calls_refuse_them(self, number: int) -> None:
        """strategy.reduce/gather and extended.reduce_to/batch_reduce_to/broadcast_to raise a
        ValueError naming the leaf, where 2**63 used to sum to uint64 0; the same calls with
        an int int64 holds then work."""
        strategy = MirroredStrategy(host_devices(2))
        extended = strategy.extended
        calls: list[tuple[str, str, Callable[[Any], Awaitable[Any]]]] = [
            ("reduce", "<root>", lambda n: strategy.reduce("sum", n)),
            ("gather", "['b'][0]", lambda n: strategy.gather({"a": np.ones(2), "b": [n]}, 0)),
            ("reduce_to", "[1]", lambda n: extended.reduce_to("sum", (1, n), "cpu:0")),
            (
                "batch_reduce_to",
                "[1]['n']",
                lambda n: extended.batch_reduce_to("sum", [(1.0, None), ({"n": n}, None)]),
            ),
            ("broadcast_to", "['n']", lambda n: extended.broadcast_to({"n": n}, None)),
        ]
        messages = []
        for _, _, call in calls:
            with pytest.raises(ValueError, match="does not fit int64") as caught:
                await call(number)
            messages.append(str(caught.value).partition(";")[0])
        assert messages == [
            refusal(what, "the value", path, number).partition(";")[0] for what, path, _ in calls
        ]
        assert int(await strategy.reduce("sum", 2**62 - 1)) == 2**63 - 2
        assert int(await extended.broadcast_to(-(2**63), "cpu:1")) == -(2**63)

    @pytest.mark.parametrize("number", OUT_OF_RANGE)
    async def test_replica_collectives_name_the_replica(self, number: int) -> None:
        """all_reduce, all_gather, broadcast and reduce_scatter refuse such an int passed by
        one replica, naming that replica and the path; nothing is reduced."""
        strategy = MirroredStrategy(host_devices(3))
        collectives: dict[str, Callable[[Any], Awaitable[Any]]] = {
            "all_reduce": lambda value: replica_context().all_reduce("sum", value),
            "all_gather": lambda value: replica_context().all_gather(value, axis=0),
            "broadcast": lambda value: replica_context().broadcast(value),
            "reduce_scatter": lambda value: replica_context().reduce_scatter("sum", value, 0),
        }
        messages = []
        for collective in collectives.values():

            async def step(collective: Callable[[Any], Awaitable[Any]] = collective) -> Any:
                value = number if replica_id() == 2 else 1
                return await collective({"x": np.ones(3), "n": [0, value]})

            with pytest.raises(ValueError, match="does not fit int64") as caught:
                await strategy.run(step)
            messages.append(str(caught.value).partition(";")[0])
        assert messages == [
            refusal(name, "replica 2's value", "['n'][1]", number).partition(";")[0]
            for name in collectives
        ]

    async def test_ints_at_the_edges_and_numpy_uint64_still_reduce(self) -> None:
        """-2**63 and 2**63 - 1 are int64s; NumPy's uint64 values are reduced as before."""
        strategy = MirroredStrategy(host_devices(2))
        edges = PerReplica([-(2**63), 2**63 - 1])
        unsigned = PerReplica([np.uint64(2**63), np.uint64(2**64 - 1)])
        results = [
            await strategy.reduce("min", edges),
            await strategy.reduce("max", edges),
            await strategy.reduce("max", unsigned),
            await strategy.reduce("sum", np.array([2**63], dtype=np.uint64)),
        ]
        assert [(int(np.asarray(r).reshape(-1)[0]), np.asarray(r).dtype) for r in results] == [
            (-(2**63), np.dtype(np.int64)),
            (2**63 - 1, np.dtype(np.int64)),
            (2**64 - 1, np.dtype(np.uint64)),
            (0, np.dtype(np.uint64)),  # NumPy's uint64 wraps: the caller's dtype, kept
        ]


class TestLossArguments:
    @pytest.mark.parametrize(
        ("losses", "shown"), [("x", "str 'x'"), (None, "NoneType None"), (b"ab", "bytes b'ab'")]
    )
    def test_no_number_at_all_is_a_type_error(self, losses: Any, shown: str) -> None:
        """A string or None is no number: a TypeError naming per_example_loss, not the
        ValueError for a scalar loss (which said "got a scalar 'x'")."""
        with pytest.raises(TypeError) as caught:
            compute_average_loss(losses)
        assert str(caught.value) == (
            f"compute_average_loss(): per_example_loss must hold numbers, got {shown}: pass "
            "numbers, or cast them first, e.g. np.asarray(per_example_loss, dtype=np.float32)"
        )

    @pytest.mark.parametrize(
        ("weights", "shown"),
        [("w", "str 'w'"), ([None] * 4, "list [None, None, None, None]")],
    )
    def test_sample_weight_of_no_numbers_is_a_type_error(self, weights: Any, shown: str) -> None:
        """sample_weight holding no numbers is a TypeError naming it (it was NumPy's
        UFuncTypeError about a multiply loop); bool weights still weigh."""
        with pytest.raises(TypeError) as caught:
            compute_average_loss(np.ones(4), sample_weight=weights)
        assert str(caught.value) == (
            f"compute_average_loss(): sample_weight must hold numbers, got {shown}: pass "
            "numbers, or cast them first, e.g. np.asarray(sample_weight, dtype=np.float32)"
        )
        kept = np.array([True, False, True, True])
        assert compute_average_loss(np.ones(4), sample_weight=kept) == 0.75

    def test_ragged_arguments_are_named(self) -> None:
        """Lists of different lengths make no array: a ValueError naming the argument
        instead of NumPy's about an inhomogeneous shape."""
        ragged = [[1.0], [1.0, 2.0]]
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("compute_average_loss(): per_example_loss", lambda: compute_average_loss(ragged)),
            (
                "compute_average_loss(): sample_weight",
                lambda: compute_average_loss(np.ones(2), sample_weight=ragged),
            ),
            (
                "compute_average_loss(): global_batch_size",
                lambda: compute_average_loss(np.ones(2), global_batch_size=ragged),  # type: ignore[arg-type]
            ),
            (
                "scale_regularization_loss(): regularization_loss",
                lambda: scale_regularization_loss(ragged),
            ),
        ]
        starts = []
        for _, call in calls:
            with pytest.raises(ValueError, match="makes no array") as caught:
                call()
            starts.append(str(caught.value).partition(" makes no array")[0])
        assert starts == [name for name, _ in calls]
