"""Tests for checkpoints at their edges: one variable at two paths, byte order, a restore
cancelled before it commits, folders where files are expected, ``checkpoint_interval`` with a
failed save, and ``latest_checkpoint``."""

from __future__ import annotations

import io
import json
import os
import threading
import zipfile
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import numpy as np
import pytest

import aioreplica
from aioreplica import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    InputOptions,
    MirroredStrategy,
    Variable,
    _checkpoint,
    batched,
    latest_checkpoint,
)
from aioreplica._cluster import WorkersDisagree
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio


def big_endian_copy(path: str, to: Path) -> None:
    """Rewrite the checkpoint at ``path`` to ``to`` as a big-endian machine writes it: its
    float64 arrays, and their manifest entries, in ``>f8``."""
    with zipfile.ZipFile(path) as old, zipfile.ZipFile(to, "w") as new:
        document = json.loads(old.read("manifest.json"))
        for entry in document["entries"]:
            if entry.get("dtype") == "<f8":
                entry["dtype"] = ">f8"
        for info in old.infolist():
            data = old.read(info.filename)
            if info.filename == "manifest.json":
                data = json.dumps(document).encode()
            else:
                array = np.lib.format.read_array(io.BytesIO(data))
                if array.dtype == np.float64:
                    written = io.BytesIO()
                    np.lib.format.write_array(written, array.astype(">f8"))
                    data = written.getvalue()
            new.writestr(info.filename, data)


class TestOneVariableAtTwoPaths:
    async def test_different_values_are_refused_naming_both_paths(self, tmp_path: Path) -> None:
        """A file holding different values at two paths that are one variable here is
        refused, naming both paths, and the variable keeps its value."""
        path = await Checkpoint(x=Variable(np.ones(2)), y=Variable(np.full(2, 2.0))).save(
            tmp_path / "two.npz"
        )
        w = Variable(np.zeros(2), name="w")
        with pytest.raises(CheckpointError) as refused:
            await Checkpoint(x=w, y=w).restore(path)
        assert refused.value.problems == (
            "x and y: the checkpoint holds different values at these paths, and here they "
            "hold the same variable 'w', which cannot take both; give each path its own "
            "variable, as when it was saved",
        )
        np.testing.assert_array_equal(w.numpy(), [0.0, 0.0])

    async def test_equal_values_restore(self, tmp_path: Path) -> None:
        """The same value at both paths (as one variable saved at two paths) restores."""
        w = Variable(np.arange(2.0), name="w")
        ckpt = Checkpoint(x=w, y=w)
        path = await ckpt.save(tmp_path / "one.npz")
        await w.assign(7.0)
        report = await ckpt.restore(path)
        assert report.restored == ("x", "y")
        np.testing.assert_array_equal(w.numpy(), [0.0, 1.0])

    @pytest.mark.parametrize("equal", [True, False])
    async def test_the_values_are_compared_off_the_event_loop(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, equal: bool
    ) -> None:
        """Comparing the values at both paths reads every byte of both (tied weights are
        compared at every restore): it runs in a worker thread, not on the event loop's."""
        x = Variable(np.arange(4.0), name="x")
        path = await Checkpoint(x=x, y=x if equal else Variable(np.ones(4))).save(
            tmp_path / "tied.npz"
        )
        w = Variable(np.zeros(4), name="w")
        loop = threading.get_ident()
        on_loop: list[bool] = []
        array_equal = np.array_equal

        def noted(*args: Any, **kwargs: Any) -> bool:
            on_loop.append(threading.get_ident() == loop)
            return bool(array_equal(*args, **kwargs))

        monkeypatch.setattr(np, "array_equal", noted)
        if equal:
            assert (await Checkpoint(x=w, y=w).restore(path)).complete
        else:
            with pytest.raises(CheckpointError, match="holds different values"):
                await Checkpoint(x=w, y=w).restore(path)
        assert on_loop == [False]
        np.testing.assert_array_equal(w.numpy(), np.arange(4.0) if equal else np.zeros(4))


