"""``cupy.cuda.runtime``: the calls the backend and the checks make."""

from __future__ import annotations

from typing import Any

from .. import _sim

_ERRORS = {
    1: "cudaErrorInvalidValue: invalid argument",
    2: "cudaErrorMemoryAllocation: out of memory",
    101: "cudaErrorInvalidDevice: invalid device ordinal",
    700: "cudaErrorIllegalAddress: an illegal memory access was encountered",
}


class CUDARuntimeError(RuntimeError):
    """As CuPy's: made from a CUDA status code (``cupy_backends/cuda/api/runtime.pyx``)."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(_ERRORS.get(status, f"cudaError {status}"))

    def __reduce__(self) -> Any:
        return (type(self), (self.status,))


def getDeviceCount() -> int:
    return _sim.world().device_count


def getDevice() -> int:
    return _sim.world().thread.device


def setDevice(device: int) -> None:
    world = _sim.world()
    world.check_device(device)
    world.thread.device = device


def deviceSynchronize() -> None:
    world = _sim.world()
    world.device_sync(world.thread.device, "runtime.deviceSynchronize")


def runtimeGetVersion() -> int:
    return 13000


def driverGetVersion() -> int:
    return 13000


def getDeviceProperties(device: int) -> dict[str, Any]:
    _sim.world().check_device(device)
    return {
        "name": b"Simulated GPU (cupy_sim)",
        "totalGlobalMem": 1 << 34,
        "major": 9,
        "minor": 0,
        "multiProcessorCount": 4,
    }


def deviceCanAccessPeer(device: int, peer: int) -> int:
    world = _sim.world()
    world.check_device(device)
    world.check_device(peer)
    return int(world.peer_access)
