"""Checkpoints: round trips, the file format, atomic saves, checked restores and the manager."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import os
import re
import socket
import sys
import threading
import zipfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
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
    MirroredVariable,
    PerReplica,
    SyncOnReadVariable,
    Variable,
)
from aioreplica.optimizers import SGD, Adam, Optimizer
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

pytestmark = pytest.mark.anyio

#: The directory that holds the ``aioreplica`` package, for subprocesses' ``PYTHONPATH``.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(aioreplica.__file__)))

#: The end of every message about a file that cannot be read.
UNREADABLE = "; the file is truncated, corrupted or not an aioreplica checkpoint"

#: The end of every message about a manifest whose fields are malformed.
MALFORMED = "; the file is corrupted or not an aioreplica checkpoint"


def copies(variable: Variable) -> list[Any]:
    """Every copy of ``variable``, as nested lists (exact values, comparable with ``==``)."""
    return [np.asarray(copy).tolist() for copy in variable.values]


def state(*objects: Variable | Optimizer, of: tuple[Variable, ...] = ()) -> list[Any]:
    """Every copy of every variable, and the step count and slot copies of every optimizer.

    Slots are read for the variables in ``of``; a variable without slots reads as ``None``.
    """
    result: list[Any] = []
    for obj in objects:
        if isinstance(obj, Variable):
            result.append(copies(obj))
            continue
        slots: list[Any] = []
        for variable in of:
            for name in obj.slot_names:
                try:
                    slots.append(copies(obj.get_slot(variable, name)))
                except ValueError:
                    slots.append(None)
        result.append((obj.iterations, len(obj.variables()), slots))
    return result


def open_files(path: str | os.PathLike[str]) -> list[io.BufferedReader]:
    """The file objects still open on ``path`` (alive or awaiting collection)."""
    name = os.fspath(path)
    return [
        obj
        for obj in gc.get_objects()
        if isinstance(obj, io.BufferedReader) and obj.name == name and not obj.closed
    ]


def manifest(path: str | os.PathLike[str]) -> Any:
    """The parsed ``manifest.json`` member of a checkpoint file."""
    with np.load(path, allow_pickle=False) as npz:
        return json.loads(bytes(npz["manifest.json"]))


def saved(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every value in a checkpoint file by object path, as nested lists.

    Optimizer slots are keyed ``<optimizer path>/<variable path>/<slot name>``.
    """
    values: dict[str, Any] = {}
    with np.load(path, allow_pickle=False) as npz:
        for entry in json.loads(bytes(npz["manifest.json"]))["entries"]:
            where = "/".join(map(str, entry["path"]))
            values[where] = npz[entry["array"]].tolist()
            for slot in entry.get("slots", []):
                variable = "/".join(map(str, slot["variable"]))
                values[f"{where}/{variable}/{slot['slot']}"] = npz[slot["array"]].tolist()
    return values


def member_of(path: str | os.PathLike[str], object_path: list[Any]) -> str:
    """The ``.npy`` member (without suffix) holding the object at ``object_path``."""
    for entry in manifest(path)["entries"]:
        if entry["path"] == object_path:
            member: str = entry["array"]
            return member
    raise AssertionError(f"{object_path} is not in {path}")


def rewrite(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    replace: dict[str, bytes | None],
) -> None:
    """Copy a checkpoint's ZIP members, replacing some (``None``: leave the member out)."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            if info.filename not in replace:
                new.writestr(info.filename, old.read(info.filename))
            elif (data := replace[info.filename]) is not None:
                new.writestr(info.filename, data)


UNPICKLED: list[str] = []


def _record_unpickling(what: str) -> str:
    UNPICKLED.append(what)
    return what


class Tracer:
    """An object that records it if it is ever unpickled."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _record_unpickling, ("unpickled",)


@dataclass
class Model:
    """Two variables trained by one optimizer, in a strategy or (``strategy=None``) without."""

    strategy: MirroredStrategy | None
    w: Variable
    b: Variable
    opt: Optimizer

    @property
    def variables(self) -> tuple[Variable, Variable]:
        return (self.w, self.b)

    def state(self) -> list[Any]:
        return state(self.w, self.b, self.opt, of=self.variables)


def build(
    replicas: int | None,
    opt: Optimizer,
    *,
    offset: float = 0.0,
    w_shape: tuple[int, ...] = (2, 3),
    dtype: Any = np.float64,
) -> Model:
    """A model: ``w`` of ``w_shape``, ``b`` of shape ``(3,)``, values shifted by ``offset``."""
    strategy = MirroredStrategy(host_devices(replicas)) if replicas is not None else None
    scope: contextlib.AbstractContextManager[object] = (
        strategy.scope() if strategy is not None else contextlib.nullcontext()
    )
    with scope:
        size = int(np.prod(w_shape))
        w = Variable(
            (np.arange(size, dtype=np.float64).reshape(w_shape) / 4 + offset).astype(dtype),
            name="w",
        )
        b = Variable((np.array([1.0, -2.0, 0.5]) + offset).astype(dtype), name="b")
    return Model(strategy, w, b, opt)


async def train(model: Model, steps: int) -> None:
    """``steps`` optimizer steps; gradients depend on the weights and the replica."""

    async def step() -> None:
        context = aioreplica.get_replica_context()
        assert context is not None
        replica = context.replica_id_in_sync_group
        await model.opt.apply_gradients(
            [
                (np.asarray(model.w) * 0.5 + replica + 1.0, model.w),
                (np.asarray(model.b) - replica, model.b),
            ]
        )

    for _ in range(steps):
        if model.strategy is None:
            await step()
        else:
            await model.strategy.run(step)


async def set_copies(strategy: MirroredStrategy, variable: Variable, values: list[Any]) -> None:
    """Give each copy of a sync-on-read variable its own value (written in replica context)."""

    async def step(value: Any) -> None:
        await variable.assign(value)

    await strategy.run(step, args=(PerReplica(values),))


@dataclass
class Saved:
    """A trained 2-replica model saved to ``path``, then changed (one more step, new numbers)."""

    model: Model
    history: list[float]
    ckpt: Checkpoint
    path: Path

    def state(self) -> list[Any]:
        return [*self.model.state(), self.ckpt.epoch, list(self.history)]


async def saved_then_changed(tmp_path: Path) -> Saved:
    model = build(2, SGD(0.1, momentum=0.9))
    await train(model, 2)
    history = [0.5]
    ckpt = Checkpoint(
        model={"w": model.w, "b": model.b}, optimizer=model.opt, epoch=3, history=history
    )
    path = tmp_path / "ckpt.npz"
    await ckpt.save(path)
    await train(model, 1)
    ckpt.epoch = 9
    history[0] = 2.0
    return Saved(model, history, ckpt, path)


class TestRoundTrip:
    async def test_restore_brings_everything_back(self, tmp_path: Path) -> None:
        """Every copy, every slot, the step count and the numbers come back as saved."""
        model = build(2, SGD(0.1, momentum=0.9))
        await train(model, 2)
        history = [0.5]
        ckpt = Checkpoint(
            model={"w": model.w, "b": model.b}, optimizer=model.opt, epoch=3, history=history
        )
        before = model.state()
        assert await ckpt.save(tmp_path / "ckpt.npz") == str(tmp_path / "ckpt.npz")
        await model.w.assign(np.full((2, 3), 7.0))
        await train(model, 3)
        ckpt.epoch = 9
        history[0] = 2.0
        assert model.state() != before

        await ckpt.restore(tmp_path / "ckpt.npz")

        assert model.state() == before
        assert model.opt.iterations == 2
        assert ckpt.epoch == 3
        assert type(ckpt.epoch) is int
        assert history == [0.5]
        assert type(history[0]) is float
        assert ckpt.history is history

    async def test_numbers_in_dicts_and_lists_restored_in_place(self, tmp_path: Path) -> None:
        """Numbers nested in dicts and lists are written back into those containers."""
        counters: dict[str, Any] = {"step": 5, "losses": [1.5, 2.5], "best": {"loss": 0.25}}
        ckpt = Checkpoint(counters=counters, rate=0.125)
        await ckpt.save(tmp_path / "n.npz")
        counters["step"] = 6
        counters["losses"][1] = 9.0
        counters["best"]["loss"] = 0.5
        ckpt.rate = 1.0

        await ckpt.restore(tmp_path / "n.npz")

        assert counters == {"step": 5, "losses": [1.5, 2.5], "best": {"loss": 0.25}}
        assert ckpt.counters is counters
        assert [type(counters["step"]), type(counters["losses"][0])] == [int, float]
        assert ckpt.rate == 0.125
        assert type(ckpt.rate) is float

    async def test_numpy_numbers_are_numbers(self, tmp_path: Path) -> None:
        """NumPy's integer and floating scalars are saved as the numbers they are and restored
        as Python ints and floats, in place; a file that named a float64 by its type (before
        NumPy's scalars were numbers) restores into a float."""
        counters: dict[str, Any] = {"step": np.int64(5), "loss": np.float32(0.25)}
        ckpt = Checkpoint(counters=counters, epoch=np.uint8(3), rate=np.float64(0.5))
        path = await ckpt.save(tmp_path / "n.npz")
        entries = [(entry["path"], entry["type"]) for entry in manifest(path)["entries"]]
        assert entries == [
            (["counters", "loss"], "float"),
            (["counters", "step"], "int"),
            (["epoch"], "int"),
            (["rate"], "float"),
        ]
        counters.update(step=np.int64(6), loss=np.float32(9.0))
        ckpt.epoch, ckpt.rate = np.uint8(4), 1.0

        await ckpt.restore(path)

        restored = [counters["step"], counters["loss"], ckpt.epoch, ckpt.rate]
        assert [(type(n), n) for n in restored] == [(int, 5), (float, 0.25), (int, 3), (float, 0.5)]
        old = json.loads(json.dumps(manifest(path)).replace('"float"', '"float64"'))
        rewrite(path, tmp_path / "old.npz", {"manifest.json": json.dumps(old).encode()})
        ckpt.rate = np.float64(2.0)
        await ckpt.restore(tmp_path / "old.npz")
        assert (type(ckpt.rate), ckpt.rate) == (float, 0.5)

    async def test_largest_step_count_round_trips(self, tmp_path: Path) -> None:
        """The largest step count ``iterations`` takes, 2**63 - 1, saves and restores."""
        opt = SGD(0.1)
        opt.iterations = 2**63 - 1
        path = await Checkpoint(opt=opt).save(tmp_path / "c.npz")
        fresh = SGD(0.1)
        await Checkpoint(opt=fresh).restore(path)
        assert (type(fresh.iterations), fresh.iterations) == (int, 2**63 - 1)

    async def test_save_returns_path_as_string(self, tmp_path: Path) -> None:
        """``save`` returns the path it wrote, as a string, for str and PathLike arguments."""
        ckpt = Checkpoint(step=1)
        assert await ckpt.save(tmp_path / "a.npz") == os.path.join(tmp_path, "a.npz")
        assert await ckpt.save(str(tmp_path / "b.npz")) == os.path.join(tmp_path, "b.npz")
        assert sorted(os.listdir(tmp_path)) == ["a.npz", "b.npz"]

    async def test_bytes_paths(self, tmp_path: Path) -> None:
        """A path in bytes (as ``os.fsencode`` makes) saves and restores like a str."""
        ckpt = Checkpoint(step=1)
        where = os.fsencode(tmp_path / "c.npz")
        assert await ckpt.save(where) == str(tmp_path / "c.npz")  # type: ignore[arg-type]
        ckpt.step = 2
        await ckpt.restore(where)  # type: ignore[arg-type]
        assert ckpt.step == 1

    async def test_what_is_no_path_is_refused(self, tmp_path: Path) -> None:
        ckpt = Checkpoint(step=1)
        no_path: Any = 5
        with pytest.raises(
            TypeError,
            match=r"^Checkpoint\.save needs a file path \(a str or os\.PathLike\), got int 5$",
        ):
            await ckpt.save(no_path)
        with pytest.raises(TypeError, match=r"^Checkpoint\.restore needs a file path .*got int 5$"):
            await ckpt.restore(no_path)
        with pytest.raises(TypeError, match=r"^CheckpointManager needs a file path .*got int 5$"):
            CheckpointManager(ckpt, no_path)
        assert os.listdir(tmp_path) == []

    def test_attributes(self) -> None:
        """Objects read back as attributes; an unknown name is refused."""
        ckpt = Checkpoint(epoch=1)
        ckpt.step = 2
        assert (ckpt.epoch, ckpt.step) == (1, 2)
        assert repr(ckpt) == "Checkpoint(epoch, step)"
        with pytest.raises(AttributeError, match="this Checkpoint holds no object named 'loss'"):
            _ = ckpt.loss


