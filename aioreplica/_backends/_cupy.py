"""The CUDA backend: CuPy arrays on GPUs ``gpu:0``, ``gpu:1``, ..., one CUDA stream each.

Imported only when a GPU is asked for or listed; ``import aioreplica`` never imports it.

Devices
-------
A ``CudaDevice`` owns one blocking stream (CuPy's default), created in its
GPU's context: CUDA orders it with the GPU's legacy default stream, where code outside a step
runs, so a ``float(loss)`` after ``run()`` and an array made with ``cupy.asarray`` before it
are ordered with the replica's work (docs/architecture.md, "Host reads and device order").
CuPy's current device and current stream are per host thread, and every replica runs on the
loop thread, so the scheduler calls ``resume()`` before each step of a replica's coroutine and
``suspend()`` after it (invariant 1): an ``enter()`` and a ``leave()`` of the device. ``enter``
pushes the device's stream the way ``with stream:`` does, so a ``with other_stream:`` block
inside replica code falls back to the replica's stream when it ends (a stream made current with
``Stream.use()`` would not be restored by CuPy there). ``leave`` pops it and, if the loop
thread had made a stream current with ``use()`` before, makes that one current again: CuPy's
``with`` exit restores the previous ``with`` block's stream, not a ``use()``'d one
(cupy/cupy#8377). Calls nest: reading a variable inside a step enters its device again, and
each ``leave`` undoes its own ``enter``. What the replica itself made current when it suspends
(its ``with other_stream:`` block, another GPU) is kept per task and made current again when it
resumes, so such a block spans its awaits; meanwhile the loop thread has the caller's state
back (``CudaDevice.suspend``).

``synchronize()`` never blocks the loop: it queues a stream callback that wakes the waiting
task thread-safely, and polls an event if the callback is late (see
``CudaDevice.synchronize``).

Collectives
-----------
Inputs are one CuPy array per replica, each on its replica's GPU and produced on its replica's
stream. Replicas are grouped by GPU; the first replica on a GPU is its *leader* and the
collective runs on the leader's stream, so with one replica per GPU (the usual layout) every
collective runs on the replicas' own streams and is ordered with their work with no events at
all. Otherwise, in order:

1. *fan-in*: each other replica's stream records an event and the leader's stream waits on it;
2. the GPU's share of the work on the leader's stream (reduce, concatenate, copy) in CuPy;
3. across GPUs, NCCL in one ``groupStart``/``groupEnd``, each GPU's call on its leader's stream,
   with communicators created once per tuple of GPUs and cached;
4. *fan-out*: the leader's stream records an event, each other replica's stream waits on it and
   copies the result on that stream, and the leader's stream waits on those copies.

No step waits on the host. Every replica gets its own result array, ready in its stream's order
when the collective returns. The back edges matter as much as the forward ones: CuPy's memory
pool keeps one arena per stream and hands a freed block out again only to allocations on the
stream it was allocated on, so a buffer read on another stream is safe to free once its owner's
stream has waited for that read. The communicators are made by ``prepare``, when a strategy is
built: ``ncclCommInitAll`` holds the GIL, so on the event loop it would stall every task.
"""

from __future__ import annotations

import contextvars
import warnings
from typing import TYPE_CHECKING, Any, Final, TypeVar, final

import anyio.lowlevel
import anyio.to_thread
import cupy
import cupyx
import numpy as np

from .. import _loops, _trace
from ._arrays import host_array

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import ModuleType

    from ._protocol import Device

__all__ = ["CUPY_BACKEND", "CudaDevice", "CupyBackend", "cuda_device", "visible_device_count"]

T = TypeVar("T")

_runtime: Any = cupy.cuda.runtime
#: ``cudaErrorMemoryAllocation`` (CuPy's Python module does not name it).
_CUDA_ERROR_MEMORY_ALLOCATION: Final = 2
_get_device: Callable[[], int] = _runtime.getDevice
_set_device: Callable[[int], None] = _runtime.setDevice
_get_current_stream: Callable[..., Any] = cupy.cuda.get_current_stream
_xp: ModuleType = cupy


# -- the device --------------------------------------------------------------------------


