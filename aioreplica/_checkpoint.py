"""Checkpoints: variables, optimizers and counters in one atomic ``.npz`` file.

File format
    A checkpoint is a ZIP archive that ``numpy.load`` reads: one ``.npy`` member per saved
    array (``a0.npy``, ``a1.npy``, ...) and a ``manifest.json`` member::

        {"format": "aioreplica.checkpoint", "version": 1, "entries": [
          {"path": ["model", "w"], "kind": "variable", "array": "a0", "dtype": "<f8",
           "shape": [64, 10], "synchronization": "auto", "aggregation": "none"},
          {"path": ["optimizer"], "kind": "optimizer", "class": "SGD", "array": "a1",
           "slots": [{"variable": ["model", "w"], "slot": "momentum", "array": "a2",
                      "dtype": "<f8", "shape": [64, 10]}]},
          {"path": ["epoch"], "kind": "number", "type": "int", "array": "a3"}]}

    A path is the object's place in ``Checkpoint(**objects)``: keyword, then dict keys and
    list indices. A mirrored variable saves its primary copy, a sync-on-read variable its
    aggregate (restored as in TF: ``SUM`` divided again by the replica count), so a
    checkpoint restores into any number of replicas, on any kind of device. An optimizer saves
    its step count, and its slots under the path of the variable they belong to.

Saving is atomic
    The file is written under a temporary name in the target directory, flushed and fsynced,
    then renamed over the target (and the directory fsynced). A crash at any point leaves the
    previous checkpoint whole: at worst a ``.<name>.*.tmp`` file stays behind.

Restoring changes nothing unless everything fits
    The file is read whole (with ``allow_pickle=False``: a checkpoint never runs code; ZIP
    checksums catch corruption), every entry is checked against the objects (names, kinds,
    dtypes, shapes), the new copies are placed on their devices, and only then is everything
    committed in one synchronous step. Any problem raises ``CheckpointError`` listing every
    mismatch by object path, with every object unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import zipfile
import zlib
from typing import TYPE_CHECKING, Any, Final, final

import anyio
import numpy as np

from . import _tree
from ._context import context_state
from ._errors import CheckpointError
from ._optimizers import Optimizer, restore_state, slot_table, slots_to_restore
from ._variables import Variable, new_copies, snapshot
from ._writes import commit, to_host

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["Checkpoint", "CheckpointManager"]

FORMAT: Final = "aioreplica.checkpoint"
VERSION: Final = 1
_MANIFEST: Final = "manifest.json"

Path = tuple[str | int, ...]


def _show(path: Path) -> str:
    return "/".join(map(str, path))


@final
class Checkpoint:
    """A set of objects saved and restored together.

    Objects are given by keyword: variables, optimizers (their step count and slots), plain
    ``int`` or ``float`` values such as an epoch counter, and dicts, lists and tuples of these.
    A number is restored in place: at the top level read it back as an attribute
    (``ckpt.epoch``); inside a dict or list it is written back into that container. Assigning
    an attribute (``ckpt.epoch = 3``) replaces or adds an object.

    Args:
        **objects: what to save, by name.

    Raises:
        TypeError: an object of another kind, a dict key that is not a string, or a number
            inside a tuple (which cannot be restored in place).

    Example:
        >>> w = aioreplica.Variable(np.zeros(3), name="w")
        >>> ckpt = Checkpoint(model={"w": w}, epoch=0)
        >>> path = anyio.run(ckpt.save, tmp / "model.npz")
        >>> anyio.run(w.assign, 1.0)
        <aioreplica.Variable 'w' shape=(3,) dtype=float64 value=array([1., 1., 1.])>
        >>> anyio.run(ckpt.restore, path)
        >>> w.numpy()
        array([0., 0., 0.])
    """

    __slots__ = ("_objects",)

    def __init__(self, **objects: Any) -> None:
        for name, value in objects.items():
            _check_objects(name, value)
        object.__setattr__(self, "_objects", dict(objects))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._objects[name]
        except KeyError:
            raise AttributeError(f"this Checkpoint holds no object named {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            raise AttributeError(f"Checkpoint object names cannot start with '_': {name!r}")
        _check_objects(name, value)
        self._objects[name] = value

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._objects)})"

    async def save(self, path: str | os.PathLike[str]) -> str:
        """Write every object to ``path`` atomically; return the path.

        The values saved are those at the moment of the call (a consistent snapshot, even
        while other tasks keep training). The file is written in a worker thread, and once
        started it finishes even if the caller is cancelled.

        Args:
            path: the file to write (``.npz`` by convention); its directory must exist.

        Returns:
            ``path`` as a string.

        Raises:
            RuntimeError: called inside a replica (save from cross-replica code, after
                ``run()``).
            ValueError: an optimizer has slots for a variable that is not in this checkpoint.
            OSError: the file cannot be written; any previous file at ``path`` is intact.

        Example:
            >>> ckpt = Checkpoint(step=3)
            >>> anyio.run(ckpt.save, tmp / "step.npz").endswith("step.npz")
            True
        """
        _check_not_in_replica("save")
        path = os.fspath(path)
        entries: list[dict[str, Any]] = []
        pending: list[tuple[str, Any, Any]] = []  # (member, array or number, device)

        def add(value: Any, device: Any = None) -> str:
            member = f"a{len(pending)}"
            pending.append((member, value, device))
            return member

        # Take every value at once, with no await in between: a consistent snapshot.
        variable_paths = {id(v): p for p, v in self._leaves() if isinstance(v, Variable)}
        for obj_path, obj in self._leaves():
            if isinstance(obj, Variable):
                array, device = snapshot(obj)
                entries.append(_variable_entry(obj_path, obj, add(array, device)))
            elif isinstance(obj, Optimizer):
                entries.append(_optimizer_entry(obj_path, obj, variable_paths, add))
            else:
                entries.append(
                    {
                        "path": list(obj_path),
                        "kind": "number",
                        "type": type(obj).__name__,
                        "array": add(obj),
                    }
                )
        arrays = []
        for member, value, device in pending:
            if device is None:
                arrays.append((member, np.asarray(value)))
            else:
                arrays.append((member, await to_host(value, device)))
        manifest = {"format": FORMAT, "version": VERSION, "entries": entries}
        data = json.dumps(manifest, indent=1).encode()
        await anyio.to_thread.run_sync(_write_atomic, path, data, arrays)
        return path

    async def restore(self, path: str | os.PathLike[str]) -> None:
        """Set every object to its value in the checkpoint at ``path``, or change nothing.

        Every entry is checked first: each object must be in the file with the same kind,
        dtype and shape, and the file must hold nothing else. The number of replicas and the
        kind of device may differ from when it was saved. An optimizer without slots yet
        gets them from the file.

        Args:
            path: a file written by ``save`` or ``CheckpointManager.save``.

        Raises:
            CheckpointError: the file is truncated, corrupted, not a checkpoint, or does not
                match the objects; ``problems`` names each object concerned. Nothing changed.
            FileNotFoundError: there is no such file.
            RuntimeError: called inside a replica.

        Example:
            >>> ckpt = Checkpoint(step=3)
            >>> path = anyio.run(ckpt.save, tmp / "step.npz")
            >>> ckpt.step = 5
            >>> anyio.run(ckpt.restore, path)
            >>> ckpt.step
            3
        """
        _check_not_in_replica("restore")
        path = os.fspath(path)
        manifest, arrays = await anyio.to_thread.run_sync(_read, path)
        plan = _Plan(path, manifest, arrays)
        for obj_path, obj in self._leaves():
            plan.expect(obj_path, obj, self._leaves)
        plan.finish()
        # Everything fits: place the new copies (nothing changes yet), then commit at once.
        updates = [(v, await new_copies(v, array)) for v, array in plan.variables]
        commit(updates)
        for optimizer, iterations, made in plan.optimizers:
            restore_state(optimizer, iterations, made)
        for obj_path, number in plan.numbers:
            self._set_number(obj_path, number)

    def _leaves(self) -> Iterator[tuple[Path, Any]]:
        pairs, _ = _tree.flatten_with_path(self._objects)
        for key_path, leaf in pairs:
            yield _plain_path(key_path), leaf

    def _set_number(self, path: Path, value: int | float) -> None:
        _parent(self._objects, path)[path[-1]] = value


@final
class CheckpointManager:
    """Numbered checkpoints in a directory, keeping the newest ``max_to_keep``.

    Files are named ``<checkpoint_name>-<number>.npz``. Existing ones in ``directory`` are
    found when the manager is made, so a restarted program resumes from ``latest``.

    Args:
        checkpoint: the ``Checkpoint`` to save.
        directory: where the files go (created on the first save).
        max_to_keep: how many to keep, oldest deleted first; ``None`` keeps all.
        checkpoint_name: the file name prefix.

    Raises:
        TypeError: ``checkpoint`` is not a ``Checkpoint``.
        ValueError: ``max_to_keep`` is not a positive int or None; ``checkpoint_name`` is
            empty or holds a path separator.

    Example:
        >>> manager = CheckpointManager(Checkpoint(step=1), tmp / "run", max_to_keep=2)
        >>> for step in range(3):
        ...     _ = anyio.run(manager.save)
        >>> [os.path.basename(p) for p in manager.checkpoints]
        ['ckpt-2.npz', 'ckpt-3.npz']
        >>> os.path.basename(manager.latest)
        'ckpt-3.npz'
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 5,
        *,
        checkpoint_name: str = "ckpt",
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint must be a Checkpoint, got {type(checkpoint).__name__}")
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise ValueError(f"max_to_keep must be an int >= 1 or None, got {max_to_keep!r}")
        if not checkpoint_name or os.sep in checkpoint_name or "/" in checkpoint_name:
            raise ValueError(
                f"checkpoint_name must be a non-empty file name prefix, got {checkpoint_name!r}"
            )
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        self._numbers = sorted(self._existing())

    @property
    def directory(self) -> str:
        """The directory of the checkpoints."""
        return self._directory

    @property
    def checkpoints(self) -> list[str]:
        """The kept checkpoint files, oldest first."""
        return [self._path(number) for number in self._numbers]

    @property
    def latest(self) -> str | None:
        """The newest checkpoint file, or ``None`` if there is none."""
        return self._path(self._numbers[-1]) if self._numbers else None

    async def save(self, checkpoint_number: int | None = None) -> str:
        """Save the checkpoint as the next number (or ``checkpoint_number``); prune old ones.

        Args:
            checkpoint_number: the number to save as; default one more than the newest.

        Returns:
            The path written.

        Raises:
            ValueError: ``checkpoint_number`` is not an int >= 0.
            OSError: as ``Checkpoint.save``; older checkpoints are kept.

        Example:
            >>> manager = CheckpointManager(Checkpoint(step=1), tmp / "numbered")
            >>> os.path.basename(anyio.run(manager.save, 7))
            'ckpt-7.npz'
        """
        if checkpoint_number is None:
            number = self._numbers[-1] + 1 if self._numbers else 1
        elif (
            isinstance(checkpoint_number, bool)
            or not isinstance(checkpoint_number, int)
            or checkpoint_number < 0
        ):
            raise ValueError(f"checkpoint_number must be an int >= 0, got {checkpoint_number!r}")
        else:
            number = checkpoint_number
        await anyio.to_thread.run_sync(lambda: os.makedirs(self._directory, exist_ok=True))
        path = await self._checkpoint.save(self._path(number))
        if number in self._numbers:
            self._numbers.remove(number)
        self._numbers.append(number)
        if self._max_to_keep is not None and len(self._numbers) > self._max_to_keep:
            drop = self._numbers[: -self._max_to_keep]
            self._numbers = self._numbers[-self._max_to_keep :]
            await anyio.to_thread.run_sync(_remove, [self._path(n) for n in drop])
        return path

    def _path(self, number: int) -> str:
        return os.path.join(self._directory, f"{self._name}-{number}.npz")

    def _existing(self) -> list[int]:
        try:
            names = os.listdir(self._directory)
        except FileNotFoundError:
            return []
        prefix = f"{self._name}-"
        numbers = []
        for name in names:
            middle = name[len(prefix) : -len(".npz")]
            if name.startswith(prefix) and name.endswith(".npz") and middle.isdigit():
                numbers.append(int(middle))
        return numbers

    def __repr__(self) -> str:
        return f"CheckpointManager({self._directory!r}, latest={self.latest!r})"