class TestFileFormat:
    async def test_valid_npz_with_manifest(self, tmp_path: Path) -> None:
        """The file is an ``.npz`` with one member per array and the documented manifest."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros((2, 3), np.float32), name="w", synchronization="on_write")
            m = Variable(np.zeros(4, np.int64), synchronization="on_read", aggregation="sum")
        assert (type(w), type(m)) == (MirroredVariable, SyncOnReadVariable)
        opt = SGD(0.1, momentum=0.5)
        opt.build([w])
        ckpt = Checkpoint(model={"w": w}, metrics=[m], optimizer=opt, epoch=3)
        path = await ckpt.save(tmp_path / "ckpt.npz")

        with np.load(path, allow_pickle=False) as npz:
            assert npz.files == ["manifest.json", "a0", "a1", "a2", "a3", "a4", "a5"]
            assert npz["a0"].tolist() == 3
            assert npz["a0"].shape == ()
        assert manifest(path) == {
            "format": "aioreplica.checkpoint",
            "version": 1,
            "entries": [
                {"path": ["epoch"], "kind": "number", "type": "int", "array": "a0"},
                {
                    "path": ["metrics", 0],
                    "kind": "variable",
                    "array": "a1",
                    "dtype": "<i8",
                    "shape": [4],
                    "synchronization": "on_read",
                    "aggregation": "sum",
                },
                {
                    "path": ["model", "w"],
                    "kind": "variable",
                    "array": "a2",
                    "dtype": "<f4",
                    "shape": [2, 3],
                    "synchronization": "on_write",
                    "aggregation": "none",
                },
                {
                    "path": ["optimizer"],
                    "kind": "optimizer",
                    "class": "SGD",
                    "slot_names": ["momentum"],
                    "array": "a4",
                    "learning_rate": "a5",
                    "slots": [
                        {
                            "variable": ["model", "w"],
                            "slot": "momentum",
                            "array": "a3",
                            "dtype": "<f4",
                            "shape": [2, 3],
                        }
                    ],
                },
            ],
        }

    async def test_members_are_plain_arrays(self, tmp_path: Path) -> None:
        """Each member loads without pickle, with the manifest's dtype and shape."""
        saved_model = await saved_then_changed(tmp_path)
        with np.load(saved_model.path, allow_pickle=False) as npz:
            for entry in manifest(saved_model.path)["entries"]:
                for item in [entry, *entry.get("slots", [])]:
                    array = npz[item["array"]]
                    assert array.dtype != object
                    if "dtype" in item:
                        assert (array.dtype.str, list(array.shape)) == (
                            item["dtype"],
                            item["shape"],
                        )


class TestSavedValues:
    async def test_mirrored_saves_primary_copy(self, tmp_path: Path) -> None:
        """A mirrored variable's file value is its primary copy."""
        model = build(4, SGD(0.1))
        await train(model, 1)
        await Checkpoint(w=model.w).save(tmp_path / "c.npz")
        assert saved(tmp_path / "c.npz") == {"w": copies(model.w)[0]}

    async def test_sum_float_saves_aggregate_and_restores_share(self, tmp_path: Path) -> None:
        """SUM saves the sum of the copies; restoring gives each copy the sum / n."""
        strategy = MirroredStrategy(host_devices(4))
        with strategy.scope():
            v = Variable(np.zeros(2), synchronization="on_read", aggregation="sum")
        await set_copies(strategy, v, [np.array([1.0, 10.0]) * (i + 1) for i in range(4)])
        ckpt = Checkpoint(v=v)
        await ckpt.save(tmp_path / "c.npz")
        assert saved(tmp_path / "c.npz") == {"v": [10.0, 100.0]}
        await set_copies(strategy, v, [np.zeros(2)] * 4)

        await ckpt.restore(tmp_path / "c.npz")

        assert copies(v) == [[2.5, 25.0]] * 4
        assert v.numpy().tolist() == [10.0, 100.0]

    async def test_sum_float_into_other_replica_count(self, tmp_path: Path) -> None:
        """A SUM variable restored into 3 replicas gets the saved sum / 3 in each copy."""
        strategy = MirroredStrategy(host_devices(4))
        with strategy.scope():
            v = Variable(np.zeros(2), synchronization="on_read", aggregation="sum")
        await set_copies(strategy, v, [np.array([1.0, 10.0]) * (i + 1) for i in range(4)])
        await Checkpoint(v=v).save(tmp_path / "c.npz")
        with MirroredStrategy(host_devices(3)).scope():
            target = Variable(np.zeros(2), synchronization="on_read", aggregation="sum")

        await Checkpoint(v=target).restore(tmp_path / "c.npz")

        assert copies(target) == [(np.array([10.0, 100.0]) / 3).tolist()] * 3

    @pytest.mark.parametrize(
        ("replicas", "expected"),
        [
            (4, [[5, 0], [2, -1], [2, -1], [2, -1]]),
            (3, [[5, -1], [3, -1], [3, -1]]),
            (1, [[11, -3]]),
        ],
    )
    async def test_sum_int_exact_remainder_on_first_copy(
        self, tmp_path: Path, replicas: int, expected: list[list[int]]
    ) -> None:
        """An int SUM variable restores the quotient per copy, the remainder on copy 0."""
        strategy = MirroredStrategy(host_devices(4))
        with strategy.scope():
            v = Variable(np.zeros(2, np.int64), synchronization="on_read", aggregation="sum")
        await set_copies(strategy, v, [[1, -3], [2, 0], [3, 0], [5, 0]])
        await Checkpoint(v=v).save(tmp_path / "c.npz")
        assert saved(tmp_path / "c.npz") == {"v": [11, -3]}
        with MirroredStrategy(host_devices(replicas)).scope():
            target = Variable(np.zeros(2, np.int64), synchronization="on_read", aggregation="sum")

        await Checkpoint(v=target).restore(tmp_path / "c.npz")

        assert copies(target) == expected
        assert np.sum(np.asarray(target.values), axis=0).tolist() == [11, -3]
        assert {np.asarray(copy).dtype for copy in target.values} == {np.dtype(np.int64)}

    async def test_mean_restores_value_into_every_copy(self, tmp_path: Path) -> None:
        """MEAN saves the mean of the copies and restores it into every copy."""
        strategy = MirroredStrategy(host_devices(4))
        with strategy.scope():
            v = Variable(np.zeros(2), synchronization="on_read", aggregation="mean")
        await set_copies(strategy, v, [np.array([1.0, -2.0]) * (i + 1) for i in range(4)])
        ckpt = Checkpoint(v=v)
        await ckpt.save(tmp_path / "c.npz")
        assert saved(tmp_path / "c.npz") == {"v": [2.5, -5.0]}
        await set_copies(strategy, v, [np.zeros(2)] * 4)

        await ckpt.restore(tmp_path / "c.npz")

        assert copies(v) == [[2.5, -5.0]] * 4

    async def test_only_first_replica_restores_value_into_every_copy(self, tmp_path: Path) -> None:
        """ONLY_FIRST_REPLICA saves copy 0 and restores it into every copy."""
        strategy = MirroredStrategy(host_devices(4))
        with strategy.scope():
            v = Variable(
                np.zeros(2, np.int32), synchronization="on_read", aggregation="only_first_replica"
            )
        await set_copies(strategy, v, [[7 + i, -i] for i in range(4)])
        ckpt = Checkpoint(v=v)
        await ckpt.save(tmp_path / "c.npz")
        assert saved(tmp_path / "c.npz") == {"v": [7, 0]}
        await set_copies(strategy, v, [[1, 1]] * 4)

        await ckpt.restore(tmp_path / "c.npz")

        assert copies(v) == [[7, 0]] * 4


