"""Checkpoints under concurrency, cancellation and crashes, and malformed manifests.

Concurrent saves of one manager, restores racing with writes and optimizer steps, saves
cancelled at each point of their work, writers killed mid-write, and manifests malformed
field by field.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.to_thread
import numpy as np
import pytest
from held_writes import hold_writes

import aioreplica
from aioreplica import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    MirroredStrategy,
    Variable,
)
from aioreplica._backends._numpy import INLINE_BYTES, HostDevice
from aioreplica.optimizers import SGD
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

pytestmark = pytest.mark.anyio

#: The directory that holds the ``aioreplica`` package, for subprocesses' ``PYTHONPATH``.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(aioreplica.__file__)))

#: A variable this big is written through its device's worker thread, not inline.
BIG: tuple[int, int] = (1024, 1024)
assert np.zeros(BIG).nbytes >= INLINE_BYTES


def saved(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every top-level value of a checkpoint file by object path, as nested lists."""
    with np.load(path, allow_pickle=False) as npz:
        entries = json.loads(bytes(npz["manifest.json"]))["entries"]
        return {"/".join(map(str, e["path"])): npz[e["array"]].tolist() for e in entries}


def names(paths: list[str]) -> list[str]:
    return [os.path.basename(path) for path in paths]


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.exists() else []


