"""Checkpoints across workers: a collective save the chief writes, restore everywhere, and a
CheckpointManager whose numbering and pruning come from the chief.

The ranks share one directory (made by rank 0, its name broadcast): the shared filesystem the
multi-worker strategy assumes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

from aioreplica import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    InputContext,
    ReplicaSyncError,
    Variable,
    batched,
)
from aioreplica._cluster import WorkersDisagree
from aioreplica.optimizers import Adam
from aioreplica.testing import replica_id
from multiworker.mwtools import (
    RANK,
    WORKERS,
    WORLD,
    allgather,
    assert_same_on_every_worker,
    shared_directory,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from aioreplica import DistributedIterator, MultiWorkerMirroredStrategy
    from multiworker.mwtools import MakeStrategy

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]
NUMBERED = re.compile(r"ckpt-\d+\.npz$")


class Model:
    """A weight, a sync-on-read metric and an Adam optimizer, trained one step."""

    def __init__(self, strategy: MultiWorkerMirroredStrategy) -> None:
        self.strategy = strategy
        with strategy.scope():
            self.w = Variable(np.arange(6.0).reshape(2, 3) * (RANK + 1), name="w")
            self.seen = Variable(0, name="seen", synchronization="on_read", aggregation="sum")
        self.optimizer = Adam(0.1)

    async def train(self, scale: float) -> None:
        async def step() -> None:
            g = replica_id()
            await self.optimizer.apply_gradients([(np.full((2, 3), scale * (g + 1)), self.w)])
            await self.seen.assign_add(g + 1)

        await self.strategy.run(step)

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(w=self.w, seen=self.seen, optimizer=self.optimizer, epoch=3)

    def state(self) -> list[Any]:
        """What must be equal on every worker: the weight's and the slots' copies, the step."""
        slots = [copy for slot in self.optimizer.variables() for copy in slot.values]
        return [*self.w.values, *slots, self.optimizer.iterations]


async def read_back(path: str) -> Checkpoint:
    """The file's values, restored into plain variables outside any strategy."""
    w = Variable(np.zeros((2, 3)), name="w")
    ckpt = Checkpoint(w=w, seen=Variable(0, name="seen"), optimizer=Adam(0.1), epoch=0)
    await ckpt.restore(path)
    return ckpt


@pytest.mark.parametrize("local", [1, 2])
async def test_save_is_collective_and_complete_on_return(
    make_strategy: MakeStrategy, local: int
) -> None:
    """Every worker's save returns the same path once the file is complete: the non-chief
    reads it at once and finds the global values (the sync-on-read sum over all workers)."""
    strategy = make_strategy(local)
    model = Model(strategy)
    await model.train(1.0)
    n = WORKERS * local
    with shared_directory() as directory:
        path = os.path.join(directory, "model.npz")
        returned = await model.checkpoint().save(path)
        assert returned == path
        assert allgather(returned) == [path] * WORKERS
        back = await read_back(path)  # on every rank, at once
        np.testing.assert_array_equal(back.w.numpy(), model.w.values[0])
        assert int(back.seen.numpy()) == sum(g + 1 for g in range(n))
        assert back.optimizer.iterations == 1
        assert back.epoch == 3
        assert sorted(os.listdir(directory)) == ["model.npz"]  # no temporaries left
        WORLD.Barrier()


@pytest.mark.parametrize("local", [1, 2])
async def test_restore_on_every_worker(make_strategy: MakeStrategy, local: int) -> None:
    """After more training, restoring brings every worker back to the saved state, bitwise
    equal across workers; the sync-on-read metric reads the saved global total again."""
    strategy = make_strategy(local)
    model = Model(strategy)
    await model.train(1.0)
    saved_w = np.array(model.w.values[0])
    saved_seen = int(model.seen.numpy())
    with shared_directory() as directory:
        ckpt = model.checkpoint()
        path = await ckpt.save(os.path.join(directory, "model.npz"))
        await model.train(5.0)
        ckpt.epoch = 9
        assert not np.array_equal(model.w.values[0], saved_w)
        await ckpt.restore(path)
        for copy in model.w.values:
            np.testing.assert_array_equal(copy, saved_w)
        assert model.optimizer.iterations == 1
        assert ckpt.epoch == 3
        assert int(model.seen.numpy()) == saved_seen
        assert_same_on_every_worker(*model.state())
        # Training goes on from the restored state identically everywhere.
        await model.train(2.0)
        assert_same_on_every_worker(*model.state())
        WORLD.Barrier()


