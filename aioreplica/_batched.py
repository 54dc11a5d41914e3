"""In-memory datasets: ``batched`` cuts arrays into global batches, one epoch per iteration.

``batch_rows`` is the one check that a batch's leaves share a leading (batch) size; the
distributed iterator uses it on every batch it splits.

Resumable input
    ``iter(batched(...))`` is a ``BatchedIterator``: one epoch. A ``Checkpoint`` saves its
    place as a small JSON-ready state (``BatchedIterator._input_state``): what the dataset is
    (rows, batch size, shuffle, the structure and the leaves' dtypes and row shapes), the
    epoch, the position (batches handed out) and, with ``shuffle=True``, the state of the
    dataset's random generator from *before* this epoch's permutation was drawn. Restoring it
    into an iterator over an identical dataset draws that permutation again, which leaves the
    dataset's generator where it was after the draw: the iteration continues at the next batch
    of the same epoch, and later epochs shuffle as they would have in an unbroken run. The
    arrays' values are not compared: the same arrays, in the same order, are the caller's part.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Final, Protocol, SupportsIndex, final

import numpy as np

from . import _tree
from ._errors import checked_integer

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["BatchedIterator", "ResumableInput", "batch_rows", "batched"]

#: The errors numpy raises for a random state that does not fit its generator.
_BAD_RANDOM_STATE: Final = (TypeError, ValueError, KeyError, OverflowError, AttributeError)


@final
class batched:
    """Batches of in-memory arrays: an iterable of global batches, one epoch per iteration.

    Each ``iter()`` is a new epoch, a ``BatchedIterator``; with ``shuffle=True`` it draws its
    permutation of the rows from the dataset's generator when it is made. Its place in the
    epoch can be saved in a ``Checkpoint`` (``Checkpoint(data=iterator)``).

    NumPy batches are read-only (``writeable=False``), as the batches of a distributed
    dataset are: without shuffle they are views of ``arrays``, so nothing is copied and a
    change would reach every later epoch. A step that changes its batch in place copies it
    first (``batch = batch.copy()``).

    Args:
        arrays: a nested structure of arrays sharing a leading dimension, e.g. ``(x, y)``.
        batch_size: rows per batch; the last batch of an epoch may be smaller.
        shuffle: draw a new permutation of the rows for every epoch.
        seed: seeds the permutations (the same seed gives the same sequence of epochs): an
            int >= 0 (NumPy's integers too), only with ``shuffle=True``; ``None`` draws one.

    Raises:
        ValueError: ``batch_size`` < 1, or the arrays' leading sizes differ; ``seed`` is
            negative, or given with ``shuffle=False`` (which has no permutations to seed).
        TypeError: a leaf has no leading dimension; ``batch_size`` or ``seed`` is not an
            integer (a bool is not one); ``shuffle`` is not a bool.

    Example:
        >>> [b.tolist() for b in batched(np.arange(5), 2)]
        [[0, 1], [2, 3], [4]]
        >>> next(iter(batched(np.arange(5), 2))).flags.writeable
        False
    """

    def __init__(
        self,
        arrays: Any,
        batch_size: SupportsIndex,
        *,
        shuffle: bool = False,
        seed: SupportsIndex | None = None,
    ) -> None:
        size = checked_integer(batch_size, "batch_size must be an int >= 1", 1)
        if not isinstance(shuffle, bool | np.bool_):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        seed_value = None
        if seed is not None:
            seed_value = checked_integer(seed, "seed must be an int >= 0 or None", 0)
            if not shuffle:
                raise ValueError(
                    f"seed={seed_value} only applies to shuffle=True, whose permutations it "
                    "seeds; pass shuffle=True with it, or no seed"
                )
        self._leaves, self._treedef = _tree.flatten(arrays)
        self._rows = batch_rows(arrays, self._leaves, "batched")
        # What a shuffled batch's gather copies, which decides where it is made: fixed by the
        # leaves, so counted once here rather than over every leaf for every batch.
        self._row_bytes = sum(
            leaf.itemsize * math.prod(leaf.shape[1:])
            for leaf in self._leaves
            if isinstance(leaf, np.ndarray)
        )
        self._host_only = all(isinstance(leaf, np.ndarray) for leaf in self._leaves)
        self._batch_size = size
        self._rng = np.random.default_rng(seed_value) if shuffle else None
        self._epochs = 0  # iterators made so far: the epoch of the next one

    def __len__(self) -> int:
        return math.ceil(self._rows / self._batch_size)

    def __iter__(self) -> BatchedIterator:
        return BatchedIterator(self)

    def _structure(self, *, sized_records: bool = False) -> str:
        """The structure of a batch, a leaf drawn as its dtype and shape (``*``: the rows).

        ``sized_records`` draws a structured dtype by its size alone (``void128``), as
        checkpoints written before its fields were drawn hold it.
        """
        described = [_LeafShape(leaf, sized_records=sized_records) for leaf in self._leaves]
        return repr(self._treedef.unflatten(described))


@final
class BatchedIterator:
    """One epoch of a ``batched`` dataset (``iter(batched(...))``); a ``Checkpoint`` can save
    its place.

    ``epoch`` counts the dataset's iterators made before this one; ``position`` the batches
    this one has handed out.

    Raises:
        TypeError: ``dataset`` is not a ``batched`` dataset (``iter(batched(...))`` makes
            one of these; other iterables have iterators of their own).

    Example:
        >>> data = batched(np.arange(5), 2)
        >>> iterator = iter(data)
        >>> next(iterator).tolist(), iterator.epoch, iterator.position
        ([0, 1], 0, 1)
        >>> [b.tolist() for b in iterator]
        [[2, 3], [4]]
    """

    __slots__ = ("_dataset", "_epoch", "_order", "_position", "_random_state")

    def __init__(self, dataset: batched) -> None:
        if not isinstance(dataset, batched):
            raise TypeError(
                f"BatchedIterator: dataset must be an aioreplica.batched dataset, got "
                f"{type(dataset).__name__} {dataset!r:.60}; iter(batched(arrays, batch_size)) "
                "makes its iterators"
            )
        self._dataset = dataset
        self._epoch = dataset._epochs
        dataset._epochs += 1
        self._position = 0
        rng = dataset._rng
        # The generator's state before this epoch's permutation is drawn: a restore draws the
        # same permutation from it, leaving the generator as an unbroken run leaves it.
        self._random_state: dict[str, Any] | None = None
        self._order: np.ndarray[Any, Any] | None = None
        if rng is not None:
            self._random_state = dict(rng.bit_generator.state)
            self._order = rng.permutation(dataset._rows)

    def __iter__(self) -> BatchedIterator:
        return self

    def __next__(self) -> Any:
        rows = self._next_rows()
        if rows is None:
            raise StopIteration
        return self._batch(rows)

    def _next_rows(self) -> slice | np.ndarray[Any, Any] | None:
        """Take the next batch's place: its rows of the dataset (a slice, or with shuffle the
        indices to gather), or None at the end of the epoch. ``_batch`` makes the batch, which
        for a shuffled one is a copy that a caller may make on another thread."""
        dataset = self._dataset
        start = self._position * dataset._batch_size
        if start >= dataset._rows:
            return None
        self._position += 1
        stop = min(start + dataset._batch_size, dataset._rows)
        return slice(start, stop) if self._order is None else self._order[start:stop]

    def _batch(self, rows: slice | np.ndarray[Any, Any]) -> Any:
        """The batch of ``rows`` (from ``_next_rows``)."""
        dataset = self._dataset
        parts = [leaf[rows] for leaf in dataset._leaves]
        # Unshuffled batches are views of the caller's arrays: a step that changed one in
        # place would change the data of every later epoch. Shuffled ones are copies, read-only
        # as well, so that a step behaves the same with or without shuffle.
        for part in parts:
            if isinstance(part, np.ndarray):
                part.flags.writeable = False
        return dataset._treedef.unflatten(parts)

    def _gathered_bytes(self, rows: slice | np.ndarray[Any, Any]) -> int:
        """The bytes of host memory ``_batch(rows)`` copies: none for a slice (views)."""
        return 0 if isinstance(rows, slice) else len(rows) * self._dataset._row_bytes

    def _host_only(self) -> bool:
        """Whether every leaf is a host (NumPy) array, which any thread can gather from."""
        return self._dataset._host_only

    @property
    def epoch(self) -> int:
        """The epoch this iterator goes through, from 0."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many batches this iterator has handed out."""
        return self._position

    def __repr__(self) -> str:
        return (
            f"<aioreplica.BatchedIterator epoch={self._epoch} position={self._position} "
            f"of {len(self._dataset)} batches>"
        )

    # -- checkpoints (see the module docstring) ----------------------------------------------

    def _first_batch_rows(self) -> int:
        """The rows of the dataset's first batch: the full batch size, or every row."""
        return min(self._dataset._batch_size, self._dataset._rows)

    def _input_state(self, position: int | None = None) -> dict[str, Any]:
        """This iterator's place (at ``position``, by default its own), ready for JSON."""
        dataset = self._dataset
        return {
            "rows": dataset._rows,
            "batch_size": dataset._batch_size,
            "shuffle": dataset._rng is not None,
            "structure": dataset._structure(),
            "epoch": self._epoch,
            "position": self._position if position is None else position,
            "random_state": self._random_state,
        }

    def _input_differences(self, state: dict[str, Any]) -> list[str]:
        """How the dataset described by ``state`` differs from this iterator's."""
        here = self._input_state()
        differences = []
        for field, name in _DATASET_FIELDS.items():
            if state[field] != here[field] and not self._older_structure(field, state[field]):
                differences.append(
                    f"{name} {_shown(field, state[field])} in the checkpoint, "
                    f"{_shown(field, here[field])} here"
                )
        return differences

    def _older_structure(self, field: str, value: Any) -> bool:
        """Whether ``value`` is this dataset's structure as older checkpoints drew it.

        Those drew a structured dtype by its size alone: a record of the same size matches,
        as nothing there tells its fields apart.
        """
        return field == "structure" and value == self._dataset._structure(sized_records=True)

    def _input_problem(self, state: dict[str, Any]) -> str | None:
        """Why ``state``, of a dataset like this one, cannot be restored: a corrupted file."""
        problem = self._state_problem(state)
        return None if problem is None else f"{problem}; the file is corrupted"

    def _state_problem(self, state: dict[str, Any]) -> str | None:
        batches = len(self._dataset)
        if state["position"] > batches:
            return f"position {state['position']} is past the end of its epoch ({batches} batches)"
        random_state = state["random_state"]
        if (random_state is None) != (self._dataset._rng is None):
            return "its random state does not match its shuffle flag"
        if random_state is not None:
            assert self._dataset._rng is not None
            # Tried on a generator of its own: nothing changes before the restore commits.
            probe = type(self._dataset._rng.bit_generator)()
            try:
                probe.state = random_state
            except _BAD_RANDOM_STATE as exc:
                return f"its random state is not one of a {type(probe).__name__} generator ({exc})"
        return None

    def _restore_input(self, state: dict[str, Any]) -> None:
        """Take the place ``state`` describes (checked with the two methods above)."""
        dataset = self._dataset
        self._epoch = state["epoch"]
        dataset._epochs = self._epoch + 1
        self._position = state["position"]
        self._random_state = state["random_state"]
        if dataset._rng is not None:
            dataset._rng.bit_generator.state = self._random_state
            self._order = dataset._rng.permutation(dataset._rows)