class TestRestoreElsewhere:
    @pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
    @pytest.mark.parametrize("replicas", [1, 2, 8, None], ids=["1", "2", "8", "no-strategy"])
    async def test_saved_with_4_restored_anywhere(
        self, tmp_path: Path, replicas: int | None, stepped: bool
    ) -> None:
        """Every copy of every variable and slot equals the file's value, in any replica count."""
        source = build(4, Adam(0.1))
        await train(source, 2)
        path = tmp_path / "four.npz"
        await Checkpoint(model={"w": source.w, "b": source.b}, optimizer=source.opt).save(path)
        values = saved(path)
        target = build(replicas, Adam(0.1), offset=100.0)
        if stepped:
            await train(target, 3)
        else:
            with pytest.raises(ValueError, match="Adam has no slots for variable 'w' yet"):
                target.opt.get_slot(target.w, "m")
        count = 1 if replicas is None else replicas

        await Checkpoint(model={"w": target.w, "b": target.b}, optimizer=target.opt).restore(path)

        assert copies(target.w) == [values["model/w"]] * count
        assert copies(target.b) == [values["model/b"]] * count
        assert target.opt.iterations == 2 == values["optimizer"]
        for name in ("w", "b"):
            variable = getattr(target, name)
            for slot_name in ("m", "v"):
                slot = target.opt.get_slot(variable, slot_name)
                assert copies(slot) == [values[f"optimizer/model/{name}/{slot_name}"]] * count
                assert slot.devices == variable.devices
                if replicas is not None:
                    assert isinstance(slot, MirroredVariable)
        assert len(target.opt.variables()) == 4

    async def test_training_continues_identically(self, tmp_path: Path) -> None:
        """Save after 3 steps, restore into a fresh model, 2 more steps == 5 steps straight."""
        straight = build(2, SGD(0.05, momentum=0.9))
        await train(straight, 5)

        first = build(2, SGD(0.05, momentum=0.9))
        await train(first, 3)
        path = tmp_path / "mid.npz"
        await Checkpoint(model={"w": first.w, "b": first.b}, optimizer=first.opt).save(path)
        resumed = build(2, SGD(0.05, momentum=0.9), offset=-3.0)
        await Checkpoint(model={"w": resumed.w, "b": resumed.b}, optimizer=resumed.opt).restore(
            path
        )
        await train(resumed, 2)

        assert resumed.opt.iterations == 5
        assert resumed.state() == straight.state()


class TestAtomicSave:
    async def test_failed_write_keeps_old_file(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A write that fails midway raises, leaves the old file byte for byte, and no temp."""
        saved_model = await saved_then_changed(tmp_path)
        old = saved_model.path.read_bytes()
        real = np.lib.format.write_array
        calls: list[int] = []

        def failing(*args: Any, **kwargs: Any) -> None:
            calls.append(1)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
            real(*args, **kwargs)

        monkeypatch.setattr(np.lib.format, "write_array", failing)
        with pytest.raises(OSError, match="No space left on device"):
            await saved_model.ckpt.save(saved_model.path)

        assert len(calls) == 2
        assert saved_model.path.read_bytes() == old
        assert os.listdir(tmp_path) == ["ckpt.npz"]

    async def test_crash_mid_save_keeps_old_checkpoint(self, tmp_path: Path) -> None:
        """A process killed while saving over a checkpoint leaves the old one restorable."""
        script = """if True:
            import hashlib, os, sys
            import anyio, numpy as np
            import aioreplica
            path = sys.argv[1]
            w = aioreplica.Variable(np.arange(4.0), name="w")
            ckpt = aioreplica.Checkpoint(model={"w": w}, epoch=1)
            anyio.run(ckpt.save, path)
            with open(path, "rb") as file:
                print(hashlib.sha256(file.read()).hexdigest(), flush=True)
            anyio.run(w.assign, -1.0)
            ckpt.epoch = 2
            real = np.lib.format.write_array
            calls = []
            def crash(*args, **kwargs):
                calls.append(1)
                if len(calls) == 2:
                    os._exit(1)
                real(*args, **kwargs)
            np.lib.format.write_array = crash
            anyio.run(ckpt.save, path)
            print("not reached", flush=True)
        """
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
        path = tmp_path / "ckpt.npz"
        result = await anyio.run_process(
            [sys.executable, "-c", script, str(path)], check=False, env=env
        )

        assert (result.returncode, result.stderr) == (1, b"")
        first_hash = result.stdout.decode().split()
        assert first_hash == [hashlib.sha256(path.read_bytes()).hexdigest()]
        leftovers = sorted(set(os.listdir(tmp_path)) - {"ckpt.npz"})
        assert "ckpt.npz" in os.listdir(tmp_path)
        assert len(leftovers) <= 1
        assert all(re.fullmatch(r"\.ckpt\.npz\..+\.tmp", name) for name in leftovers)
        w = Variable(np.zeros(4), name="w")
        ckpt = Checkpoint(model={"w": w}, epoch=0)
        await ckpt.restore(path)
        assert (w.numpy().tolist(), ckpt.epoch) == ([0.0, 1.0, 2.0, 3.0], 1)

    async def test_save_into_missing_directory_names_the_target(self, tmp_path: Path) -> None:
        """Saving into a folder that does not exist names the file asked for and the folder."""
        target = tmp_path / "nowhere" / "c.npz"
        with pytest.raises(FileNotFoundError) as caught:
            await Checkpoint(step=1).save(target)
        assert str(caught.value) == (
            f"[Errno 2] cannot save checkpoint {str(target)!r}: its folder "
            f"{str(tmp_path / 'nowhere')!r} does not exist; create it first (os.makedirs), or "
            "save through a CheckpointManager, which creates its directory"
        )
        assert os.listdir(tmp_path) == []

    async def test_long_file_name(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A file name of 244 characters saves: its temporary's name, which adds the host, pid
        and more, used to pass the 255-byte limit (ENAMETOOLONG). It is cut short, ending in
        ``~`` and keeping the writer's host and pid whole."""
        name = "c" * 240 + ".npz"
        path = tmp_path / name
        ckpt = Checkpoint(w=Variable(np.arange(3.0), name="w"), epoch=4)
        resume = threading.Event()
        writing = hold_writes(monkeypatch, resume)
        temporaries: list[str] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(ckpt.save, path)
            assert await anyio.to_thread.run_sync(writing.wait, 10)
            temporaries = os.listdir(tmp_path)
            resume.set()

        [temporary] = temporaries
        assert len(os.fsencode(temporary)) <= 255
        host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())
        match = re.fullmatch(
            rf"\.(c+)~\.{re.escape(host)}\.{os.getpid()}\.[0-9a-f]{{8}}\.tmp", temporary
        )
        assert match is not None, temporary
        assert os.listdir(tmp_path) == [name]
        assert saved(path) == {"w": [0.0, 1.0, 2.0], "epoch": 4}
        ckpt.epoch = 0
        await ckpt.restore(path)
        assert ckpt.epoch == 4


