"""Resumable input: iterators over ``batched`` datasets saved in checkpoints, resumed exactly.

A run interrupted at any point, saved and resumed in a fresh program (a new strategy, a new
``batched`` over the same arrays) must see exactly the batches an unbroken run sees: the rest
of the interrupted epoch, then later epochs shuffled as in the unbroken run. Every async test
runs on asyncio, uvloop and trio. Row i of the data holds the value i, so a batch says which
rows it holds.
"""

from __future__ import annotations

import json
import re
import threading
import zipfile
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy as np
import pytest
from held_writes import hold_writes

from aioreplica import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    DistributedIterator,
    MirroredStrategy,
    PerReplica,
    Variable,
    batched,
)
from aioreplica.testing import host_devices

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio

Array = np.ndarray[Any, Any]

ROWS = 22
BATCH = 4  # 6 batches an epoch, the last of 2 rows
EPOCHS = 3
SEED = 7

#: The end of every message about a manifest whose fields are malformed.
MALFORMED = "; the file is corrupted or not an aioreplica checkpoint"


def table(rows: int = ROWS, width: int = 3) -> tuple[Array, Array]:
    """Features (float32, ``width`` wide) and labels (int64) whose row i holds i."""
    x = np.repeat(np.arange(rows, dtype=np.float32)[:, None], width, axis=1)
    return x, np.arange(rows, dtype=np.int64)


def rows_of(labels: Any) -> list[list[int]]:
    """The label rows of each replica in one element (one list for one replica)."""
    parts = labels.values if isinstance(labels, PerReplica) else (labels,)
    return [np.asarray(part).tolist() for part in parts]


def manifest_entry(path: Path, name: str) -> Any:
    """The manifest entry of the object named ``name`` in the checkpoint at ``path``."""
    with np.load(path, allow_pickle=False) as npz:
        entries = json.loads(bytes(npz["manifest.json"]))["entries"]
    return next(entry for entry in entries if entry["path"] == [name])


def rewrite_manifest(source: Path, target: Path, name: str, **fields: Any) -> None:
    """Copy a checkpoint, changing fields of the manifest entry of ``name``."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            data = old.read(info.filename)
            if info.filename == "manifest.json":
                manifest = json.loads(data)
                for entry in manifest["entries"]:
                    if entry["path"] == [name]:
                        entry.update(fields)
                data = json.dumps(manifest).encode()
            new.writestr(info.filename, data)


class Program:
    """A training program's input: a strategy, a ``batched`` dataset distributed over it, and a
    checkpoint of the epoch and the current epoch's iterator. Each one is a fresh start."""

    def __init__(
        self,
        replicas: int,
        *,
        shuffle: bool = True,
        prefetch: int = 2,
        seed: int | None = SEED,
        drop_remainder: bool = False,
        rows: int = ROWS,
    ) -> None:
        self.strategy = MirroredStrategy(host_devices(replicas))
        # (a seed seeds the shuffle: there is none to seed in order)
        self.data = batched(table(rows), BATCH, shuffle=shuffle, seed=seed if shuffle else None)
        self.dist = self.strategy.distribute_dataset(
            self.data, prefetch=prefetch, drop_remainder=drop_remainder
        )
        self.ckpt = Checkpoint(epoch=0, data=aiter(self.dist))
        self.seen: list[list[list[int]]] = []

    async def train(self, stop_after: int | None = None) -> None:
        """Iterate until ``EPOCHS`` epochs are done, recording each element's rows, as a
        training loop does; or stop once ``stop_after`` elements are seen in all."""
        while self.ckpt.epoch < EPOCHS:
            async for _, labels in self.ckpt.data:
                self.seen.append(rows_of(labels))
                if len(self.seen) == stop_after:
                    return
            self.ckpt.epoch += 1
            self.ckpt.data = aiter(self.dist)

    async def interrupted(self, stop_after: int, path: Path) -> None:
        """Train ``stop_after`` elements, let the prefetcher run ahead as far as it goes, save,
        and leave the iteration (the program ends)."""
        await self.train(stop_after)
        await anyio.wait_all_tasks_blocked()
        await self.ckpt.save(path)
        await self.ckpt.data.aclose()


