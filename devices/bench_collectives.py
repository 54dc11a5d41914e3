"""Host all_reduce and host compute against plain NumPy, and GPU all_reduce against plain CuPy.

Part A, host ``all_reduce`` SUM of float32 arrays, for N = 2, 4, 8 replicas and 1, 16, 64 MiB
per replica. One run times, interleaved:

aioreplica    ``await strategy.run(step, args=(PerReplica(arrays),))`` where ``step`` awaits
              ``get_replica_context().all_reduce(ReduceOp.SUM, x)``; the strategy
              (``MirroredStrategy(["cpu:0", ...])``) is created once per N, outside the timing.
kernel-2t     aioreplica's host kernel alone (``aioreplica/_backends/_hostreduce.py``, loaded
              from its file): ``reduce_range`` over ``split_ranges(size, 4, 2)`` in two
              persistent worker threads, into a ``BufferPool`` buffer that is then published.
              This is what the host backend does without the scheduler around it.
kernel-1t     the same kernel over the whole array in the calling thread.
numpy-chain   ``np.add(a, b, out=o); np.add(o, c, out=o); ...`` into one preallocated output.
numpy-reduce  ``functools.reduce(np.add, arrays)``: a new output per call, as plain code does.
copy          ``np.copyto`` of the same N x size bytes into a preallocated array: the memory
              bandwidth of this machine now, reported in GB/s (bytes copied per second).

"fastest NumPy" is whichever of numpy-chain and numpy-reduce has the lower median; ratios are
medians of per-round ratios (sample i of one implementation over sample i of the other, taken
moments apart). Before timing, every implementation's result is compared with numpy-chain's,
and for aioreplica: every replica's result must be the very same array object (or share its
memory), read-only, and not one of the inputs; tracemalloc then counts the bytes NumPy allocates
during three warm steps (0 when the output buffer is reused, one output when it is allocated
afresh, N outputs if every replica got its own copy).

Part B, a compute-bound step on 1 vs 2 host replicas: each replica runs ``_compute_work``
(``np.sin``/``np.exp`` with ``out=`` on its own 4 MiB float64 array; single-threaded ufuncs that
release the GIL; no BLAS) through ``await get_replica_context().device.run(...)``. Reported as
throughput (steps/s x replicas) and the ratio 2 replicas / 1. For reference the same work runs
on 1 and 2 plain persistent threads ("threads"), which shows what this machine allows now. A
step takes about 10 ms on a 2-core EPYC, long against the fixed cost of handing it to a thread
and back (0.1-0.3 ms there): with 1 MiB arrays even plain threads scaled only 1.6x, so the
ratio measured that cost more than parallelism (``bench_scheduler.py`` measures overhead).

Part C, ``all_reduce`` SUM of float32 arrays across N = 2, 4 replicas on one GPU (``gpu:0``),
16 and 64 MiB per replica. It runs only when CuPy imports and ``aioreplica.list_devices()``
names a GPU; otherwise it is reported as skipped, with the reason. A strategy needs a distinct
device per replica, so the replicas are ``cuda_device(0)`` and ``check_gpu.ExtraReplicaDevice``
wrappers ``gpu:0.1``, ``gpu:0.2``, ... (imported from ``devices/check_gpu.py``), each with a
CUDA stream of its own. The inputs are created on GPU 0 and complete before timing starts. Rows:

aioreplica    the same step as in part A, on those devices.
cupy-sum      ``cupy.add(a, b, out=o); cupy.add(o, c, out=o); ...`` into one preallocated output.
cupy-copy     ``dst[...] = src`` for each of the N inputs, into preallocated arrays: N x size
              bytes copied device to device, reported as GB/s (this GPU's copy bandwidth now).

Every replica gets a result of its own, so aioreplica must do more than cupy-sum: the sum, then
N - 1 copies of it (one per further replica). Its target is stated against that work: its time
within 1 / 0.8 of cupy-sum's plus N - 1 copies of one input (cupy-copy's time x (N - 1) / N),
and the memory bandwidth it reaches on the bytes it must move (3 N - 1 times the input size:
N reads and a write for the sum, a read and a write per copy) at least 70 % of cupy-copy's
(which moves 2 N times the input size).

Timing includes completion: each timed call is followed by ``cupy.cuda.Device(0).synchronize()``
(in the harness, between steps, never inside one), and ``time.perf_counter_ns`` spans the calls
and their waits. CUDA events would time one stream, but aioreplica's work spans the replicas'
streams; a device synchronize waits for all of them and costs every row the same fixed time,
reported as ``idle_sync_us`` (a synchronize on an idle GPU). Results are checked against a
NumPy sum before timing; aioreplica's must be on GPU 0 for every replica. A failure in part C is
recorded and reported; parts A and B still report. Against the CPU stand-in of CuPy
(``PYTHONPATH=tests/cupy_sim``) part C runs, so the script itself is exercised, but its
timings are of NumPy on the host: it says so, and its checks are SKIP.

Each configuration is calibrated so that one sample (``time.perf_counter_ns`` around ``reps``
calls) lasts about 0.2 s (0.05 s with ``--quick``, at least one call). 7 samples are taken per
configuration (3 with ``--quick``; three times as many in part B, which is cheap and whose ratio
divides two noisy throughputs), interleaved (A B C A B C ...) because absolute times drift on a
shared machine while ratios taken close together hold. ``gc.collect()`` runs before each
sample; the collector stays enabled during it, as in a real program, so freeing old results is
part of what is timed.

Run from the repository root (aioreplica is imported from this checkout)::

    .venv/bin/python devices/bench_collectives.py --quick          # under a minute
    .venv/bin/python devices/bench_collectives.py                  # a few minutes
    .venv/bin/python devices/bench_collectives.py --loop trio      # or uvloop
    .venv/bin/python devices/bench_collectives.py --n 4 --sizes 64 --part a
    .venv/bin/python devices/bench_collectives.py --part c         # GPU only (skipped without)

Output. Table 1: per (N, MiB per replica), copy GB/s, median ms per all_reduce of each
implementation, aioreplica / fastest NumPy, kernel-2t / fastest NumPy, and aioreplica's input
bandwidth (N x size / time). Table 2: steps/s x replicas for 1 and 2 replicas, and 2/1. Table 3
(part C): per (N, MiB per replica), cupy-copy GB/s, median ms per call of each row, aioreplica /
cupy-sum, aioreplica / (cupy-sum + N - 1 copies), aioreplica's input bandwidth and that bandwidth
over the copy's. Checks, PASS / FAIL (SKIP when a check's configuration was left out, or part C
had no GPU or ran on the stand-in): (1a) 4 x 64 MiB float32
SUM all_reduce within 1.0x of the fastest plain-NumPy sum (as fast or faster: the work split over
the worker threads), (1b) 4 x 1 MiB within 2.0x (the whole call: a run() start, a merge round,
the checks and the reduction, against the bare sum); (2) results shared, no per-replica
copies; (3) 2 replicas with device.run reach >= 1.6x the throughput of 1; (4a) 4 x 64 MiB float32
SUM all_reduce on one GPU at >= 0.8x the speed of the plain CuPy sum plus the 3 copies it must
make (its time <= 1.25 x (cupy-sum + 3/4 cupy-copy)); (4b) its memory bandwidth on the bytes
it must move >= 70 % of the device-to-device copy bandwidth. Metadata (with part C's status,
GPU, whether it was the stand-in, and timing method), raw samples and checks go to ``--json``
(default ``bench-results/bench_collectives.json``). The exit status is 0 whatever the checks
say; non-zero means the script itself crashed.
"""

