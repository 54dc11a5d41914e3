"""GPU conformance check: what users run with aioreplica on CuPy, compared with NumPy.

Runs on a machine with CUDA and CuPy, or against the CPU stand-in of CuPy in
``tests/cupy_sim`` (``PYTHONPATH=.:tests/cupy_sim``), whose race detector turns every access to
device memory that CUDA would not order into a ``RaceError``.

First a smoke test: on each GPU a small kernel, then one ``CudaDevice.synchronize()`` under a
10 s limit. A broken driver hangs there; the check then fails at once, with the summary, before
any layout runs. Then, for each replica layout:

- one replica per visible GPU (``MirroredStrategy(["gpu:0", ...])``);
- with one GPU, 1, 2 and 4 replicas on it; with several, also 2 replicas on each GPU. A strategy
  gives each replica its own device name, so these extra replicas are devices that wrap a
  ``CudaDevice`` of their own (their own stream) under names ``gpu:<i>.<k>``;
- with several GPUs and no NCCL (CuPy's wheels do not bundle it), the layouts across GPUs are
  reported as SKIP, with the reason; the layouts on ``gpu:0`` run instead, and a check makes
  sure a collective across GPUs fails with an error that names NCCL;

and on each event loop available (asyncio, and trio when it is installed), it checks, each
against the same computation in NumPy:

1. collectives: ``ctx.all_reduce`` for each op and several dtypes (plain arrays, a nested
   structure, Python scalars), ``ctx.all_gather`` with uneven lengths along axis 0 and 1,
   ``ctx.broadcast`` from the first and the last replica, ``ctx.reduce_scatter``,
   ``ctx.barrier``, ``strategy.reduce`` with and without ``axis``; results read on the host
   right after ``run()``, with no synchronization in between, as users read them;
2. variables: a ``MirroredVariable`` (aggregation sum and mean) and a ``SyncOnReadVariable``
   (sum and mean) made in ``strategy.scope()`` from NumPy values and from CuPy arrays made
   outside a step (on GPU 0 and on the last GPU), and a 0-d one; ``assign``/``assign_add`` in
   replica context and in cross-replica context (CuPy and NumPy values); after each stage every
   copy on its replica's GPU with the expected value, and ``v.numpy()``, ``np.asarray(v)``,
   ``float(v)`` and ``repr(v)``;
3. an optimizer step: ``SGD`` with momentum and ``Adam``, two ``apply_gradients`` steps inside
   ``strategy.run`` with per-replica gradients, among them non-contiguous ones (``g.T`` of a
   ``(k, m)`` array for an ``(m, k)`` variable, and a strided slice), against the same updates
   in NumPy, slots and step count included;
4. a checkpoint round trip: ``Checkpoint.save`` of variables (one sync-on-read whose copies
   differ), an optimizer and a number, then a further step and writes, then ``restore``: every
   value, copy and slot is back;
5. non-contiguous leaves in ``ctx.all_reduce``: a ``.T`` array and a strided slice
   ``x[:, ::2]`` among several small leaves of a nested structure, so they are packed;
6. memory reuse: the same step (``all_reduce``, ``all_gather``, a variable write) run several
   times, every result checked and then dropped, so the memory pool hands the blocks out again
   (CuPy's pool keeps one arena per stream: a missing back edge shows up as a race there, or as
   wrong values on a GPU);
7. that every result lives on its replica's GPU;
8. invariant 1: at every await inside the steps, with replicas interleaving, the current CUDA
   device and the current CuPy stream are the replica's own, and ``device.run`` runs its
   function with them current;
9. invariant 4: no host synchronization on the event loop thread during a step, watched two
   ways. Every ``strategy.run`` call runs inside ``cupyx.allow_synchronize(False)`` where cupyx
   has it (CuPy, and the stand-in, then raise ``DeviceSynchronized`` from ``ndarray.get()``
   and ``Device.synchronize()``); and the Python-level entry points that block the host
   (``Stream.synchronize``, ``Event.synchronize``, ``Device.synchronize``, the runtime's
   ``deviceSynchronize``, ``streamSynchronize`` and ``eventSynchronize``, ``cupy.asnumpy``) are
   wrapped to record calls made from the loop thread while a step runs (entry points CuPy does
   not let us wrap are listed as not watched). A heartbeat task also measures the longest pause
   of the event loop during steps, printed as INFO: a host wait for GPU work shows up there as
   a long pause;
10. against the stand-in: that it recorded no data race (one the code under test caught).

Inputs come out of a chain of 8 matrix products on the replica's stream (2048 x 2048 float32,
about 2 ms on a current GPU), so work that is not ordered after the replica's stream reads
unfinished data and fails the comparison instead of passing by luck. ``--quick`` uses 16 x 16
matrices; it is on by itself against the stand-in, where the race detector checks the order
and the timing means nothing.

Each layout runs under ``anyio.fail_after`` (``--layout-timeout``, default 60 s): a layout that
takes longer is a FAIL line naming it, and the next layout runs.

Prints one line per check, ``PASS`` or ``FAIL`` with the difference (``SKIP`` with the reason),
and a summary: ``<n> passed, <n> failed, <n> skipped in <s> s``. Exit status: 0 when no check
failed, 1 when one did, 2 when there is no CuPy or no CUDA device.

Run from the repository root::

    PYTHONPATH=. python devices/check_gpu.py
    PYTHONPATH=.:tests/cupy_sim CUPY_SIM_DEVICES=2 python devices/check_gpu.py   # stand-in
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import math
import operator
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import numpy as np

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator
    from types import ModuleType

cp: Any = None  # the cupy module, imported in main()
cupyx: Any = None  # the cupyx module, or None where it cannot be imported

OPS = ("sum", "mean", "max", "min", "prod")
#: dtype -> the ops checked for it (the collectives refuse mean of integers and bool sums).
REDUCE_DTYPES: dict[str, tuple[str, ...]] = {
    "float32": OPS,
    "float64": OPS,
    "float16": ("sum", "mean", "max", "min"),
    "int32": ("sum", "max", "min", "prod"),
    "int64": ("sum", "max", "min", "prod"),
    "bool": ("max", "min"),
}
SHAPE = (33, 7)
#: The side of the matrices in ``slow``'s chain: about 2 ms of work per chain on a current GPU.
SLOW_SIZE = 2048
#: The side with ``--quick`` (and against the stand-in, where timing means nothing).
QUICK_SLOW_SIZE = 16
SLOW_PRODUCTS = 8
#: Seconds the first ``synchronize()`` may take before the check gives up on the driver.
SMOKE_TIMEOUT = 10.0
#: Default seconds per layout (``--layout-timeout``).
LAYOUT_TIMEOUT = 60.0
#: How often the heartbeat task wakes during steps (seconds).
HEARTBEAT_S = 0.001
#: How many times the memory-reuse check runs its step.
POOL_ROUNDS = 4
VAR_SHAPE = (3, 4)
#: ``(m, k)``: the optimizer's weight; its gradient arrives as the transpose of a ``(k, m)``.
OPT_SHAPE = (6, 5)
#: Tolerance for optimizer updates (float32 on the GPU against float64 in NumPy).
OPT_TOLERANCE = (1e-4, 1e-5)

slow_size = SLOW_SIZE  # set by main()


# -- results --------------------------------------------------------------------------------


@dataclass
class Report:
    """Counts and prints each check's outcome."""

    passed: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        if ok:
            self.passed += 1
            print(f"PASS {name}", flush=True)
        else:
            self.failed.append(name)
            print(f"FAIL {name}: {detail}", flush=True)

    def skip(self, name: str, reason: str) -> None:
        self.skipped.append(name)
        print(f"SKIP {name}: {reason}", flush=True)

    def summary(self, elapsed: float) -> str:
        return (
            f"\n{self.passed} passed, {len(self.failed)} failed, {len(self.skipped)} skipped "
            f"in {elapsed:.1f} s" + "".join(f"\n  FAILED {name}" for name in self.failed)
        )


