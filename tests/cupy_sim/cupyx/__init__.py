"""``cupyx``: ``allow_synchronize`` and ``DeviceSynchronized`` (``cupyx/_runtime.py``), and
``empty_pinned`` (``cupyx/_pinned_array.py``)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterator


class DeviceSynchronized(RuntimeError):
    """Raised from a call that synchronises the host inside ``allow_synchronize(False)``."""


@contextlib.contextmanager
def allow_synchronize(allow: bool) -> Iterator[None]:
    """Within the block, on this thread, ``ndarray.get()`` and ``Device.synchronize()`` raise
    ``DeviceSynchronized`` (what CuPy's ``syncdetect`` catches); warns that it is deprecated."""
    import warnings

    from cupy import _sim

    warnings.warn(
        "cupyx.allow_synchronize will be removed in future releases as it is not possible to "
        "reliably detect synchronizations.",
        stacklevel=3,
    )
    thread = _sim.world().thread
    previous = thread.allow_synchronize
    thread.allow_synchronize = allow
    try:
        yield
    finally:
        thread.allow_synchronize = previous


def empty_pinned(shape: Any, dtype: Any = float, order: str = "C") -> np.ndarray[Any, Any]:
    """A NumPy array in "page-locked" host memory: plain host memory here, which
    ``MemoryPointer.copy_to_host_async`` fills asynchronously."""
    from cupy import _sim

    world = _sim.world()
    result: np.ndarray[Any, Any] = np.empty(shape, dtype=dtype, order=order)  # type: ignore[call-overload]
    world.pinned(result)
    return result
