"""Checkpoints where TF users expect TF's behaviour: slots saved before the first step, the
learning rate, a restore's status methods, the manager's interval and hourly keeping, and the
errors of TF's names that aioreplica spells otherwise. Every async test runs on every loop."""

from __future__ import annotations

import json
import os
import time
import zipfile
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from aioreplica import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    MirroredStrategy,
    RestoreReport,
    Variable,
)
from aioreplica.optimizers import SGD, Adagrad, Adam, Optimizer
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio


def slot_values(optimizer: Optimizer, variable: Variable) -> dict[str, list[Any]]:
    """Each slot of ``variable`` by name, as nested lists of its primary copy."""
    return {
        name: np.asarray(optimizer.get_slot(variable, name).numpy()).tolist()
        for name in optimizer.slot_names
    }


def with_manifest(source: str, target: Path, change: Any) -> str:
    """Copy the checkpoint ``source`` to ``target`` with its manifest changed by ``change``."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            data = old.read(info.filename)
            if info.filename == "manifest.json":
                manifest = json.loads(data)
                change(manifest)
                data = json.dumps(manifest).encode()
            new.writestr(info.filename, data)
    return str(target)


def optimizer_entry(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's entry of the optimizer saved as ``opt``."""
    entries: list[dict[str, Any]] = manifest["entries"]
    (entry,) = (e for e in entries if e["path"] == ["opt"])
    return entry


