"""The host backend: NumPy arrays on logical CPU devices ``cpu:0``, ``cpu:1``, ...

Several logical CPU devices are how replicas are laid out on a host with no GPU. They share the
host's memory, so there is no device state to switch between replica steps.

Each host device owns one worker thread, started on first use: its "stream". ``device.run``
queues work there in submission order and the event loop waits for the result without
blocking, so host replicas really compute in parallel (NumPy releases the GIL) while the loop
keeps serving the others (invariant 4). Every job runs in a copy of its submitter's context
(as ``anyio.to_thread.run_sync`` runs its function), so replica code on the worker still sees
its replica context and its context variables, and what it sets stays inside the job.
Devices are process-wide, so strategies share them: each open strategy claims its devices, and
``strategy.close()`` stops the threads no open strategy still claims; the next job starts the
thread again.

Host collectives read each input once and write one output, which every host replica shares
read-only (invariant 6). Large reductions are split into cache-sized blocks spread over the
replicas' worker threads (at most one per core); outputs come from a pool and are reused once
nobody holds them, because a fresh large buffer per call costs page faults.
"""

from __future__ import annotations

import atexit
import contextvars
import os
import queue
import threading
from typing import TYPE_CHECKING, Any, Final, TypeVar, final

import numpy as np

from .. import _loops, _trace
from ._arrays import host_array
from ._hostreduce import BufferPool, reduce_range, reduce_small, split_ranges

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import ModuleType

    from ._protocol import Device

__all__ = [
    "HOST_BACKEND",
    "INLINE_BYTES",
    "HostBackend",
    "HostDevice",
    "host_device",
    "share_cores",
]

T = TypeVar("T")

#: Host work that reads fewer bytes than this (a collective's inputs, a variable update's
#: arrays) runs inline on the loop thread; more goes to a worker thread. Inline, 8 MiB is
#: about 0.2 ms at memory speed, a few times what handing a job to a worker thread and
#: waking the loop with its result costs (30-80 µs on a 2-core machine): below it the
#: handoff costs more than it saves, above it the loop would stall for long (see
#: docs/architecture.md, "Inline or worker thread").
INLINE_BYTES: Final = 8 << 20


# -- the device --------------------------------------------------------------------------