class TestRefusedRestore:
    async def refusal(self, saved_model: Saved, path: Path) -> tuple[str, ...]:
        """The problems of a refused restore, checked to change nothing and to close the file.

        A file object left open would only be noticed when collected, as a ``ResourceWarning``
        in whatever test runs then; open ones are looked for (and closed) here instead.
        """
        before = saved_model.state()
        problems = await self._problems(saved_model, path)
        assert saved_model.state() == before
        left_open = open_files(path)
        for file in left_open:
            file.close()
        assert [file.name for file in left_open] == []
        return problems

    async def _problems(self, saved_model: Saved, path: Path) -> tuple[str, ...]:
        with pytest.raises(CheckpointError, match=r"^cannot restore checkpoint ") as caught:
            await saved_model.ckpt.restore(path)
        assert isinstance(caught.value, ValueError)
        assert caught.value.path == str(path)
        return caught.value.problems

    async def expect_refused(self, saved_model: Saved, path: Path, problems: list[str]) -> None:
        assert list(await self.refusal(saved_model, path)) == problems

    async def expect_unreadable(self, saved_model: Saved, path: Path, pattern: str) -> None:
        problems = await self.refusal(saved_model, path)
        assert len(problems) == 1
        assert re.fullmatch(pattern + re.escape(UNREADABLE), problems[0]), problems[0]

    @pytest.mark.parametrize("keep", ["10 bytes", "half", "all but 1 byte", "empty"])
    async def test_truncated_file(self, tmp_path: Path, keep: str) -> None:
        """A file cut short is refused before anything changes."""
        saved_model = await saved_then_changed(tmp_path)
        data = saved_model.path.read_bytes()
        size = {"10 bytes": 10, "half": len(data) // 2, "all but 1 byte": len(data) - 1}
        cut = tmp_path / "cut.npz"
        cut.write_bytes(data[: size.get(keep, 0)])
        await self.expect_unreadable(
            saved_model, cut, r"the manifest cannot be read \((BadZipFile|EOFError): .*\)"
        )

    async def test_flipped_byte_fails_crc(self, tmp_path: Path) -> None:
        """One byte changed inside an array's data is caught by the ZIP checksum."""
        saved_model = await saved_then_changed(tmp_path)
        member = member_of(saved_model.path, ["model", "w"])
        data = bytearray(saved_model.path.read_bytes())
        raw = np.asarray(saved(saved_model.path)["model/w"]).tobytes()
        start = data.find(raw)
        assert start > 0
        assert data.find(raw, start + 1) == -1
        data[start + len(raw) // 2] ^= 0xFF
        bad = tmp_path / "bad.npz"
        bad.write_bytes(bytes(data))
        await self.expect_refused(
            saved_model,
            bad,
            [
                f"array {member!r} cannot be read (BadZipFile: Bad CRC-32 for file "
                f"'{member}.npy')" + UNREADABLE
            ],
        )

    async def test_object_array_refused_without_unpickling(self, tmp_path: Path) -> None:
        """A member holding Python objects is refused; nothing in it is ever unpickled."""
        saved_model = await saved_then_changed(tmp_path)
        member = member_of(saved_model.path, ["model", "w"])
        buffer = io.BytesIO()
        np.save(buffer, np.array([{"a": 1}, Tracer()], dtype=object), allow_pickle=True)
        evil = tmp_path / "evil.npz"
        rewrite(saved_model.path, evil, {f"{member}.npy": buffer.getvalue()})
        UNPICKLED.clear()

        await self.expect_refused(
            saved_model,
            evil,
            [
                f"array {member!r} cannot be read (it holds Python objects, which checkpoints "
                "never load)" + UNREADABLE
            ],
        )
        assert UNPICKLED == []

    async def test_manifest_not_json(self, tmp_path: Path) -> None:
        """A manifest that is not JSON is refused."""
        saved_model = await saved_then_changed(tmp_path)
        bad = tmp_path / "bad.npz"
        rewrite(saved_model.path, bad, {"manifest.json": b"{not json"})
        await self.expect_unreadable(
            saved_model, bad, r"the manifest cannot be read \(JSONDecodeError: .*\)"
        )

    @pytest.mark.parametrize(
        ("document", "problems"),
        [
            (
                {"format": "other", "version": 1, "entries": []},
                [
                    "the manifest cannot be read (ValueError: no 'aioreplica.checkpoint' "
                    "manifest)" + UNREADABLE
                ],
            ),
            (
                {"format": "aioreplica.checkpoint", "version": 0, "entries": []},
                [
                    "the manifest cannot be read (ValueError: format version 0; this "
                    "aioreplica reads versions 1 to 2)" + UNREADABLE
                ],
            ),
            (
                {"format": "aioreplica.checkpoint", "version": 3, "entries": []},
                [
                    "format version 3, written by a newer aioreplica: this one reads versions "
                    "1 to 2; upgrade aioreplica (pip install --upgrade aioreplica) to restore it"
                ],
            ),
            (
                {"format": "aioreplica.checkpoint", "version": 1, "entries": [{"path": 1}]},
                [
                    "manifest entry 0: 'path' must be a non-empty list of strings and ints, "
                    "got 1" + MALFORMED,
                    "manifest entry 0: 'kind' must be one of 'variable', 'optimizer', "
                    "'number', 'iterator', it is missing" + MALFORMED,
                ],
            ),
        ],
        ids=["format", "version", "newer version", "entries"],
    )
    async def test_manifest_of_another_kind(
        self, tmp_path: Path, document: dict[str, Any], problems: list[str]
    ) -> None:
        """A JSON manifest of another format, version or shape is refused."""
        saved_model = await saved_then_changed(tmp_path)
        bad = tmp_path / "bad.npz"
        rewrite(saved_model.path, bad, {"manifest.json": json.dumps(document).encode()})
        await self.expect_refused(saved_model, bad, problems)

    @pytest.mark.parametrize(
        ("offset", "value", "error"),
        [
            (8, 0x41, "strong encryption (flag bit 6)"),
            (8, 0xFF, "compressed patched data (flag bit 5)"),
            (10, 0x41, "That compression method is not supported"),
            (6, 0x41, "zip file version 6.5"),
        ],
        ids=["encryption flag", "patched data flag", "compression method", "version"],
    )
    async def test_changed_byte_in_the_central_directory(
        self, tmp_path: Path, offset: int, value: int, error: str
    ) -> None:
        """One byte changed in the ZIP central directory (the manifest's entry, the first) is
        a CheckpointError caused by zipfile's error; it used to escape as NotImplementedError."""
        saved_model = await saved_then_changed(tmp_path)
        data = bytearray(saved_model.path.read_bytes())
        data[data.index(b"PK\x01\x02") + offset] = value
        bad = tmp_path / "bad.npz"
        bad.write_bytes(bytes(data))
        await self.expect_refused(
            saved_model,
            bad,
            [f"the manifest cannot be read (NotImplementedError: {error})" + UNREADABLE],
        )
        with pytest.raises(CheckpointError) as caught:
            await saved_model.ckpt.restore(bad)
        assert isinstance(caught.value.__cause__, NotImplementedError)

    async def test_deeply_nested_manifest(self, tmp_path: Path) -> None:
        """A manifest nested too deeply to parse is a CheckpointError (was RecursionError)."""
        # Earlier tests' garbage collected at the parser's depth would run its finalizers
        # there, with no stack left: they would fail as unraisable exceptions, not this test.
        gc.collect()
        saved_model = await saved_then_changed(tmp_path)
        bad = tmp_path / "bad.npz"
        rewrite(saved_model.path, bad, {"manifest.json": b"[" * 100_000 + b"]" * 100_000})
        await self.expect_unreadable(
            saved_model, bad, r"the manifest cannot be read \(RecursionError: .*\)"
        )
        with pytest.raises(CheckpointError) as caught:
            await saved_model.ckpt.restore(bad)
        assert isinstance(caught.value.__cause__, RecursionError)

    async def test_array_header_larger_than_its_member(self, tmp_path: Path) -> None:
        """An array whose ``.npy`` header claims shape (10**12,), 8 TB, is refused from its
        header and its member's size, before NumPy allocates it (that was a MemoryError)."""
        saved_model = await saved_then_changed(tmp_path)
        member = member_of(saved_model.path, ["model", "w"])
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            header, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)}
        )
        huge = tmp_path / "huge.npz"
        rewrite(saved_model.path, huge, {f"{member}.npy": header.getvalue() + bytes(48)})
        await self.expect_refused(
            saved_model,
            huge,
            [
                f"array {member!r} cannot be read (ValueError: its header claims shape "
                "(1000000000000,) of dtype float64, 8000000000000 bytes, but the member holds "
                "48)" + UNREADABLE
            ],
        )

    async def test_missing_manifest(self, tmp_path: Path) -> None:
        """A plain ``.npz`` without a manifest is refused."""
        saved_model = await saved_then_changed(tmp_path)
        plain = tmp_path / "plain.npz"
        np.savez(plain, w=np.zeros(3))
        await self.expect_refused(
            saved_model, plain, ["the manifest cannot be read (it is missing)" + UNREADABLE]
        )

    async def test_missing_member(self, tmp_path: Path) -> None:
        """A member the manifest names but the archive lacks is refused."""
        saved_model = await saved_then_changed(tmp_path)
        member = member_of(saved_model.path, ["model", "b"])
        bad = tmp_path / "bad.npz"
        rewrite(saved_model.path, bad, {f"{member}.npy": None})
        await self.expect_refused(
            saved_model, bad, [f"array {member!r} cannot be read (it is missing)" + UNREADABLE]
        )

    async def test_missing_file(self, tmp_path: Path) -> None:
        """A path with no file raises FileNotFoundError naming it."""
        with pytest.raises(FileNotFoundError, match=r"no checkpoint at '.*nothing\.npz'"):
            await Checkpoint(step=1).restore(tmp_path / "nothing.npz")

    async def test_other_shape(self, tmp_path: Path) -> None:
        """A variable of another shape is named, with its slot; nothing changes."""
        saved_model = await saved_then_changed(tmp_path)
        other = build(2, SGD(0.1, momentum=0.9), offset=50.0, w_shape=(3, 2))
        history = [7.5]
        ckpt = Checkpoint(
            model={"w": other.w, "b": other.b}, optimizer=other.opt, epoch=1, history=history
        )
        before = other.state()
        with pytest.raises(CheckpointError, match="model/w: dtype float64 and shape") as caught:
            await ckpt.restore(saved_model.path)
        assert caught.value.problems == (
            "model/w: dtype float64 and shape (2, 3) in the checkpoint, dtype float64 and shape "
            "(3, 2) here",
            "optimizer/slots/model/w/momentum: dtype float64 and shape (2, 3) in the "
            "checkpoint, dtype float64 and shape (3, 2) here",
        )
        assert other.state() == before
        assert other.opt.variables() == []
        assert (ckpt.epoch, history) == (1, [7.5])

    async def test_other_dtype(self, tmp_path: Path) -> None:
        """A variable of another dtype is named; nothing changes."""
        saved_model = await saved_then_changed(tmp_path)
        other = build(2, SGD(0.1, momentum=0.9), offset=50.0, dtype=np.float32)
        await train(other, 1)
        ckpt = Checkpoint(
            model={"w": other.w, "b": saved_model.model.b},
            optimizer=SGD(0.1, momentum=0.9),
            epoch=1,
            history=[7.5],
        )
        before = [*other.state(), *saved_model.state()]
        with pytest.raises(CheckpointError) as caught:
            await ckpt.restore(saved_model.path)
        assert caught.value.problems == (
            "model/w: dtype float64 and shape (2, 3) in the checkpoint, dtype float32 and shape "
            "(2, 3) here",
            "optimizer/slots/model/w/momentum: dtype float64 and shape (2, 3) in the "
            "checkpoint, dtype float32 and shape (2, 3) here",
        )
        assert [*other.state(), *saved_model.state()] == before
        assert ckpt.epoch == 1

    async def test_object_missing_from_file(self, tmp_path: Path) -> None:
        """An object the file does not hold is named; nothing changes."""
        saved_model = await saved_then_changed(tmp_path)
        saved_model.ckpt.step = 4
        await self.expect_refused(saved_model, saved_model.path, ["step: not in the checkpoint"])
        assert saved_model.ckpt.step == 4

    async def test_extra_object_in_file(self, tmp_path: Path) -> None:
        """An object in the file that the checkpoint lacks is named; nothing changes."""
        saved_model = await saved_then_changed(tmp_path)
        model = saved_model.model
        ckpt = Checkpoint(model={"w": model.w, "b": model.b}, optimizer=model.opt, epoch=9)
        before = [*model.state(), list(saved_model.history)]
        with pytest.raises(CheckpointError) as caught:
            await ckpt.restore(saved_model.path)
        assert caught.value.problems == ("history/0: in the checkpoint but not restored here",)
        assert [*model.state(), list(saved_model.history)] == before
        assert ckpt.epoch == 9

    async def test_every_mismatch_listed(self, tmp_path: Path) -> None:
        """Several mismatches are all listed, in one error."""
        saved_model = await saved_then_changed(tmp_path)
        model = saved_model.model
        ckpt = Checkpoint(model={"w": model.w}, optimizer=model.opt, epoch=9.0, step=1)
        before = model.state()
        with pytest.raises(CheckpointError) as caught:
            await ckpt.restore(saved_model.path)
        assert caught.value.problems == (
            "epoch: the checkpoint holds a number of type int there, this is of type float",
            "optimizer: slot 'momentum' of model/b: no such variable here",
            "optimizer: has slots for variable 'b', which is not in this checkpoint",
            "step: not in the checkpoint",
            "history/0: in the checkpoint but not restored here",
            "model/b: in the checkpoint but not restored here",
        )
        assert model.state() == before
        assert (ckpt.epoch, ckpt.step) == (9.0, 1)

    async def test_optimizer_of_another_class(self, tmp_path: Path) -> None:
        """An Adam is not restored from an SGD's state; it gets no slots."""
        saved_model = await saved_then_changed(tmp_path)
        model = saved_model.model
        adam = Adam(0.1)
        ckpt = Checkpoint(
            model={"w": model.w, "b": model.b}, optimizer=adam, epoch=9, history=[2.0]
        )
        before = model.state()
        with pytest.raises(CheckpointError) as caught:
            await ckpt.restore(saved_model.path)
        assert caught.value.problems == (
            "optimizer: the checkpoint holds a SGD optimizer with slots ['momentum'], this is "
            "a Adam with slots ['m', 'v']",
        )
        assert model.state() == before
        assert (adam.iterations, adam.variables()) == (0, [])

    async def test_sgd_without_momentum_differs_from_sgd_with(self, tmp_path: Path) -> None:
        """An SGD without momentum slots is not restored from one with them."""
        saved_model = await saved_then_changed(tmp_path)
        model = saved_model.model
        plain = SGD(0.1)
        ckpt = Checkpoint(
            model={"w": model.w, "b": model.b}, optimizer=plain, epoch=9, history=[2.0]
        )
        with pytest.raises(CheckpointError) as caught:
            await ckpt.restore(saved_model.path)
        assert caught.value.problems == (
            "optimizer: the checkpoint holds a SGD optimizer with slots ['momentum'], this is "
            "a SGD with slots []",
        )
        assert plain.iterations == 0

    @pytest.mark.parametrize("count", [np.uint64(2**63), np.int64(-1)], ids=["2**63", "-1"])
    async def test_step_count_outside_int64(self, tmp_path: Path, count: Any) -> None:
        """A step count outside 0 to 2**63 - 1 (what ``iterations`` holds) is refused;
        nothing changes."""
        saved_model = await saved_then_changed(tmp_path)
        member = member_of(saved_model.path, ["optimizer"])
        data = io.BytesIO()
        np.save(data, np.asarray(count))
        bad = tmp_path / "bad.npz"
        rewrite(saved_model.path, bad, {f"{member}.npy": data.getvalue()})
        await self.expect_refused(
            saved_model, bad, ["optimizer: its step count is not an int from 0 to 2**63 - 1"]
        )

    async def test_number_of_another_type(self, tmp_path: Path) -> None:
        """An int in the file is not restored into a float; nothing changes."""
        saved_model = await saved_then_changed(tmp_path)
        saved_model.ckpt.epoch = 9.0
        await self.expect_refused(
            saved_model,
            saved_model.path,
            ["epoch: the checkpoint holds a number of type int there, this is of type float"],
        )
        assert saved_model.ckpt.epoch == 9.0

    async def test_variable_where_number_was(self, tmp_path: Path) -> None:
        """An object of another kind at a saved path is refused."""
        saved_model = await saved_then_changed(tmp_path)
        saved_model.ckpt.epoch = Variable(0)
        await self.expect_refused(
            saved_model,
            saved_model.path,
            [
                "epoch: the checkpoint holds an object of kind number there, this is of kind "
                "variable"
            ],
        )