class TestSlotsSavedBeforeTheFirstStep:
    @pytest.mark.parametrize("partial", [False, True])
    async def test_restore_resets_slots_to_their_start(self, tmp_path: Path, partial: bool) -> None:
        """A file saved before the optimizer's first step (no slots in it) rolls a trained
        optimizer back: its slots restart at zero, with the step count and the variable."""
        w = Variable(np.ones(2), name="w")
        opt = Adam(0.1)
        ckpt = Checkpoint(w=w, opt=opt)
        path = await ckpt.save(tmp_path / "start.npz")
        await opt.apply_gradients([(np.ones(2), w)])
        assert slot_values(opt, w)["m"] != [0.0, 0.0]

        report = await ckpt.restore(path, partial=partial)

        assert report == RestoreReport(path, restored=("opt", "w"))
        assert (w.numpy().tolist(), opt.iterations) == ([1.0, 1.0], 0)
        assert slot_values(opt, w) == {"m": [0.0, 0.0], "v": [0.0, 0.0]}

    async def test_restore_after_build(self, tmp_path: Path) -> None:
        """A resumed program that builds its optimizer first (as ``build`` advises) restores
        a checkpoint saved before any step."""
        saved = Checkpoint(w=Variable(np.ones(2), name="w"), opt=Adam(0.1))
        manager = CheckpointManager(saved, tmp_path)
        path = await manager.save()
        w = Variable(np.zeros(2), name="w")
        opt = Adam(0.1)
        opt.build([w])
        resumed = CheckpointManager(Checkpoint(w=w, opt=opt), tmp_path)

        assert await resumed.restore_or_initialize() == path
        assert w.numpy().tolist() == [1.0, 1.0]
        assert slot_values(opt, w) == {"m": [0.0, 0.0], "v": [0.0, 0.0]}

    async def test_rolled_back_run_continues_as_a_fresh_one(self, tmp_path: Path) -> None:
        """The next step after rolling back to a file without slots is the step a fresh
        optimizer restored from it takes."""
        path = await Checkpoint(w=Variable(np.ones(2), name="w"), opt=Adam(0.1)).save(
            tmp_path / "start.npz"
        )
        trained, trained_opt = Variable(np.ones(2), name="w"), Adam(0.1)
        await trained_opt.apply_gradients([(np.full(2, 3.0), trained)])
        fresh, fresh_opt = Variable(np.zeros(2), name="w"), Adam(0.1)
        for variable, opt in ((trained, trained_opt), (fresh, fresh_opt)):
            await Checkpoint(w=variable, opt=opt).restore(path)
            await opt.apply_gradients([(np.ones(2), variable)])

        assert trained.numpy().tolist() == fresh.numpy().tolist()
        assert slot_values(trained_opt, trained) == slot_values(fresh_opt, fresh)

    async def test_slots_restart_at_the_optimizers_initial_value(self, tmp_path: Path) -> None:
        """Slots that do not start at zero (Adagrad's accumulator) restart at their own
        initial value."""
        w = Variable(np.ones(3), name="w")
        opt = Adagrad(0.1, initial_accumulator_value=0.25)
        ckpt = Checkpoint(w=w, opt=opt)
        path = await ckpt.save(tmp_path / "start.npz")
        await opt.apply_gradients([(np.ones(3), w)])

        await ckpt.restore(path)

        assert slot_values(opt, w) == {"accumulator": [0.25, 0.25, 0.25]}

    async def test_only_the_variables_without_saved_slots_reset(self, tmp_path: Path) -> None:
        """A variable the file holds slots for gets them; one trained only after the save
        restarts at zero: both in one restore."""
        a, b = Variable(np.ones(2), name="a"), Variable(np.ones(2), name="b")
        opt = SGD(0.1, momentum=0.9)
        ckpt = Checkpoint(model={"a": a, "b": b}, opt=opt)
        await opt.apply_gradients([(np.ones(2), a)])
        saved_a = slot_values(opt, a)
        path = await ckpt.save(tmp_path / "a-only.npz")
        await opt.apply_gradients([(np.ones(2), a), (np.ones(2), b)])

        await ckpt.restore(path)

        assert (slot_values(opt, a), slot_values(opt, b)) == (saved_a, {"momentum": [0.0, 0.0]})
        assert opt.iterations == 1

    async def test_refused_restore_keeps_the_slots(self, tmp_path: Path) -> None:
        """A strict restore refused for another object leaves the slots as they were."""
        w = Variable(np.ones(2), name="w")
        opt = Adam(0.1)
        path = await Checkpoint(w=w, opt=opt).save(tmp_path / "start.npz")
        await opt.apply_gradients([(np.ones(2), w)])
        trained = slot_values(opt, w)

        with pytest.raises(CheckpointError, match="extra: not in the checkpoint"):
            await Checkpoint(w=w, opt=opt, extra=1).restore(path)

        assert (slot_values(opt, w), opt.iterations) == (trained, 1)

    async def test_slots_of_a_variable_left_out_are_kept(self, tmp_path: Path) -> None:
        """A partial restore that skips a variable keeps its slots, and says so."""
        w = Variable(np.ones(2), name="w")
        opt = SGD(0.1, momentum=0.9)
        path = await Checkpoint(w=w, opt=opt).save(tmp_path / "start.npz")
        head = Variable(np.ones(2), name="head")
        await opt.apply_gradients([(np.ones(2), w), (np.ones(2), head)])
        kept = slot_values(opt, head)

        report = await Checkpoint(w=w, head=head, opt=opt).restore(path, partial=True)

        assert report.only_in_program == ("head", "opt/slots/head/momentum")
        assert (slot_values(opt, head), slot_values(opt, w)) == (kept, {"momentum": [0.0, 0.0]})


