"""Partial restore: what fits is restored, the rest is left as it was and reported.

The case it is for: fine-tuning a model with a new head from a checkpoint of the old model.
Every async test runs on asyncio, uvloop and trio.
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

import aioreplica
from aioreplica import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    MirroredStrategy,
    RestoreReport,
    Variable,
)
from aioreplica._backends._numpy import HostDevice
from aioreplica.optimizers import SGD, Adam, Optimizer
from aioreplica.testing import host_devices, replica_id

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio

Layers = dict[str, dict[str, Variable]]

#: The end of every message about a manifest whose fields are malformed.
MALFORMED = "; the file is corrupted or not an aioreplica checkpoint"


def values(variable: Variable) -> list[Any]:
    """Every copy of ``variable`` as nested lists."""
    return [np.asarray(copy).tolist() for copy in variable.values]


def slots(optimizer: Optimizer, variable: Variable) -> list[Any] | None:
    """Every copy of ``variable``'s momentum slot, or None if it has none."""
    try:
        return values(optimizer.get_slot(variable, "momentum"))
    except ValueError:
        return None


@dataclasses.dataclass
class Model:
    """Layers of a small classifier on a strategy, an optimizer, and their checkpoint."""

    strategy: MirroredStrategy
    layers: Layers
    optimizer: Optimizer
    ckpt: Checkpoint

    def variables(self) -> list[Variable]:
        return [v for layer in self.layers.values() for v in layer.values()]

    def state(self) -> list[Any]:
        """Every copy of every variable and slot, the step count and the epoch."""
        return [
            *[values(v) for v in self.variables()],
            *[slots(self.optimizer, v) for v in self.variables()],
            self.optimizer.iterations,
            self.ckpt.epoch,
        ]

    async def train(self, steps: int) -> None:
        """``steps`` optimizer steps; the gradients depend on the replica."""

        async def step() -> None:
            await self.optimizer.apply_gradients(
                [(np.full(v.shape, replica_id() + 1.0), v) for v in self.variables()]
            )

        for _ in range(steps):
            await self.strategy.run(step)


def build(
    head: str = "head",
    classes: int = 10,
    *,
    replicas: int = 2,
    offset: float = 0.0,
    optimizer: Optimizer | None = None,
) -> Model:
    """A body (4 inputs, 5 units) and a head ``head`` of ``classes`` outputs."""
    strategy = MirroredStrategy(host_devices(replicas))
    with strategy.scope():
        layers = {
            "body": {
                "w": Variable(np.arange(20.0).reshape(4, 5) / 20 + offset, name="body_w"),
                "b": Variable(np.zeros(5) + offset, name="body_b"),
            },
            head: {
                "w": Variable(np.full((5, classes), 0.25 + offset), name=f"{head}_w"),
                "b": Variable(np.zeros(classes) + offset, name=f"{head}_b"),
            },
        }
    optimizer = optimizer if optimizer is not None else SGD(0.1, momentum=0.9)
    ckpt = Checkpoint(model=layers, optimizer=optimizer, epoch=0)
    return Model(strategy, layers, optimizer, ckpt)


async def pretrained(tmp_path: Path) -> tuple[Model, Path]:
    """The old model (a 10-class head), trained 2 steps and saved at epoch 4."""
    old = build()
    await old.train(2)
    old.ckpt.epoch = 4
    path = tmp_path / "pretrained.npz"
    await old.ckpt.save(path)
    return old, path


def shape_mismatch(path: str, saved: tuple[int, ...], here: tuple[int, ...]) -> tuple[str, str]:
    return (
        path,
        f"dtype float64 and shape {saved} in the checkpoint, dtype float64 and shape {here} here",
    )


