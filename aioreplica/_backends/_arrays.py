"""The one place that tells arrays apart: NumPy, CuPy, scalars, anything else.

As in array-api-compat, a CuPy array is recognised by its type's module, so nothing here
imports CuPy: ``import aioreplica`` stays light, and a process without CuPy never loads it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _tree

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._protocol import Device

__all__ = [
    "array_kind",
    "array_module",
    "host_array",
    "is_array",
    "is_cupy_array",
    "on_replica_devices",
]


def is_cupy_array(value: object) -> bool:
    """Whether ``value`` is a CuPy array (``False`` at once where CuPy was never imported).

    Example:
        >>> is_cupy_array(np.zeros(2))
        False
    """
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray)


def is_array(value: object) -> bool:
    """Whether ``value`` is a NumPy or CuPy array.

    Example:
        >>> is_array(np.zeros(2)), is_array([1.0])
        (True, False)
    """
    return isinstance(value, np.ndarray) or is_cupy_array(value)


def array_kind(value: object) -> str:
    """``"numpy"``, ``"cupy"``, ``"scalar"`` (a Python or NumPy scalar), else the type's name.

    Example:
        >>> array_kind(np.zeros(2)), array_kind(np.float32(1)), array_kind(2), array_kind("x")
        ('numpy', 'scalar', 'scalar', 'builtins.str')
    """
    if isinstance(value, np.ndarray):
        return "numpy"
    if isinstance(value, bool | int | float | complex | np.generic):
        return "scalar"
    if is_cupy_array(value):
        return "cupy"
    return f"{type(value).__module__}.{type(value).__qualname__}"


def array_module(array: Any) -> Any:
    """``numpy`` or ``cupy``: the module of ``array`` (anything else counts as NumPy's).

    Example:
        >>> array_module(np.zeros(2)).__name__
        'numpy'
    """
    if is_cupy_array(array):
        return sys.modules["cupy"]
    return np


def host_array(value: Any, owner: Device | None = None) -> np.ndarray[Any, Any]:
    """``value`` on the host: NumPy data as it is (no copy), a CuPy array copied to the host.

    The copy is ordered after the work that made the array. With ``owner`` (the device whose
    work made it) the copy runs on that device's stream. Without one it runs on the current
    stream of the array's own GPU: outside a replica's step that is the legacy default
    stream, and CUDA orders it after the (blocking) replica streams of that GPU. Blocks the
    calling thread until the copy is done.

    Example:
        >>> host_array([1, 2])
        array([1, 2])
    """
    if not is_cupy_array(value):
        return np.asarray(value)
    cupy_array: Any = value
    with cupy_array.device:
        return cupy_array.get(stream=getattr(owner, "stream", None))  # type: ignore[no-any-return]


_Arguments = tuple[tuple[Any, ...], dict[str, Any]]


def on_replica_devices(
    parts: list[_Arguments], devices: Sequence[Device], *, host_data: bool = False
) -> list[_Arguments]:
    """Each replica's ``(args, kwargs)``, with every CuPy array in it that lives on another GPU
    than the replica's copied onto the replica's device, and with ``host_data`` every NumPy
    array too (``extended.update`` runs ``fn`` on the copy's device, as TF does; ``run()``
    leaves host data on the host).

    ``device.asarray`` makes the copy on the replica's stream after the work queued so far on
    the array's GPU's current stream (where code outside a step made it), so the replica
    reads the array after it is written, as TF copies a step's inputs to each replica's device.
    An array passed twice is copied once, and stays one object. A replica whose arguments need
    no copy gets them as they are, and so does every replica on a host device: it reads host
    data where it is, and a CuPy array is left alone (copying it to the host would block the
    event loop's thread until its GPU is done).

    Example:
        >>> from aioreplica._backends import host_device
        >>> on_replica_devices([((np.zeros(2),), {"scale": 2})], [host_device(0)])
        [((array([0., 0.]),), {'scale': 2})]
    """
    if "cupy" not in sys.modules:  # no GPU device without CuPy: nothing to copy
        return parts
    placed = []
    for part, device in zip(parts, devices, strict=True):
        if device.kind != "gpu":
            placed.append(part)
            continue
        leaves, treedef = _tree.flatten(part)
        copies: dict[int, Any] = {}
        for leaf in leaves:
            moved = is_cupy_array(leaf) or (host_data and isinstance(leaf, np.ndarray))
            if moved and id(leaf) not in copies:
                copies[id(leaf)] = device.asarray(leaf)
        if any(copy is not leaf for leaf in leaves if (copy := copies.get(id(leaf))) is not None):
            part = treedef.unflatten([copies.get(id(leaf), leaf) for leaf in leaves])
        placed.append(part)
    return placed