from __future__ import annotations

import functools
import gc
import importlib
import importlib.util
import math
import queue
import statistics
import sys
import threading
import time
import traceback
import tracemalloc
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from _benchlib import (
    REPO_ROOT,
    Api,
    Case,
    Driver,
    ReplicaContext,
    Strategy,
    aioreplica_meta,
    bench_parser,
    dist_versions,
    fmt,
    host_strategy,
    load_aioreplica,
    pick,
    print_checks,
    run_interleaved,
    run_meta,
    sample_target_ns,
    timed_async,
    timed_sync,
    within,
    write_json,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence
    from types import ModuleType

    import numpy.typing as npt

KERNEL_PATH = REPO_ROOT / "aioreplica" / "_backends" / "_hostreduce.py"
A_IMPLS = ("aioreplica", "kernel-2t", "kernel-1t", "numpy-chain", "numpy-reduce", "copy")
NUMPY_IMPLS = ("numpy-chain", "numpy-reduce")
B_IMPLS = ("aioreplica", "threads")
N_VALUES = (2, 4, 8)
SIZES_MIB = (1, 16, 64)
COMPUTE_MIB = 4  # about 10 ms per step here: long against the per-step handoff
COMPUTE_REPLICAS = (1, 2)
VERIFY_TIMEOUT_S = 120.0
#: (label, N, MiB per replica, bound on aioreplica / fastest NumPy)
CHECK1 = (("1a", 4, 64, 1.0), ("1b", 4, 1, 2.0))
CHECK3 = 1.6
C_IMPLS = ("aioreplica", "cupy-sum", "cupy-copy")


def _moved(n: int) -> int:
    """Bytes an all_reduce of N inputs must move, in units of one input, when every replica
    gets its own result: N reads and 1 write for the sum, a read and a write per copy for the
    N - 1 copies: 3 N - 1. (cupy-copy moves 2 N: N reads, N writes.)"""
    return 3 * n - 1


def _scaled(ratio: float | None, factor: float) -> float | None:
    return None if ratio is None else ratio * factor


C_N_VALUES = (2, 4)
C_SIZES_MIB = (16, 64)
#: N, MiB per replica, and the least fraction of the speed of cupy-sum plus N - 1 copies of one
#: input that aioreplica must reach (each replica gets its own result: N - 1 copies of the sum).
CHECK4 = (4, 64, 0.8)
#: The least fraction of cupy-copy's memory bandwidth that aioreplica must reach on the bytes it
#: must move (``_moved``).
CHECK4_BANDWIDTH = 0.7
GPU_INDEX = 0
GPU_TIMING = (
    "perf_counter_ns around reps calls, each call followed by cupy.cuda.Device(i).synchronize()"
)
MIB = 1 << 20
MAX_REPS = 1_000_000
_STAND_IN = "the CPU stand-in of CuPy (tests/cupy_sim)"


# --- the host kernel, loaded from its file ----------------------------------------------------


def _load_kernel() -> ModuleType | str:
    """The host kernel module loaded from its file, so a broken package import spares it."""
    try:
        spec = importlib.util.spec_from_file_location("_bench_hostreduce", KERNEL_PATH)
        if spec is None or spec.loader is None:
            return f"cannot load {KERNEL_PATH}"
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
        return module
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


# --- persistent worker threads: the kernel stand-in and the plain-thread baseline -----------


class _Workers:
    """k daemon threads; ``run_all`` gives job i to thread i and waits for all of them."""

    def __init__(self, k: int) -> None:
        self._inboxes: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(k)]
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        for inbox in self._inboxes:
            threading.Thread(target=self._work, args=(inbox,), daemon=True).start()

    def _work(self, inbox: queue.SimpleQueue[Any]) -> None:
        while (job := inbox.get()) is not None:
            fn, args = job
            del job
            try:
                fn(*args)
            except BaseException as exc:
                self._done.put(exc)
            else:
                self._done.put(None)
            del fn, args

    def run_all(self, jobs: Sequence[tuple[Callable[..., object], tuple[Any, ...]]]) -> None:
        if len(jobs) > len(self._inboxes):
            raise ValueError(f"{len(jobs)} jobs for {len(self._inboxes)} worker threads")
        for inbox, job in zip(self._inboxes, jobs, strict=False):
            inbox.put(job)
        errors = [e for e in (self._done.get() for _ in jobs) if e]
        if errors:
            raise errors[0]

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.put(None)


# --- results ----------------------------------------------------------------------------------


@dataclass
class _Result:
    part: str  # "allreduce" | "compute" | "gpu_allreduce"
    impl: str
    n: int
    mib: int
    status: str = "ok"  # ok | skipped | error
    reason: str = ""
    reps: int = 0
    samples_ns: list[int] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def tolerates_failure(self) -> bool:
        return self.impl in ("aioreplica", "kernel-1t", "kernel-2t") or self.part == "gpu_allreduce"

    @property
    def label(self) -> str:
        return f"{self.part} {self.impl} N={self.n} {self.mib} MiB"

    @property
    def per_call_ns(self) -> list[float]:
        return [s / self.reps for s in self.samples_ns] if self.status == "ok" else []

    @property
    def median_ms(self) -> float | None:
        t = self.per_call_ns
        return statistics.median(t) / 1e6 if t else None

    @property
    def best_ms(self) -> float | None:
        t = self.per_call_ns
        return min(t) / 1e6 if t else None


# --- part A: all_reduce ---------------------------------------------------------------------


def _traced_bytes(step: Callable[[], object], steps: int) -> list[int]:
    """Peak bytes NumPy and Python allocate during each of ``steps`` calls of ``step``."""
    peaks = []
    tracemalloc.start()
    try:
        for _ in range(steps):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            step()
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
    return peaks