def global_rows(seen: list[list[list[int]]]) -> list[list[int]]:
    """Each element's rows over all replicas, in replica order."""
    return [[row for part in element for row in part] for element in seen]


class TestResumeDistributed:
    @pytest.mark.parametrize("prefetch", [0, 2])
    @pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "in-order"])
    @pytest.mark.replicas(1, 2, 4)
    async def test_interrupted_and_resumed_equals_unbroken(
        self, tmp_path: Path, replicas: int, shuffle: bool, prefetch: int
    ) -> None:
        """Stopped after any number of elements (mid-epoch, at an epoch's last batch, at the
        very end) and resumed in a fresh program, a run sees the unbroken run's batches."""
        unbroken = Program(replicas, shuffle=shuffle, prefetch=prefetch)
        await unbroken.train()
        assert len(unbroken.seen) == 6 * EPOCHS
        epochs = [global_rows(unbroken.seen[i : i + 6]) for i in range(0, 18, 6)]
        for rows in epochs:
            assert sorted(row for batch in rows for row in batch) == list(range(ROWS))
        assert (epochs[0] != epochs[1]) is shuffle

        # The first batch; before an epoch's last, partial batch; after it; the first batch of
        # the second and third epochs; the very end.
        for stop_after in [1, 5, 6, 7, 13, 18]:
            path = tmp_path / f"stopped-{stop_after}.npz"
            first = Program(replicas, shuffle=shuffle, prefetch=prefetch)
            await first.interrupted(stop_after, path)
            resumed = Program(replicas, shuffle=shuffle, prefetch=prefetch, seed=None)
            await resumed.ckpt.restore(path)
            await resumed.train()
            assert first.seen + resumed.seen == unbroken.seen, f"stopped after {stop_after}"

    async def test_resumed_on_another_number_of_replicas(self, tmp_path: Path) -> None:
        """The position counts global batches: saved with 4 replicas, resumed on 1 or 3."""
        unbroken = Program(4)
        await unbroken.train()
        first = Program(4)
        await first.interrupted(8, tmp_path / "c.npz")
        for replicas in (1, 3):
            resumed = Program(replicas)
            await resumed.ckpt.restore(tmp_path / "c.npz")
            await resumed.train()
            assert global_rows(first.seen + resumed.seen) == global_rows(unbroken.seen)

    @pytest.mark.parametrize("prefetch", [0, 3])
    async def test_position_is_what_was_handed_out(self, tmp_path: Path, prefetch: int) -> None:
        """With prefetching, the position saved is the elements handed out, not those pulled
        ahead; the entry holds the dataset, the epoch and the state before its permutation."""
        program = Program(2, prefetch=prefetch)
        iterator = program.ckpt.data
        assert isinstance(iterator, DistributedIterator)
        await iterator.get_next()
        await iterator.get_next()
        await anyio.wait_all_tasks_blocked()
        source = iterator._input_source()  # the batched epoch the prefetcher pulls from
        assert source is not None
        # Pulled: those handed out, ``prefetch`` queued, one more held by the prefetcher.
        assert source.position == (2 if prefetch == 0 else 2 + prefetch + 1)
        await program.ckpt.save(tmp_path / "c.npz")
        await iterator.aclose()

        assert manifest_entry(tmp_path / "c.npz", "data") == {
            "path": ["data"],
            "kind": "iterator",
            "rows": ROWS,
            "batch_size": BATCH,
            "shuffle": True,
            "structure": "(float32[*, 3], int64[*])",
            "epoch": 0,
            "position": 2,
            "random_state": np.random.default_rng(SEED).bit_generator.state,
        }

    async def test_later_epoch_saves_the_state_before_its_permutation(self, tmp_path: Path) -> None:
        """The third epoch's iterator saves epoch 2 and the generator after two permutations."""
        program = Program(1)
        await program.train(stop_after=13)  # the first element of the third epoch
        await program.ckpt.save(tmp_path / "c.npz")
        await program.ckpt.data.aclose()
        rng = np.random.default_rng(SEED)
        rng.permutation(ROWS)
        rng.permutation(ROWS)
        entry = manifest_entry(tmp_path / "c.npz", "data")
        assert (entry["epoch"], entry["position"]) == (2, 1)
        assert entry["random_state"] == rng.bit_generator.state

    async def test_drop_remainder_still_drops_after_a_resume(self, tmp_path: Path) -> None:
        """Resumed just before an epoch's partial last batch, the iterator drops it."""
        unbroken = Program(2, drop_remainder=True, shuffle=False)
        await unbroken.train()
        assert [len(rows) for rows in global_rows(unbroken.seen)] == [4] * 5 * EPOCHS
        first = Program(2, drop_remainder=True, shuffle=False)
        await first.interrupted(5, tmp_path / "c.npz")  # the last full batch of epoch 0
        resumed = Program(2, drop_remainder=True, shuffle=False)
        await resumed.ckpt.restore(tmp_path / "c.npz")
        await resumed.train()
        assert first.seen + resumed.seen == unbroken.seen

    @pytest.mark.parametrize("prefetch", [0, 2])
    async def test_datasets_from_function(self, tmp_path: Path, prefetch: int) -> None:
        """An iterator of ``distribute_datasets_from_function`` over a ``batched`` dataset
        saves the batches of the rounds it handed out."""

        def start() -> Checkpoint:
            strategy = MirroredStrategy(host_devices(2))
            dist = strategy.distribute_datasets_from_function(
                lambda _: batched(table(14), 2, shuffle=True, seed=3), prefetch=prefetch
            )
            return Checkpoint(data=aiter(dist))

        ckpt = start()
        unbroken = [rows_of(labels) async for _, labels in ckpt.data]
        assert [len(rows) for rows in unbroken] == [2, 2, 2, 2]
        ckpt = start()
        first = [rows_of((await ckpt.data.get_next())[1]) for _ in range(2)]
        await ckpt.save(tmp_path / "c.npz")
        await ckpt.data.aclose()
        assert manifest_entry(tmp_path / "c.npz", "data")["position"] == 4

        ckpt = start()
        await ckpt.restore(tmp_path / "c.npz")
        rest = [rows_of(labels) async for _, labels in ckpt.data]
        assert first + rest == unbroken


