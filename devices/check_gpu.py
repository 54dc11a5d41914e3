"""GPU conformance check: aioreplica's collectives on CuPy arrays against NumPy, on real GPUs.

Runs only on a machine with CUDA and CuPy. For each replica layout:

- one replica per visible GPU (``MirroredStrategy(["gpu:0", ...])``);
- with one GPU, 2 and 4 replicas sharing it; with several, 2 replicas on each GPU. A strategy
  gives each replica its own device name, so these extra replicas are devices that wrap a
  ``CudaDevice`` of their own (their own stream) under names ``gpu:<i>.<k>``,

and on each event loop available (asyncio, and trio when it is installed), it checks:

1. every collective against the same computation in NumPy: ``ctx.all_reduce`` for each op and
   several dtypes (plain arrays, a nested structure, scalars), ``ctx.all_gather`` with uneven
   lengths along axis 0 and 1, ``ctx.broadcast`` from the first and the last replica,
   ``ctx.reduce_scatter``, ``ctx.barrier``, and ``strategy.reduce`` with and without ``axis``
   (tolerances by dtype; integers exact). Each input comes out of a slow chain of matrix
   products on its replica's stream, so a collective that is not ordered after the replica's
   stream reads unfinished data and fails the comparison instead of passing by luck;
2. that every result lives on its replica's GPU;
3. invariant 1: at every await inside the step (before and after), with replicas interleaving,
   the current CUDA device and the current CuPy stream are the replica's own, and
   ``device.run`` runs its function with them current;
4. invariant 4: no host synchronization on the event loop thread during a step. The
   Python-level entry points that block the host (``Stream.synchronize``,
   ``Event.synchronize``, ``Device.synchronize``, the runtime's ``deviceSynchronize``,
   ``streamSynchronize`` and ``eventSynchronize``, ``cupy.asnumpy``) are wrapped to record
   calls made from the loop thread while a step runs; entry points CuPy does not let us wrap
   (Cython types) are listed as not watched. Calls from compiled CuPy code, and the implicit
   syncs of ``ndarray.get()``, cannot be seen this way.

Prints one line per check, ``PASS`` or ``FAIL`` with the difference, and a summary. Exit status:
0 when every check passes, 1 when one fails, 2 when there is no CuPy or no CUDA device.

Run from the repository root::

    PYTHONPATH=. python devices/check_gpu.py
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import numpy as np

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from types import ModuleType

cp: Any = None  # the cupy module, imported in main()

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
SLOW_SIZE = 1024
SLOW_PRODUCTS = 8


# -- results --------------------------------------------------------------------------------


@dataclass
class Report:
    passed: int = 0
    failed: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        if ok:
            self.passed += 1
            print(f"PASS {name}", flush=True)
        else:
            self.failed.append(name)
            print(f"FAIL {name}: {detail}", flush=True)


# -- devices for several replicas on one GPU -----------------------------------------------


class ExtraReplicaDevice:
    """A further replica on a GPU: its own ``CudaDevice`` (own stream), its own name."""

    kind = "gpu"
    has_context = True

    def __init__(self, index: int, slot: int) -> None:
        from aioreplica._backends._cupy import CudaDevice

        self._inner = CudaDevice(index)
        self.name = f"gpu:{index}.{slot}"
        self.index = index
        self.enter = self._inner.enter
        self.leave = self._inner.leave
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

    async def synchronize(self) -> None:
        await self._inner.synchronize()

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await self._inner.run(fn, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<ExtraReplicaDevice {self.name}>"


def layouts(gpus: int) -> dict[str, list[Any]]:
    """Replica layouts: device names for a strategy, or device objects for extra replicas."""
    from aioreplica._backends._cupy import cuda_device

    result: dict[str, list[Any]] = {
        f"{gpus} replica(s), one per GPU": [f"gpu:{i}" for i in range(gpus)]
    }
    if gpus == 1:
        for count in (2, 4):
            result[f"{count} replicas on gpu:0"] = [cuda_device(0)] + [
                ExtraReplicaDevice(0, k) for k in range(1, count)
            ]
    else:
        result[f"{2 * gpus} replicas, 2 per GPU"] = [
            device for i in range(gpus) for device in (cuda_device(i), ExtraReplicaDevice(i, 1))
        ]
    return result


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


def same(got: Any, expected: np.ndarray[Any, Any], replicas: int) -> tuple[bool, str]:
    host = np.asarray(cp.asnumpy(got))
    if host.shape != expected.shape:
        return False, f"shape {host.shape}, expected {expected.shape}"
    if host.dtype != expected.dtype:
        return False, f"dtype {host.dtype}, expected {expected.dtype}"
    rtol, atol = tolerance(expected.dtype, replicas)
    if expected.dtype.kind in "fc":
        ok = bool(np.allclose(host, expected, rtol=rtol, atol=atol))
    else:
        ok = bool(np.array_equal(host, expected))
    if ok:
        return True, ""
    diff = np.abs(host.astype(np.float64) - expected.astype(np.float64))
    return False, f"max abs difference {diff.max():.3g} (rtol {rtol}, atol {atol})"


# -- what a step observes ---------------------------------------------------------------------


@dataclass
class Watch:
    """What replicas saw during a step; filled from inside the steps."""

    loop_thread: int = 0
    stepping: bool = False
    trace: list[tuple[int, str]] = field(default_factory=list)
    wrong_context: list[str] = field(default_factory=list)
    host_syncs: list[str] = field(default_factory=list)
    results: dict[tuple[int, str], Any] = field(default_factory=dict)


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
    here(f"before {label}")
    value = await awaitable
    here(f"after {label}")
    return value


def slow(x: Any) -> Any:
    """``x`` unchanged, but only once a chain of matrix products on the current stream is done."""
    a = cp.full((SLOW_SIZE, SLOW_SIZE), 1.0 / SLOW_SIZE, dtype=cp.float32)
    for _ in range(SLOW_PRODUCTS):
        a = a @ a  # stays 1/SLOW_SIZE everywhere: finite, and times zero is zero
    zero = (a[0, 0] * 0).astype(x.dtype)
    return x + zero if x.dtype != cp.bool_ else x | zero


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

        def wrapper(*args: Any, _original: Any = original, _name: str = name, **kw: Any) -> Any:
            if WATCH.stepping and threading.get_ident() == WATCH.loop_thread:
                WATCH.host_syncs.append(_name)
            return _original(*args, **kw)

        try:
            setattr(owner, attribute, wrapper)
        except (AttributeError, TypeError):
            unwatched.append(name)
        else:
            watched.append(name)
    return watched, unwatched


# -- the step ---------------------------------------------------------------------------------


async def step() -> Any:
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
        x = slow(device.asarray(host_data(replica, "reduce", dtype, SHAPE)))
        for op in ops:
            results[replica, f"all_reduce {op} {dtype}"] = await checked(
                f"all_reduce {op} {dtype}", ctx.all_reduce(op, x)
            )

    nested = {
        "w": slow(device.asarray(host_data(replica, "nested w", "float32", (5, 4)))),
        "b": [slow(device.asarray(host_data(replica, "nested b", "float32", (4,)))), 1.5],
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
        x = slow(device.asarray(host_data(replica, f"gather {axis}", "float32", shape)))
        results[replica, f"all_gather axis={axis}"] = await checked(
            f"all_gather axis={axis}", ctx.all_gather(x, axis=axis)
        )

    for source in sorted({0, n - 1}):
        x = slow(device.asarray(host_data(replica, "broadcast", "float64", SHAPE)))
        results[replica, f"broadcast from {source}"] = await checked(
            f"broadcast from {source}", ctx.broadcast(x, source_replica=source)
        )

    for op in ("sum", "max"):
        x = slow(device.asarray(host_data(replica, "scatter", "float32", (3 * n + 1, 4))))
        results[replica, f"reduce_scatter {op}"] = await checked(
            f"reduce_scatter {op}", ctx.reduce_scatter(op, x, axis=0)
        )

    await checked("barrier", ctx.barrier())
    for _ in range(2 - replica % 2):
        await checked("checkpoint again", anyio.lowlevel.checkpoint())
    await checked("synchronize again", device.synchronize())
    here("end")
    return slow(device.asarray(host_data(replica, "returned", "float32", SHAPE)))


async def uneven_step() -> Any:
    import aioreplica

    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    replica = ctx.replica_id_in_sync_group
    here("uneven")
    return slow(ctx.device.asarray(host_data(replica, "uneven", "float32", (replica + 1, 3))))


# -- checking one layout ----------------------------------------------------------------------


async def check_layout(report: Report, label: str, devices: list[Any]) -> None:
    import aioreplica

    strategy: Any = aioreplica.MirroredStrategy(devices)
    n = strategy.num_replicas_in_sync
    WATCH.trace.clear()
    WATCH.wrong_context.clear()
    WATCH.host_syncs.clear()
    WATCH.results.clear()
    WATCH.loop_thread = threading.get_ident()

    WATCH.stepping = True
    try:
        returned = await strategy.run(step)
        uneven = await strategy.run(uneven_step)
    finally:
        WATCH.stepping = False
    # No synchronization before strategy.reduce: it must order itself after the replicas.
    reduced = {op: await strategy.reduce(op, returned, axis=None) for op in ("sum", "mean", "max")}
    reduced_along = {op: await strategy.reduce(op, uneven, axis=0) for op in ("sum", "mean")}
    # Before reading anything on the host (cupy.asnumpy copies on the default stream, which
    # is not ordered with the replicas' non-blocking streams), let every stream finish.
    for device in strategy.extended.replica_devices:
        await device.synchronize()
    cp.cuda.runtime.deviceSynchronize()

    results = WATCH.results
    hosts = {
        (dtype, r): host_data(r, "reduce", dtype, SHAPE)
        for dtype in REDUCE_DTYPES
        for r in range(n)
    }
    replica_gpus = [d.index for d in strategy.extended.replica_devices]

    for dtype, ops in REDUCE_DTYPES.items():
        for op in ops:
            name = f"all_reduce {op} {dtype}"
            expected = numpy_reduce(op, [hosts[dtype, r] for r in range(n)])
            problems = []
            for r in range(n):
                ok, detail = same(results[r, name], expected, n)
                if not ok:
                    problems.append(f"replica {r}: {detail}")
            report.check(f"[{label}] {name}", not problems, "; ".join(problems))

    for part, shape in (("w", (5, 4)), ("b", (4,))):
        expected = numpy_reduce(
            "sum", [host_data(r, f"nested {part}", "float32", shape) for r in range(n)]
        )
        problems = []
        for r in range(n):
            ok, detail = same(results[r, f"nested {part}"], expected, n)
            if not ok:
                problems.append(f"replica {r}: {detail}")
        report.check(f"[{label}] all_reduce nested {part}", not problems, "; ".join(problems))
    scalars = [float(cp.asnumpy(results[r, "nested scalar"])) for r in range(n)]
    report.check(
        f"[{label}] all_reduce nested python scalar",
        all(abs(s - 1.5 * n) < 1e-9 for s in scalars),
        f"got {scalars}, expected {1.5 * n}",
    )

    for axis in (0, 1):
        shapes = [(r + 1, 3) if axis == 0 else (3, r + 2) for r in range(n)]
        expected = np.concatenate(
            [host_data(r, f"gather {axis}", "float32", shapes[r]) for r in range(n)], axis=axis
        )
        problems = []
        for r in range(n):
            ok, detail = same(results[r, f"all_gather axis={axis}"], expected, 1)
            if not ok:
                problems.append(f"replica {r}: {detail}")
        report.check(f"[{label}] all_gather uneven axis={axis}", not problems, "; ".join(problems))

    for source in sorted({0, n - 1}):
        expected = host_data(source, "broadcast", "float64", SHAPE)
        problems = []
        for r in range(n):
            ok, detail = same(results[r, f"broadcast from {source}"], expected, 1)
            if not ok:
                problems.append(f"replica {r}: {detail}")
        report.check(f"[{label}] broadcast from {source}", not problems, "; ".join(problems))

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
        report.check(f"[{label}] reduce_scatter {op}", not problems, "; ".join(problems))

    misplaced = [
        f"replica {r} {name}: on GPU {value.device.id}, not {replica_gpus[r]}"
        for (r, name), value in results.items()
        if isinstance(value, cp.ndarray) and value.device.id != replica_gpus[r]
    ]
    report.check(f"[{label}] results on their replica's GPU", not misplaced, "; ".join(misplaced))

    local = strategy.experimental_local_results(returned)
    returned_hosts = [host_data(r, "returned", "float32", SHAPE) for r in range(n)]
    ok, detail = (
        (len(local) == n, f"{len(local)} local results for {n} replicas")
        if len(local) != n
        else same(local[n - 1], returned_hosts[n - 1], 1)
    )
    report.check(f"[{label}] experimental_local_results", ok, detail)
    for op, value in reduced.items():
        ok, detail = same(value, numpy_reduce(op, returned_hosts), n)
        report.check(f"[{label}] strategy.reduce {op} axis=None", ok, detail)
    uneven_hosts = [host_data(r, "uneven", "float32", (r + 1, 3)) for r in range(n)]
    whole = np.concatenate(uneven_hosts, axis=0)
    for op, expected in (("sum", whole.sum(axis=0)), ("mean", whole.mean(axis=0))):
        ok, detail = same(reduced_along[op], expected.astype(np.float32), whole.shape[0])
        report.check(f"[{label}] strategy.reduce {op} axis=0 (uneven)", ok, detail)

    report.check(
        f"[{label}] invariant 1: own device and stream at every await",
        not WATCH.wrong_context,
        "; ".join(WATCH.wrong_context[:5]),
    )
    order = [replica for replica, _ in WATCH.trace]
    interleaved = n == 1 or order != sorted(order)
    report.check(
        f"[{label}] replicas interleaved",
        interleaved,
        "every replica ran to its end before the next one started",
    )
    report.check(
        f"[{label}] invariant 4: no host synchronization on the loop thread in a step",
        not WATCH.host_syncs,
        ", ".join(sorted(set(WATCH.host_syncs))),
    )


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    global cp
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--loop",
        choices=("asyncio", "trio", "all"),
        default="all",
        help="event loop(s) to run on (default: asyncio, and trio if installed)",
    )
    args = parser.parse_args(argv)
    try:
        import cupy
    except ImportError as exc:
        print(f"SKIP: CuPy is not importable ({exc}); this check needs a CUDA machine")
        return 2
    cp = cupy
    from aioreplica._backends._cupy import visible_device_count

    gpus = visible_device_count()
    if gpus == 0:
        print("SKIP: CuPy sees no CUDA device; this check needs a CUDA machine")
        return 2
    print(
        f"CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
        f"{gpus} GPU(s): "
        + ", ".join(cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(gpus)),
        flush=True,
    )
    watched, unwatched = install_host_sync_watch()
    print(f"host-sync watch on: {', '.join(watched)}")
    if unwatched:
        print(f"not watchable (not wrapped): {', '.join(unwatched)}")

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
    for loop in loops:
        for label, devices in layouts(gpus).items():
            name = f"{label}, {loop}"
            try:
                anyio.run(check_layout, report, name, devices, backend=loop)
            except Exception:
                report.check(f"[{name}] ran to the end", False, traceback.format_exc())
    elapsed = time.perf_counter() - started
    print(
        f"\n{report.passed} passed, {len(report.failed)} failed in {elapsed:.1f} s"
        + ("".join(f"\n  FAILED {name}" for name in report.failed))
    )
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