class TestConstruction:
    def test_non_string_dict_key(self) -> None:
        """A dict key that is not a string is refused."""
        with pytest.raises(TypeError, match=r"the dict key 1 at model/1 is not a string"):
            Checkpoint(model={1: Variable(0.0)})

    @pytest.mark.parametrize(
        ("value", "kind"),
        [
            ("x", "a str"),
            (np.zeros(2), "an ndarray"),
            (np.array(3), "an ndarray"),
            (True, "a bool"),
            (np.True_, "a bool"),
            (np.complex64(1), "a complex64"),
            (None, "a NoneType"),
        ],
        ids=["str", "ndarray", "0-d ndarray", "bool", "np.bool", "np.complex64", "None"],
    )
    def test_unsupported_object(self, value: Any, kind: str) -> None:
        """Strings, arrays (0-d ones too: arrays belong in variables), bools, complex numbers
        and None are not checkpoint objects."""
        with pytest.raises(TypeError, match=rf"Checkpoint: thing is {kind}; a checkpoint holds"):
            Checkpoint(thing=value)
        with pytest.raises(TypeError, match=rf"Checkpoint: model/0 is {kind}; a checkpoint"):
            Checkpoint(model=[value])

    def test_unsupported_object_assigned(self) -> None:
        """Assigning an unsupported object is refused and leaves the checkpoint as it was."""
        ckpt = Checkpoint(epoch=1)
        with pytest.raises(TypeError, match="Checkpoint: epoch is a str"):
            ckpt.epoch = "one"
        assert ckpt.epoch == 1

    @pytest.mark.parametrize("name", ["save", "restore"])
    def test_names_of_its_methods_are_refused(self, name: str) -> None:
        """An object named as a Checkpoint method could not be read back (``ckpt.save`` is
        the method): refused, at construction and by assignment, changing nothing."""
        with pytest.raises(ValueError, match=rf"^Checkpoint cannot hold an object named '{name}'"):
            Checkpoint(**{name: 3})
        ckpt = Checkpoint(epoch=1)
        with pytest.raises(ValueError, match=rf"^Checkpoint cannot hold an object named '{name}'"):
            setattr(ckpt, name, 3)
        assert repr(ckpt) == "Checkpoint(epoch)"

    def test_number_inside_tuple(self) -> None:
        """A number inside a tuple cannot be restored in place, so it is refused."""
        with pytest.raises(TypeError, match="the number at pair/1 is inside a tuple"):
            Checkpoint(pair=(Variable(0.0), 3))

    @pytest.mark.parametrize("number", [2**63, -(2**63) - 1, 2**64])
    async def test_ints_outside_64_bits_are_refused(self, tmp_path: Path, number: int) -> None:
        """A checkpoint stores ints in 64 bits. 2**63 used to save, then fail to restore with
        "a number of type int there, this is of type int"; 2**64 failed with NumPy's "Object
        arrays cannot be saved"."""
        with pytest.raises(ValueError, match=f"the int at step is {number}, outside the 64-bit"):
            Checkpoint(step=number)
        if number == 2**63:  # a NumPy integer that holds it
            with pytest.raises(ValueError, match=f"the int at step is {number}, outside the"):
                Checkpoint(step=np.uint64(number))
        ckpt = Checkpoint(counts={"step": 0})
        ckpt.counts["step"] = number  # changed after construction: refused at save
        with pytest.raises(ValueError, match=r"Checkpoint\.save: the int at counts/step is"):
            await ckpt.save(tmp_path / "c.npz")
        assert not (tmp_path / "c.npz").exists()
        edge = Checkpoint(low=-(2**63), high=2**63 - 1)
        path = await edge.save(tmp_path / "edge.npz")
        edge.low = edge.high = 0
        await edge.restore(path)
        assert (edge.low, edge.high) == (-(2**63), 2**63 - 1)

    def test_variables_inside_tuple_allowed(self) -> None:
        """Variables may sit in tuples: they are restored in place anyway."""
        ckpt = Checkpoint(pair=(Variable(0.0), Variable(1.0)))
        assert repr(ckpt) == "Checkpoint(pair)"

    @pytest.mark.parametrize("method", ["save", "restore"])
    async def test_empty_path(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
    ) -> None:
        """An empty path is a ValueError saying so. A save used to raise FileNotFoundError
        about a temporary file it had made in the parent folder; a restore, "no checkpoint at
        ''"."""
        monkeypatch.chdir(tmp_path / ".")
        ckpt = Checkpoint(step=1)
        with pytest.raises(
            ValueError,
            match=rf"^Checkpoint\.{method}: the path is empty; give the checkpoint file's path",
        ):
            await getattr(ckpt, method)("")
        assert (os.listdir(tmp_path), ckpt.step) == ([], 1)

    async def test_save_to_a_folder_path(self, tmp_path: Path) -> None:
        """A path ending with a separator names a folder: refused, nothing written."""
        folder = tmp_path / "run"
        folder.mkdir()
        with pytest.raises(ValueError, match=r"ends with a path separator, so it names a folder"):
            await Checkpoint(step=1).save(f"{folder}{os.sep}")
        assert (os.listdir(tmp_path), os.listdir(folder)) == (["run"], [])

    async def test_optimizer_slots_for_foreign_variable(self, tmp_path: Path) -> None:
        """Saving an optimizer with slots for a variable not in the checkpoint is refused."""
        w = Variable(np.zeros(2), name="w")
        other = Variable(np.zeros(2), name="other")
        opt = SGD(0.1, momentum=0.9)
        opt.build([w, other])
        with pytest.raises(
            ValueError,
            match="the optimizer at optimizer has slots for variable 'other', which is not in "
            "this checkpoint",
        ):
            await Checkpoint(model={"w": w}, optimizer=opt).save(tmp_path / "c.npz")
        assert os.listdir(tmp_path) == []

    @pytest.mark.parametrize("method", ["save", "restore"])
    async def test_inside_replica(self, tmp_path: Path, method: str) -> None:
        """``save`` and ``restore`` inside ``strategy.run`` raise RuntimeError."""
        strategy = MirroredStrategy(host_devices(2))
        ckpt = Checkpoint(step=1)
        await ckpt.save(tmp_path / "c.npz")

        async def step() -> None:
            await getattr(ckpt, method)(tmp_path / "c.npz")

        with pytest.raises(
            RuntimeError,
            match=rf"Checkpoint\.{method}\(\) was called inside replica 0; call it from "
            r"cross-replica code, outside strategy\.run\(\)",
        ):
            await strategy.run(step)