# -- saving ---------------------------------------------------------------------------------


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
    return {
        "path": list(path),
        "kind": "optimizer",
        "class": type(optimizer).__name__,
        "slot_names": list(optimizer.slot_names),
        "array": add(optimizer.iterations),
        "slots": slots,
    }


def _write_atomic(path: str, manifest: bytes, arrays: list[tuple[str, Any]]) -> None:
    """Write the archive under a temporary name, fsync it, rename it over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    # os.open applies the umask, as for any new file (mkstemp would force 0600).
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
                archive.writestr(_MANIFEST, manifest)
                for member, array in arrays:
                    with archive.open(f"{member}.npy", "w", force_zip64=True) as out:
                        np.lib.format.write_array(out, array, allow_pickle=False)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


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


def _remove(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# -- restoring ------------------------------------------------------------------------------


def _read(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray[Any, Any]]]:
    """The manifest and every array of a checkpoint file, read whole and checked."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    member = _MANIFEST
    try:
        # Our own file object: np.load leaves the file it opens open when ZipFile refuses it.
        with open(path, "rb") as file, np.load(file, allow_pickle=False) as npz:
            raw = npz[_MANIFEST]
            if not isinstance(raw, bytes):
                raise ValueError("the manifest is not a JSON document")
            manifest = json.loads(raw)
            _check_manifest(manifest)
            arrays = {}
            for member in _members(manifest):
                array = npz[member]
                if not isinstance(array, np.ndarray):
                    raise ValueError("not an array")
                arrays[member] = array
    except (zipfile.BadZipFile, zlib.error, EOFError, KeyError, ValueError, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        what = "the manifest" if member == _MANIFEST else f"array {member!r}"
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
    return manifest, arrays


def _check_manifest(manifest: Any) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"no {FORMAT!r} manifest")
    if manifest.get("version") != VERSION:
        raise ValueError(
            f"format version {manifest.get('version')!r}; this aioreplica reads version {VERSION}"
        )
    entries = manifest.get("entries")
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("path"), list) and isinstance(e.get("array"), str)
        for e in entries
    ):
        raise ValueError("malformed manifest entries")
    for entry in entries:
        slots = entry.get("slots", [])
        if not isinstance(slots, list) or not all(
            isinstance(s, dict) and isinstance(s.get("array"), str) for s in slots
        ):
            raise ValueError("malformed manifest slots")


