"""Checkpoints and the event loop: a save combines a sync-on-read variable's copies, and a
restore (or a cross-replica assign) splits its sum, on the devices' threads, not the event
loop's (invariant 4)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from aioreplica import Checkpoint, MirroredStrategy, Variable
from aioreplica.testing import FakeDevice

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]


class Noted(np.ndarray[Any, Any]):
    """An array that notes, for every NumPy operation on it, the operation's name and
    whether it ran on the event loop's thread (``loop``, set by the test)."""

    loop: int = 0
    notes: list[tuple[str, bool]] = []  # noqa: RUF012 (shared by every Noted array of a test)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        Noted.notes.append((ufunc.__name__, threading.get_ident() == Noted.loop))
        inputs = tuple(np.asarray(x) if isinstance(x, Noted) else x for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(np.asarray(x) for x in kwargs["out"])
        return getattr(ufunc, method)(*inputs, **kwargs)


class NotingDevice(FakeDevice):
    """A fake device (its work on its worker thread) whose arrays are ``Noted``."""

    def asarray(self, value: Any) -> Any:
        return np.asarray(super().asarray(value)).view(Noted)


@pytest.fixture
def notes() -> list[tuple[str, bool]]:
    """The operations on ``Noted`` arrays from now on, each with whether it ran on the loop."""
    Noted.loop = threading.get_ident()
    Noted.notes = []
    return Noted.notes


def noting_strategy() -> MirroredStrategy:
    return MirroredStrategy([NotingDevice(f"noting:{i}", i) for i in range(4)])


class TestSyncOnReadVariables:
    @pytest.mark.parametrize("aggregation", ["sum", "mean"])
    async def test_a_save_combines_the_copies_off_the_loop(
        self, tmp_path: Path, notes: list[tuple[str, bool]], aggregation: str
    ) -> None:
        """A save adds up a sync-on-read variable's copies on a device's thread."""
        strategy = noting_strategy()
        with strategy.scope():  # every copy starts as [0, 1, 2]
            v = Variable(np.arange(3.0), synchronization="on_read", aggregation=aggregation)
        notes.clear()
        await Checkpoint(v=v).save(str(tmp_path / "ck"))
        assert notes == [("add", False)] * 3  # three copies added to the first, off the loop
        target = Variable(np.zeros(3))
        await Checkpoint(v=target).restore(str(tmp_path / "ck"))
        assert target.numpy().tolist() == ([0.0, 4.0, 8.0] if aggregation == "sum" else [0, 1, 2])

    @pytest.mark.parametrize(
        ("dtype", "operation", "want"),
        [("float64", "divide", [[1.5, 2.5]] * 4), ("int64", "divmod", [[3, 4]] + [[1, 2]] * 3)],
    )
    async def test_a_restore_splits_the_sum_off_the_loop(
        self,
        tmp_path: Path,
        notes: list[tuple[str, bool]],
        dtype: str,
        operation: str,
        want: list[list[float]],
    ) -> None:
        """A restore of a SUM sync-on-read variable computes each copy's share of the saved
        total on the devices' threads (integers exactly, the remainder in copy 0)."""
        source = Variable(np.array([6, 10], dtype), name="v")
        path = await Checkpoint(v=source).save(str(tmp_path / "ck"))
        strategy = noting_strategy()
        with strategy.scope():
            v = Variable(np.zeros(2, dtype), synchronization="on_read", aggregation="sum", name="v")
        notes.clear()
        await Checkpoint(v=v).restore(path)
        assert notes == [(operation, False)] * 4  # one share per copy, off the loop
        assert [np.asarray(copy).tolist() for copy in v.values] == want

    @pytest.mark.parametrize(
        ("dtype", "operation", "want"),
        [("float64", "divide", [[1.5, 2.5]] * 4), ("int64", "divmod", [[3, 4]] + [[1, 2]] * 3)],
    )
    async def test_a_cross_replica_assign_splits_the_sum_off_the_loop(
        self, notes: list[tuple[str, bool]], dtype: str, operation: str, want: list[list[float]]
    ) -> None:
        """A cross-replica assign() of a SUM sync-on-read variable splits the total as a
        restore does: each copy's share on the devices' threads (integers exactly, the
        remainder in copy 0)."""
        strategy = noting_strategy()
        with strategy.scope():
            v = Variable(np.zeros(2, dtype), synchronization="on_read", aggregation="sum", name="v")
        notes.clear()
        await v.assign(np.array([6, 10], dtype))
        assert notes == [(operation, False)] * 4  # one share per copy, off the loop
        assert [np.asarray(copy).tolist() for copy in v.values] == want