class TestFineTuning:
    async def test_new_head_of_another_shape(self, tmp_path: Path) -> None:
        """A head with 3 classes instead of 10: the body, the step count and the body's slots
        are restored; the head and its slots are reported with both shapes and keep their
        values; training then goes on, the head getting its slots at its first step."""
        old, path = await pretrained(tmp_path)
        new = build(classes=3, offset=100.0)
        head_before = [values(new.layers["head"]["w"]), values(new.layers["head"]["b"])]

        report = await new.ckpt.restore(path, partial=True)

        assert report == RestoreReport(
            str(path),
            restored=("epoch", "model/body/b", "model/body/w", "optimizer"),
            mismatched=(
                shape_mismatch("model/head/b", (10,), (3,)),
                shape_mismatch("model/head/w", (5, 10), (5, 3)),
                shape_mismatch("optimizer/slots/model/head/b/momentum", (10,), (3,)),
                shape_mismatch("optimizer/slots/model/head/w/momentum", (5, 10), (5, 3)),
            ),
        )
        assert not report.complete
        for name in ("w", "b"):
            old_var, new_var = old.layers["body"][name], new.layers["body"][name]
            assert values(new_var) == values(old_var)
            assert slots(new.optimizer, new_var) == slots(old.optimizer, old_var)
        assert [values(new.layers["head"]["w"]), values(new.layers["head"]["b"])] == head_before
        assert slots(new.optimizer, new.layers["head"]["w"]) is None
        assert (new.optimizer.iterations, new.ckpt.epoch) == (2, 4)

        await new.train(1)
        assert new.optimizer.iterations == 3
        assert slots(new.optimizer, new.layers["head"]["w"]) is not None

    async def test_new_head_layer(self, tmp_path: Path) -> None:
        """A new layer ``classifier`` in place of ``head``: the old head and its slots are only
        in the file, the new layer only here; the body is restored."""
        old, path = await pretrained(tmp_path)
        new = build(head="classifier", classes=3, offset=100.0)
        before = [values(v) for v in new.layers["classifier"].values()]

        report = await new.ckpt.restore(path, partial=True)

        assert report == RestoreReport(
            str(path),
            restored=("epoch", "model/body/b", "model/body/w", "optimizer"),
            only_in_file=(
                "model/head/b",
                "model/head/w",
                "optimizer/slots/model/head/b/momentum",
                "optimizer/slots/model/head/w/momentum",
            ),
            only_in_program=("model/classifier/b", "model/classifier/w"),
        )
        assert report.skipped == (
            "model/classifier/b",
            "model/classifier/w",
            "model/head/b",
            "model/head/w",
            "optimizer/slots/model/head/b/momentum",
            "optimizer/slots/model/head/w/momentum",
        )
        assert values(new.layers["body"]["w"]) == values(old.layers["body"]["w"])
        assert [values(v) for v in new.layers["classifier"].values()] == before
        assert str(report) == (
            f"restored 4 of the objects of checkpoint {str(path)!r}, skipped 6:\n"
            "  restored: epoch, model/body/b, model/body/w, optimizer\n"
            "  only in the file, not restored: model/head/b, model/head/w, "
            "optimizer/slots/model/head/b/momentum, optimizer/slots/model/head/w/momentum\n"
            "  only here, left as they were: model/classifier/b, model/classifier/w"
        )

    async def test_strict_restore_refuses_the_new_head(self, tmp_path: Path) -> None:
        """Without ``partial`` the same restore is refused, changing nothing."""
        _, path = await pretrained(tmp_path)
        new = build(classes=3, offset=100.0)
        await new.train(1)
        before = new.state()
        with pytest.raises(CheckpointError) as caught:
            await new.ckpt.restore(path)
        assert caught.value.problems == (
            "model/head/b: dtype float64 and shape (10,) in the checkpoint, dtype float64 and "
            "shape (3,) here",
            "model/head/w: dtype float64 and shape (5, 10) in the checkpoint, dtype float64 and "
            "shape (5, 3) here",
            "optimizer/slots/model/head/w/momentum: dtype float64 and shape (5, 10) in the "
            "checkpoint, dtype float64 and shape (5, 3) here",
            "optimizer/slots/model/head/b/momentum: dtype float64 and shape (10,) in the "
            "checkpoint, dtype float64 and shape (3,) here",
        )
        assert new.state() == before

    async def test_slots_here_without_slots_in_the_file(self, tmp_path: Path) -> None:
        """An optimizer that already has slots for a variable the file has none for keeps
        them, and the report names them; the other slots are restored."""
        old, path = await pretrained(tmp_path)
        new = build(head="classifier", classes=3, offset=100.0)
        await new.train(1)
        kept = slots(new.optimizer, new.layers["classifier"]["w"])
        assert kept is not None

        report = await new.ckpt.restore(path, partial=True)

        assert report.only_in_program == (
            "model/classifier/b",
            "model/classifier/w",
            "optimizer/slots/model/classifier/b/momentum",
            "optimizer/slots/model/classifier/w/momentum",
        )
        assert slots(new.optimizer, new.layers["classifier"]["w"]) == kept
        body_w = new.layers["body"]["w"]
        assert slots(new.optimizer, body_w) == slots(old.optimizer, old.layers["body"]["w"])
        assert new.optimizer.iterations == 2