def _check_shared(values: Sequence[Any], n: int, inputs: Sequence[Any]) -> dict[str, Any]:
    first = values[0]
    return {
        "replicas_seen": len(values),
        "same_object": all(v is first for v in values),
        "shares_memory": all(v is first or np.shares_memory(v, first) for v in values),
        "read_only": all(isinstance(v, np.ndarray) and not v.flags.writeable for v in values),
        "is_an_input": any(np.shares_memory(first, x) for x in inputs),
        "complete": len(values) == n,
    }


def _allreduce_cases(
    n: int,
    mib: int,
    impls: list[str],
    api: Api | str | None,
    strategy: Strategy | None,
    kernel: ModuleType | str,
    workers: _Workers,
    driver: Driver,
    rows: dict[str, _Result],
) -> list[Case[_Result]]:
    size = mib * MIB // 4
    rng = np.random.default_rng(n * 1000 + mib)
    arrays = [rng.random(size, dtype=np.float32) for _ in range(n)]
    chain_out = np.zeros(size, np.float32)
    copy_out = np.zeros((n, size), np.float32)
    reference = functools.reduce(np.add, arrays)
    cases: list[Case[_Result]] = []

    def close_to_reference(got: Any, impl: str) -> None:
        if not np.allclose(got, reference, rtol=1e-5, atol=1e-5):
            raise RuntimeError(f"{impl} N={n} {mib} MiB: result differs from numpy-chain")

    def chain() -> None:
        np.add(arrays[0], arrays[1], out=chain_out)
        for x in arrays[2:]:
            np.add(chain_out, x, out=chain_out)

    def copy() -> None:
        for i, x in enumerate(arrays):
            np.copyto(copy_out[i], x)

    plain: dict[str, Callable[[], object]] = {
        "numpy-chain": chain,
        "numpy-reduce": lambda: functools.reduce(np.add, arrays),
        "copy": copy,
    }
    for impl, fn in plain.items():
        if impl in impls:

            def verify(fn: Callable[[], object] = fn, impl: str = impl) -> None:
                fn()
                if impl == "copy":
                    if not np.array_equal(copy_out[-1], arrays[-1]):
                        raise RuntimeError("copy did not copy")
                else:
                    close_to_reference(chain_out if impl == "numpy-chain" else fn(), impl)

            cases.append(Case(rows[impl], functools.partial(timed_sync, fn), verify))

    if not isinstance(kernel, str):
        pool = kernel.BufferPool()
        split = kernel.split_ranges(size, 4, 2)

        def kernel_1t() -> Any:
            out = pool.take((size,), np.float32)
            kernel.reduce_range("sum", arrays, out, 0, size)
            return pool.publish(out)

        def kernel_2t() -> Any:
            out = pool.take((size,), np.float32)
            jobs = [(kernel.reduce_range, ("sum", arrays, out, lo, hi)) for lo, hi in split]
            workers.run_all(jobs)
            del jobs
            return pool.publish(out)

        for impl, fn in (("kernel-1t", kernel_1t), ("kernel-2t", kernel_2t)):
            if impl in impls:

                def kverify(fn: Callable[[], Any] = fn, impl: str = impl) -> None:
                    close_to_reference(fn(), impl)
                    rows[impl].info["ranges"] = len(split)

                cases.append(Case(rows[impl], functools.partial(timed_sync, fn), kverify))

    if "aioreplica" in impls and isinstance(api, Api) and strategy is not None:
        get_ctx, strat, op = api.get_replica_context, strategy, api.sum_op
        per_replica = api.per_replica(arrays)

        async def step(x: Any) -> Any:
            return await get_ctx().all_reduce(op, x)

        def run_once() -> Any:
            return driver.run(lambda: strat.run(step, args=(per_replica,)))

        def aio_verify() -> None:
            result = driver.run(
                lambda: within(VERIFY_TIMEOUT_S, strat.run(step, args=(per_replica,)))
            )
            wrapped = isinstance(result, api.distributed_values)
            # one entry per replica, the one shared array n times where every replica got it
            values = strat.experimental_local_results(result)
            info = _check_shared(values, n, arrays)
            info["run_returned"] = "PerReplica/Mirrored" if wrapped else "the one shared array"
            close_to_reference(values[0], "aioreplica")
            del result, values
            peaks = _traced_bytes(run_once, 3)
            info["allocated_bytes_per_warm_step"] = peaks
            info["outputs_allocated_per_warm_step"] = [round(p / (size * 4), 2) for p in peaks]
            rows["aioreplica"].info.update(info)

        cases.append(
            Case(
                rows["aioreplica"],
                lambda reps: driver.run(
                    lambda: timed_async(lambda: strat.run(step, args=(per_replica,)), reps)
                ),
                aio_verify,
            )
        )
    return cases


def _measure_allreduce(
    ns: list[int],
    sizes: list[int],
    impls: list[str],
    samples: int,
    target_ns: int,
    api: Api | str | None,
    kernel: ModuleType | str,
    workers: _Workers,
    driver: Driver,
) -> list[_Result]:
    results: list[_Result] = []
    for n in ns:
        strategy, strategy_error = host_strategy(api, n, impls)
        for mib in sizes:
            rows = {impl: _Result("allreduce", impl, n, mib) for impl in impls}
            results.extend(rows.values())
            for impl, r in rows.items():
                if impl == "aioreplica" and isinstance(api, str):
                    r.status, r.reason = "skipped", f"aioreplica not importable: {api}"
                elif impl == "aioreplica" and strategy_error:
                    r.status, r.reason = "error", strategy_error
                elif impl.startswith("kernel") and isinstance(kernel, str):
                    r.status, r.reason = "error", f"kernel not loadable: {kernel}"
            cases = _allreduce_cases(n, mib, impls, api, strategy, kernel, workers, driver, rows)
            run_interleaved(cases, samples, target_ns, max_reps=MAX_REPS, gc_off=False)
            del cases
            gc.collect()
            line = "  ".join(f"{r.impl} {fmt(r.median_ms)}" for r in rows.values())
            print(f"N={n} {mib:>2} MiB  {line}  (ms)", file=sys.stderr, flush=True)
    return results


# --- part B: compute --------------------------------------------------------------------------