class ResumableInput(Protocol):
    """What a ``Checkpoint`` needs of an iterator it saves: a ``BatchedIterator``, or a
    ``DistributedIterator`` over a ``batched`` dataset."""

    def _input_state(self) -> dict[str, Any]: ...

    def _input_differences(self, state: dict[str, Any]) -> list[str]: ...

    def _input_problem(self, state: dict[str, Any]) -> str | None: ...

    def _restore_input(self, state: dict[str, Any]) -> None: ...


#: The fields that describe the dataset (they must match for a restore), with their names.
_DATASET_FIELDS: Final = {
    "rows": "rows",
    "batch_size": "batch size",
    "shuffle": "shuffle",
    "structure": "batch structure",
}


def _shown(field: str, value: Any) -> str:
    if field == "shuffle":
        return "on" if value else "off"
    return str(value)


@final
class _LeafShape:
    """A leaf drawn in a structure as its dtype and shape, ``*`` for the rows."""

    __slots__ = ("_text",)

    def __init__(self, leaf: Any, *, sized_records: bool = False) -> None:
        rows = ", ".join(["*", *map(str, leaf.shape[1:])])
        dtype = np.dtype(leaf.dtype)
        # A structured dtype's name gives only its size ("void64"): its fields tell records
        # of one layout from another. Other dtypes keep their name, which checkpoints hold.
        described = dtype.name if dtype.fields is None or sized_records else str(dtype)
        self._text = f"{described}[{rows}]"

    def __repr__(self) -> str:
        return self._text