class TestLearningRate:
    async def test_number_is_saved_and_restored(self, tmp_path: Path) -> None:
        """A learning rate lowered during training is restored, as Keras restores it."""
        w = Variable(np.ones(2), name="w")
        opt = Adam(1e-3)
        await opt.apply_gradients([(np.ones(2), w)])
        opt.learning_rate = 1e-4
        path = await Checkpoint(w=w, opt=opt).save(tmp_path / "c.npz")
        resumed = Adam(1e-3)

        report = await Checkpoint(w=Variable(np.zeros(2), name="w"), opt=resumed).restore(path)

        assert (report.complete, resumed.learning_rate) == (True, 1e-4)

    @pytest.mark.parametrize(
        ("saved", "here", "why"),
        [
            (
                0.5,
                lambda step: 0.1,
                "the number 0.5 in the checkpoint, a schedule, callable or variable here",
            ),
            (
                lambda: 0.1,
                0.25,
                "a schedule, callable or variable in the checkpoint (saved apart, if at all), the "
                "number 0.25 here",
            ),
        ],
    )
    async def test_number_against_schedule_is_a_mismatch(
        self, tmp_path: Path, saved: Any, here: Any, why: str
    ) -> None:
        """A number on one side and a schedule on the other: a strict restore refuses it,
        changing nothing; a partial one keeps the program's and names it."""
        path = await Checkpoint(w=Variable(np.ones(2), name="w"), opt=SGD(saved)).save(
            tmp_path / "c.npz"
        )
        w = Variable(np.zeros(2), name="w")
        opt = SGD(here)
        ckpt = Checkpoint(w=w, opt=opt)

        with pytest.raises(CheckpointError) as refused:
            await ckpt.restore(path)
        assert refused.value.problems == (f"opt/learning_rate: {why}",)
        assert (w.numpy().tolist(), opt.learning_rate) == ([0.0, 0.0], here)

        report = await ckpt.restore(path, partial=True)
        assert report.mismatched == (("opt/learning_rate", why),)
        assert report.restored == ("opt", "w")
        assert (w.numpy().tolist(), opt.learning_rate) == ([1.0, 1.0], here)

    async def test_schedules_on_both_sides(self, tmp_path: Path) -> None:
        """A schedule saved and a schedule here: the program's stays, nothing is skipped."""
        path = await Checkpoint(opt=SGD(lambda step: 1.0)).save(tmp_path / "c.npz")
        schedule = lambda step: 0.5  # noqa: E731
        opt = SGD(schedule)
        report = await Checkpoint(opt=opt).restore(path)
        assert (report.complete, opt.learning_rate) == (True, schedule)

    async def test_file_without_learning_rate_restores(self, tmp_path: Path) -> None:
        """A file written before learning rates were saved restores as before: the
        program's learning rate stays, and nothing is reported."""
        saved = await Checkpoint(w=Variable(np.ones(2), name="w"), opt=SGD(0.5)).save(
            tmp_path / "new.npz"
        )
        old = with_manifest(
            saved, tmp_path / "old.npz", lambda m: optimizer_entry(m).pop("learning_rate")
        )
        for here in (0.1, lambda step: 0.1):
            opt = SGD(here)
            report = await Checkpoint(w=Variable(np.zeros(2), name="w"), opt=opt).restore(old)
            assert (report.complete, opt.learning_rate) == (True, here)

    @pytest.mark.parametrize("field", [3, ["a3"], True])
    async def test_malformed_field_is_refused(self, tmp_path: Path, field: Any) -> None:
        """A manifest whose learning rate is neither an array's name nor null is refused,
        changing nothing."""
        saved = await Checkpoint(opt=SGD(0.5)).save(tmp_path / "c.npz")
        broken = with_manifest(
            saved,
            tmp_path / "broken.npz",
            lambda m: optimizer_entry(m).__setitem__("learning_rate", field),
        )
        opt = SGD(0.1)
        with pytest.raises(CheckpointError) as refused:
            await Checkpoint(opt=opt).restore(broken)
        assert refused.value.problems == (
            f"manifest entry 0 (opt): 'learning_rate' must be a string or null, got {field!r}; "
            "the file is corrupted or not an aioreplica checkpoint",
        )
        assert opt.learning_rate == 0.1

    async def test_array_that_is_no_rate_is_refused(self, tmp_path: Path) -> None:
        """A learning rate whose array is not a finite float is refused, changing nothing."""
        saved = await Checkpoint(opt=SGD(0.5)).save(tmp_path / "c.npz")
        # point it at the step count's array, an int
        broken = with_manifest(
            saved,
            tmp_path / "broken.npz",
            lambda m: optimizer_entry(m).__setitem__("learning_rate", optimizer_entry(m)["array"]),
        )
        opt = SGD(0.1)
        with pytest.raises(CheckpointError, match=r"opt/learning_rate: the file holds an array"):
            await Checkpoint(opt=opt).restore(broken)
        assert opt.learning_rate == 0.1


