"""The host backend: NumPy arrays on logical CPU devices ``cpu:0``, ``cpu:1``, ...

Several logical CPU devices are how replicas are laid out on a host with no GPU. They share
the host's memory, so there is no device state to switch between replica steps.
"""

from __future__ import annotations

from typing import Final, final

__all__ = ["HostDevice"]


@final
class HostDevice:
    """A logical host device, ``cpu:<index>``.

    Example:
        >>> HostDevice(1).name
        'cpu:1'
    """

    __slots__ = ("_index",)

    kind: Final = "cpu"
    has_context: Final = False

    def __init__(self, index: int) -> None:
        self._index = index

    @property
    def name(self) -> str:
        return f"cpu:{self._index}"

    @property
    def index(self) -> int:
        return self._index

    def enter(self) -> None:
        pass

    def leave(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<HostDevice {self.name}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HostDevice) and other._index == self._index

    def __hash__(self) -> int:
        return hash(("cpu", self._index))