def _compute_work(x: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> None:
    """A compute-bound step: single-threaded ufuncs that release the GIL, no BLAS."""
    np.sin(x, out=y)
    np.exp(y, out=y)
    np.sin(y, out=y)
    np.exp(y, out=y)


def _measure_compute(
    impls: list[str],
    samples: int,
    target_ns: int,
    api: Api | str | None,
    workers: _Workers,
    driver: Driver,
) -> list[_Result]:
    size = COMPUTE_MIB * MIB // 8
    xs = [np.linspace(i, i + 1, size) for i in range(max(COMPUTE_REPLICAS))]
    reference = [np.empty(size) for _ in xs]
    for x, ref in zip(xs, reference, strict=True):
        _compute_work(x, ref)
    results: list[_Result] = []
    cases: list[Case[_Result]] = []
    if isinstance(api, Api):
        compute_step = functools.partial(_compute_step, api.get_replica_context)
    for impl in impls:
        for n in COMPUTE_REPLICAS:
            res = _Result("compute", impl, n, COMPUTE_MIB)
            results.append(res)
            ys = [np.zeros(size) for _ in range(n)]

            def check(ys: list[Any] = ys, impl: str = impl, n: int = n) -> None:
                for y, ref in zip(ys, reference, strict=False):
                    if not np.array_equal(y, ref):
                        raise RuntimeError(f"compute {impl} n={n}: wrong result")

            if impl == "threads":
                jobs = [(_compute_work, (xs[i], ys[i])) for i in range(n)]

                def tverify(jobs: Any = jobs, check: Any = check) -> None:
                    workers.run_all(jobs)
                    check()

                cases.append(
                    Case(
                        res,
                        functools.partial(timed_sync, functools.partial(workers.run_all, jobs)),
                        tverify,
                    )
                )
                continue
            if isinstance(api, str) or api is None:
                res.status, res.reason = "skipped", f"aioreplica not importable: {api}"
                continue
            try:
                strategy = api.strategy_cls([f"cpu:{i}" for i in range(n)])
            except Exception as exc:
                res.status, res.reason = "error", f"{type(exc).__name__}: {exc}"
                continue
            args = (api.per_replica(xs[:n]), api.per_replica(ys))

            def averify(
                strategy: Strategy = strategy, args: Any = args, check: Any = check
            ) -> None:
                driver.run(lambda: within(VERIFY_TIMEOUT_S, strategy.run(compute_step, args=args)))
                check()

            def asample(reps: int, strategy: Strategy = strategy, args: Any = args) -> int:
                return driver.run(
                    lambda: timed_async(lambda: strategy.run(compute_step, args=args), reps)
                )

            cases.append(Case(res, asample, averify))
    run_interleaved(cases, samples, target_ns, max_reps=MAX_REPS, gc_off=False)
    for r in results:
        print(
            f"compute {r.impl} replicas={r.n}  {fmt(_throughput(r))} steps/s x replicas",
            file=sys.stderr,
            flush=True,
        )
    return results


async def _compute_step(get_ctx: Callable[[], ReplicaContext], x: Any, y: Any) -> None:
    await get_ctx().device.run(_compute_work, x, y)


def _throughput(r: _Result) -> float | None:
    """Steps/s x replicas from the fastest sample: on a shared machine noise only ever slows a
    sample down, and the 2/1 ratio divides two such throughputs."""
    t = r.best_ms
    return None if t is None or t <= 0 else r.n * 1e3 / t


# --- part C: all_reduce on one GPU ------------------------------------------------------------


def _load_gpu(api: Api | str | None) -> tuple[Any, str]:
    """The ``cupy`` module when CuPy imports and aioreplica lists a GPU; else None and why not."""
    if not isinstance(api, Api):
        return None, f"aioreplica not importable: {api}"
    try:
        cp = importlib.import_module("cupy")
    except Exception as exc:
        return None, f"CuPy not importable ({type(exc).__name__}: {exc})"
    if api.list_devices is None:
        return None, "aioreplica has no list_devices()"
    names = api.list_devices()
    if not any(name.startswith("gpu:") for name in names):
        return None, f"no GPU in aioreplica.list_devices() = {names}"
    return cp, ""


def _extra_replica_device() -> Callable[[int, int], Any]:
    """``check_gpu.ExtraReplicaDevice``: a replica ``gpu:<i>.<k>`` on a GPU, own stream."""
    devices_dir = str(Path(__file__).resolve().parent)
    if devices_dir not in sys.path:
        sys.path.insert(0, devices_dir)
    from check_gpu import ExtraReplicaDevice

    return ExtraReplicaDevice


def _gpu_timed_sync(step: Callable[[], object], wait: Callable[[], object], reps: int) -> int:
    wait()
    t0 = time.perf_counter_ns()
    for _ in range(reps):
        step()
        wait()
    return time.perf_counter_ns() - t0


async def _gpu_timed_async(
    step: Callable[[], Awaitable[object]], wait: Callable[[], object], reps: int
) -> int:
    wait()
    t0 = time.perf_counter_ns()
    for _ in range(reps):
        await step()
        wait()  # the harness waits here, between steps, never inside one
    return time.perf_counter_ns() - t0


def _idle_sync_us(wait: Callable[[], object], calls: int = 200) -> float:
    """Median µs of ``wait()`` on an idle GPU: the fixed cost that every timed call includes."""
    wait()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        wait()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def _gpu_allreduce_cases(
    cp: Any,
    index: int,
    n: int,
    mib: int,
    impls: list[str],
    api: Api,
    strategy: Strategy | None,
    driver: Driver,
    rows: dict[str, _Result],
) -> list[Case[_Result]]:
    size = mib * MIB // 4
    rng = np.random.default_rng(n * 1000 + mib)
    hosts = [rng.random(size, dtype=np.float32) for _ in range(n)]
    reference = functools.reduce(np.add, hosts)
    last_host = hosts[-1]
    gpu = cp.cuda.Device(index)
    with gpu:
        arrays = [cp.asarray(h) for h in hosts]
        sum_out = cp.empty(size, dtype=cp.float32)
        copy_outs = [cp.empty(size, dtype=cp.float32) for _ in range(n)]
    del hosts
    wait = gpu.synchronize
    wait()  # the inputs are complete before any replica stream reads them
    cases: list[Case[_Result]] = []

    def on_host(x: Any) -> npt.NDArray[Any]:
        wait()
        return np.asarray(cp.asnumpy(x))

    def close_to_reference(got: Any, impl: str) -> None:
        if not np.allclose(on_host(got), reference, rtol=1e-5, atol=1e-5):
            raise RuntimeError(f"{impl} N={n} {mib} MiB: result differs from the NumPy sum")

    def cupy_sum() -> None:
        with gpu:
            cp.add(arrays[0], arrays[1], out=sum_out)
            for x in arrays[2:]:
                cp.add(sum_out, x, out=sum_out)

    def cupy_copy() -> None:
        with gpu:
            for dst, src in zip(copy_outs, arrays, strict=True):
                dst[...] = src

    def sum_verify() -> None:
        cupy_sum()
        close_to_reference(sum_out, "cupy-sum")

    def copy_verify() -> None:
        cupy_copy()
        if not np.array_equal(on_host(copy_outs[-1]), last_host):
            raise RuntimeError("cupy-copy did not copy")

    for impl, fn, verify in (
        ("cupy-sum", cupy_sum, sum_verify),
        ("cupy-copy", cupy_copy, copy_verify),
    ):
        if impl in impls:
            cases.append(Case(rows[impl], functools.partial(_gpu_timed_sync, fn, wait), verify))

    if "aioreplica" in impls and strategy is not None:
        get_ctx, strat, op = api.get_replica_context, strategy, api.sum_op
        per_replica = api.per_replica(arrays)

        async def step(x: Any) -> Any:
            return await get_ctx().all_reduce(op, x)

        def aio_verify() -> None:
            result = driver.run(
                lambda: within(VERIFY_TIMEOUT_S, strat.run(step, args=(per_replica,)))
            )
            values = strat.experimental_local_results(result)  # one entry per replica
            for value in values:
                close_to_reference(value, "aioreplica")
            inputs = {x.data.ptr for x in arrays}
            rows["aioreplica"].info.update(
                {
                    "replicas_seen": len(values),
                    "on_the_gpu": all(v.device.id == index for v in values),
                    "distinct_buffers": len({v.data.ptr for v in values}),
                    "is_an_input": any(v.data.ptr in inputs for v in values),
                }
            )
            del result, values

        cases.append(
            Case(
                rows["aioreplica"],
                lambda reps: driver.run(
                    lambda: _gpu_timed_async(
                        lambda: strat.run(step, args=(per_replica,)), wait, reps
                    )
                ),
                aio_verify,
            )
        )
    return cases


def _measure_gpu_allreduce(
    cp: Any,
    ns: list[int],
    sizes: list[int],
    impls: list[str],
    samples: int,
    target_ns: int,
    api: Api,
    driver: Driver,
) -> tuple[list[_Result], dict[str, Any]]:
    from aioreplica._backends._cupy import cuda_device

    extra = _extra_replica_device()
    index = GPU_INDEX
    wait = cp.cuda.Device(index).synchronize
    info: dict[str, Any] = {
        "gpu": f"gpu:{index}",
        "gpu_name": _gpu_name(cp, index),
        "cupy": str(getattr(cp, "__version__", None)),
        "timing": GPU_TIMING,
        "idle_sync_us": _idle_sync_us(wait),
        "simulated": _simulated(cp),
    }
    results: list[_Result] = []
    for n in ns:
        strategy, strategy_error = None, ""
        if "aioreplica" in impls:
            try:
                devices = [cuda_device(index)] + [extra(index, k) for k in range(1, n)]
                strategy = api.strategy_cls(devices)
            except Exception as exc:
                strategy_error = (
                    f"MirroredStrategy(N={n} on gpu:{index}): {type(exc).__name__}: {exc}"
                )
        for mib in sizes:
            rows = {impl: _Result("gpu_allreduce", impl, n, mib) for impl in impls}
            results.extend(rows.values())
            if strategy_error:
                rows["aioreplica"].status, rows["aioreplica"].reason = "error", strategy_error
            cases = _gpu_allreduce_cases(cp, index, n, mib, impls, api, strategy, driver, rows)
            run_interleaved(cases, samples, target_ns, max_reps=MAX_REPS, gc_off=False)
            del cases
            gc.collect()
            line = "  ".join(f"{r.impl} {fmt(r.median_ms)}" for r in rows.values())
            print(f"gpu N={n} {mib:>2} MiB  {line}  (ms)", file=sys.stderr, flush=True)
    return results, info


def _simulated(cp: Any) -> bool:
    """Whether ``cp`` is the CPU stand-in of CuPy (``tests/cupy_sim``), not CuPy on a GPU."""
    return hasattr(cp, "_sim")


def _gpu_name(cp: Any, index: int) -> str | None:
    try:
        name = cp.cuda.runtime.getDeviceProperties(index)["name"]
    except Exception:
        return None
    return name.decode() if isinstance(name, bytes) else str(name)


def _run_gpu_part(
    ns: list[int],
    sizes: list[int],
    impls: list[str],
    samples: int,
    target_ns: int,
    api: Api | str | None,
    driver: Driver,
) -> tuple[list[_Result], dict[str, Any]]:
    """Part C, or why it did not run; a crash in it is recorded so parts A and B still report."""
    cp, why = _load_gpu(api)
    if cp is None or not isinstance(api, Api):
        return [], {"status": "skipped", "reason": why}
    if _simulated(cp):
        print(
            f"NOTE: part C runs on {_STAND_IN}: its timings are of NumPy on the host and mean "
            "nothing, and its checks are SKIP",
            file=sys.stderr,
            flush=True,
        )
    try:
        results, info = _measure_gpu_allreduce(
            cp, ns, sizes, impls, samples, target_ns, api, driver
        )
    except Exception as exc:
        traceback.print_exc()
        return [], {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
    return results, {"status": "ran", "reason": ""} | info


# --- reporting --------------------------------------------------------------------------------


def _times(x: float | None) -> str:
    return "n/a" if x is None else f"{fmt(x)}x"


def _paired_ratio_to_sum(
    a: _Result | None, parts: Sequence[tuple[_Result | None, float]]
) -> float | None:
    """Median over rounds of a's per-call time over the weighted sum of the parts' times in
    the same round."""
    if a is None or any(part is None for part, _ in parts):
        return None
    rounds = zip(a.per_call_ns, *(part.per_call_ns for part, _ in parts if part), strict=False)
    weights = [weight for _, weight in parts]
    pairs = []
    for first, *rest in rounds:
        whole = sum(weight * t for weight, t in zip(weights, rest, strict=True))
        if whole > 0:
            pairs.append(first / whole)
    return statistics.median(pairs) if pairs else None


def _paired_ratio(a: _Result | None, b: _Result | None) -> float | None:
    """Median over rounds of a's per-call time over b's, samples taken moments apart."""
    if a is None or b is None:
        return None
    pa, pb = a.per_call_ns, b.per_call_ns
    pairs = [x / y for x, y in zip(pa, pb, strict=False) if y > 0]
    return statistics.median(pairs) if pairs else None


def _fastest_numpy(rows: dict[str, _Result]) -> _Result | None:
    timed = [rows[i] for i in NUMPY_IMPLS if i in rows and rows[i].median_ms is not None]
    return min(timed, key=lambda r: r.median_ms or math.inf, default=None)


def _allreduce_table(results: list[_Result]) -> list[dict[str, Any]]:
    groups: dict[tuple[int, int], dict[str, _Result]] = {}
    for r in results:
        groups.setdefault((r.n, r.mib), {})[r.impl] = r
    table = []
    for (n, mib), rows in groups.items():
        fastest = _fastest_numpy(rows)
        copy = rows.get("copy")
        copy_ms = copy.median_ms if copy else None
        aio = rows.get("aioreplica")
        aio_ms = aio.median_ms if aio else None
        total = n * mib * MIB
        table.append(
            {
                "n": n,
                "mib_per_replica": mib,
                "copy_gb_s": None if not copy_ms else total / (copy_ms / 1e3) / 1e9,
                "median_ms": {i: r.median_ms for i, r in rows.items()},
                "fastest_numpy": fastest.impl if fastest else None,
                "aioreplica_over_fastest_numpy": _paired_ratio(aio, fastest),
                "kernel2t_over_fastest_numpy": _paired_ratio(rows.get("kernel-2t"), fastest),
                "kernel1t_over_fastest_numpy": _paired_ratio(rows.get("kernel-1t"), fastest),
                "aioreplica_input_gb_s": None if not aio_ms else total / (aio_ms / 1e3) / 1e9,
            }
        )
    return table


def _gpu_table(results: list[_Result]) -> list[dict[str, Any]]:
    groups: dict[tuple[int, int], dict[str, _Result]] = {}
    for r in results:
        groups.setdefault((r.n, r.mib), {})[r.impl] = r
    table = []
    for (n, mib), rows in groups.items():
        copy, plain, aio = rows.get("cupy-copy"), rows.get("cupy-sum"), rows.get("aioreplica")
        copy_ms = copy.median_ms if copy else None
        aio_ms = aio.median_ms if aio else None
        total = n * mib * MIB
        table.append(
            {
                "n": n,
                "mib_per_replica": mib,
                "copy_gb_s": None if not copy_ms else total / (copy_ms / 1e3) / 1e9,
                "median_ms": {i: r.median_ms for i, r in rows.items()},
                "aioreplica_over_cupy_sum": _paired_ratio(aio, plain),
                # the work aioreplica must do: the sum, then N - 1 copies of one input
                "aioreplica_over_sum_plus_copies": _paired_ratio_to_sum(
                    aio, [(plain, 1.0), (copy, (n - 1) / n)]
                ),
                "aioreplica_input_gb_s": None if not aio_ms else total / (aio_ms / 1e3) / 1e9,
                # the memory bandwidth aioreplica reaches on the bytes it must move, as a
                # fraction of the copy's (see _moved)
                "aioreplica_bandwidth_over_copy": _scaled(
                    _paired_ratio(copy, aio), _moved(n) / (2 * n)
                ),
            }
        )
    return table


def _compute_table(results: list[_Result]) -> dict[str, Any]:
    by = {(r.impl, r.n): r for r in results}
    out: dict[str, Any] = {}
    for impl in B_IMPLS:
        one, two = by.get((impl, 1)), by.get((impl, 2))
        ratio = _paired_ratio(one, two)  # t1 / t2 per step, so throughput2 / throughput1 / 2
        out[impl] = {
            "throughput_1": _throughput(one) if one else None,
            "throughput_2": _throughput(two) if two else None,
            "ratio_2_over_1": None if ratio is None else 2 * ratio,
        }
    return out


def _speed_check(
    results: list[_Result],
    table: list[dict[str, Any]],
    label: str,
    n1: int,
    mib1: int,
    bound: float,
) -> dict[str, str]:
    """One check of aioreplica's all_reduce time against the fastest NumPy sum."""
    row = next((t for t in table if (t["n"], t["mib_per_replica"]) == (n1, mib1)), None)
    name1 = (
        f"({label}) {n1} x {mib1} MiB float32 SUM all_reduce within {bound}x of the fastest "
        "NumPy sum"
    )
    ran = set(row["median_ms"]) if row else set()
    if row is None:
        return {"name": name1, "status": "SKIP", "detail": "not in this run"}
    if "aioreplica" not in ran or not ran & set(NUMPY_IMPLS):
        detail = "aioreplica or both NumPy rows left out of this run"
        return {"name": name1, "status": "SKIP", "detail": detail}
    ratio = row["aioreplica_over_fastest_numpy"]
    ms = row["median_ms"]
    reasons = {
        r.reason
        for r in results
        if r.part == "allreduce" and (r.n, r.mib) == (n1, mib1) and r.reason
    }
    detail = (
        f"aioreplica {fmt(ms.get('aioreplica'))} ms, {row['fastest_numpy']} "
        f"{fmt(ms.get(row['fastest_numpy']) if row['fastest_numpy'] else None)} ms: "
        f"{_times(ratio)} (median of paired ratios)"
    )
    if ratio is None:
        detail += "; not measured: " + ("; ".join(sorted(reasons)) or "no samples")
    if (k2t := row["kernel2t_over_fastest_numpy"]) is not None:
        detail += f"; the kernel alone (kernel-2t): {_times(k2t)}"
    return {
        "name": name1,
        "status": "PASS" if ratio is not None and ratio <= bound else "FAIL",
        "detail": detail,
    }


def _checks(
    results: list[_Result],
    table: list[dict[str, Any]],
    compute: dict[str, Any],
    gpu_table: list[dict[str, Any]],
    gpu_part: dict[str, Any],
) -> list[dict[str, str]]:
    checks = []
    for label, n1, mib1, bound in CHECK1:
        checks.append(_speed_check(results, table, label, n1, mib1, bound))

    name2 = "(2) results shared with no per-replica copies"
    aio = [r for r in results if r.part == "allreduce" and r.impl == "aioreplica"]
    verified = [r for r in aio if "shares_memory" in r.info]
    if not aio:
        checks.append({"name": name2, "status": "SKIP", "detail": "aioreplica not in this run"})
    elif not verified:
        why = sorted({r.reason for r in aio if r.reason})
        checks.append(
            {"name": name2, "status": "FAIL", "detail": "not measured: " + "; ".join(why)}
        )
    else:
        bad = []
        worst_outputs = 0.0
        for r in verified:
            i = r.info
            outputs = max(i["outputs_allocated_per_warm_step"])
            worst_outputs = max(worst_outputs, outputs)
            if not (i["complete"] and i["shares_memory"] and i["read_only"]) or i["is_an_input"]:
                bad.append(f"N={r.n} {r.mib} MiB: {i}")
            elif outputs >= 1.5:
                bad.append(f"N={r.n} {r.mib} MiB: {outputs} outputs allocated per step")
        same = all(r.info["same_object"] for r in verified)
        reused = sum(o < 0.5 for r in verified for o in r.info["outputs_allocated_per_warm_step"])
        steps = sum(len(r.info["outputs_allocated_per_warm_step"]) for r in verified)
        detail = (
            f"{len(verified)} configuration{'s' * (len(verified) != 1)}: every replica's result "
            f"{'is the same object' if same else 'shares memory'}, read-only, not an input; "
            f"at most {worst_outputs:.2f} outputs allocated per warm step; output buffer reused "
            f"from the pool in {reused} of {steps} warm steps"
        )
        if len(verified) < len(aio):
            detail += f"; {len(aio) - len(verified)} configurations not measured"
        if bad:
            detail += "; " + "; ".join(bad)
        checks.append({"name": name2, "status": "FAIL" if bad else "PASS", "detail": detail})

    name3 = f"(3) 2 replicas with device.run reach >= {CHECK3}x the throughput of 1"
    c = compute.get("aioreplica")
    if c is None:
        checks.append({"name": name3, "status": "SKIP", "detail": "not in this run"})
    else:
        ratio = c["ratio_2_over_1"]
        thr = compute.get("threads", {}).get("ratio_2_over_1")
        detail = (
            f"aioreplica {fmt(c['throughput_1'])} -> {fmt(c['throughput_2'])} steps/s x "
            f"replicas: {_times(ratio)}; plain threads on this machine now: {_times(thr)}"
        )
        if ratio is None:
            why = sorted({r.reason for r in results if r.part == "compute" and r.reason})
            detail += "; not measured: " + ("; ".join(why) or "no samples")
        checks.append(
            {
                "name": name3,
                "status": "PASS" if ratio is not None and ratio >= CHECK3 else "FAIL",
                "detail": detail,
            }
        )
    checks += _gpu_checks(results, gpu_table, gpu_part)
    return checks


def _gpu_checks(
    results: list[_Result], gpu_table: list[dict[str, Any]], gpu_part: dict[str, Any]
) -> list[dict[str, str]]:
    """(4a) aioreplica's time against the plain sum plus the copies it must make, and (4b) its
    input bandwidth against the copy's, for N x MiB of ``CHECK4``."""
    n4, mib4, speed = CHECK4
    copies = n4 - 1
    names = (
        f"(4a) {n4} x {mib4} MiB float32 SUM all_reduce on one GPU at >= {speed}x the speed of "
        f"the plain CuPy sum plus the {copies} copies it must make",
        f"(4b) {n4} x {mib4} MiB float32 SUM all_reduce on one GPU moves the bytes it must at "
        f">= {CHECK4_BANDWIDTH:.0%} of the device-to-device copy bandwidth",
    )

    def every(status: str, detail: str) -> list[dict[str, str]]:
        return [{"name": name, "status": status, "detail": detail} for name in names]

    status = gpu_part["status"]
    if status == "not requested":
        return every("SKIP", "part C not in this run")
    if status != "ran":  # skipped (no CuPy or no GPU), or error (part C crashed)
        verdict = "SKIP" if status == "skipped" else "FAIL"
        return every(verdict, f"part C {status}: {gpu_part['reason']}")
    if gpu_part.get("simulated"):
        return every("SKIP", f"part C ran on {_STAND_IN}: its timings mean nothing")
    row = next((t for t in gpu_table if (t["n"], t["mib_per_replica"]) == (n4, mib4)), None)
    if row is None:
        return every("SKIP", "not in this run")
    ms = row["median_ms"]
    if any(impl not in ms for impl in C_IMPLS):
        return every("SKIP", f"one of {', '.join(C_IMPLS)} left out of this run")
    over_work = row["aioreplica_over_sum_plus_copies"]
    bandwidth = row["aioreplica_bandwidth_over_copy"]
    times = (
        f"aioreplica {fmt(ms['aioreplica'])} ms, cupy-sum {fmt(ms['cupy-sum'])} ms, cupy-copy "
        f"{fmt(ms['cupy-copy'])} ms for {n4} copies"
    )
    not_measured = ""
    if over_work is None or bandwidth is None:
        reasons = {
            r.reason
            for r in results
            if r.part == "gpu_allreduce" and (r.n, r.mib) == (n4, mib4) and r.reason
        }
        not_measured = "; not measured: " + ("; ".join(sorted(reasons)) or "no samples")
    speed_detail = (
        f"{times}: aioreplica / (cupy-sum + {copies}/{n4} cupy-copy) = {_times(over_work)} "
        f"(median of paired ratios; {fmt(1 / speed)}x or less passes){not_measured}"
    )
    bandwidth_detail = (
        f"aioreplica {fmt(row['aioreplica_input_gb_s'])} GB/s of input, cupy-copy "
        f"{fmt(row['copy_gb_s'])} GB/s; counting the {_moved(n4)} x {mib4} MiB an all_reduce "
        f"with {n4} results must move against the copy's {2 * n4} x {mib4} MiB: "
        f"{_times(bandwidth)} (median of paired ratios){not_measured}"
    )
    return [
        {
            "name": names[0],
            "status": "PASS" if over_work is not None and over_work <= 1 / speed else "FAIL",
            "detail": speed_detail,
        },
        {
            "name": names[1],
            "status": "PASS" if bandwidth is not None and bandwidth >= CHECK4_BANDWIDTH else "FAIL",
            "detail": bandwidth_detail,
        },
    ]


def _print_report(
    results: list[_Result],
    table: list[dict[str, Any]],
    compute: dict[str, Any],
    impls: list[str],
    gpu_table: list[dict[str, Any]],
    gpu_part: dict[str, Any],
    checks: list[dict[str, str]],
) -> None:
    if table:
        w = 13
        timed = [i for i in impls if i != "copy"]
        heads = "".join(i.rjust(w) for i in timed)
        print(
            "\nTable 1: host all_reduce SUM float32, median ms per call "
            "(ratios: median of paired per-round ratios)"
        )
        print(
            f"{'N':>3}{'MiB':>5}{'copy GB/s':>11}{heads}{'aio/numpy':>11}{'k2t/numpy':>11}"
            f"{'aio GB/s':>10}"
        )
        for t in table:
            cells = "".join(fmt(t["median_ms"].get(i), w) for i in timed)
            print(
                f"{t['n']:>3}{t['mib_per_replica']:>5}{fmt(t['copy_gb_s'], 11)}{cells}"
                f"{fmt(t['aioreplica_over_fastest_numpy'], 11)}"
                f"{fmt(t['kernel2t_over_fastest_numpy'], 11)}"
                f"{fmt(t['aioreplica_input_gb_s'], 10)}"
            )
        print(
            "  numpy = the faster of numpy-chain and numpy-reduce; aio GB/s = N x MiB read per "
            "second by aioreplica, to set against copy GB/s"
        )
    if compute:
        print(
            f"\nTable 2: compute-bound step ({COMPUTE_MIB} MiB float64 sin/exp per replica), "
            "steps/s x replicas"
        )
        print(f"{'replicas':>9}" + "".join(i.rjust(12) for i in compute))
        for key, label in (("throughput_1", "1"), ("throughput_2", "2"), ("ratio_2_over_1", "2/1")):
            print(f"{label:>9}" + "".join(fmt(c[key], 12) for c in compute.values()))
    if gpu_part["status"] in ("skipped", "error"):
        print(f"\nPart C (all_reduce on one GPU) {gpu_part['status']}: {gpu_part['reason']}")
    elif gpu_table:
        w = 12
        timed = [i for i in C_IMPLS if any(i in t["median_ms"] for t in gpu_table)]
        gpu = gpu_part["gpu"] + (f" ({gpu_part['gpu_name']})" if gpu_part.get("gpu_name") else "")
        print(
            f"\nTable 3: all_reduce SUM float32, N replicas on {gpu}, median ms per call "
            "including its completion"
        )
        print(
            f"{'N':>3}{'MiB':>5}{'copy GB/s':>11}{''.join(i.rjust(w) for i in timed)}"
            f"{'aio/sum':>9}{'aio/work':>10}{'aio GB/s':>10}{'aio/copy':>10}"
        )
        for t in gpu_table:
            cells = "".join(fmt(t["median_ms"].get(i), w) for i in timed)
            print(
                f"{t['n']:>3}{t['mib_per_replica']:>5}{fmt(t['copy_gb_s'], 11)}{cells}"
                f"{fmt(t['aioreplica_over_cupy_sum'], 9)}"
                f"{fmt(t['aioreplica_over_sum_plus_copies'], 10)}"
                f"{fmt(t['aioreplica_input_gb_s'], 10)}"
                f"{fmt(t['aioreplica_bandwidth_over_copy'], 10)}"
            )
        print(
            "  sum = cupy-sum (cp.add into one preallocated output); aio/work = aioreplica's "
            "time over cupy-sum's plus N - 1 copies of one input (the work it must do); aio GB/s "
            "= N x MiB reduced per second by aioreplica; aio/copy = aioreplica's memory "
            "bandwidth on the 3N - 1 inputs' worth of bytes it must move over cupy-copy's on "
            "its 2N. Each call is followed by a device synchronize (idle: "
            f"{fmt(gpu_part['idle_sync_us'])} µs)"
        )
        if gpu_part.get("simulated"):
            print(f"  These timings are of {_STAND_IN}, NumPy on the host: they mean nothing.")
    for r in results:
        if r.status != "ok":
            print(f"  {r.part} {r.impl} N={r.n} {r.mib} MiB: {r.status}: {r.reason}")
    print_checks(checks)


def _csv(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "event loop for aioreplica")
    p.add_argument(
        "--part",
        default="a,b,c",
        help="a (host all_reduce), b (host compute), c (all_reduce on one GPU), or a list",
    )
    p.add_argument(
        "--only",
        default=",".join(A_IMPLS),
        help=f"subset of {','.join(A_IMPLS)} (leaving out aioreplica leaves it out of all parts)",
    )
    p.add_argument(
        "--n",
        help=f"replica counts, parts a and c (default {_csv(N_VALUES)} and {_csv(C_N_VALUES)})",
    )
    p.add_argument(
        "--sizes",
        help=f"MiB per replica, parts a and c (default {_csv(SIZES_MIB)} and {_csv(C_SIZES_MIB)})",
    )
    p.add_argument(
        "--samples",
        type=int,
        help="samples per configuration (default 7, 3 quick; part b takes 3x as many)",
    )
    p.add_argument("--json", type=Path, default=Path("bench-results/bench_collectives.json"))
    args = p.parse_args(argv)
    parts = pick(p, "--part", args.part, ("a", "b", "c"))
    impls = pick(p, "--only", args.only, A_IMPLS)
    ns = _ints(args.n) if args.n else list(N_VALUES)
    sizes = _ints(args.sizes) if args.sizes else list(SIZES_MIB)
    c_ns = _ints(args.n) if args.n else list(C_N_VALUES)
    c_sizes = _ints(args.sizes) if args.sizes else list(C_SIZES_MIB)
    samples = args.samples or (3 if args.quick else 7)
    target_ns = sample_target_ns(args.quick)

    loaded = load_aioreplica()
    kernel = _load_kernel()
    for what, value in (("aioreplica", loaded), ("the host kernel", kernel)):
        if isinstance(value, str):
            print(
                f"WARNING: {what} cannot be loaded ({value}); its rows are not run.",
                file=sys.stderr,
            )
    driver = Driver(args.loop)
    workers = _Workers(2)
    t0 = time.perf_counter()
    results: list[_Result] = []
    try:
        if "a" in parts:
            results += _measure_allreduce(
                ns, sizes, impls, samples, target_ns, loaded, kernel, workers, driver
            )
        if "b" in parts:
            b_impls = [i for i in B_IMPLS if i == "threads" or i in impls]
            # Part B is cheap and its ratio is the quotient of two noisy throughputs: more samples.
            b_samples = args.samples or 3 * samples
            results += _measure_compute(b_impls, b_samples, target_ns, loaded, workers, driver)
        gpu_part: dict[str, Any] = {"status": "not requested", "reason": ""}
        if "c" in parts:
            c_impls = [i for i in C_IMPLS if i != "aioreplica" or i in impls]
            c_results, gpu_part = _run_gpu_part(
                c_ns, c_sizes, c_impls, samples, target_ns, loaded, driver
            )
            results += c_results
    finally:
        driver.close()
        workers.close()
    table = _allreduce_table([r for r in results if r.part == "allreduce"])
    compute = _compute_table([r for r in results if r.part == "compute"]) if "b" in parts else {}
    gpu_table = _gpu_table([r for r in results if r.part == "gpu_allreduce"])
    checks = _checks(results, table, compute, gpu_table, gpu_part)
    _print_report(results, table, compute, impls, gpu_table, gpu_part, checks)
    meta = run_meta() | {
        "loop": args.loop,
        "quick": args.quick,
        "samples": samples,
        "samples_part_b": args.samples or 3 * samples,
        "target_sample_s": target_ns / 1e9,
        "wall_s": round(time.perf_counter() - t0, 1),
        "versions": dist_versions(),
        "aioreplica": aioreplica_meta(loaded),
        "kernel": (
            {"block_bytes": kernel.BLOCK_BYTES, "min_range_bytes": kernel.MIN_RANGE_BYTES}
            if not isinstance(kernel, str)
            else f"not loadable: {kernel}"
        ),
        "part_c": gpu_part,
    }
    doc = {
        "meta": meta,
        "results": [
            asdict(r) | {"median_ms": r.median_ms, "per_call_ns": r.per_call_ns} for r in results
        ],
        "allreduce_table": table,
        "compute_table": compute,
        "gpu_allreduce_table": gpu_table,
        "checks": checks,
    }
    write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