class TestRestoreStatus:
    async def test_complete_restore_passes_every_check(self, tmp_path: Path) -> None:
        """After a complete restore every status method returns the report, so calls chain."""
        ckpt = Checkpoint(w=Variable(np.ones(2), name="w"))
        report = await ckpt.restore(await ckpt.save(tmp_path / "c.npz"))
        assert report.assert_consumed().assert_existing_objects_matched().expect_partial() is report

    async def test_file_objects_left_unused(self, tmp_path: Path) -> None:
        """Objects only in the file fail ``assert_consumed`` but not
        ``assert_existing_objects_matched``."""
        path = await Checkpoint(w=Variable(np.ones(2)), head=Variable(np.ones(3))).save(
            tmp_path / "c.npz"
        )
        report = await Checkpoint(w=Variable(np.zeros(2))).restore(path, partial=True)

        assert report.assert_existing_objects_matched() is report
        with pytest.raises(AssertionError, match=r"only in the file, not restored: head"):
            report.assert_consumed()

    async def test_program_objects_left_out(self, tmp_path: Path) -> None:
        """Objects of the program that the file lacks or that mismatch fail both checks,
        each named; ``expect_partial`` returns the report all the same."""
        path = await Checkpoint(w=Variable(np.ones(2)), b=Variable(np.ones(3))).save(
            tmp_path / "c.npz"
        )
        ckpt = Checkpoint(w=Variable(np.zeros(2)), b=Variable(np.zeros(4)), extra=1)
        report = await ckpt.restore(path, partial=True)

        with pytest.raises(AssertionError) as unmatched:
            report.assert_existing_objects_matched()
        assert str(unmatched.value) == (
            f"objects of this program were not restored from {path!r}: b, extra"
        )
        with pytest.raises(AssertionError, match="not every object was matched"):
            report.assert_consumed()
        assert report.expect_partial() is report

    async def test_no_checkpoint(self, tmp_path: Path) -> None:
        """Restoring ``None`` (no checkpoint yet) matched nothing: both checks fail."""
        report = await Checkpoint(step=1).restore(None)
        for check in (report.assert_consumed, report.assert_existing_objects_matched):
            with pytest.raises(AssertionError, match=r"no checkpoint to restore \(path None\)"):
                check()