def batch_rows(batch: Any, leaves: Sequence[Any], what: str) -> int:
    """The shared leading size of ``leaves``, the leaves of ``batch`` (flattened);
    ``TypeError``/``ValueError`` naming the path."""
    sizes = []
    for leaf in leaves:
        shape = getattr(leaf, "shape", None)
        if not shape:
            # Named by a walk that ends at it: a batch of nested Python lists has a leaf per
            # number, too many to pair each with its path.
            path = _first_unbatched(batch)
            raise TypeError(
                f"{what}: the leaf at {_tree.describe_path(path)} is "
                f"{_tree.with_article(type(leaf).__name__)}, which has no batch dimension; "
                "every leaf must be an array whose first dimension is the batch"
                f"{_list_advice(batch, path)}"
            )
        sizes.append(shape[0])
    if sizes and all(size == sizes[0] for size in sizes):
        return int(sizes[0])
    if not sizes:
        raise ValueError(f"{what}: the batch has no arrays")
    paths = [path for path, _ in _tree.flatten_with_path(batch)[0]]
    listed = ", ".join(
        f"{_tree.describe_path(path)} has {size}" for path, size in zip(paths, sizes, strict=True)
    )
    raise ValueError(f"{what}: leaves have different leading (batch) sizes: {listed}")


