"""The simulated machine: GPUs, streams as agents with vector clocks, memory, and the detector.

Execution is eager: every kernel, copy and NCCL call computes its result with NumPy at once, so
values are always right, and ordering is checked instead. Each stream (and the host, as one
agent) carries a vector clock; work launched on a stream ticks its clock, and the edges CUDA
guarantees join clocks:

- program order on a stream;
- the host launching work: everything the host did before happens before it;
- ``Event.record`` on a stream and ``Stream.wait_event``;
- host synchronisation (``Stream.synchronize``, ``Event.synchronize``, ``Device.synchronize``,
  ``deviceSynchronize``, a blocking device-to-host copy, a stream callback that ran, a
  ``done`` query that said ``True``);
- the legacy default stream of a device against the *blocking* streams of that device: work on
  it waits for all work launched before on them, and their later work waits for it.
  Non-blocking streams (``Stream(non_blocking=True)``) have no such edge;
- an NCCL collective: its ranks' kernels wait for each other.

Every allocation is a block of real host memory (``ptr`` is its address, so NCCL counts are
bounds-checked) with an access history: the last write and the reads since. A kernel that
reads a block whose last write does not happen before it, or writes a block with a read or
write that does not, is a race: ``RaceError`` names both sides (stream, operation and the
caller's source line) and is also kept in ``races`` for a fixture to check after the test.

The memory pool keeps one arena per stream, as CuPy's does (``cupy/cuda/memory.pyx``): a freed
block is handed out again only to an allocation on the stream it was allocated on, with its
history, so a read on another stream that was not ordered before the reuse is a race.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import sys
import threading
import weakref
from collections import defaultdict
from typing import Any

import numpy as np

__all__ = ["RaceError", "SimulationError", "World", "close", "world"]

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: CuPy rounds allocations up to 512 bytes (memory.pyx, ``ALLOCATION_UNIT_SIZE``).
ALLOCATION_UNIT = 512


class RaceError(AssertionError):
    """Two accesses to one block of device memory with no happens-before edge between them."""


class SimulationError(RuntimeError):
    """A use of the API that real CUDA or NCCL would reject or hang on."""


def caller() -> str:
    """``file:line function`` of the first frame outside the stand-in."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_HERE):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    code = frame.f_code
    path = code.co_filename
    for marker in ("/aioreplica/", "/tests/", "/devices/", "/examples/"):
        at = path.rfind(marker)
        if at >= 0:
            path = path[at + 1 :]
            break
    return f"{path}:{frame.f_lineno} {code.co_name}"


class Clock(dict[int, int]):
    """A vector clock: agent id -> the last tick of that agent known to happen before."""

    def join(self, other: dict[int, int]) -> None:
        for agent, tick in other.items():
            if self.get(agent, 0) < tick:
                self[agent] = tick


class Agent:
    """Something that executes in order: a stream on one device, or the host."""

    def __init__(self, world: World, name: str, device: int | None, blocking: bool) -> None:
        self.id = world.next_agent_id()
        self.name = name
        self.device = device
        self.blocking = blocking
        self.clock = Clock({self.id: 0})
        self.is_null = False
        self.handle = 0

    def tick(self) -> int:
        self.clock[self.id] += 1
        return self.clock[self.id]

    def __repr__(self) -> str:
        return self.name


class Access:
    __slots__ = ("agent", "tick", "what")

    def __init__(self, agent: Agent, tick: int, what: str) -> None:
        self.agent = agent
        self.tick = tick
        self.what = what

    def describe(self) -> str:
        return f"{self.what} on {self.agent.name}"


class Block:
    """One allocation of device memory: real bytes and their access history."""

    def __init__(self, world: World, device: int, size: int, arena: int) -> None:
        self.device = device
        self.size = size
        self.arena = arena  # the id of the stream agent it was allocated on
        self.buffer = np.empty(size, dtype=np.uint8)
        self.ptr: int = self.buffer.ctypes.data
        self.write: Access | None = None
        self.reads: dict[int, Access] = {}
        self.live = False
        self.lease_id = 0


class Lease:
    """One use of a block, from allocation until the last array on it is dropped."""

    __slots__ = ("__weakref__", "block", "id")

    def __init__(self, world: World, block: Block) -> None:
        self.block = block
        world.lease_counter += 1
        self.id = world.lease_counter
        block.live = True
        block.lease_id = self.id
        weakref.finalize(self, world.free, block, self.id)


class _ThreadState(threading.local):
    """What CUDA and CuPy keep per host thread (``cupy/cuda/stream.pyx``, ``_ThreadLocal``;
    ``cupy/cuda/device.pyx``, ``_ThreadLocalStack``; ``cupy/_core/syncdetect.py``)."""

    def __init__(self) -> None:
        self.device = 0  # the runtime's current device
        #: device id -> its current stream (absent: the default stream, ``Stream.null``)
        self.current: dict[int, Any] = {}
        #: device id -> the streams ``with stream:`` pushed, innermost last
        self.stack: dict[int, list[Any]] = defaultdict(list)
        #: the device id of each ``with stream:`` block, innermost last
        self.stream_devices: list[int] = []
        #: the devices that ``with Device(i):`` blocks saved, innermost last
        self.device_stack: list[int] = []
        self.allow_synchronize = True