async def test_manager_numbering_and_pruning_come_from_the_chief(
    make_strategy: MakeStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The non-chief's manager, made before the chief's saw an older checkpoint, still numbers
    as the chief does, keeps the chief's list, and never deletes a file itself."""
    strategy = make_strategy(2)
    model = Model(strategy)
    deleted: list[str] = []
    if RANK != 0:
        for name in ("unlink", "remove"):
            real = getattr(os, name)

            def recording(path: Any, *args: Any, _real: Any = real, **kwargs: Any) -> None:
                if NUMBERED.search(os.fspath(path)):
                    deleted.append(os.fspath(path))
                _real(path, *args, **kwargs)

            monkeypatch.setattr(os, name, recording)
    with shared_directory() as directory:
        run = os.path.join(directory, "run")
        seed = await model.checkpoint().save(os.path.join(directory, "seed.npz"))
        managers: list[CheckpointManager] = []
        if RANK != 0:  # made while the directory does not exist yet
            managers.append(CheckpointManager(model.checkpoint(), run, max_to_keep=2))
        WORLD.Barrier()
        if RANK == 0:  # an older run left checkpoint 5
            os.makedirs(run)
            shutil.copyfile(seed, os.path.join(run, "ckpt-5.npz"))
            managers.append(CheckpointManager(model.checkpoint(), run, max_to_keep=2))
        manager = managers[0]
        paths = []
        for scale in (1.0, 2.0, 3.0):
            await model.train(scale)
            paths.append(await manager.save())
            assert allgather(paths[-1]) == [paths[-1]] * WORKERS
        assert [os.path.basename(p) for p in paths] == ["ckpt-6.npz", "ckpt-7.npz", "ckpt-8.npz"]
        assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-7.npz", "ckpt-8.npz"]
        assert manager.latest == paths[-1]
        assert sorted(f for f in os.listdir(run) if NUMBERED.search(f)) == [
            "ckpt-7.npz",
            "ckpt-8.npz",
        ]
        assert allgather(deleted) == [[]] * WORKERS  # only the chief (not recorded) deletes
        WORLD.Barrier()


async def test_manager_restore_latest_on_every_worker(make_strategy: MakeStrategy) -> None:
    """A manager made after a restart finds the latest checkpoint on every worker; restoring
    it there gives every worker the saved weights."""
    strategy = make_strategy(2)
    model = Model(strategy)
    with shared_directory() as directory:
        manager = CheckpointManager(model.checkpoint(), directory, max_to_keep=3)
        for scale in (1.0, 2.0):
            await model.train(scale)
            await manager.save()
        saved = np.array(model.w.values[0])
        await model.train(7.0)
        restarted = CheckpointManager(model.checkpoint(), directory, max_to_keep=3)
        latest = restarted.latest
        assert latest is not None
        assert allgather(os.path.basename(latest)) == ["ckpt-2.npz"] * WORKERS
        await model.checkpoint().restore(latest)
        for copy in model.w.values:
            np.testing.assert_array_equal(copy, saved)
        assert_same_on_every_worker(*model.state())
        WORLD.Barrier()


@pytest.mark.parametrize("name", ["ckpt", "other"])
async def test_a_manager_made_with_a_workers_own_directory_names_the_chiefs_files(
    make_strategy: MakeStrategy, name: str
) -> None:
    """TF's multi-worker programs give the other workers' managers a temporary directory of
    their own: only the chief writes, and after a save every worker's ``latest`` and
    ``checkpoints`` name the chief's files, the ones ``save()`` returned (also when the
    other workers' managers were given another ``checkpoint_name``); the other workers'
    directories stay unmade, and restoring ``latest`` works everywhere."""
    strategy = make_strategy(1)
    model = Model(strategy)
    with shared_directory() as directory:
        task_id = strategy.cluster_resolver.task_id
        own = directory if task_id == 0 else os.path.join(directory, f"workertemp_{task_id}")
        manager = CheckpointManager(
            model.checkpoint(),
            own,
            max_to_keep=1,
            checkpoint_name="ckpt" if task_id == 0 else name,
        )
        for scale in (1.0, 2.0):
            await model.train(scale)
            path = await manager.save()
            assert allgather(path) == [path] * WORKERS
            assert manager.latest_checkpoint == path
            assert manager.checkpoints == [path]
            assert manager.directory == directory
            assert os.path.basename(path) in os.listdir(directory)
        assert [f for f in os.listdir(directory) if f.startswith("workertemp")] == []
        saved = np.array(model.w.values[0])
        await model.train(5.0)
        await model.checkpoint().restore(path)  # manager.latest_checkpoint, as checked
        np.testing.assert_array_equal(model.w.values[0], saved)
        assert_same_on_every_worker(*model.state())
        WORLD.Barrier()


async def test_restoring_no_checkpoint_on_every_worker_is_a_new_run(
    make_strategy: MakeStrategy,
) -> None:
    """TF's resume idiom on a first run: every worker's manager finds no file, and
    ``restore(manager.latest)`` (None) changes nothing anywhere; after a save the same line
    restores the chief's file on every worker."""
    strategy = make_strategy(2)
    model = Model(strategy)
    with shared_directory() as directory:
        manager = CheckpointManager(model.checkpoint(), os.path.join(directory, "run"))
        await model.train(1.0)
        before = model.state()
        report = await model.checkpoint().restore(manager.latest)
        assert (manager.latest, report.path, report.restored) == (None, None, ())
        assert not report.complete
        assert_same_on_every_worker(*model.state())
        for now, then in zip(model.state(), before, strict=True):
            np.testing.assert_array_equal(now, then)
        await manager.save()
        await model.train(2.0)
        await model.checkpoint().restore(manager.latest)
        for now, then in zip(model.state(), before, strict=True):
            np.testing.assert_array_equal(now, then)
        assert_same_on_every_worker(*model.state())
        WORLD.Barrier()


async def test_restore_or_initialize_on_every_worker(make_strategy: MakeStrategy) -> None:
    """A first run: every worker finds no checkpoint and calls ``init_fn`` (a write outside
    run(), so the chief's value everywhere); after a save and a restart, every worker restores
    the chief's file and calls nothing; a worker whose manager looks elsewhere makes every
    worker raise, naming it, with nothing restored and ``init_fn`` not called."""
    strategy = make_strategy(2)
    model = Model(strategy)
    calls: list[str] = []

    async def pretrained() -> None:
        calls.append("init")
        await model.w.assign(np.full((2, 3), 10.0 * (RANK + 1)))

    with shared_directory() as directory:
        manager = CheckpointManager(model.checkpoint(), directory, init_fn=pretrained)
        assert await manager.restore_or_initialize() is None
        assert calls == ["init"]
        np.testing.assert_array_equal(model.w.values[0], np.full((2, 3), 10.0))
        await model.train(1.0)
        path = await manager.save()
        saved = model.state()
        await model.train(2.0)
        restarted = CheckpointManager(model.checkpoint(), directory, init_fn=pretrained)
        assert await restarted.restore_or_initialize() == path
        for now, then in zip(model.state(), saved, strict=True):
            np.testing.assert_array_equal(now, then)
        assert calls == ["init"]
        assert_same_on_every_worker(*model.state())

        own = directory if RANK == 0 else os.path.join(directory, f"elsewhere_{RANK}")
        astray = CheckpointManager(model.checkpoint(), own, init_fn=pretrained)
        with pytest.raises(ValueError, match=r"worker 1: Checkpoint\.restore of no checkpoint"):
            await astray.restore_or_initialize()
        assert calls == ["init"]
        for now, then in zip(model.state(), saved, strict=True):
            np.testing.assert_array_equal(now, then)
        WORLD.Barrier()


@pytest.mark.parametrize("case", ["other file", "missing file", "corrupted file", "no checkpoint"])
async def test_a_restore_that_differs_on_one_worker_restores_nowhere(
    make_strategy: MakeStrategy, case: str
) -> None:
    """Worker 1 restores another checkpoint, or one it cannot read, or none (``None``, as the
    ``latest`` of a manager that found no file): every worker raises (worker 1 its own error,
    the others a ValueError naming it and what it met), no worker restored anything, so the
    copies stay identical, and then the same file restores everywhere."""
    strategy = make_strategy(2)
    model = Model(strategy)
    with shared_directory() as directory:
        first = await model.checkpoint().save(os.path.join(directory, "first.npz"))
        await model.train(1.0)
        second = await model.checkpoint().save(os.path.join(directory, "second.npz"))
        await model.train(2.0)
        before = [np.array(copy) for copy in model.w.values]
        path: str | None = second
        if RANK == 1 and case == "other file":
            path = first
        elif RANK == 1 and case == "no checkpoint":
            path = None
        elif RANK == 1 and case == "missing file":  # a long path, whose error reaches
            # every worker whole
            path = os.path.join(directory, "a-run-of-a-long-name-" * 8, "missing.npz")
        elif RANK == 1:
            path = os.path.join(directory, "corrupted.npz")
            await anyio.Path(path).write_bytes(b"not a checkpoint")
        own = {"other file": ValueError, "missing file": FileNotFoundError}
        expected = own.get(case, ValueError) if RANK == 1 else ValueError
        with pytest.raises(expected) as caught:
            await model.checkpoint().restore(path)
        refused = allgather(str(caught.value).splitlines()[0])[1]
        for copy, kept in zip(model.w.values, before, strict=True):
            np.testing.assert_array_equal(copy, kept)
        assert_same_on_every_worker(*model.state())
        await model.checkpoint().restore(second)
        await model.train(3.0)  # the strategy goes on working
        assert_same_on_every_worker(*model.state())
        WORLD.Barrier()
    # What the others were told (checked once every worker has left the shared directory):
    if RANK != 1:
        message = str(caught.value)
        assert "worker 1" in message
        if case in ("missing file", "corrupted file"):
            assert isinstance(caught.value, WorkersDisagree)
            assert caught.value.workers == (1,)
            assert ": worker 1 refused what it was given (worker 0: " in message, message
            assert refused in message, (refused, message)  # whole, however long
        if case == "other file":  # each worker's file by its name, this one's full path
            assert "(second.npz) into" in message, message
            assert "(first.npz) into" in message, message
            notes = "\n".join(caught.value.__notes__)
            assert f"this worker restores {second!r} into" in notes, notes
            assert "restore the same file, the chief's" in notes
        if case == "no checkpoint":
            assert "worker 1: Checkpoint.restore of no checkpoint (path None)" in message
        elif case != "other file":
            assert "Checkpoint.restore refusing the file" in message
            assert ("FileNotFoundError" if case == "missing file" else "CheckpointError") in (
                message
            )


async def test_a_restore_into_other_variables_on_one_worker_restores_nowhere(
    make_strategy: MakeStrategy,
) -> None:
    """Worker 1 restores the file into another variable at the same path (of the same name,
    shape and dtype): its copies would take what another variable's took on the chief. Every
    worker raises the same ValueError, with a note naming the variables it restores into, and
    no copy changed anywhere; then the same variables restore everywhere."""
    strategy = make_strategy(1)
    with strategy.scope():
        a = Variable(np.zeros(2), name="w")
        b = Variable(np.zeros(2), name="w")
    with shared_directory() as directory:
        await a.assign(np.ones(2))
        await b.assign(np.full(2, 9.0))
        saved = await Checkpoint(w=a).save(os.path.join(directory, "a.npz"))
        await a.assign(np.full(2, 2.0))
        mine = a if RANK == 0 else b
        ckpt = Checkpoint(w=mine)
        with pytest.raises(ValueError, match=r"Checkpoint\.restore of a file") as caught:
            await ckpt.restore(saved)
        # The same after the what (each worker's own words for the restore):
        assert len({m.split(":", 1)[1] for m in allgather(str(caught.value))}) == 1
        label = "variable #0 'w'" if RANK == 0 else "variable #1 'w'"
        assert f"this worker restores {saved!r} into w: {label}; every worker must restore" in (
            "\n".join(getattr(caught.value, "__notes__", []))
        ), getattr(caught.value, "__notes__", None)
        for variable, want in ((a, 2.0), (b, 9.0)):
            for copy in variable.values:
                np.testing.assert_array_equal(copy, np.full(2, want))
            assert_same_on_every_worker(*variable.values)
        await Checkpoint(w=a).restore(saved)
        np.testing.assert_array_equal(a.values[0], np.ones(2))
        assert_same_on_every_worker(*a.values)
        WORLD.Barrier()


def changed_after_construction(ckpt: Checkpoint, bad: bool) -> Checkpoint:
    """A checkpoint of ``ckpt``'s weight and a dict, which gets a str (no checkpoint value)
    after the checkpoint is made, where ``bad``."""
    config: dict[str, Any] = {"epoch": 3}
    changed = Checkpoint(w=ckpt.w, config=config)
    if bad:
        config["note"] = "a str"
    return changed


#: Bad arguments to a save or a restore, by the call they go to.
BAD_CHECKPOINT_CALLS: dict[str, tuple[Callable[[Any, Any, str, bool], Awaitable[Any]], type]] = {
    "save of a changed dict": (
        lambda ckpt, manager, path, bad: changed_after_construction(ckpt, bad).save(path),
        TypeError,
    ),
    "restore into a changed dict": (
        lambda ckpt, manager, path, bad: changed_after_construction(ckpt, bad).restore(
            path.replace("good.npz", "changed.npz")  # its objects, before the change
        ),
        TypeError,
    ),
    "save path": (lambda ckpt, manager, path, bad: ckpt.save(7 if bad else path), TypeError),
    "manager number": (lambda ckpt, manager, path, bad: manager.save(-1 if bad else 3), ValueError),
    "restore partial": (
        lambda ckpt, manager, path, bad: ckpt.restore(path, partial="yes" if bad else False),
        TypeError,
    ),
}


@pytest.mark.parametrize("everywhere", [True, False], ids=["every worker", "one worker"])
@pytest.mark.parametrize("case", list(BAD_CHECKPOINT_CALLS))
async def test_bad_checkpoint_arguments_refused_in_step(
    make_strategy: MakeStrategy, case: str, everywhere: bool
) -> None:
    """A save or restore whose arguments one worker refuses raises on every worker (that error
    there, a ValueError naming it on the others) instead of leaving them waiting for it;
    nothing is written, and the workers stay in step."""
    strategy = make_strategy(1)
    model = Model(strategy)
    call, own = BAD_CHECKPOINT_CALLS[case]
    bad = everywhere or RANK == WORKERS - 1
    with shared_directory() as directory:
        path = await model.checkpoint().save(os.path.join(directory, "good.npz"))
        unchanged = changed_after_construction(model.checkpoint(), bad=False)
        await unchanged.save(os.path.join(directory, "changed.npz"))
        manager = CheckpointManager(model.checkpoint(), os.path.join(directory, "run"))
        before = sorted(os.listdir(directory))
        with pytest.raises((TypeError, ValueError)) as caught:
            await call(model.checkpoint(), manager, path, bad)
        if bad:
            assert caught.type is own
        else:
            assert f"worker {WORKERS - 1}" in str(caught.value)
            assert own.__name__ in str(caught.value)
        assert sorted(os.listdir(directory)) == before
        await model.train(1.0)  # in step
        assert_same_on_every_worker(*model.state())
        WORLD.Barrier()


async def test_a_save_cancelled_on_the_chief_fails_the_others(make_strategy: MakeStrategy) -> None:
    """A save cancelled on the chief before it writes counts as the chief failing: the others,
    waiting for its answer, raise ReplicaSyncError naming it at once instead of waiting on
    (past their own deadlines), and no file is written."""
    strategy = make_strategy(1)
    model = Model(strategy)
    ckpt = model.checkpoint()
    with shared_directory() as directory:
        path = os.path.join(directory, "cancelled.npz")
        with anyio.fail_after(20):
            if RANK == 0:
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    await ckpt.save(path)
                assert scope.cancelled_caught
            else:
                with pytest.raises(ReplicaSyncError) as caught:
                    await ckpt.save(path)
                assert caught.value.workers == (0,)
                # (in the save's own exchange, in its broadcast, or between waits)
                shown = (
                    r"worker 0 failed: its Checkpoint\.save was (stopped|interrupted) by Cancelled"
                )
                assert re.search(shown, str(caught.value)), str(caught.value)
        WORLD.Barrier()
        assert "cancelled.npz" not in os.listdir(directory)


@pytest.mark.parametrize("manager", [False, True])
async def test_a_save_of_other_objects_on_one_worker_is_refused_on_every_worker(
    make_strategy: MakeStrategy, manager: bool
) -> None:
    """Worker 1's checkpoint holds the same variables at swapped paths: only the chief
    writes, so worker 1 would find the chief's file holding what it did not save. Every
    worker raises the same disagreement before anything is written (worker 1's note names
    its objects), and the strategy goes on: a save of the same objects works after it."""
    strategy = make_strategy(1)
    with strategy.scope():
        a = Variable(1.0, name="a")
        b = Variable(2.0, name="b")
    ours = Checkpoint(a=a, b=b) if RANK == 0 else Checkpoint(a=b, b=a)
    with shared_directory() as directory:
        path = os.path.join(directory, "ck.npz")

        async def save(checkpoint: Checkpoint) -> str | None:
            if manager:
                return await CheckpointManager(checkpoint, directory, None).save()
            return await checkpoint.save(path)

        with pytest.raises(WorkersDisagree, match="of objects") as caught:
            await save(ours)
        written = sorted(os.listdir(directory))
        again = await save(Checkpoint(a=a, b=b))
        WORLD.Barrier()
    assert len(set(allgather(str(caught.value)))) == 1
    note = caught.value.__notes__[-1]
    saved_at_a = "'a'" if RANK == 0 else "'b'"
    assert re.match(rf"this worker saves a: variable #\d+ {saved_at_a}, b: ", note), note
    assert written == []
    assert again is not None
    assert os.path.basename(again) in ("ck.npz", "ckpt-1.npz")


def own_input(context: InputContext) -> batched:
    """Each worker's own input: its own rows, more of them on worker 1, shuffled with its
    own seed."""
    pipeline = context.input_pipeline_id
    return batched(np.arange(8 + 6 * pipeline) + 1000 * pipeline, 2, shuffle=True, seed=pipeline)


async def batches_left(iterator: DistributedIterator) -> list[list[int]]:
    """Every batch that ``iterator`` still hands out this epoch, as this worker's rows."""
    return [np.asarray(batch).tolist() async for batch in iterator]


async def test_each_worker_resumes_its_own_input(make_strategy: MakeStrategy) -> None:
    """Iterators of ``distribute_datasets_from_function`` (a shuffle seeded per worker,
    inputs of other lengths), in a checkpoint with no variable: the chief writes one file
    holding every worker's place, and each worker resumes on its own next batches."""
    strategy = make_strategy(1)
    with shared_directory() as directory:
        dataset = strategy.distribute_datasets_from_function(own_input)
        iterator = aiter(dataset)
        manager = CheckpointManager(Checkpoint(step=2, data=iterator), directory)
        for _ in range(2):
            await iterator.get_next()
        path = await manager.save()
        expected = await batches_left(iterator)
        assert allgather(path) == [path] * WORKERS
        assert os.listdir(directory) == ["ckpt-1.npz"]
        resumed = aiter(dataset)
        restarted = CheckpointManager(Checkpoint(step=0, data=resumed), directory)
        assert await restarted.restore_or_initialize() == path
        assert await batches_left(resumed) == expected
        assert {row // 1000 for batch in expected for row in batch} == {RANK}  # its own
        WORLD.Barrier()


async def test_places_of_each_worker_are_refused_under_another_worker_count(
    make_strategy: MakeStrategy,
) -> None:
    """A checkpoint holding each worker's own place is refused, on every worker, by a run
    with another number of workers (here one: a plain iterator), naming the counts."""
    strategy = make_strategy(1)
    with shared_directory() as directory:
        iterator = aiter(strategy.distribute_datasets_from_function(own_input))
        await iterator.get_next()
        path = await Checkpoint(data=iterator).save(os.path.join(directory, "data.npz"))
        alone = iter(own_input(InputContext(num_input_pipelines=WORKERS, input_pipeline_id=RANK)))
        with pytest.raises(CheckpointError) as refused:
            await Checkpoint(data=alone).restore(path)
        assert refused.value.problems == (
            f"data: the checkpoint holds a place for each of {WORKERS} workers (each iterated "
            "its own input, or was at another batch), and this run has 1 worker: each worker "
            f"resumes only its own place, so restore it with {WORKERS} workers, or restore the "
            "rest with partial=True and start this iterator anew",
        )
        assert alone.position == 0
        WORLD.Barrier()


async def test_the_same_place_on_every_worker_is_saved_once(make_strategy: MakeStrategy) -> None:
    """A ``distribute_dataset`` iterator is at the same place on every worker: the file
    holds it once (a version-1 file), and it restores under any number of workers."""
    strategy = make_strategy(1)
    with shared_directory() as directory:
        iterator = aiter(
            strategy.distribute_dataset(batched(np.arange(12), 4, shuffle=True, seed=5))
        )
        await iterator.get_next()
        path = await Checkpoint(data=iterator).save(os.path.join(directory, "data.npz"))
        with zipfile.ZipFile(path) as archive:
            manifest = json.loads(archive.read("manifest.json"))
        assert manifest["version"] == 1
        assert "workers" not in manifest["entries"][0]
        alone = iter(batched(np.arange(12), 4, shuffle=True))
        assert (await Checkpoint(data=alone).restore(path)).complete
        assert alone.position == 1
        WORLD.Barrier()


async def test_a_save_whose_folder_is_a_file_names_it_on_every_worker(
    make_strategy: MakeStrategy,
) -> None:
    """The manager's folder replaced by a file: the chief's save raises
    ``NotADirectoryError`` naming it, and the others' ``OSError`` carries what the chief's
    save was doing."""
    strategy = make_strategy(1)
    model = Model(strategy)
    with shared_directory() as directory:
        folder = os.path.join(directory, "run")
        manager = CheckpointManager(model.checkpoint(), folder)
        WORLD.Barrier()  # every worker's manager is made (it refuses a file) before the file is
        if RANK == 0:
            await anyio.Path(folder).write_bytes(b"")
        WORLD.Barrier()
        with pytest.raises(OSError, match=r"cannot save|could not write") as caught:
            await manager.save()
        path = os.path.join(folder, "ckpt-1.npz")
        doing = f"while saving checkpoint {path!r}: making its folder {folder!r}; any file"
        if RANK == 0:
            assert isinstance(caught.value, NotADirectoryError)
            assert caught.value.filename == folder
            assert caught.value.__notes__[0].startswith(doing)
        else:
            assert str(caught.value).startswith(
                "the chief (worker 0) could not write the checkpoint: NotADirectoryError: "
            )
            assert caught.value.__notes__[0].startswith(f"on the chief: {doing}")
        assert manager.checkpoints == []
        WORLD.Barrier()


async def test_the_chiefs_file_by_another_path_restores_on_every_worker(
    make_strategy: MakeStrategy,
) -> None:
    """A worker may reach the chief's file by another path (a symlink here, as another mount
    point of the shared filesystem): the workers agree on the file itself, so it restores."""
    strategy = make_strategy(1)
    model = Model(strategy)
    saved = np.array(model.w.values[0])
    with shared_directory() as directory:
        path = await model.checkpoint().save(os.path.join(directory, "model.npz"))
        mount = os.path.join(directory, "mount")
        if RANK == 0:
            os.symlink(directory, mount)
        WORLD.Barrier()
        try:
            await model.train(5.0)
            mine = path if RANK == 0 else os.path.join(mount, "model.npz")
            assert (await model.checkpoint().restore(mine)).complete
            np.testing.assert_array_equal(model.w.values[0], saved)
            assert_same_on_every_worker(*model.state())
        finally:
            WORLD.Barrier()
            if RANK == 0:
                os.remove(mount)


async def test_a_restore_cancelled_once_the_workers_agreed_commits_on_every_worker(
    make_strategy: MakeStrategy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the workers agreed to restore, every worker commits: worker 1's caller, cancelled
    right after the agreement (a large variable, whose new copies take a while), gets its
    cancellation only after the commit."""
    strategy = make_strategy(1)
    saved = np.arange(4_000_000.0)
    with strategy.scope():
        w = Variable(saved, name="w")
    with shared_directory() as directory:
        ckpt = Checkpoint(w=w)
        path = await ckpt.save(os.path.join(directory, "big.npz"))
        await w.assign(0.0)
        agree = Checkpoint._agree_to_restore
        with anyio.CancelScope() as scope:

            async def agreed(self: Checkpoint, *args: Any) -> None:
                await agree(self, *args)
                if RANK == 1:
                    scope.cancel()

            monkeypatch.setattr(Checkpoint, "_agree_to_restore", agreed)
            await ckpt.restore(path)
        assert allgather(scope.cancelled_caught) == [False, True]
        np.testing.assert_array_equal(w.values[0], saved)
        WORLD.Barrier()


async def test_a_restore_on_a_broken_cluster_resumes_this_workers_own_place(
    make_strategy: MakeStrategy,
) -> None:
    """After a failure each worker's restore is its own; a file holding each worker's place
    still restores this worker's: the run still has its workers, though they agree on nothing
    more (so the iterator is not read here: its passes agree on each batch)."""
    strategy = make_strategy(1)
    with shared_directory() as directory:
        dataset = strategy.distribute_datasets_from_function(own_input)
        iterator = aiter(dataset)
        await iterator.get_next()
        path = await Checkpoint(data=iterator).save(os.path.join(directory, "data.npz"))

        async def step() -> None:
            if RANK == 1:
                raise RuntimeError("worker 1 fails")

        with pytest.raises((RuntimeError, ReplicaSyncError)):
            await strategy.run(step)
        report = await Checkpoint(data=aiter(dataset)).restore(path)
        assert (report.complete, report.restored) == (True, ("data",))
        WORLD.Barrier()


async def test_the_workers_gather_bytes_of_any_length(make_strategy: MakeStrategy) -> None:
    """What gathers the iterator places: every worker's bytes, in worker order, whatever
    their lengths (none at all included)."""
    strategy = make_strategy(1)
    workers = strategy._engine.cluster
    assert workers is not None
    mine = b"" if RANK == 0 else b"place of worker %d" % RANK
    gathered = await workers.allgather_bytes(mine, what="a test")
    assert gathered == [b"" if w == 0 else b"place of worker %d" % w for w in range(WORKERS)]


async def test_a_checkpoint_of_two_strategies_reads_each_ones_sync_on_read_variables(
    make_strategy: MakeStrategy,
) -> None:
    """A checkpoint holding sync-on-read variables of two multi-worker strategies: the save
    holds the first one's call and awaits the reads over its workers; the other's variable it
    reads at once, before any await, with blocking calls (new, it first takes the chief's
    value). The file holds each variable's value over every worker."""
    first, second = make_strategy(1), make_strategy(2)
    with first.scope():
        total = Variable(0.0, synchronization="on_read", aggregation="sum", name="total")
    with second.scope():  # never used yet: still to take the chief's value
        chief = Variable(
            float(RANK + 5), synchronization="on_read", aggregation="only_first_replica"
        )

    async def step() -> None:
        await total.assign(1.0)

    await first.run(step)
    with shared_directory() as directory:
        path = await Checkpoint(total=total, chief=chief).save(f"{directory}/two.npz")
        with np.load(path) as saved:
            values = sorted(float(saved[k]) for k in saved.files if k != "manifest.json")
    assert values == sorted([float(WORKERS), 5.0])
    assert float(chief) == 5.0