@final
class CudaDevice:
    """One GPU, ``gpu:<index>``: CuPy arrays and one CUDA stream (blocking: ordered with the
    GPU's default stream).

    Replica code runs with this device and its stream current, so CuPy work it launches is
    queued on the stream and runs asynchronously. Use ``cuda_device(index)`` for the
    process-wide device; every ``CudaDevice`` made directly owns a stream of its own.

    Example:
        >>> device = cuda_device(0)
        >>> device.name, device.kind
        ('gpu:0', 'gpu')
        >>> x = device.asarray([1.0, 2.0])  # a cupy.ndarray on GPU 0
        >>> x.device.id, x.get().tolist()
        (0, [1.0, 2.0])
    """

    __slots__ = ("_index", "_saved", "_stream")

    kind: Final = "gpu"
    has_context: Final = True

    def __init__(self, index: int) -> None:
        self._index = index
        with cupy.cuda.Device(index):
            # Blocking, as CuPy's streams are by default: the legacy default stream, on which
            # code outside a step runs, waits for its work and it waits for the default
            # stream's, so reads and arrays made outside a step are ordered with the replicas.
            self._stream: Any = cupy.cuda.Stream(non_blocking=False)
        self._saved: list[tuple[int, Any]] = []

    @property
    def name(self) -> str:
        return f"gpu:{self._index}"

    @property
    def index(self) -> int:
        return self._index

    @property
    def xp(self) -> ModuleType:
        return _xp

    @property
    def backend(self) -> CupyBackend:
        return CUPY_BACKEND

    @property
    def stream(self) -> Any:
        """The ``cupy.cuda.Stream`` that this device's replica work is queued on."""
        return self._stream

    async def compute(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` through ``run``, with this device and its stream current."""
        return await self.run(fn, *args)

    def enter(self) -> None:
        """Make this GPU and its stream current on the calling thread; remember the previous.

        Called around synchronous work on the device outside a replica's step (a merge
        function's, a checkpoint's). Calls nest: each ``leave`` undoes the latest ``enter``
        (reading a variable inside a replica's step enters its device again).

        Example:
            >>> device = cuda_device(0)
            >>> device.enter(); cupy.cuda.get_current_stream() == device.stream
            True
            >>> device.leave()
        """
        self._saved.append(_activate(self._index, self._stream))

    def leave(self) -> None:
        """Make current again exactly the device and stream that were current at the matching
        ``enter``.

        Example:
            >>> device = cuda_device(0)
            >>> before = cupy.cuda.get_current_stream()
            >>> device.enter(); device.leave()
            >>> cupy.cuda.get_current_stream() == before
            True
        """
        if self._saved:
            _restore(self._index, self._stream, self._saved.pop())

    def resume(self) -> None:
        """``enter``, as the scheduler resumes a replica's step: then make current again what
        the replica had made current when it last suspended (see ``suspend``), so a ``with
        other_stream:`` or ``with cupy.cuda.Device(k):`` block around an await goes on after
        it.

        Example:
            >>> device = cuda_device(0)
            >>> device.resume(); cupy.cuda.get_current_stream() == device.stream
            True
            >>> device.suspend()
        """
        saved = self._saved
        resumed = None if saved else _resume.get()
        saved.append(_activate(self._index, self._stream))
        if resumed is not None and resumed[0] is self:
            _resume.set(None)  # taken: a task started in this step does not inherit it
            _, gpu, stream, pushed = resumed
            if stream is not self._stream:
                if pushed:
                    stream.__enter__()  # its ``with`` block's exit pops it again
                else:
                    stream.use()
            if gpu != self._index:
                _set_device(gpu)

    def suspend(self) -> None:
        """``leave``, as a replica's step suspends: first note what the replica has current, if
        it is not this device and its stream: another GPU, or a stream of its own (made
        current with ``with`` or ``use()``).

        The note is a context variable, so per replica task, and the scheduler's next
        ``resume`` in the task makes it current again; meanwhile the loop thread, and so every
        other replica, merge function and the caller, has its own state back. The ``with``
        block of a stream the replica pushed on this device is taken off CuPy's per-thread
        stack with the entry under it and pushed again on resume, so its exit falls back to
        this device's stream. One such block is carried: blocks nested around an await, or a
        stream block on another GPU, stay on CuPy's stacks while the replica waits
        (docs/gpu.md says so).

        Example:
            >>> device = cuda_device(0)
            >>> before = cupy.cuda.get_current_stream()
            >>> device.resume(); device.suspend()
            >>> cupy.cuda.get_current_stream() == before
            True
        """
        saved = self._saved
        if not saved:
            return
        previous_device, previous_stream = saved.pop()
        index, stream = self._index, self._stream
        gpu = _get_device()
        if gpu != index:
            _set_device(index)
        current = _get_current_stream()
        stream.__exit__(None, None, None)
        if not saved and (gpu != index or current is not stream):
            # The replica suspends with its own device or stream current. If it had pushed
            # that stream (``with side:``), the pop above took it and left this device's
            # entry on top: take that too, so no stream of the replica's stays on the stack.
            pushed = (
                current is not stream
                and previous_stream is not stream
                and _get_current_stream() is stream
            )
            if pushed:
                stream.__exit__(None, None, None)
            _resume.set((self, gpu, current, pushed))
        if _get_current_stream() is not previous_stream:
            previous_stream.use()  # it was made current with use(), which the with-stack forgets
        if previous_device != index:
            _set_device(previous_device)

    def asarray(self, value: Any) -> Any:
        """Return ``value`` as a CuPy array on this GPU, copied on this device's stream.

        A CuPy array already on this GPU is returned as is. Host data (NumPy arrays, lists,
        scalars) is copied host-to-device on the stream, asynchronously where the CuPy version
        does so (``cupy.asarray(..., blocking=False)`` is the default from CuPy 13). An array on
        another GPU is copied peer to peer on this device's stream, after the work queued so far
        on that GPU's current stream (where code outside a replica's step made it).

        Raises:
            TypeError: ``value`` cannot be turned into an array.

        Example:
            >>> cuda_device(0).asarray(np.arange(3)).device.id
            0
        """
        if not isinstance(value, cupy.ndarray):
            with _Active(self._index, self._stream):
                return cupy.asarray(value)
        gpu = value.device.id
        if gpu == self._index:
            return value
        # Made on its GPU's current stream (where code outside a step queues its work): copy it
        # on this stream after that work, and let that stream wait for the copy before it
        # hands the memory out again.
        return _copy_from(value, gpu, _get_current_stream(gpu), self._index, self._stream)

    async def synchronize(self) -> None:
        """Wait, without blocking the event loop, until the work queued so far on this stream
        has finished.

        The stream gets a callback (``Stream.add_callback``) that hands the result to the
        waiting task through the event loop's thread-safe wake-up, so the loop serves other
        replicas meanwhile and spends no CPU on the wait. The wait does not hang on the
        callback alone: if it has not come after 50 ms, an event recorded with it is polled
        too, at growing intervals (up to 50 ms), so a driver that runs callbacks late, or
        never, costs latency, not a hang. Polling alone would keep the loop waking for as
        long as the GPU works, and would never see a device error (CuPy's ``done`` reads one
        as "not done"); ``launch_host_func`` is not called at all after a device error (the
        CUDA runtime documents this for ``cudaLaunchHostFunc``), whereas a stream callback is
        called with the error status, which this method raises.

        Raises:
            cupy.cuda.runtime.CUDARuntimeError: the stream's work failed on the device.

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["gpu:0"])
            >>> async def step():
            ...     device = aioreplica.get_replica_context().device
            ...     y = device.xp.linalg.norm(device.asarray([3.0, 4.0]))  # queued on the stream
            ...     await device.synchronize()  # y is computed now
            ...     return float(y)
            >>> anyio.run(strategy.run, step)
            5.0
        """
        stream = self._stream
        if stream.done:
            await anyio.lowlevel.checkpoint()
            return
        with _Active(self._index, stream):
            done = stream.record(_event())
        waiter = _Waiter(_loops.current().thread_result())
        stream.add_callback(_stream_callback, waiter)
        with anyio.move_on_after(_CALLBACK_GRACE):
            await waiter.result
        pause = _POLL_FIRST
        # ``done`` stays False after a device error (CuPy checks no status there): the
        # callback's status, whenever it comes, is what reports one.
        while waiter.status is None and not done.done:
            await anyio.sleep(pause)
            pause = min(2 * pause, _POLL_MAX)
        if waiter.status:
            raise _runtime.CUDARuntimeError(waiter.status)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` inline on the calling thread with this GPU and its stream
        current, and return its result.

        CuPy queues GPU work asynchronously, so this returns as soon as ``fn`` has queued its
        work; it does not wait for the GPU (``await synchronize()`` does) and does not yield to
        the event loop. The previous device and stream are current again afterwards.

        ``fn`` runs in a copy of the caller's context, as a host device's worker runs it: it
        sees the replica context and the caller's context variables, and a context variable it
        sets is not seen by the caller afterwards. (CuPy keeps its current device and stream
        per thread, not per context, so the copy does not hide them.)

        Raises:
            BaseException: whatever ``fn`` raises.

        Example:
            >>> strategy = aioreplica.MirroredStrategy(["gpu:0"])
            >>> async def step():
            ...     device = aioreplica.get_replica_context().device
            ...     norm = await device.run(device.xp.linalg.norm, device.asarray([3.0, 4.0]))
            ...     return float(norm)
            >>> anyio.run(strategy.run, step)
            5.0
        """
        recorder = _trace.recorder
        if recorder is not None:  # a trace is being recorded: a span on the caller's track
            name = f"device.run {_trace.callable_name(fn)}"
            with recorder.span(name, {"device": self.name}), _Active(self._index, self._stream):
                return contextvars.copy_context().run(fn, *args, **kwargs)
        with _Active(self._index, self._stream):
            return contextvars.copy_context().run(fn, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<CudaDevice {self.name}>"


#: What the replica of this task had current when it last suspended, for its next ``enter``:
#: ``(device, GPU current, stream current on the device's GPU, whether that stream was pushed
#: with ``with``)``, or ``None`` when it was the device and its stream.
_resume: contextvars.ContextVar[tuple[CudaDevice, int, Any, bool] | None] = contextvars.ContextVar(
    "aioreplica_cuda_resume", default=None
)

_cuda_devices: dict[int, CudaDevice] = {}


def cuda_device(index: int) -> CudaDevice:
    """The process-wide device ``gpu:<index>``: strategies on one GPU share its stream.

    Raises:
        cupy.cuda.runtime.CUDARuntimeError: there is no GPU ``index``.

    Example:
        >>> cuda_device(0) is cuda_device(0)
        True
    """
    device = _cuda_devices.get(index)
    if device is None:
        device = _cuda_devices[index] = CudaDevice(index)
    return device


def visible_device_count() -> int:
    """How many GPUs CuPy sees; 0 when there is no CUDA driver or no device. Never raises.

    Example:
        >>> visible_device_count() >= 0
        True
    """
    try:
        return int(_runtime.getDeviceCount())
    except (RuntimeError, OSError, ImportError):
        # CUDARuntimeError (a RuntimeError) for no device or an old driver; OSError or
        # ImportError when CuPy cannot load the CUDA libraries at all.
        return 0


# -- the backend -------------------------------------------------------------------------


@final
class CupyBackend:
    """Collectives over CuPy arrays on GPUs: local CuPy work per GPU, NCCL across GPUs.

    Every replica gets its own result array on its GPU, ordered on its stream (see the module
    docstring). Nothing here waits on the host.
    """

    name: Final = "cupy"

    def __init__(self) -> None:
        self._plans: dict[tuple[Device, ...], _Plan] = {}
        self._communicators: dict[tuple[int, ...], list[Any]] = {}

    async def all_reduce(
        self, op: str, inputs: Sequence[Any], devices: Sequence[Device]
    ) -> list[Any]:
        """Reduce elementwise across replicas; every replica gets the result on its GPU.

        ``mean`` sums, then each GPU divides its result by the number of replicas (NCCL's own
        average divides by the number of GPUs, which differs when a GPU holds several
        replicas); like ``numpy.mean``, the mean of integer or bool inputs is float64. Other
        ops keep the dtype (bool ``sum`` is logical or and ``prod`` logical and, as
        ``numpy.add`` and ``numpy.multiply`` give for bools).

        Raises:
            ValueError: ``op`` is not ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.
            TypeError: a device is not a GPU device, or NCCL cannot reduce the dtype with
                ``op`` (only across GPUs; on one GPU CuPy reduces any dtype).
            RuntimeError: the replicas span several GPUs and NCCL is not available.

        Example:
            >>> a = b = cuda_device(0)  # two replicas on one GPU; on two GPUs it is the same
            >>> xs = [a.asarray([1.0, 2.0]), b.asarray([3.0, 4.0])]
            >>> [r.get() for r in anyio.run(CUPY_BACKEND.all_reduce, "sum", xs, [a, b])]
            [array([4., 6.]), array([4., 6.])]
        """
        local_op = _LOCAL_OPS.get(op)
        if local_op is None:
            raise ValueError(
                f"unknown reduction {op!r}; expected one of {', '.join(map(repr, _LOCAL_OPS))}"
            )
        plan = self._plan(devices)
        dtype = inputs[0].dtype
        work_dtype = _FLOAT64 if op == "mean" and dtype.kind in "biu" else dtype
        groups = plan.groups
        across = len(groups) > 1
        if across:
            nccl, communicators = self._nccl(plan)
            nccl_dtype, count_factor, nccl_op = _nccl_reduction(nccl, op, work_dtype)
        plan.fan_in()
        sends: list[Any] = []
        outputs: list[Any] = []
        for group in groups:
            with _Active(group.index, group.leader):
                first = inputs[group.replicas[0]]
                if across and len(group.replicas) == 1:
                    # NCCL writes out of place, so the replica's own input is the send buffer.
                    send = _contiguous(first, work_dtype)
                    out = cupy.empty_like(send)
                else:  # reduce this GPU's inputs into a fresh buffer, then NCCL in place
                    out = send = cupy.empty(first.shape, dtype=work_dtype)
                    others = group.replicas[1:]
                    if others:  # the first pass reads two inputs and writes the buffer
                        # In ``work_dtype``: a ufunc picks its loop from the inputs, so a
                        # mean's sum of bools or int8s would otherwise be or'd or wrap.
                        local_op(first, inputs[others[0]], out=out, dtype=work_dtype)
                        for position in others[1:]:
                            local_op(out, inputs[position], out=out, dtype=work_dtype)
                    else:
                        out[...] = first
            sends.append(send)
            outputs.append(out)
        if across and outputs[0].size:
            nccl.groupStart()
            try:
                for rank, group in enumerate(groups):
                    communicators[rank].allReduce(
                        sends[rank].data.ptr,
                        outputs[rank].data.ptr,
                        outputs[rank].size * count_factor,
                        nccl_dtype,
                        nccl_op,
                        group.leader.ptr,
                    )
            finally:
                nccl.groupEnd()
        if op == "mean" and len(inputs) > 1:
            for group, out in zip(groups, outputs, strict=True):
                with _Active(group.index, group.leader):
                    cupy.true_divide(out, len(inputs), out=out)
        return plan.fan_out(outputs)

    async def all_reduce_packed(
        self, op: str, leaves: Sequence[Sequence[Any]], devices: Sequence[Device]
    ) -> list[Any]:
        """Several leaves reduced as one: each GPU joins its replica's leaves into one flat
        array (on its stream), then one ``all_reduce`` of those (one NCCL call across GPUs).

        Raises:
            ValueError, TypeError, RuntimeError: as ``all_reduce``.
        """
        packed = []
        for r, device in enumerate(devices):
            parts = [leaf[r] for leaf in leaves]
            nbytes = sum(part.nbytes for part in parts)
            packed.append(await device.compute(nbytes, _flat_concatenate, parts))
        return await self.all_reduce(op, packed, devices)

    async def all_gather(
        self, inputs: Sequence[Any], axis: int, devices: Sequence[Device]
    ) -> list[Any]:
        """Concatenate the inputs along ``axis`` in replica order; every replica gets the whole.

        Inputs may differ in length along ``axis``. NCCL's ``allGather`` needs equal counts,
        so across GPUs this is one NCCL *broadcast* per replica (all in one group call), each
        from that replica's GPU straight into its slice of every GPU's output: no padding, no
        extra pass, and any dtype (the bytes are copied, not interpreted). Along an axis other
        than 0 the slices are gathered with ``axis`` moved to the front and moved back once.

        Raises:
            TypeError: a device is not a GPU device.
            RuntimeError: the replicas span several GPUs and NCCL is not available.

        Example:
            >>> a = b = cuda_device(0)  # two replicas on one GPU; on two GPUs it is the same
            >>> xs = [a.asarray([1, 2]), b.asarray([3])]
            >>> [r.get() for r in anyio.run(CUPY_BACKEND.all_gather, xs, 0, [a, b])]
            [array([1, 2, 3]), array([1, 2, 3])]
        """
        plan = self._plan(devices)
        first = inputs[0]
        axis = axis % first.ndim if first.ndim else 0
        groups = plan.groups
        plan.fan_in()
        if len(groups) == 1:
            with _Active(groups[0].index, groups[0].leader):
                whole = cupy.concatenate(list(inputs), axis=axis)
            return plan.fan_out([whole])
        nccl, communicators = self._nccl(plan)
        lengths = [x.shape[axis] for x in inputs]
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        rest = first.shape[:axis] + first.shape[axis + 1 :]
        sources: dict[int, Any] = {}
        gathered: list[Any] = []
        for group in groups:
            with _Active(group.index, group.leader):
                for position in group.replicas:
                    sources[position] = cupy.ascontiguousarray(
                        cupy.moveaxis(inputs[position], axis, 0)
                    )
                gathered.append(cupy.empty((sum(lengths), *rest), dtype=first.dtype))
        word, nccl_dtype = _raw_words(nccl, first.dtype)
        row_words = first.dtype.itemsize // word * _product(rest)
        calls = [
            (position, plan.rank_of[position])
            for position in range(len(inputs))
            if lengths[position]
        ]
        if row_words and calls:
            nccl.groupStart()
            try:
                for position, root in calls:
                    start, stop = starts[position], starts[position] + lengths[position]
                    for rank, group in enumerate(groups):
                        receive = gathered[rank][start:stop]
                        send = sources[position] if rank == root else receive
                        communicators[rank].broadcast(
                            send.data.ptr,
                            receive.data.ptr,
                            lengths[position] * row_words,
                            nccl_dtype,
                            root,
                            group.leader.ptr,
                        )
            finally:
                nccl.groupEnd()
        outputs = []
        for group, whole in zip(groups, gathered, strict=True):
            with _Active(group.index, group.leader):
                outputs.append(cupy.ascontiguousarray(cupy.moveaxis(whole, 0, axis)))
        return plan.fan_out(outputs)

    async def broadcast(self, value: Any, devices: Sequence[Device]) -> list[Any]:
        """Give every replica its own copy of ``value``, on its GPU.

        ``value`` may live on any GPU. On one of the replicas' GPUs it is read on that GPU's
        leader stream after every replica stream there (so whichever replica made it, it is
        ready); on another GPU it is first copied to the first replica's GPU after the work
        queued so far on that GPU's current stream (where code outside a step made it), as
        ``CudaDevice.asarray`` copies it. Host data is copied in.

        Raises:
            TypeError: a device is not a GPU device.
            RuntimeError: the replicas span several GPUs and NCCL is not available.

        Example:
            >>> a = b = cuda_device(0)  # two replicas on one GPU; on two GPUs it is the same
            >>> results = anyio.run(CUPY_BACKEND.broadcast, a.asarray([5, 6]), [a, b])
            >>> [r.get().tolist() for r in results], results[0] is results[1]
            ([[5, 6], [5, 6]], False)
        """
        plan = self._plan(devices)
        groups = plan.groups
        plan.fan_in()
        if isinstance(value, cupy.ndarray) and value.device.id in plan.rank_of_gpu:
            root = plan.rank_of_gpu[value.device.id]
            with _Active(groups[root].index, groups[root].leader):
                source = _contiguous(value)
                if len(groups) == 1 and source is value:
                    source = value.copy()  # every replica gets an array of its own
        elif isinstance(value, cupy.ndarray):  # on a GPU that holds no replica
            root, gpu = 0, value.device.id
            copied = _copy_from(
                value, gpu, _get_current_stream(gpu), groups[0].index, groups[0].leader
            )
            with _Active(groups[0].index, groups[0].leader):
                source = _contiguous(copied)
        else:
            root = 0
            with _Active(groups[0].index, groups[0].leader):
                source = _contiguous(cupy.asarray(value))
        if len(groups) == 1:
            return plan.fan_out([source])
        nccl, communicators = self._nccl(plan)
        outputs = []
        for group in groups:
            with _Active(group.index, group.leader):
                outputs.append(cupy.empty(source.shape, dtype=source.dtype))
        word, nccl_dtype = _raw_words(nccl, source.dtype)
        if source.nbytes:
            nccl.groupStart()
            try:
                for rank, group in enumerate(groups):
                    send = source if rank == root else outputs[rank]
                    communicators[rank].broadcast(
                        send.data.ptr,
                        outputs[rank].data.ptr,
                        source.nbytes // word,
                        nccl_dtype,
                        root,
                        group.leader.ptr,
                    )
            finally:
                nccl.groupEnd()
        return plan.fan_out(outputs)

    async def to_host(self, value: Any, device: Device) -> np.ndarray[Any, Any]:
        """A new, writeable, C-contiguous NumPy copy of ``value``, copied on ``device``'s
        stream after the work queued there before, and awaited without blocking the event loop.

        The copy goes into page-locked host memory (``cupyx.empty_pinned``), so CUDA makes it
        asynchronously: it is queued on the stream and awaited as ``synchronize`` awaits (a
        stream callback), with no host synchronization on the loop thread (``ndarray.get``
        would block the thread for the whole copy). Where no page-locked memory is left, the
        copy goes into ordinary memory in a worker thread instead, as CuPy falls back for its
        own transfers. An array on another GPU is first copied to ``device``'s GPU, as
        ``CudaDevice.asarray`` copies it; host data is copied as it is.

        CuPy's pool keeps the page-locked blocks for reuse: for the transient copies of the
        collectives, not for copies as large as a model that stay (a checkpoint's).

        Raises:
            TypeError: ``value`` is a CuPy array and ``device`` no GPU device.
            cupy.cuda.runtime.CUDARuntimeError: the stream's work failed on the device.

        Example:
            >>> a = cuda_device(0)
            >>> anyio.run(CUPY_BACKEND.to_host, a.asarray([[1, 2], [3, 4]]).T, a)
            array([[1, 3],
                   [2, 4]])
        """
        if not isinstance(value, cupy.ndarray):
            return np.array(value, copy=True, order="C")
        index, stream = _placed(device, 0)
        _forget_finished_copies()
        source = device.asarray(value)  # on another GPU: copied to this one, on this stream
        with _Active(index, stream):  # (no await inside: other tasks run between awaits)
            source = _contiguous(source)
            try:
                host: np.ndarray[Any, Any] | None = cupyx.empty_pinned(value.shape, value.dtype)
            except _runtime.CUDARuntimeError as exc:
                if exc.status != _CUDA_ERROR_MEMORY_ALLOCATION:
                    raise
                host = None
            if host is not None:
                if host.nbytes:
                    source.data.copy_to_host_async(host.ctypes.data, host.nbytes, stream)
                copied = stream.record(_event())
        if host is None:  # no page-locked memory left
            return await anyio.to_thread.run_sync(host_array, source, device)
        try:
            await device.synchronize()
        except BaseException:
            # Abandoned (cancelled, or the device failed): the copy may still be writing into
            # the buffer, which must not go back to the pinned pool before it has finished.
            _abandoned_copies.append((copied, host))
            raise
        return host

    def reduce_to_first(self, op: str, inputs: Sequence[Any], devices: Sequence[Device]) -> Any:
        """``op`` (``"sum"`` or ``"mean"``) over the inputs, into a new array on the first
        device's GPU, queued on its stream now (synchronous: nothing is awaited).

        Inputs on other GPUs are copied over first, each on the first device's stream after
        the work on its replica's stream; inputs on the same GPU are read after the work on
        their replicas' streams (an event each). Every replica's stream then waits for those
        reads, so none of them reuses an input's memory too early. For small reads outside a
        step, such as a sync-on-read variable's value.

        Raises:
            ValueError: ``op`` is not ``"sum"`` or ``"mean"``.

        Example:
            >>> a, b = cuda_device(0), CudaDevice(0)  # two replicas on one GPU
            >>> xs = [a.asarray([1.0, 2.0]), b.asarray([3.0, 4.0])]
            >>> CUPY_BACKEND.reduce_to_first("sum", xs, [a, b]).get()
            array([4., 6.])
        """
        if op not in ("sum", "mean"):
            raise ValueError(f"reduce_to_first reduces with 'sum' or 'mean', not {op!r}")
        placed = [_placed(device, position) for position, device in enumerate(devices)]
        index, stream = placed[0]
        here = [value for value, (gpu, _) in zip(inputs, placed, strict=True) if gpu == index]
        away = [
            _copy_from(value, gpu, other, index, stream)
            for value, (gpu, other) in zip(inputs, placed, strict=True)
            if gpu != index
        ]
        others = {other: gpu for gpu, other in placed[1:] if gpu == index and other != stream}
        with _Active(index, stream):
            for other in others:
                stream.wait_event(other.record(_event()))
            total = cupy.array(here[0], copy=True)
            for value in [*here[1:], *away]:
                total += value
            if op == "mean":
                total /= len(inputs)
            read = stream.record(_event())
        for other in others:
            other.wait_event(read)
        return total

    def _plan(self, devices: Sequence[Device]) -> _Plan:
        key = tuple(devices)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(key)
        return plan

    def prepare(self, devices: Sequence[Device]) -> None:
        """Make the plan of ``devices`` and, when they span several GPUs and NCCL is there,
        its communicators: called when a strategy is built, so the first collective does not
        run ``ncclCommInitAll`` (which holds the GIL for as long as it takes) on the event
        loop. Without NCCL this does nothing: collectives across GPUs then raise.

        Raises:
            TypeError: a device is not a GPU device.

        Example:
            >>> CUPY_BACKEND.prepare([cuda_device(0)])
        """
        plan = self._plan(devices)
        if len(plan.groups) > 1 and _nccl_or_none() is not None:
            self._nccl(plan)

    def _nccl(self, plan: _Plan) -> tuple[Any, list[Any]]:
        """The NCCL module and the communicators of the plan's GPUs (made by ``prepare``, or
        here the first time a collective meets a set of GPUs no strategy was built on)."""
        nccl = _nccl_module()
        gpus = tuple(group.index for group in plan.groups)
        communicators = self._communicators.get(gpus)
        if communicators is None:
            communicators = self._communicators[gpus] = nccl.NcclCommunicator.initAll(list(gpus))
        return nccl, communicators

    def __repr__(self) -> str:
        return "<CupyBackend>"


CUPY_BACKEND: Final = CupyBackend()


# -- helpers -----------------------------------------------------------------------------


def _activate(index: int, stream: Any) -> tuple[int, Any]:
    """Make GPU ``index`` and ``stream`` current; return what to restore."""
    previous_device = _get_device()
    if previous_device != index:
        _set_device(index)
    previous_stream = _get_current_stream()
    stream.__enter__()
    return previous_device, previous_stream


def _restore(index: int, stream: Any, previous: tuple[int, Any]) -> None:
    """Undo ``_activate``, even if the code in between switched the device."""
    previous_device, previous_stream = previous
    if _get_device() != index:
        _set_device(index)
    stream.__exit__(None, None, None)
    if _get_current_stream() is not previous_stream:
        previous_stream.use()  # it was made current with use(), which the with-stack forgets
    if previous_device != index:
        _set_device(previous_device)


class _Active:
    """``with _Active(index, stream):`` runs its body with that GPU and stream current."""

    __slots__ = ("_index", "_previous", "_stream")

    def __init__(self, index: int, stream: Any) -> None:
        self._index = index
        self._stream = stream
        self._previous: tuple[int, Any] | None = None

    def __enter__(self) -> None:
        self._previous = _activate(self._index, self._stream)

    def __exit__(self, *exc_info: object) -> None:
        assert self._previous is not None
        _restore(self._index, self._stream, self._previous)


class _Waiter:
    """What a stream callback hands to ``synchronize``: the status, and the wake-up."""

    __slots__ = ("result", "status")

    def __init__(self, result: _loops.ThreadResult) -> None:
        self.result = result
        self.status: int | None = None


def _stream_callback(stream: Any, status: int, waiter: _Waiter) -> None:
    # Runs on a CUDA driver thread, which may make no CUDA calls: hand the bare status over
    # and let the waiting task build the exception.
    waiter.status = status
    waiter.result.set(status, None)


#: ``(event, buffer)`` of device-to-host copies whose wait was abandoned: each buffer stays
#: referenced until its copy has finished.
_abandoned_copies: list[tuple[Any, Any]] = []


def _forget_finished_copies() -> None:
    _abandoned_copies[:] = [(event, host) for event, host in _abandoned_copies if not event.done]


def _event() -> Any:
    """A CUDA event on the current device, for ordering only (no timing)."""
    return cupy.cuda.Event(disable_timing=True)


def _copy_from(value: Any, gpu: int, source: Any, index: int, stream: Any) -> Any:
    """A copy on GPU ``index``, made on ``stream``, of ``value`` from GPU ``gpu``, where the
    work on stream ``source`` made it: ``stream`` waits for that work, and ``source`` waits for
    the copy before its memory pool hands ``value``'s memory out again. A non-contiguous
    ``value`` is made contiguous on ``source`` first (CuPy copies only contiguous arrays
    between GPUs)."""
    if not (value.flags.c_contiguous or value.flags.f_contiguous):
        with _Active(gpu, source):
            value = cupy.ascontiguousarray(value)
    with _Active(index, stream):
        stream.wait_event(_recorded(source, gpu))
        copied = cupy.copy(value)
        read = stream.record(_event())
    with cupy.cuda.Device(gpu):
        source.wait_event(read)
    return copied


def _recorded(stream: Any, gpu: int) -> Any:
    """An event recorded on ``stream`` of GPU ``gpu`` (made on that GPU, as CUDA requires)."""
    with cupy.cuda.Device(gpu):
        return stream.record(_event())


class _Group:
    """The replicas of one collective that live on one GPU."""

    __slots__ = ("index", "leader", "others", "replicas")

    def __init__(self, index: int) -> None:
        self.index = index
        self.leader: Any = None  # the stream of the first replica on this GPU
        self.replicas: list[int] = []  # replica positions, the leader's first
        self.others: list[tuple[int, Any]] = []  # (position, stream) of all but the leader


def _placed(device: Device, position: int) -> tuple[int, Any]:
    """``(GPU index, stream)`` of replica ``position``'s device, or a ``TypeError``."""
    stream = getattr(device, "stream", None)
    if device.kind != "gpu" or stream is None:
        raise TypeError(
            f"the CuPy backend runs collectives over GPU devices with a CUDA stream, "
            f"got {type(device).__name__} {device!r} for replica {position}"
        )
    return device.index, stream


class _Plan:
    """How a tuple of devices maps onto GPUs and streams; made once per tuple, then cached.

    GPUs are ranked by index, so every ordering of the same GPUs shares one set of NCCL
    communicators; results still follow replica order.
    """

    __slots__ = ("groups", "rank_of", "rank_of_gpu")

    def __init__(self, devices: tuple[Device, ...]) -> None:
        placed = [_placed(device, position) for position, device in enumerate(devices)]
        gpus = sorted({index for index, _ in placed})
        self.rank_of_gpu = {index: rank for rank, index in enumerate(gpus)}
        self.groups = [_Group(index) for index in gpus]
        self.rank_of: list[int] = []
        for position, (index, stream) in enumerate(placed):
            rank = self.rank_of_gpu[index]
            group = self.groups[rank]
            if group.replicas:
                group.others.append((position, stream))
            else:
                group.leader = stream
            group.replicas.append(position)
            self.rank_of.append(rank)

    def fan_in(self) -> None:
        """Order each GPU's leader stream after the work queued on its other replicas' streams."""
        for group in self.groups:
            if not group.others:
                continue
            leader = group.leader
            with _Active(group.index, leader):
                for _, stream in group.others:
                    if stream is not leader:
                        leader.wait_event(stream.record(_event()))

    def fan_out(self, outputs: list[Any]) -> list[Any]:
        """Give each replica its GPU's output: the leader the array itself, the others a copy
        made on their own stream after it; the leader's stream then waits for those copies."""
        results: list[Any] = [None] * len(self.rank_of)
        for group, output in zip(self.groups, outputs, strict=True):
            results[group.replicas[0]] = output
            if not group.others:
                continue
            leader = group.leader
            with _Active(group.index, leader):
                done = leader.record(_event())
            for position, stream in group.others:
                with _Active(group.index, stream):
                    if stream is not leader:
                        stream.wait_event(done)
                    results[position] = output.copy()
                    if stream is not leader:
                        leader.wait_event(stream.record(_event()))
        return results


#: How long ``synchronize`` waits for its stream callback before it polls an event too, the
#: first pause between polls, and the longest (seconds).
_CALLBACK_GRACE: Final = 0.05
_POLL_FIRST: Final = 0.001
_POLL_MAX: Final = 0.05

_FLOAT64: Final = cupy.dtype("float64")

_LOCAL_OPS: Final[dict[str, Any]] = {
    "sum": cupy.add,
    "mean": cupy.add,
    "max": cupy.maximum,
    "min": cupy.minimum,
    "prod": cupy.multiply,
}

#: NumPy dtype name -> NCCL data type name (cupy.cuda.nccl constants).
_NCCL_DTYPES: Final = {
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
}

#: aioreplica op -> NCCL op name; "mean" is a sum, divided afterwards.
_NCCL_OPS: Final = {
    "sum": "NCCL_SUM",
    "mean": "NCCL_SUM",
    "prod": "NCCL_PROD",
    "max": "NCCL_MAX",
    "min": "NCCL_MIN",
}

#: bool goes over the wire as uint8 0/1: or (max) for sum, and (min) for prod, as NumPy does.
_BOOL_OPS: Final = {"sum": "NCCL_MAX", "prod": "NCCL_MIN", "max": "NCCL_MAX", "min": "NCCL_MIN"}

#: Word sizes for copying raw bytes with NCCL (broadcast copies bits, whatever the type).
_RAW_WORDS: Final = ((8, "NCCL_UINT64"), (4, "NCCL_UINT32"), (2, "NCCL_FLOAT16"))


def _contiguous(array: Any, dtype: Any = None) -> Any:
    """``cupy.ascontiguousarray``, except that a 0-d array stays 0-d (CuPy, as NumPy, makes it
    1-d)."""
    result = cupy.ascontiguousarray(array, dtype=dtype)
    return result if result.shape == array.shape else result.reshape(array.shape)


def _flat_concatenate(parts: list[Any]) -> Any:
    """The arrays flattened and joined end to end (any layout: non-contiguous ones too)."""
    return cupy.concatenate(parts, axis=None)


def _nccl_reduction(nccl: Any, op: str, dtype: Any) -> tuple[int, int, int]:
    """``(nccl data type, elements per array element, nccl op)`` for reducing ``dtype``.

    Raises:
        TypeError: NCCL cannot reduce ``dtype`` with ``op``.
    """
    if dtype.kind == "b":
        return nccl.NCCL_UINT8, 1, getattr(nccl, _BOOL_OPS[op])
    if dtype.kind == "c" and op in ("sum", "mean"):
        # A complex sum is the sum of the real parts and of the imaginary parts.
        part = _NCCL_DTYPES.get(cupy.dtype(dtype.char.lower()).name)
        if part is not None:
            return getattr(nccl, part), 2, nccl.NCCL_SUM
    name = _NCCL_DTYPES.get(dtype.name)
    if name is None:
        raise TypeError(
            f"all_reduce({op!r}) across GPUs cannot reduce dtype {dtype.name}: NCCL reduces "
            f"{', '.join(_NCCL_DTYPES)} (and bool; complex for sum and mean only); cast the "
            "value first, e.g. x.astype('int32') or x.astype('float32')"
        )
    return getattr(nccl, name), 1, getattr(nccl, _NCCL_OPS[op])


def _raw_words(nccl: Any, dtype: Any) -> tuple[int, int]:
    """``(word size in bytes, nccl data type)`` to copy arrays of ``dtype`` bit for bit."""
    for size, name in _RAW_WORDS:
        if dtype.itemsize % size == 0:
            return size, getattr(nccl, name)
    return 1, nccl.NCCL_UINT8


def _product(shape: tuple[int, ...]) -> int:
    result = 1
    for extent in shape:
        result *= extent
    return result


def _nccl_module() -> Any:
    """``cupy.cuda.nccl``, or advice when CuPy cannot load NCCL.

    Raises:
        RuntimeError: NCCL is not installed where CuPy looks for it.
    """
    nccl = _nccl_or_none()
    if nccl is None:
        raise RuntimeError(_NO_NCCL)
    return nccl


def _nccl_or_none() -> Any:
    """``cupy.cuda.nccl`` where CuPy could load NCCL, else ``None``.

    CuPy's wheels do not bundle NCCL: the import then succeeds with ``available`` false, after
    a ``UserWarning`` that says so (an error under ``-W error``); ``available`` is the answer.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            from cupy.cuda import nccl
        except ImportError:  # pragma: no cover - older CuPy builds without the module
            return None
    return nccl if getattr(nccl, "available", False) else None


_NO_NCCL: Final = (
    "collectives across several GPUs need NCCL, which CuPy cannot load here; install it "
    "(for CUDA 12: pip install nvidia-nccl-cu12, or python -m cupyx.tools.install_library "
    "--cuda 12.x --library nccl), or run the replicas on one GPU"
)
