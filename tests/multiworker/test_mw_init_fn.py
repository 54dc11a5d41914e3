"""A manager's ``init_fn`` failing on one worker, and what a failed manager save says.

``restore_or_initialize`` ends as a ``run()`` does, with an agreement that ``init_fn``
succeeded everywhere, so a worker whose ``init_fn`` raises fails every worker's call. A
manager's save names itself in the waits that a late or cancelled worker ends, and every
``OSError`` of a save names the path the user gave, not the temporary file written first.

Runs under ``mpiexec -n 2`` (see conftest.py); the ranks share one directory (made by rank 0,
its name broadcast).
"""

from __future__ import annotations

import errno
import os
import re
import time
from typing import TYPE_CHECKING

import anyio
import numpy as np
import pytest

from aioreplica import Checkpoint, CheckpointManager, ReplicaSyncError, Variable
from multiworker.mwtools import RANK, WORKERS, WORLD, allgather, shared_directory

if TYPE_CHECKING:
    from pathlib import Path

    from aioreplica import MultiWorkerMirroredStrategy
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

#: The worker whose ``init_fn`` fails, or whose save is late or cancelled.
FAILING = WORKERS - 1


async def assert_refused(strategy: MultiWorkerMirroredStrategy) -> str:
    """The strategy refuses the next ``run()``, as after any cross-worker failure."""
    with pytest.raises(RuntimeError, match="the workers fell out of step"):
        await strategy.run(lambda: None)
    return "run() refused"


@pytest.mark.parametrize("when", ["before its collective", "after its collective"])
async def test_an_init_fn_raising_on_one_worker_fails_every_workers_call(
    make_strategy: MakeStrategy, when: str
) -> None:
    """The last worker's ``init_fn`` raises before or after the write that the others make
    too: it raises its own exception, every other worker's ``restore_or_initialize`` a
    ReplicaSyncError naming it and the exception within seconds (not a disagreement with its
    next call, nor a return), and then every worker's strategy refuses a ``run()``."""
    strategy = make_strategy(2)
    with strategy.scope():
        w = Variable(np.zeros(3), name="w")

    async def init_fn() -> None:
        if RANK == FAILING and when == "before its collective":
            raise OSError("no pretrained weights on this worker")
        await w.assign(np.full(3, 7.0))
        if RANK == FAILING:
            raise OSError("no pretrained weights on this worker")

    with shared_directory() as directory:
        manager = CheckpointManager(
            Checkpoint(w=w), os.path.join(directory, "run"), init_fn=init_fn
        )
        raising = OSError if RANK == FAILING else ReplicaSyncError
        with anyio.fail_after(10), pytest.raises(raising) as caught:
            await manager.restore_or_initialize()
        seen = [type(caught.value).__name__, await assert_refused(strategy)]
        assert allgather(seen) == [
            *[["ReplicaSyncError", "run() refused"]] * (WORKERS - 1),
            ["OSError", "run() refused"],
        ]
        if RANK != FAILING:
            assert isinstance(caught.value, ReplicaSyncError)
            assert caught.value.workers == (FAILING,)
            assert (
                f"worker {FAILING} failed: OSError: no pretrained weights on this worker was "
                "raised in its init_fn (CheckpointManager.restore_or_initialize)"
            ) in str(caught.value)


@pytest.mark.parametrize("interval", [None, 10], ids=["every save", "checkpoint_interval"])
async def test_a_late_manager_save_names_its_call(
    make_strategy: MakeStrategy, interval: int | None
) -> None:
    """With ``sync_timeout=1``, the last worker reaches ``manager.save()`` only once the
    others have given up on it: each side's ReplicaSyncError says it waited in
    ``CheckpointManager.save`` (the call the user made), whatever the save's first collective
    is (the chief's step, with a ``checkpoint_interval``)."""
    strategy = make_strategy(1, sync_timeout=1)
    with strategy.scope():
        w = Variable(np.zeros(3), name="w")
        step = Variable(np.int64(0), name="step")
    with shared_directory() as directory:
        manager = CheckpointManager(
            Checkpoint(w=w, step=step),
            os.path.join(directory, "run"),
            step_counter=step if interval else None,
            checkpoint_interval=interval,
        )
        if RANK == FAILING:
            WORLD.recv(source=0)  # once the others gave up
        with anyio.fail_after(10), pytest.raises(ReplicaSyncError) as caught:
            await manager.save()
        if RANK == 0:
            WORLD.send(None, dest=FAILING)
        if RANK == FAILING:
            assert str(caught.value).startswith(
                f"worker 0 gave up waiting for worker {FAILING} (this worker, worker {FAILING}, "
                "among them): it waited 1 s in CheckpointManager.save"
            )
            assert caught.value.workers == (FAILING,)
        else:
            assert f"waited 1 s in CheckpointManager.save for worker {FAILING}" in str(caught.value)