class TestCheckpointInterval:
    async def test_saves_at_most_every_interval(self, tmp_path: Path) -> None:
        """As TF: the first save saves; later ones only once the step moved by the
        interval; the same step never saves twice; ``check_interval=False`` saves any new
        step. Each held-back save returns None and writes nothing."""
        step = Variable(np.int64(0), name="step")
        checkpoint = Checkpoint(step=step)
        manager = CheckpointManager(
            checkpoint, tmp_path, None, step_counter=step, checkpoint_interval=3
        )
        assert (manager.checkpoint_interval, manager.checkpoint) == (3, checkpoint)
        results = []
        for value, check in [(0, True), (2, True), (3, True), (3, False), (4, False), (6, True)]:
            await step.assign(value)
            saved = await manager.save(check_interval=check)
            results.append(None if saved is None else os.path.basename(saved))

        assert results == [
            "ckpt-1.npz",
            None,
            "ckpt-2.npz",
            None,
            "ckpt-3.npz",
            None,
        ]
        assert sorted(os.listdir(tmp_path)) == ["ckpt-1.npz", "ckpt-2.npz", "ckpt-3.npz"]

    def test_a_sync_on_read_step_counter_is_refused(self, tmp_path: Path) -> None:
        """A sync-on-read step counter's read aggregates over the replicas (across workers, a
        collective the chief would make alone): refused, as TF's counter is a plain one."""
        with MirroredStrategy(host_devices(2)).scope():
            step = Variable(np.int64(0), synchronization="on_read", aggregation="sum")
        with pytest.raises(TypeError, match=r"not a sync-on-read one, or None; got SyncOnRead"):
            CheckpointManager(
                Checkpoint(step=step), tmp_path, step_counter=step, checkpoint_interval=2
            )

    async def test_a_restore_counts_the_interval_from_its_step(self, tmp_path: Path) -> None:
        """As TF's ``restore_or_initialize``: a resumed run's manager counts the interval from
        the step restored, so a save one step later is held back."""
        step = Variable(np.int64(0), name="step")
        first = CheckpointManager(
            Checkpoint(step=step), tmp_path, step_counter=step, checkpoint_interval=100
        )
        await step.assign(1000)
        saved = await first.save()
        await step.assign(0)
        resumed = CheckpointManager(
            Checkpoint(step=step), tmp_path, step_counter=step, checkpoint_interval=100
        )
        assert await resumed.restore_or_initialize() == saved
        await step.assign(1001)
        assert await resumed.save() is None
        await step.assign(1100)
        assert os.path.basename(await resumed.save() or "") == "ckpt-2.npz"

    async def test_a_failed_save_records_no_step(self, tmp_path: Path) -> None:
        """A save that fails saves no step: the same step saves once the cause is gone,
        instead of being held back as if it had been saved."""
        step = Variable(np.int64(100), name="step")
        directory = tmp_path / "run"
        manager = CheckpointManager(
            Checkpoint(step=step), directory, step_counter=step, checkpoint_interval=10
        )
        directory.write_bytes(b"")  # a file where the folder goes
        with pytest.raises(NotADirectoryError):
            await manager.save()
        directory.unlink()
        assert os.path.basename(await manager.save() or "") == "ckpt-1.npz"
        assert await manager.save() is None  # now it is saved

    async def test_without_interval_every_save_saves(self, tmp_path: Path) -> None:
        """A step counter alone holds nothing back."""
        step = Variable(np.int64(0), name="step")
        manager = CheckpointManager(Checkpoint(step=step), tmp_path, step_counter=step)
        assert manager.checkpoint_interval is None
        assert [os.path.basename(await manager.save()) for _ in range(2)] == [
            "ckpt-1.npz",
            "ckpt-2.npz",
        ]

    @pytest.mark.parametrize(
        ("arguments", "error", "message"),
        [
            (
                {"checkpoint_interval": 2},
                ValueError,
                "checkpoint_interval=2 needs a step_counter",
            ),
            (
                {"checkpoint_interval": 0, "step_counter": Variable(np.int64(0))},
                ValueError,
                "checkpoint_interval must be an int >= 1, got 0",
            ),
            (
                {"checkpoint_interval": 2.0, "step_counter": Variable(np.int64(0))},
                TypeError,
                "checkpoint_interval must be an int >= 1, got float 2.0",
            ),
            (
                {"checkpoint_interval": 2, "step_counter": 5},
                TypeError,
                "step_counter must be a 0-d integer aioreplica.Variable .* got int 5",
            ),
            (
                {"checkpoint_interval": 2, "step_counter": Variable(np.zeros(()))},
                TypeError,
                "step_counter must be a 0-d integer aioreplica.Variable",
            ),
            (
                {"keep_checkpoint_every_n_hours": "1"},
                TypeError,
                "keep_checkpoint_every_n_hours must be a number of hours or None, got str '1'",
            ),
            (
                {"keep_checkpoint_every_n_hours": 0},
                ValueError,
                r"keep_checkpoint_every_n_hours must be a finite number of hours > 0",
            ),
            (
                {"keep_checkpoint_every_n_hours": float("inf")},
                ValueError,
                r"keep_checkpoint_every_n_hours must be a finite number of hours > 0",
            ),
            (
                {"keep_checkpoint_every_n_hours": 10**400},  # too large for a float
                ValueError,
                r"keep_checkpoint_every_n_hours must be a finite number of hours > 0",
            ),
        ],
    )
    def test_arguments_are_checked(
        self, tmp_path: Path, arguments: dict[str, Any], error: type[Exception], message: str
    ) -> None:
        """Each new argument of the wrong type or value is refused, naming it."""
        with pytest.raises(error, match=message):
            CheckpointManager(Checkpoint(step=1), tmp_path, **arguments)

    async def test_check_interval_must_be_a_bool(self, tmp_path: Path) -> None:
        """``save(check_interval=...)`` takes a bool only, and writes nothing otherwise."""
        manager = CheckpointManager(Checkpoint(step=1), tmp_path)
        with pytest.raises(TypeError, match="check_interval must be True or False, got str 'no'"):
            await manager.save(check_interval="no")  # type: ignore[call-overload]
        assert os.listdir(tmp_path) == []


