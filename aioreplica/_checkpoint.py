"""Checkpoints: variables, optimizers and counters in one atomic ``.npz`` file.

File format
    A checkpoint is a ZIP archive that ``numpy.load`` reads: one ``.npy`` member per saved
    array (``a0.npy``, ``a1.npy``, ...) and a ``manifest.json`` member::

        {"format": "aioreplica.checkpoint", "version": 1, "entries": [
          {"path": ["model", "w"], "kind": "variable", "array": "a0", "dtype": "<f8",
           "shape": [64, 10], "synchronization": "auto", "aggregation": "none"},
          {"path": ["optimizer"], "kind": "optimizer", "class": "SGD", "array": "a1",
           "slot_names": ["momentum"], "learning_rate": "a4",
           "slots": [{"variable": ["model", "w"], "slot": "momentum", "array": "a2",
                      "dtype": "<f8", "shape": [64, 10]}]},
          {"path": ["epoch"], "kind": "number", "type": "int", "array": "a3"},
          {"path": ["data"], "kind": "iterator", "rows": 1437, "batch_size": 64,
           "shuffle": true, "structure": "(float64[*, 64], int64[*])", "epoch": 2,
           "position": 5, "random_state": {"bit_generator": "PCG64", "state": {...}, ...}}]}

    A path is the object's place in ``Checkpoint(**objects)``: keyword, then dict keys and
    list indices. A mirrored variable saves its primary copy, a sync-on-read variable its
    aggregate (restored as in TF: ``SUM`` divided again by the replica count), so a
    checkpoint restores into any number of replicas, on any kind of device. An optimizer saves
    its step count, and its slots under the path of the variable they belong to. A variable
    the optimizer has no slots for yet (no step trained it) has none in the file: restored,
    its slots restart at their initial values. A number learning rate is saved as an array
    (``learning_rate`` names it); a schedule or callable is code, never saved, and a variable
    is saved as a variable where the program puts it: ``null``.
    Files written before learning rates were saved have no ``learning_rate`` field.

    An ``iterator`` entry is the place of an iterator over a ``batched`` dataset, a plain one
    (``iter(batched(...))``) or a distributed one (``aiter(strategy.distribute_dataset(...))``),
    held in the manifest alone: the dataset it expects (``rows``, ``batch_size``, ``shuffle``
    and the batch ``structure``, each leaf as its dtype and row shape), its ``epoch``, its
    ``position`` (the batches it had handed out; prefetched ones do not count) and, with
    shuffling, the ``random_state`` of the dataset's NumPy generator from before that epoch's
    permutation was drawn (its 128-bit integers are plain JSON numbers). Restoring it draws that
    permutation again, so the iteration goes on at the next batch, and later epochs shuffle as
    in an unbroken run. The dataset must match; a distributed iterator must not have pulled
    ahead yet (restore into a fresh one); the number of replicas may differ.

    Across workers each worker has its own place (``distribute_datasets_from_function`` gives
    each its own input): the chief gathers them, and an entry whose places differ holds them
    all in ``workers``, a list of such places by worker index (the fields above keep the
    chief's). Each worker restores its own, so such an entry restores only under the same
    number of workers. A file with such an entry is format version 2; every other file is
    version 1, which earlier versions of aioreplica read too.

    Arrays are written in the writing machine's byte order, and their manifest ``dtype`` says
    which; a restore reads either order, into this machine's.

Saving is atomic
    The file is written under a temporary name in the target directory,
    ``.<name>.<host>.<pid>.<random>.tmp``, flushed and fsynced, then renamed over the target
    (and the directory fsynced). A crash at any point leaves the previous checkpoint whole: at
    worst the temporary stays behind. The values written are those at the moment of the call.
    Where ``<name>`` is too long for the temporary's name to fit the file system's limit
    (255 bytes), it is cut short and followed by ``~``: ``.<start of name>~.<host>...``.

    Every save checks the objects first, as ``Checkpoint(...)`` does (the dicts and lists
    given to it may have changed since): it never writes a file that ``restore`` could not
    restore into the same objects.

Numbered checkpoints
    A ``CheckpointManager``'s saves run one at a time, in the order they were called: each
    gets its own number, and pruning old files never races with a write. A save cancelled
    before its file is written leaves nothing; once the write has started, the save finishes,
    including the deletion of checkpoints beyond ``max_to_keep``, and the cancellation then
    takes effect. A file on disk is deleted before the manager forgets it. One that cannot be
    deleted (it became a folder, or the OS refuses) is forgotten all the same, with a
    ``RuntimeWarning`` naming it: the new checkpoint is written and listed, and the manager
    lists at most ``max_to_keep``. Otherwise at most ``max_to_keep`` checkpoints stay, plus,
    while a save runs, the temporary it writes. A save's default number is one more than the
    highest it keeps or finds in the directory, looked up as the written file is put in place
    (in the same worker-thread job, one manager of the process at a time), and the file is
    linked there without replacing any: if another writer took that name meanwhile, the save
    takes the next number. So a numbered save never replaces a file it did not write, even
    with another manager (of this process or another) saving into the same directory. An
    explicit ``checkpoint_number`` replaces the file of that number, as in TF.

    A writer killed mid-write (``SIGKILL``, a power cut) leaves its temporary. The first save
    of a manager removes the stale temporaries of its own checkpoints: those of a process of
    this host that has ended, and those of another host (or of unknown origin) older than
    ``STALE_AFTER`` seconds (an hour), whose writer cannot be asked. A temporary of a live
    process of this host, this one included, always stays. A temporary whose name was cut
    short counts as the manager's when what is left of the name could be one of its
    checkpoints' (so a stale one of a manager whose name begins the same may go too).

Restoring changes nothing unless everything fits
    The objects are checked first, as ``Checkpoint(...)`` does (the dicts and lists given to
    it may have changed since): one that a restore could not set raises the constructor's
    ``TypeError`` (or ``ValueError``), before the file is read. The file is read whole (with
    ``allow_pickle=False``: a checkpoint never runs code; ZIP checksums catch corruption; an
    array whose header claims more bytes than its member holds, or a member more than the
    file holds, is refused before anything is allocated), the manifest is checked field by
    field, every entry is checked against the objects (names, kinds, dtypes, shapes), and only
    then are the new copies computed and everything committed in one synchronous step. Any
    problem with the file, whatever reading or parsing it raised, raises ``CheckpointError``
    listing every problem by object path or manifest entry, with every object unchanged. The
    objects are checked once more just before the commit: a restore whose objects changed
    while it waited for its turn raises ``CheckpointError`` too, changing nothing. The new
    copies are computed and committed holding the write turns of every variable, slot and
    optimizer restored (invariant 8), so a write or an optimizer step called meanwhile applies
    after the restore, on the restored values, and one that was under way when the restore
    took its turns finishes first.

    A partial restore (``restore(path, partial=True)``) restores every object whose path,
    kind, dtype and shape (class and slots for an optimizer, dataset for an iterator) match,
    leaves the others as they are and names them in its ``RestoreReport``; an optimizer's
    slots follow their variables. A file that cannot be read, a malformed manifest, an entry
    whose values contradict its manifest, and an optimizer with slots for a variable outside
    the checkpoint are refused in both modes, changing nothing. What a partial restore does
    restore, it restores as a strict one does: checked first, committed at once, holding the
    same write turns.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import json
import math
import operator
import os
import re
import secrets
import socket
import sys
import threading
import time
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, SupportsIndex, final, overload

import anyio
import numpy as np

from . import _trace, _tree
from ._batched import BatchedIterator, ResumableInput, batched
from ._cluster import WorkersDisagree, call_of, error_line
from ._context import context_state
from ._dataset import DistributedIterator
from ._errors import INT64_MAX, INT64_MIN, CheckpointError, add_note, as_real, checked_integer
from ._optimizers import (
    MAX_ITERATIONS,
    Optimizer,
    check_slots_to_restore,
    restore_state,
    slot_table,
    slots_to_restore,
)
from ._variables import (
    AcrossWorkers,
    Aggregate,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    new_copies,
    settle_here,
    snapshot,
    sync_variables,
    variable_label,
)
from ._writes import Turn, commit, taking_turns, to_host

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

    from typing_extensions import TypeVar

    from ._cluster import Workers

    #: The type of a ``CheckpointManager``'s ``checkpoint_interval``: with one, ``save``
    #: returns ``str | None`` (a save it holds back returns ``None``), else ``str``.
    _Interval = TypeVar("_Interval", bound="SupportsIndex | None", default=None, covariant=True)
else:  # a default needs typing_extensions before Python 3.13; only type checkers use it
    from typing import TypeVar

    _Interval = TypeVar("_Interval", covariant=True)

__all__ = ["Checkpoint", "CheckpointManager", "RestoreReport", "latest_checkpoint"]

FORMAT: Final = "aioreplica.checkpoint"
#: The newest format version this aioreplica reads and writes. Version 2 added the place of an
#: iterator on each worker (an iterator entry's ``workers``); a file that needs none is written
#: as version 1, which earlier versions of aioreplica read too.
VERSION: Final = 2
_MANIFEST: Final = "manifest.json"

#: How old (in seconds) a temporary must be before a manager removes it when it cannot ask
#: its writer: one from another host, or of unknown origin.
STALE_AFTER: Final = 3600.0

Path = tuple[str | int, ...]


def _show(path: Path) -> str:
    return "/".join(map(str, path))


@final
class Checkpoint:
    """A set of objects saved and restored together.

    Objects are given by keyword: variables, optimizers (their step count and slots), plain
    ``int`` or ``float`` values such as an epoch counter, iterators over ``batched`` datasets
    (their place in the epoch), and dicts, lists and tuples of these. NumPy's integer and
    floating scalars (``np.int64(3)``) are numbers too, saved and restored as the Python int
    or float they are; an array, even a 0-d one, belongs in a variable. A number is restored in
    place: at the top level read it back as an attribute (``ckpt.epoch``); inside a dict or
    list it is written back into that container. Assigning an attribute (``ckpt.epoch = 3``)
    replaces or adds an object.

    An iterator is either ``iter(batched(...))`` or a distributed one over a ``batched``
    dataset, ``aiter(strategy.distribute_dataset(batched(...)))`` (or over one ``batched``
    per worker, from ``distribute_datasets_from_function``: each worker saves and restores
    its own place). It saves its epoch, the batches it has handed out (not those prefetched)
    and the dataset's random state, so a run resumed from the checkpoint sees the batches an
    unbroken run would have seen. Restore it into a fresh iterator over the same
    ``batched(...)`` (same arrays, batch size and shuffle); a new ``iter()`` of that dataset
    then begins the next epoch, shuffled as in the unbroken run.

    Args:
        **objects: what to save, by name.

    Raises:
        TypeError: an object of another kind (an iterator over another source included), a
            dict key that is not a string, or a number inside a tuple (which cannot be
            restored in place).
        ValueError: a name that is ``save``, ``restore``, ``_objects`` or a special name such
            as ``__dict__`` (the checkpoint's own attributes would hide the object).

    Example:
        >>> w = aioreplica.Variable(np.zeros(3), name="w")
        >>> ckpt = Checkpoint(model={"w": w}, epoch=0)
        >>> path = anyio.run(ckpt.save, tmp / "model.npz")
        >>> anyio.run(w.assign, 1.0)
        <aioreplica.Variable 'w' shape=(3,) dtype=float64 value=array([1., 1., 1.])>
        >>> _ = anyio.run(ckpt.restore, path)
        >>> w.numpy()
        array([0., 0., 0.])

        The place of an iterator over a ``batched`` dataset:

        >>> data = aioreplica.batched(np.arange(10), 4, shuffle=True, seed=0)
        >>> iterator = iter(data)
        >>> next(iterator).tolist()
        [4, 6, 2, 7]
        >>> ckpt = Checkpoint(data=iterator)
        >>> path = anyio.run(ckpt.save, tmp / "data.npz")
        >>> resumed = Checkpoint(data=iter(aioreplica.batched(np.arange(10), 4, shuffle=True)))
        >>> _ = anyio.run(resumed.restore, path)
        >>> [batch.tolist() for batch in resumed.data] == [batch.tolist() for batch in iterator]
        True
    """

    __slots__ = ("_objects",)

    def __init__(self, **objects: Any) -> None:
        for name, value in objects.items():
            _check_name(name)
            _check_objects("Checkpoint", name, value)
        object.__setattr__(self, "_objects", dict(objects))

    def __getattr__(self, name: str) -> Any:
        # No object has a name that ``_check_name`` refuses: such a name not found
        # (``_objects`` of a copy being made, ``__setstate__``) is simply missing, and is not
        # looked up in ``_objects``, which may not be set yet.
        if _clashes(name):
            raise AttributeError(f"this Checkpoint has no attribute {name!r}")
        try:
            return self._objects[name]
        except KeyError:
            instead = _TF_ONLY.get(name)
            if instead is not None:
                raise AttributeError(
                    f"aioreplica's Checkpoint has no {name!r} (TF's Checkpoint.{name}); {instead}"
                ) from None
            raise AttributeError(f"this Checkpoint holds no object named {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        _check_name(name)
        _check_objects("Checkpoint", name, value)
        self._objects[name] = value

    def __delattr__(self, name: str) -> None:
        """Remove the object named ``name`` (as ``del`` of a TF ``Checkpoint``'s attribute
        stops tracking it): later saves leave it out, and restores leave it as it is.

        Raises:
            AttributeError: this checkpoint holds no object named ``name``.

        Example:
            >>> ckpt = Checkpoint(epoch=1, step=10)
            >>> del ckpt.step
            >>> ckpt
            Checkpoint(epoch)
        """
        try:
            del self._objects[name]
        except KeyError:
            raise AttributeError(f"this Checkpoint holds no object named {name!r}") from None

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy`` and ``pickle`` take of a checkpoint: its objects, by name.

        ``copy.copy(ckpt)`` is a new checkpoint of the same objects (names added to or
        removed from one leave the other as it is); ``copy.deepcopy(ckpt)`` one of deep copies
        of them, as ``copy.deepcopy`` makes each (a variable's is a new variable; an optimizer
        refuses it). Pickling works where every object pickles: numbers do, variables and
        optimizers refuse it.

        Example:
            >>> import copy
            >>> w = aioreplica.Variable(np.zeros(2), name="w")
            >>> ckpt = Checkpoint(w=w, epoch=1)
            >>> copy.copy(ckpt).w is w
            True
            >>> copy.deepcopy(ckpt).w is w  # a new variable, holding the same values
            False
        """
        return dict(self._objects)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Take the objects of ``state`` (``__getstate__``'s), checked as the constructor
        checks them.

        Raises:
            TypeError, ValueError: as the constructor.

        Example:
            >>> import pickle
            >>> pickle.loads(pickle.dumps(Checkpoint(epoch=3))).epoch
            3
        """
        for name, value in state.items():
            _check_name(name)
            _check_objects("Checkpoint", name, value)
        object.__setattr__(self, "_objects", dict(state))

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._objects)})"

    async def save(self, path: str | os.PathLike[str]) -> str:
        """Write every object to ``path`` atomically; return the path.

        The values saved are those at the moment of the call (a consistent snapshot, even
        while other tasks keep training). The file is written in a worker thread, and once
        started it finishes even if the caller is cancelled.

        The objects are checked again first, as ``Checkpoint(...)`` checks them: a dict or
        list given to the checkpoint may have changed since, and a save never writes what
        ``restore`` could not restore. A refused save writes nothing.

        Args:
            path: the file to write (``.npz`` by convention); its directory must exist.

        Returns:
            ``path`` as a string.

        Raises:
            RuntimeError: called inside a replica (save from cross-replica code, after
                ``run()``).
            ValueError: an optimizer has slots for a variable that is not in this checkpoint;
                an int does not fit in 64 bits; a sync-on-read variable has aggregation
                ``NONE`` (its copies have no one value to save); ``path`` is empty or ends with
                a path separator.
            TypeError: ``path`` is not a path (a str, bytes or ``os.PathLike``); a container
                of the checkpoint now holds an object of another kind (a str, None, ...), a
                number inside a tuple, or a dict key that is not a string.
            OSError: the file cannot be written: the OS's very error, naming ``path`` (a
                note names the temporary file the save was writing); across workers, on the
                other workers, an ``OSError`` naming the chief and that error. Any previous
                file at ``path`` is intact.

        Example:
            >>> ckpt = Checkpoint(step=3)
            >>> anyio.run(ckpt.save, tmp / "step.npz").endswith("step.npz")
            True
        """
        _check_not_in_replica("Checkpoint.save")
        workers = self._workers()
        if workers is None:
            target = _file_path_of("Checkpoint.save", path, writing=True)
            return await self._snapshot("Checkpoint.save").write(target)
        async with workers.call("Checkpoint.save"):
            try:
                target = _file_path_of("Checkpoint.save", path, writing=True)
                self._check("Checkpoint.save")
            except (TypeError, ValueError) as exc:  # refused on every worker, in step
                await workers.refuse_in_step("Checkpoint.save", exc)
                raise
            snap = await self._collective_snapshot(workers, "Checkpoint.save")
            return await _chief_writes(workers, lambda: snap.write(target), None)

    def _check(self, caller: str) -> None:
        """Check the objects as they are now, as ``Checkpoint(...)`` does: a dict or list
        given to the checkpoint may have changed since.

        Raises:
            TypeError: an object of another kind, a number inside a tuple, a dict key that is
                not a string (each message begins with ``caller``).
            ValueError: an int outside 64 bits.
        """
        for name, value in self._objects.items():
            _check_objects(caller, name, value)

    def _structure(self) -> list[tuple[Path, Any]]:
        """Each object's path with the object's identity (a number's: its type), to tell
        whether the checkpoint's containers changed while a restore waited."""
        return [
            (path, type(obj) if _kind(obj) == "number" else id(obj)) for path, obj in self._leaves()
        ]

    def _workers(self) -> Workers | None:
        """The workers of a multi-worker strategy whose variables or distributed iterators
        this checkpoint holds.

        ``None`` too for objects nested in themselves, which ``_check`` then refuses on each
        worker (alike, with no collective: the objects are found on none).
        """
        try:
            leaves = list(self._leaves())
        except RecursionError:
            return None
        for _, obj in leaves:
            workers: Workers | None = None
            if isinstance(obj, Variable):
                engine = getattr(obj, "_engine", None)
                workers = None if engine is None else engine.cluster
            elif isinstance(obj, DistributedIterator):
                workers = obj._input_workers()
            if workers is not None:
                return workers
        return None

    async def _collective_snapshot(self, workers: Workers, caller: str) -> _Snapshot:
        """The snapshot of a save on several workers, once every worker is here (an
        agreement named ``caller``, as a wait there for a late or cancelled worker says)."""
        await self._agree_to_save(workers, caller)
        return await self._synced_snapshot(workers, caller)

    async def _agree_to_save(self, workers: Workers, caller: str, detail: str = "") -> None:
        """Agree with the other workers to save (``caller``, and ``detail`` they compare too)
        the same objects at the same paths: only the chief writes, so a worker whose
        checkpoint holds other objects, or the same ones at other paths, would find the
        chief's file holding what it did not save.

        Raises:
            WorkersDisagree: the workers' checkpoints hold other objects, or their calls
                differ.
        """
        held, placed = self._placement(every_object=True)
        try:
            await workers.barrier(caller, f"{detail} of objects {placed:08x}")
        except WorkersDisagree as exc:
            add_note(
                exc,
                f"this worker saves {', '.join(held) or 'no objects'}; every worker must save "
                "the same objects at the same paths (the chief writes the file for all)",
            )
            raise

    async def _synced_snapshot(self, workers: Workers, caller: str) -> _Snapshot:
        """The snapshot of a save on several workers, every worker here: new variables take
        the chief's values, sync-on-read ones are read over all workers, and each iterator
        holds every worker's place."""
        if workers.pending:
            await sync_variables(workers)
        snap = self._snapshot(caller)
        await snap.read_across_workers(workers, caller)
        await _gather_places(workers, snap)
        return snap

    def _snapshot(self, caller: str) -> _Snapshot:
        """Every value to save, taken at once with no await in between: a consistent snapshot.

        The objects are checked first (``_check``), with no await in between either.
        """
        self._check(caller)
        snap = _Snapshot()
        leaves = list(self._leaves())
        variable_paths = {id(v): p for p, v in leaves if isinstance(v, Variable)}
        for obj_path, obj in leaves:
            if isinstance(obj, Variable):
                # Only a NONE variable's refusal is wrapped (across workers, a sync-on-read
                # variable is read later: ``_Snapshot.read_across_workers``).
                none = (
                    isinstance(obj, SyncOnReadVariable)
                    and obj.aggregation is VariableAggregation.NONE
                )
                try:
                    array, device = snapshot(obj)
                except ValueError as exc:
                    if not none:
                        raise
                    raise ValueError(
                        f"{caller}: cannot save {_show(obj_path)}: {exc}; nothing was written"
                    ) from exc
                snap.entries.append(_variable_entry(obj_path, obj, snap.add(array, device)))
            elif isinstance(obj, Optimizer):
                snap.entries.append(_optimizer_entry(obj_path, obj, variable_paths, snap.add))
            elif _is_input(obj):
                state = obj._input_state()
                snap.entries.append({"path": list(obj_path), "kind": "iterator", **state})
            else:
                number = _number(obj)
                snap.entries.append(
                    {
                        "path": list(obj_path),
                        "kind": "number",
                        "type": type(number).__name__,
                        "array": snap.add(number),
                    }
                )
        return snap

    async def restore(
        self, path: str | os.PathLike[str] | None, *, partial: bool = False
    ) -> RestoreReport:
        """Set every object to its value in the checkpoint at ``path``, or change nothing.

        Every entry is checked first: each object must be in the file with the same kind,
        dtype and shape, and the file must hold nothing else. The number of replicas and the
        kind of device may differ from when it was saved. An optimizer without slots yet
        gets them from the file; one with slots for a variable that the file restores but
        holds no slots for (saved before a step trained it) has them reset to their initial
        values, as they were then. A number learning rate is restored into an optimizer
        whose learning rate is a number; a number on one side and a schedule or callable on
        the other is a mismatch. An iterator continues where the saved one was. The objects
        themselves are checked again too, as ``Checkpoint(...)`` checks them (a dict or list
        given to the checkpoint may have changed since), before anything changes, and once
        more just before the restore commits.

        With ``partial=True`` the objects that do not fit are skipped instead: every object
        whose path, kind, dtype and shape match is restored (an optimizer of the same class
        and slots; an iterator over the same dataset), the others keep their values, and the
        report names them. An optimizer's slots follow their variables: the slots of a
        variable that is skipped are skipped too. This is how a model with a new head is
        fine-tuned from a checkpoint of the old one.

        Once the file is read and checked, the restore takes its place among the writes and
        optimizer steps of the objects it restores: those under way finish first, those
        called afterwards apply to the restored values.

        ``path=None`` means there is no checkpoint yet (``manager.latest`` before the first
        save): nothing changes, as in TF, so ``await ckpt.restore(manager.latest)`` starts
        a new run or resumes one. The report says so: its ``path`` is ``None`` and every
        object is in ``only_in_program``.

        With variables or distributed iterators of a ``MultiWorkerMirroredStrategy`` it is
        collective, as ``save`` is: every worker calls it, and before any value changes the
        workers agree that each one read and checked the same file (by its checksums and
        name: a worker may reach the chief's file by another path, through a symlink or
        another mount point). If one could not, or read another file, every worker raises
        and none restores anything. Each worker's iterator takes its own place from the file.

        A cancellation of the caller that arrives before the restore commits (while the file
        is read, say, which is not given up midway) cancels it, changing nothing. Across
        workers it does so up to their agreement, after which every worker commits and the
        cancellation reaches the caller once its worker has.

        Args:
            path: a file written by ``save`` or ``CheckpointManager.save``, or ``None``.
            partial: restore what fits and report the rest, instead of refusing it all.

        Returns:
            A ``RestoreReport``: what was restored and, for a partial restore, what was
            skipped (a strict restore of a file that returns has skipped nothing).

        Raises:
            CheckpointError: the file is truncated, corrupted, not a checkpoint, or of a
                newer format version; an optimizer has slots for a variable outside this
                checkpoint, or would get slots for a variable its ``build()`` refuses (one of
                another strategy than the optimizer's); a distributed iterator has pulled
                ahead; one variable is at two paths whose values in the file differ; the
                checkpoint's dicts or lists changed while the restore waited for its turn; or
                (unless ``partial``) an object does not match (an iterator whose file holds
                each worker's place, restored under another number of workers, included).
                ``problems`` names each object concerned. Nothing changed.
            FileNotFoundError: there is no such file.
            IsADirectoryError: ``path`` is a folder (restore a file in it, such as
                ``latest_checkpoint(folder)``).
            TypeError: ``partial`` is not a bool; ``path`` is not a path or None; a container
                of the checkpoint now holds an object it cannot restore (as ``save``).
                Nothing changed.
            RuntimeError: called inside a replica.
            ValueError: ``path`` is empty; an int does not fit in 64 bits. (Several
                workers) another worker could not read or check its file, or read another
                checkpoint, or had none (``WorkersDisagree``, naming it). Nothing changed.
            ReplicaSyncError: (several workers) a worker failed, or was late past the
                strategy's ``sync_timeout``.

        Example:
            >>> ckpt = Checkpoint(step=3)
            >>> path = anyio.run(ckpt.save, tmp / "step.npz")
            >>> ckpt.step = 5
            >>> report = anyio.run(ckpt.restore, path)
            >>> report.complete, report.restored, ckpt.step
            (True, ('step',), 3)

            A partial restore skips what does not fit, and says so:

            >>> ckpt = Checkpoint(step=5, head=aioreplica.Variable(np.zeros(2)))
            >>> report = anyio.run(lambda: ckpt.restore(path, partial=True))
            >>> report.restored, report.only_in_program, ckpt.step
            (('step',), ('head',), 3)

            No checkpoint yet, nothing restored:

            >>> print(anyio.run(ckpt.restore, None))
            no checkpoint to restore (path None): every object kept its value
        """
        _check_not_in_replica("Checkpoint.restore")
        restoring = self._restore(path, partial)
        args = {"path": str(path)}
        report: RestoreReport = await _trace.traced(restoring, "checkpoint restore", args)
        return report

    async def _restore(self, where: str | os.PathLike[str] | None, partial: bool) -> RestoreReport:
        workers = self._workers()
        # A file's per-worker places are this worker's even when the cluster is broken.
        worker = (0, 1) if workers is None else (workers.worker_index, workers.num_workers)
        if workers is not None and workers.broken:
            workers = None  # no more agreements after a failure: this worker's restore alone
        async with call_of(workers, "Checkpoint.restore"):
            return await self._restore_on(workers, worker, where, partial)

    async def _restore_on(
        self,
        workers: Workers | None,
        worker: tuple[int, int],
        where: str | os.PathLike[str] | None,
        partial: bool,
    ) -> RestoreReport:
        """``restore`` on this worker alone (``workers`` None), or on every worker; ``worker``
        is this worker's index and the number of workers (``(0, 1)`` without workers)."""
        if where is None and isinstance(partial, bool):
            return await self._restore_nothing(workers)
        try:
            if not isinstance(partial, bool):
                raise TypeError(f"partial must be True or False, got {partial!r}")
            path = _file_path_of("Checkpoint.restore", where)
            self._check("Checkpoint.restore")
            manifest, arrays, fingerprint = await anyio.to_thread.run_sync(_read, path)
            # The read is not given up midway: a cancellation meanwhile takes effect here.
            await anyio.lowlevel.checkpoint_if_cancelled()
            self._check("Checkpoint.restore")  # again: the containers may change meanwhile
            structure = self._structure()
            plan = _Plan(path, manifest, arrays, partial=partial, worker=worker)
            for obj_path, obj in self._leaves():
                plan.expect(obj_path, obj, self._leaves)
            await plan.finish()
        except BaseException as exc:
            if workers is not None:
                await _refuse_restore(workers, exc)
            raise
        if workers is not None:  # every worker restores the same file, or none does
            await self._agree_to_restore(workers, path, fingerprint)
        # Everything fits. Take the write turns of everything restored (an optimizer's new
        # slots included), so that no write or step interleaves with this one. ``build`` may
        # still give an optimizer slots while the copies are computed: then commit is refused
        # and the restore starts over.
        # Across workers, once they agreed, every worker commits: a cancellation of this
        # caller meanwhile reaches it after the commit, not between the agreement and it.
        with anyio.CancelScope(shield=workers is not None):
            while True:
                async with taking_turns(plan.turns):
                    if await plan.commit(
                        self._set_number, lambda: self._check_unchanged(path, structure)
                    ):
                        break
        await anyio.lowlevel.checkpoint_if_cancelled()
        return plan.report()

    def _check_unchanged(self, path: str, structure: list[tuple[Path, Any]]) -> None:
        """Raise ``CheckpointError`` unless the objects are still those that a restore of
        ``path`` planned for (``structure``), and still fit a checkpoint. A restore calls it
        with no await before its commit, so what it checks holds at the commit."""
        changed = "the checkpoint's objects changed while the restore waited for its turn"
        try:
            self._check("Checkpoint.restore")
        except (TypeError, ValueError) as exc:
            raise CheckpointError(path, [f"{changed}: {exc}; nothing was restored"]) from exc
        if self._structure() != structure:
            raise CheckpointError(
                path,
                [
                    f"{changed} (an object added, removed or replaced in one of its dicts or "
                    "lists); nothing was restored: restore again"
                ],
            )

    async def _restore_nothing(self, workers: Workers | None) -> RestoreReport:
        """``restore(None)``: there is no checkpoint (``manager.latest`` before the first
        save), so every object keeps its value, as in TF. Across workers every worker must have
        none: one that restores a file meanwhile makes every worker raise."""
        if workers is not None:
            try:
                await workers.barrier("Checkpoint.restore of no checkpoint (path None)")
            except WorkersDisagree as exc:
                add_note(
                    exc,
                    "this worker has no checkpoint to restore (path None), another has one; "
                    "every worker must restore the same file, the chief's, or none: "
                    + _CHIEFS_FILE,
                )
                raise
        kept = tuple(sorted(_show(path) for path, _ in self._leaves()))
        return RestoreReport(None, only_in_program=kept)

    async def _agree_to_restore(self, workers: Workers, path: str, fingerprint: int) -> None:
        """Agree with the other workers to restore the file ``path`` (of ``fingerprint``)
        into the same multi-worker variables: each restored at the same path on every worker,
        or the copies of one would take what another's took elsewhere.

        The workers compare the file's fingerprint and name, not its full path: a worker may
        reach the chief's file by another path (a symlink, another mount point of the shared
        filesystem). The full path is only shown when they disagree.

        Raises:
            WorkersDisagree: the workers restore different files, or into other variables.
        """
        into, placed = self._placement(every_object=False)
        try:
            await workers.barrier(
                f"Checkpoint.restore of a file {fingerprint:08x} ({os.path.basename(path)}) "
                f"into variables {placed:08x}"
            )
        except WorkersDisagree as exc:
            add_note(
                exc,
                f"this worker restores {_full_path(path)!r} into "
                f"{', '.join(into) or 'no variables'}; every worker must restore the same "
                f"file, the chief's, into the same variables: {_CHIEFS_FILE}",
            )
            raise

    def _placement(self, *, every_object: bool) -> tuple[list[str], int]:
        """Where the checkpoint holds its multi-worker variables (each path with the
        variable's number and name), and with ``every_object`` its other objects too (each
        path with its kind); and a checksum of that, which the workers compare."""
        placed = []
        for path, obj in self._leaves():
            if isinstance(obj, Variable) and obj._number is not None:
                placed.append(f"{_show(path)}: {variable_label(obj)}")
            elif every_object:
                placed.append(f"{_show(path)}: {_kind(obj)}")
        return placed, zlib.crc32("; ".join(placed).encode())

    def _leaves(self) -> Iterator[tuple[Path, Any]]:
        pairs, _ = _tree.flatten_with_path(self._objects)
        for key_path, leaf in pairs:
            yield _plain_path(key_path), leaf

    def _set_number(self, path: Path, value: int | float) -> None:
        _parent(self._objects, path)[path[-1]] = value


#: How every worker restores the chief's file, for the messages of a restore across workers.
_CHIEFS_FILE: Final = (
    "give every worker's CheckpointManager the chief's directory (on a filesystem every worker "
    "shares, at the same path), or restore the path that the chief's save returned"
)

#: TF's ``Checkpoint`` members that this one has no use for, with what to use instead.
_TF_ONLY: Final = {
    "write": "await ckpt.save(path) writes exactly the path given, atomically, as TF's write "
    "does; number the files with a CheckpointManager",
    "read": "await ckpt.restore(path) reads exactly the path given, as TF's read does",
    "save_counter": "a Checkpoint numbers nothing: a CheckpointManager numbers its saves "
    "(manager.checkpoints, manager.latest); to count saves or steps, keep an int or a "
    "variable in the checkpoint",
}


@final
@dataclass(frozen=True)
class RestoreReport:
    """What ``Checkpoint.restore`` restored, and what a partial restore skipped.

    Objects are named by path as in ``CheckpointError``: ``model/w``, ``epoch``, ``data``;
    an optimizer's slot as ``<optimizer>/slots/<variable>/<slot>``. A skipped object kept
    its value.

    Attributes:
        path: the checkpoint file (``None``: there was none, and nothing was restored).
        restored: the objects restored (an optimizer with its step count and the slots of
            the variables restored).
        only_in_file: what the file holds but this checkpoint does not: objects, and the
            slots of variables that are not here.
        only_in_program: objects of this checkpoint that the file lacks, and optimizer slots
            of variables that the file has no slots for.
        mismatched: ``(path, what differs)`` for each object at the same path in both but of
            another kind, dtype or shape (both given), optimizer class or dataset, and for
            the slots of such variables.

    Example:
        >>> report = RestoreReport(
        ...     "ft.npz", restored=("body/w",), only_in_program=("head/w",),
        ...     mismatched=(("head/b", "shape (10,) in the checkpoint, (3,) here"),),
        ... )
        >>> report.complete, report.skipped
        (False, ('head/b', 'head/w'))
        >>> print(report)
        restored 1 of the objects of checkpoint 'ft.npz', skipped 2:
          restored: body/w
          only here, left as they were: head/w
          mismatched, left as they were:
            head/b: shape (10,) in the checkpoint, (3,) here
    """

    path: str | None
    restored: tuple[str, ...] = ()
    only_in_file: tuple[str, ...] = ()
    only_in_program: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, str], ...] = ()

    @property
    def skipped(self) -> tuple[str, ...]:
        """Every path skipped on either side, sorted."""
        mismatched = [path for path, _ in self.mismatched]
        return tuple(sorted({*self.only_in_file, *self.only_in_program, *mismatched}))

    @property
    def complete(self) -> bool:
        """Whether nothing was skipped: every object of both sides was restored."""
        return not (self.only_in_file or self.only_in_program or self.mismatched)

    def assert_consumed(self) -> RestoreReport:
        """Check that the restore was complete, as TF's status method of this name does:
        every object of the file and of the program restored, nothing skipped.

        Returns:
            This report, so that calls chain.

        Raises:
            AssertionError: something was skipped (named, as ``str(report)`` names it), or
                there was no checkpoint (``path`` None).

        Example:
            >>> RestoreReport("c.npz", restored=("w",)).assert_consumed().restored
            ('w',)
            >>> RestoreReport("c.npz", only_in_file=("head/w",)).assert_consumed()
            Traceback (most recent call last):
            AssertionError: not every object was matched: restored 0 of the objects ...
        """
        if self.path is None or not self.complete:
            raise AssertionError(f"not every object was matched: {self}")
        return self

    def assert_existing_objects_matched(self) -> RestoreReport:
        """Check that every object of the program was restored, as TF's status method of
        this name does; what only the file holds does not count.

        Returns:
            This report, so that calls chain.

        Raises:
            AssertionError: an object of the program (or an optimizer's slots) was not in
                the file or did not match it (each named), or there was no checkpoint
                (``path`` None).

        Example:
            >>> report = RestoreReport("c.npz", restored=("w",), only_in_file=("head/w",))
            >>> report.assert_existing_objects_matched().complete
            False
            >>> RestoreReport("c.npz", only_in_program=("b",)).assert_existing_objects_matched()
            Traceback (most recent call last):
            AssertionError: objects of this program were not restored from 'c.npz': b
        """
        unmatched = [*self.only_in_program, *(path for path, _ in self.mismatched)]
        if self.path is None:
            raise AssertionError(f"not every object was matched: {self}")
        if unmatched:
            raise AssertionError(
                f"objects of this program were not restored from {self.path!r}: "
                f"{', '.join(sorted(unmatched))}"
            )
        return self

    def expect_partial(self) -> RestoreReport:
        """Return this report, as TF's status method of this name returns its status.

        TF warns at exit about what a restore left unused unless this is called; nothing
        here warns (a strict restore refuses a mismatch, and a partial one reports it), so
        there is nothing to silence.

        Returns:
            This report.

        Raises:
            Nothing.

        Example:
            >>> RestoreReport("c.npz", only_in_file=("head/w",)).expect_partial().skipped
            ('head/w',)
        """
        return self

    def __str__(self) -> str:
        if self.path is None:
            return "no checkpoint to restore (path None): every object kept its value"
        restored = ", ".join(self.restored) or "nothing"
        if self.complete:
            return f"restored every object of checkpoint {self.path!r}: {restored}"
        lines = [
            f"restored {len(self.restored)} of the objects of checkpoint {self.path!r}, "
            f"skipped {len(self.skipped)}:",
            f"  restored: {restored}",
        ]
        if self.only_in_file:
            lines.append(f"  only in the file, not restored: {', '.join(self.only_in_file)}")
        if self.only_in_program:
            lines.append(f"  only here, left as they were: {', '.join(self.only_in_program)}")
        if self.mismatched:
            lines.append("  mismatched, left as they were:")
            lines += [f"    {path}: {what}" for path, what in self.mismatched]
        return "\n".join(lines)