class _Worker:
    """One thread running submitted jobs in order: a host device's stream.

    The thread starts on the first job and stops when ``stop`` is called (after the jobs
    already queued); the next job starts a new thread, which first waits for the old one to
    end, so jobs still run one at a time in submission order across a restart. ``claims``
    counts the open strategies that use the device (see ``HostDevice.claim``).
    """

    __slots__ = ("_claims", "_collected", "_lock", "_name", "_previous", "_queue", "_thread")

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._previous: threading.Thread | None = None  # stopping, maybe not yet ended
        self._lock = threading.Lock()
        self._claims = 0
        # Claims of strategies collected as garbage: their finalizers may run on any thread,
        # even one holding the lock, so they only append here (atomic); counted under the lock.
        self._collected: list[None] = []

    def submit(
        self,
        context: contextvars.Context,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: _loops.ThreadResult,
    ) -> None:
        # Under the lock, so a stop from another thread cannot slip between the check and the
        # put and leave the job behind the stop marker with no thread to run it.
        with self._lock:
            if self._thread is None:
                thread = threading.Thread(
                    target=self._work,
                    args=(self._previous,),
                    name=f"aioreplica {self._name}",
                    daemon=True,
                )
                self._previous = None
                thread.start()
                _running_workers.add(self)
                self._thread = thread
            self._queue.put((context, fn, args, kwargs, result))

    def claim(self) -> None:
        with self._lock:
            self._claims += 1

    def release(self) -> None:
        with self._lock:
            self._count_collected()
            if self._claims == 0:  # pragma: no cover - strategies release what they claimed
                raise AssertionError(f"{self._name}: released more often than claimed")
            self._claims -= 1

    def release_collected(self) -> None:
        self._collected.append(None)

    def _count_collected(self) -> None:
        while self._collected:
            self._collected.pop()
            self._claims -= 1

    def stop(
        self, done: _loops.ThreadResult | None = None, *, unclaimed: bool = False
    ) -> threading.Thread | None:
        """End the thread once the jobs queued so far have run (at once if idle); ``done`` is
        set when it ends. ``unclaimed``: only if no open strategy uses the device. Returns the
        thread that was stopped, or ``None`` (none running, or still claimed)."""
        with self._lock:
            self._count_collected()
            thread = self._thread
            if thread is None or (unclaimed and self._claims):
                return None
            self._queue.put((None, done))
            self._thread = None
            self._previous = thread
            _running_workers.discard(self)
            return thread

    def _work(self, previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join()  # its queued jobs first: one job at a time, in order
        while True:
            job = self._queue.get()
            if job[0] is None:  # the stop marker: (None, done)
                if job[1] is not None:
                    job[1].set(None, None)
                return
            self._run(*job)
            # Hold nothing between jobs: a pooled output must not look held by this thread.
            del job

    @staticmethod
    def _run(
        context: contextvars.Context,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: _loops.ThreadResult,
    ) -> None:
        if result.cancelled:  # its waiter gave up before it started
            return
        try:
            value = context.run(fn, *args, **kwargs)
        except BaseException as exc:
            result.set(None, exc)
        else:
            result.set(value, None)


_running_workers: set[_Worker] = set()


@atexit.register
def _stop_workers() -> None:
    for worker in list(_running_workers):
        worker.stop()


@final
class HostDevice:
    """A logical host device, ``cpu:<index>``: NumPy arrays, one worker thread.

    Example:
        >>> HostDevice(1).name
        'cpu:1'
    """

    __slots__ = ("_index", "_worker")

    kind: Final = "cpu"
    has_context: Final = False

    def __init__(self, index: int) -> None:
        self._index = index
        self._worker = _Worker(f"cpu:{index}")

    @property
    def name(self) -> str:
        return f"cpu:{self._index}"

    @property
    def index(self) -> int:
        return self._index

    @property
    def xp(self) -> ModuleType:
        return np

    @property
    def backend(self) -> HostBackend:
        return HOST_BACKEND

    async def compute(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` inline if it reads under ``INLINE_BYTES``, else in the worker thread.

        ``nbytes`` is what ``fn`` reads (every input array). A thread handoff costs more than
        small work; large work must not block the loop.
        Either way ``fn`` sees the caller's context variables (on the worker, through ``run``,
        in a copy of the caller's context).

        Raises:
            BaseException: whatever ``fn`` raises.

        Example:
            >>> anyio.run(HostDevice(0).compute, 16, sum, [1, 2])
            3
        """
        if nbytes < INLINE_BYTES:
            return fn(*args)
        return await self.run(fn, *args)

    def enter(self) -> None:
        pass

    def leave(self) -> None:
        pass

    def asarray(self, value: Any) -> np.ndarray[Any, Any]:
        """Return ``value`` as a NumPy array (a CuPy array is copied to the host).

        Example:
            >>> HostDevice(0).asarray([1, 2]).tolist()
            [1, 2]
        """
        if type(value) is np.ndarray:  # the common case, before any dispatch
            return value
        return host_array(value)  # a CuPy array: copied once the work that made it is done

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` in this device's worker thread; await its result.

        Jobs on one device run one at a time, in the order they were submitted; jobs on
        different devices run in parallel. The event loop is never blocked. If the awaiting
        task is cancelled, a job that has not started is skipped; one that has started runs
        to its end and its result is dropped.

        ``fn`` runs in a copy of the caller's context, taken when the job is queued (as
        ``anyio.to_thread.run_sync`` does): inside a replica it sees that replica's
        ``get_replica_context()`` and context variables, and a context variable it sets is not
        seen by the caller afterwards, nor by the device's next job.

        Raises:
            BaseException: whatever ``fn`` raises.

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def step():
            ...     device = aioreplica.get_replica_context().device
            ...     return float(await device.run(np.linalg.norm, device.asarray([3.0, 4.0])))
            >>> anyio.run(strategy.run, step)
            PerReplica({0: 5.0, 1: 5.0})
        """
        recorder = _trace.recorder
        if recorder is not None:  # a trace is being recorded: a span on the caller's track
            span = recorder.open(f"device.run {_trace.callable_name(fn)}", {"device": self.name})
            try:
                traced: T = await self._queue(fn, args, kwargs)
            finally:
                if span is not None:
                    recorder.close(*span)
            return traced
        value: T = await self._queue(fn, args, kwargs)
        return value

    def _queue(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _loops.ThreadResult:
        """Queue a job on this device's worker now; await the result object for its value.

        Every path to the worker comes through here, so every job runs in a copy of the
        context of the task that queued it (taken now, on the loop thread).
        """
        result = _loops.current().thread_result()
        self._worker.submit(contextvars.copy_context(), fn, args, kwargs, result)
        return result

    async def synchronize(self) -> None:
        """Wait until every job queued on this device so far has finished.

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
            >>> async def step():
            ...     device = aioreplica.get_replica_context().device
            ...     await device.synchronize()  # every job queued on it so far has finished
            ...     return device.name
            >>> anyio.run(strategy.run, step)
            PerReplica({0: 'cpu:0', 1: 'cpu:1'})
        """
        await self.run(_nothing)

    # Host devices are process-wide (``host_device``), so several strategies may share one.
    # Each open strategy claims its host devices; closing it releases them, and a worker
    # thread is stopped only when no open strategy still claims its device. A later job
    # starts the thread again.

    def claim(self) -> None:
        """Count one more open user (a strategy): ``stop_worker(unclaimed=True)`` leaves the
        worker thread running until every claim is released.

        Example:
            >>> device = HostDevice(9)
            >>> device.claim()
            >>> device.stop_worker(unclaimed=True) is None  # claimed (and not started)
            True
            >>> device.release()
        """
        self._worker.claim()

    def release(self) -> None:
        """Undo one ``claim``; the worker thread keeps running until ``stop_worker``.

        Raises:
            AssertionError: more releases than claims (a bug in the caller).

        Example:
            >>> device = HostDevice(9)
            >>> device.claim()
            >>> device.release()
        """
        self._worker.release()

    def release_collected(self) -> None:
        """``release`` for a strategy collected as garbage, from its finalizer: safe on any
        thread at any moment (it takes no lock), counted at the next ``release`` or stop.

        Example:
            >>> device = HostDevice(9)
            >>> device.claim()
            >>> device.release_collected()
            >>> device.stop_worker(unclaimed=True) is None  # unclaimed (and not started)
            True
        """
        self._worker.release_collected()

    def stop_worker(
        self, done: _loops.ThreadResult | None = None, *, unclaimed: bool = False
    ) -> threading.Thread | None:
        """Stop the worker thread once the jobs already queued have run; never blocks.

        The next job starts a new thread, which runs only after the old one has ended, so jobs
        still run one at a time in submission order.

        Args:
            done: set (from the worker) when the thread ends, for a task to await.
            unclaimed: stop only if no open strategy claims the device.

        Returns:
            The thread being stopped (to ``join``), or ``None``: no thread was running, or it
            is still claimed (``done`` is then never set).

        Example:
            >>> device = HostDevice(9)
            >>> anyio.run(device.run, sum, [1, 2])
            3
            >>> thread = device.stop_worker()
            >>> thread.join(5)
            >>> thread.is_alive(), device.stop_worker()
            (False, None)
            >>> anyio.run(device.run, sum, [3, 4])  # starts a new thread
            7
            >>> device.stop_worker().join(5)
        """
        return self._worker.stop(done, unclaimed=unclaimed)

    def __repr__(self) -> str:
        return f"<HostDevice {self.name}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HostDevice) and other._index == self._index

    def __hash__(self) -> int:
        return hash(("cpu", self._index))


_host_devices: dict[int, HostDevice] = {}


def host_device(index: int) -> HostDevice:
    """The process-wide device ``cpu:<index>``: strategies on one device share its stream."""
    device = _host_devices.get(index)
    if device is None:
        device = _host_devices[index] = HostDevice(index)
    return device


def _nothing() -> None:
    return None


# -- the backend -------------------------------------------------------------------------


@final
class HostBackend:
    """Collectives over NumPy arrays on host devices; results shared read-only."""

    name: Final = "numpy"

    def __init__(self) -> None:
        self._pool = BufferPool()

    def prepare(self, devices: Sequence[Device]) -> None:
        """Nothing to set up: host collectives need no communicators."""

    def output(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray[Any, Any]:
        """A writeable output buffer from the pool (fill it, then ``publish`` it).

        Example:
            >>> HOST_BACKEND.output((2,), "float32").flags.writeable
            True
        """
        return self._pool.take(shape, dtype)

    def publish(self, buffer: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """``buffer`` made read-only, to be shared by every host replica.

        Example:
            >>> HOST_BACKEND.publish(HOST_BACKEND.output((2,), "float32")).flags.writeable
            False
        """
        return self._pool.publish(buffer)

    def reduce_to_first(self, op: str, inputs: Sequence[Any], devices: Sequence[Device]) -> Any:
        """``op`` (``"sum"`` or ``"mean"``) over the inputs into a new array, at once, on the
        calling thread (for small reads, such as a sync-on-read variable's value).

        Raises:
            ValueError: ``op`` is not ``"sum"`` or ``"mean"``.

        Example:
            >>> HOST_BACKEND.reduce_to_first("mean", [np.ones(2), np.zeros(2)], [])
            array([0.5, 0.5])
        """
        if op not in ("sum", "mean"):
            raise ValueError(f"reduce_to_first reduces with 'sum' or 'mean', not {op!r}")
        total = np.array(inputs[0], copy=True)
        for value in inputs[1:]:
            total += value
        if op == "mean":
            total /= len(inputs)
        return total

    async def all_reduce(
        self, op: str, inputs: Sequence[Any], devices: Sequence[Device]
    ) -> list[Any]:
        first = np.asarray(inputs[0])
        out = self._pool.take(first.shape, first.dtype)
        if out.nbytes * len(inputs) < INLINE_BYTES:
            reduce_small(op, inputs, out)  # the ufuncs take any layout
            return [self._pool.publish(out)] * len(inputs)
        flat = [np.ascontiguousarray(x).reshape(-1) for x in inputs]
        out_flat = out.reshape(-1)
        size = out_flat.size
        if len(devices) == 1:
            reduce_range(op, flat, out_flat, 0, size)
        else:
            parts = min(len(devices), _cores())
            ranges = split_ranges(size, out.itemsize, parts)
            pending = [
                _submit(devices[i], reduce_range, op, flat, out_flat, start, stop)
                for i, (start, stop) in enumerate(ranges)
            ]
            for result in pending:
                await result
        return [self._pool.publish(out)] * len(inputs)

    async def all_reduce_packed(
        self, op: str, leaves: Sequence[Sequence[Any]], devices: Sequence[Device]
    ) -> list[Any]:
        """Several leaves reduced into one shared flat output, each leaf straight into its
        part: every input is read once, with no joined copy of each replica's leaves."""
        sizes = [leaf[0].size for leaf in leaves]
        out = self._pool.take(sum(sizes), leaves[0][0].dtype)
        if out.nbytes * len(devices) < INLINE_BYTES:
            _reduce_leaves_into(op, leaves, sizes, out)
        else:
            await _submit(devices[0], _reduce_leaves_into, op, leaves, sizes, out)
        return [self._pool.publish(out)] * len(devices)

    async def all_gather(
        self, inputs: Sequence[Any], axis: int, devices: Sequence[Device]
    ) -> list[Any]:
        arrays = [np.asarray(x) for x in inputs]
        shape = list(arrays[0].shape)
        shape[axis] = sum(a.shape[axis] for a in arrays)
        out = self._pool.take(tuple(shape), arrays[0].dtype)
        if out.nbytes < INLINE_BYTES:
            np.concatenate(arrays, axis=axis, out=out)
        else:
            await _submit(devices[0], np.concatenate, arrays, axis=axis, out=out)
        return [self._pool.publish(out)] * len(inputs)

    async def broadcast(self, value: Any, devices: Sequence[Device]) -> list[Any]:
        source = np.asarray(value)
        out = self._pool.take(source.shape, source.dtype)
        if out.nbytes < INLINE_BYTES:
            np.copyto(out, source)
        else:
            await _submit(devices[0], np.copyto, out, source)
        return [self._pool.publish(out)] * len(devices)

    async def to_host(self, value: Any, device: Device) -> np.ndarray[Any, Any]:
        """A new, writeable, C-contiguous copy of ``value``, made where ``device.compute``
        puts work of its size: a large one on ``device``'s worker, so the event loop goes on
        meanwhile.

        Example:
            >>> anyio.run(HOST_BACKEND.to_host, np.arange(3)[::-1], HostDevice(0))
            array([2, 1, 0])
        """
        source = np.asarray(value)
        out = np.empty(source.shape, source.dtype)
        await device.compute(out.nbytes, np.copyto, out, source)
        return out


def _reduce_leaves_into(
    op: str, leaves: Sequence[Sequence[Any]], sizes: Sequence[int], out: np.ndarray[Any, Any]
) -> None:
    start = 0
    for leaf, size in zip(leaves, sizes, strict=True):
        # The ufuncs take the inputs in any layout; the output part takes the leaf's shape.
        reduce_small(op, leaf, out[start : start + size].reshape(np.shape(leaf[0])))
        start += size


def _submit(device: Device, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Queue ``fn`` on a host device's worker now; await the returned object for its result.

    Unlike ``await device.run(...)``, several jobs can be queued on different devices before
    awaiting any, so they run in parallel without a task each.
    """
    if not isinstance(device, HostDevice):  # pragma: no cover - collectives check the kind
        raise TypeError(f"{device!r} is not a host device")
    return device._queue(fn, args, kwargs)


def _cores() -> int:
    """The cores this process may use for one reduction: its share when several processes
    of one job run on this machine (``share_cores``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // _processes_here)


#: How many processes of one job share this machine's cores (set by a multi-worker strategy).
_processes_here = 1


def share_cores(processes: int) -> None:
    """Say that ``processes`` processes of one job (workers) run on this machine, so a host
    reduction splits over this process's share of the cores only: splitting over cores a peer
    is using made a 2-worker reduction slower (measured: 16 MiB, 2 workers on 2 cores).

    Example:
        >>> share_cores(1)
    """
    global _processes_here
    _processes_here = max(1, int(processes))


HOST_BACKEND: Final = HostBackend()