class TestResumePlainIterator:
    @pytest.mark.parametrize("shuffle", [True, False], ids=["shuffle", "in-order"])
    async def test_interrupted_and_resumed_equals_unbroken(
        self, tmp_path: Path, shuffle: bool
    ) -> None:
        """``iter(batched(...))`` saved mid-epoch resumes with the rest of the epoch, and the
        dataset's later epochs shuffle as in the unbroken run."""
        unbroken_data = batched(table(), BATCH, shuffle=shuffle, seed=SEED if shuffle else None)
        unbroken = [b.tolist() for _ in range(EPOCHS) for _, b in unbroken_data]

        for stop_after in [2, 6, 9]:
            data = batched(table(), BATCH, shuffle=shuffle, seed=SEED if shuffle else None)
            iterator = iter(data)
            ckpt = Checkpoint(data=iterator)
            seen = []
            for _ in range(stop_after):
                try:
                    seen.append(next(iterator)[1].tolist())
                except StopIteration:
                    iterator = ckpt.data = iter(data)
                    seen.append(next(iterator)[1].tolist())
            await ckpt.save(tmp_path / "c.npz")

            data = batched(table(), BATCH, shuffle=shuffle)
            ckpt = Checkpoint(data=iter(data))
            await ckpt.restore(tmp_path / "c.npz")
            seen += [b.tolist() for _, b in ckpt.data]
            while len(seen) < len(unbroken):
                seen += [b.tolist() for _, b in data]
            assert seen == unbroken, f"stopped after {stop_after}"

    async def test_epoch_and_position(self, tmp_path: Path) -> None:
        """The iterator tells its epoch and position; a restored one takes the saved ones, and
        the dataset's next iterator is the epoch after."""
        data = batched(np.arange(10), 3)
        first, second = iter(data), iter(data)
        next(second)
        assert [(it.epoch, it.position) for it in (first, second)] == [(0, 0), (1, 1)]
        await Checkpoint(data=second).save(tmp_path / "c.npz")
        other = batched(np.arange(10), 3)
        restored = iter(other)
        await Checkpoint(data=restored).restore(tmp_path / "c.npz")
        assert (restored.epoch, restored.position) == (1, 1)
        assert [b.tolist() for b in restored] == [[3, 4, 5], [6, 7, 8], [9]]
        assert iter(other).epoch == 2