@final
class CheckpointManager(Generic[_Interval]):
    """Numbered checkpoints in a directory, keeping the newest ``max_to_keep``.

    Files are named ``<checkpoint_name>-<number>.npz``. Existing ones in ``directory`` are
    found when the manager is made, so a restarted program resumes from ``latest`` (also
    ``latest_checkpoint``, TF's name; ``None`` before the first save):
    ``restore_or_initialize()`` restores it, or calls ``init_fn`` when there is none.
    Files found so are listed by number (there is no state file beside them, as TF's
    ``checkpoint`` file): with the default numbering, or any increasing one (the step), that
    is the order they were saved in. A program that saves a lower number than one already on
    disk (resuming from an earlier point with numbers taken from the step, say) has it as
    ``latest`` until it ends, but a manager made later over the directory names the higher
    one: remove the abandoned checkpoints, or let the manager number the saves.

    A checkpoint beyond ``max_to_keep`` that cannot be deleted (it became a folder, or the
    OS refuses) does not fail the save that pruned it, whose file is written and listed: a
    ``RuntimeWarning`` names it and the OS error, and the manager stops listing it, so
    ``checkpoints`` still holds at most ``max_to_keep``. It stays on disk until removed by
    hand; a manager made later over the directory finds it again, and tries again to delete
    it when it is beyond ``max_to_keep``.

    ``keep_checkpoint_every_n_hours`` works as TF's: a checkpoint pushed out of the newest
    ``max_to_keep`` is kept on disk, and no longer listed, when it was saved at least that
    many hours after the last one kept so (or after the manager was made, for the first). A
    checkpoint's time is when its save finished; with no state file, that of a checkpoint
    found in the directory is its file's modification time (at most now). With
    ``keep_checkpoint_every_n_hours``, the checkpoints found beyond the newest
    ``max_to_keep`` count as kept so by an earlier manager: they stay, unlisted, and the
    newest of them starts the count of hours.

    ``checkpoint_interval`` works as TF's: ``save()`` reads ``step_counter`` and saves only
    if it moved by at least that many steps since the last save that succeeded (the first
    save always saves); otherwise it returns ``None``. A save decides once the saves called
    before it have ended, so one that fails holds no later save back.
    ``save(check_interval=False)`` saves whenever the step moved at all; a save at the same
    step as the last returns ``None`` in any case.
    Across workers the chief reads its step counter and decides for every worker.

    Args:
        checkpoint: the ``Checkpoint`` to save.
        directory: where the files go (created on the first save).
        max_to_keep: how many to keep, oldest deleted first; ``None`` keeps all.
        keep_checkpoint_every_n_hours: a number of hours > 0, or ``None``: which
            checkpoints pushed out of the newest ``max_to_keep`` stay on disk (see above).
        checkpoint_name: the file name prefix, a str.
        step_counter: a 0-d integer ``Variable`` counting the steps, which
            ``checkpoint_interval`` needs.
        checkpoint_interval: an int >= 1, or ``None``: the fewest steps between two saves.
        init_fn: what ``restore_or_initialize`` calls when there is no checkpoint yet (to
            start from pretrained weights, say): a function of no arguments, plain or async.

    Raises:
        TypeError: ``checkpoint`` is not a ``Checkpoint``; ``directory`` is not a path;
            ``checkpoint_name`` is not a str; ``init_fn`` is not callable; ``max_to_keep``
            or ``checkpoint_interval`` is not an int or None (a bool is not one);
            ``keep_checkpoint_every_n_hours`` is not a number or None; ``step_counter`` is
            not a 0-d integer ``Variable`` or None.
        ValueError: ``max_to_keep`` is below 1; ``checkpoint_name`` is
            empty or holds a path separator (or a NUL); ``directory`` is empty (give ``"."``
            for the current folder); ``keep_checkpoint_every_n_hours`` is not finite and
            > 0; ``checkpoint_interval`` is below 1, or given without ``step_counter``.
        NotADirectoryError: ``directory`` is an existing file.

    Example:
        >>> manager = CheckpointManager(Checkpoint(step=1), tmp / "run", max_to_keep=2)
        >>> for step in range(3):
        ...     _ = anyio.run(manager.save)
        >>> [os.path.basename(p) for p in manager.checkpoints]
        ['ckpt-2.npz', 'ckpt-3.npz']
        >>> os.path.basename(manager.latest)
        'ckpt-3.npz'

        Saving at most every 100 steps:

        >>> step = aioreplica.Variable(np.int64(0))
        >>> every = CheckpointManager(
        ...     Checkpoint(step=step), tmp / "every", step_counter=step, checkpoint_interval=100
        ... )
        >>> os.path.basename(anyio.run(every.save))
        'ckpt-1.npz'
        >>> _ = anyio.run(step.assign, 50)
        >>> print(anyio.run(every.save))  # 50 steps later: not yet
        None
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: SupportsIndex | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        *,
        checkpoint_name: str = "ckpt",
        step_counter: Variable | None = None,
        checkpoint_interval: _Interval | None = None,
        init_fn: Callable[[], Any] | None = None,
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint must be a Checkpoint, got {type(checkpoint).__name__}")
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_fn must be callable or None, got {type(init_fn).__name__}")
        keep = (
            None
            if max_to_keep is None
            else checked_integer(max_to_keep, "max_to_keep must be an int >= 1 or None", 1)
        )
        name = _checked_name(checkpoint_name)
        hours = _hours(keep_checkpoint_every_n_hours)
        interval = _interval(step_counter, checkpoint_interval)
        self._checkpoint = checkpoint
        self._directory = _directory_of("CheckpointManager", directory)
        self._max_to_keep = keep
        self._name = name
        self._init_fn = init_fn
        self._numbers = sorted(self._existing())
        self._keep_hours = hours
        self._step_counter = step_counter
        self._interval = interval
        self._last_step: int | None = None  # the step of the last save, for the interval
        now = time.time()
        # When each listed checkpoint was saved, and the last one kept for the hours.
        self._times = {
            number: min(_mtime(self._path(number), now), now) for number in self._numbers
        }
        self._last_preserved = now - 1.0  # as TF's, made with no state: just before now
        if hours is not None and keep is not None and len(self._numbers) > keep:
            preserved = self._numbers[:-keep]  # kept so by an earlier manager: left alone
            self._last_preserved = max(self._times.pop(number) for number in preserved)
            del self._numbers[:-keep]
        # Saves take it in turn: number, write, bookkeeping and deletions, one save at a time.
        self._turn = Turn()
        # Stale temporaries are removed by the first save, not here: in a worker thread,
        # off the event loop, and only by a manager that writes (one made to find
        # ``latest`` for an evaluation deletes nothing).
        self._swept = False

    @property
    def directory(self) -> str:
        """The directory of the checkpoints."""
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        """The ``Checkpoint`` this manager saves and restores, as TF's ``checkpoint``."""
        return self._checkpoint

    @property
    def checkpoint_interval(self) -> int | None:
        """The fewest steps between two saves (``None``: every save saves), as in TF."""
        return self._interval

    @property
    def checkpoints(self) -> list[str]:
        """The kept checkpoint files, oldest first."""
        return [self._path(number) for number in self._numbers]

    @property
    def latest(self) -> str | None:
        """The newest checkpoint file, or ``None`` if there is none."""
        return self._path(self._numbers[-1]) if self._numbers else None

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint file, or ``None``: ``latest`` under TF's name.

        Example:
            >>> manager = CheckpointManager(Checkpoint(step=1), tmp / "tf")
            >>> manager.latest_checkpoint is None
            True
            >>> path = anyio.run(manager.save)
            >>> manager.latest_checkpoint == manager.latest == path
            True
        """
        return self.latest

    async def restore_or_initialize(self) -> str | None:
        """Restore ``latest``; if there is none yet, call ``init_fn`` (if given) instead.

        As TF's: the program's first line either resumes a run or starts one. It restores
        as ``Checkpoint.restore`` does (everything checked first; across workers collective,
        every worker finding the same newest checkpoint, or none).

        Across workers every worker calls ``init_fn``, and the call ends as a ``run()`` does,
        with an agreement that ``init_fn`` succeeded on every worker: an ``init_fn`` that
        raises on one worker (before its collectives, between them or after the last) makes
        that worker raise its exception and every other worker's call raise
        ``ReplicaSyncError`` naming it and the exception, and then, as after a failed
        ``run()``, the strategy makes no more cross-worker calls.

        Returns:
            The path restored, or ``None`` when there was no checkpoint.

        Raises:
            CheckpointError: as ``Checkpoint.restore``; nothing changed.
            ValueError: (several workers) as ``Checkpoint.restore``: another worker found
                another checkpoint, or none (``WorkersDisagree``, naming it); the workers'
                ``init_fn`` made different collectives.
            ReplicaSyncError: (several workers) another worker's ``init_fn`` raised (naming
                the worker and its exception), or a worker was late past the strategy's
                ``sync_timeout``; the strategy makes no more cross-worker calls.
            RuntimeError: called inside a replica.
            Exception: whatever ``init_fn`` raises (across workers, the strategy then makes
                no more cross-worker calls).

        Example:
            >>> w = aioreplica.Variable(0.0)
            >>> async def pretrained():
            ...     await w.assign(5.0)
            >>> manager = CheckpointManager(Checkpoint(w=w), tmp / "resume", init_fn=pretrained)
            >>> anyio.run(manager.restore_or_initialize), float(w)  # a new run
            (None, 5.0)
            >>> path = anyio.run(manager.save)
            >>> _ = anyio.run(w.assign, 7.0)
            >>> anyio.run(manager.restore_or_initialize) == path, float(w)  # resumed
            (True, 5.0)
        """
        _check_not_in_replica("CheckpointManager.restore_or_initialize")
        workers = self._checkpoint._workers()
        # Across workers one call, init_fn's work included (none held after a failure).
        async with call_of(workers, "CheckpointManager.restore_or_initialize"):
            latest = self.latest
            await self._checkpoint.restore(latest)
            if latest is not None and self._interval is not None:
                self._last_step = self._step()  # as TF: the interval counts from the restore
            if latest is None and self._init_fn is not None:
                if workers is None or workers.broken:  # this worker's own, as the restore was
                    await _initialize(self._init_fn)
                else:
                    await _initialize_on(workers, self._init_fn)
            return latest

    @overload
    async def save(
        self: CheckpointManager[None],
        checkpoint_number: SupportsIndex | None = None,
        check_interval: bool = True,
    ) -> str: ...

    @overload
    async def save(
        self: CheckpointManager[SupportsIndex | None],
        checkpoint_number: SupportsIndex | None = None,
        check_interval: bool = True,
    ) -> str | None: ...

    async def save(
        self, checkpoint_number: SupportsIndex | None = None, check_interval: bool = True
    ) -> str | None:
        """Save the checkpoint as the next number (or ``checkpoint_number``); prune old ones.

        The values saved are those at the moment of the call. Saves of one manager run one
        after another in the order they were called, so concurrent saves get distinct
        numbers. A save cancelled before its file is written leaves nothing; once the write
        has started, it finishes, old checkpoints' deletion included. The first save also
        removes stale temporaries that killed writers left (see the module's documentation).

        A kept checkpoint beyond ``max_to_keep`` that cannot be deleted is reported as a
        ``RuntimeWarning`` and no longer listed; the save itself succeeds (see the class).

        With a ``checkpoint_interval``, the step counter is read first, as in TF: a save
        less than ``checkpoint_interval`` steps after the last one that succeeded
        (``check_interval`` True), or at the same step (in any case), saves nothing and
        returns ``None``. It decides once the saves called before it have ended.

        Args:
            checkpoint_number: the number to save as: a file of that number is replaced,
                whoever wrote it, as in TF. By default one more than the highest number this
                manager keeps or finds in its directory as the file is put in place (1 when
                there is none), so that it never replaces a file: two managers saving into
                one directory each get numbers of their own.
            check_interval: whether ``checkpoint_interval`` holds back this save (a bool;
                without a ``checkpoint_interval``, it changes nothing).

        Returns:
            The path written, or ``None`` when ``checkpoint_interval`` held the save back.

        Raises:
            ValueError: ``checkpoint_number`` is negative; as ``Checkpoint.save``.
            TypeError: ``checkpoint_number`` is not an integer (a bool, a float, or a
                variable that is not a 0-d integer one); ``check_interval`` is not a bool;
                as ``Checkpoint.save``: a container of the checkpoint now holds an object it
                cannot save. Nothing is written.
            RuntimeError: called inside a replica.
            OSError: as ``Checkpoint.save``, for the checkpoint's path (also when its
                directory cannot be made; ``NotADirectoryError`` naming it when it is a file);
                older checkpoints are kept.

        Example:
            >>> manager = CheckpointManager(Checkpoint(step=1), tmp / "numbered")
            >>> os.path.basename(anyio.run(manager.save, 7))
            'ckpt-7.npz'
        """
        _check_not_in_replica("CheckpointManager.save")
        workers = self._checkpoint._workers()
        number: int | None = None
        error: Exception | None = None
        if checkpoint_number is not None:
            try:
                number = checked_integer(
                    checkpoint_number, "checkpoint_number must be an int >= 0", 0
                )
            except (TypeError, ValueError) as exc:
                error = exc
        if error is None and not isinstance(check_interval, bool):
            error = TypeError(
                f"CheckpointManager.save: check_interval must be True or False, got "
                f"{type(check_interval).__name__} {check_interval!r:.60}"
            )
        if error is None and workers is not None:
            try:  # as Checkpoint.save: refused before any collective, on every worker alike
                self._checkpoint._check("CheckpointManager.save")
            except (TypeError, ValueError) as exc:
                error = exc
        if workers is not None:
            async with workers.call("CheckpointManager.save"):
                if error is not None:  # refused on every worker, in step
                    await workers.refuse_in_step("CheckpointManager.save", error)
                    raise error
                return await self._save_on_workers(workers, number, check_interval)
        if error is not None:
            raise error
        # References only (copies never change in place); the objects are checked first.
        values = self._checkpoint._snapshot("CheckpointManager.save")
        step = self._step()  # read with the values; the interval is counted in its turn
        async with self._turn:
            # The saves called before this one have ended: ``_last_step`` is that of the last
            # one that succeeded, so a failed save holds no later save back.
            last = self._last_step
            if self._held_back(step, check_interval):
                return None
            try:
                return await self._save(values, number)
            except BaseException:
                self._last_step = last  # a save that failed saved no step
                raise

    def _step(self) -> int | None:
        """The step counter's value now (``None`` without a ``checkpoint_interval``)."""
        if self._interval is None or self._step_counter is None:
            return None
        return operator.index(self._step_counter)

    def _held_back(self, step: int | None, check_interval: bool) -> bool:
        """Whether ``checkpoint_interval`` holds back a save at ``step``, as TF decides; a
        save that goes ahead records its step (the caller puts back the last one if it
        fails)."""
        if self._interval is None or step is None:
            return False
        last = self._last_step
        if last is not None and (step == last or (check_interval and step < last + self._interval)):
            return True
        self._last_step = step
        return False

    async def _save_on_workers(
        self, workers: Workers, checkpoint_number: int | None, check_interval: bool
    ) -> str | None:
        """A collective save: the chief numbers, writes and prunes; the others take its list
        of checkpoints (no worker ever deletes another's files), its directory and its
        ``checkpoint_name``, so that ``latest`` names the file that ``save()`` returned on
        every worker (one made with another directory, a temporary one as in TF's
        multi-worker programs, say, then names the chief's files, which it never writes)."""
        async with self._turn:
            # Every worker here first: a wait for a late or cancelled one names this call (and
            # the workers compare whether their managers have an interval).
            interval = f" every {self._interval} steps" if self._interval is not None else ""
            await self._checkpoint._agree_to_save(workers, "CheckpointManager.save", interval)
            if workers.pending:  # on every worker, before the chief alone reads its step
                await sync_variables(workers)
            last = self._last_step
            if self._interval is not None:  # the chief decides for every worker
                decided = None
                if workers.is_chief:
                    step = self._step()
                    decided = {"step": step, "held": self._held_back(step, check_interval)}
                sent = json.dumps(decided).encode()
                decided = json.loads(await workers.broadcast_bytes(sent, 0))
                if decided["held"]:
                    return None
                self._last_step = decided["step"]
            try:
                values = await self._checkpoint._synced_snapshot(workers, "CheckpointManager.save")
                path = await _chief_writes(
                    workers, lambda: self._save(values, checkpoint_number), self._numbers
                )
            except BaseException:
                self._last_step = last  # a save that failed saved no step
                raise
            if not workers.is_chief:
                self._directory = os.path.dirname(path)
                self._name = os.path.basename(path).rsplit("-", 1)[0]  # <name>-<number>.npz
            return path

    async def _save(self, values: _Snapshot, checkpoint_number: int | None) -> str:
        """Number, write, record and prune one checkpoint (holding the manager's turn)."""
        number = checkpoint_number
        if number is None:  # never one kept: ``_numbers`` is in save order, not sorted
            number = max(self._numbers) + 1 if self._numbers else 1
        await anyio.to_thread.run_sync(_make_directory, self._directory, self._path(number))
        if not self._swept:
            await anyio.to_thread.run_sync(_remove_stale_temporaries, self._directory, self._name)
            self._swept = True
        # The write and its bookkeeping run shielded in a task of their own: a caller
        # cancelled in any way (an anyio scope, or a bare Task.cancel() as asyncio.timeout
        # does) waits for them, so every checkpoint that reaches the disk is listed and pruned.
        outcome: list[Any] = []  # the path written, or the exception it failed with
        with anyio.CancelScope(shield=True):  # a scope's cancellation: at the caller's next await
            async with anyio.create_task_group() as group:
                default = number if checkpoint_number is None else None
                group.start_soon(self._write_and_record, values, number, outcome, default)
        if isinstance(outcome[0], BaseException):
            raise outcome[0]  # itself, not in a group
        path: str = outcome[0]
        return path

    async def _write_and_record(
        self, values: _Snapshot, number: int, outcome: list[Any], default_number: int | None
    ) -> None:
        with anyio.CancelScope(shield=True):
            try:
                numbered: list[int] = []
                if number == default_number:
                    place = functools.partial(self._place, max(self._numbers, default=0), numbered)
                    path = await values.write(self._path(number), place)
                    number = numbered[0]
                else:
                    path = await values.write(self._path(number))
                # No await since the write: every checkpoint on disk is one this manager lists.
                if number in self._numbers:
                    self._numbers.remove(number)
                self._numbers.append(number)
                self._times[number] = time.time()
                await self._prune()
            except BaseException as exc:  # handed to the caller as it is
                outcome.append(exc)
            else:
                outcome.append(path)

    async def _prune(self) -> None:
        """Delete the checkpoints beyond ``max_to_keep``, oldest first.

        One that cannot be deleted is forgotten all the same, with a ``RuntimeWarning``: the
        checkpoint just written is safe, and ``max_to_keep`` still bounds the list.
        """
        if self._max_to_keep is None or len(self._numbers) <= self._max_to_keep:
            return
        beyond = self._numbers[: -self._max_to_keep]
        drop = []
        for number in beyond:  # as TF's sweep: kept on disk every n hours, and forgotten
            saved_at = self._times.get(number, self._last_preserved)
            hours = self._keep_hours
            if hours is not None and saved_at - hours * 3600.0 >= self._last_preserved:
                self._last_preserved = saved_at
                self._numbers.remove(number)
                self._times.pop(number, None)
            else:
                drop.append(number)
        if not drop:
            return
        # Delete, then forget: a save cancelled in between leaves them listed, for the next.
        failures = await anyio.to_thread.run_sync(_remove, [self._path(n) for n in drop])
        del self._numbers[: len(drop)]
        for number in drop:
            self._times.pop(number, None)
        for path, error in failures:  # warned once forgotten: a warning made an error is safe
            warnings.warn(
                f"CheckpointManager: could not delete old checkpoint {path!r} ({error}); it "
                f"stays on disk but is no longer listed among the kept checkpoints (remove it "
                "by hand); the new checkpoint was saved",
                RuntimeWarning,
                stacklevel=2,
            )

    def _path(self, number: int) -> str:
        return os.path.join(self._directory, f"{self._name}-{number}.npz")

    def _place(self, kept: int, numbered: list[int], temporary: str) -> str:
        """Put the written ``temporary`` in place as the next number (appended to
        ``numbered``): one more than ``kept`` (the highest this manager keeps) and than any
        in the directory now, never replacing a file. In the writing worker thread."""
        with _NUMBERING:  # the managers of this process one at a time: none takes another's
            number = max([kept, *self._existing()]) + 1
            while True:
                path = self._path(number)
                try:
                    os.link(temporary, path)  # fails, rather than replacing, if it exists
                except FileExistsError:  # another process's save took it meanwhile
                    number += 1
                    continue
                except OSError:  # a file system without hard links: a rename, checked first
                    if os.path.lexists(path):
                        number += 1
                        continue
                    os.replace(temporary, path)
                else:
                    os.remove(temporary)  # the file stays, under its own name
                numbered.append(number)
                return path

    def _existing(self) -> list[int]:
        return _numbers_in(self._directory, self._name)

    def __repr__(self) -> str:
        return f"CheckpointManager({self._directory!r}, latest={self.latest!r})"


