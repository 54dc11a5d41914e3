"""``cupyx``: only ``allow_synchronize`` and ``DeviceSynchronized`` (``cupyx/_runtime.py``)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

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
