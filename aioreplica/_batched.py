"""In-memory datasets: ``batched`` cuts arrays into global batches, one epoch per iteration.

``batch_rows`` is the one check that a batch's leaves share a leading (batch) size; the
distributed iterator uses it on every batch it splits.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, final

import numpy as np

from . import _tree

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

__all__ = ["batch_rows", "batched"]


@final
class batched:
    """Batches of in-memory arrays: an iterable of global batches, one epoch per iteration.

    Args:
        arrays: a nested structure of arrays sharing a leading dimension, e.g. ``(x, y)``.
        batch_size: rows per batch; the last batch of an epoch may be smaller.
        shuffle: draw a new permutation of the rows for every epoch.
        seed: seeds the permutations (the same seed gives the same sequence of epochs).

    Raises:
        ValueError: ``batch_size`` < 1, or the arrays' leading sizes differ.
        TypeError: a leaf has no leading dimension.

    Example:
        >>> [b.tolist() for b in batched(np.arange(5), 2)]
        [[0, 1], [2, 3], [4]]
    """

    def __init__(
        self, arrays: Any, batch_size: int, *, shuffle: bool = False, seed: int | None = None
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self._leaves, self._treedef = _tree.flatten(arrays)
        self._rows = batch_rows(self._leaves, self._treedef, "batched")
        self._batch_size = batch_size
        self._rng = np.random.default_rng(seed) if shuffle else None

    def __len__(self) -> int:
        return math.ceil(self._rows / self._batch_size)

    def __iter__(self) -> Iterator[Any]:
        order = None if self._rng is None else self._rng.permutation(self._rows)
        for start in range(0, self._rows, self._batch_size):
            stop = min(start + self._batch_size, self._rows)
            if order is None:
                parts = [leaf[start:stop] for leaf in self._leaves]
            else:
                rows = order[start:stop]
                parts = [leaf[rows] for leaf in self._leaves]
            yield self._treedef.unflatten(parts)


def batch_rows(leaves: Sequence[Any], treedef: _tree.TreeDef, what: str) -> int:
    """The shared leading size of ``leaves``; ``TypeError``/``ValueError`` naming the path."""
    sizes = [shape[0] if (shape := getattr(leaf, "shape", None)) else None for leaf in leaves]
    if sizes and sizes[0] is not None and all(size == sizes[0] for size in sizes):
        return int(sizes[0])
    paths = [path for path, _ in _tree.flatten_with_path(treedef.unflatten(leaves))[0]]
    for path, leaf, size in zip(paths, leaves, sizes, strict=True):
        if size is None:
            raise TypeError(
                f"{what}: the leaf at {_tree.describe_path(path)} is a {type(leaf).__name__}, "
                "which has no batch dimension; every leaf must be an array whose first "
                "dimension is the batch"
            )
    if not sizes:
        raise ValueError(f"{what}: the batch has no arrays")
    listed = ", ".join(
        f"{_tree.describe_path(path)} has {size}" for path, size in zip(paths, sizes, strict=True)
    )
    raise ValueError(f"{what}: leaves have different leading (batch) sizes: {listed}")