class TestByteOrder:
    async def test_a_variable_of_the_other_byte_order_restores(self, tmp_path: Path) -> None:
        """A variable whose dtype is in the other byte order than this machine's saves and
        restores, keeping its dtype."""
        other = np.dtype(np.float64).newbyteorder()
        w = Variable(np.arange(3, dtype=other), name="w")
        ckpt = Checkpoint(w=w)
        path = await ckpt.save(tmp_path / "other.npz")
        await w.assign(np.full(3, 9.0, dtype=other))
        assert (await ckpt.restore(path)).complete
        np.testing.assert_array_equal(w.numpy(), [0.0, 1.0, 2.0])
        assert w.dtype == other

    async def test_a_big_endian_file_restores_in_native_order(self, tmp_path: Path) -> None:
        """Arrays written in the other byte order restore, as the same values in this
        machine's order."""
        w = Variable(np.arange(3.0), name="w")
        ckpt = Checkpoint(w=w, rate=0.5)
        path = await ckpt.save(tmp_path / "native.npz")
        big_endian_copy(path, tmp_path / "big.npz")
        await w.assign(9.0)
        ckpt.rate = 0.0
        assert (await ckpt.restore(tmp_path / "big.npz")).complete
        np.testing.assert_array_equal(w.numpy(), [0.0, 1.0, 2.0])
        assert (w.numpy().dtype, ckpt.rate) == (np.dtype(np.float64), 0.5)


class TestCancelledRestore:
    async def test_cancelled_while_reading_changes_nothing(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A caller's scope cancelled while the file is read (which is not given up midway)
        cancels the restore before it commits: nothing changes, and the scope caught its
        cancellation."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros(4), name="w")
        ckpt = Checkpoint(w=w, step=1)
        path = await ckpt.save(tmp_path / "c.npz")
        await w.assign(5.0)
        ckpt.step = 2
        read = np.lib.format.read_array
        scopes: list[anyio.CancelScope] = []

        def cancelling(*args: Any, **kwargs: Any) -> Any:
            anyio.from_thread.run_sync(scopes[-1].cancel)
            return read(*args, **kwargs)

        monkeypatch.setattr(np.lib.format, "read_array", cancelling)
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await ckpt.restore(path)
        monkeypatch.undo()
        assert (scope.cancelled_caught, ckpt.step) == (True, 2)
        for copy in w.values:
            np.testing.assert_array_equal(copy, [5.0] * 4)
        assert (await ckpt.restore(path)).complete  # and a restore not cancelled commits
        assert ckpt.step == 1


class TestFolders:
    async def test_restoring_a_folder_says_so(self, tmp_path: Path) -> None:
        """A folder given to restore is named as a folder, with where to find its newest
        checkpoint, not as a corrupted file."""
        with pytest.raises(IsADirectoryError) as refused:
            await Checkpoint(step=0).restore(tmp_path)
        assert str(refused.value) == (
            f"[Errno 21] cannot restore checkpoint {str(tmp_path)!r}: it is a folder, not a "
            "checkpoint file; give a file in it, such as the newest of a manager's: "
            "CheckpointManager(checkpoint, folder).latest, or "
            "aioreplica.latest_checkpoint(folder)"
        )

    async def test_a_folder_named_like_a_checkpoint_is_not_one(self, tmp_path: Path) -> None:
        """A folder named ``ckpt-5.npz`` is neither listed nor ``latest``, and pruning never
        deletes a good file on its account."""
        manager = CheckpointManager(Checkpoint(step=0), tmp_path, max_to_keep=2)
        await manager.save(3)
        (tmp_path / "ckpt-5.npz").mkdir()
        found = CheckpointManager(Checkpoint(step=0), tmp_path, max_to_keep=2)
        assert found.checkpoints == [str(tmp_path / "ckpt-3.npz")]
        assert latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-3.npz")
        assert await found.save() == str(tmp_path / "ckpt-4.npz")
        assert await found.save() == str(tmp_path / "ckpt-6.npz")  # past the folder's name
        assert sorted(os.listdir(tmp_path)) == ["ckpt-4.npz", "ckpt-5.npz", "ckpt-6.npz"]
        assert found.checkpoints == [str(tmp_path / "ckpt-4.npz"), str(tmp_path / "ckpt-6.npz")]

    async def test_a_managers_folder_replaced_by_a_file(self, tmp_path: Path) -> None:
        """A manager's folder that became a regular file: the save names the folder as a
        file (not the checkpoint as existing), with what it was doing."""
        directory = tmp_path / "run"
        manager = CheckpointManager(Checkpoint(step=0), directory)
        await manager.save()
        directory.rename(tmp_path / "moved")
        directory.write_bytes(b"")
        with pytest.raises(NotADirectoryError) as refused:
            await manager.save()
        path = str(directory / "ckpt-2.npz")
        assert str(refused.value) == (
            f"[Errno 20] cannot save checkpoint {path!r}: its folder is a file, not a folder "
            f"(move that file away, or give the manager another directory): {str(directory)!r}"
        )
        assert refused.value.__notes__ == [
            f"while saving checkpoint {path!r}: making its folder {str(directory)!r}; any "
            "file already there is intact"
        ]
        assert manager.checkpoints == [str(directory / "ckpt-1.npz")]


class IntervalSaves:
    """A manager saving every 100 steps of ``step`` into ``directory``, where the file of
    ``checkpoint_number=7`` cannot be written (a folder is in its place); ``outcomes`` records
    each ``save``'s file name, ``None`` (held back) or the name of its OSError, in order."""

    def __init__(self, directory: Path) -> None:
        (directory / "ckpt-7.npz").mkdir()
        self.step = Variable(np.int64(100))
        self.manager = CheckpointManager(
            Checkpoint(step=self.step), directory, step_counter=self.step, checkpoint_interval=100
        )
        self.outcomes: list[str | None] = []

    async def save(self, **kwargs: Any) -> None:
        try:
            path = await self.manager.save(**kwargs)
        except OSError as exc:
            self.outcomes.append(type(exc).__name__)
        else:
            self.outcomes.append(None if path is None else os.path.basename(path))

    async def failing_then(self, step: int) -> None:
        """A save that fails, and while it is in flight, ``step`` and a save of it."""
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: self.save(checkpoint_number=7))
            await anyio.wait_all_tasks_blocked()
            await self.step.assign(step)
            group.start_soon(self.save)


