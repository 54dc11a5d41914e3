"""A checkpoint's objects as attributes: copies and pickles of a checkpoint, names it keeps
for itself, and objects deleted from it."""

from __future__ import annotations

import copy
import pickle
from typing import TYPE_CHECKING

import numpy as np
import pytest

from aioreplica import Checkpoint, CheckpointError, MirroredStrategy, Variable
from aioreplica.optimizers import SGD
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio


class TestCopies:
    async def test_a_copy_holds_the_same_objects(self) -> None:
        """``copy.copy`` is a new checkpoint of the same objects: a name added to or deleted
        from one leaves the other as it is."""
        w = Variable(np.zeros(2), name="w")
        ckpt = Checkpoint(w=w, epoch=1)
        shallow = copy.copy(ckpt)
        shallow.step = 5
        del shallow.epoch
        assert (repr(ckpt), repr(shallow), shallow.w is w) == (
            "Checkpoint(w, epoch)",
            "Checkpoint(w, step)",
            True,
        )

    async def test_a_deep_copy_holds_copies_of_them(self, tmp_path: Path) -> None:
        """``copy.deepcopy`` is a checkpoint of deep copies: new variables of the same
        strategy holding the same values, which a restore into the copy sets alone."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            w = Variable(np.zeros(2), name="w")
        ckpt = Checkpoint(model={"w": w}, epoch=1)
        path = await ckpt.save(tmp_path / "zeros.npz")
        deep = copy.deepcopy(ckpt)
        await deep.model["w"].assign(np.ones(2))
        deep.epoch = 2
        await deep.restore(path)
        assert (
            deep.model["w"] is w,
            deep.model["w"].distribute_strategy is strategy,
            [np.array(c).tolist() for c in w.values],
            ckpt.epoch,
            deep.epoch,
        ) == (False, True, [[0.0, 0.0]] * 2, 1, 1)
        await deep.model["w"].assign(np.ones(2))
        assert [np.array(c).tolist() for c in w.values] == [[0.0, 0.0]] * 2

    def test_a_deep_copy_of_an_optimizer_is_refused_by_the_optimizer(self) -> None:
        """A checkpoint holding an optimizer cannot be deep-copied: the optimizer's own
        TypeError says why and what to do instead."""
        ckpt = Checkpoint(opt=SGD(0.1), epoch=1)
        with pytest.raises(TypeError, match=r"^cannot copy or pickle SGD\(learning_rate=0\.1"):
            copy.deepcopy(ckpt)

    def test_a_checkpoint_of_numbers_pickles(self) -> None:
        """Pickling works where every object pickles (numbers do, in their containers)."""
        again = pickle.loads(pickle.dumps(Checkpoint(epoch=3, seen={"rows": [1, 2]})))
        assert (repr(again), again.epoch, again.seen) == (
            "Checkpoint(epoch, seen)",
            3,
            {"rows": [1, 2]},
        )

    def test_a_checkpoint_of_a_variable_does_not_pickle(self) -> None:
        """A variable refuses to be pickled, with its own message, inside a checkpoint too."""
        with pytest.raises(TypeError, match=r"^cannot pickle variable 'w' \(Variable\)"):
            pickle.dumps(Checkpoint(w=Variable(np.zeros(2), name="w")))


class TestNames:
    @pytest.mark.parametrize("name", ["_objects", "__dict__", "__deepcopy__"])
    def test_a_name_of_its_own_attributes_is_refused(self, name: str) -> None:
        """The constructor refuses ``_objects`` and special names, as assigning one is
        refused, since the checkpoint's own attributes would hide such an object."""
        w = Variable(np.zeros(2), name="w")
        with pytest.raises(ValueError, match=r"^Checkpoint cannot hold an object named") as info:
            Checkpoint(**{name: w, "epoch": 1})
        assert str(info.value) == (
            f"Checkpoint cannot hold an object named {name!r}: the name is kept for its own "
            "attributes (its objects, and Python's special names), so the object could not "
            "be read back; choose another name"
        )
        ckpt = Checkpoint(epoch=1)
        with pytest.raises(ValueError, match=f"^Checkpoint cannot hold an object named {name!r}"):
            setattr(ckpt, name, w)
        assert repr(ckpt) == "Checkpoint(epoch)"

    async def test_a_name_starting_with_an_underscore_is_saved_and_restored(
        self, tmp_path: Path
    ) -> None:
        """Any other name starting with ``_`` is an object's, as it always was: a file saved
        with one restores into a checkpoint that names its object so, and assigning such a
        name adds an object."""
        ckpt = Checkpoint(_model=Variable(np.arange(3.0), name="w"), epoch=4)
        ckpt._step = 7
        path = await ckpt.save(tmp_path / "private.npz")
        w = Variable(np.zeros(3), name="w")
        again = Checkpoint(_model=w, epoch=0, _step=0)
        await again.restore(path)
        assert (repr(ckpt), again._model is w, w.numpy().tolist(), again.epoch, again._step) == (
            "Checkpoint(_model, epoch, _step)",
            True,
            [0.0, 1.0, 2.0],
            4,
            7,
        )

    def test_copies_and_pickles_keep_names_starting_with_an_underscore(self) -> None:
        """``copy``, ``copy.deepcopy`` and every pickle protocol keep an object whose name
        starts with ``_``."""
        ckpt = Checkpoint(_seen=[1, 2], epoch=3)
        copies = [copy.copy(ckpt), copy.deepcopy(ckpt)] + [
            pickle.loads(pickle.dumps(ckpt, protocol)) for protocol in range(6)
        ]
        assert [(repr(c), c._seen, c.epoch) for c in copies] == [
            ("Checkpoint(_seen, epoch)", [1, 2], 3)
        ] * 8

    def test_a_missing_name_is_an_attribute_error(self) -> None:
        """Looking up a name the checkpoint does not hold is an AttributeError at once: a
        special name, or ``_objects`` of a checkpoint not yet set up (as ``copy`` and
        ``pickle`` look some up), never a RecursionError."""
        ckpt = Checkpoint(epoch=1)
        empty = Checkpoint.__new__(Checkpoint)
        errors = []
        for target, name in [(ckpt, "_hidden"), (ckpt, "__missing__"), (empty, "_objects")]:
            with pytest.raises(AttributeError) as info:
                getattr(target, name)
            errors.append(str(info.value))
        assert errors == [
            "this Checkpoint holds no object named '_hidden'",
            "this Checkpoint has no attribute '__missing__'",
            "this Checkpoint has no attribute '_objects'",
        ]