class TestStrictReport:
    async def test_complete_report(self, tmp_path: Path) -> None:
        """A strict restore (the default) returns a report with nothing skipped; so does a
        partial one when everything fits."""
        old, path = await pretrained(tmp_path)
        for partial in (False, True):
            twin = build(offset=50.0)
            report = await twin.ckpt.restore(path, partial=partial)
            assert report == RestoreReport(
                str(path),
                restored=(
                    "epoch",
                    "model/body/b",
                    "model/body/w",
                    "model/head/b",
                    "model/head/w",
                    "optimizer",
                ),
            )
            assert (report.complete, report.skipped) == (True, ())
            assert twin.state() == old.state()
        assert str(report) == (
            f"restored every object of checkpoint {str(path)!r}: epoch, model/body/b, "
            "model/body/w, model/head/b, model/head/w, optimizer"
        )

    def test_report_is_frozen(self) -> None:
        """A report is a frozen dataclass."""
        report = RestoreReport("c.npz")
        with pytest.raises(dataclasses.FrozenInstanceError):
            report.restored = ("x",)  # type: ignore[misc]
        assert aioreplica.RestoreReport is RestoreReport

    async def test_partial_must_be_a_bool(self, tmp_path: Path) -> None:
        """``partial`` given as something other than a bool is a TypeError."""
        ckpt = Checkpoint(step=1)
        await ckpt.save(tmp_path / "c.npz")
        with pytest.raises(TypeError, match="partial must be True or False, got 'yes'"):
            await ckpt.restore(tmp_path / "c.npz", partial="yes")  # type: ignore[arg-type]