class TestIntervalAfterAFailedSave:
    async def test_a_failed_save_keeps_a_later_saves_step(self, tmp_path: Path) -> None:
        """Of two concurrent saves the first fails and the second succeeds: the interval
        then counts from the second's step."""
        saves = IntervalSaves(tmp_path)
        await saves.failing_then(200)
        await saves.step.assign(201)
        await saves.save()
        assert saves.outcomes == ["IsADirectoryError", "ckpt-1.npz", None]

    async def test_a_save_after_one_in_flight_that_fails_is_not_lost(self, tmp_path: Path) -> None:
        """A save within the interval of one still in flight decides once that one ended: it
        failed, so this one saves, and the step has its checkpoint."""
        saves = IntervalSaves(tmp_path)
        await saves.failing_then(150)
        assert saves.outcomes == ["IsADirectoryError", "ckpt-1.npz"]
        restored = Checkpoint(step=Variable(np.int64(0)))
        await restored.restore(tmp_path / "ckpt-1.npz")
        assert int(restored.step) == 150


class TestLatestCheckpoint:
    async def test_the_newest_of_a_managers_files(self, tmp_path: Path) -> None:
        """TF's ``tf.train.latest_checkpoint``: the highest number of the given name, or None
        where there is none (no folder, or no file of that name)."""
        assert latest_checkpoint(tmp_path / "none") is None
        manager = CheckpointManager(Checkpoint(step=0), tmp_path, checkpoint_name="model")
        for number in (2, 10):
            await manager.save(number)
        assert latest_checkpoint(tmp_path) is None
        assert latest_checkpoint(tmp_path, checkpoint_name="model") == str(
            tmp_path / "model-10.npz"
        )

    @pytest.mark.parametrize(
        ("directory", "name", "error", "message"),
        [
            (3, "ckpt", TypeError, "latest_checkpoint needs a file path"),
            ("", "ckpt", ValueError, "latest_checkpoint: directory is empty"),
            ("file", "ckpt", NotADirectoryError, "latest_checkpoint: directory '.*file' is a"),
            (".", 1, TypeError, "checkpoint_name must be a str"),
            (".", "a/b", ValueError, "checkpoint_name must be a non-empty file name prefix"),
        ],
        ids=["not a path", "empty", "a file", "name not a str", "name with a separator"],
    )
    def test_bad_arguments(
        self, tmp_path: Path, directory: Any, name: Any, error: type[Exception], message: str
    ) -> None:
        """Arguments that cannot name a manager's checkpoints are refused, named."""
        (tmp_path / "file").write_bytes(b"")
        if directory == "file":
            directory = tmp_path / "file"
        with pytest.raises(error, match=message):
            latest_checkpoint(directory, name)