def latest_checkpoint(
    directory: str | os.PathLike[str], checkpoint_name: str = "ckpt"
) -> str | None:
    """The newest checkpoint a ``CheckpointManager`` saved in ``directory``, or ``None``.

    TF's ``tf.train.latest_checkpoint(directory)``: the file a manager made over
    ``directory`` now would name as ``latest``, the ``<checkpoint_name>-<number>.npz`` of
    the highest number (a regular file; a folder of such a name is not a checkpoint). There
    is no state file to read: the files are listed, as the manager lists them.

    Args:
        directory: the folder of the checkpoints (one that does not exist holds none).
        checkpoint_name: the manager's file name prefix.

    Returns:
        The path of the newest checkpoint, or ``None`` when there is none.

    Raises:
        TypeError: ``directory`` is not a path; ``checkpoint_name`` is not a str.
        ValueError: ``directory`` is empty; ``checkpoint_name`` is empty or holds a path
            separator.
        NotADirectoryError: ``directory`` is a file.

    Example:
        >>> aioreplica.latest_checkpoint(tmp / "latest") is None
        True
        >>> manager = CheckpointManager(Checkpoint(step=1), tmp / "latest")
        >>> path = anyio.run(manager.save, 4)
        >>> aioreplica.latest_checkpoint(tmp / "latest") == path
        True
        >>> resumed = Checkpoint(step=0)
        >>> _ = anyio.run(resumed.restore, aioreplica.latest_checkpoint(tmp / "latest"))
        >>> resumed.step
        1
    """
    folder = _directory_of("latest_checkpoint", directory)
    name = _checked_name(checkpoint_name)
    numbers = _numbers_in(folder, name)
    return os.path.join(folder, f"{name}-{max(numbers)}.npz") if numbers else None