class TestSkippedObjects:
    async def test_other_optimizer_class(self, tmp_path: Path) -> None:
        """An Adam is not restored from an SGD's state: reported; the model is restored."""
        old, path = await pretrained(tmp_path)
        new = build(offset=100.0, optimizer=Adam(0.1))
        report = await new.ckpt.restore(path, partial=True)
        assert report.mismatched == (
            (
                "optimizer",
                "the checkpoint holds a SGD optimizer with slots ['momentum'], this is a Adam "
                "with slots ['m', 'v']",
            ),
        )
        assert report.restored == (
            "epoch",
            "model/body/b",
            "model/body/w",
            "model/head/b",
            "model/head/w",
        )
        assert (new.optimizer.iterations, new.optimizer.variables()) == (0, [])
        assert [values(v) for v in new.variables()] == [values(v) for v in old.variables()]

    async def test_numbers_and_kinds(self, tmp_path: Path) -> None:
        """A number of another type, and an object of another kind, are reported and kept."""
        ckpt = Checkpoint(epoch=3, rate=0.5, w=Variable(np.ones(2)))
        await ckpt.save(tmp_path / "c.npz")
        w = Variable(np.zeros(2))
        target = Checkpoint(epoch=9.0, rate=0.25, w=7)
        target.extra = w
        report = await target.restore(tmp_path / "c.npz", partial=True)
        assert report == RestoreReport(
            str(tmp_path / "c.npz"),
            restored=("rate",),
            only_in_program=("extra",),
            mismatched=(
                (
                    "epoch",
                    "the checkpoint holds a number of type int there, this is of type float",
                ),
                (
                    "w",
                    "the checkpoint holds an object of kind variable there, this is of kind number",
                ),
            ),
        )
        assert (target.epoch, target.rate, target.w, values(w)) == (9.0, 0.5, 7, [[0.0, 0.0]])

    async def test_iterator_over_another_dataset(self, tmp_path: Path) -> None:
        """An iterator over another dataset is reported and goes on from where it was."""
        iterator = iter(aioreplica.batched(np.arange(10), 4))
        next(iterator)
        ckpt = Checkpoint(data=iterator, step=3)
        await ckpt.save(tmp_path / "c.npz")
        other = iter(aioreplica.batched(np.arange(10), 5))
        target = Checkpoint(data=other, step=0)
        report = await target.restore(tmp_path / "c.npz", partial=True)
        assert report.restored == ("step",)
        assert report.mismatched == (
            (
                "data",
                "the checkpoint's iterator is over another dataset: batch size 4 in the "
                "checkpoint, 5 here; restore into an iterator over the same batched(...) dataset",
            ),
        )
        assert ([b.tolist() for b in other], target.step) == ([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], 3)


class TestRefusedInBothModes:
    async def refused(self, model: Model, path: Path) -> tuple[str, ...]:
        """The problems of a partial restore, checked to change nothing."""
        before = model.state()
        with pytest.raises(CheckpointError) as caught:
            await model.ckpt.restore(path, partial=True)
        assert model.state() == before
        return caught.value.problems

    async def test_truncated_file(self, tmp_path: Path) -> None:
        """A file cut short is refused."""
        _, path = await pretrained(tmp_path)
        cut = tmp_path / "cut.npz"
        cut.write_bytes(path.read_bytes()[:-100])
        problems = await self.refused(build(classes=3), cut)
        assert len(problems) == 1
        assert problems[0].startswith("the manifest cannot be read (BadZipFile: ")

    async def test_malformed_manifest(self, tmp_path: Path) -> None:
        """A manifest with a field of the wrong type is refused."""
        _, path = await pretrained(tmp_path)
        bad = tmp_path / "bad.npz"
        with zipfile.ZipFile(path) as old, zipfile.ZipFile(bad, "w") as new:
            for info in old.infolist():
                data = old.read(info.filename)
                if info.filename == "manifest.json":
                    manifest = json.loads(data)
                    manifest["entries"][0]["type"] = 3
                    data = json.dumps(manifest).encode()
                new.writestr(info.filename, data)
        assert await self.refused(build(classes=3), bad) == (
            "manifest entry 0 (epoch): 'type' must be a string, got 3" + MALFORMED,
        )

    async def test_array_contradicting_its_manifest(self, tmp_path: Path) -> None:
        """An array whose dtype is not the one its manifest gives is refused as corrupted."""
        _, path = await pretrained(tmp_path)
        bad = tmp_path / "bad.npz"
        with zipfile.ZipFile(path) as old, zipfile.ZipFile(bad, "w") as new:
            manifest = json.loads(old.read("manifest.json"))
            member = next(e["array"] for e in manifest["entries"] if e["path"][-1] == "w")
            for info in old.infolist():
                data = old.read(info.filename)
                if info.filename == f"{member}.npy":
                    with old.open(info.filename) as file:
                        array = np.lib.format.read_array(file)
                    with new.open(info.filename, "w") as out:
                        np.lib.format.write_array(out, array.astype(np.float32))
                    continue
                new.writestr(info.filename, data)
        assert await self.refused(build(classes=3), bad) == (
            "model/body/w: the file's array has dtype float32 and shape (4, 5), not what its "
            "manifest says (the file is corrupted)",
        )

    async def test_optimizer_with_slots_outside_the_checkpoint(self, tmp_path: Path) -> None:
        """An optimizer with slots for a variable the checkpoint does not hold is refused."""
        _, path = await pretrained(tmp_path)
        model = build(classes=3)
        outside = Variable(np.zeros(2), name="outside")
        model.optimizer.build([outside])
        assert await self.refused(model, path) == (
            "optimizer: has slots for variable 'outside', which is not in this checkpoint",
        )