def _set_t(value: Any) -> Callable[[dict[Any, Any]], None]:
    def change(cfg: dict[Any, Any]) -> None:
        cfg["t"] = value

    return change


def _int_key(cfg: dict[Any, Any]) -> None:
    cfg[1] = 2


#: A change made to a dict of the checkpoint after ``Checkpoint(...)``, and what a save or a
#: restore then says (after its ``Checkpoint.save: `` or ``Checkpoint.restore: ``).
CHANGED_LATER: dict[str, tuple[Callable[[dict[Any, Any]], None], str]] = {
    "number in a tuple": (
        _set_t((5,)),
        "the number at cfg/t/0 is inside a tuple, where it cannot be restored in place; use a "
        "list or a dict",
    ),
    "str": (_set_t("five"), "cfg/t is a str; a checkpoint holds variables, optimizers"),
    "bool": (_set_t(True), "cfg/t is a bool; a checkpoint holds"),
    "None": (_set_t(None), "cfg/t is a NoneType; a checkpoint holds"),
    "object": (_set_t(object()), "cfg/t is an object; a checkpoint holds"),
    "int key": (_int_key, "the dict key 1 at cfg/1 is not a string"),
    "itself": (lambda cfg: _set_t(cfg)(cfg), "cfg nests too deeply, or a dict or list inside"),
}


class TestChangedAfterConstruction:
    """A dict or list given to ``Checkpoint(...)`` changes later: every save and restore checks
    the objects as they are then, with the constructor's errors, and changes nothing."""

    @pytest.mark.parametrize("change", list(CHANGED_LATER))
    async def test_save_refuses(self, tmp_path: Path, change: str) -> None:
        """Such a save used to write a file that no restore could read back ("the file is
        corrupted"), or fail with NumPy's "Object arrays cannot be saved"."""
        apply, message = CHANGED_LATER[change]
        cfg: dict[Any, Any] = {"epoch": 1}
        ckpt = Checkpoint(w=Variable(np.zeros(2), name="w"), cfg=cfg)
        apply(cfg)
        with pytest.raises(TypeError, match=rf"^Checkpoint\.save: {re.escape(message)}"):
            await ckpt.save(tmp_path / "c.npz")
        manager = CheckpointManager(ckpt, tmp_path / "run")
        with pytest.raises(TypeError, match=rf"^CheckpointManager\.save: {re.escape(message)}"):
            await manager.save()
        assert (os.listdir(tmp_path), manager.checkpoints) == ([], [])

    @pytest.mark.parametrize("change", list(CHANGED_LATER))
    async def test_restore_refuses_changing_nothing(self, tmp_path: Path, change: str) -> None:
        """With a number in a tuple, such a restore used to commit the variables and the
        numbers before it, then fail with "'tuple' object does not support item
        assignment"."""
        apply, message = CHANGED_LATER[change]
        path = await Checkpoint(
            w=Variable(np.arange(2.0), name="w"), cfg={"epoch": 1, "t": [5]}
        ).save(tmp_path / "c.npz")
        w = Variable(np.full(2, 7.0), name="w")
        cfg: dict[Any, Any] = {"epoch": 9}
        ckpt = Checkpoint(w=w, cfg=cfg)
        apply(cfg)
        before = dict(cfg)
        for partial in (False, True):
            with pytest.raises(TypeError, match=rf"^Checkpoint\.restore: {re.escape(message)}"):
                await ckpt.restore(path, partial=partial)
            assert (w.numpy().tolist(), cfg.keys(), cfg["epoch"]) == (
                [7.0, 7.0],
                before.keys(),
                9,
            )