def _members(manifest: dict[str, Any]) -> list[str]:
    members = []
    for entry in manifest["entries"]:
        members.append(entry["array"])
        members += [slot["array"] for slot in entry.get("slots", [])]
    return members


class _Plan:
    """A restore, checked entry by entry before anything changes."""

    def __init__(
        self, path: str, manifest: dict[str, Any], arrays: dict[str, np.ndarray[Any, Any]]
    ) -> None:
        self.path = path
        self.arrays = arrays
        self.entries: dict[Path, dict[str, Any]] = {}
        for entry in manifest["entries"]:
            self.entries[tuple(entry["path"])] = entry
        self.used: set[Path] = set()
        self.problems: list[str] = []
        self.variables: list[tuple[Variable, np.ndarray[Any, Any]]] = []
        self.optimizers: list[
            tuple[Optimizer, int, list[tuple[Variable, tuple[Variable, ...]]]]
        ] = []
        self.numbers: list[tuple[Path, int | float]] = []

    def expect(self, path: Path, obj: Any, leaves: Any) -> None:
        kind = (
            "variable"
            if isinstance(obj, Variable)
            else "optimizer"
            if isinstance(obj, Optimizer)
            else "number"
        )
        entry = self.entries.get(path)
        if entry is None:
            self.problems.append(f"{_show(path)}: not in the checkpoint")
            return
        self.used.add(path)
        if entry.get("kind") != kind:
            self.problems.append(
                f"{_show(path)}: the checkpoint holds an object of kind {entry.get('kind')} "
                f"there, this is of kind {kind}"
            )
            return
        if isinstance(obj, Variable):
            array = self._array(path, entry, obj.dtype, obj.shape)
            if array is not None:
                self.variables.append((obj, array))
        elif isinstance(obj, Optimizer):
            self._expect_optimizer(path, obj, entry, leaves)
        else:
            self._expect_number(path, obj, entry)

    def _array(
        self,
        path: Path,
        entry: dict[str, Any],
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
    ) -> np.ndarray[Any, Any] | None:
        """The entry's array if its dtype and shape are the object's (else a problem)."""
        array = self.arrays[entry["array"]]
        if entry.get("dtype") != array.dtype.str or entry.get("shape") != list(array.shape):
            self.problems.append(
                f"{_show(path)}: the file's array has dtype {array.dtype} and shape "
                f"{array.shape}, not what its manifest says (the file is corrupted)"
            )
            return None
        if array.dtype != dtype or tuple(array.shape) != shape:
            self.problems.append(
                f"{_show(path)}: dtype {array.dtype} and shape {tuple(array.shape)} in the "
                f"checkpoint, dtype {dtype} and shape {shape} here"
            )
            return None
        return array

    def _expect_optimizer(
        self, path: Path, optimizer: Optimizer, entry: dict[str, Any], leaves: Any
    ) -> None:
        name = type(optimizer).__name__
        if entry.get("class") != name or entry.get("slot_names") != list(optimizer.slot_names):
            self.problems.append(
                f"{_show(path)}: the checkpoint holds a {entry.get('class')} optimizer with "
                f"slots {entry.get('slot_names')}, this is a {name} with slots "
                f"{list(optimizer.slot_names)}"
            )
            return
        iterations = self.arrays[entry["array"]]
        if iterations.shape != () or iterations.dtype.kind not in "iu" or int(iterations) < 0:
            self.problems.append(f"{_show(path)}: its step count is not a non-negative int")
            return
        variables = {p: v for p, v in leaves() if isinstance(v, Variable)}
        saved: dict[Path, dict[str, np.ndarray[Any, Any]]] = {}
        for slot in entry["slots"]:
            variable_path = tuple(slot.get("variable", ()))
            variable = variables.get(variable_path)
            where = f"{_show(path)}: slot {slot.get('slot')!r} of {_show(variable_path)}"
            if variable is None:
                self.problems.append(f"{where}: no such variable here")
                continue
            array = self._array(
                (*path, "slots", *variable_path, str(slot.get("slot"))),
                slot,
                variable.dtype,
                variable.shape,
            )
            if array is not None:
                saved.setdefault(variable_path, {})[slot.get("slot")] = array
        paths = {id(v): p for p, v in variables.items()}
        for variable, _ in slot_table(optimizer):
            owned = paths.get(id(variable))
            if owned is None:
                self.problems.append(
                    f"{_show(path)}: has slots for variable {variable.name!r}, which is not "
                    "in this checkpoint"
                )
            elif owned not in saved and optimizer.slot_names:
                self.problems.append(
                    f"{_show(path)}: has slots for {_show(owned)}, the checkpoint has none"
                )
        made = []
        for variable_path, arrays in saved.items():
            if set(arrays) != set(optimizer.slot_names):
                self.problems.append(
                    f"{_show(path)}: slots {sorted(arrays)} of {_show(variable_path)} in the "
                    f"checkpoint, {list(optimizer.slot_names)} expected"
                )
                continue
            variable = variables[variable_path]
            slots = slots_to_restore(optimizer, variable)
            made.append((variable, slots))
            for slot_name, slot in zip(optimizer.slot_names, slots, strict=True):
                self.variables.append((slot, arrays[slot_name]))
        self.optimizers.append((optimizer, int(iterations), made))

    def _expect_number(self, path: Path, number: int | float, entry: dict[str, Any]) -> None:
        kind = type(number).__name__
        array = self.arrays[entry["array"]]
        if (
            entry.get("type") != kind
            or array.shape != ()
            or (array.dtype.kind != ("i" if kind == "int" else "f"))
        ):
            self.problems.append(
                f"{_show(path)}: the checkpoint holds a number of type {entry.get('type')} "
                f"there, this is of type {kind}"
            )
            return
        self.numbers.append((path, int(array) if kind == "int" else float(array)))

    def finish(self) -> None:
        for path in self.entries:
            if path not in self.used:
                self.problems.append(f"{_show(path)}: in the checkpoint but not restored here")
        if self.problems:
            raise CheckpointError(self.path, self.problems)