def _directory_of(what: str, directory: Any) -> str:
    """The folder of a manager's checkpoints, as a str: it may not exist yet.

    Raises:
        TypeError: ``directory`` is not a path.
        ValueError: it is empty.
        NotADirectoryError: it is a file.
    """
    folder = _path_of(what, directory)
    if not folder:
        raise ValueError(
            f"{what}: directory is empty; give the folder of the checkpoints ('.' for the "
            "current one)"
        )
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"{what}: directory {folder!r} is a file, not a folder; give the folder of the "
            "checkpoints (a manager makes it on its first save)",
        )
    return folder


def _checked_name(checkpoint_name: Any) -> str:
    """A manager's ``checkpoint_name``, checked: a non-empty file name prefix.

    Raises:
        TypeError: it is not a str.
        ValueError: it is empty or holds a path separator (or a NUL).
    """
    if not isinstance(checkpoint_name, str):
        raise TypeError(
            "checkpoint_name must be a str, the file name prefix (such as 'ckpt'), got "
            f"{type(checkpoint_name).__name__} {checkpoint_name!r:.60}"
        )
    if not checkpoint_name or any(c in checkpoint_name for c in {os.sep, "/", "\0"}):
        raise ValueError(
            "checkpoint_name must be a non-empty file name prefix, with no path separator, "
            f"such as 'ckpt'; got {checkpoint_name!r}"
        )
    return checkpoint_name