class TestCheckpointManager:
    async def test_numbers_and_keeps_newest(self, tmp_path: Path) -> None:
        """Files are numbered from 1 and only the newest ``max_to_keep`` stay on disk."""
        directory = tmp_path / "run"
        manager = CheckpointManager(Checkpoint(step=0), directory, max_to_keep=2)
        assert (manager.latest, manager.checkpoints) == (None, [])
        assert not directory.exists()
        paths = [await manager.save() for _ in range(3)]
        assert paths == [str(directory / f"ckpt-{n}.npz") for n in (1, 2, 3)]
        assert manager.checkpoints == [str(directory / "ckpt-2.npz"), str(directory / "ckpt-3.npz")]
        assert manager.latest == str(directory / "ckpt-3.npz")
        assert sorted(os.listdir(directory)) == ["ckpt-2.npz", "ckpt-3.npz"]
        assert manager.directory == str(directory)

    async def test_directory_created_on_first_save(self, tmp_path: Path) -> None:
        """A missing directory, nested too, is created by the first save, not before."""
        directory = tmp_path / "a" / "b"
        manager = CheckpointManager(Checkpoint(step=0), directory)
        assert not (tmp_path / "a").exists()
        await manager.save()
        assert os.listdir(directory) == ["ckpt-1.npz"]

    @pytest.mark.parametrize("partial", [False, True])
    async def test_restoring_none_is_a_new_run(self, tmp_path: Path, partial: bool) -> None:
        """TF's resume idiom, ``restore(manager.latest)``, before any save: ``latest`` is None,
        and restoring None changes nothing (variables, optimizer, numbers, an iterator that
        has pulled) and reports every object as kept; after a save the same line resumes."""
        saved = await saved_then_changed(tmp_path)
        assert saved.model.strategy is not None
        batches = aioreplica.batched(np.arange(8), 2)
        data = aiter(saved.model.strategy.distribute_dataset(batches, prefetch=0))
        first = await anext(data)
        saved.ckpt.data = data
        manager = CheckpointManager(saved.ckpt, tmp_path / "run")
        before = saved.state()

        report = await saved.ckpt.restore(manager.latest, partial=partial)

        assert manager.latest is None
        assert saved.state() == before
        assert report.path is None
        assert report.restored == ()
        kept = ("data", "epoch", "history/0", "model/b", "model/w", "optimizer")
        assert report.only_in_program == kept
        assert not report.complete
        assert str(report) == "no checkpoint to restore (path None): every object kept its value"
        assert (await anext(data)).values[0].tolist() != first.values[0].tolist()

        await manager.save()
        await saved.ckpt.restore(manager.latest)  # the same line, once there is one
        assert saved.state() == before

    async def test_restoring_none_still_checks_partial(self, tmp_path: Path) -> None:
        ckpt = Checkpoint(step=Variable(1.0))
        with pytest.raises(TypeError, match="partial must be True or False, got 'yes'"):
            await ckpt.restore(None, partial="yes")  # type: ignore[arg-type]

    @pytest.mark.parametrize("kind", ["plain", "async"])
    async def test_restore_or_initialize(self, tmp_path: Path, kind: str) -> None:
        """TF's: no checkpoint yet, ``init_fn`` runs (once, awaited when async) and None comes
        back; once there is one, it is restored, its path returned, and ``init_fn`` not
        called."""
        w = Variable(np.zeros(2), name="w")
        calls: list[str] = []

        def plain() -> None:
            calls.append("plain")

        async def pretrained() -> None:
            calls.append("async start")
            await w.assign([4.0, 5.0])
            calls.append("async end")

        init_fn = plain if kind == "plain" else pretrained
        manager = CheckpointManager(Checkpoint(w=w), tmp_path, init_fn=init_fn)

        assert await manager.restore_or_initialize() is None
        assert calls == (["plain"] if kind == "plain" else ["async start", "async end"])
        calls.clear()
        await w.assign([1.0, 2.0])
        path = await manager.save()
        await w.assign([7.0, 7.0])

        again = CheckpointManager(Checkpoint(w=w), tmp_path, init_fn=init_fn)
        assert await again.restore_or_initialize() == path
        assert w.numpy().tolist() == [1.0, 2.0]
        assert calls == []

    async def test_restore_or_initialize_without_init_fn(self, tmp_path: Path) -> None:
        w = Variable(np.ones(2), name="w")
        manager = CheckpointManager(Checkpoint(w=w), tmp_path)
        assert await manager.restore_or_initialize() is None
        assert w.numpy().tolist() == [1.0, 1.0]

    async def test_restore_or_initialize_raises_what_init_fn_raises(self, tmp_path: Path) -> None:
        def broken() -> None:
            raise OSError("no pretrained weights")

        manager = CheckpointManager(Checkpoint(step=1), tmp_path, init_fn=broken)
        with pytest.raises(OSError, match="no pretrained weights"):
            await manager.restore_or_initialize()

    async def test_restore_or_initialize_refuses_a_corrupted_latest(self, tmp_path: Path) -> None:
        """The newest file cannot be read: CheckpointError, nothing changed, and ``init_fn``
        is not called (there is a checkpoint, a broken one)."""
        w = Variable(np.ones(2), name="w")
        calls: list[str] = []
        (tmp_path / "ckpt-3.npz").write_bytes(b"not a checkpoint")
        manager = CheckpointManager(Checkpoint(w=w), tmp_path, init_fn=lambda: calls.append("init"))
        with pytest.raises(CheckpointError, match=r"ckpt-3\.npz"):
            await manager.restore_or_initialize()
        assert w.numpy().tolist() == [1.0, 1.0]
        assert calls == []

    async def test_restore_or_initialize_inside_a_replica(self, tmp_path: Path) -> None:
        calls: list[str] = []
        manager = CheckpointManager(
            Checkpoint(step=1), tmp_path, init_fn=lambda: calls.append("init")
        )
        with pytest.raises(
            RuntimeError,
            match=r"CheckpointManager\.restore_or_initialize\(\) was called inside replica 0",
        ):
            await MirroredStrategy(host_devices(2)).run(manager.restore_or_initialize)
        assert calls == []

    def test_init_fn_must_be_callable(self, tmp_path: Path) -> None:
        with pytest.raises(TypeError, match="init_fn must be callable or None, got int"):
            CheckpointManager(Checkpoint(step=1), tmp_path, init_fn=3)  # type: ignore[arg-type]

    async def test_new_manager_finds_existing(self, tmp_path: Path) -> None:
        """A new manager over the same directory resumes from the newest file."""
        step = Variable(np.zeros(()), name="step")
        ckpt = Checkpoint(step=step)
        manager = CheckpointManager(ckpt, tmp_path, max_to_keep=3)
        for value in range(4):
            await step.assign(float(value))
            await manager.save()
        (tmp_path / "ckpt-x.npz").write_bytes(b"")
        (tmp_path / "other-9.npz").write_bytes(b"")
        (tmp_path / ".ckpt-9.npz.0a1b2c3d.tmp").write_bytes(b"")

        again = CheckpointManager(ckpt, tmp_path, max_to_keep=3)

        assert again.latest == str(tmp_path / "ckpt-4.npz")
        assert again.checkpoints == [str(tmp_path / f"ckpt-{n}.npz") for n in (2, 3, 4)]
        await step.assign(-1.0)
        assert again.latest is not None
        await ckpt.restore(again.latest)
        assert step.numpy().tolist() == 3.0
        assert await again.save() == str(tmp_path / "ckpt-5.npz")
        assert not (tmp_path / "ckpt-2.npz").exists()

    async def test_explicit_checkpoint_number(self, tmp_path: Path) -> None:
        """``save(checkpoint_number=7)`` writes ``ckpt-7.npz``; the next save is 8."""
        manager = CheckpointManager(Checkpoint(step=0), tmp_path)
        await manager.save()
        assert await manager.save(checkpoint_number=7) == str(tmp_path / "ckpt-7.npz")
        assert await manager.save() == str(tmp_path / "ckpt-8.npz")
        assert manager.checkpoints == [str(tmp_path / f"ckpt-{n}.npz") for n in (1, 7, 8)]

    async def test_resaving_a_number_replaces_it(self, tmp_path: Path) -> None:
        """Saving a number again overwrites that file and lists it once."""
        ckpt = Checkpoint(step=1)
        manager = CheckpointManager(ckpt, tmp_path)
        await manager.save(checkpoint_number=3)
        ckpt.step = 2
        await manager.save(checkpoint_number=3)
        assert manager.checkpoints == [str(tmp_path / "ckpt-3.npz")]
        assert saved(tmp_path / "ckpt-3.npz") == {"step": 2}

    async def test_keep_all(self, tmp_path: Path) -> None:
        """``max_to_keep=None`` never deletes."""
        manager = CheckpointManager(Checkpoint(step=0), tmp_path, max_to_keep=None)
        for _ in range(7):
            await manager.save()
        assert sorted(os.listdir(tmp_path)) == sorted(f"ckpt-{n}.npz" for n in range(1, 8))

    async def test_checkpoint_name(self, tmp_path: Path) -> None:
        """``checkpoint_name`` is the file name prefix."""
        manager = CheckpointManager(Checkpoint(step=0), tmp_path, checkpoint_name="model")
        assert await manager.save() == str(tmp_path / "model-1.npz")
        assert repr(manager) == f"CheckpointManager({str(tmp_path)!r}, latest={manager.latest!r})"

    @pytest.mark.parametrize("max_to_keep", [0, -1])
    def test_bad_max_to_keep(self, tmp_path: Path, max_to_keep: Any) -> None:
        """``max_to_keep`` must be an int >= 1 or None."""
        with pytest.raises(
            ValueError, match=rf"^max_to_keep must be an int >= 1 or None, got {max_to_keep!r}$"
        ):
            CheckpointManager(Checkpoint(step=0), tmp_path, max_to_keep=max_to_keep)

    @pytest.mark.parametrize("max_to_keep", [True, 1.5, "5"])
    def test_max_to_keep_of_another_type(self, tmp_path: Path, max_to_keep: Any) -> None:
        """A ``max_to_keep`` that is no int (a bool, a float, a string) is a TypeError."""
        shown = re.escape(f"got {type(max_to_keep).__name__} {max_to_keep!r}")
        with pytest.raises(TypeError, match=rf"^max_to_keep must be an int >= 1 or None, {shown}$"):
            CheckpointManager(Checkpoint(step=0), tmp_path, max_to_keep=max_to_keep)

    async def test_numpy_integers_are_counts(self, tmp_path: Path) -> None:
        """``max_to_keep`` and ``checkpoint_number`` taken from NumPy work as ints."""
        manager = CheckpointManager(Checkpoint(step=0), tmp_path, max_to_keep=np.int64(1))
        assert await manager.save(checkpoint_number=np.int64(4)) == str(tmp_path / "ckpt-4.npz")
        assert await manager.save() == str(tmp_path / "ckpt-5.npz")
        assert manager.checkpoints == [str(tmp_path / "ckpt-5.npz")]

    @pytest.mark.parametrize("name", ["", "a/b", f"a{os.sep}b", "a\0b"])
    def test_bad_checkpoint_name(self, tmp_path: Path, name: str) -> None:
        """An empty prefix or one with a path separator (or a NUL) is refused."""
        with pytest.raises(ValueError, match="checkpoint_name must be a non-empty file name"):
            CheckpointManager(Checkpoint(step=0), tmp_path, checkpoint_name=name)

    @pytest.mark.parametrize(
        ("name", "shown"), [(5, "int 5"), (b"ckpt", "bytes b'ckpt'"), (None, "NoneType None")]
    )
    def test_checkpoint_name_of_another_type(self, tmp_path: Path, name: Any, shown: str) -> None:
        """A prefix that is not a str is a TypeError naming the argument; it used to be
        "argument of type 'int' is not iterable" or "a bytes-like object is required"."""
        with pytest.raises(
            TypeError,
            match=rf"^checkpoint_name must be a str, the file name prefix \(such as 'ckpt'\), "
            rf"got {re.escape(shown)}$",
        ):
            CheckpointManager(Checkpoint(step=0), tmp_path, checkpoint_name=name)

    def test_empty_directory(self, tmp_path: Path) -> None:
        """An empty directory is refused when the manager is made (its first save used to
        fail in os.makedirs)."""
        with pytest.raises(ValueError, match=r"directory is empty; .*\('\.' for the current"):
            CheckpointManager(Checkpoint(step=0), "")

    async def test_default_number_never_replaces_a_kept_checkpoint(self, tmp_path: Path) -> None:
        """After ``save(1)`` beside a kept ``ckpt-2``, ``save()`` writes ``ckpt-3``: one more
        than the highest kept, not than the latest save (which overwrote ``ckpt-2``)."""
        ckpt = Checkpoint(step=2)
        await CheckpointManager(ckpt, tmp_path).save(2)
        manager = CheckpointManager(ckpt, tmp_path)
        ckpt.step = 1
        assert await manager.save(1) == str(tmp_path / "ckpt-1.npz")
        assert manager.latest == str(tmp_path / "ckpt-1.npz")
        ckpt.step = 3
        assert await manager.save() == str(tmp_path / "ckpt-3.npz")
        assert [saved(tmp_path / f"ckpt-{n}.npz") for n in (1, 2, 3)] == [
            {"step": 1},
            {"step": 2},
            {"step": 3},
        ]
        assert manager.checkpoints == [str(tmp_path / f"ckpt-{n}.npz") for n in (2, 1, 3)]

    async def test_two_managers_over_one_directory_never_replace_each_others_files(
        self, tmp_path: Path
    ) -> None:
        """Two managers sharing a directory and a Checkpoint, saving in turn and at once: each
        save takes a number no file has, so every file holds what its save wrote, and each
        manager lists (and prunes) only its own."""
        ckpt = Checkpoint(step=0)
        first = CheckpointManager(ckpt, tmp_path, max_to_keep=2)
        second = CheckpointManager(ckpt, tmp_path, max_to_keep=2)
        written: dict[str, int] = {}
        for step, manager in enumerate([first, second, first], 1):
            ckpt.step = step
            written[os.path.basename(await manager.save())] = step

        async def save(manager: CheckpointManager, step: int) -> None:
            ckpt.step = step  # the values of the call: set just before it
            written[os.path.basename(await manager.save())] = step

        async with anyio.create_task_group() as group:
            group.start_soon(save, first, 4)
            group.start_soon(save, second, 5)
        assert sorted(written) == [f"ckpt-{n}.npz" for n in range(1, 6)]
        on_disk = sorted(os.listdir(tmp_path))
        assert on_disk == sorted(map(os.path.basename, first.checkpoints + second.checkpoints))
        assert {name: saved(tmp_path / name)["step"] for name in on_disk} == {
            name: written[name] for name in on_disk
        }
        assert (len(first.checkpoints), len(second.checkpoints)) == (2, 2)

    @pytest.mark.parametrize("links", ["hard links", "no hard links"])
    async def test_a_file_another_writer_made_is_never_replaced(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: str
    ) -> None:
        """A file of the next number made by another writer after the manager was made, or
        just as the save puts its file in place (another process), is left as it is: the save
        takes the next free number (with or without hard links on the file system)."""
        ckpt = Checkpoint(step=1)
        manager = CheckpointManager(ckpt, tmp_path)
        (tmp_path / "ckpt-1.npz").write_bytes(b"another writer's")
        real_link = os.link
        events: list[str] = []

        def link(source: str, target: str) -> None:
            name = os.path.basename(target)
            if name == "ckpt-2.npz":  # another process takes it just now
                (tmp_path / name).write_bytes(b"another process's")
            events.append(f"link {name}")
            if links == "no hard links":
                raise PermissionError(1, "Operation not permitted")
            real_link(source, target)

        monkeypatch.setattr(os, "link", link)
        assert await manager.save() == str(tmp_path / "ckpt-3.npz")
        assert events == ["link ckpt-2.npz", "link ckpt-3.npz"]
        assert (tmp_path / "ckpt-1.npz").read_bytes() == b"another writer's"
        assert (tmp_path / "ckpt-2.npz").read_bytes() == b"another process's"
        assert saved(tmp_path / "ckpt-3.npz") == {"step": 1}
        assert sorted(os.listdir(tmp_path)) == [f"ckpt-{n}.npz" for n in (1, 2, 3)]
        assert manager.checkpoints == [str(tmp_path / "ckpt-3.npz")]  # its own only

    async def test_an_explicit_number_replaces_another_writers_file(self, tmp_path: Path) -> None:
        """As in TF, ``save(checkpoint_number=n)`` writes ``ckpt-n`` even over a file another
        manager wrote; only the default numbering never replaces a file."""
        ckpt = Checkpoint(step=1)
        other = CheckpointManager(ckpt, tmp_path)
        manager = CheckpointManager(ckpt, tmp_path)
        await other.save()
        ckpt.step = 2
        assert await manager.save(checkpoint_number=1) == str(tmp_path / "ckpt-1.npz")
        assert saved(tmp_path / "ckpt-1.npz") == {"step": 2}

    @pytest.mark.parametrize("why", ["folder", "refused"])
    async def test_checkpoint_that_cannot_be_deleted(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
    ) -> None:
        """An old checkpoint that cannot be pruned (now a folder, or its deletion refused) is a
        RuntimeWarning naming it, not a failed save: the new checkpoint is written and listed,
        the old one is no longer listed, and later saves prune as usual. Such saves used to
        raise IsADirectoryError, every one after it too, and keep more than max_to_keep."""
        manager = CheckpointManager(Checkpoint(step=0), tmp_path, max_to_keep=2)
        await manager.save()
        await manager.save()
        stuck = tmp_path / "ckpt-1.npz"
        if why == "folder":
            stuck.unlink()
            stuck.mkdir()
            (stuck / "inside").write_bytes(b"")
            error = "Is a directory" if sys.platform != "win32" else ""
        else:
            real = os.unlink

            def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
                if os.fspath(path) == str(stuck):
                    raise PermissionError(13, "Permission denied", str(stuck))
                real(path, *args, **kwargs)

            monkeypatch.setattr(os, "unlink", refuse)
            error = "Permission denied"
        with pytest.warns(RuntimeWarning) as warned:
            assert await manager.save() == str(tmp_path / "ckpt-3.npz")
        [warning] = warned
        assert str(warning.message).startswith(
            f"CheckpointManager: could not delete old checkpoint {str(stuck)!r} ("
        )
        assert error in str(warning.message)
        assert str(warning.message).endswith(
            "it stays on disk but is no longer listed among the kept checkpoints (remove it by "
            "hand); the new checkpoint was saved"
        )
        assert manager.checkpoints == [str(tmp_path / f"ckpt-{n}.npz") for n in (2, 3)]
        assert await manager.save() == str(tmp_path / "ckpt-4.npz")
        assert manager.checkpoints == [str(tmp_path / f"ckpt-{n}.npz") for n in (3, 4)]
        assert sorted(os.listdir(tmp_path)) == ["ckpt-1.npz", "ckpt-3.npz", "ckpt-4.npz"]

    async def test_checkpoint_number_from_an_integer_variable(self, tmp_path: Path) -> None:
        """A 0-d integer variable (a step counter, as in TF) numbers a save; one of another
        dtype or shape is refused and nothing is written."""
        manager = CheckpointManager(Checkpoint(step=0), tmp_path)
        step = Variable(np.int64(4), name="step")
        assert await manager.save(checkpoint_number=step) == str(tmp_path / "ckpt-4.npz")
        for bad in (Variable(4.0, name="f"), Variable(np.arange(2), name="v")):
            shown = rf"got Variable <aioreplica\.Variable {bad.name!r} shape"
            with pytest.raises(
                TypeError, match=rf"^checkpoint_number must be an int >= 0, {shown}"
            ):
                await manager.save(checkpoint_number=bad)
        assert os.listdir(tmp_path) == ["ckpt-4.npz"]

    @pytest.mark.parametrize("name", ["ckpt-007.npz", "ckpt-\u0663.npz", "ckpt-\u00b2.npz"])
    async def test_files_named_otherwise_than_a_save_names_them_are_left_alone(
        self, tmp_path: Path, name: str
    ) -> None:
        """A file whose number is not written as a save writes one (leading zeros, other
        digits) is no checkpoint of the manager's: not listed, never pruned, no error."""
        (tmp_path / name).write_bytes(b"not mine")
        manager = CheckpointManager(Checkpoint(step=0), tmp_path, max_to_keep=1)
        assert (manager.checkpoints, manager.latest) == ([], None)
        await manager.save()
        await manager.save()
        assert manager.checkpoints == [str(tmp_path / "ckpt-2.npz")]
        assert sorted(os.listdir(tmp_path)) == sorted(["ckpt-2.npz", name])

    def test_not_a_checkpoint(self, tmp_path: Path) -> None:
        """The first argument must be a Checkpoint."""
        with pytest.raises(TypeError, match="checkpoint must be a Checkpoint, got dict"):
            CheckpointManager({"step": 0}, tmp_path)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("number", "error", "shown"),
        [
            (-1, ValueError, "-1"),
            (True, TypeError, "bool True"),
            (2.0, TypeError, "float 2.0"),
            ("3", TypeError, "str '3'"),
        ],
    )
    async def test_bad_checkpoint_number(
        self, tmp_path: Path, number: Any, error: type[Exception], shown: str
    ) -> None:
        """``checkpoint_number`` must be an int >= 0 (another type is a TypeError); nothing
        is written."""
        manager = CheckpointManager(Checkpoint(step=0), tmp_path / "run")
        with pytest.raises(
            error, match=rf"^checkpoint_number must be an int >= 0, got {re.escape(shown)}$"
        ):
            await manager.save(checkpoint_number=number)
        assert not (tmp_path / "run").exists()


