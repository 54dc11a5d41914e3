"""Host all_reduce and host compute of aioreplica against plain NumPy, on this machine.

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

Output. Table 1: per (N, MiB per replica), copy GB/s, median ms per all_reduce of each
implementation, aioreplica / fastest NumPy, kernel-2t / fastest NumPy, and aioreplica's input
bandwidth (N x size / time). Table 2: steps/s x replicas for 1 and 2 replicas, and 2/1. Checks,
PASS / FAIL (SKIP when a check's configuration was left out): (1) 4 x 64 MiB float32 SUM
all_reduce within 1.25x of the fastest plain-NumPy sum; (2) results shared, no per-replica
copies; (3) 2 replicas with device.run reach >= 1.6x the throughput of 1. Metadata, raw samples
and checks go to ``--json`` (default ``bench-results/bench_collectives.json``). The exit status
is 0 whatever the checks say; non-zero means the script itself crashed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import queue
import statistics
import sys
import threading
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import numpy as np

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence
    from types import ModuleType

    import numpy.typing as npt

REPO_ROOT = Path(__file__).resolve().parent.parent
KERNEL_PATH = REPO_ROOT / "aioreplica" / "_backends" / "_hostreduce.py"
A_IMPLS = ("aioreplica", "kernel-2t", "kernel-1t", "numpy-chain", "numpy-reduce", "copy")
NUMPY_IMPLS = ("numpy-chain", "numpy-reduce")
B_IMPLS = ("aioreplica", "threads")
N_VALUES = (2, 4, 8)
SIZES_MIB = (1, 16, 64)
COMPUTE_MIB = 4  # about 10 ms per step here: long against the per-step handoff
COMPUTE_REPLICAS = (1, 2)
VERIFY_TIMEOUT_S = 120.0
CHECK1 = (4, 64, 1.25)  # N, MiB per replica, bound on aioreplica / fastest NumPy
CHECK3 = 1.6
MIB = 1 << 20
T = TypeVar("T")


# --- aioreplica, imported from this checkout ------------------------------------------------


class _ReplicaContext(Protocol):
    @property
    def device(self) -> Any: ...

    def all_reduce(self, op: Any, value: Any) -> Awaitable[Any]: ...


class _Strategy(Protocol):
    def run(
        self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...] = ...
    ) -> Awaitable[Any]: ...

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]: ...


@dataclass
class _Api:
    strategy_cls: Callable[[list[str]], _Strategy]
    get_replica_context: Callable[[], _ReplicaContext]
    per_replica: Callable[[Sequence[Any]], Any]
    distributed_values: type
    sum_op: Any
    version: str


def _load_aioreplica() -> _Api | str:
    """The aioreplica API, or why it cannot be imported."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        mod = importlib.import_module("aioreplica")
        reduce_op = getattr(mod, "ReduceOp", None)
        return _Api(
            mod.MirroredStrategy,
            mod.get_replica_context,
            mod.PerReplica,
            mod.DistributedValues,
            reduce_op.SUM if reduce_op is not None else "sum",
            str(getattr(mod, "__version__", None) or _dist_version("aioreplica")),
        )
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


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


# --- event loops ----------------------------------------------------------------------------


class _Driver:
    """Runs coroutine functions on one kind of event loop (one asyncio loop, reused)."""

    def __init__(self, kind: str) -> None:
        self.kind, self._runner = kind, None if kind == "trio" else asyncio.Runner()
        if kind == "uvloop":
            import uvloop

            self._runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)

    def run(self, fn: Callable[[], Awaitable[T]]) -> T:
        if self._runner is not None:
            return self._runner.run(_await(fn))
        import trio

        return trio.run(_await, fn)

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()


