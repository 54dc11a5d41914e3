"""``cupy.cuda``: devices, streams, events and memory pointers of the simulated machine.

Per host thread there is a current device and, per device, a current stream and the stack of
streams that ``with stream:`` blocks saved (``cupy/cuda/stream.pyx``, ``_ThreadLocal``).
"""

from __future__ import annotations

from typing import Any

from .. import _sim
from . import runtime

__all__ = [
    "Device",
    "Event",
    "MemoryPointer",
    "Stream",
    "get_current_stream",
    "get_device_id",
    "runtime",
]


def get_device_id() -> int:
    return _sim.world().thread.device


class Device:
    """``cupy.cuda.Device``: a GPU by index; ``with Device(i):`` makes it current and restores
    the device of before from a per-thread stack (``cupy/cuda/device.pyx``)."""

    def __init__(self, device: Any = None) -> None:
        self.id: int = _sim.world().thread.device if device is None else int(device)

    def use(self) -> None:
        runtime.setDevice(self.id)

    def __enter__(self) -> Device:
        thread = _sim.world().thread
        thread.device_stack.append(thread.device)
        if self.id != thread.device:
            runtime.setDevice(self.id)
        return self

    def __exit__(self, *exc_info: object) -> None:
        thread = _sim.world().thread
        runtime.setDevice(thread.device_stack.pop())

    def synchronize(self) -> None:
        world = _sim.world()
        world.declare_synchronize()
        world.device_sync(self.id, f"Device({self.id}).synchronize")

    def __int__(self) -> int:
        return self.id

    def __index__(self) -> int:
        return self.id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("cuda-device", self.id))

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


class MemoryPointer:
    """A device address: ``ptr`` is the real address of the simulated memory."""

    __slots__ = ("device_id", "ptr")

    def __init__(self, device_id: int, ptr: int) -> None:
        self.device_id = device_id
        self.ptr = ptr

    @property
    def device(self) -> Device:
        return Device(self.device_id)

    def copy_to_host_async(self, mem: Any, size: int, stream: Stream | None = None) -> None:
        """Queue a copy of ``size`` bytes from here to host address ``mem`` on ``stream`` (the
        current one by default), as CUDA copies into page-locked memory: asynchronously. The
        host bytes read ``0xFF`` until the host learns the copy has finished (a synchronize, a
        stream callback, a ``done`` that said ``True``), so code that reads them earlier reads
        garbage, as it may on a GPU."""
        world = _sim.world()
        if stream is None:
            stream = get_current_stream()
        address = int(getattr(mem, "value", mem) or 0)
        with world.lock:
            block = world.block_at(self.ptr, size, "copy_to_host_async")
            agent = world.null[block.device] if stream.ptr == 0 else stream.agent
            tick = world.launch(agent)
            world.access(block, agent, tick, False, "device-to-host copy (copy_to_host_async)")
            start = self.ptr - block.ptr
            world.copy_to_host_later(agent, tick, address, block.buffer[start : start + size])