# -- checks ---------------------------------------------------------------------------------


def _check_objects(name: str, value: Any) -> None:
    pairs, _ = _tree.flatten_with_path(value)
    for key_path, leaf in pairs:
        where = _show((name, *_plain_path(key_path)))
        for key in key_path:
            if isinstance(key, _tree.MappingKey) and not isinstance(key.key, str):
                raise TypeError(
                    f"Checkpoint: the dict key {key.key!r} at {where} is not a string; "
                    "checkpoint paths are made of string keys and list indices"
                )
            if isinstance(key, _tree.AttrKey):
                raise TypeError(
                    f"Checkpoint: {where} is inside a {type(value).__name__}; use dicts, "
                    "lists and tuples to group objects"
                )
        if isinstance(leaf, Variable | Optimizer):
            continue
        if isinstance(leaf, int | float) and not isinstance(leaf, bool):
            if key_path and not _restorable(value, key_path):
                raise TypeError(
                    f"Checkpoint: the number at {where} is inside a tuple, where it cannot be "
                    "restored in place; use a list or a dict"
                )
            continue
        raise TypeError(
            f"Checkpoint: {where} is a {type(leaf).__name__}; a checkpoint holds variables, "
            "optimizers, ints and floats, in dicts, lists and tuples"
        )


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
            f"Checkpoint.{what}() was called inside replica {replica.replica_id_in_sync_group}; "
            f"call it from cross-replica code, outside strategy.run()"
        )
