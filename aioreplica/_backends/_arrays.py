"""The one place that tells arrays apart: NumPy, CuPy, scalars, anything else.

As in array-api-compat, a CuPy array is recognised by its type's module, so nothing here
imports CuPy: ``import aioreplica`` stays light, and a process without CuPy never loads it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ._protocol import Device

__all__ = ["array_kind", "array_module", "host_array", "is_array", "is_cupy_array"]


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