def _numbers_in(directory: str, name: str) -> list[int]:
    """The numbers of the checkpoints named ``<name>-<number>.npz`` in ``directory``: regular
    files (or links to them) only, as a save makes them; a folder so named is not one."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    prefix = f"{name}-"
    numbers = []
    for entry in names:
        middle = entry[len(prefix) : -len(".npz")]
        if (
            entry.startswith(prefix)
            and entry.endswith(".npz")
            and middle.isascii()
            and middle.isdigit()
            and str(int(middle)) == middle  # the name a save gives it: no leading zeros
            and os.path.isfile(os.path.join(directory, entry))
        ):
            numbers.append(int(middle))
    return numbers


def _hours(value: Any) -> float | None:
    """``keep_checkpoint_every_n_hours`` checked: a finite number > 0, or ``None``.

    Raises:
        TypeError: not a number (a bool is not one) nor None.
        ValueError: a number that is not finite and > 0.
    """
    if value is None:
        return None
    hours = as_real(value)
    if hours is None:
        raise TypeError(
            "keep_checkpoint_every_n_hours must be a number of hours or None, got "
            f"{type(value).__name__} {value!r:.60}"
        )
    if not (math.isfinite(hours) and hours > 0):
        raise ValueError(
            f"keep_checkpoint_every_n_hours must be a finite number of hours > 0 (or None: "
            f"keep none beyond max_to_keep), got {value!r}"
        )
    return hours


def _interval(step_counter: Any, checkpoint_interval: Any) -> int | None:
    """``checkpoint_interval`` checked, with its ``step_counter``: an int >= 1 and a 0-d
    integer variable, or ``None``.

    Raises:
        TypeError: ``checkpoint_interval`` is not an int or None; ``step_counter`` is not a
            0-d integer ``Variable`` or None.
        ValueError: ``checkpoint_interval`` is below 1, or given without ``step_counter``.
    """
    if step_counter is not None and not (
        isinstance(step_counter, Variable)
        and not isinstance(step_counter, SyncOnReadVariable)  # a read that aggregates
        and step_counter.shape == ()
        and step_counter.dtype.kind in "iu"
    ):
        shown = f"{type(step_counter).__name__} {step_counter!r:.80}"
        raise TypeError(
            "step_counter must be a 0-d integer aioreplica.Variable that counts the steps (such "
            f"as Variable(np.int64(0))), not a sync-on-read one, or None; got {shown}"
        )
    if checkpoint_interval is None:
        return None
    interval = checked_integer(checkpoint_interval, "checkpoint_interval must be an int >= 1", 1)
    if step_counter is None:
        raise ValueError(
            f"checkpoint_interval={interval} needs a step_counter, the variable whose steps it "
            "counts: pass step_counter=<a 0-d integer Variable>"
        )
    return interval


def _mtime(path: str, default: float) -> float:
    """When the file at ``path`` was last modified, or ``default`` if it cannot be told."""
    try:
        return os.stat(path).st_mtime
    except OSError:
        return default


def _path_of(what: str, path: Any) -> str:
    """``path`` (a str, bytes or ``os.PathLike``) as a str.

    Raises:
        TypeError: ``path`` is none of those.
    """
    try:
        return os.fsdecode(path)
    except TypeError:
        raise TypeError(
            f"{what} needs a file path (a str or os.PathLike), got {type(path).__name__} "
            f"{path!r:.60}"
        ) from None


def _full_path(path: str) -> str:
    """``path`` made absolute, as a message about the file shows it. (No file is read: only
    the working directory.)"""
    return os.path.abspath(path)


def _file_path_of(what: str, path: Any, *, writing: bool = False) -> str:
    """``path`` as a str (``_path_of``), refused if it cannot name a checkpoint file.

    Raises:
        TypeError: ``path`` is not a path.
        ValueError: ``path`` is empty; (``writing``) it ends with a path separator, naming a
            folder, not a file.
    """
    text = _path_of(what, path)
    if not text:
        raise ValueError(
            f"{what}: the path is empty; give the checkpoint file's path, such as "
            "'checkpoints/model.npz'"
        )
    if writing and not os.path.basename(text):
        raise ValueError(
            f"{what}: the path {text!r} ends with a path separator, so it names a folder; "
            "give the file to write in it, such as 'model.npz'"
        )
    return text


async def _initialize(init_fn: Callable[[], Any]) -> None:
    """Call a manager's ``init_fn``, plain or async."""
    started = init_fn()
    if inspect.isawaitable(started):
        await started


async def _initialize_on(workers: Workers, init_fn: Callable[[], Any]) -> None:
    """``init_fn`` on every worker, which then agree that it succeeded everywhere, as at the
    end of a ``run()``. A failure on one worker is announced, as a failed ``run()``'s is: the
    others raise ``ReplicaSyncError`` naming it, in ``init_fn``'s collectives or in that
    agreement, rather than pairing their next collectives with its next call.

    Raises:
        ReplicaSyncError: another worker failed, or a worker was late past the timeout.
        WorkersDisagree: a worker made other collectives (on every worker alike).
        Exception: what ``init_fn`` raised.
    """
    try:
        await _initialize(init_fn)
        await workers.barrier(_INITIALIZED)
    except Exception as exc:  # (cancelled or interrupted: the call's end announces it)
        # Unless every worker raised in step (arguments refused, collectives that differ), or
        # the cluster broke already (a peer's failure, a timeout): nothing more to tell.
        if exc is workers.refused:
            workers.refused = None
        elif not (workers.broken or isinstance(exc, WorkersDisagree)):
            workers.announce(f"{error_line(exc)} was raised in its init_fn ({_INITIALIZING})")
        raise


#: What the workers call the end of a manager's ``init_fn``, and ``init_fn`` itself.
_INITIALIZING: Final = "CheckpointManager.restore_or_initialize"
_INITIALIZED: Final = f"the end of the init_fn of {_INITIALIZING}"


async def _refuse_restore(workers: Workers, error: BaseException) -> None:
    """Meet the other workers' agreement to restore with this worker's ``error`` (it could not
    read or check the file), so that they raise ``WorkersDisagree`` naming it and nobody
    restores; the caller raises ``error``. A restore cancelled (or interrupted) here counts as
    this worker failing, as a cancelled ``run()`` does: MPI cannot take back the agreement."""
    if not isinstance(error, Exception):
        workers.announce(f"its Checkpoint.restore was stopped by {type(error).__name__}")
        return
    with contextlib.suppress(WorkersDisagree):  # raised on the others: this one raises error
        await workers.barrier(f"Checkpoint.restore refusing the file: {error_line(error)}")


# -- saving ---------------------------------------------------------------------------------

#: What the other workers wait for while the chief writes a checkpoint (a wait's name).
_CHIEF_WRITES: Final = "the chief's writing of the checkpoint"


async def _chief_writes(
    workers: Workers, write: Callable[[], Awaitable[str]], numbers: list[int] | None
) -> str:
    """The chief runs ``write()``; every worker then returns its path, or raises its error.

    ``numbers`` (a manager's kept checkpoint numbers) is replaced on the other workers by the
    chief's, after its pruning.
    """
    outcome: dict[str, Any] = {}
    if workers.is_chief:
        try:
            outcome["path"] = await write()
        except Exception as exc:
            outcome["error"] = error_line(exc)
            outcome["notes"] = [str(note) for note in getattr(exc, "__notes__", ())]
            outcome["exception"] = exc
        if numbers is not None:
            outcome["numbers"] = numbers
    shown = {key: value for key, value in outcome.items() if key != "exception"}
    with anyio.CancelScope(shield=True):  # the others wait for this answer: always send it
        said = json.dumps(shown).encode()
        answer = json.loads(await workers.broadcast_bytes(said, 0, _CHIEF_WRITES))
    if "exception" in outcome:
        raise outcome["exception"]
    if "error" in answer:
        error = OSError(
            f"the chief (worker 0) could not write the checkpoint: {answer['error']}; every "
            "worker's save failed, and the previous checkpoints are intact"
        )
        for note in answer["notes"]:  # what the chief's save was doing
            add_note(error, f"on the chief: {note}")
        raise error
    if numbers is not None and not workers.is_chief:
        numbers[:] = answer["numbers"]
    path: str = answer["path"]
    return path


async def _gather_places(workers: Workers, snap: _Snapshot) -> None:
    """Put every worker's place of each iterator of ``snap`` in its entry, for the chief to
    write: each worker may iterate an input of its own (``distribute_datasets_from_function``,
    a shuffle seeded per worker, shards of other lengths) or be at another batch. A place that
    is the same on every worker stays one; the others become the entry's ``workers``, by
    worker index. Collective: every worker's checkpoint holds iterators at the same paths
    (``_agree_to_save``), so all of them gather, or none.
    """
    entries = [entry for entry in snap.entries if entry["kind"] == "iterator"]
    if not entries:
        return
    places = [{field: entry[field] for field in _FIELDS["iterator"]} for entry in entries]
    gathered = await workers.allgather_bytes(json.dumps(places).encode(), what=_GATHERING)
    every = [json.loads(data) for data in gathered]
    for index, entry in enumerate(entries):
        each = [worker_places[index] for worker_places in every]
        if any(place != each[0] for place in each):
            entry["workers"] = each


#: What the workers wait for while they gather their iterators' places (a wait's name).
_GATHERING: Final = "the gathering of every worker's iterator places for a checkpoint"


@final
class _Snapshot:
    """The manifest entries and values of one save, taken at once, written later."""

    __slots__ = ("entries", "pending")

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        # (member, value, device), the value an array, an Aggregate, an AcrossWorkers until
        # ``read_across_workers``, or a number
        self.pending: list[tuple[str, Any, Any]] = []

    def add(self, value: Any, device: Any = None) -> str:
        """Keep ``value`` (an array on ``device``, a sync-on-read variable's ``Aggregate`` or
        ``AcrossWorkers``, or a number) for the file; its member."""
        member = f"a{len(self.pending)}"
        self.pending.append((member, value, device))
        return member

    async def read_across_workers(self, workers: Workers, caller: str) -> None:
        """Read the sync-on-read variables of several workers (``AcrossWorkers``) over every
        worker, in the snapshot's order, which is the same on every worker: a collective
        each. Those of ``workers`` (the strategy whose call the save holds) are awaited;
        those of another strategy are read first, with blocking calls, before any await, as
        the snapshot itself was taken (``caller``: the save, which the reads' names say)."""
        for k, (member, value, _) in enumerate(self.pending):
            if isinstance(value, AcrossWorkers) and value.workers is not workers:
                self.pending[k] = (member, value.read_now(caller), None)
        for k, (member, value, _) in enumerate(self.pending):
            if isinstance(value, AcrossWorkers):
                self.pending[k] = (member, await value.read(caller), None)

    async def write(self, path: str, place: Callable[[str], str] | None = None) -> str:
        """Write the snapshot to ``path`` atomically, in a worker thread; return the path
        written: ``path``, or where ``place(temporary)`` put the written temporary instead.

        Once the thread has started, the write finishes even if the caller is cancelled.
        While a trace is recorded, the write is a span ``checkpoint save``.
        """
        recorder = _trace.recorder
        if recorder is not None:
            saving = self._write(path, place)
            written: str = await recorder.timed(saving, "checkpoint save", {"path": path})
            return written
        return await self._write(path, place)

    async def _write(self, path: str, place: Callable[[str], str] | None) -> str:
        arrays = []
        for member, value, device in self.pending:
            assert not isinstance(value, AcrossWorkers), "read_across_workers() first"
            if device is None:
                arrays.append((member, np.asarray(value)))
            elif isinstance(value, Aggregate):  # combined now, off the event loop's thread
                arrays.append((member, await to_host(await value.value(), device)))
            else:
                arrays.append((member, await to_host(value, device)))
        version = VERSION if any("workers" in entry for entry in self.entries) else 1
        manifest = {"format": FORMAT, "version": version, "entries": self.entries}
        written: str = await anyio.to_thread.run_sync(_write_atomic, path, manifest, arrays, place)
        return written


def _variable_entry(path: Path, variable: Variable, member: str) -> dict[str, Any]:
    return {
        "path": list(path),
        "kind": "variable",
        "array": member,
        "dtype": variable.dtype.str,
        "shape": list(variable.shape),
        "synchronization": variable.synchronization.value,
        "aggregation": variable.aggregation.value,
    }


def _optimizer_entry(
    path: Path, optimizer: Optimizer, variable_paths: dict[int, Path], add: Any
) -> dict[str, Any]:
    slots = []
    for variable, variable_slots in slot_table(optimizer):
        variable_path = variable_paths.get(id(variable))
        if variable_path is None:
            raise ValueError(
                f"the optimizer at {_show(path)} has slots for variable {variable.name!r}, "
                "which is not in this checkpoint; add the model's variables to the Checkpoint "
                "so that its slots can be restored with it"
            )
        for slot_name, slot in zip(optimizer.slot_names, variable_slots, strict=True):
            array, device = snapshot(slot)
            slots.append(
                {
                    "variable": list(variable_path),
                    "slot": slot_name,
                    "array": add(array, device),
                    "dtype": slot.dtype.str,
                    "shape": list(slot.shape),
                }
            )
    rate = optimizer.learning_rate
    return {
        "path": list(path),
        "kind": "optimizer",
        "class": type(optimizer).__name__,
        "slot_names": list(optimizer.slot_names),
        "array": add(optimizer.iterations),
        # A number is saved, as Keras saves it (a variable); a schedule or callable is code,
        # which a checkpoint never holds, and a variable is the program's to save: null says
        # the program gives it.
        "learning_rate": None if callable(rate) or isinstance(rate, Variable) else add(float(rate)),
        "slots": slots,
    }


def _write_atomic(
    path: str,
    manifest: dict[str, Any],
    arrays: list[tuple[str, Any]],
    place: Callable[[str], str] | None = None,
) -> str:
    """Write the archive under a temporary name, fsync it, rename it over ``path`` (or let
    ``place`` put it where it returns); return the path written.

    The manifest is encoded here, off the event loop, by ``json``'s C encoder (no indent):
    a model of thousands of variables has a manifest of megabytes."""
    data = json.dumps(manifest).encode()
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(
        directory, _temporary_name(os.path.basename(path), _name_max(directory))
    )
    fd = _create(temporary, path)
    try:
        try:
            with os.fdopen(fd, "wb") as file:
                with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
                    archive.writestr(_MANIFEST, data)
                    for member, array in arrays:
                        with archive.open(f"{member}.npy", "w", force_zip64=True) as out:
                            np.lib.format.write_array(out, array, allow_pickle=False)
                file.flush()
                os.fsync(file.fileno())
        except OSError as exc:  # no space left on the device, an I/O error...
            _name_the_save(path, exc, f"writing its temporary file {temporary!r}")
            raise
        if place is None:
            _replace(temporary, path)
        else:
            try:
                path = place(temporary)
            except OSError as exc:
                moving = f"putting its temporary file {temporary!r} in place"
                _name_the_save(path, exc, moving)
                raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)
    return path


def _replace(temporary: str, path: str) -> None:
    """Rename the written ``temporary`` over ``path``; an error is named as the user gave the
    path, not as the temporary."""
    try:
        os.replace(temporary, path)
    except IsADirectoryError:
        raise IsADirectoryError(
            errno.EISDIR,
            f"cannot save checkpoint {path!r}: it is a folder; give the file to write, such as "
            f"{os.path.join(path, 'model.npz')!r}",
        ) from None
    except OSError as exc:
        _name_the_save(path, exc, f"renaming its temporary file {temporary!r} to it")
        raise


