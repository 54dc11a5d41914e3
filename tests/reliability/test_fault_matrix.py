"""The fault matrix: every cell of ``fault_cells.CELLS`` played on asyncio, uvloop and trio.

One assertion helper, ``assert_cell``, checks every cell alike: the play ended within its
deadline (a hang is a failure); the caller got the documented exception itself, unwrapped, with
its message and the one note saying where it came from (or the caller's cancellation, or a
normal end); work the run may abandon in a thread was still running when the run ended (so the
run did not wait for it); no task is left; no thread is left at work, and none started but the
device workers and the async libraries' pooled threads; every copy of every variable is equal
and either untouched or fully updated, as documented; the checkpoint directory holds exactly the
manager's checkpoints and the newest one restores.

The detectors behind these checks are proved on deliberate leaks below (``TestDetectors``).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from fault_cells import CELLS, DOC, OWN_CANCEL, Cell, doc_table, pattern, render_table
from harness import (
    BIG,
    Outcome,
    Snapshot,
    ThreadGate,
    World,
    assert_checkpoints,
    assert_variables,
    busy_threads,
    unexpected_threads,
    until,
)

from aioreplica import MirroredStrategy

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from pathlib import Path

_LOOPS: dict[str, tuple[str, dict[str, Any]]] = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}
if sys.platform == "win32":
    del _LOOPS["uvloop"]


def _cell_params() -> list[Any]:
    return [
        pytest.param(cell, _LOOPS[loop], id=f"{cell.id}-{loop}")
        for cell in CELLS
        for loop in cell.loops
        if loop in _LOOPS
    ]


@pytest.mark.anyio
@pytest.mark.parametrize(("cell", "anyio_backend"), _cell_params())
async def test_fault_cell(
    cell: Cell, anyio_backend: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = await World.create(
        tmp_path / "checkpoints", monkeypatch, sync_timeout=cell.sync_timeout
    )
    try:
        before = Snapshot.take()
        outcome = await world.play(cell.scenario)
        await assert_cell(cell, outcome, world, before)
    finally:
        world.open_gates()


async def assert_cell(cell: Cell, outcome: Outcome, world: World, before: Snapshot) -> None:
    """Everything a cell promises (see the module docstring)."""
    assert not outcome.hung, f"the play hung; cancelled after {outcome.seconds:.1f} s with " + (
        _describe(outcome.error)
    )
    _assert_outcome(cell, outcome, world)
    if cell.events is not None:
        assert sorted(world.events) == sorted(cell.events)
    if cell.abandoned is not None:
        gate = world.abandoned_gate
        assert gate is not None, "the scenario watches no abandoned work"
        assert gate.inside > 0, f"{cell.abandoned} had ended when the play did: the run waited"
    await before.assert_no_task_left()
    world.open_gates()  # what was left running may now finish
    await before.assert_no_thread_left()
    assert_variables(world, cell.state)
    await assert_checkpoints(world, cell.newest_checkpoint)


def _assert_outcome(cell: Cell, outcome: Outcome, world: World) -> None:
    error = outcome.error
    if cell.raises is None:
        assert error is None, f"expected no exception, got {_describe(error)}"
        assert outcome.cancelled == cell.cancelled, (
            "expected the caller's cancellation to end the play"
            if cell.cancelled
            else "the play was cancelled"
        )
        return
    assert isinstance(error, cell.raises), (
        f"expected {cell.raises.__name__}, got {_describe(error)}"
    )
    assert not isinstance(error, BaseExceptionGroup), f"wrapped in a group: {_describe(error)}"
    assert pattern(cell.message).search(str(error)), (
        f"the message {str(error)!r} does not match {cell.message!r}"
    )
    notes = getattr(error, "__notes__", [])
    if cell.note is None:
        assert notes == [], f"expected no note, got {notes}"
    else:  # where it came from, last: no other failure ("also raised ...") was reported
        assert notes, f"expected a note like {cell.note!r}, got none"
        assert pattern(cell.note).fullmatch(notes[-1]), f"expected {cell.note!r} last: {notes}"
    if world.injected is not None and cell.fault == OWN_CANCEL:
        assert error.__cause__ is world.injected, "__cause__ is not the replica's CancelledError"
    elif world.injected is not None:
        assert error is world.injected, "not the very exception injected"


def _describe(error: BaseException | None) -> str:
    if error is None:
        return "no exception"
    return "".join(traceback.format_exception(error))


def test_the_docs_show_the_matrix() -> None:
    """docs/reliability.md shows the table of the matrix as it is."""
    assert doc_table(DOC.read_text(encoding="utf-8")) == render_table(CELLS), (
        f"the fault table in {DOC} is out of date: run "
        ".venv/bin/python tests/reliability/fault_cells.py --write"
    )


def test_every_phase_meets_every_fault_it_can() -> None:
    """The table's shape: ids unique; each phase meets the faults its comments do not rule out."""
    assert len({cell.id for cell in CELLS}) == len(CELLS)
    faults: dict[str, set[str]] = {}
    for cell in CELLS:
        faults.setdefault(cell.phase, set()).add(cell.fault)
    assert {phase: len(kinds) for phase, kinds in faults.items()} == {
        "before the first merge": 5,  # no timeout
        "parked at a merge point": 6,
        "in a sync merge_fn": 6,
        "in an async merge_fn": 6,
        "in a collective (ctx.all_reduce)": 5,  # no own CancelledError
        "in ctx.device.run": 5,  # no merge
        "in a variable write (2 MiB)": 5,  # no own CancelledError
        "in an optimizer step": 5,  # no own CancelledError
        "in Checkpoint.save": 3,  # exception, cancel, BaseException
        "in dataset prefetch": 3,  # exception, cancel, BaseException
    }