@pytest.mark.parametrize("interval", [None, 10], ids=["every save", "checkpoint_interval"])
async def test_a_manager_save_cancelled_on_one_worker_names_its_call(
    make_strategy: MakeStrategy, interval: int | None
) -> None:
    """The last worker's save is cancelled while it waits for the others: the others'
    ReplicaSyncError names it and says its ``CheckpointManager.save`` was interrupted."""
    strategy = make_strategy(1)
    with strategy.scope():
        w = Variable(np.zeros(3), name="w")
        step = Variable(np.int64(0), name="step")
    with shared_directory() as directory:
        manager = CheckpointManager(
            Checkpoint(w=w, step=step),
            os.path.join(directory, "run"),
            step_counter=step if interval else None,
            checkpoint_interval=interval,
        )
        if RANK == FAILING:
            with anyio.CancelScope() as scope:
                scope.cancel()
                await manager.save()
            assert scope.cancelled_caught
            WORLD.send(None, dest=0)
        else:
            if RANK == 0:
                WORLD.recv(source=FAILING)  # once its wait was cancelled
            with anyio.fail_after(10), pytest.raises(ReplicaSyncError) as caught:
                await manager.save()
            assert caught.value.workers == (FAILING,)
            shown = f"worker {FAILING} failed: its CheckpointManager.save was interrupted"
            assert shown in str(caught.value)
        WORLD.Barrier()


def assert_names_the_path(error: OSError, path: str, reason: str, doing: str) -> None:
    """``error`` is the OS's ``reason`` for ``path`` (not for the temporary file), with a
    note of what the save was ``doing`` with its temporary file
    (``.<name>.<host>.<pid>.<hex>.tmp`` beside ``path``)."""
    assert str(error) == f"[Errno {error.errno}] {reason}: {path!r}"
    temporary = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.")
    pattern = (
        re.escape(f"while saving checkpoint {path!r}: {doing} '{temporary}")
        + r"[^'/]+\.tmp'; any file already there is intact"
    )
    notes = getattr(error, "__notes__", [])
    assert any(re.fullmatch(pattern, note) for note in notes), notes


async def test_a_save_under_a_file_names_the_path_given(tmp_path: Path) -> None:
    """On this worker alone (a checkpoint of no multi-worker variable), a save whose folder is
    a file raises the OS's error for the path given, the temporary file after it."""
    blocker = tmp_path / "afile"
    blocker.write_bytes(b"")
    path = str(blocker / "x.npz")
    with pytest.raises(NotADirectoryError) as caught:
        await Checkpoint(step=1).save(path)
    assert_names_the_path(caught.value, path, "Not a directory", "creating its temporary file")
    assert os.listdir(tmp_path) == ["afile"]