class TestAllOrNothing:
    async def test_failure_while_computing_changes_nothing(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A partial restore that fails after computing some new copies changes nothing."""
        _, path = await pretrained(tmp_path)
        model = build(classes=3, offset=100.0)
        before = model.state()
        real = HostDevice.compute
        calls: list[int] = []

        async def failing(device: HostDevice, nbytes: int, fn: Any, *args: Any) -> Any:
            calls.append(nbytes)
            if len(calls) == 3:
                raise MemoryError("out of memory")
            return await real(device, nbytes, fn, *args)

        monkeypatch.setattr(HostDevice, "compute", failing)
        with pytest.raises(MemoryError, match="out of memory"):
            await model.ckpt.restore(path, partial=True)
        assert len(calls) == 3
        assert model.state() == before

    async def test_write_called_during_restore_applies_after_it(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A write of a restored variable called while the partial restore computes waits for
        it and applies on the restored value; a skipped variable's write does not wait."""
        old, path = await pretrained(tmp_path)
        model = build(classes=3, offset=100.0)
        body_w, head_w = model.layers["body"]["w"], model.layers["head"]["w"]
        entered, release = anyio.Event(), anyio.Event()
        real = HostDevice.compute
        armed = [True]

        async def held(device: HostDevice, nbytes: int, fn: Any, *args: Any) -> Any:
            if armed and armed.pop():
                entered.set()
                await release.wait()
            return await real(device, nbytes, fn, *args)

        monkeypatch.setattr(HostDevice, "compute", held)
        events: list[str] = []

        async def restore() -> None:
            await model.ckpt.restore(path, partial=True)
            events.append("restored")

        async def write(variable: Variable, name: str) -> None:
            await variable.assign_add(np.ones(variable.shape))
            events.append(f"{name} written")

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(restore)
                await entered.wait()
                tg.start_soon(write, body_w, "body")
                tg.start_soon(write, head_w, "head")
                await anyio.wait_all_tasks_blocked()
                events.append("restore let go on")
                release.set()

        assert events == ["head written", "restore let go on", "restored", "body written"]
        saved_w = np.asarray(old.layers["body"]["w"].values[0])
        assert values(body_w) == [(saved_w + 1).tolist()] * 2
        assert values(head_w) == [np.full((5, 3), 101.25).tolist()] * 2


class TestLatestCheckpoint:
    async def test_same_value_as_latest(self, tmp_path: Path) -> None:
        """``latest_checkpoint`` (TF's name) is ``latest``: None, then the newest file, also
        for a manager made later over the same directory."""
        manager = CheckpointManager(Checkpoint(step=1), tmp_path, max_to_keep=2)
        assert manager.latest_checkpoint is None
        for number in (1, 2, 3):
            assert await manager.save() == manager.latest_checkpoint == manager.latest
            assert manager.latest_checkpoint == str(tmp_path / f"ckpt-{number}.npz")
        later = CheckpointManager(Checkpoint(step=1), tmp_path)
        assert later.latest_checkpoint == later.latest == str(tmp_path / "ckpt-3.npz")
