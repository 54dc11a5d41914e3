"""Devices for tests: third-party ``Device`` implementations over a host device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from aioreplica._backends import HostDevice

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

    from aioreplica._backends import ArrayBackend

T = TypeVar("T")


class FakeDevice:
    """Implements the whole ``Device`` protocol; arrays and work go to a host device."""

    kind = "cpu"
    has_context = True

    def __init__(self, name: str, index: int = 0) -> None:
        self.name = name
        self.index = index
        self._host = HostDevice(index)

    @property
    def xp(self) -> ModuleType:
        return self._host.xp

    @property
    def backend(self) -> ArrayBackend:
        return self._host.backend

    async def compute(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        return await self.run(fn, *args)

    def enter(self) -> None:
        pass

    def leave(self) -> None:
        pass

    def asarray(self, value: Any) -> Any:
        return self._host.asarray(value)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await self._host.run(fn, *args, **kwargs)

    async def synchronize(self) -> None:
        await self._host.synchronize()


class RecordingDevice(FakeDevice):
    """A device whose "current device" is process state, like CuPy's thread-local device.

    ``enter``/``leave`` record into the class-wide ``log`` and set ``current``; anything but
    strictly alternating enter/leave pairs shows up in the log as ``nested enter`` or
    ``bad leave``.
    """

    current: str | None = None
    log: list[tuple[str, str]] = []  # noqa: RUF012 - reset by each test that uses it

    def __init__(self, index: int) -> None:
        super().__init__(f"rec:{index}", index)

    def enter(self) -> None:
        if RecordingDevice.current is not None:
            RecordingDevice.log.append(("nested enter", self.name))
        RecordingDevice.current = self.name
        RecordingDevice.log.append(("enter", self.name))

    def leave(self) -> None:
        if RecordingDevice.current != self.name:
            RecordingDevice.log.append(("bad leave", self.name))
        RecordingDevice.current = None
        RecordingDevice.log.append(("leave", self.name))