# -- the detectors, proved on deliberate leaks ---------------------------------------------


def _spawn_detached(fn: Callable[[], Coroutine[Any, Any, Any]]) -> None:
    """Start a task that belongs to no task group, as a leaking library would."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        import trio

        trio.lowlevel.spawn_system_task(fn)
    else:
        loop.create_task(fn())  # noqa: RUF006 - the leak under test


@pytest.mark.anyio
class TestDetectors:
    async def test_a_detached_task_is_seen(self) -> None:
        before = Snapshot.take()
        stop = anyio.Event()
        _spawn_detached(stop.wait)
        await anyio.lowlevel.checkpoint()
        assert len(before.new_tasks()) == 1
        stop.set()
        await before.assert_no_task_left()

    async def test_a_task_in_a_task_group_is_seen(self) -> None:
        before = Snapshot.take()
        stop = anyio.Event()
        async with anyio.create_task_group() as group:
            group.start_soon(stop.wait)
            assert len(before.new_tasks()) == 1
            stop.set()
        assert before.new_tasks() == []

    async def test_a_task_left_fails_the_check(self) -> None:
        before = Snapshot.take()
        stop = anyio.Event()
        _spawn_detached(stop.wait)
        try:
            with pytest.raises(AssertionError, match="tasks left"):
                await before.assert_no_task_left(seconds=0.05)
        finally:
            stop.set()
        await before.assert_no_task_left()

    async def test_a_busy_or_stray_thread_is_seen(self) -> None:
        before = Snapshot.take()
        gate = ThreadGate()
        stray = threading.Thread(target=gate.hold, name="stray")
        stray.start()
        await until(lambda: gate.inside == 1, "the stray thread waits at the gate")
        assert before.newly_busy() == {"stray": ["ThreadGate.hold"]}
        assert busy_threads() == {stray: ["ThreadGate.hold"]}
        assert unexpected_threads(before.threads) == ["stray"]
        assert not Snapshot.take().newly_busy()  # already at work: not a later play's doing
        gate.open()
        await anyio.to_thread.run_sync(stray.join)
        await before.assert_no_thread_left()

    async def test_a_device_worker_is_busy_in_a_job_and_idle_after(self) -> None:
        before = Snapshot.take()
        device = MirroredStrategy(["cpu:0"]).extended.replica_devices[0]
        gate = ThreadGate()
        async with anyio.create_task_group() as group:
            group.start_soon(device.run, gate.hold)
            await until(lambda: gate.inside == 1, "the job runs")
            assert "ThreadGate.hold" in before.newly_busy()["aioreplica cpu:0"]
            gate.open()
        await until(lambda: not before.newly_busy(), "the worker is idle")
        assert unexpected_threads(before.threads) == []

    async def test_a_hang_ends_the_play(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        world = await World.create(tmp_path, monkeypatch, sync_timeout=None)

        async def hang(w: World) -> None:
            await w.never.wait()

        outcome = await world.play(hang, deadline=0.05)
        assert outcome.hung
        assert not outcome.cancelled

    async def test_a_torn_write_is_seen(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        world = await World.create(tmp_path, monkeypatch, sync_timeout=None)
        copies = list(world.big.values)
        copies[1] = np.ones(BIG)
        world.big._copies = tuple(copies)
        with pytest.raises(AssertionError, match="copy 1 of 'big' differs from copy 0"):
            assert_variables(world, "untouched")

    async def test_a_stray_checkpoint_file_is_seen(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        world = await World.create(tmp_path, monkeypatch, sync_timeout=None)
        await assert_checkpoints(world, 1)
        (tmp_path / "ckpt-0.npz").write_bytes(b"")
        with pytest.raises(AssertionError, match="the checkpoint directory holds"):
            await assert_checkpoints(world, 1)