async def _await(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()


async def _within(seconds: float, aw: Awaitable[T]) -> T:
    try:
        with anyio.fail_after(seconds):
            return await aw
    except TimeoutError:
        raise TimeoutError(f"verification step did not finish within {seconds} s") from None


async def _timed_async(step: Callable[[], Awaitable[object]], reps: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(reps):
        await step()
    return time.perf_counter_ns() - t0


def _timed_sync(step: Callable[[], object], reps: int) -> int:
    t0 = time.perf_counter_ns()
    for _ in range(reps):
        step()
    return time.perf_counter_ns() - t0


# --- results and cases ----------------------------------------------------------------------


@dataclass
class _Result:
    part: str  # "allreduce" | "compute"
    impl: str
    n: int
    mib: int
    status: str = "ok"  # ok | skipped | error
    reason: str = ""
    reps: int = 0
    samples_ns: list[int] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def per_call_ns(self) -> list[float]:
        return [s / self.reps for s in self.samples_ns] if self.status == "ok" else []

    @property
    def median_ms(self) -> float | None:
        t = self.per_call_ns
        return statistics.median(t) / 1e6 if t else None


@dataclass
class _Case:
    result: _Result
    sample: Callable[[int], int]  # reps -> elapsed ns
    verify: Callable[[], None]


def _one_sample(case: _Case, reps: int) -> int:
    gc.collect()
    return case.sample(reps)


def _calibrate(case: _Case, target_ns: int) -> int:
    reps = 1
    while True:
        elapsed = max(_one_sample(case, reps), 1)
        if elapsed >= target_ns // 5 or reps >= 1_000_000:
            return max(1, round(reps * target_ns / elapsed))
        reps = max(reps * 2, min(reps * 100, math.ceil(reps * target_ns / 2 / elapsed)))


def _guard(case: _Case, action: Callable[[_Case], object]) -> bool:
    """Run one harness action; an aioreplica or kernel failure is recorded, others raise."""
    try:
        action(case)
    except Exception as exc:
        r = case.result
        if r.impl not in ("aioreplica", "kernel-1t", "kernel-2t"):
            raise
        r.status, r.reason = "error", f"{type(exc).__name__}: {exc}"
        print(f"  {r.part} {r.impl} N={r.n} {r.mib} MiB failed: {r.reason}", file=sys.stderr)
        return False
    return True


def _run_interleaved(cases: list[_Case], samples: int, target_ns: int) -> None:
    for c in list(cases):
        if not _guard(c, lambda c: c.verify()) or not _guard(
            c, lambda c: setattr(c.result, "reps", _calibrate(c, target_ns))
        ):
            cases.remove(c)
    for _ in range(samples):  # A B C A B C ...
        for c in list(cases):
            if not _guard(c, lambda c: c.result.samples_ns.append(_one_sample(c, c.result.reps))):
                cases.remove(c)


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
    api: _Api | str | None,
    strategy: _Strategy | None,
    kernel: ModuleType | str,
    workers: _Workers,
    driver: _Driver,
    rows: dict[str, _Result],
) -> list[_Case]:
    size = mib * MIB // 4
    rng = np.random.default_rng(n * 1000 + mib)
    arrays = [rng.random(size, dtype=np.float32) for _ in range(n)]
    chain_out = np.zeros(size, np.float32)
    copy_out = np.zeros((n, size), np.float32)
    reference = functools.reduce(np.add, arrays)
    cases: list[_Case] = []

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

            cases.append(_Case(rows[impl], functools.partial(_timed_sync, fn), verify))

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

                cases.append(_Case(rows[impl], functools.partial(_timed_sync, fn), kverify))

    if "aioreplica" in impls and isinstance(api, _Api) and strategy is not None:
        get_ctx, strat, op = api.get_replica_context, strategy, api.sum_op
        per_replica = api.per_replica(arrays)

        async def step(x: Any) -> Any:
            return await get_ctx().all_reduce(op, x)

        def run_once() -> Any:
            return driver.run(lambda: strat.run(step, args=(per_replica,)))

        def aio_verify() -> None:
            result = driver.run(
                lambda: _within(VERIFY_TIMEOUT_S, strat.run(step, args=(per_replica,)))
            )
            wrapped = isinstance(result, api.distributed_values)
            values = strat.experimental_local_results(result)
            if not wrapped:  # regroup: every replica got this very object
                values = values * n
            info = _check_shared(values, n, arrays)
            info["run_returned"] = "PerReplica/Mirrored" if wrapped else "the one shared array"
            close_to_reference(values[0], "aioreplica")
            del result, values
            peaks = _traced_bytes(run_once, 3)
            info["allocated_bytes_per_warm_step"] = peaks
            info["outputs_allocated_per_warm_step"] = [round(p / (size * 4), 2) for p in peaks]
            rows["aioreplica"].info.update(info)

        cases.append(
            _Case(
                rows["aioreplica"],
                lambda reps: driver.run(
                    lambda: _timed_async(lambda: strat.run(step, args=(per_replica,)), reps)
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
    api: _Api | str | None,
    kernel: ModuleType | str,
    workers: _Workers,
    driver: _Driver,
) -> list[_Result]:
    results: list[_Result] = []
    for n in ns:
        strategy, strategy_error = None, ""
        if "aioreplica" in impls and isinstance(api, _Api):
            try:
                strategy = api.strategy_cls([f"cpu:{i}" for i in range(n)])
            except Exception as exc:
                strategy_error = f"MirroredStrategy(N={n}): {type(exc).__name__}: {exc}"
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
            _run_interleaved(cases, samples, target_ns)
            del cases
            gc.collect()
            line = "  ".join(f"{r.impl} {_fmt(r.median_ms)}" for r in rows.values())
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
    api: _Api | str | None,
    workers: _Workers,
    driver: _Driver,
) -> list[_Result]:
    size = COMPUTE_MIB * MIB // 8
    xs = [np.linspace(i, i + 1, size) for i in range(max(COMPUTE_REPLICAS))]
    reference = [np.empty(size) for _ in xs]
    for x, ref in zip(xs, reference, strict=True):
        _compute_work(x, ref)
    results: list[_Result] = []
    cases: list[_Case] = []
    if isinstance(api, _Api):
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
                    _Case(
                        res,
                        functools.partial(_timed_sync, functools.partial(workers.run_all, jobs)),
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
                strategy: _Strategy = strategy, args: Any = args, check: Any = check
            ) -> None:
                driver.run(lambda: _within(VERIFY_TIMEOUT_S, strategy.run(compute_step, args=args)))
                check()

            def asample(reps: int, strategy: _Strategy = strategy, args: Any = args) -> int:
                return driver.run(
                    lambda: _timed_async(lambda: strategy.run(compute_step, args=args), reps)
                )

            cases.append(_Case(res, asample, averify))
    _run_interleaved(cases, samples, target_ns)
    for r in results:
        print(
            f"compute {r.impl} replicas={r.n}  {_fmt(_throughput(r))} steps/s x replicas",
            file=sys.stderr,
            flush=True,
        )
    return results


async def _compute_step(get_ctx: Callable[[], _ReplicaContext], x: Any, y: Any) -> None:
    await get_ctx().device.run(_compute_work, x, y)


def _throughput(r: _Result) -> float | None:
    t = r.median_ms
    return None if t is None or t <= 0 else r.n * 1e3 / t


# --- reporting --------------------------------------------------------------------------------


def _fmt(x: float | None, width: int = 0) -> str:
    if x is None:
        return "n/a".rjust(width)
    text = f"{x:.3g}" if abs(x) < 10 else f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}"
    return text.rjust(width)


def _times(x: float | None) -> str:
    return "n/a" if x is None else f"{_fmt(x)}x"


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


def _checks(
    results: list[_Result], table: list[dict[str, Any]], compute: dict[str, Any]
) -> list[dict[str, str]]:
    checks = []
    n1, mib1, bound = CHECK1
    row = next((t for t in table if (t["n"], t["mib_per_replica"]) == (n1, mib1)), None)
    name1 = f"(1) {n1} x {mib1} MiB float32 SUM all_reduce within {bound}x of the fastest NumPy sum"
    ran = set(row["median_ms"]) if row else set()
    if row is None:
        checks.append({"name": name1, "status": "SKIP", "detail": "not in this run"})
    elif "aioreplica" not in ran or not ran & set(NUMPY_IMPLS):
        detail = "aioreplica or both NumPy rows left out of this run"
        checks.append({"name": name1, "status": "SKIP", "detail": detail})
    else:
        ratio = row["aioreplica_over_fastest_numpy"]
        ms = row["median_ms"]
        reasons = {
            r.reason
            for r in results
            if r.part == "allreduce" and (r.n, r.mib) == (n1, mib1) and r.reason
        }
        detail = (
            f"aioreplica {_fmt(ms.get('aioreplica'))} ms, {row['fastest_numpy']} "
            f"{_fmt(ms.get(row['fastest_numpy']) if row['fastest_numpy'] else None)} ms: "
            f"{_times(ratio)} (median of paired ratios)"
        )
        if ratio is None:
            detail += "; not measured: " + ("; ".join(sorted(reasons)) or "no samples")
        if (k2t := row["kernel2t_over_fastest_numpy"]) is not None:
            detail += f"; the kernel alone (kernel-2t): {_times(k2t)}"
        checks.append(
            {
                "name": name1,
                "status": "PASS" if ratio is not None and ratio <= bound else "FAIL",
                "detail": detail,
            }
        )

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
            f"aioreplica {_fmt(c['throughput_1'])} -> {_fmt(c['throughput_2'])} steps/s x "
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
    return checks


def _print_report(
    results: list[_Result],
    table: list[dict[str, Any]],
    compute: dict[str, Any],
    impls: list[str],
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
            cells = "".join(_fmt(t["median_ms"].get(i), w) for i in timed)
            print(
                f"{t['n']:>3}{t['mib_per_replica']:>5}{_fmt(t['copy_gb_s'], 11)}{cells}"
                f"{_fmt(t['aioreplica_over_fastest_numpy'], 11)}"
                f"{_fmt(t['kernel2t_over_fastest_numpy'], 11)}"
                f"{_fmt(t['aioreplica_input_gb_s'], 10)}"
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
            print(f"{label:>9}" + "".join(_fmt(c[key], 12) for c in compute.values()))
    for r in results:
        if r.status != "ok":
            print(f"  {r.part} {r.impl} N={r.n} {r.mib} MiB: {r.status}: {r.reason}")
    print()
    for c in checks:
        print(f"{c['status']}  {c['name']}: {c['detail']}")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="0.05 s samples, 3 per configuration")
    p.add_argument(
        "--loop",
        choices=("asyncio", "uvloop", "trio"),
        default="asyncio",
        help="event loop for aioreplica",
    )
    p.add_argument("--part", default="a,b", help="a (all_reduce), b (compute), or a,b")
    p.add_argument("--only", default=",".join(A_IMPLS), help=f"subset of {','.join(A_IMPLS)}")
    p.add_argument("--n", default=",".join(map(str, N_VALUES)), help="replica counts (part a)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)), help="MiB per replica")
    p.add_argument(
        "--samples",
        type=int,
        help="samples per configuration (default 7, 3 quick; part b takes 3x as many)",
    )
    p.add_argument("--json", type=Path, default=Path("bench-results/bench_collectives.json"))
    args = p.parse_args(argv)
    parts = {s.strip() for s in args.part.split(",") if s.strip()}
    chosen = {s.strip() for s in args.only.split(",") if s.strip()}
    if not parts or parts - {"a", "b"}:
        p.error(f"--part {args.part!r}: choose from a,b")
    if not chosen or chosen - set(A_IMPLS):
        p.error(f"--only {args.only!r}: choose from {','.join(A_IMPLS)}")
    impls = [i for i in A_IMPLS if i in chosen]
    ns, sizes = _ints(args.n), _ints(args.sizes)
    samples = args.samples or (3 if args.quick else 7)
    target_ns = 50_000_000 if args.quick else 200_000_000

    loaded = _load_aioreplica()
    kernel = _load_kernel()
    for what, value in (("aioreplica", loaded), ("the host kernel", kernel)):
        if isinstance(value, str):
            print(
                f"WARNING: {what} cannot be loaded ({value}); its rows are not run.",
                file=sys.stderr,
            )
    driver = _Driver(args.loop)
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
    finally:
        driver.close()
        workers.close()
    table = _allreduce_table([r for r in results if r.part == "allreduce"])
    compute = _compute_table([r for r in results if r.part == "compute"]) if "b" in parts else {}
    checks = _checks(results, table, compute)
    _print_report(results, table, compute, impls, checks)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": sys.version,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "loop": args.loop,
        "quick": args.quick,
        "samples": samples,
        "samples_part_b": args.samples or 3 * samples,
        "target_sample_s": target_ns / 1e9,
        "wall_s": round(time.perf_counter() - t0, 1),
        "versions": {d: _dist_version(d) for d in ("numpy", "anyio", "trio", "uvloop")},
        "aioreplica": loaded.version if isinstance(loaded, _Api) else f"not importable: {loaded}",
        "kernel": (
            {"block_bytes": kernel.BLOCK_BYTES, "min_range_bytes": kernel.MIN_RANGE_BYTES}
            if not isinstance(kernel, str)
            else f"not loadable: {kernel}"
        ),
    }
    doc = {
        "meta": meta,
        "results": [
            asdict(r) | {"median_ms": r.median_ms, "per_call_ns": r.per_call_ns} for r in results
        ],
        "allreduce_table": table,
        "compute_table": compute,
        "checks": checks,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {args.json} ({meta['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