def _first_unbatched(batch: Any) -> _tree.KeyPath:
    """The path of ``batch``'s first leaf (in flatten order) that has no batch dimension;
    ``batch`` has one."""
    pending: list[tuple[_tree.KeyPath, Any]] = [((), batch)]  # depth first, next one last
    while pending:
        path, node = pending.pop()
        level = _tree.node_level(node)
        if level is None:
            if not getattr(node, "shape", None):
                return path
            continue
        pending.extend(
            ((*path, key), child)
            for key, child in zip(reversed(level.keys), reversed(level.children), strict=True)
        )
    raise AssertionError("the batch has a leaf without a batch dimension")


def _list_advice(batch: Any, path: _tree.KeyPath) -> str:
    """What to do when the leaf at ``path`` lies inside a list of ``batch``: tf.data makes a
    Python list one tensor, where here (as in ``tf.nest``, and for ``run()``'s arguments) a
    list is a structure whose items are leaves of their own."""
    node = batch
    for depth, key in enumerate(path):
        if isinstance(node, list):
            where = _tree.describe_path(path[:depth])
            try:
                np.asarray(node)
            except (TypeError, ValueError):  # ragged: items of different shapes
                fix = (
                    "its items differ in shape, so no one array can hold them: give them all "
                    "one shape, then np.asarray(...) makes the list an array of rows"
                )
            else:
                fix = "wrap it in np.asarray(...) to make it an array of rows"
            return (
                f"; the list at {where} is taken as a structure (as in tf.nest), not as one "
                f"array as tf.data takes it: {fix}"
            )
        level = _tree.node_level(node)
        assert level is not None  # a node on the way to a leaf
        node = level.children[level.keys.index(key)]
    return ""