class TestConcurrentSaves:
    async def test_each_save_gets_its_own_number_in_call_order(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Six overlapping saves write six files, numbered in call order, each with its values.

        Every write waits until all six saves have been called, so they all overlap.
        """
        count, keep = 6, 3
        ckpt = Checkpoint(step=-1)
        manager = CheckpointManager(ckpt, tmp_path / "run", max_to_keep=keep)
        all_called = threading.Event()
        hold_writes(monkeypatch, all_called)
        calls: list[int] = []
        paths: dict[int, str] = {}

        async def save(value: int) -> None:
            ckpt.step = value  # the value this save must write
            calls.append(value)
            if len(calls) == count:
                all_called.set()
            paths[value] = await manager.save()

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for value in range(count):
                    tg.start_soon(save, value)

        assert sorted(calls) == list(range(count))
        numbers = {value: calls.index(value) + 1 for value in calls}
        assert paths == {v: str(tmp_path / "run" / f"ckpt-{n}.npz") for v, n in numbers.items()}
        assert names(manager.checkpoints) == ["ckpt-4.npz", "ckpt-5.npz", "ckpt-6.npz"]
        assert manager.latest == str(tmp_path / "run" / "ckpt-6.npz")
        assert listing(tmp_path / "run") == ["ckpt-4.npz", "ckpt-5.npz", "ckpt-6.npz"]
        for number in (4, 5, 6):
            assert saved(tmp_path / "run" / f"ckpt-{number}.npz") == {"step": calls[number - 1]}

    async def test_values_are_those_at_the_call_even_while_waiting(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A save that waits for an earlier one still writes the values it was called with."""
        w = Variable(np.zeros(3), name="w")
        ckpt = Checkpoint(w=w, epoch=0)
        manager = CheckpointManager(ckpt, tmp_path)
        resume = threading.Event()
        writing = hold_writes(monkeypatch, resume)
        events: list[str] = []

        async def save(label: str) -> None:
            events.append(f"{label} called")
            await manager.save()
            events.append(f"{label} saved")

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(save, "first")
                assert await anyio.to_thread.run_sync(writing.wait, 10)
                await w.assign(np.ones(3))
                ckpt.epoch = 1
                tg.start_soon(save, "second")
                await anyio.wait_all_tasks_blocked()
                await w.assign(np.full(3, 2.0))
                ckpt.epoch = 2
                resume.set()

        assert events == ["first called", "second called", "first saved", "second saved"]
        assert saved(tmp_path / "ckpt-1.npz") == {"w": [0.0, 0.0, 0.0], "epoch": 0}
        assert saved(tmp_path / "ckpt-2.npz") == {"w": [1.0, 1.0, 1.0], "epoch": 1}

    async def test_save_cancelled_while_waiting_writes_nothing(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A save cancelled while an earlier one writes leaves no file and no gap in numbers."""
        manager = CheckpointManager(Checkpoint(step=1), tmp_path, max_to_keep=2)
        resume = threading.Event()
        writing = hold_writes(monkeypatch, resume)
        events: list[str] = []
        waiting = anyio.CancelScope()

        async def cancelled_save() -> None:
            with waiting:
                events.append("second called")
                await manager.save()
                events.append("second saved")
            events.append(f"second cancelled: {waiting.cancelled_caught}")

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(manager.save)
                assert await anyio.to_thread.run_sync(writing.wait, 10)
                tg.start_soon(cancelled_save)
                await anyio.wait_all_tasks_blocked()
                waiting.cancel()
                await anyio.wait_all_tasks_blocked()
                resume.set()
            assert await manager.save() == str(tmp_path / "ckpt-2.npz")

        assert events == ["second called", "second cancelled: True"]
        assert listing(tmp_path) == ["ckpt-1.npz", "ckpt-2.npz"]
        assert names(manager.checkpoints) == ["ckpt-1.npz", "ckpt-2.npz"]


class TestCancelledSave:
    @pytest.mark.parametrize(
        "point",
        [
            "making the directory",
            "removing stale temporaries",
            "writing",
            "deleting old checkpoints",
        ],
    )
    async def test_no_checkpoint_orphaned(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
    ) -> None:
        """Saves cancelled at one point of their work never leave a file the manager forgot.

        The cancellation comes from inside that step (in its worker thread). Every file on disk
        stays listed, so a later save deletes it; no more than ``max_to_keep`` remain.
        """
        keep = 2
        directory = tmp_path / "run"
        manager = CheckpointManager(Checkpoint(step=0), directory, max_to_keep=keep)
        scopes: list[anyio.CancelScope] = []
        module, name = {
            "making the directory": (os, "makedirs"),
            "removing stale temporaries": (os, "scandir"),
            "writing": (np.lib.format, "write_array"),
            "deleting old checkpoints": (os, "unlink"),
        }[point]
        real = getattr(module, name)

        def cancelling(*args: Any, **kwargs: Any) -> Any:
            anyio.from_thread.run_sync(scopes[-1].cancel)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, cancelling)
        cancelled: list[bool] = []
        with anyio.fail_after(20):
            for _ in range(6):
                with anyio.CancelScope() as scope:
                    scopes.append(scope)
                    await manager.save()
                cancelled.append(scope.cancel_called)
                assert listing(directory) == sorted(names(manager.checkpoints))
                assert len(listing(directory)) <= keep
            monkeypatch.undo()
            await manager.save()

        expected_cancelled = {
            "making the directory": [True] * 6,
            "removing stale temporaries": [True, False, False, False, False, False],
            "writing": [True] * 6,
            "deleting old checkpoints": [False, False, True, True, True, True],
        }
        assert cancelled == expected_cancelled[point]
        assert listing(directory) == sorted(names(manager.checkpoints))
        assert len(manager.checkpoints) == (1 if point == "making the directory" else keep)


@pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ],
)
async def test_a_save_cancelled_by_task_cancel_lists_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare ``Task.cancel()`` (as ``asyncio.timeout`` and ``wait_for`` use) during the write:
    the write finishes, and its checkpoint is listed and the old one pruned before the
    cancellation comes out. It used to leave a file on disk that the manager did not list."""
    import asyncio

    directory = tmp_path / "run"
    manager = CheckpointManager(Checkpoint(step=0), directory, max_to_keep=1)
    await manager.save()
    go_on = threading.Event()
    writing = hold_writes(monkeypatch, go_on)
    task = asyncio.ensure_future(manager.save())
    with anyio.fail_after(10):
        assert await anyio.to_thread.run_sync(writing.wait, 10), "the write never started"
        task.cancel()
        go_on.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert names(manager.checkpoints) == ["ckpt-2.npz"]
    assert listing(directory) == ["ckpt-2.npz"]


async def dead_pid() -> int:
    """The pid of a process of this host that has ended (and been reaped)."""
    async with await anyio.open_process([sys.executable, "-c", "pass"]) as process:
        assert await process.wait() == 0
    return process.pid


async def killed_writer(directory: Path, name: str) -> int:
    """Run a process whose manager (``checkpoint_name=name``) saves once into ``directory``,
    then is killed (SIGKILL) in the middle of its second save; return its pid."""
    script = """if True:
        import os, signal, sys
        import anyio, numpy as np
        import aioreplica
        print(os.getpid(), flush=True)
        w = aioreplica.Variable(np.arange(4.0), name="w")
        manager = aioreplica.CheckpointManager(
            aioreplica.Checkpoint(w=w), sys.argv[1], checkpoint_name=sys.argv[2]
        )
        anyio.run(manager.save)
        real = np.lib.format.write_array
        def killed(*args, **kwargs):
            real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        np.lib.format.write_array = killed
        anyio.run(manager.save)
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    with anyio.fail_after(20):
        result = await anyio.run_process(
            [sys.executable, "-c", script, str(directory), name], check=False, env=env
        )
    assert (result.returncode, result.stderr) == (-signal.SIGKILL, b"")
    return int(result.stdout)


class TestStaleTemporaries:
    async def test_first_save_removes_only_stale_ones(self, tmp_path: Path) -> None:
        """The first save removes this manager's temporaries whose writer is gone.

        Here: those of an ended process of this host, and those of another host (or of an
        unknown writer) older than an hour. A live writer's, a young one of another host, another
        prefix's and other files stay. Making the manager removes nothing.
        """
        host = socket.gethostname()
        dead = await dead_pid()
        hour_ago = time.time() - 3600 - 60
        async with await anyio.open_process(
            [sys.executable, "-c", "import sys; sys.stdin.read()"]
        ) as child:
            files = {
                f".ckpt-3.npz.{host}.{dead}.0a1b2c3d.tmp": ("removed", None),
                f".ckpt-4.npz.{host}.{os.getpid()}.0a1b2c3d.tmp": ("kept", hour_ago),
                f".ckpt-5.npz.{host}.{child.pid}.0a1b2c3d.tmp": ("kept", hour_ago),
                f".ckpt-3.npz.elsewhere.example.org.{dead}.1a1b2c3d.tmp": ("kept", None),
                f".ckpt-3.npz.elsewhere.example.org.{dead}.2a1b2c3d.tmp": ("removed", hour_ago),
                ".ckpt-3.npz.3a1b2c3d.tmp": ("kept", None),
                ".ckpt-3.npz.4a1b2c3d.tmp": ("removed", hour_ago),
                f".other-3.npz.{host}.{dead}.0a1b2c3d.tmp": ("kept", hour_ago),
                f".ckpt-x.npz.{host}.{dead}.0a1b2c3d.tmp": ("kept", hour_ago),
                "notes.tmp": ("kept", hour_ago),
            }
            for name, (_, mtime) in files.items():
                (tmp_path / name).write_bytes(b"partial")
                if mtime is not None:
                    os.utime(tmp_path / name, (mtime, mtime))
            manager = CheckpointManager(Checkpoint(step=1), tmp_path)
            assert listing(tmp_path) == sorted(files)

            await manager.save()

            kept = [name for name, (fate, _) in files.items() if fate == "kept"]
            assert listing(tmp_path) == sorted([*kept, "ckpt-1.npz"])
            assert child.stdin is not None
            await child.stdin.aclose()
            with anyio.fail_after(10):
                assert await child.wait() == 0

    async def test_killed_writer_leaves_a_temporary_the_next_run_removes(
        self, tmp_path: Path
    ) -> None:
        """A writer killed mid-write leaves one temporary named after its host and pid; the next
        run's first save removes it, and numbering resumes after the last whole checkpoint."""
        pid = await killed_writer(tmp_path, "ckpt")
        host = socket.gethostname()
        [temporary] = [name for name in listing(tmp_path) if name != "ckpt-1.npz"]
        assert temporary.startswith(f".ckpt-2.npz.{host}.{pid}.")
        assert temporary.endswith(".tmp")

        w = Variable(np.zeros(4), name="w")
        manager = CheckpointManager(Checkpoint(w=w), tmp_path)
        assert listing(tmp_path) == sorted(["ckpt-1.npz", temporary])
        assert await manager.save() == str(tmp_path / "ckpt-2.npz")

        assert listing(tmp_path) == ["ckpt-1.npz", "ckpt-2.npz"]
        assert saved(tmp_path / "ckpt-1.npz") == {"w": [0.0, 1.0, 2.0, 3.0]}

    async def test_long_checkpoint_name(self, tmp_path: Path) -> None:
        """A manager whose file names leave no room in a temporary's name for the host and pid
        (a 240-character ``checkpoint_name``) saves: the temporary's name is cut short, ending
        in ``~``, within 255 bytes (its saves used to fail with ENAMETOOLONG). A writer killed
        mid-write leaves such a temporary; the next run's first save recognises it as its
        own and removes it, and keeps a live writer's and another name's."""
        name = "n" * 240
        pid = await killed_writer(tmp_path, name)
        host = socket.gethostname()
        [temporary] = [n for n in listing(tmp_path) if n != f"{name}-1.npz"]
        assert len(os.fsencode(temporary)) <= 255
        start = temporary[1 : temporary.index(f"~.{host}.{pid}.")]
        assert start
        assert f"{name}-2.npz".startswith(start)
        assert temporary.endswith(".tmp")
        # This process's pid may have more digits than the writer's: its name is cut to fit.
        mine = start[: 255 - len(f".~.{host}.{os.getpid()}.0a1b2c3d.tmp")]
        alive = f".{mine}~.{host}.{os.getpid()}.0a1b2c3d.tmp"
        another = f".m{start[1:]}~.{host}.{pid}.0a1b2c3d.tmp"
        for other in (alive, another):
            (tmp_path / other).write_bytes(b"partial")

        w = Variable(np.zeros(4), name="w")
        manager = CheckpointManager(Checkpoint(w=w), tmp_path, checkpoint_name=name)
        assert await manager.save() == str(tmp_path / f"{name}-2.npz")

        assert listing(tmp_path) == sorted([f"{name}-1.npz", f"{name}-2.npz", alive, another])
        assert saved(tmp_path / f"{name}-1.npz") == {"w": [0.0, 1.0, 2.0, 3.0]}


# -- restores racing with writes ---------------------------------------------------------------


@dataclass
class Model:
    """A strategy's ``w`` and ``b``, trained by ``opt``, saved with ``epoch`` in ``ckpt``."""

    strategy: MirroredStrategy
    w: Variable
    b: Variable
    opt: SGD
    ckpt: Checkpoint

    def state(self) -> list[Any]:
        """Every copy of every variable and slot, the step count and the epoch."""
        slots = [self.opt.get_slot(v, "momentum") for v in (self.w, self.b)]
        return [
            *[np.asarray(c).tolist() for v in (self.w, self.b, *slots) for c in v.values],
            self.opt.iterations,
            self.ckpt.epoch,
        ]


async def trained(w_shape: tuple[int, ...], steps: int) -> Model:
    strategy = MirroredStrategy(host_devices(2))
    with strategy.scope():
        size = int(np.prod(w_shape))
        w = Variable(np.arange(size, dtype=np.float64).reshape(w_shape) / size, name="w")
        b = Variable(np.array([1.0, -2.0, 0.5]), name="b")
    opt = SGD(0.1, momentum=0.9)
    model = Model(strategy, w, b, opt, Checkpoint(model={"w": w, "b": b}, opt=opt, epoch=0))
    for _ in range(steps):
        await step(model)
    return model


async def step(model: Model) -> None:
    """One optimizer step; the gradients depend on the weights and the replica."""

    async def replica_step() -> None:
        context = aioreplica.get_replica_context()
        assert context is not None
        replica = context.replica_id_in_sync_group
        await model.opt.apply_gradients(
            [
                (np.asarray(model.w) * 0.5 + replica + 1.0, model.w),
                (np.asarray(model.b) - replica, model.b),
            ]
        )

    await model.strategy.run(replica_step)


async def _optimizer_step(model: Model) -> None:
    """One optimizer step whose gradients (unlike ``step``'s) do not depend on the weights.

    A replica computes its gradients before the step waits for its turn, so gradients read
    from the weights would be those from before the restore.
    """

    async def replica_step() -> None:
        context = aioreplica.get_replica_context()
        assert context is not None
        replica = context.replica_id_in_sync_group
        await model.opt.apply_gradients(
            [(np.full(model.w.shape, replica + 1.0), model.w), (np.full(3, -replica), model.b)]
        )

    await model.strategy.run(replica_step)


def _assign_add(model: Model) -> Awaitable[Any]:
    return model.w.assign_add(np.ones(model.w.shape))


def _update(model: Model) -> Awaitable[Any]:
    return model.strategy.extended.update(model.w, lambda copy: copy * 2.0 + 1.0)


def _slot_write(model: Model) -> Awaitable[Any]:
    return model.opt.get_slot(model.w, "momentum").assign_add(np.full(model.w.shape, 0.5))


#: The writes raced with a restore: a variable write and a ``strategy.extended.update`` of a
#: big ``w`` (its new copies computed in the worker thread), a write of an optimizer slot,
#: and an optimizer step.
WRITES: dict[str, tuple[Callable[[Model], Awaitable[Any]], tuple[int, ...]]] = {
    "assign_add": (_assign_add, BIG),
    "update": (_update, BIG),
    "slot write": (_slot_write, BIG),
    "optimizer step": (_optimizer_step, (2, 3)),
}


class HeldCompute:
    """Holds the first device computation started after ``arm()`` until ``release``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        self.entered = anyio.Event()
        self.release = anyio.Event()
        real = HostDevice.compute

        async def compute(device: HostDevice, nbytes: int, fn: Any, *args: Any) -> Any:
            if self.armed:
                self.armed = False
                self.entered.set()
                await self.release.wait()
            return await real(device, nbytes, fn, *args)

        monkeypatch.setattr(HostDevice, "compute", compute)


class TestRestoreTakesTurns:
    @pytest.mark.parametrize("write", list(WRITES))
    async def test_write_called_during_restore_applies_after_it(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: str
    ) -> None:
        """A write called while a restore computes its new copies waits, then applies on top.

        The restore is held inside its first device computation, after the file was read and
        checked; the write is called then and runs as far as it can. Outcome: the restored
        state with the write applied, as when the two run one after the other (never the
        write on the pre-restore values, never the restore dropping the write).
        """
        apply, w_shape = WRITES[write]
        model = await trained(w_shape, steps=1)
        path = str(tmp_path / "ckpt.npz")
        await model.ckpt.save(path)
        await step(model)
        model.ckpt.epoch = 9
        reference = await trained(w_shape, steps=3)
        await reference.ckpt.restore(path)
        await apply(reference)
        held = HeldCompute(monkeypatch)
        events: list[str] = []

        async def restore() -> None:
            await model.ckpt.restore(path)
            events.append("restored")

        async def write_during_restore() -> None:
            events.append("write called")
            await apply(model)
            events.append("written")

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                held.armed = True
                tg.start_soon(restore)
                await held.entered.wait()
                tg.start_soon(write_during_restore)
                await anyio.wait_all_tasks_blocked()
                events.append("restore let go on")
                held.release.set()

        assert events == ["write called", "restore let go on", "restored", "written"]
        assert model.state() == reference.state()

    @pytest.mark.parametrize(
        ("change", "problem"),
        [
            ("tuple", "Checkpoint.restore: the number at cfg/t/0 is inside a tuple"),
            ("added", "(an object added, removed or replaced in one of its dicts or lists)"),
            ("replaced", "(an object added, removed or replaced in one of its dicts or lists)"),
        ],
    )
    async def test_objects_changed_while_the_restore_waits(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str, problem: str
    ) -> None:
        """A dict of the checkpoint changed while the restore, checked already, computes its
        new copies: the restore raises CheckpointError and changes nothing. A number moved
        into a tuple used to fail the commit halfway, with the variables restored and a bare
        TypeError."""
        model = await trained(BIG, steps=1)
        cfg: dict[str, Any] = {"t": [5]}
        model.ckpt.cfg = cfg
        path = str(tmp_path / "ckpt.npz")
        await model.ckpt.save(path)
        await step(model)
        cfg["t"] = [6]
        before = model.state()
        held = HeldCompute(monkeypatch)

        async def restore() -> None:
            with pytest.raises(CheckpointError) as caught:
                await model.ckpt.restore(path)
            [message] = caught.value.problems
            assert message.startswith(
                "the checkpoint's objects changed while the restore waited for its turn"
            )
            assert problem in message

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                held.armed = True
                tg.start_soon(restore)
                await held.entered.wait()
                if change == "tuple":
                    cfg["t"] = (6,)
                elif change == "added":
                    cfg["u"] = 1
                else:
                    model.ckpt.model["b"] = Variable(np.zeros(3), name="b")
                held.release.set()

        assert model.state() == before
        assert cfg["t"] == ((6,) if change == "tuple" else [6])


# -- malformed manifests and clear messages ---------------------------------------------------


def _rewrite(source: str, target: str, document: Any) -> None:
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            data = old.read(info.filename)
            if info.filename == "manifest.json":
                data = json.dumps(document).encode()
            new.writestr(info.filename, data)


#: Values of the wrong type for a field of each type; ``DELETE`` removes the field.
DELETE = object()
WRONG: dict[str, list[Any]] = {
    "str": [7, None, True, ["a"], {"a": 1}, DELETE],
    "path": ["w", 7, None, [], ["model", ["w"]], ["model", {"a": 1}], ["model", True],
             ["model", 1.5], ["model", None], DELETE],
    "shape": ["3", 3, None, [1.5], [-1], [True], [[3]], DELETE],
    "str list": ["momentum", 7, None, [1], [["momentum"]], DELETE],
    "slots": ["a", 7, None, {"a": 1}, [1], [[]], DELETE],
}  # fmt: skip

#: The type of every field the manifest of ``Malformed.saved`` holds, by entry kind.
FIELDS: dict[str, dict[str, str]] = {
    "variable": {
        "path": "path",
        "kind": "str",
        "array": "str",
        "dtype": "str",
        "shape": "shape",
        "synchronization": "str",
        "aggregation": "str",
    },
    "optimizer": {
        "path": "path",
        "kind": "str",
        "class": "str",
        "slot_names": "str list",
        "array": "str",
        "slots": "slots",
    },
    "slot": {"variable": "path", "slot": "str", "array": "str", "dtype": "str", "shape": "shape"},
    "number": {"path": "path", "kind": "str", "type": "str", "array": "str"},
}


def _probes() -> list[Any]:
    """One manifest change per field of every kind of entry and per wrong value."""
    probes = []
    for kind, fields in FIELDS.items():
        for field, field_type in fields.items():
            for k, value in enumerate(WRONG[field_type]):
                shown = "deleted" if value is DELETE else f"bad{k}"
                probes.append(pytest.param(kind, field, value, id=f"{kind}-{field}-{shown}"))
    return probes


class TestMalformedManifest:
    async def saved(self, tmp_path: Path) -> tuple[Checkpoint, dict[str, Any], list[Any]]:
        w = Variable(np.zeros((2, 3)), name="w")
        opt = SGD(0.1, momentum=0.9)
        opt.build([w])
        ckpt = Checkpoint(model={"w": w}, opt=opt, epoch=3)
        await ckpt.save(tmp_path / "good.npz")
        with np.load(tmp_path / "good.npz", allow_pickle=False) as npz:
            document = json.loads(bytes(npz["manifest.json"]))
        await w.assign(np.ones((2, 3)))
        ckpt.epoch = 4
        return ckpt, document, [w.numpy().tolist(), opt.iterations, ckpt.epoch]

    async def refused(
        self, tmp_path: Path, ckpt: Checkpoint, document: Any, before: list[Any]
    ) -> tuple[str, ...]:
        bad = str(tmp_path / "bad.npz")
        _rewrite(str(tmp_path / "good.npz"), bad, document)
        with pytest.raises(CheckpointError) as caught:
            await ckpt.restore(bad)
        w, opt = ckpt.model["w"], ckpt.opt
        assert [w.numpy().tolist(), opt.iterations, ckpt.epoch] == before
        return caught.value.problems

    @pytest.mark.parametrize(("kind", "field", "value"), _probes())
    async def test_every_field_of_the_wrong_type_is_named(
        self, tmp_path: Path, kind: str, field: str, value: Any
    ) -> None:
        """A field of the wrong type or missing: a CheckpointError naming the entry and field."""
        ckpt, document, before = await self.saved(tmp_path)
        entries = document["entries"]
        assert [e["kind"] for e in entries] == ["number", "variable", "optimizer"]
        index = {"number": 0, "variable": 1, "optimizer": 2, "slot": 2}[kind]
        target = entries[index] if kind != "slot" else entries[index]["slots"][0]
        if value is DELETE:
            del target[field]
        else:
            target[field] = copy.deepcopy(value)

        problems = await self.refused(tmp_path, ckpt, document, before)

        assert len(problems) == 1, problems
        where = f"manifest entry {index}"
        if kind == "slot" or field != "path":
            where += f" ({'/'.join(map(str, entries[index]['path']))})"
        if kind == "slot":
            where += ", slot 0"
        assert problems[0].startswith(f"{where}: "), problems[0]
        assert f"'{field}'" in problems[0], problems[0]
        assert problems[0].endswith("; the file is corrupted or not an aioreplica checkpoint")

    async def test_list_in_a_path(self, tmp_path: Path) -> None:
        """A path holding a list is refused with a message naming the entry and the value."""
        ckpt, document, before = await self.saved(tmp_path)
        document["entries"][1]["path"] = ["model", ["w"]]
        assert await self.refused(tmp_path, ckpt, document, before) == (
            "manifest entry 1: 'path' must be a non-empty list of strings and ints, got "
            "['model', ['w']]; the file is corrupted or not an aioreplica checkpoint",
        )

    async def test_every_malformed_entry_listed(self, tmp_path: Path) -> None:
        """Several malformed entries are all listed, in one error."""
        ckpt, document, before = await self.saved(tmp_path)
        document["entries"][0]["array"] = 0
        del document["entries"][2]["slots"][0]["shape"]
        problems = await self.refused(tmp_path, ckpt, document, before)
        assert problems == (
            "manifest entry 0 (epoch): 'array' must be a string, got 0; the file is corrupted "
            "or not an aioreplica checkpoint",
            "manifest entry 2 (opt), slot 0: 'shape' must be a list of ints >= 0, it is "
            "missing; the file is corrupted or not an aioreplica checkpoint",
        )

    @pytest.mark.parametrize(
        ("value", "problem"),
        [
            ({"a": 1}, "the manifest's 'entries' must be a list, got {'a': 1}"),
            ([1], "manifest entry 0 must be an object, got 1"),
        ],
    )
    async def test_entries_of_the_wrong_type(
        self, tmp_path: Path, value: Any, problem: str
    ) -> None:
        """Entries that are not a list of objects are refused, named."""
        ckpt, document, before = await self.saved(tmp_path)
        document["entries"] = value
        assert await self.refused(tmp_path, ckpt, document, before) == (
            f"{problem}; the file is corrupted or not an aioreplica checkpoint",
        )

    @pytest.mark.parametrize("version", [True, "1", 1.0, None])
    async def test_version_of_the_wrong_type(self, tmp_path: Path, version: Any) -> None:
        """Only the int 1 is format version 1 (not True, "1" or 1.0)."""
        ckpt, document, before = await self.saved(tmp_path)
        document["version"] = version
        assert await self.refused(tmp_path, ckpt, document, before) == (
            f"the manifest cannot be read (ValueError: format version {version!r}; this "
            "aioreplica reads versions 1 to 2); the file is truncated, corrupted or not an "
            "aioreplica checkpoint",
        )

    async def test_path_given_twice(self, tmp_path: Path) -> None:
        """Two entries for one object: neither is silently chosen."""
        ckpt, document, before = await self.saved(tmp_path)
        document["entries"].append(copy.deepcopy(document["entries"][0]))
        assert await self.refused(tmp_path, ckpt, document, before) == (
            "manifest entry 3 (epoch): the same path as entry 0; the file is corrupted or not "
            "an aioreplica checkpoint",
        )

    async def test_slot_given_twice(self, tmp_path: Path) -> None:
        """Two values for one slot of one variable: neither is silently chosen."""
        ckpt, document, before = await self.saved(tmp_path)
        slots = document["entries"][2]["slots"]
        slots.append(copy.deepcopy(slots[0]))
        assert await self.refused(tmp_path, ckpt, document, before) == (
            "manifest entry 2 (opt), slot 1: slot 'momentum' of model/w again (as slot 0); "
            "the file is corrupted or not an aioreplica checkpoint",
        )