async def test_a_write_that_fails_names_the_path_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills up as the file is flushed: the save raises that very error (which
    named no path) for the path given, the temporary file in a note, and removes the
    temporary."""

    injected = OSError(errno.ENOSPC, "No space left on device")

    def full(fd: int) -> None:
        raise injected

    monkeypatch.setattr(os, "fsync", full)
    path = str(tmp_path / "x.npz")
    with pytest.raises(OSError, match="No space left on device") as caught:
        await Checkpoint(step=1).save(path)
    assert caught.value is injected
    reason = "No space left on device"
    assert_names_the_path(caught.value, path, reason, "writing its temporary file")
    assert os.listdir(tmp_path) == []


async def test_a_manager_directory_that_cannot_be_made_names_the_checkpoint(
    tmp_path: Path,
) -> None:
    """A manager's directory under a file made after the manager: its save names the
    checkpoint and the directory given, not the part of it where making it failed."""
    directory = str(tmp_path / "later" / "a" / "b")
    manager = CheckpointManager(Checkpoint(step=1), directory)
    (tmp_path / "later").write_bytes(b"")
    with pytest.raises(NotADirectoryError) as caught:
        await manager.save()
    target = os.path.join(directory, "ckpt-1.npz")
    assert str(caught.value) == f"[Errno {errno.ENOTDIR}] Not a directory: {target!r}"
    assert caught.value.__notes__ == [
        f"while saving checkpoint {target!r}: making its folder {directory!r}; any file "
        "already there is intact"
    ]
    assert manager.checkpoints == []


async def test_a_chiefs_failed_write_names_the_path_on_every_worker(
    make_strategy: MakeStrategy,
) -> None:
    """Every worker saves under a file (not a folder) of the shared directory: the chief
    raises the OS's error for that path, the others an OSError naming the chief and that
    path; no temporary file is named before it, and the strategy goes on working."""
    strategy = make_strategy(1)
    with strategy.scope():
        w = Variable(np.zeros(3), name="w")
    with shared_directory() as directory:
        if RANK == 0:
            await anyio.Path(directory, "afile").write_bytes(b"")
        WORLD.Barrier()
        path = os.path.join(directory, "afile", "x.npz")
        with pytest.raises(OSError, match="Not a directory") as caught:
            await Checkpoint(w=w).save(path)
        named = f"NotADirectoryError: [Errno {errno.ENOTDIR}] Not a directory: {path!r}"
        if RANK == 0:
            assert f"{type(caught.value).__name__}: {caught.value}" == named
        else:
            assert str(caught.value).startswith(
                f"the chief (worker 0) could not write the checkpoint: {named}; "
            )
        good = os.path.join(directory, "good.npz")
        assert allgather(await Checkpoint(w=w).save(good)) == [good] * WORKERS
        assert sorted(os.listdir(directory)) == ["afile", "good.npz"]


async def test_a_manager_with_a_checkpoint_interval_decides_by_the_chiefs_new_step_counter(
    make_strategy: MakeStrategy,
) -> None:
    """A step counter never read yet (made in the strategy's scope, so it still holds this
    worker's own initial value) takes the chief's value on every worker before the chief
    reads it, so every worker's save decides alike, by the chief's step."""
    strategy = make_strategy(1)
    with strategy.scope():
        w = Variable(np.zeros(3), name="w")
        step = Variable(np.int64(100 * RANK), name="step")
    with shared_directory() as directory:
        manager = CheckpointManager(
            Checkpoint(w=w, step=step),
            os.path.join(directory, "run"),
            step_counter=step,
            checkpoint_interval=10,
        )
        saved = [await manager.save()]  # at the chief's step 0 (not this worker's own)
        for moved in (5, 10):
            await step.assign(np.int64(moved))
            saved.append(await manager.save())
        names = [None if path is None else os.path.basename(path) for path in saved]
        assert allgather(names) == [["ckpt-1.npz", None, "ckpt-2.npz"]] * WORKERS


async def test_the_chief_decides_whether_a_save_is_held_back_on_every_worker(
    make_strategy: MakeStrategy,
) -> None:
    """Workers whose saves would decide apart (``check_interval`` True on some, False on the
    chief) all follow the chief's decision, so they make the same collectives: here every
    worker saves, as the chief does; then every worker holds back, as the chief does."""
    strategy = make_strategy(1)
    with strategy.scope():
        step = Variable(np.int64(100), name="step")
    with shared_directory() as directory:
        manager = CheckpointManager(
            Checkpoint(step=step),
            os.path.join(directory, "run"),
            step_counter=step,
            checkpoint_interval=100,
        )
        saved = [await manager.save()]
        await step.assign(np.int64(150))
        saved.append(await manager.save(check_interval=RANK != 0))  # the chief: False
        await step.assign(np.int64(160))
        saved.append(await manager.save(check_interval=RANK == 0))  # the chief: True
        names = [None if path is None else os.path.basename(path) for path in saved]
        assert allgather(names) == [["ckpt-1.npz", "ckpt-2.npz", None]] * WORKERS
        WORLD.Barrier()


async def test_a_checkpoint_interval_on_some_workers_only_is_refused_in_step(
    make_strategy: MakeStrategy,
) -> None:
    """A manager with a ``checkpoint_interval`` on the chief only would make a collective
    more there: every worker's save raises the same ValueError instead, nothing is written,
    and the workers are still in step."""
    strategy = make_strategy(1)
    with strategy.scope():
        step = Variable(np.int64(0), name="step")
    with shared_directory() as directory:
        manager = CheckpointManager(
            Checkpoint(step=step),
            os.path.join(directory, "run"),
            step_counter=step,
            checkpoint_interval=10 if RANK == 0 else None,
        )
        with pytest.raises(ValueError, match=r"CheckpointManager\.save every 10 steps") as caught:
            await manager.save()
        assert len({m.split(":", 1)[1] for m in allgather(str(caught.value))}) == 1
        assert manager.checkpoints == []
        assert await strategy.run(lambda: RANK) == RANK  # still in step
        WORLD.Barrier()


async def test_a_chief_writing_past_sync_timeout_is_named_as_such(
    make_strategy: MakeStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chief whose write of the file outlasts ``sync_timeout``: the others' ReplicaSyncError
    says they waited for the chief's writing of the checkpoint (not for a "broadcast"), naming
    the chief; the chief raises too, told that they gave up on it."""
    strategy = make_strategy(1, sync_timeout=1)
    with strategy.scope():
        w = Variable(np.zeros(3), name="w")
    await strategy.run(lambda: None)  # w synced: the save's first collective is the write's
    if RANK == 0:
        fsync = os.fsync

        def slow_fsync(fd: int) -> None:  # on the save's worker thread, off the event loop
            time.sleep(2.5)
            fsync(fd)

        monkeypatch.setattr(os, "fsync", slow_fsync)
    with shared_directory() as directory:
        with anyio.fail_after(20), pytest.raises(ReplicaSyncError) as caught:
            await Checkpoint(w=w).save(os.path.join(directory, "slow.npz"))
        monkeypatch.undo()
        message = str(caught.value)
        assert caught.value.workers == (0,), message
        if RANK == 0:
            assert message.startswith(
                "worker 1 gave up waiting for worker 0 (this worker, worker 0, among them): it "
                "waited 1 s in the chief's writing of the checkpoint"
            ), message
        else:
            assert message.startswith(
                "worker 1 waited 1 s in the chief's writing of the checkpoint for worker 0"
            ), message