class TestConsistentSnapshot:
    async def test_saves_values_at_call_time(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Updates made while a save is writing do not reach the file: it holds the old values.

        The save is held inside its first array write (in its worker thread) while the main
        task trains one step, assigns and changes the numbers; then the write resumes.
        """
        model = build(2, SGD(0.1, momentum=0.9))
        await train(model, 2)
        history = [0.5]
        ckpt = Checkpoint(
            model={"w": model.w, "b": model.b}, optimizer=model.opt, epoch=3, history=history
        )
        before = model.state()
        path = tmp_path / "c.npz"
        resume = threading.Event()
        writing = hold_writes(monkeypatch, resume)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ckpt.save, path)
            assert await anyio.to_thread.run_sync(writing.wait, 10)
            await train(model, 1)
            await model.b.assign(np.full(3, 42.0))
            ckpt.epoch = 9
            history[0] = 2.0
            resume.set()

        assert model.state() != before
        target = build(2, SGD(0.1, momentum=0.9), offset=10.0)
        restored = Checkpoint(
            model={"w": target.w, "b": target.b}, optimizer=target.opt, epoch=0, history=[0.0]
        )
        await restored.restore(path)
        assert target.state() == before
        assert (restored.epoch, restored.history) == (3, [0.5])

    async def test_cancelled_save_still_writes(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A save cancelled while writing finishes its file, whole and restorable."""
        w = Variable(np.arange(3.0), name="w")
        ckpt = Checkpoint(w=w)
        path = tmp_path / "c.npz"
        resume = threading.Event()
        writing = hold_writes(monkeypatch, resume)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ckpt.save, path)
            assert await anyio.to_thread.run_sync(writing.wait, 10)
            tg.cancel_scope.cancel()
            resume.set()

        assert os.listdir(tmp_path) == ["c.npz"]
        assert saved(path) == {"w": [0.0, 1.0, 2.0]}


class FakeWorkers:
    """The workers of a MultiWorkerMirroredStrategy, as a checkpoint sees them, recording the
    collectives a call makes (no MPI): ``refuse_in_step`` is how a save refuses its arguments
    on every worker alike, a ``Checkpoint.restore refusing the file`` barrier how a restore
    does; any other collective means the refusal came too late, after the workers met."""

    is_chief = True
    broken = False
    pending = False
    worker_index = 0
    num_workers = 2

    def __init__(self) -> None:
        self.collectives: list[str] = []

    def call(self, what: str) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    async def refuse_in_step(self, what: str, error: BaseException) -> None:
        self.collectives.append(f"{what} refusing its arguments: {type(error).__name__}")

    async def barrier(self, what: str, detail: str = "") -> None:
        self.collectives.append(what.split(": ")[0])

    async def broadcast_bytes(self, data: bytes, root: int, what: str = "broadcast") -> bytes:
        self.collectives.append("broadcast")
        return data


class TestRefusedOnEveryWorker:
    """Across workers, the new refusals happen before the workers meet, as the others do: in
    step on every worker alike, never leaving one waiting in a collective for another."""

    @pytest.fixture
    def workers(self, monkeypatch: pytest.MonkeyPatch) -> FakeWorkers:
        fake = FakeWorkers()
        monkeypatch.setattr(Checkpoint, "_workers", lambda self: fake)
        return fake

    async def test_save(self, tmp_path: Path, workers: FakeWorkers) -> None:
        cfg: dict[str, Any] = {"epoch": 1}
        ckpt = Checkpoint(w=Variable(np.zeros(2), name="w"), cfg=cfg)
        cfg["t"] = "five"
        with pytest.raises(TypeError, match=r"^Checkpoint\.save: cfg/t is a str"):
            await ckpt.save(tmp_path / "c.npz")
        with pytest.raises(TypeError, match=r"^CheckpointManager\.save: cfg/t is a str"):
            await CheckpointManager(ckpt, tmp_path / "run").save()
        del cfg["t"]
        with pytest.raises(ValueError, match=r"^Checkpoint\.save: the path is empty"):
            await ckpt.save("")
        assert workers.collectives == [
            "Checkpoint.save refusing its arguments: TypeError",
            "CheckpointManager.save refusing its arguments: TypeError",
            "Checkpoint.save refusing its arguments: ValueError",
        ]
        assert os.listdir(tmp_path) == []

    async def test_restore(self, tmp_path: Path, workers: FakeWorkers) -> None:
        path = await Checkpoint(epoch=1, cfg={"t": [5]}).save(tmp_path / "c.npz")
        workers.collectives.clear()
        cfg: dict[str, Any] = {"t": [0]}
        ckpt = Checkpoint(epoch=9, cfg=cfg)
        cfg["t"] = (0,)
        with pytest.raises(TypeError, match=r"^Checkpoint\.restore: the number at cfg/t/0"):
            await ckpt.restore(path)
        with pytest.raises(ValueError, match=r"^Checkpoint\.restore: the path is empty"):
            await ckpt.restore("")
        assert workers.collectives == ["Checkpoint.restore refusing the file"] * 2
        assert (ckpt.epoch, cfg) == (9, {"t": (0,)})