# -- devices for several replicas on one GPU -----------------------------------------------


class ExtraReplicaDevice:
    """A further replica on a GPU: its own ``CudaDevice`` (own stream) under its own name.

    Implements the whole ``aioreplica._backends.Device`` protocol, and ``stream``, which the
    CuPy backend reads, by delegating to the ``CudaDevice`` it wraps; only the name differs
    (``gpu:<index>.<slot>``), since a strategy needs a distinct name per replica.
    """

    kind = "gpu"
    has_context = True

    def __init__(self, index: int, slot: int) -> None:
        from aioreplica._backends._cupy import CudaDevice

        self._inner = CudaDevice(index)
        self.name = f"gpu:{index}.{slot}"
        self.index = index
        self.enter = self._inner.enter
        self.leave = self._inner.leave
        self.resume = self._inner.resume
        self.suspend = self._inner.suspend
        self.asarray = self._inner.asarray

    @property
    def xp(self) -> ModuleType:
        return self._inner.xp

    @property
    def backend(self) -> Any:
        return self._inner.backend

    @property
    def stream(self) -> Any:
        return self._inner.stream

    async def compute(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._inner.compute(nbytes, fn, *args)

    async def synchronize(self) -> None:
        await self._inner.synchronize()

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await self._inner.run(fn, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<ExtraReplicaDevice {self.name}>"


@dataclass
class Layout:
    """Replicas to check together: device names for a strategy, or device objects."""

    label: str
    devices: list[Any]
    gpus: int  # how many GPUs the replicas span


def single_gpu_layouts() -> list[Layout]:
    """1, 2 and 4 replicas on ``gpu:0``."""
    from aioreplica._backends._cupy import cuda_device

    result = [Layout("1 replica on gpu:0", ["gpu:0"], 1)]
    for count in (2, 4):
        devices: list[Any] = [cuda_device(0)]
        devices += [ExtraReplicaDevice(0, k) for k in range(1, count)]
        result.append(Layout(f"{count} replicas on gpu:0", devices, 1))
    return result


def multi_gpu_layouts(gpus: int) -> list[Layout]:
    """One replica per GPU, and two per GPU."""
    from aioreplica._backends._cupy import cuda_device

    pairs = [device for i in range(gpus) for device in (cuda_device(i), ExtraReplicaDevice(i, 1))]
    return [
        Layout(f"{gpus} replicas, one per GPU", [f"gpu:{i}" for i in range(gpus)], gpus),
        Layout(f"{2 * gpus} replicas, 2 per GPU", pairs, gpus),
    ]


def nccl_available() -> bool:
    """Whether CuPy can load NCCL, which collectives across GPUs need."""
    from aioreplica._backends._cupy import _nccl_or_none

    return _nccl_or_none() is not None


# -- data -------------------------------------------------------------------------------------


def host_data(replica: int, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """The same pseudo-random data in the step (on the GPU) and in the NumPy reference."""
    seed = [replica, *(ord(c) for c in f"{name}/{dtype}")]
    rng = np.random.default_rng(seed)
    kind = np.dtype(dtype).kind
    if kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if kind in "iu":
        return rng.integers(-2, 3, shape).astype(dtype)
    return rng.uniform(0.5, 1.5, shape).astype(dtype)


def tolerance(dtype: Any, replicas: int) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing a reduction of ``replicas`` values of ``dtype``."""
    kind = np.dtype(dtype)
    if kind == np.float16:
        return 2e-3 * replicas, 2e-3 * replicas
    if kind == np.float32:
        return 1e-5 * replicas, 1e-6 * replicas
    if kind == np.float64:
        return 1e-12 * replicas, 1e-13 * replicas
    return 0.0, 0.0


def numpy_reduce(op: str, arrays: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    if op == "mean":
        return np.asarray(np.mean(np.stack(arrays), axis=0, dtype=np.float64)).astype(
            arrays[0].dtype
        )
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    return np.asarray(functools.reduce(ufunc, arrays))


def compare(
    host: np.ndarray[Any, Any], expected: np.ndarray[Any, Any], rtol: float, atol: float
) -> tuple[bool, str]:
    """Whether a host array matches ``expected`` (shape, dtype, values), and if not, how not."""
    host = np.asarray(host)
    if host.shape != expected.shape:
        return False, f"shape {host.shape}, expected {expected.shape}"
    if host.dtype != expected.dtype:
        return False, f"dtype {host.dtype}, expected {expected.dtype}"
    if expected.dtype.kind in "fc":
        ok = bool(np.allclose(host, expected, rtol=rtol, atol=atol))
    else:
        ok = bool(np.array_equal(host, expected))
    if ok:
        return True, ""
    diff = np.abs(host.astype(np.float64) - expected.astype(np.float64))
    return False, f"max abs difference {diff.max():.3g} (rtol {rtol}, atol {atol})"


def same(got: Any, expected: np.ndarray[Any, Any], replicas: int) -> tuple[bool, str]:
    """Whether ``got`` (on the GPU or the host) matches ``expected``, read on the host as a
    user reads it: ``cupy.asnumpy`` with nothing synchronized first."""
    return compare(np.asarray(cp.asnumpy(got)), expected, *tolerance(expected.dtype, replicas))


def as_float32(value: Any) -> np.ndarray[Any, Any]:
    return np.asarray(value, dtype=np.float64).astype(np.float32)


# -- what a step observes ---------------------------------------------------------------------


@dataclass
class Watch:
    """What replicas saw during the steps of one layout; filled from inside the steps."""

    loop_thread: int = 0
    stepping: bool = False
    trace: list[tuple[int, str]] = field(default_factory=list)
    wrong_context: list[str] = field(default_factory=list)
    host_syncs: list[str] = field(default_factory=list)
    sync_errors: list[str] = field(default_factory=list)
    longest_pause: float = 0.0
    results: dict[tuple[int, str], Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.loop_thread = threading.get_ident()
        self.stepping = False
        self.trace.clear()
        self.wrong_context.clear()
        self.host_syncs.clear()
        self.sync_errors.clear()
        self.longest_pause = 0.0
        self.results.clear()


WATCH = Watch()


def here(label: str) -> None:
    """Record where a replica is, and whether its own device and stream are current."""
    import aioreplica

    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    replica = ctx.replica_id_in_sync_group
    device: Any = ctx.device
    WATCH.trace.append((replica, label))
    current_device = cp.cuda.runtime.getDevice()
    current_stream = cp.cuda.get_current_stream()
    if current_device != device.index or current_stream != device.stream:
        WATCH.wrong_context.append(
            f"replica {replica} at {label}: device {current_device} stream "
            f"{current_stream.ptr:#x}, expected device {device.index} stream "
            f"{device.stream.ptr:#x}"
        )


async def checked(label: str, awaitable: Awaitable[Any]) -> Any:
    """``await awaitable``, checking the replica's device and stream before and after."""
    here(f"before {label}")
    value = await awaitable
    here(f"after {label}")
    return value


def slow(x: Any) -> Any:
    """``x`` unchanged, but only once a chain of matrix products on the current stream is done."""
    a = cp.full((slow_size, slow_size), 1.0 / slow_size, dtype=cp.float32)
    for _ in range(SLOW_PRODUCTS):
        a = a @ a  # stays 1/slow_size everywhere: finite, and times zero is zero
    zero = (a[0, 0] * 0).astype(x.dtype)
    return x + zero if x.dtype != cp.bool_ else x | zero


def replica_data(name: str, shape: tuple[int, ...], dtype: str = "float32") -> Any:
    """This replica's ``host_data`` on its device, out of a slow chain on its stream."""
    import aioreplica

    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    return slow(ctx.device.asarray(host_data(ctx.replica_id_in_sync_group, name, dtype, shape)))


def install_host_sync_watch() -> tuple[list[str], list[str]]:
    """Wrap the host-blocking entry points; return (watched, not watched)."""
    targets: list[tuple[Any, str, str]] = [
        (cp.cuda.Stream, "synchronize", "Stream.synchronize"),
        (cp.cuda.Event, "synchronize", "Event.synchronize"),
        (cp.cuda.Device, "synchronize", "Device.synchronize"),
        (cp.cuda.runtime, "deviceSynchronize", "runtime.deviceSynchronize"),
        (cp.cuda.runtime, "streamSynchronize", "runtime.streamSynchronize"),
        (cp.cuda.runtime, "eventSynchronize", "runtime.eventSynchronize"),
        (cp, "asnumpy", "cupy.asnumpy"),
    ]
    watched, unwatched = [], []
    for owner, attribute, name in targets:
        original = getattr(owner, attribute, None)
        if original is None:
            unwatched.append(name)
            continue
        if getattr(original, "_check_gpu_watch", False):  # main() ran before in this process
            watched.append(name)
            continue

        def wrapper(*args: Any, _original: Any = original, _name: str = name, **kw: Any) -> Any:
            if WATCH.stepping and threading.get_ident() == WATCH.loop_thread:
                WATCH.host_syncs.append(_name)
            return _original(*args, **kw)

        wrapper._check_gpu_watch = True  # type: ignore[attr-defined]
        try:
            setattr(owner, attribute, wrapper)
        except (AttributeError, TypeError):
            unwatched.append(name)
        else:
            watched.append(name)
    return watched, unwatched


@contextlib.contextmanager
def host_sync_forbidden() -> Iterator[None]:
    """``cupyx.allow_synchronize(False)`` on this thread, where cupyx has it; else nothing.

    CuPy marks the API deprecated (or experimental) and warns on every call; that warning is
    silenced here.
    """
    allow = getattr(cupyx, "allow_synchronize", None)
    if allow is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="cupyx.allow_synchronize")
            stack.enter_context(allow(False))
        yield


async def run_step(strategy: Any, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """``await strategy.run(fn, args=args)`` as users call it, watched for host syncs.

    While the step runs, host synchronization is forbidden on this (the loop's) thread
    (``DeviceSynchronized`` is recorded and raised), the wrapped entry points record calls from
    it, and a heartbeat task measures the longest pause of the event loop.
    """
    synchronized = getattr(cupyx, "DeviceSynchronized", None)

    async def heartbeat() -> None:
        last = time.perf_counter()
        while True:
            await anyio.sleep(HEARTBEAT_S)
            now = time.perf_counter()
            WATCH.longest_pause = max(WATCH.longest_pause, now - last)
            last = now

    failure: Exception | None = None
    WATCH.stepping = True
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(heartbeat)
            try:
                with host_sync_forbidden():
                    result = await strategy.run(fn, args=args)
            except Exception as exc:  # raised below as it is, not in an exception group
                failure = exc
            finally:
                group.cancel_scope.cancel()
    finally:
        WATCH.stepping = False
    if failure is not None:
        if synchronized is not None and isinstance(failure, synchronized):
            WATCH.sync_errors.append(f"{fn.__name__}: {failure}")
        raise failure
    return result


def misplaced(values: dict[str, Any], replica: int, gpu: int) -> list[str]:
    """The CuPy arrays among ``values`` that are not on ``gpu``, described."""
    return [
        f"replica {replica} {name}: on GPU {value.device.id}, not {gpu}"
        for name, value in values.items()
        if isinstance(value, cp.ndarray) and value.device.id != gpu
    ]


@dataclass
class LayoutRun:
    """One layout on one event loop: the strategy and where to report."""

    report: Report
    label: str
    strategy: Any
    replica_gpus: list[int]

    @property
    def n(self) -> int:
        return len(self.replica_gpus)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.report.check(f"[{self.label}] {name}", ok, detail)


# -- 1. collectives ---------------------------------------------------------------------------


async def collectives_step() -> Any:
    import aioreplica

    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    replica = ctx.replica_id_in_sync_group
    n = ctx.num_replicas_in_sync
    device: Any = ctx.device
    results = WATCH.results
    here("start")

    for _ in range(replica % 3):  # replicas reach their first collective in a mixed order
        await checked("checkpoint", anyio.lowlevel.checkpoint())

    for dtype, ops in REDUCE_DTYPES.items():
        x = replica_data("reduce", SHAPE, dtype)
        for op in ops:
            results[replica, f"all_reduce {op} {dtype}"] = await checked(
                f"all_reduce {op} {dtype}", ctx.all_reduce(op, x)
            )

    nested = {
        "w": replica_data("nested w", (5, 4)),
        "b": [replica_data("nested b", (4,)), 1.5],
    }
    total = await checked("all_reduce nested", ctx.all_reduce(aioreplica.ReduceOp.SUM, nested))
    results[replica, "nested w"], results[replica, "nested b"] = total["w"], total["b"][0]
    results[replica, "nested scalar"] = total["b"][1]

    await checked("synchronize", device.synchronize())
    seen = await checked(
        "run", device.run(lambda: (cp.cuda.runtime.getDevice(), cp.cuda.get_current_stream()))
    )
    if seen != (device.index, device.stream):
        WATCH.wrong_context.append(f"replica {replica}: device.run ran with {seen}")

    for axis in (0, 1):
        shape = (replica + 1, 3) if axis == 0 else (3, replica + 2)
        results[replica, f"all_gather axis={axis}"] = await checked(
            f"all_gather axis={axis}",
            ctx.all_gather(replica_data(f"gather {axis}", shape), axis=axis),
        )

    for source in sorted({0, n - 1}):
        x = replica_data("broadcast", SHAPE, "float64")
        results[replica, f"broadcast from {source}"] = await checked(
            f"broadcast from {source}", ctx.broadcast(x, source_replica=source)
        )

    for op in ("sum", "max"):
        x = replica_data("scatter", (3 * n + 1, 4))
        results[replica, f"reduce_scatter {op}"] = await checked(
            f"reduce_scatter {op}", ctx.reduce_scatter(op, x, axis=0)
        )

    await checked("barrier", ctx.barrier())
    for _ in range(2 - replica % 2):
        await checked("checkpoint again", anyio.lowlevel.checkpoint())
    await checked("synchronize again", device.synchronize())
    here("end")
    return replica_data("returned", SHAPE)


async def uneven_step() -> Any:
    import aioreplica

    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    here("uneven")
    return replica_data("uneven", (ctx.replica_id_in_sync_group + 1, 3))


async def check_collectives(run: LayoutRun) -> None:
    strategy, n = run.strategy, run.n
    WATCH.results.clear()
    first = len(WATCH.trace)
    returned = await run_step(strategy, collectives_step)
    uneven = await run_step(strategy, uneven_step)
    order = [replica for replica, _ in WATCH.trace[first:]]
    # No synchronization anywhere below: strategy.reduce must order itself after the replicas,
    # and reads on the host (cupy.asnumpy, on the legacy default stream) after both.
    reduced = {op: await strategy.reduce(op, returned, axis=None) for op in ("sum", "mean", "max")}
    reduced_along = {op: await strategy.reduce(op, uneven, axis=0) for op in ("sum", "mean")}

    results = WATCH.results
    hosts = {
        (dtype, r): host_data(r, "reduce", dtype, SHAPE)
        for dtype in REDUCE_DTYPES
        for r in range(n)
    }

    def each_replica(name: str, expected: np.ndarray[Any, Any], replicas: int) -> None:
        problems = []
        for r in range(n):
            ok, detail = same(results[r, name], expected, replicas)
            if not ok:
                problems.append(f"replica {r}: {detail}")
        run.check(name, not problems, "; ".join(problems))

    for dtype, ops in REDUCE_DTYPES.items():
        for op in ops:
            expected = numpy_reduce(op, [hosts[dtype, r] for r in range(n)])
            each_replica(f"all_reduce {op} {dtype}", expected, n)

    for part, shape in (("w", (5, 4)), ("b", (4,))):
        expected = numpy_reduce(
            "sum", [host_data(r, f"nested {part}", "float32", shape) for r in range(n)]
        )
        each_replica(f"nested {part}", expected, n)
    scalars = [float(cp.asnumpy(results[r, "nested scalar"])) for r in range(n)]
    run.check(
        "all_reduce nested python scalar",
        all(abs(s - 1.5 * n) < 1e-9 for s in scalars),
        f"got {scalars}, expected {1.5 * n}",
    )

    for axis in (0, 1):
        shapes = [(r + 1, 3) if axis == 0 else (3, r + 2) for r in range(n)]
        expected = np.concatenate(
            [host_data(r, f"gather {axis}", "float32", shapes[r]) for r in range(n)], axis=axis
        )
        each_replica(f"all_gather axis={axis}", expected, 1)

    for source in sorted({0, n - 1}):
        each_replica(
            f"broadcast from {source}", host_data(source, "broadcast", "float64", SHAPE), 1
        )

    for op in ("sum", "max"):
        scattered = numpy_reduce(
            op, [host_data(r, "scatter", "float32", (3 * n + 1, 4)) for r in range(n)]
        )
        chunks = np.array_split(scattered, n, axis=0)
        problems = []
        for r in range(n):
            ok, detail = same(results[r, f"reduce_scatter {op}"], chunks[r], n)
            if not ok:
                problems.append(f"replica {r}: {detail}")
        run.check(f"reduce_scatter {op}", not problems, "; ".join(problems))

    wrong = [
        f"replica {r} {name}: on GPU {value.device.id}, not {run.replica_gpus[r]}"
        for (r, name), value in results.items()
        if isinstance(value, cp.ndarray) and value.device.id != run.replica_gpus[r]
    ]
    run.check("collective results on their replica's GPU", not wrong, "; ".join(wrong))

    local = strategy.experimental_local_results(returned)
    returned_hosts = [host_data(r, "returned", "float32", SHAPE) for r in range(n)]
    ok, detail = (
        (False, f"{len(local)} local results for {n} replicas")
        if len(local) != n
        else same(local[n - 1], returned_hosts[n - 1], 1)
    )
    run.check("experimental_local_results", ok, detail)
    for op, value in reduced.items():
        ok, detail = same(value, numpy_reduce(op, returned_hosts), n)
        run.check(f"strategy.reduce {op} axis=None", ok, detail)
    uneven_hosts = [host_data(r, "uneven", "float32", (r + 1, 3)) for r in range(n)]
    whole = np.concatenate(uneven_hosts, axis=0)
    for op, expected in (("sum", whole.sum(axis=0)), ("mean", whole.mean(axis=0))):
        ok, detail = same(reduced_along[op], expected.astype(np.float32), whole.shape[0])
        run.check(f"strategy.reduce {op} axis=0 (uneven)", ok, detail)
    run.check(
        "replicas interleaved",
        n == 1 or order != sorted(order),
        "every replica ran to its end before the next one started",
    )
    results.clear()


# -- 2. variables -----------------------------------------------------------------------------

#: name -> (synchronization, aggregation, shape)
VARIABLES: dict[str, tuple[str, str, tuple[int, ...]]] = {
    "mirrored sum": ("auto", "sum", VAR_SHAPE),
    "mirrored mean": ("auto", "mean", VAR_SHAPE),
    "on-read sum": ("on_read", "sum", VAR_SHAPE),
    "on-read mean": ("on_read", "mean", VAR_SHAPE),
    "mirrored 0-d": ("auto", "sum", ()),
}


def variable_data(name: str) -> np.ndarray[Any, Any]:
    """The value named ``name``: a variable's initial value, or one written to it."""
    shape = VARIABLES[name][2] if name in VARIABLES else VAR_SHAPE
    return host_data(0, f"variable {name}", "float32", shape)


def expected_read(name: str, copies: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    """What a cross-replica read of variable ``name`` gives, from the values of its copies."""
    if name.startswith("on-read"):
        return numpy_reduce("sum" if name.endswith("sum") else "mean", copies)
    return copies[0]


def check_variable_values(
    run: LayoutRun, stage: str, variables: dict[str, Any], model: dict[str, list[Any]]
) -> None:
    """Every copy of every variable on its replica's GPU with its expected value, and every
    cross-replica read a user makes: ``numpy()``, ``np.asarray``, ``float`` (0-d), ``repr``."""
    rtol, atol = tolerance(np.float32, run.n)
    for name, variable in variables.items():
        copies = model[name]
        expected = expected_read(name, copies)
        problems = []
        for r, value in enumerate(variable.values):
            problems += misplaced({"copy": value}, r, run.replica_gpus[r])
            ok, detail = same(value, copies[r], run.n)
            if not ok:
                problems.append(f"copy {r}: {detail}")
        reads = {"numpy()": variable.numpy(), "np.asarray(v)": np.asarray(variable)}
        if variable.ndim == 0:
            reads["float(v)"] = np.asarray(np.float32(float(variable)))
        for how, host in reads.items():
            ok, detail = compare(host, expected, rtol, atol)
            if not ok:
                problems.append(f"{how}: {detail}")
        shown = repr(variable)
        if f"value={reads['numpy()']!r}" not in shown:
            problems.append(f"repr(v) is {shown!r}, expected value={reads['numpy()']!r}")
        run.check(f"variables, {stage}: {name}", not problems, "; ".join(problems))


async def check_variables(run: LayoutRun) -> None:
    import aioreplica

    strategy, n, gpus = run.strategy, run.n, run.replica_gpus
    # CuPy arrays made outside any step, as a user makes them: on the legacy default stream of
    # the current GPU, still being computed (the slow chain) when the variables copy them.
    with cp.cuda.Device(gpus[0]):
        made_mean = slow(cp.asarray(variable_data("mirrored mean")))
        made_scalar = slow(cp.asarray(variable_data("mirrored 0-d")))
    with cp.cuda.Device(gpus[-1]):
        made_on_read = slow(cp.asarray(variable_data("on-read mean")))
    initial = {
        "mirrored sum": variable_data("mirrored sum"),
        "mirrored mean": made_mean,
        "on-read sum": variable_data("on-read sum"),
        "on-read mean": made_on_read,
        "mirrored 0-d": made_scalar,
    }
    with strategy.scope():
        variables = {
            name: aioreplica.Variable(
                initial[name],
                name=name,
                synchronization=VARIABLES[name][0],
                aggregation=VARIABLES[name][1],
            )
            for name in VARIABLES
        }
    del made_mean, made_scalar, made_on_read, initial  # the pool may hand the memory out again
    model = {name: [variable_data(name)] * n for name in VARIABLES}
    check_variable_values(run, "made in scope()", variables, model)

    async def write_step() -> dict[str, Any]:
        here("variables")
        await checked(
            "mirrored assign_add",
            variables["mirrored sum"].assign_add(replica_data("write mirrored sum", VAR_SHAPE)),
        )
        await checked(
            "mirrored assign",
            variables["mirrored mean"].assign(replica_data("write mirrored mean", VAR_SHAPE)),
        )
        await checked(
            "on-read assign_add",
            variables["on-read sum"].assign_add(replica_data("write on-read sum", VAR_SHAPE)),
        )
        await checked(
            "on-read assign",
            variables["on-read mean"].assign(replica_data("write on-read mean", VAR_SHAPE)),
        )
        await checked(
            "0-d assign_add",
            variables["mirrored 0-d"].assign_add(replica_data("write mirrored 0-d", ())),
        )
        # Replica-context reads: this replica's copy, on its device.
        return {name: variable.value() * 1 for name, variable in variables.items()}

    seen = await run_step(strategy, write_step)

    def written(name: str) -> list[np.ndarray[Any, Any]]:
        return [host_data(r, f"write {name}", "float32", VARIABLES[name][2]) for r in range(n)]

    model["mirrored sum"] = [as_float32(model["mirrored sum"][0] + sum(written("mirrored sum")))]
    model["mirrored mean"] = [numpy_reduce("mean", written("mirrored mean"))]
    model["mirrored 0-d"] = [as_float32(model["mirrored 0-d"][0] + sum(written("mirrored 0-d")))]
    for name in ("mirrored sum", "mirrored mean", "mirrored 0-d"):
        model[name] = model[name] * n
    model["on-read sum"] = [
        as_float32(old + new)
        for old, new in zip(model["on-read sum"], written("on-read sum"), strict=True)
    ]
    model["on-read mean"] = written("on-read mean")

    problems = []
    for r in range(n):
        values = aioreplica.select_replica(r, seen)
        problems += misplaced(values, r, gpus[r])
        for name, value in values.items():
            ok, detail = same(value, model[name][r], n)
            if not ok:
                problems.append(f"replica {r} {name}: {detail}")
    run.check("variables, replica-context reads after writes", not problems, "; ".join(problems))
    del seen
    check_variable_values(run, "written in replica context", variables, model)

    # Cross-replica writes, from CuPy arrays made outside a step and from NumPy values.
    with cp.cuda.Device(gpus[0]):
        added = slow(cp.asarray(variable_data("cross add")))
    with cp.cuda.Device(gpus[-1]):
        added_on_read = slow(cp.asarray(variable_data("cross on-read add")))
    await variables["mirrored sum"].assign_add(added)
    await variables["mirrored mean"].assign(variable_data("cross assign"))
    await variables["on-read sum"].assign(variable_data("cross on-read assign"))
    await variables["on-read mean"].assign_add(added_on_read)
    await variables["mirrored 0-d"].assign(2.5)
    del added, added_on_read
    model["mirrored sum"] = [as_float32(model["mirrored sum"][0] + variable_data("cross add"))] * n
    model["mirrored mean"] = [variable_data("cross assign")] * n
    # A sync-on-read SUM variable assigned across replicas: each copy gets value / n.
    model["on-read sum"] = [as_float32(variable_data("cross on-read assign") / n)] * n
    model["on-read mean"] = [
        as_float32(old + variable_data("cross on-read add")) for old in model["on-read mean"]
    ]
    model["mirrored 0-d"] = [np.asarray(np.float32(2.5))] * n
    check_variable_values(run, "written in cross-replica context", variables, model)

    # Cross-replica reads of the sync-on-read variables kept on the device (no host wait), then
    # replica-context writes that drop the copies those reads use: each copy's stream must wait
    # for the read before its memory is handed out again.
    on_read = ("on-read sum", "on-read mean")
    held = {name: variables[name].value() for name in on_read}
    expected_held = {name: expected_read(name, model[name]) for name in on_read}

    async def add_step(round_: int) -> None:
        for name in on_read:
            value = replica_data(f"add {name} {round_}", VAR_SHAPE)
            await checked(f"{name} assign_add", variables[name].assign_add(value))

    for round_ in range(2):
        await run_step(strategy, add_step, round_)
        for name in on_read:
            model[name] = [
                as_float32(old + host_data(r, f"add {name} {round_}", "float32", VAR_SHAPE))
                for r, old in enumerate(model[name])
            ]
    problems = []
    for name, value in held.items():
        problems += misplaced({name: value}, 0, gpus[0])
        ok, detail = same(value, expected_held[name], n)
        if not ok:
            problems.append(f"{name}: {detail}")
    del held
    run.check(
        "variables, cross-replica reads held on the GPU across later writes",
        not problems,
        "; ".join(problems),
    )
    check_variable_values(run, "written again after cross-replica reads", variables, model)


# -- 3. an optimizer step ---------------------------------------------------------------------


def sgd_reference(
    weight: np.ndarray[Any, Any], grads: list[np.ndarray[Any, Any]], rate: float, momentum: float
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Keras' SGD with momentum over ``grads`` (one summed gradient per step), in float64."""
    w = weight.astype(np.float64)
    m = np.zeros_like(w)
    for g in grads:
        m = momentum * m - rate * g
        w = w + m
    return w, m


def adam_reference(
    weight: np.ndarray[Any, Any], grads: list[np.ndarray[Any, Any]], rate: float
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Keras' Adam (default betas and epsilon of ``aioreplica.optimizers.Adam``), in float64."""
    beta_1, beta_2, epsilon = 0.9, 0.999, 1e-7
    w = weight.astype(np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for step, g in enumerate(grads):
        t = step + 1
        alpha = rate * math.sqrt(1.0 - beta_2**t) / (1.0 - beta_1**t)
        m = m + (g - m) * (1.0 - beta_1)
        v = v + (g * g - v) * (1.0 - beta_2)
        w = w - m * alpha / (np.sqrt(v) + epsilon)
    return w, m, v


def check_variable_copies(
    run: LayoutRun, name: str, variable: Any, expected: np.ndarray[Any, Any]
) -> list[str]:
    """Problems with ``variable``: a copy off its GPU or off ``expected``, or ``numpy()``."""
    rtol, atol = OPT_TOLERANCE
    want = as_float32(expected)
    problems = []
    for r, value in enumerate(variable.values):
        problems += misplaced({name: value}, r, run.replica_gpus[r])
        ok, detail = compare(np.asarray(cp.asnumpy(value)), want, rtol, atol)
        if not ok:
            problems.append(f"{name} copy {r}: {detail}")
    ok, detail = compare(variable.numpy(), want, rtol, atol)
    if not ok:
        problems.append(f"{name}.numpy(): {detail}")
    return problems


async def check_optimizer(run: LayoutRun) -> None:
    import aioreplica

    strategy, n = run.strategy, run.n
    m, k = OPT_SHAPE
    steps = 2
    sgd_rate, sgd_momentum, adam_rate = 0.1, 0.9, 0.05
    start = {
        name: host_data(0, f"optimizer {name}", "float32", shape)
        for name, shape in (("sgd w", (m, k)), ("sgd b", (k,)), ("adam w", (m, k)))
    }
    start["adam b"] = host_data(0, "optimizer adam b", "float32", (k,))
    with strategy.scope():
        variables = {name: aioreplica.Variable(value, name=name) for name, value in start.items()}
    sgd = aioreplica.optimizers.SGD(sgd_rate, momentum=sgd_momentum)
    adam = aioreplica.optimizers.Adam(adam_rate)

    async def train_step(step: int) -> None:
        # Non-contiguous gradients: the transpose of a (k, m) array, and a strided slice.
        g = replica_data(f"gradient sgd w {step}", (k, m))
        gb = replica_data(f"gradient sgd b {step}", (k,))
        await checked(
            "SGD apply_gradients",
            sgd.apply_gradients([(g.T, variables["sgd w"]), (gb, variables["sgd b"])]),
        )
        g = replica_data(f"gradient adam w {step}", (k, m))
        gb = replica_data(f"gradient adam b {step}", (2 * k,))
        await checked(
            "Adam apply_gradients",
            adam.apply_gradients([(g.T, variables["adam w"]), (gb[::2], variables["adam b"])]),
        )

    for step in range(steps):
        await run_step(strategy, train_step, step)

    def summed(name: str, shape: tuple[int, ...], view: Callable[[Any], Any]) -> list[Any]:
        return [
            sum(
                view(host_data(r, f"gradient {name} {step}", "float32", shape)).astype(np.float64)
                for r in range(n)
            )
            for step in range(steps)
        ]

    def transposed(x: Any) -> Any:
        return x.T

    def every_other(x: Any) -> Any:
        return x[::2]

    def unchanged(x: Any) -> Any:
        return x

    grads = {
        "sgd w": summed("sgd w", (k, m), transposed),
        "sgd b": summed("sgd b", (k,), unchanged),
        "adam w": summed("adam w", (k, m), transposed),
        "adam b": summed("adam b", (2 * k,), every_other),
    }
    problems = []
    for name in ("sgd w", "sgd b"):
        weight, momentum = sgd_reference(start[name], grads[name], sgd_rate, sgd_momentum)
        problems += check_variable_copies(run, name, variables[name], weight)
        slot = sgd.get_slot(variables[name], "momentum")
        problems += check_variable_copies(run, f"{name} momentum", slot, momentum)
    if sgd.iterations != steps:
        problems.append(f"SGD iterations {sgd.iterations}, expected {steps}")
    run.check(
        "optimizer SGD (momentum) apply_gradients, g.T gradient", not problems, "; ".join(problems)
    )

    problems = []
    for name in ("adam w", "adam b"):
        weight, first, second = adam_reference(start[name], grads[name], adam_rate)
        problems += check_variable_copies(run, name, variables[name], weight)
        problems += check_variable_copies(
            run, f"{name} m", adam.get_slot(variables[name], "m"), first
        )
        problems += check_variable_copies(
            run, f"{name} v", adam.get_slot(variables[name], "v"), second
        )
    if adam.iterations != steps:
        problems.append(f"Adam iterations {adam.iterations}, expected {steps}")
    run.check(
        "optimizer Adam apply_gradients, g.T and strided gradients",
        not problems,
        "; ".join(problems),
    )


# -- 4. a checkpoint round trip ---------------------------------------------------------------


async def check_checkpoint(run: LayoutRun) -> None:
    import aioreplica

    strategy, n = run.strategy, run.n
    with strategy.scope():
        weight = aioreplica.Variable(
            host_data(0, "checkpoint w", "float32", (4, 3)), name="checkpoint w"
        )
        total = aioreplica.Variable(
            np.zeros(3, np.float32), synchronization="on_read", aggregation="sum", name="total"
        )
    sgd = aioreplica.optimizers.SGD(0.1, momentum=0.5)

    async def train_step(step: int) -> None:
        gradient = replica_data(f"checkpoint gradient {step}", (3, 4))
        await checked("apply_gradients", sgd.apply_gradients([(gradient.T, weight)]))
        # Each replica adds its own counts: the copies of the sync-on-read variable differ.
        await checked(
            "assign_add", total.assign_add(replica_data(f"checkpoint count {step}", (3,)))
        )

    await run_step(strategy, train_step, 0)
    momentum = sgd.get_slot(weight, "momentum")
    saved = {"w": weight.numpy(), "total": total.numpy(), "momentum": momentum.numpy()}
    checkpoint = aioreplica.Checkpoint(model={"w": weight, "total": total}, optimizer=sgd, epoch=1)
    problems = []
    with tempfile.TemporaryDirectory() as directory:
        path = await checkpoint.save(Path(directory) / "checkpoint.npz")
        await run_step(strategy, train_step, 1)
        await weight.assign(np.zeros((4, 3), np.float32))
        checkpoint.epoch = 7
        if np.array_equal(weight.numpy(), saved["w"]) or np.allclose(total.numpy(), saved["total"]):
            problems.append("the values did not change between save and restore")
        restored = await checkpoint.restore(path)
    if not restored.complete:
        problems.append(f"restore report: {restored}")
    if sgd.iterations != 1 or checkpoint.epoch != 1:
        problems.append(f"iterations {sgd.iterations}, epoch {checkpoint.epoch}: expected 1, 1")
    rtol, atol = tolerance(np.float32, n)
    for name, variable, copies in (
        ("w", weight, [saved["w"]] * n),
        ("momentum", momentum, [saved["momentum"]] * n),
        # A sync-on-read SUM variable saves its sum and restores value / n into each copy.
        ("total", total, [as_float32(saved["total"] / n)] * n),
    ):
        for r, value in enumerate(variable.values):
            problems += misplaced({name: value}, r, run.replica_gpus[r])
            ok, detail = compare(np.asarray(cp.asnumpy(value)), copies[r], rtol, atol)
            if not ok:
                problems.append(f"{name} copy {r}: {detail}")
        ok, detail = compare(variable.numpy(), saved[name], rtol, atol)
        if not ok:
            problems.append(f"{name}.numpy(): {detail}")
    run.check("checkpoint save, change, restore: values back", not problems, "; ".join(problems))


# -- 5. non-contiguous leaves -----------------------------------------------------------------


def noncontiguous_leaves(replica: int, make: Callable[[str, tuple[int, ...]], Any]) -> Any:
    """A nested structure of small leaves, two of them views that are not contiguous."""
    return {
        "transposed": make("transposed", (4, 6)).T,
        "strided": make("strided", (5, 8))[:, ::2],
        "small": [make("small a", (3,)), make("small b", (2, 2))],
        "scalar": 0.25 * (replica + 1),
    }


async def noncontiguous_step() -> Any:
    import aioreplica

    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    replica = ctx.replica_id_in_sync_group
    leaves = noncontiguous_leaves(replica, lambda name, shape: replica_data(f"leaf {name}", shape))
    total = await checked("all_reduce non-contiguous", ctx.all_reduce("sum", leaves))
    mean = await checked("all_reduce non-contiguous mean", ctx.all_reduce("mean", leaves))
    return total, mean


async def check_noncontiguous(run: LayoutRun) -> None:
    import aioreplica

    n = run.n
    result = await run_step(run.strategy, noncontiguous_step)

    def host_leaves(replica: int) -> list[Any]:
        def make(name: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
            return host_data(replica, f"leaf {name}", "float32", shape)

        return list(aioreplica.nest.flatten(noncontiguous_leaves(replica, make)))

    hosts = [host_leaves(r) for r in range(n)]
    names = ["scalar", "small a", "small b", "strided", "transposed"]  # nest's sorted key order
    problems = []
    for r in range(n):
        total, mean = aioreplica.select_replica(r, result)
        for op, got in (("sum", total), ("mean", mean)):
            flat = aioreplica.nest.flatten(got)
            for position, name in enumerate(names):
                value = flat[position]
                inputs = [hosts[q][position] for q in range(n)]
                if name == "scalar":
                    expected = float(np.sum(inputs)) / (n if op == "mean" else 1)
                    if not math.isclose(float(cp.asnumpy(value)), expected, rel_tol=1e-9):
                        problems.append(f"replica {r} {op} {name}: {value}, expected {expected}")
                    continue
                problems += misplaced({f"{op} {name}": value}, r, run.replica_gpus[r])
                ok, detail = same(value, numpy_reduce(op, [np.asarray(x) for x in inputs]), n)
                if not ok:
                    problems.append(f"replica {r} {op} {name}: {detail}")
    run.check(
        "all_reduce of a .T and an x[:, ::2] among packed small leaves",
        not problems,
        "; ".join(problems),
    )


# -- 6. memory reuse --------------------------------------------------------------------------


async def check_pool_reuse(run: LayoutRun) -> None:
    import aioreplica

    strategy, n = run.strategy, run.n
    with strategy.scope():
        counter = aioreplica.Variable(np.zeros(SHAPE, np.float32), aggregation="sum", name="count")

    async def reuse_step(round_: int) -> Any:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        x = replica_data(f"reuse {round_}", SHAPE)
        total = await checked("all_reduce (reuse)", ctx.all_reduce("sum", x))
        gathered = await checked("all_gather (reuse)", ctx.all_gather(x[:2], axis=0))
        await checked("assign_add (reuse)", counter.assign_add(x))
        own = x * 1
        del x  # dropped here: its block may be handed out again at once
        return total, gathered, own

    problems = []
    expected_count = np.zeros(SHAPE, np.float64)
    for round_ in range(POOL_ROUNDS):
        result = await run_step(strategy, reuse_step, round_)
        inputs = [host_data(r, f"reuse {round_}", "float32", SHAPE) for r in range(n)]
        expected_count += sum(x.astype(np.float64) for x in inputs)
        reduced = await strategy.reduce("sum", result[2], axis=None)
        for r in range(n):
            total, gathered, _ = aioreplica.select_replica(r, result)
            for what, value, expected in (
                ("all_reduce", total, numpy_reduce("sum", inputs)),
                ("all_gather", gathered, np.concatenate([x[:2] for x in inputs])),
            ):
                ok, detail = same(value, expected, n)
                if not ok:
                    problems.append(f"round {round_} replica {r} {what}: {detail}")
        ok, detail = same(reduced, numpy_reduce("sum", inputs), n)
        if not ok:
            problems.append(f"round {round_} strategy.reduce: {detail}")
        ok, detail = compare(counter.numpy(), as_float32(expected_count), *tolerance(np.float32, n))
        if not ok:
            problems.append(f"round {round_} variable: {detail}")
        del result, reduced  # every result dropped before the next round
    run.check(
        f"{POOL_ROUNDS} rounds of the same step, results dropped each round",
        not problems,
        "; ".join(problems),
    )


# -- checking one layout ----------------------------------------------------------------------


def parts() -> list[tuple[str, Callable[[LayoutRun], Awaitable[None]]]]:
    """What ``check_layout`` runs, in order (looked up on each call)."""
    return [
        ("collectives", check_collectives),
        ("variables", check_variables),
        ("optimizer", check_optimizer),
        ("checkpoint", check_checkpoint),
        ("non-contiguous leaves", check_noncontiguous),
        ("memory reuse", check_pool_reuse),
    ]


async def check_layout(report: Report, layout: Layout) -> None:
    import aioreplica

    strategy: Any = aioreplica.MirroredStrategy(layout.devices)
    run = LayoutRun(
        report, layout.label, strategy, [d.index for d in strategy.extended.replica_devices]
    )
    WATCH.reset()
    for name, part in parts():
        try:
            await part(run)
        except Exception:
            run.check(f"{name} ran to the end", False, traceback.format_exc())

    run.check(
        "invariant 1: own device and stream at every await",
        not WATCH.wrong_context,
        "; ".join(WATCH.wrong_context[:5]),
    )
    run.check(
        "invariant 4: no host synchronization on the loop thread in a step (wrapped entry points)",
        not WATCH.host_syncs,
        ", ".join(sorted(set(WATCH.host_syncs))),
    )
    if getattr(cupyx, "allow_synchronize", None) is not None:
        run.check(
            "invariant 4: no host synchronization on the loop thread in a step "
            "(cupyx.allow_synchronize(False))",
            not WATCH.sync_errors,
            "; ".join(WATCH.sync_errors[:5]),
        )
    print(
        f"INFO [{layout.label}] longest event-loop pause during steps: "
        f"{WATCH.longest_pause * 1e3:.1f} ms (heartbeat every {HEARTBEAT_S * 1e3:g} ms)",
        flush=True,
    )
    sim = getattr(cp, "_sim", None)
    if sim is not None:
        races = list(sim.world().races)
        sim.world().races.clear()
        run.check("no data race recorded by the stand-in", not races, "\n".join(races[:5]))


async def check_layout_within(report: Report, layout: Layout, limit: float) -> None:
    """``check_layout`` under ``anyio.fail_after(limit)``: a FAIL line naming it if late."""
    try:
        with anyio.fail_after(limit):
            await check_layout(report, layout)
    except TimeoutError:
        report.check(
            f"[{layout.label}] finished within {limit:g} s",
            False,
            "timed out (a hang, or a GPU much slower than expected); the next layout runs",
        )


async def check_missing_nccl(report: Report, gpus: int) -> None:
    """Without NCCL a collective across GPUs must fail with an error that says so."""
    import aioreplica

    strategy: Any = aioreplica.MirroredStrategy([f"gpu:{i}" for i in range(gpus)])

    async def step() -> Any:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        return await ctx.all_reduce("sum", ctx.device.asarray(np.ones(3, np.float32)))

    name = "[no NCCL] a collective across GPUs raises an error naming NCCL"
    try:
        await run_step(strategy, step)
    except RuntimeError as exc:
        report.check(name, "NCCL" in str(exc), f"the error does not name NCCL: {exc!r}")
    except Exception:
        report.check(name, False, traceback.format_exc())
    else:
        report.check(name, False, "the collective returned without NCCL")


# -- the smoke test ---------------------------------------------------------------------------


async def smoke_one(index: int) -> Any:
    """A small kernel on ``gpu:<index>``'s stream, then ``synchronize()``, bounded."""
    from aioreplica._backends._cupy import cuda_device

    device = cuda_device(index)
    x = device.asarray(np.arange(8, dtype=np.float32))
    y = await device.run(operator.mul, x, 2)
    with anyio.fail_after(SMOKE_TIMEOUT):
        await device.synchronize()
    return y


def smoke_test(report: Report, gpus: int) -> bool:
    """On each GPU, a small kernel and one ``synchronize()`` under ``SMOKE_TIMEOUT``; whether
    to go on (a hang there means a broken driver: nothing else would finish either)."""
    for index in range(gpus):
        name = f"[smoke] gpu:{index} synchronize() after a small kernel, within {SMOKE_TIMEOUT:g} s"
        try:
            y = anyio.run(smoke_one, index, backend="asyncio")
        except TimeoutError:
            report.check(
                name,
                False,
                "it hung: the stream callback never came and the event never completed; "
                "check the driver (nvidia-smi) first",
            )
            return False
        except Exception:
            report.check(name, False, traceback.format_exc())
            return False
        ok, detail = same(y, np.arange(8, dtype=np.float32) * 2, 1)
        report.check(name, ok, detail)
    return True


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global cp, cupyx, slow_size
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--loop",
        choices=("asyncio", "trio", "all"),
        default="all",
        help="event loop(s) to run on (default: asyncio, and trio if installed)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_SLOW_SIZE} x {QUICK_SLOW_SIZE} matrices in the slow chains instead of "
        f"{SLOW_SIZE} x {SLOW_SIZE} (always on against the CPU stand-in of CuPy)",
    )
    parser.add_argument(
        "--layout-timeout",
        type=float,
        default=LAYOUT_TIMEOUT,
        help=f"seconds each layout may take (default {LAYOUT_TIMEOUT:g})",
    )
    args = parser.parse_args(argv)
    try:
        import cupy
    except ImportError as exc:
        print(f"SKIP: CuPy is not importable ({exc}); this check needs a CUDA machine")
        return 2
    cp = cupy
    try:
        cupyx = importlib.import_module("cupyx")
    except ImportError:
        cupyx = None
    from aioreplica._backends._cupy import visible_device_count

    gpus = visible_device_count()
    if gpus == 0:
        print("SKIP: CuPy sees no CUDA device; this check needs a CUDA machine")
        return 2
    simulated = hasattr(cupy, "_sim")
    quick = args.quick or simulated
    slow_size = QUICK_SLOW_SIZE if quick else SLOW_SIZE
    print(
        f"CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
        f"{gpus} GPU(s): "
        + ", ".join(cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(gpus)),
        flush=True,
    )
    if simulated:
        print("the CPU stand-in of CuPy (tests/cupy_sim): its race detector checks the order")
    print(f"slow chains: {SLOW_PRODUCTS} products of {slow_size} x {slow_size} float32")
    watched, unwatched = install_host_sync_watch()
    print(f"host-sync watch on: {', '.join(watched)}")
    if unwatched:
        print(f"not watchable (not wrapped): {', '.join(unwatched)}")
    if getattr(cupyx, "allow_synchronize", None) is None:
        print("cupyx.allow_synchronize is not available: steps run without it")

    loops = ["asyncio", "trio"] if args.loop == "all" else [args.loop]
    if "trio" in loops:
        try:
            import trio  # noqa: F401
        except ImportError:
            if args.loop == "trio":
                print("SKIP: trio is not installed")
                return 2
            loops.remove("trio")
            print("trio is not installed: asyncio only")

    report = Report()
    started = time.perf_counter()
    if not smoke_test(report, gpus):
        print(report.summary(time.perf_counter() - started))
        return 1
    nccl = gpus == 1 or nccl_available()
    for loop in loops:
        if gpus == 1:
            layouts = single_gpu_layouts()
        elif nccl:
            layouts = multi_gpu_layouts(gpus)
        else:
            for layout in multi_gpu_layouts(gpus):
                report.skip(
                    f"[{layout.label}, {loop}]",
                    "collectives across GPUs need NCCL, which CuPy cannot load here; the "
                    "layouts on gpu:0 run instead",
                )
            anyio.run(check_missing_nccl, report, gpus, backend=loop)
            layouts = single_gpu_layouts()
        for layout in layouts:
            layout.label = f"{layout.label}, {loop}"
            try:
                anyio.run(check_layout_within, report, layout, args.layout_timeout, backend=loop)
            except Exception:
                report.check(f"[{layout.label}] ran to the end", False, traceback.format_exc())
    print(report.summary(time.perf_counter() - started))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
