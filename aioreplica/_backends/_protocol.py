"""The device protocol: what the scheduler and the strategy need from a device.

A device is where a replica's arrays live and its work runs. The scheduler calls ``enter()``
before every step of a replica's coroutine and ``leave()`` after it (DESIGN invariant 1), so a
device whose "current device" state is thread-local (CuPy's current device and stream) follows
its replica across every await. Host devices have nothing to enter: they say so with
``has_context = False`` and the scheduler then skips both calls on its hot path.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Device"]


@runtime_checkable
class Device(Protocol):
    """One device a replica runs on.

    Attributes:
        name: the canonical name, such as ``"cpu:0"`` or ``"gpu:1"``.
        kind: ``"cpu"`` or ``"gpu"`` (or another kind a third-party device defines).
        index: the device's number within its kind.
        has_context: whether ``enter``/``leave`` do anything; ``False`` lets the scheduler
            skip them.
    """

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def index(self) -> int: ...

    @property
    def has_context(self) -> bool: ...

    def enter(self) -> None:
        """Make this device current on the calling thread (before a replica step)."""

    def leave(self) -> None:
        """Undo ``enter`` (after a replica step, before the event loop runs anything else)."""