def _name_the_save(path: str, error: OSError, doing: str) -> None:
    """Name ``path``, the file the user gave, in ``error``, met while ``doing`` (what, with
    the temporary file): the OS's error stays the very object raised, its file name the path
    (not the temporary; a rename's error names both already), and a note says what the save
    was doing."""
    if error.errno is not None and error.strerror is not None and error.filename2 is None:
        error.filename = path
    add_note(error, f"while saving checkpoint {path!r}: {doing}; any file already there is intact")


#: Numbered saves of this process's managers pick their numbers one at a time.
_NUMBERING: Final = threading.Lock()


def _temporary_name(name: str, name_max: int) -> str:
    """``.<name>.<host>.<pid>.<random>.tmp``: who writes it, so that a stale one can be told.

    A name that would make it longer than ``name_max`` bytes (the file system's limit) is cut
    short and ends with ``~`` (``.<start of name>~.<host>...``), which no host name holds:
    the writer's host and process stay whole, for ``_remove_stale_temporaries``.
    """
    writer = f".{_host()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    if _length(f".{name}{writer}") <= name_max:
        return f".{name}{writer}"
    room = max(name_max - _length(f".~{writer}"), 0)
    name = name[:room]  # a character takes a byte at least
    while _length(name) > room:
        name = name[:-1]
    return f".{name}~{writer}"


def _length(name: str) -> int:
    """The length of a file name as the file system counts it, in bytes."""
    return len(os.fsencode(name))


def _name_max(directory: str) -> int:
    """The longest file name, in bytes, that the file system of ``directory`` takes."""
    try:
        return min(os.pathconf(directory, "PC_NAME_MAX"), _NAME_MAX)
    except (AttributeError, ValueError, OSError):  # no pathconf (Windows), or no answer
        return _NAME_MAX


#: The longest file name most file systems take, in bytes (or, on Windows, UTF-16 units).
_NAME_MAX: Final = 255


def _host() -> str:
    """This host's name, as it appears in temporary file names (at most 64 characters)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "unknown"


def _create(temporary: str, path: str) -> int:
    """Create ``temporary`` for writing; an error is named as the user gave the path, not as
    the temporary."""
    try:
        # os.open applies the umask, as for any new file (mkstemp would force 0600).
        return os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileNotFoundError as exc:
        folder = os.path.dirname(temporary)
        if os.path.isdir(folder):  # a file system that takes no new files (/proc, say)
            _name_the_save(path, exc, f"creating its temporary file {temporary!r}")
            raise
        raise FileNotFoundError(
            errno.ENOENT,
            f"cannot save checkpoint {path!r}: its folder {folder!r} does not exist; create "
            "it first (os.makedirs), or save through a CheckpointManager, which creates its "
            "directory",
        ) from None
    except OSError as exc:  # no permission, a file where a folder should be...
        _name_the_save(path, exc, f"creating its temporary file {temporary!r}")
        raise


def _make_directory(directory: str, path: str) -> None:
    """Make a manager's ``directory`` for the checkpoint ``path``; an error names them both,
    not the part of the directory where making it failed."""
    doing = f"making its folder {directory!r}"
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError as exc:  # the folder itself is a file (replaced since, say)
        error = NotADirectoryError(
            errno.ENOTDIR,
            f"cannot save checkpoint {path!r}: its folder is a file, not a folder (move that "
            "file away, or give the manager another directory)",
            directory,
        )
        add_note(
            error, f"while saving checkpoint {path!r}: {doing}; any file already there is intact"
        )
        raise error from exc
    except OSError as exc:  # a file on the way, no permission...
        _name_the_save(path, exc, doing)
        raise


def _remove_stale_temporaries(directory: str, name: str) -> None:
    """Remove the temporaries of ``<name>-<number>.npz`` files whose writer is gone.

    A temporary whose target name was cut short (``_temporary_name``) counts when what is
    left of the name begins ``<name>-<number>.npz``, or is the start of ``<name>-``: then it
    may be another manager's, of a name that begins the same, but only a stale one is
    removed, whose writer is gone.
    """
    pattern = re.compile(
        rf"\.{re.escape(name)}-\d+\.npz\.(?:(?P<host>.+)\.(?P<pid>\d+)\.)?[0-9a-f]{{8}}\.tmp"
    )
    here = _host()
    now = time.time()
    with os.scandir(directory) as found:
        for entry in found:
            match = pattern.fullmatch(entry.name) or _cut_short(entry.name, name)
            # Gone meanwhile, or not ours to remove: leave it, this is only housekeeping.
            with contextlib.suppress(OSError):
                if match is not None and _stale(match, here, entry, now):
                    os.unlink(entry.path)


#: A temporary whose target name was cut short: ``.<start of name>~.<host>.<pid>.<hex>.tmp``
#: (a host name holds no ``~``, so the last ``~.`` ends the name).
_CUT_SHORT: Final = re.compile(
    r"\.(?P<start>.*)~\.(?P<host>[A-Za-z0-9._-]+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp"
)


def _cut_short(temporary: str, name: str) -> re.Match[str] | None:
    """The match of ``temporary`` if it is a cut-short temporary of a ``<name>-<number>.npz``."""
    match = _CUT_SHORT.fullmatch(temporary)
    if match is None:
        return None
    start, head = match["start"], f"{name}-"
    if len(start) <= len(head):
        return match if start and head.startswith(start) else None
    rest = start[len(head) :]
    return (
        match
        if start.startswith(head) and re.fullmatch(r"\d+(?:\.(?:n(?:pz?)?)?)?", rest)
        else None
    )


def _stale(match: re.Match[str], here: str, entry: os.DirEntry[str], now: float) -> bool:
    """Whether a temporary's writer is gone: ended on this host, or too long ago to be alive."""
    if match["host"] == here:
        alive = _process_alive(int(match["pid"]))
        if alive is not None:
            return not alive
    # Another host's, or of unknown origin: its writer cannot be asked, so wait for its age.
    return now - entry.stat().st_mtime > STALE_AFTER


def _process_alive(pid: int) -> bool | None:
    """Whether process ``pid`` of this host runs; ``None`` where that cannot be told."""
    if pid <= 0 or sys.platform == "win32":  # there, os.kill would end the process
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    except (OverflowError, OSError):
        return None
    return True


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable (where the OS lets a directory be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - not on Linux
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse
        pass
    finally:
        os.close(fd)


def _remove(paths: list[str]) -> list[tuple[str, OSError]]:
    """Delete each file (gone already is fine); those that cannot be deleted, with why."""
    failures = []
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # a folder now, no permission, busy (Windows)...
            failures.append((path, exc))
    return failures


# -- restoring ------------------------------------------------------------------------------


def _read(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray[Any, Any]], int]:
    """The manifest and every array of a checkpoint file, read whole and checked, and the
    file's fingerprint: a CRC-32 of its members' names, sizes and CRC-32s (which the zip
    holds), so that workers can tell whether they read the same checkpoint."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    if os.path.isdir(path):
        raise IsADirectoryError(
            errno.EISDIR,
            f"cannot restore checkpoint {path!r}: it is a folder, not a checkpoint file; give "
            "a file in it, such as the newest of a manager's: CheckpointManager(checkpoint, "
            "folder).latest, or aioreplica.latest_checkpoint(folder)",
        )
    what = "the manifest"
    try:
        with open(path, "rb") as file, zipfile.ZipFile(file) as archive:
            infos = archive.infolist()
            members = sorted((i.filename, i.file_size, i.CRC) for i in infos)
            fingerprint = zlib.crc32(repr(members).encode())
            size = os.fstat(file.fileno()).st_size
            for info in infos:  # before anything is read, so before anything is allocated
                if info.file_size > _room(info, size):
                    what = f"member {info.filename!r}"
                    raise ValueError(
                        f"its size is given as {info.file_size} bytes, more than its "
                        f"{info.compress_size} bytes in a file of {size} can hold"
                    )
            what = "the manifest"
            manifest = json.loads(archive.read(_MANIFEST))
            _check_manifest(manifest)
            arrays: dict[str, np.ndarray[Any, Any]] = {}
            names = set(archive.namelist())
            for member in _members(manifest):
                what = f"array {member!r}"
                if member not in arrays:  # once, however many entries name it
                    arrays[member] = _read_array(archive, names, member)
    except _MalformedManifestError as exc:
        raise CheckpointError(path, [problem + _MALFORMED for problem in exc.problems]) from None
    except _NewerFormatError as exc:
        raise CheckpointError(path, [str(exc)]) from None
    except (FileNotFoundError, MemoryError):
        # Gone since it was found, or short of memory for arrays that fit in the file:
        # nothing wrong with the file itself (absurd sizes are refused above).
        raise
    except Exception as exc:  # whatever reading or parsing the file raised: it is unusable
        if isinstance(exc, KeyError):
            detail = "it is missing"
        elif "pickle" in str(exc):
            detail = "it holds Python objects, which checkpoints never load"
        else:
            detail = f"{type(exc).__name__}: {exc}"
        raise CheckpointError(
            path,
            [
                f"{what} cannot be read ({detail}); the file is truncated, corrupted or "
                "not an aioreplica checkpoint"
            ],
        ) from exc
    return manifest, arrays, fingerprint


#: The most a compressed ZIP member can expand (deflate's largest ratio), to bound the size a
#: corrupted file may state for one. A checkpoint's own members are stored, not compressed.
_MOST_EXPANSION: Final = 1032


def _room(info: zipfile.ZipInfo, size: int) -> int:
    """The most bytes the member ``info`` can hold in a ZIP file of ``size`` bytes."""
    stored = min(info.compress_size, size)
    return stored if info.compress_type == zipfile.ZIP_STORED else stored * _MOST_EXPANSION


def _read_array(archive: zipfile.ZipFile, names: set[str], member: str) -> np.ndarray[Any, Any]:
    """The array of ``member`` (its ``.npy`` file, as ``np.load`` names it), never a pickle.

    Its ``.npy`` header is read first: an array larger than its ZIP member can hold is
    refused before NumPy allocates it.

    Raises:
        KeyError: there is no such member.
        ValueError: it is not an array, or its header claims more than the member holds.
    """
    info = archive.getinfo(member if member in names else f"{member}.npy")
    with archive.open(info) as data:
        if data.read(len(np.lib.format.MAGIC_PREFIX)) != np.lib.format.MAGIC_PREFIX:
            raise ValueError("not an array")
        data.seek(0)
        version = np.lib.format.read_magic(data)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(data)
        elif version in {(2, 0), (3, 0)}:  # 3.0 differs only in its header's encoding
            shape, _, dtype = np.lib.format.read_array_header_2_0(data)
        else:
            raise ValueError(f".npy format version {version}, which NumPy does not read")
        claimed = math.prod(shape) * dtype.itemsize
        held = info.file_size - data.tell()
        if claimed > held:
            raise ValueError(
                f"its header claims shape {shape} of dtype {dtype}, {claimed} bytes, but the "
                f"member holds {max(held, 0)}"
            )
        data.seek(0)
        array = np.lib.format.read_array(data, allow_pickle=False)
    # A file written on a machine of the other byte order: the same values, in this one's.
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _members(manifest: dict[str, Any]) -> list[str]:
    members = []
    for entry in manifest["entries"]:
        if entry["kind"] == "iterator":  # held in the manifest alone
            continue
        members.append(entry["array"])
        if entry["kind"] == "optimizer":
            members += [slot["array"] for slot in entry["slots"]]
            if isinstance(entry.get("learning_rate"), str):
                members.append(entry["learning_rate"])
    return members


# -- the manifest's fields -------------------------------------------------------------------

#: The end of every problem with the manifest's own structure.
_MALFORMED: Final = "; the file is corrupted or not an aioreplica checkpoint"

_MISSING: Final = object()


class _NewerFormatError(Exception):
    """A manifest of a newer format version: the file is fine, this aioreplica is too old."""


class _MalformedManifestError(Exception):
    """The manifest's fields, each problem naming its entry (becomes a ``CheckpointError``)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(problems)
        self.problems = problems


def _check_manifest(manifest: Any) -> None:
    """Raise unless ``manifest`` is a version-1 manifest with every field of the right type.

    The rest of the reader relies on it: a path is a hashable tuple of keys, every array
    name a string, every optimizer entry has its list of slots.
    """
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"no {FORMAT!r} manifest")
    version = manifest.get("version")
    if type(version) is int and version > VERSION:
        raise _NewerFormatError(
            f"format version {version}, written by a newer aioreplica: this one reads versions "
            f"1 to {VERSION}; upgrade aioreplica (pip install --upgrade aioreplica) to restore it"
        )
    if type(version) is not int or not 1 <= version <= VERSION:  # not True, 1.0 or "1"
        raise ValueError(
            f"format version {version!r}; this aioreplica reads versions 1 to {VERSION}"
        )
    entries = manifest.get("entries", _MISSING)
    if not isinstance(entries, list):
        raise _MalformedManifestError([f"the manifest's 'entries' must be a list, {_got(entries)}"])
    problems: list[str] = []
    first: dict[Path, int] = {}  # each path's first entry
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            problems.append(f"manifest entry {index} must be an object, {_got(entry)}")
            continue
        where = f"manifest entry {index}"
        path = entry.get("path", _MISSING)
        if not _is_path(path):
            problems.append(f"{where}: 'path' must be {_PATH}, {_got(path)}")
        else:
            where += f" ({_show(tuple(path))})"
            if first.setdefault(tuple(path), index) != index:
                problems.append(f"{where}: the same path as entry {first[tuple(path)]}")
        problems += _entry_problems(where, entry)
    if problems:
        raise _MalformedManifestError(problems)


def _entry_problems(where: str, entry: dict[str, Any]) -> list[str]:
    """The problems of an entry's fields other than its path."""
    kind = entry.get("kind", _MISSING)
    if not isinstance(kind, str) or kind not in _FIELDS:
        return [f"{where}: 'kind' must be one of {', '.join(map(repr, _FIELDS))}, {_got(kind)}"]
    problems = _field_problems(where, entry, _FIELDS[kind])
    rate = entry.get("learning_rate", _MISSING)
    places = entry.get("workers", _MISSING)
    if kind == "iterator" and places is not _MISSING:  # (version 2: a place per worker)
        if not (isinstance(places, list) and len(places) >= 2 and _is_objects(places)):
            problems.append(
                f"{where}: 'workers' must be a list of two or more iterator places, {_got(places)}"
            )
        else:
            for index, place in enumerate(places):
                problems += _field_problems(f"{where}, worker {index}", place, _FIELDS["iterator"])
    if kind == "optimizer" and rate is not _MISSING and not (rate is None or _is_str(rate)):
        # (absent in files written before learning rates were saved)
        problems.append(f"{where}: 'learning_rate' must be a string or null, {_got(rate)}")
    if kind == "optimizer" and not problems:
        first: dict[tuple[Path, str], int] = {}  # each slot's first place
        for index, slot in enumerate(entry["slots"]):
            slot_where = f"{where}, slot {index}"
            slot_problems = _field_problems(slot_where, slot, _SLOT_FIELDS)
            problems += slot_problems
            if not slot_problems:
                key = (tuple(slot["variable"]), slot["slot"])
                if first.setdefault(key, index) != index:
                    problems.append(
                        f"{slot_where}: slot {key[1]!r} of {_show(key[0])} again (as slot "
                        f"{first[key]})"
                    )
    return problems


def _field_problems(
    where: str, item: dict[str, Any], fields: dict[str, tuple[Callable[[Any], bool], str]]
) -> list[str]:
    problems = []
    for name, (valid, what) in fields.items():
        value = item.get(name, _MISSING)
        if not valid(value):
            problems.append(f"{where}: {name!r} must be {what}, {_got(value)}")
    return problems