class TestDeleting:
    async def test_a_deleted_object_is_left_out_of_saves(self, tmp_path: Path) -> None:
        """``del ckpt.name`` removes that object (as TF's Checkpoint stops tracking a deleted
        attribute): later saves leave it out, and reading it is an AttributeError."""
        ckpt = Checkpoint(epoch=1, step=10)
        del ckpt.step
        path = await ckpt.save(tmp_path / "epoch.npz")
        with pytest.raises(AttributeError, match=r"^this Checkpoint holds no object named 'step'$"):
            _ = ckpt.step
        with pytest.raises(CheckpointError, match=r"step: not in the checkpoint$"):
            await Checkpoint(epoch=0, step=0).restore(path)
        again = Checkpoint(epoch=0)
        await again.restore(path)
        assert (repr(ckpt), again.epoch) == ("Checkpoint(epoch)", 1)

    def test_deleting_a_name_it_does_not_hold_is_an_attribute_error(self) -> None:
        """Deleting a name the checkpoint does not hold is an AttributeError naming it, which
        changes nothing."""
        ckpt = Checkpoint(epoch=1)
        with pytest.raises(AttributeError, match=r"^this Checkpoint holds no object named 'step'$"):
            del ckpt.step
        assert (repr(ckpt), ckpt.epoch) == ("Checkpoint(epoch)", 1)