class FakeClock:
    """``time.time`` that moves only when told to."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class TestKeepEveryNHours:
    async def test_keeps_one_checkpoint_every_n_hours(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """As TF: a checkpoint pushed out of the newest ``max_to_keep`` stays on disk (and
        leaves the list) when saved at least n hours after the last one kept so."""
        clock = FakeClock()
        monkeypatch.setattr(time, "time", clock)
        manager = CheckpointManager(Checkpoint(step=1), tmp_path, 2, 1.0)
        for _ in range(6):  # saved at 0, 0.5, 1, 1.5, 2 and 2.5 hours
            await manager.save()
            clock.now += 1800.0

        names = [os.path.basename(path) for path in manager.checkpoints]
        assert names == ["ckpt-5.npz", "ckpt-6.npz"]
        # ckpt-1 at 0 h is within an hour of the manager's start, ckpt-3 (1 h) is kept, ckpt-4
        # (1.5 h) is not an hour after it.
        assert sorted(os.listdir(tmp_path)) == ["ckpt-3.npz", "ckpt-5.npz", "ckpt-6.npz"]

    async def test_new_manager_takes_times_from_the_files(self, tmp_path: Path) -> None:
        """With no state file, a manager made over a directory dates each checkpoint by its
        file's modification time; those beyond the newest ``max_to_keep`` count as kept
        earlier and stay."""
        now = time.time()
        for number, hours_ago in [(1, 10), (2, 4), (3, 3.5), (4, 3)]:
            path = tmp_path / f"ckpt-{number}.npz"
            await Checkpoint(step=number).save(path)
            os.utime(path, (now - hours_ago * 3600, now - hours_ago * 3600))
        manager = CheckpointManager(Checkpoint(step=0), tmp_path, 2, 0.75)
        assert [os.path.basename(path) for path in manager.checkpoints] == [
            "ckpt-3.npz",
            "ckpt-4.npz",
        ]

        await manager.save()
        await manager.save()

        # ckpt-3 (3.5 h ago) is not 0.75 h after ckpt-2 (4 h ago, kept earlier): deleted;
        # ckpt-4 (3 h ago) is: kept.
        assert sorted(os.listdir(tmp_path)) == [
            "ckpt-1.npz",
            "ckpt-2.npz",
            "ckpt-4.npz",
            "ckpt-5.npz",
            "ckpt-6.npz",
        ]
        assert [os.path.basename(path) for path in manager.checkpoints] == [
            "ckpt-5.npz",
            "ckpt-6.npz",
        ]

    async def test_without_hours_found_files_are_pruned(self, tmp_path: Path) -> None:
        """Without ``keep_checkpoint_every_n_hours`` the files found beyond ``max_to_keep``
        are listed and deleted by the next save, as before."""
        for number in (1, 2, 3):
            await Checkpoint(step=number).save(tmp_path / f"ckpt-{number}.npz")
        manager = CheckpointManager(Checkpoint(step=0), tmp_path, 2)
        assert len(manager.checkpoints) == 3
        await manager.save()
        assert sorted(os.listdir(tmp_path)) == ["ckpt-3.npz", "ckpt-4.npz"]


class TestTFNames:
    @pytest.mark.parametrize(
        ("name", "advice"),
        [
            ("write", r"await ckpt.save\(path\) writes exactly the path given"),
            ("read", r"await ckpt.restore\(path\) reads exactly the path given"),
            ("save_counter", "a Checkpoint numbers nothing: a CheckpointManager numbers its saves"),
        ],
    )
    def test_tf_only_members_say_what_to_use(self, name: str, advice: str) -> None:
        """TF's ``write``, ``read`` and ``save_counter`` name aioreplica's equivalent."""
        with pytest.raises(AttributeError, match=f"has no '{name}' .*; {advice}"):
            getattr(Checkpoint(step=1), name)

    def test_object_of_that_name_is_returned(self) -> None:
        """An object the checkpoint holds under one of those names is returned as usual."""
        assert Checkpoint(save_counter=3).save_counter == 3

    def test_manager_directory_that_is_a_file(self, tmp_path: Path) -> None:
        """A manager's directory that is a file is named as such."""
        path = tmp_path / "afile"
        path.write_bytes(b"")
        with pytest.raises(NotADirectoryError, match=f"directory {str(path)!r} is a file"):
            CheckpointManager(Checkpoint(step=1), path)

    async def test_save_onto_a_folder_names_it(self, tmp_path: Path) -> None:
        """Saving to a path that is a folder names that path, not a temporary, and leaves
        nothing behind."""
        folder = tmp_path / "sub"
        folder.mkdir()
        with pytest.raises(IsADirectoryError) as refused:
            await Checkpoint(step=1).save(folder)
        assert str(refused.value) == (
            f"[Errno 21] cannot save checkpoint {str(folder)!r}: it is a folder; give the file "
            f"to write, such as {str(folder / 'model.npz')!r}"
        )
        assert os.listdir(tmp_path) == ["sub"]