def _got(value: Any) -> str:
    if value is _MISSING:
        return "it is missing"
    shown = repr(value)
    return f"got {shown if len(shown) <= 80 else shown[:77] + '...'}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _is_positive(value: Any) -> bool:
    return _is_int(value) and value >= 1


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_random_state(value: Any) -> bool:
    return value is None or isinstance(value, dict)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_path(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(key, str) or _is_int(key) for key in value)
    )


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(size) and size >= 0 for size in value)


def _is_names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)


def _is_objects(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


_PATH: Final = "a non-empty list of strings and ints"
_STRING: Final = (_is_str, "a string")
_SHAPE: Final = (_is_shape, "a list of ints >= 0")
_COUNT: Final = (_is_count, "an int >= 0")

#: Every field each kind of entry must have besides its path, with its check and type.
_FIELDS: Final[dict[str, dict[str, tuple[Callable[[Any], bool], str]]]] = {
    "variable": {
        "array": _STRING,
        "dtype": _STRING,
        "shape": _SHAPE,
        "synchronization": _STRING,
        "aggregation": _STRING,
    },
    "optimizer": {
        "array": _STRING,
        "class": _STRING,
        "slot_names": (_is_names, "a list of strings"),
        "slots": (_is_objects, "a list of slot objects"),
    },
    "number": {"array": _STRING, "type": _STRING},
    # The state of an iterator over a ``batched`` dataset: ``aioreplica._batched``.
    "iterator": {
        "rows": _COUNT,
        "batch_size": (_is_positive, "an int >= 1"),
        "shuffle": (_is_bool, "true or false"),
        "structure": _STRING,
        "epoch": _COUNT,
        "position": _COUNT,
        "random_state": (_is_random_state, "an object or null"),
    },
}
_SLOT_FIELDS: Final[dict[str, tuple[Callable[[Any], bool], str]]] = {
    "variable": (_is_path, _PATH),
    "slot": _STRING,
    "array": _STRING,
    "dtype": _STRING,
    "shape": _SHAPE,
}


# -- checking a restore against the objects --------------------------------------------------


class _Plan:
    """A restore, checked entry by entry before anything changes, then committed at once.

    Each object that does not fit is a problem of a strict restore, or a skip that a partial
    restore reports (``_skip``); a problem of the file itself refuses either.
    """

    def __init__(
        self,
        path: str,
        manifest: dict[str, Any],
        arrays: dict[str, np.ndarray[Any, Any]],
        *,
        partial: bool,
        worker: tuple[int, int] = (0, 1),
    ) -> None:
        self.path = path
        self.arrays = arrays
        self.partial = partial
        self.worker = worker  # this worker's index, and the number of workers
        self.entries: dict[Path, dict[str, Any]] = {}
        for entry in manifest["entries"]:
            self.entries[tuple(entry["path"])] = entry
        self.used: set[Path] = set()
        self.problems: list[str] = []
        self.restored: list[str] = []
        self.only_in_file: list[str] = []
        self.only_in_program: list[str] = []
        self.mismatched: list[tuple[str, str]] = []
        self.variables: list[tuple[Variable, np.ndarray[Any, Any]]] = []
        #: Each variable's first path and array: one at several paths takes a value once.
        self.places: dict[int, tuple[Path, np.ndarray[Any, Any]]] = {}
        #: Such a variable's first path, another path, its name and the arrays at both: they
        #: must be equal, which ``finish`` checks away from the event loop (O(data)).
        self.ties: list[_Tie] = []
        self.optimizers: list[_OptimizerRestore] = []
        self.numbers: list[tuple[Path, int | float]] = []
        self.iterators: list[tuple[Path, ResumableInput, dict[str, Any]]] = []
        self.slots_left: list[str] = []

    def _skip(self, side: Literal["file", "program", "mismatch"], path: Path, why: str) -> None:
        """``path`` is not restored: a problem, or in a partial restore an item of the report.

        ``side`` is ``"file"`` (only in the file), ``"program"`` (only here) or
        ``"mismatch"``; ``why`` completes the problem's message.
        """
        if not self.partial:
            self.problems.append(f"{_show(path)}: {why}")
        elif side == "file":
            self.only_in_file.append(_show(path))
        elif side == "program":
            self.only_in_program.append(_show(path))
        else:
            self.mismatched.append((_show(path), why))

    def expect(self, path: Path, obj: Any, leaves: Any) -> None:
        kind = _kind(obj)
        entry = self.entries.get(path)
        if entry is None:
            self._skip("program", path, "not in the checkpoint")
            return
        self.used.add(path)
        if entry["kind"] != kind:
            self._skip(
                "mismatch",
                path,
                f"the checkpoint holds an object of kind {entry['kind']} there, this is of "
                f"kind {kind}",
            )
            return
        if isinstance(obj, Variable):
            fits = self._expect_variable(path, obj, entry)
        elif isinstance(obj, Optimizer):
            fits = self._expect_optimizer(path, obj, entry, leaves)
        elif kind == "iterator":
            fits = self._expect_iterator(path, obj, entry)
        else:
            fits = self._expect_number(path, obj, entry)
        if fits:
            self.restored.append(_show(path))

    def _expect_variable(self, path: Path, variable: Variable, entry: dict[str, Any]) -> bool:
        array = self._array(path, entry, variable.dtype, variable.shape)
        if array is None:
            return False
        earlier = self.places.setdefault(id(variable), (path, array))
        if earlier[0] == path:
            self.variables.append((variable, array))
        else:
            self.ties.append((earlier[0], path, variable._name, earlier[1], array))
        return True

    def _array(
        self,
        path: Path,
        entry: dict[str, Any],
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
    ) -> np.ndarray[Any, Any] | None:
        """The entry's array if its dtype and shape are the object's (else a problem)."""
        array = self._saved_array(path, entry)
        if array is None:
            return None
        if not _is_of(array, dtype, shape):
            self._skip(
                "mismatch",
                path,
                f"dtype {array.dtype} and shape {tuple(array.shape)} in the checkpoint, dtype "
                f"{dtype} and shape {shape} here",
            )
            return None
        return array

    def _saved_array(self, path: Path, entry: dict[str, Any]) -> np.ndarray[Any, Any] | None:
        """The entry's array if it is what its manifest says (else a problem: corrupted)."""
        array = self.arrays[entry["array"]]
        if not _as_its_entry_says(array, entry):
            self.problems.append(
                f"{_show(path)}: the file's array has dtype {array.dtype} and shape "
                f"{array.shape}, not what its manifest says (the file is corrupted)"
            )
            return None
        return array

    def _fits(self, path: Path, variable: Variable) -> bool:
        """Whether the variable at ``path`` is restored (its own check, with no side effect)."""
        entry = self.entries.get(path)
        if entry is None or entry["kind"] != "variable":
            return False
        array = self.arrays[entry["array"]]
        return _as_its_entry_says(array, entry) and _is_of(array, variable.dtype, variable.shape)

    def _expect_optimizer(
        self, path: Path, optimizer: Optimizer, entry: dict[str, Any], leaves: Any
    ) -> bool:
        name = type(optimizer).__name__
        if entry["class"] != name or entry["slot_names"] != list(optimizer.slot_names):
            self._skip(
                "mismatch",
                path,
                f"the checkpoint holds a {entry['class']} optimizer with slots "
                f"{entry['slot_names']}, this is a {name} with slots "
                f"{list(optimizer.slot_names)}",
            )
            return False
        iterations = self.arrays[entry["array"]]
        if (
            iterations.shape != ()
            or iterations.dtype.kind not in "iu"
            or not 0 <= int(iterations) <= MAX_ITERATIONS
        ):
            self.problems.append(f"{_show(path)}: its step count is not an int from 0 to 2**63 - 1")
            return False
        rate = self._learning_rate(path, optimizer, entry)
        variables = {p: v for p, v in leaves() if isinstance(v, Variable)}
        saved: dict[Path, dict[str, np.ndarray[Any, Any]]] = {}
        in_file: set[Path] = set()
        for slot in entry["slots"]:
            variable_path = tuple(slot["variable"])
            in_file.add(variable_path)
            slot_path = (*path, "slots", *variable_path, slot["slot"])
            array = self._slot_array(path, slot, slot_path, variables.get(variable_path))
            if array is not None:
                saved.setdefault(variable_path, {})[slot["slot"]] = array
        restore = _OptimizerRestore(path, optimizer, int(iterations), saved, in_file, variables)
        restore.learning_rate = rate
        self._uncovered(restore)
        self.problems += restore.foreign_slots()
        for variable_path, arrays in saved.items():
            if set(arrays) != set(optimizer.slot_names):
                self.problems.append(
                    f"{_show(path)}: slots {sorted(arrays)} of {_show(variable_path)} in the "
                    f"checkpoint, {list(optimizer.slot_names)} expected"
                )
        self.optimizers.append(restore)
        return True

    def _learning_rate(
        self, path: Path, optimizer: Optimizer, entry: dict[str, Any]
    ) -> float | None:
        """The number learning rate to restore into ``optimizer``, if any.

        A file's number restores into an optimizer whose learning rate is a number; a number
        on one side against a schedule or callable on the other is a mismatch, which a
        partial restore skips, keeping the program's. A file written before learning rates
        were saved has none, and the program's stays.
        """
        saved = entry.get("learning_rate")
        here = optimizer.learning_rate
        where = (*path, "learning_rate")
        if saved is None:  # none saved, or given by the program (a schedule, a variable)
            if "learning_rate" in entry and not _given_by_program(here):
                self._skip(
                    "mismatch",
                    where,
                    f"a schedule, callable or variable in the checkpoint (saved apart, if at "
                    f"all), the number {here!r} here",
                )
            return None
        array = self.arrays[saved]
        if array.shape != () or array.dtype.kind != "f" or not math.isfinite(float(array)):
            self.problems.append(
                f"{_show(where)}: the file holds an array of dtype {array.dtype} and shape "
                f"{array.shape} with value {array!r:.40}, not a finite float (the file is "
                "corrupted)"
            )
            return None
        if _given_by_program(here):
            self._skip(
                "mismatch",
                where,
                f"the number {float(array)!r} in the checkpoint, a schedule, callable or "
                "variable here",
            )
            return None
        return float(array)

    def _slot_array(
        self,
        path: Path,
        slot: dict[str, Any],
        slot_path: Path,
        variable: Variable | None,
    ) -> np.ndarray[Any, Any] | None:
        """A saved slot's array if it is restored: its variable is here, and restored too."""
        variable_path = tuple(slot["variable"])
        if variable is None:
            if self.partial:
                self.only_in_file.append(_show(slot_path))
            else:
                self.problems.append(
                    f"{_show(path)}: slot {slot['slot']!r} of {_show(variable_path)}: no such "
                    "variable here"
                )
            return None
        array = self._array(slot_path, slot, variable.dtype, variable.shape)
        if array is not None and not self._fits(variable_path, variable):
            self._skip("mismatch", slot_path, f"its variable {_show(variable_path)} is skipped")
            return None
        return array

    def _uncovered(self, restore: _OptimizerRestore) -> None:
        """The optimizer's slots that the file has nothing for and that a restore cannot
        reset, as problems: all of them in a strict restore; in a partial one, those of
        variables outside the checkpoint (the others are left as they are, and reported once
        the restore holds its turns)."""
        for variable_path, problem in restore.uncovered_slots(self._fits):
            if variable_path is None or not self.partial:
                self.problems.append(problem)

    def _expect_number(self, path: Path, number: Any, entry: dict[str, Any]) -> bool:
        kind = type(_number(number)).__name__
        # (files written before NumPy scalars were numbers named a float64 by its type)
        if entry["type"] != kind and (entry["type"], kind) != ("float64", "float"):
            self._skip(
                "mismatch",
                path,
                f"the checkpoint holds a number of type {entry['type']} there, this is of type "
                f"{kind}",
            )
            return False
        array = self.arrays[entry["array"]]
        if array.shape != () or array.dtype.kind != ("i" if kind == "int" else "f"):
            self.problems.append(
                f"{_show(path)}: the manifest says a scalar {kind}, but the file holds an array "
                f"of dtype {array.dtype} and shape {array.shape} (the file is corrupted)"
            )
            return False
        self.numbers.append((path, int(array) if kind == "int" else float(array)))
        return True

    def _expect_iterator(self, path: Path, iterator: ResumableInput, entry: dict[str, Any]) -> bool:
        state = self._place(path, entry)
        if state is None:
            return False
        differences = iterator._input_differences(state)
        if differences:
            self._skip(
                "mismatch",
                path,
                f"the checkpoint's iterator is over another dataset: {'; '.join(differences)}; "
                "restore into an iterator over the same batched(...) dataset",
            )
            return False
        problem = iterator._input_problem(state)
        if problem is not None:
            self.problems.append(f"{_show(path)}: {problem}")
            return False
        self.iterators.append((path, iterator, state))
        return True

    def _place(self, path: Path, entry: dict[str, Any]) -> dict[str, Any] | None:
        """This worker's place of the iterator ``entry``: the one place every worker had, or
        its own of those the entry holds per worker (else a mismatch: another worker count)."""
        places = entry.get("workers")
        if places is None:
            return {field: entry[field] for field in _FIELDS["iterator"]}
        index, count = self.worker
        if len(places) != count:
            self._skip(
                "mismatch",
                path,
                f"the checkpoint holds a place for each of {len(places)} workers (each "
                f"iterated its own input, or was at another batch), and this run has {count} "
                f"worker{'s' if count != 1 else ''}: each worker resumes only its own place, so "
                f"restore it with {len(places)} workers, or restore the rest with "
                "partial=True and start this iterator anew",
            )
            return None
        return {field: places[index][field] for field in _FIELDS["iterator"]}

    async def finish(self) -> None:
        """Check what needs every object's entry, then raise the problems found, if any.

        The arrays of a variable at several paths are compared in a worker thread: a
        comparison takes time in proportion to their size, which the event loop must not
        wait for.

        Raises:
            CheckpointError: the file does not fit these objects (its message lists why).
        """
        if self.ties:
            differ = await anyio.to_thread.run_sync(_differing, self.ties)
            self.problems += [
                f"{_show(first)} and {_show(second)}: the checkpoint holds different values "
                f"at these paths, and here they hold the same variable {name!r}, which cannot "
                "take both; give each path its own variable, as when it was saved"
                for first, second, name in differ
            ]
        for path in self.entries:
            if path not in self.used:
                self._skip("file", path, "in the checkpoint but not restored here")
        if self.problems:
            raise CheckpointError(self.path, self.problems)

    def turns(self) -> set[Turn]:
        """The write turns of everything this restore changes, as things stand now."""
        turns = {variable._turn for variable, _ in self.variables}
        for restore in self.optimizers:
            turns |= restore.turns()
        return turns

    async def commit(
        self,
        set_number: Callable[[Path, int | float], None],
        unchanged: Callable[[], None],
    ) -> bool:
        """Compute every new copy, then change everything in one synchronous step.

        Call it holding ``turns()``. Returns ``False``, having changed nothing, if an
        optimizer got slots from elsewhere (``build``) while the new copies were computed.
        ``unchanged()`` is called just before the commit, with no await in between: it
        raises if the objects restored are no longer those the plan was made for. A
        cancellation of the caller that came before the commit (while the copies were
        computed, which is not given up midway) cancels the restore, unless the caller shields
        it: across workers, once they agreed to restore, every worker commits.

        Raises:
            CheckpointError: while this restore waited for its turns, an optimizer got slots
                that the restore must refuse, a distributed iterator pulled ahead, or (from
                ``unchanged()``) the objects changed. Nothing changed.
        """
        problems: list[str] = []
        slots_left: list[str] = []  # of a partial restore: reported once it is done
        for restore in self.optimizers:
            for variable_path, problem in restore.uncovered_slots(self._fits):
                if variable_path is None or not self.partial:
                    problems.append(problem)
                else:
                    slots_left += restore.slot_paths(variable_path)
            if restore.learning_rate is not None and _given_by_program(
                restore.optimizer.learning_rate
            ):
                problems.append(
                    f"{_show((*restore.path, 'learning_rate'))}: it became a schedule, "
                    "callable or variable while the restore waited for its turn, and the "
                    "checkpoint holds a number; nothing was restored: restore again"
                )
            # A step may have decided the optimizer's strategy while the restore waited.
            problems += restore.foreign_slots()
        if problems:
            raise CheckpointError(self.path, problems)
        tables = [restore.slot_ids() for restore in self.optimizers]
        slots = [restore.slots() for restore in self.optimizers]
        writes = list(self.variables)
        for restore, made in zip(self.optimizers, slots, strict=True):
            writes += restore.writes(made) + restore.resets(self._fits)
        updates = [(variable, await new_copies(variable, array)) for variable, array in writes]
        await anyio.lowlevel.checkpoint_if_cancelled()
        if tables != [restore.slot_ids() for restore in self.optimizers]:
            return False
        # An iterator may have been pulled from while the restore waited: checked again.
        busy = [
            f"{_show(path)}: {why}"
            for path, iterator, state in self.iterators
            if (why := iterator._input_problem(state)) is not None
        ]
        if busy:
            raise CheckpointError(self.path, busy)
        unchanged()  # every number's place is still a dict or list: set_number cannot fail
        # The all-or-nothing point: nothing above changed any state.
        commit(updates)
        for variable, _ in updates:
            settle_here(variable)
        for restore, made in zip(self.optimizers, slots, strict=True):
            restore_state(restore.optimizer, restore.iterations, made)
            if restore.learning_rate is not None:  # a finite float: the setter takes it
                restore.optimizer.learning_rate = restore.learning_rate
        for path, number in self.numbers:
            set_number(path, number)
        for _, iterator, state in self.iterators:
            iterator._restore_input(state)
        self.slots_left = slots_left  # as they are now: the turns held keep them so
        return True

    def report(self) -> RestoreReport:
        """What this restore restored and skipped (call it after ``commit``)."""
        return RestoreReport(
            self.path,
            restored=tuple(self.restored),
            only_in_file=tuple(sorted(self.only_in_file)),
            only_in_program=tuple(sorted(self.only_in_program + self.slots_left)),
            mismatched=tuple(sorted(self.mismatched)),
        )


@final
class _OptimizerRestore:
    """An optimizer's part of a restore: its step count and the saved values of its slots."""

    __slots__ = (
        "in_file",
        "iterations",
        "learning_rate",
        "optimizer",
        "path",
        "saved",
        "variables",
    )

    def __init__(
        self,
        path: Path,
        optimizer: Optimizer,
        iterations: int,
        saved: dict[Path, dict[str, np.ndarray[Any, Any]]],
        in_file: set[Path],
        variables: dict[Path, Variable],
    ) -> None:
        self.path = path
        self.optimizer = optimizer
        self.iterations = iterations
        self.saved = saved  # variable path -> slot name -> saved value, for those restored
        self.in_file = in_file  # the variables the file holds slots for, restored or not
        self.variables = variables  # every variable of the checkpoint, by path
        self.learning_rate: float | None = None  # the number to restore, if any

    def uncovered_slots(
        self, restored: Callable[[Path, Variable], bool]
    ) -> list[tuple[Path | None, str]]:
        """The optimizer's slots that the file has nothing for and that are not reset, each
        with its problem.

        A file without slots for a variable it restores (``restored(path, variable)``) was
        saved while that variable's slots had their initial values (before the first step
        that trained it): those slots are reset (``resets``), not uncovered. Each uncovered
        slot is a variable's path, with the problem for a strict restore, or ``None`` for the
        slots of a variable outside this checkpoint (refused by any restore). Its slots can
        change until the restore holds its turn (a step makes them): checked when the restore
        is planned, and again once it holds the turns.
        """
        uncovered: list[tuple[Path | None, str]] = []
        paths = {id(v): p for p, v in self.variables.items()}
        for variable, _ in slot_table(self.optimizer):
            owned = paths.get(id(variable))
            if owned is None:
                uncovered.append(
                    (
                        None,
                        f"{_show(self.path)}: has slots for variable {variable.name!r}, which "
                        "is not in this checkpoint",
                    )
                )
            elif (
                owned not in self.in_file
                and self.optimizer.slot_names
                and not restored(owned, variable)
            ):
                uncovered.append(
                    (
                        owned,
                        f"{_show(self.path)}: has slots for {_show(owned)}, the checkpoint has "
                        "none",
                    )
                )
        return uncovered

    def resets(
        self, restored: Callable[[Path, Variable], bool]
    ) -> list[tuple[Variable, np.ndarray[Any, Any]]]:
        """Each slot the optimizer has now for a variable that the restore sets
        (``restored(path, variable)``) but the file holds no slots for, with its initial
        value: the file was saved before any step trained that variable."""
        paths = {id(v): p for p, v in self.variables.items()}
        resets = []
        for variable, slots in slot_table(self.optimizer):
            owned = paths.get(id(variable))
            if owned is None or owned in self.in_file or not restored(owned, variable):
                continue
            for name, slot in zip(self.optimizer.slot_names, slots, strict=True):
                initial = self.optimizer._slot_initial(name)
                resets.append((slot, np.full(slot.shape, initial, dtype=slot.dtype)))
        return resets

    def foreign_slots(self) -> list[str]:
        """A problem for each variable whose slots the restore would make and the optimizer's
        ``build()`` refuses (one of another strategy than the optimizer's): checked when the
        restore is planned, and again once it holds the turns (a step decides the strategy
        of an optimizer that has none yet)."""
        problems = []
        for path in self.saved:
            try:
                check_slots_to_restore(self.optimizer, self.variables[path])
            except ValueError as exc:
                problems.append(f"{_show((*self.path, 'slots', *path))}: {exc}")
        return problems

    def slot_paths(self, variable_path: Path) -> list[str]:
        """The paths of the optimizer's slots of the variable at ``variable_path``."""
        return [
            _show((*self.path, "slots", *variable_path, name)) for name in self.optimizer.slot_names
        ]

    def turns(self) -> set[Turn]:
        """The optimizer's turn and those of every slot it has now."""
        turns = {self.optimizer._turn}
        for _, slots in slot_table(self.optimizer):
            turns.update(slot._turn for slot in slots)
        return turns

    def slot_ids(self) -> list[tuple[int, ...]]:
        """Which slot variables the optimizer has now, to tell whether that changed."""
        return [
            tuple(map(id, (variable, *slots))) for variable, slots in slot_table(self.optimizer)
        ]

    def slots(self) -> list[tuple[Variable, tuple[Variable, ...]]]:
        """Each restored variable with its slots: the optimizer's, or new ones to register."""
        return [
            (self.variables[path], slots_to_restore(self.optimizer, self.variables[path]))
            for path in self.saved
        ]

    def writes(
        self, made: list[tuple[Variable, tuple[Variable, ...]]]
    ) -> list[tuple[Variable, np.ndarray[Any, Any]]]:
        """Each slot of ``made`` with its saved value."""
        names = self.optimizer.slot_names
        writes = []
        for (_, slots), arrays in zip(made, self.saved.values(), strict=True):
            writes += [(slot, arrays[name]) for name, slot in zip(names, slots, strict=True)]
        return writes


# -- checks ---------------------------------------------------------------------------------


def _as_its_entry_says(array: np.ndarray[Any, Any], entry: dict[str, Any]) -> bool:
    """Whether a file's ``array`` (read in this machine's byte order) has the dtype, in any
    byte order, and the shape its manifest ``entry`` says (the check of ``_saved_array``, and
    of ``_fits`` without its side effect)."""
    try:
        saved = np.dtype(entry["dtype"])
    except (TypeError, ValueError):  # not a dtype at all: a corrupted manifest
        return False
    return bool(saved.newbyteorder("=") == array.dtype and entry["shape"] == list(array.shape))


#: A variable's first path, another path, its name, and the file's arrays at those paths.
_Tie = tuple[Path, Path, str, np.ndarray[Any, Any], np.ndarray[Any, Any]]


def _differing(ties: list[_Tie]) -> list[tuple[Path, Path, str]]:
    """The paths and names of ``ties`` whose two arrays differ (NaNs equal to NaNs). Runs in
    a worker thread: it reads every byte of both."""
    return [
        (first, second, name)
        for first, second, name, one, other in ties
        if not np.array_equal(one, other, equal_nan=one.dtype.kind in "fc")
    ]


def _is_of(array: np.ndarray[Any, Any], dtype: np.dtype[Any], shape: tuple[int, ...]) -> bool:
    """Whether ``array`` has an object's ``dtype`` and ``shape`` (the check of ``_array``, and
    of ``_fits`` without its side effect). Byte order aside: a file's arrays are read in this
    machine's order, and the new copies take the object's own (``astype``)."""
    native = array.dtype.newbyteorder("=") == dtype.newbyteorder("=")
    return native and tuple(array.shape) == shape


def _check_name(name: str) -> None:
    """Refuse an object name that ``Checkpoint``'s own attributes hide (``ckpt.save``).

    Raises:
        ValueError: ``name`` is one of ``Checkpoint``'s methods, ``_objects`` or a special
            name (``__dict__``).
    """
    if name in ("save", "restore"):
        raise ValueError(
            f"Checkpoint cannot hold an object named {name!r}: ckpt.{name} is its method, so "
            "the object could not be read back; choose another name"
        )
    if _clashes(name):
        raise ValueError(
            f"Checkpoint cannot hold an object named {name!r}: the name is kept for its own "
            "attributes (its objects, and Python's special names), so the object could not "
            "be read back; choose another name"
        )


def _clashes(name: str) -> bool:
    """Whether ``name`` is one of ``Checkpoint``'s own private or special attributes' names,
    which ``copy`` and ``pickle`` look up before its objects are set."""
    return name == "_objects" or (name.startswith("__") and name.endswith("__"))


def _check_objects(caller: str, name: str, value: Any) -> None:
    """Raise unless ``value``, given as ``name``, is something a checkpoint saves and
    restores; each message begins with ``caller`` (``Checkpoint``, ``Checkpoint.save``...)."""
    try:
        pairs, _ = _tree.flatten_with_path(value)
    except RecursionError:
        raise TypeError(
            f"{caller}: {name} nests too deeply, or a dict or list inside it holds itself"
        ) from None
    for key_path, leaf in pairs:
        where = _show((name, *_plain_path(key_path)))
        for key in key_path:
            if isinstance(key, _tree.MappingKey) and not isinstance(key.key, str):
                raise TypeError(
                    f"{caller}: the dict key {key.key!r} at {where} is not a string; "
                    "checkpoint paths are made of string keys and list indices"
                )
            if isinstance(key, _tree.AttrKey):
                raise TypeError(
                    f"{caller}: {where} is inside a {type(value).__name__}; use dicts, "
                    "lists and tuples to group objects"
                )
        if isinstance(leaf, Variable | Optimizer) or _is_input(leaf):
            continue
        if _is_number(leaf):
            if key_path and not _restorable(value, key_path):
                raise TypeError(
                    f"{caller}: the number at {where} is inside a tuple, where it cannot be "
                    "restored in place; use a list or a dict"
                )
            _check_int_range(caller, where, leaf)
            continue
        raise TypeError(f"{caller}: {where} is {_refused(leaf)}")


def _is_number(leaf: Any) -> bool:
    """Whether ``leaf`` is a number a checkpoint holds: an int or a float, Python's or NumPy's
    (not a bool, nor an array: arrays belong in variables)."""
    return isinstance(leaf, int | float | np.integer | np.floating) and not isinstance(leaf, bool)


def _number(leaf: Any) -> int | float:
    """A number of the checkpoint (``_is_number``) as the Python int or float it is saved
    and restored as."""
    return int(leaf) if isinstance(leaf, int | np.integer) else float(leaf)


def _check_int_range(caller: str, where: str, number: Any) -> None:
    """A checkpoint stores an int as a 64-bit integer: refuse one that does not fit."""
    number = _number(number)
    if isinstance(number, int) and not INT64_MIN <= number <= INT64_MAX:
        raise ValueError(
            f"{caller}: the int at {where} is {number}, outside the 64-bit range a checkpoint "
            f"stores ({INT64_MIN} to {INT64_MAX}); store it as a float or in parts"
        )


def _refused(leaf: Any) -> str:
    """What ``leaf`` is and why a checkpoint cannot hold it, for the ``TypeError``."""
    kind = type(leaf).__name__
    if isinstance(leaf, DistributedIterator):
        over = _tree.with_article(leaf._source_kind())
        return f"a DistributedIterator over {over}; {_SAVED_ITERATORS}"
    if isinstance(leaf, batched):
        return (
            "a batched dataset, which has no place of its own to save: save its iterator, "
            "iter(dataset) or aiter(strategy.distribute_dataset(dataset))"
        )
    if hasattr(leaf, "__next__") or hasattr(leaf, "__anext__"):
        return f"an iterator ({kind}) with no position to save; {_SAVED_ITERATORS}"
    return (
        f"{_tree.with_article(kind)}; a checkpoint holds variables, optimizers, ints and "
        "floats, in dicts, lists and tuples, and iterators over aioreplica.batched datasets"
    )


#: Which iterators a checkpoint can save, for its messages.
_SAVED_ITERATORS: Final = (
    "a checkpoint saves only iterators over an aioreplica.batched dataset: iter(batched(...)), "
    "aiter(strategy.distribute_dataset(batched(...))) and "
    "aiter(strategy.distribute_datasets_from_function(fn)) where fn returns batched(...) "
    "(InputReplicationMode.PER_WORKER, the default)"
)


def _is_input(obj: Any) -> bool:
    """Whether ``obj`` is an iterator whose place a checkpoint saves (``ResumableInput``)."""
    if isinstance(obj, BatchedIterator):
        return True
    return isinstance(obj, DistributedIterator) and obj._input_source() is not None


def _kind(obj: Any) -> str:
    """The manifest kind of an object that ``_check_objects`` accepted."""
    if isinstance(obj, Variable):
        return "variable"
    if isinstance(obj, Optimizer):
        return "optimizer"
    if isinstance(obj, BatchedIterator | DistributedIterator):
        return "iterator"
    return "number"


def _restorable(root: Any, key_path: _tree.KeyPath) -> bool:
    """Whether the leaf at ``key_path`` sits in a container it can be written back into."""
    return isinstance(_parent(root, _plain_path(key_path)), dict | list)


def _parent(root: Any, path: Path) -> Any:
    """The container holding the object at ``path`` below ``root``."""
    for key in path[:-1]:
        root = root[key]
    return root


def _plain_path(key_path: _tree.KeyPath) -> Path:
    """A key path as JSON-friendly keys: dict keys and list indices (attributes refused)."""
    path: list[str | int] = []
    for key in key_path:
        if isinstance(key, _tree.SequenceKey):
            path.append(key.index)
        elif isinstance(key, _tree.MappingKey):
            path.append(key.key)  # type: ignore[arg-type]  # checked to be str on entry
        else:
            path.append(key.name)
    return tuple(path)


def _check_not_in_replica(what: str) -> None:
    replica = context_state.get().replica
    if replica is not None:
        raise RuntimeError(
            f"{what}() was called inside replica {replica.replica_id_in_sync_group}; "
            f"call it from cross-replica code, outside strategy.run()"
        )


def _given_by_program(rate: Any) -> bool:
    """Whether an optimizer's learning rate is the program's to give (as ``_optimizer_entry``
    tells), not a number a checkpoint holds: a schedule or callable (code), or a variable
    (saved as a variable, where the program puts it in the checkpoint)."""
    return callable(rate) or isinstance(rate, Variable)