class TestRefusedIterators:
    def test_per_replica_pipelines_are_named_by_their_mode(self) -> None:
        """An iterator over ``PER_REPLICA`` pipelines is refused naming that mode, not an
        internal class."""
        strategy = MirroredStrategy(host_devices(2))
        options = InputOptions(experimental_replication_mode="per_replica")
        dataset = strategy.distribute_datasets_from_function(
            lambda context: batched(np.arange(4), 2), options
        )
        with pytest.raises(TypeError) as refused:
            Checkpoint(data=aiter(dataset))
        assert str(refused.value).startswith(
            "Checkpoint: data is a DistributedIterator over a per-replica set of input "
            "pipelines (InputReplicationMode.PER_REPLICA); a checkpoint saves only"
        )


class TestRefusedSave:
    async def test_a_sync_on_read_none_variable_is_named(self, tmp_path: Path) -> None:
        """A sync-on-read variable with aggregation NONE has no one value to save: the error
        names its path and says nothing was written."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            none = Variable(np.zeros(2), synchronization="on_read", name="none")
        manager = CheckpointManager(Checkpoint(model={"n": none}), tmp_path / "run")
        with pytest.raises(
            ValueError, match=r"^CheckpointManager.save: cannot save model/n: "
        ) as e:
            await manager.save()
        assert str(e.value).endswith("; nothing was written")
        assert not (tmp_path / "run").exists()

    async def test_workers_disagreeing_on_a_read_is_not_rewrapped(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A variable's read that the workers disagree on (as a multi-worker sync-on-read
        read may) reaches the caller as the ``WorkersDisagree`` it is, not a plain
        ``ValueError``."""
        disagree = WorkersDisagree("reading sync-on-read variable 'm': the workers differ")

        def read(variable: Variable) -> Any:
            raise disagree

        monkeypatch.setattr(_checkpoint, "snapshot", read)
        with pytest.raises(WorkersDisagree) as e:
            await Checkpoint(m=Variable(np.zeros(2), name="m")).save(tmp_path / "m.npz")
        assert e.value is disagree
        assert not (tmp_path / "m.npz").exists()


def test_exported() -> None:
    """``latest_checkpoint`` is public, beside ``CheckpointManager``."""
    assert aioreplica.latest_checkpoint is latest_checkpoint
    assert latest_checkpoint.__module__ == "aioreplica"


async def test_a_save_encodes_its_manifest_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest of a model of thousands of variables takes tens of milliseconds to
    encode: a save does it in its worker thread, never on the event loop's thread, and the
    file reads back the same."""
    strategy = MirroredStrategy(host_devices(2))
    with strategy.scope():
        variables = {f"v{i}": Variable(np.full(3, i, np.float32)) for i in range(50)}
    encoded_on: list[str] = []
    dumps = json.dumps

    def recording_dumps(obj: Any, *args: Any, **kwargs: Any) -> str:
        if isinstance(obj, dict) and "entries" in obj:
            encoded_on.append(threading.current_thread().name)
        return dumps(obj, *args, **kwargs)

    monkeypatch.setattr(json, "dumps", recording_dumps)
    checkpoint = Checkpoint(**variables)
    path = await checkpoint.save(tmp_path / "ckpt")
    assert len(encoded_on) == 1
    assert encoded_on != [threading.current_thread().name]
    for variable in variables.values():
        await variable.assign(np.zeros(3, np.float32))
    await checkpoint.restore(path)
    assert [int(v.numpy()[0]) for v in variables.values()] == list(range(50))