class Stream:
    """``cupy.cuda.Stream``: made on the current device; blocking unless ``non_blocking``."""

    null: Stream  # the legacy default stream of whichever device is current

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False) -> None:
        world = _sim.world()
        self._null = null
        self.is_non_blocking = bool(non_blocking)
        if null:
            self.device_id = -1
            self._agent: _sim.Agent | None = None
            self.ptr = 0
        else:
            self.device_id = world.thread.device
            self._agent = world.new_stream(self.device_id, blocking=not non_blocking)
            self.ptr = self._agent.handle

    @property
    def agent(self) -> _sim.Agent:
        """The agent that work on this stream runs on (the null stream: the current GPU's)."""
        if self._agent is None:
            world = _sim.world()
            return world.null[world.thread.device]
        return self._agent

    def _device(self) -> int:
        """The device this stream belongs to: its own, or for the default stream the current
        one; ``RuntimeError`` if that is not the current device (``stream.pyx``,
        ``check_stream_device_match``)."""
        current = _sim.world().thread.device
        if self.device_id != -1 and self.device_id != current:
            raise RuntimeError(
                f"The device that the stream is created on ({self.device_id}) does not match "
                f"with the current device ({current})"
            )
        return current

    def _make_current(self) -> None:
        """``_ThreadLocal.set_current_stream``: on its device (the default stream: on the
        device current now)."""
        thread = _sim.world().thread
        device = thread.device if self.device_id == -1 else self.device_id
        thread.current[device] = self

    def __enter__(self) -> Stream:
        thread = _sim.world().thread
        device = self._device()
        thread.stack[device].append(self)
        thread.stream_devices.append(device)
        self._make_current()
        return self

    def __exit__(self, *exc_info: object) -> None:
        thread = _sim.world().thread
        device = thread.stream_devices.pop()
        stack = thread.stack[device]
        stack.pop()
        (stack[-1] if stack else Stream.null)._make_current()

    def use(self) -> Stream:
        self._device()
        self._make_current()
        return self

    def record(self, event: Event | None = None) -> Event:
        if event is None:
            event = Event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        world = _sim.world()
        with world.lock:
            agent = self.agent
            if event.device_id != agent.device:
                pass  # cudaStreamWaitEvent may wait on an event of another device
            world.launch(agent)
            agent.clock.join(event.clock)

    def synchronize(self) -> None:
        world = _sim.world()
        world.host_sync(_sim.Clock(self.agent.clock), "Stream.synchronize")

    @property
    def done(self) -> bool:
        world = _sim.world()
        return world.query(_sim.Clock(self.agent.clock))

    def add_callback(self, callback: Any, arg: Any) -> None:
        world = _sim.world()
        self._host_call(lambda: callback(self, world.fail_status, arg))

    def launch_host_func(self, callback: Any, arg: Any) -> None:
        world = _sim.world()
        self._host_call(lambda: None if world.fail_status else callback(arg))

    def _host_call(self, call: Any) -> None:
        """Run ``call`` on the driver's callback thread once the stream's work so far is done
        (at once here), unless callbacks are being lost (``drop_callbacks``)."""
        world = _sim.world()
        with world.lock:
            agent = self.agent
            world.launch(agent)
            clock = _sim.Clock(agent.clock)
        if world.drop_callbacks:
            return

        def run() -> None:
            with world.lock:
                world.host.clock.join(clock)
                world.host_learned()
            call()

        world.callback_thread.call(run)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.ptr == self.ptr

    def __hash__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"<Stream {self.ptr:#x} (device {self.device_id})>"


Stream.null = Stream(null=True)


class Event:
    """``cupy.cuda.Event``: made on the current device; marks a point in a stream."""

    def __init__(
        self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
    ) -> None:
        self.device_id = _sim.world().thread.device
        self.clock = _sim.Clock()

    def record(self, stream: Stream | None = None) -> None:
        world = _sim.world()
        if stream is None:
            stream = get_current_stream()
        with world.lock:
            agent = stream.agent
            if agent.device != self.device_id:
                raise runtime.CUDARuntimeError(400)  # invalid resource handle
            world.launch(agent)
            self.clock = _sim.Clock(agent.clock)

    def synchronize(self) -> None:
        _sim.world().host_sync(self.clock, "Event.synchronize")

    @property
    def done(self) -> bool:
        return _sim.world().query(self.clock)


def get_current_stream(device_id: int = -1) -> Stream:
    thread = _sim.world().thread
    device = thread.device if device_id < 0 else device_id
    stream = thread.current.get(device)
    return Stream.null if stream is None else stream


def __getattr__(name: str) -> Any:
    if name == "nccl":
        import importlib

        return importlib.import_module(f"{__name__}.nccl")
    raise AttributeError(f"module 'cupy.cuda' has no attribute {name!r}")