class TestSnapshot:
    async def test_iterator_saved_as_of_the_call(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Iterators consumed while a save writes are saved where they were at the call, with
        the variables' values of that moment."""
        program = Program(2, prefetch=2)
        plain = iter(batched(table(), BATCH))
        w = Variable(np.zeros(2), name="w")
        ckpt = Checkpoint(w=w, data=program.ckpt.data, plain=plain)
        await ckpt.data.get_next()
        next(plain)
        resume = threading.Event()
        writing = hold_writes(monkeypatch, resume)
        async with anyio.create_task_group() as tg:
            tg.start_soon(CheckpointManager(ckpt, tmp_path).save)
            assert await anyio.to_thread.run_sync(writing.wait, 10)
            await ckpt.data.get_next()
            next(plain)
            await w.assign(np.ones(2))
            resume.set()
        await ckpt.data.aclose()

        saved = tmp_path / "ckpt-1.npz"
        assert [manifest_entry(saved, name)["position"] for name in ("data", "plain")] == [1, 1]
        with np.load(tmp_path / "ckpt-1.npz", allow_pickle=False) as npz:
            assert npz[manifest_entry(tmp_path / "ckpt-1.npz", "w")["array"]].tolist() == [0, 0]


class TestRefusedRestore:
    @pytest.mark.parametrize(
        ("other", "difference"),
        [
            ("rows", "rows 22 in the checkpoint, 21 here"),
            ("batch size", "batch size 4 in the checkpoint, 5 here"),
            ("no shuffle", "shuffle on in the checkpoint, off here"),
            (
                "dict",
                "batch structure (float32[*, 3], int64[*]) in the checkpoint, "
                "{'x': float32[*, 3], 'y': int64[*]} here",
            ),
            (
                "dtype",
                "batch structure (float32[*, 3], int64[*]) in the checkpoint, "
                "(float64[*, 3], int64[*]) here",
            ),
            (
                "row shape",
                "batch structure (float32[*, 3], int64[*]) in the checkpoint, "
                "(float32[*, 4], int64[*]) here",
            ),
        ],
    )
    async def test_other_dataset(self, tmp_path: Path, other: str, difference: str) -> None:
        """An iterator over a different dataset is named with what differs; nothing changes:
        not the other objects, not the iterator, not its dataset's random state."""
        first = Program(2)
        await first.interrupted(3, tmp_path / "c.npz")

        def dataset() -> batched:
            x, y = table(21 if other == "rows" else ROWS, width=4 if other == "row shape" else 3)
            if other == "dtype":
                x = x.astype(np.float64)
            arrays: Any = {"x": x, "y": y} if other == "dict" else (x, y)
            size = 5 if other == "batch size" else BATCH
            shuffle = other != "no shuffle"
            return batched(arrays, size, shuffle=shuffle, seed=1 if shuffle else None)

        data, twin = dataset(), dataset()
        iterator = aiter(MirroredStrategy(host_devices(2)).distribute_dataset(data))
        ckpt = Checkpoint(epoch=5, data=iterator)
        with pytest.raises(CheckpointError) as caught:
            await ckpt.restore(tmp_path / "c.npz")
        assert caught.value.problems == (
            f"data: the checkpoint's iterator is over another dataset: {difference}; restore "
            "into an iterator over the same batched(...) dataset",
        )
        assert ckpt.epoch == 5

        def labels(batch: Any) -> Any:
            return batch["y"] if isinstance(batch, dict) else batch[1]

        got = [global_rows([rows_of(labels(batch))])[0] async for batch in iterator]
        twin_epochs = [[labels(batch).tolist() for batch in twin] for _ in range(2)]
        assert got == twin_epochs[0]
        assert [labels(batch).tolist() for batch in data] == twin_epochs[1]

    async def test_structured_records_of_other_fields(self, tmp_path: Path) -> None:
        """Records of the same size with other fields are another dataset: the structure
        names the fields, not only the record size."""
        saved = iter(batched(np.zeros(6, dtype=[("x", "<f8")]), 2))
        next(saved)
        await Checkpoint(data=saved).save(tmp_path / "c.npz")
        iterator = iter(batched(np.zeros(6, dtype=[("label", "<i8")]), 2))
        with pytest.raises(CheckpointError) as caught:
            await Checkpoint(data=iterator).restore(tmp_path / "c.npz")
        assert caught.value.problems == (
            "data: the checkpoint's iterator is over another dataset: batch structure "
            "[('x', '<f8')][*] in the checkpoint, [('label', '<i8')][*] here; restore into an "
            "iterator over the same batched(...) dataset",
        )
        assert iterator.position == 0

    async def test_structured_records_of_older_checkpoints(self, tmp_path: Path) -> None:
        """Older checkpoints drew a structured dtype by its size alone ("void128"): a record
        of that size takes the saved place; one of another size is another dataset."""
        records = np.zeros(6, dtype=[("x", "<f8"), ("y", "<i8")])
        records["y"] = np.arange(6)
        saved = iter(batched(records, 2))
        next(saved)
        await Checkpoint(data=saved).save(tmp_path / "c.npz")
        rewrite_manifest(tmp_path / "c.npz", tmp_path / "old.npz", "data", structure="void128[*]")
        rewrite_manifest(tmp_path / "c.npz", tmp_path / "small.npz", "data", structure="void64[*]")

        iterator = iter(batched(records, 2))
        await Checkpoint(data=iterator).restore(tmp_path / "old.npz")
        assert [batch["y"].tolist() for batch in iterator] == [[2, 3], [4, 5]]

        iterator = iter(batched(records, 2))
        with pytest.raises(CheckpointError) as caught:
            await Checkpoint(data=iterator).restore(tmp_path / "small.npz")
        assert caught.value.problems == (
            "data: the checkpoint's iterator is over another dataset: batch structure "
            "void64[*] in the checkpoint, [('x', '<f8'), ('y', '<i8')][*] here; restore into "
            "an iterator over the same batched(...) dataset",
        )
        assert iterator.position == 0

    async def test_iterator_that_pulled_ahead(self, tmp_path: Path) -> None:
        """A distributed iterator that has prefetched is refused, and so is a closed one; with
        prefetch=0 one that handed out elements takes the saved place."""
        first = Program(2)
        await first.interrupted(3, tmp_path / "c.npz")

        started = Program(2, prefetch=2)
        head = await started.ckpt.data.get_next()
        with pytest.raises(CheckpointError) as caught:
            await started.ckpt.restore(tmp_path / "c.npz")
        assert caught.value.problems == (
            "data: this DistributedIterator has pulled elements ahead of those it handed out, "
            "which a restore would skip; restore into a fresh one (aiter(dataset)) before its "
            "first element, or use prefetch=0",
        )
        rest = [rows_of(labels) async for _, labels in started.ckpt.data]
        unbroken = Program(2)
        await unbroken.train(stop_after=6)
        assert [rows_of(head[1]), *rest] == unbroken.seen  # the iteration went on unchanged

        with pytest.raises(CheckpointError) as caught:
            await started.ckpt.restore(tmp_path / "c.npz")
        assert caught.value.problems == (
            "data: this DistributedIterator is closed; restore into a fresh one (aiter(dataset))",
        )

        on_demand = Program(2, prefetch=0)
        await on_demand.ckpt.data.get_next()
        await on_demand.ckpt.restore(tmp_path / "c.npz")
        await on_demand.train()
        full = Program(2)
        await full.train()
        assert on_demand.seen == full.seen[3:]

    @pytest.mark.parametrize("partial", [False, True], ids=["strict", "partial"])
    @pytest.mark.parametrize(
        ("fields", "problem"),
        [
            ({"position": 7}, "position 7 is past the end of its epoch (6 batches)"),
            (
                {"random_state": None},
                "its random state does not match its shuffle flag",
            ),
            (
                {"random_state": {"bit_generator": "MT19937"}},
                "its random state is not one of a PCG64 generator (state must be for a PCG64 RNG)",
            ),
        ],
        ids=["position", "no-random-state", "other-generator"],
    )
    async def test_corrupted_state(
        self, tmp_path: Path, fields: dict[str, Any], problem: str, partial: bool
    ) -> None:
        """An iterator entry whose state cannot be right is refused, strict or partial."""
        first = Program(2)
        await first.interrupted(3, tmp_path / "c.npz")
        rewrite_manifest(tmp_path / "c.npz", tmp_path / "bad.npz", "data", **fields)
        program = Program(2)
        with pytest.raises(CheckpointError) as caught:
            await program.ckpt.restore(tmp_path / "bad.npz", partial=partial)
        assert caught.value.problems == (f"data: {problem}; the file is corrupted",)
        await program.train(stop_after=6)
        unbroken = Program(2)
        await unbroken.train(stop_after=6)
        assert program.seen == unbroken.seen

    @pytest.mark.parametrize("partial", [False, True], ids=["strict", "partial"])
    async def test_malformed_entry(self, tmp_path: Path, partial: bool) -> None:
        """An iterator entry with fields of the wrong type is a malformed manifest."""
        first = Program(2)
        await first.interrupted(3, tmp_path / "c.npz")
        rewrite_manifest(
            tmp_path / "c.npz", tmp_path / "bad.npz", "data", shuffle="yes", position=-1
        )
        with pytest.raises(CheckpointError) as caught:
            await Program(2).ckpt.restore(tmp_path / "bad.npz", partial=partial)
        assert caught.value.problems == (
            "manifest entry 0 (data): 'shuffle' must be true or false, got 'yes'" + MALFORMED,
            "manifest entry 0 (data): 'position' must be an int >= 0, got -1" + MALFORMED,
        )


class TestRefusedIterators:
    @pytest.mark.parametrize(
        ("make", "message"),
        [
            (
                lambda: (b for b in [np.zeros(2)]),
                "data is an iterator (generator) with no position to save; a checkpoint saves "
                "only iterators over an aioreplica.batched dataset: iter(batched(...)), "
                "aiter(strategy.distribute_dataset(batched(...))) and "
                "aiter(strategy.distribute_datasets_from_function(fn)) where fn returns "
                "batched(...) (InputReplicationMode.PER_WORKER, the default)",
            ),
            (
                lambda: iter([np.zeros(2)]),
                "data is an iterator (list_iterator) with no position to save",
            ),
            (
                lambda: aiter(MirroredStrategy(host_devices(2)).distribute_dataset([np.zeros(2)])),
                "data is a DistributedIterator over a list; a checkpoint saves only iterators "
                "over an aioreplica.batched dataset",
            ),
            (
                lambda: aiter(
                    MirroredStrategy(host_devices(2)).distribute_dataset(b for b in [np.zeros(2)])
                ),
                "data is a DistributedIterator over a generator",
            ),
            (
                lambda: aiter(
                    MirroredStrategy(host_devices(2)).distribute_dataset(
                        iter(batched(np.zeros(4), 2))
                    )
                ),
                "data is a DistributedIterator over a BatchedIterator",
            ),
            (
                lambda: batched(np.zeros(4), 2),
                "data is a batched dataset, which has no place of its own to save: save its "
                "iterator, iter(dataset) or aiter(strategy.distribute_dataset(dataset))",
            ),
        ],
        ids=[
            "generator",
            "list",
            "distributed-list",
            "distributed-generator",
            "distributed-batched-iterator",
            "dataset",
        ],
    )
    async def test_refused_at_construction(self, make: Any, message: str) -> None:
        """An iterator over another source is refused when the checkpoint is made, or when it
        is assigned, saying which iterators can be saved."""
        obj = make()
        try:
            with pytest.raises(TypeError, match=f"^Checkpoint: {re.escape(message)}"):
                Checkpoint(data=obj)
            ckpt = Checkpoint(epoch=1)
            with pytest.raises(TypeError, match=r"^Checkpoint: model/data is "):
                ckpt.model = {"data": obj}
            assert repr(ckpt) == "Checkpoint(epoch)"
        finally:
            if isinstance(obj, DistributedIterator):
                await obj.aclose()