class World:
    """One simulated machine: ``devices`` GPUs, with peer access between them or not."""

    def __init__(self, devices: int = 2, *, peer_access: bool = True) -> None:
        self.device_count = devices
        self.peer_access = peer_access
        self._agents = 0
        self.lock = threading.RLock()
        self.host = Agent(self, "the host", None, True)
        self.streams: list[Agent] = []
        self.null: dict[int, Agent] = {}
        for device in range(devices):
            null = Agent(self, f"the default stream of GPU {device}", device, True)
            null.is_null = True
            self.null[device] = null
        self.free_blocks: dict[tuple[int, int], list[Block]] = defaultdict(list)
        self.blocks: dict[int, Block] = {}  # ptr -> block, every block ever made
        self._starts: list[int] = []  # the keys of ``blocks``, sorted
        self.handles: dict[int, Agent] = {}  # stream handle (``Stream.ptr``) -> its agent
        self.lease_counter = 0
        self.races: list[str] = []
        #: every kernel launched: (operation, stream name), in order
        self.kernels: list[tuple[str, str]] = []
        self.raise_on_race = True
        self.thread = _ThreadState()
        #: fault injection: stream callbacks are never called (a driver that loses them)
        self.drop_callbacks = False
        #: fault injection: how many more ``done`` queries answer "not yet" (a busy GPU)
        self.busy_queries = 0
        #: fault injection: a CUDA error status the device's work failed with (0: none);
        #: callbacks get it, synchronizing calls raise it, ``done`` stays False, as in CUDA
        self.fail_status = 0
        self.callback_thread = _CallbackThread()
        #: device-to-host copies into page-locked memory not yet known to be done:
        #: (stream agent id, tick, the destination array, its address, the bytes)
        self.host_copies: list[tuple[int, int, Any, int, bytes]] = []
        #: the arrays ``cupyx.empty_pinned`` made, by address (weakly: they may be dropped)
        self.pinned_arrays: dict[int, Any] = {}

    def next_agent_id(self) -> int:
        self._agents += 1
        return self._agents

    def new_stream(self, device: int, *, blocking: bool) -> Agent:
        number = len(self.streams) + 1
        kind = "blocking" if blocking else "non-blocking"
        agent = Agent(self, f"stream {number} ({kind}) of GPU {device}", device, blocking)
        agent.handle = 0x7F0000 + 0x10 * number
        self.streams.append(agent)
        self.handles[agent.handle] = agent
        return agent

    def check_device(self, device: int) -> None:
        if not 0 <= device < self.device_count:
            from .cuda.runtime import CUDARuntimeError

            raise CUDARuntimeError(101)  # cudaErrorInvalidDevice

    # -- launching ------------------------------------------------------------------------

    def pinned(self, array: np.ndarray[Any, Any]) -> None:
        """Remember ``array`` as page-locked memory (``cupyx.empty_pinned``), until dropped."""
        address = array.ctypes.data
        self.pinned_arrays[address] = weakref.ref(array)
        weakref.finalize(array, self.pinned_arrays.pop, address, None)

    def copy_to_host_later(self, agent: Agent, tick: int, address: int, data: Any) -> None:
        """A copy of ``data`` to host ``address``, launched at ``tick`` of ``agent``. Into
        page-locked memory it is asynchronous: the host bytes read ``0xFF`` until the host
        learns that tick is done. Into other memory CUDA copies synchronously: the host waits
        for the stream to reach the copy, then has the bytes."""
        ref = self.pinned_arrays.get(address)
        if ref is None or ref() is None:
            ctypes.memmove(address, bytes(data), len(data))
            self.host_sync(Clock(agent.clock), "copy_to_host_async into pageable memory")
            return
        ctypes.memset(address, 0xFF, len(data))
        self.host_copies.append((agent.id, tick, ref, address, bytes(data)))

    def host_learned(self) -> None:
        """Land the host copies that the host clock now covers (call under the lock, after
        joining a clock into the host's). A copy whose destination was dropped before it
        landed is a ``SimulationError``: on a GPU it writes memory that the pool may have
        handed out again."""
        waiting = []
        for agent, tick, ref, address, data in self.host_copies:
            if self.host.clock.get(agent, 0) < tick:
                waiting.append((agent, tick, ref, address, data))
            elif ref() is None:
                self.races.append(
                    f"a device-to-host copy into page-locked memory at {address:#x} finished "
                    "after the memory was dropped"
                )
            else:
                ctypes.memmove(address, data, len(data))
        self.host_copies = waiting

    def query(self, clock: dict[int, int]) -> bool:
        """``Stream.done`` / ``Event.done``: never raise (CuPy checks no status); a "yes" is
        the host learning that the work ``clock`` covers is done."""
        with self.lock:
            if self.fail_status:
                return False
            if self.busy_queries > 0:
                self.busy_queries -= 1
                return False
            self.host.clock.join(clock)
            self.host.tick()
            self.host_learned()
            return True

    def launch(self, agent: Agent) -> int:
        """Order new work on ``agent`` after what the host did, and the legacy stream edges."""
        clock = agent.clock
        clock.join(self.host.clock)
        if agent.device is not None and agent.blocking:
            if agent.is_null:
                for other in self.streams:
                    if other.device == agent.device and other.blocking:
                        clock.join(other.clock)
            else:
                clock.join(self.null[agent.device].clock)
        return agent.tick()

    def declare_synchronize(self) -> None:
        """``syncdetect._declare_synchronize``: what ``cupyx.allow_synchronize(False)`` catches
        (only ``ndarray.get`` and ``Device.synchronize`` declare it, in CuPy 13.6 and 14.2)."""
        if not self.thread.allow_synchronize:
            import cupyx

            raise cupyx.DeviceSynchronized(
                f"Device synchronization was detected while disallowed. ({caller()})"
            )

    def host_sync(self, clock: dict[int, int], what: str) -> None:
        """The host waited for the work ``clock`` covers; raises the device's error if the
        work failed (``fail_status``)."""
        if self.fail_status:
            from .cuda.runtime import CUDARuntimeError

            raise CUDARuntimeError(self.fail_status)
        with self.lock:
            self.host.clock.join(clock)
            self.host.tick()
            self.host_learned()

    def device_sync(self, device: int, what: str) -> None:
        """The host waited for all work launched so far on GPU ``device``, on every stream."""
        clock = Clock()
        for agent in [self.null[device], *self.streams]:
            if agent.device == device:
                clock.join(agent.clock)
        self.host_sync(clock, what)

    # -- memory ---------------------------------------------------------------------------

    def allocate(self, device: int, nbytes: int, stream: Agent) -> Lease:
        size = max(ALLOCATION_UNIT, -(-nbytes // ALLOCATION_UNIT) * ALLOCATION_UNIT)
        with self.lock:
            free = self.free_blocks[stream.id, size]
            block = free.pop() if free else None
            if block is None:
                block = Block(self, device, size, stream.id)
                self.blocks[block.ptr] = block
                bisect.insort(self._starts, block.ptr)
            return Lease(self, block)

    def free(self, block: Block, lease_id: int) -> None:
        with self.lock:
            if block.lease_id == lease_id and block.live:
                block.live = False
                self.free_blocks[block.arena, block.size].append(block)

    def block_at(self, ptr: int, nbytes: int, what: str) -> Block:
        """The live block holding ``[ptr, ptr + nbytes)``; ``SimulationError`` if none does."""
        at = bisect.bisect_right(self._starts, ptr) - 1
        block = self.blocks[self._starts[at]] if at >= 0 else None
        if block is None or ptr >= block.ptr + block.size:
            raise SimulationError(f"{what}: {ptr:#x} is not device memory ({caller()})")
        if ptr + nbytes > block.ptr + block.size:
            raise SimulationError(
                f"{what}: {nbytes} bytes from {ptr:#x} run past the end of the "
                f"{block.size}-byte allocation at {block.ptr:#x} ({caller()})"
            )
        if not block.live:
            raise SimulationError(f"{what}: {ptr:#x} is freed memory ({caller()})")
        return block

    # -- the detector ---------------------------------------------------------------------

    def access(self, block: Block, agent: Agent, tick: int, write: bool, what: str) -> None:
        clock = agent.clock
        here = Access(agent, tick, f"{what} ({caller()})")
        last = block.write
        if last is not None and last.agent is not agent and clock.get(last.agent.id, 0) < last.tick:
            self.race(here, last, write)
        if write:
            for read in block.reads.values():
                if read.agent is not agent and clock.get(read.agent.id, 0) < read.tick:
                    self.race(here, read, True, earlier_read=True)
            block.write = here
            block.reads = {}
        else:
            block.reads[agent.id] = here

    def race(self, now: Access, before: Access, write: bool, *, earlier_read: bool = False) -> None:
        kinds = ("write" if write else "read", "read" if earlier_read else "write")
        message = (
            f"data race on device memory: {kinds[0]} by {now.describe()} is not ordered after "
            f"the {kinds[1]} by {before.describe()}"
        )
        self.races.append(message)
        if self.raise_on_race:
            raise RaceError(message)


class _CallbackThread:
    """The driver thread that calls stream callbacks, one after another."""

    def __init__(self) -> None:
        self._calls: list[Any] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def call(self, fn: Any, *args: Any) -> None:
        with self._cond:
            self._calls.append((fn, args))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="cuda-callbacks", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        """Run the callbacks already queued, then end the thread."""
        with self._cond:
            thread = self._thread
            self._thread = None
            self._calls.append(None)
            self._cond.notify()
        if thread is not None:
            thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._calls:
                    self._cond.wait()
                call = self._calls.pop(0)
            if call is None:
                return
            fn, args = call
            fn(*args)


_world: World | None = None


def world() -> World:
    global _world
    if _world is None:
        _world = World(int(os.environ.get("CUPY_SIM_DEVICES", "2")))
    return _world


def close() -> None:
    """End the machine's callback thread (for a test harness that drops this package)."""
    if _world is not None:
        _world.callback_thread.close()
