"""Scheduler overhead of aioreplica against an asyncio floor and a thread-per-replica baseline.

A step runs a step function on N replicas; each replica makes k ``merge_call``s. The calls
pass one of four kinds of arguments (``--args``, default all):

none    ``await ctx.merge_call(_noop)``: no arguments, and the merge function does nothing, so
        regroup and select have nothing to do. N in 2, 8, 64, 1024, 10000; k in 0, 1, 10.
scalar  ``await ctx.merge_call(identity, args=(x,))``, x the replica's own Python float
        (``float(replica_id)``);
array   the same, x a NumPy array of 16 float32 (``np.full(16, replica_id, np.float32)``);
dict3   the same, x ``{"a": float, "b": array, "c": int}`` (those two values and the replica
        id). ``identity(strategy, x)`` returns x as the merge function gets it, regrouped (a
        ``PerReplica``; for dict3 a dict of three), so every round regroups the replicas'
        arguments and each replica resumes with its own slice (select): the object it passed,
        for dict3 a dict of the leaves it passed. Every replica's x is made before the timing
        and looked up once per step by ``replica_id_in_sync_group``. N in 2, 8, 64, 1024; k in
        0 and 10 (what the marginal cost needs).

For each N one run times:

aioreplica  ``await strategy.run(step, args=(k,))``, the strategy
            (``MirroredStrategy(["cpu:0", ...])``) created once per N, outside the timing.
floor       The leanest asyncio equivalent: N tasks from ``loop.create_task`` awaited with one
            ``asyncio.gather``; a merge round is an arrival counter plus one shared future (the
            last task to arrive calls the merge function, resolves the future with its result
            and replaces it; the others await it). With arguments each task first stores its x
            in a list slot indexed by its replica id (the floor's regroup; a dict3 is stored
            whole, not per leaf), the last to arrive hands that list to the merge function and
            starts a new list for the next round, and each task takes ``result[replica_id]``
            (the floor's select). No locks, no anyio. Under ``--loop uvloop`` it runs on
            uvloop; under ``--loop trio`` on a plain asyncio loop (labelled in the tables).
threads     TensorFlow's ``mirrored_run.py`` protocol (``_call_for_each_replica``,
            ``_MirroredReplicaThread``): per step one ``threading.Thread`` subclass per replica,
            holding ``should_run`` / ``has_paused`` events, is created and started; the
            coordinator hands control to each replica in turn (set ``should_run``, wait
            ``has_paused``); a replica runs to its next merge point or its end, records its
            merge arguments, sets ``has_paused`` and waits ``should_run``; when all have paused
            the coordinator runs the merge function once, and the next round of handoffs
            resumes them; the threads are joined at the end of the step. Simplified from TF: no
            ``Coordinator`` (a replica's exception is kept on its thread and re-raised by the
            coordinator, a stop flag replaces ``coord.should_stop()``); no graph, name-scope,
            variable-scope, device or eager-context capture; ``regroup``/``select_replica``
            reduced to zipping the merge arguments and giving every replica the same result;
            only the sequential handoff (TF's ``run_concurrently = False``); daemon threads.
            Run for the ``none`` kind only (no merge arguments); not for N = 10000, nor for
            N >= 1024 under ``--quick``.

For each (kind, N, k) every implementation runs one untimed step with a counting merge
function (all N replicas must finish, the merge function must run exactly k times; with
arguments it returns its argument, and each replica checks that its last ``merge_call`` gave
back its own value: the same object, for dict3 the same three leaves), is calibrated so that
one sample (``time.perf_counter_ns``) lasts about 0.2 s (0.05 s with ``--quick``), then the
samples are taken interleaved (A B C A B C ..., over the implementations, kinds and k of one
N): on a shared, noisy machine absolute times drift but ratios measured close together hold.
Each time is the fastest of the samples (noise only ever adds time, and a marginal cost is a
difference of two times, so it needs both at their least noisy); the JSON keeps every sample and
the medians too. ``gc.collect()`` runs before each sample and the GC is off during it.

Run from the repository root (aioreplica is imported from this checkout)::

    .venv/bin/python devices/bench_scheduler.py --quick          # under a minute
    .venv/bin/python devices/bench_scheduler.py                  # a few minutes
    .venv/bin/python devices/bench_scheduler.py --loop trio      # or uvloop
    .venv/bin/python devices/bench_scheduler.py --only floor,threads
    .venv/bin/python devices/bench_scheduler.py --args none,scalar

Many steps per call (aioreplica only, N in 8 and 64 where measured, k in 0 and 1): the same
``STEPS`` steps, each handed its replica's slice of one element (a ``PerReplica`` of scalars),
run as ``for x in elements: await strategy.run(step, args=(x,))`` ("run per step") and as one
``await strategy.run_steps(step, iterator, STEPS)`` over an async iterator of the same elements,
which starts the replicas once and hands out each element at a merge round; interleaved like
the rest. A checkout without ``run_steps`` reports it as skipped.

Output. Table 1: µs per step (best of the samples), one row per (N, kind, k). Table 2: one
block per kind: per N, the marginal cost of one merge round for one replica,
``(t(k=10) - t(k=0)) / (10 * N)`` µs, then ``aio/floor`` (1.0 = no overhead over the floor) and,
for ``none``, ``threads/aio`` (how many times cheaper than threads). Table 3: µs per step of
"run per step" and "run_steps", and their ratio. Table 4, step start: the ``none`` k = 0 rows
of Table 1, ``run()`` of N replicas that make no ``merge_call`` against N plain tasks, and
their ratio. Checks, PASS / FAIL (SKIP when ``--only`` / ``--n`` / ``--args`` left out what one
needs): (a) ``none`` and (a2) ``scalar``: aioreplica marginal within 2x of the floor for
N = 8, 64, 1024; (b) aioreplica marginal at least 10x below threads for N = 8 (``none``);
(c) 10,000 replicas x 10 merge_calls completed (``none``); (d) step start: aioreplica within 2x
of the floor at k = 0 for N = 8 and 64. The aio/floor marginals of ``array`` and ``dict3`` at
N = 8, 64, 1024 follow as INFO lines, not judged. Metadata, raw samples and checks go to
``--json`` (default ``bench-results/bench_scheduler.json``): ``results`` and
``marginal_us_per_round_per_replica`` hold the ``none`` kind (what ``compare_checkouts.py``
reads), ``results_with_args`` the other kinds, ``marginal_by_args`` every kind, ``step_start``
Table 4, ``not_judged`` the INFO lines. The exit status is 0 whatever the checks say; non-zero
means the script itself crashed.
"""

from __future__ import annotations

import asyncio
import math
import reprlib
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from _benchlib import (
    Api,
    Case,
    Driver,
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
    from collections.abc import Awaitable, Callable

IMPLS = ("aioreplica", "floor", "threads")
N_VALUES = (2, 8, 64, 1024, 10_000)
K_VALUES = (0, 1, 10)
K_HI = K_VALUES[-1]
ARG_KINDS = ("none", "scalar", "array", "dict3")
ARRAY_LEN = 16
ARG_TEXT = {
    "none": "merge_call(_noop)",
    "scalar": "merge_call(identity, args=(float,))",
    "array": f"merge_call(identity, args=(float32[{ARRAY_LEN}],))",
    "dict3": f"merge_call(identity, args=({{a: float, b: float32[{ARRAY_LEN}], c: int}},))",
}
ARG_N = (2, 8, 64, 1024)  # the N at which the kinds other than none run
ARG_K = (0, K_HI)
VERIFY_TIMEOUT_S = 120.0
MAX_REPS = 10_000_000


def _noop(strategy: object, *args: object) -> None:
    return None


def _identity(strategy: object, x: object) -> object:
    return x


def _arg_values(kind: str, n: int) -> list[Any]:
    """Each replica's merge argument, by replica id, made once before the timing."""
    if kind == "scalar":
        return [float(rid) for rid in range(n)]
    arrays = [np.full(ARRAY_LEN, rid, np.float32) for rid in range(n)]
    if kind == "array":
        return arrays
    if kind == "dict3":
        return [{"a": float(rid), "b": arrays[rid], "c": rid} for rid in range(n)]
    raise ValueError(f"no argument values for kind {kind!r}")


def _is_own(got: object, mine: object) -> bool:
    """``got`` is the value the replica passed: the same object; a dict of the same leaves."""
    if isinstance(mine, dict):
        return (
            isinstance(got, dict)
            and got.keys() == mine.keys()
            and all(got[key] is leaf for key, leaf in mine.items())
        )
    return got is mine


class _Count:
    """Counting merge functions and finish counter for the untimed verification step."""

    def __init__(self, impl: str, n: int, k: int, kind: str = "none") -> None:
        self.impl, self.n, self.k, self.kind = impl, n, k, kind
        self.merges = self.finished = self.checked = 0

    def merge(self, strategy: object, *args: object) -> None:
        self.merges += 1

    def identity(self, strategy: object, x: object) -> object:
        self.merges += 1
        return x

    def returned(self, got: object, mine: object) -> None:
        """A replica's check that its last ``merge_call`` gave back its own value."""
        if not _is_own(got, mine):
            raise RuntimeError(
                f"{self.impl} N={self.n} k={self.k} args={self.kind}: a replica passed "
                f"{reprlib.repr(mine)} and got back {reprlib.repr(got)}"
            )
        self.checked += 1

    def check(self) -> None:
        want_checked = self.n if self.kind != "none" and self.k > 0 else 0
        if (self.merges, self.finished, self.checked) != (self.k, self.n, want_checked):
            raise RuntimeError(
                f"{self.impl} N={self.n} k={self.k} args={self.kind}: merge function ran "
                f"{self.merges} times, {self.finished}/{self.n} replicas finished, "
                f"{self.checked}/{want_checked} checked their own value"
            )


# --- asyncio floor -------------------------------------------------------------------------


class _Barrier:
    __slots__ = ("arrived", "future", "loop", "merge_fn", "n", "slots")

    def __init__(self, n: int, merge_fn: Callable[..., Any], slots: bool = False) -> None:
        self.loop = asyncio.get_running_loop()
        self.n, self.merge_fn, self.arrived = n, merge_fn, 0
        self.slots: list[Any] = [None] * n if slots else []
        self.future: asyncio.Future[Any] = self.loop.create_future()


async def _floor_replica(b: _Barrier, k: int, count: _Count | None) -> None:
    for _ in range(k):
        b.arrived += 1
        if b.arrived == b.n:
            b.arrived = 0
            b.merge_fn(None)
            future, b.future = b.future, b.loop.create_future()
            future.set_result(None)
        else:
            await b.future
    if count is not None:
        count.finished += 1


async def _floor_step(n: int, k: int, count: _Count | None = None) -> None:
    b = _Barrier(n, _noop if count is None else count.merge)
    await asyncio.gather(*[b.loop.create_task(_floor_replica(b, k, count)) for _ in range(n)])


async def _floor_arg_replica(
    b: _Barrier, k: int, rid: int, x: object, count: _Count | None
) -> None:
    got: object = None
    for _ in range(k):
        b.slots[rid] = x
        b.arrived += 1
        if b.arrived == b.n:
            b.arrived = 0
            slots, b.slots = b.slots, [None] * b.n
            result = b.merge_fn(None, slots)
            future, b.future = b.future, b.loop.create_future()
            future.set_result(result)
        else:
            result = await b.future
        got = result[rid]
    if count is not None:
        if k:
            count.returned(got, x)
        count.finished += 1


async def _floor_arg_step(n: int, k: int, values: list[Any], count: _Count | None = None) -> None:
    b = _Barrier(n, _identity if count is None else count.identity, slots=True)
    await asyncio.gather(
        *[
            b.loop.create_task(_floor_arg_replica(b, k, rid, x, count))
            for rid, x in enumerate(values)
        ]
    )


# --- one thread per replica, TensorFlow's mirrored_run.py handoff --------------------------


class _StopRequested(Exception):
    pass


class _ReplicaThread(threading.Thread):
    def __init__(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        super().__init__(daemon=True)
        self.main_fn, self.main_args = fn, args
        self.main_result: object = None
        self.done = self.stop = False
        self.error: BaseException | None = None
        self.merge_fn: Callable[..., object] = _noop
        self.merge_args: tuple[object, ...] = ()
        self.merge_result: object = None
        self.should_run = threading.Event()
        self.has_paused = threading.Event()

    def run(self) -> None:
        self.should_run.wait()
        self.should_run.clear()
        try:
            if not self.stop:
                self.main_result = self.main_fn(*self.main_args)
                self.done = True
        except BaseException as exc:
            self.error = exc
        finally:
            self.has_paused.set()


def _thread_merge_call(merge_fn: Callable[..., object], *args: object) -> object:
    t = threading.current_thread()
    if not isinstance(t, _ReplicaThread):
        raise RuntimeError("merge_call outside a replica thread")
    t.merge_fn, t.merge_args = merge_fn, args
    t.has_paused.set()
    t.should_run.wait()
    t.should_run.clear()
    if t.stop:
        raise _StopRequested
    return t.merge_result


def _thread_run(fn: Callable[..., object], n: int, args: tuple[object, ...]) -> list[object]:
    threads = [_ReplicaThread(fn, args) for _ in range(n)]
    for t in threads:
        t.start()
    failed = True
    try:
        all_done = False
        while not all_done:
            done = []
            for t in threads:
                t.should_run.set()
                t.has_paused.wait()
                t.has_paused.clear()
                if t.error is not None:
                    raise t.error
                done.append(t.done)
            all_done = all(done)
            if not all_done:
                if any(done):
                    raise RuntimeError("replicas made different numbers of merge_call() calls")
                merge_args = tuple(zip(*(t.merge_args for t in threads), strict=True))
                result = threads[0].merge_fn(None, *merge_args)
                for t in threads:
                    t.merge_result = result
        failed = False
    finally:
        for t in threads:
            t.stop = failed
            t.should_run.set()
        for t in threads:
            t.join()
    return [t.main_result for t in threads]


def _thread_step(k: int, count: _Count | None = None) -> None:
    for _ in range(k):
        _thread_merge_call(_noop if count is None else count.merge)
    if count is not None:
        count.finished += 1


# --- harness -------------------------------------------------------------------------------


@dataclass
class _Result:
    impl: str
    n: int
    k: int
    args: str = "none"  # the kind of merge arguments, one of ARG_KINDS
    status: str = "ok"  # ok | skipped | error
    reason: str = ""
    reps: int = 0
    samples_ns: list[int] = field(default_factory=list)

    @property
    def tolerates_failure(self) -> bool:
        return self.impl not in ("floor", "threads")

    @property
    def label(self) -> str:
        return f"{self.impl} N={self.n} k={self.k}" + (
            "" if self.args == "none" else f" args={self.args}"
        )

    @property
    def median_us(self) -> float | None:
        if self.status != "ok" or not self.samples_ns:
            return None
        return statistics.median(s / self.reps / 1e3 for s in self.samples_ns)

    @property
    def best_us(self) -> float | None:
        """The fastest sample: noise on a shared machine only ever adds time."""
        if self.status != "ok" or not self.samples_ns:
            return None
        return min(s / self.reps / 1e3 for s in self.samples_ns)


def _make_case(
    res: _Result, api: Api | str | None, strategy: Strategy | None, aio: Driver, floor: Driver
) -> Case[_Result]:
    n, k, kind = res.n, res.k, res.args
    count = _Count(res.impl, n, k, kind)
    if kind != "none":
        if res.impl == "threads":
            raise RuntimeError("the threads baseline runs without merge arguments only")
        return _make_arg_case(res, api, strategy, aio, floor, count)
    if res.impl == "floor":

        def sample(reps: int) -> int:
            return floor.run(lambda: timed_async(lambda: _floor_step(n, k), reps))

        def verify() -> None:
            floor.run(lambda: _floor_step(n, k, count))
            count.check()

        return Case(res, sample, verify)
    if res.impl == "threads":

        def thread_sample(reps: int) -> int:
            return timed_sync(lambda: _thread_run(_thread_step, n, (k,)), reps)

        def thread_verify() -> None:
            _thread_run(_thread_step, n, (k, count))
            count.check()

        return Case(res, thread_sample, thread_verify)
    if not isinstance(api, Api) or strategy is None:
        raise RuntimeError("aioreplica is not available")
    get_ctx, strat = api.get_replica_context, strategy

    async def step(k: int) -> None:
        ctx = get_ctx()
        for _ in range(k):
            await ctx.merge_call(_noop)

    async def counting_step(k: int) -> None:
        ctx = get_ctx()
        for _ in range(k):
            await ctx.merge_call(count.merge)
        count.finished += 1

    return _aio_case(res, aio, strat, step, counting_step, count)


def _aio_case(
    res: _Result,
    aio: Driver,
    strat: Strategy,
    step: Callable[[int], Awaitable[None]],
    counting_step: Callable[[int], Awaitable[None]],
    count: _Count,
) -> Case[_Result]:
    """aioreplica's case: ``step`` timed, ``counting_step`` run once and checked."""
    k = res.k

    def aio_sample(reps: int) -> int:
        return aio.run(lambda: timed_async(lambda: strat.run(step, args=(k,)), reps))

    def aio_verify() -> None:
        aio.run(lambda: within(VERIFY_TIMEOUT_S, strat.run(counting_step, args=(k,))))
        count.check()

    return Case(res, aio_sample, aio_verify)


def _make_arg_case(
    res: _Result,
    api: Api | str | None,
    strategy: Strategy | None,
    aio: Driver,
    floor: Driver,
    count: _Count,
) -> Case[_Result]:
    """A case whose merge calls pass each replica's own argument of kind ``res.args``."""
    n, k = res.n, res.k
    values = _arg_values(res.args, n)
    if res.impl == "floor":

        def sample(reps: int) -> int:
            return floor.run(lambda: timed_async(lambda: _floor_arg_step(n, k, values), reps))

        def verify() -> None:
            floor.run(lambda: _floor_arg_step(n, k, values, count))
            count.check()

        return Case(res, sample, verify)
    if not isinstance(api, Api) or strategy is None:
        raise RuntimeError("aioreplica is not available")
    get_ctx, strat = api.get_replica_context, strategy

    async def step(k: int) -> None:
        ctx = get_ctx()
        x = values[ctx.replica_id_in_sync_group]
        for _ in range(k):
            await ctx.merge_call(_identity, args=(x,))

    async def counting_step(k: int) -> None:
        ctx = get_ctx()
        x = values[ctx.replica_id_in_sync_group]
        got: object = None
        for _ in range(k):
            got = await ctx.merge_call(count.identity, args=(x,))
        if k:
            count.returned(got, x)
        count.finished += 1

    return _aio_case(res, aio, strat, step, counting_step, count)


# --- many steps per call -------------------------------------------------------------------

STEPS = 20  # steps per sample repetition, in both forms
STEPS_N = (8, 64)
STEPS_K = (0, 1)
STEPS_IMPLS = ("run per step", "run_steps")


class _Elements:
    """An async iterator over elements made beforehand, as a distributed dataset yields them."""

    def __init__(self, items: list[object]) -> None:
        self._items = iter(items)

    def __aiter__(self) -> _Elements:
        return self

    async def __anext__(self) -> object:
        try:
            return next(self._items)
        except StopIteration:
            raise StopAsyncIteration from None


def _steps_case(res: _Result, api: Api, strategy: Strategy, aio: Driver) -> Case[_Result]:
    n, k = res.n, res.k
    count = _Count(res.impl, n, k * STEPS)
    get_ctx, strat = api.get_replica_context, strategy
    elements = [api.per_replica([float(step)] * n) for step in range(STEPS)]
    run_steps = getattr(strat, "run_steps", None)

    async def step(x: object, merge: Callable[..., object] = _noop) -> None:
        ctx = get_ctx()
        for _ in range(k):
            await ctx.merge_call(merge)

    async def counting(x: object) -> None:
        await step(x, count.merge)
        count.finished += 1

    async def per_step(fn: Callable[..., Awaitable[None]]) -> None:
        for x in elements:
            await strat.run(fn, args=(x,))

    async def in_one_call(fn: Callable[..., Awaitable[None]]) -> None:
        assert run_steps is not None
        await run_steps(fn, _Elements(elements), STEPS)

    loop = per_step if res.impl == "run per step" else in_one_call

    def sample(reps: int) -> int:
        return aio.run(lambda: timed_async(lambda: loop(step), reps))

    def verify() -> None:
        if res.impl == "run_steps" and run_steps is None:
            raise RuntimeError("this checkout has no strategy.run_steps")
        aio.run(lambda: within(VERIFY_TIMEOUT_S, loop(counting)))
        count.finished //= STEPS  # every replica finishes every step, in both forms
        count.check()

    return Case(res, sample, verify)


def _measure_steps(
    ns: list[int], samples: int, target_ns: int, api: Api | str | None, aio: Driver
) -> list[_Result]:
    results: list[_Result] = []
    if not isinstance(api, Api):
        return results
    for n in (n for n in ns if n in STEPS_N):
        strategy, error = host_strategy(api, n, ["aioreplica"])
        cases = []
        for k in STEPS_K:
            for impl in STEPS_IMPLS:
                res = _Result(impl, n, k)
                results.append(res)
                if strategy is None:
                    res.status, res.reason = "error", error
                else:
                    cases.append(_steps_case(res, api, strategy, aio))
        run_interleaved(cases, samples, target_ns, max_reps=MAX_REPS, gc_off=True)
    return results


def _print_steps(results: list[_Result]) -> None:
    if not results:
        return
    w = 16
    print(
        f"\nTable 3: µs per step, {STEPS} steps per call\n{'N':>6}{'k':>4}"
        + "".join(impl.rjust(w) for impl in STEPS_IMPLS)
        + "per step/run_steps".rjust(w + 4)
    )
    for i in range(0, len(results), 2):
        run, steps = results[i : i + 2]
        us = [None if r.best_us is None else r.best_us / STEPS for r in (run, steps)]
        cells = [
            fmt(u, w) if r.status == "ok" else r.status.rjust(w)
            for u, r in zip(us, (run, steps), strict=True)
        ]
        print(f"{run.n:>6}{run.k:>4}{''.join(cells)}{fmt(_ratio(us[0], us[1]), w + 4)}")
        for r in (run, steps):
            if r.status != "ok":
                print(f"  {r.impl} N={r.n} k={r.k}: {r.status}: {r.reason}")


def _skip_reason(impl: str, n: int, quick: bool, api: Api | str | None) -> str:
    if impl == "aioreplica" and isinstance(api, str):
        return f"aioreplica not importable: {api}"
    if impl == "threads" and n >= 10_000:
        return "not run for N = 10000 (one OS thread per replica, created every step)"
    if impl == "threads" and quick and n >= 1024:
        return "not run for N >= 1024 under --quick"
    return ""


def _measure(
    impls: list[str],
    kinds: list[str],
    ns: list[int],
    samples: int,
    target_ns: int,
    quick: bool,
    api: Api | str | None,
    aio: Driver,
    floor: Driver,
) -> list[_Result]:
    results: list[_Result] = []
    for n in ns:
        strategy, strategy_error = host_strategy(api, n, impls)
        rows: list[list[_Result]] = []  # one per (kind, k), one result per implementation
        for kind in kinds:
            if kind == "none":
                rows += [[_Result(impl, n, k) for impl in impls] for k in K_VALUES]
            elif n in ARG_N and (arg_impls := [i for i in impls if i != "threads"]):
                rows += [[_Result(impl, n, k, kind) for impl in arg_impls] for k in ARG_K]
        cases: list[Case[_Result]] = []
        for res in (r for row in rows for r in row):
            results.append(res)
            if reason := _skip_reason(res.impl, n, quick, api):
                res.status, res.reason = "skipped", reason
            elif res.impl == "aioreplica" and strategy_error:
                res.status, res.reason = "error", strategy_error
            else:
                cases.append(_make_case(res, api, strategy, aio, floor))
        # interleaved over implementations, kinds and k: A B C A B C ...
        run_interleaved(cases, samples, target_ns, max_reps=MAX_REPS, gc_off=True)
        for row in rows:
            line = "  ".join(f"{r.impl} {fmt(r.best_us)}" for r in row)
            where = f"N={n:>5} {row[0].args:>6} k={row[0].k:>2}"
            print(f"{where}  {line}  (µs/step)", file=sys.stderr, flush=True)
    return results


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b if b > 0 else math.inf


Marginals = dict[str, dict[int, dict[str, float | None]]]


def _marginals(results: list[_Result]) -> Marginals:
    """(t(k=10) - t(k=0)) / (10 * N) in µs, per kind of arguments, N and implementation."""
    t = {(r.args, r.impl, r.n, r.k): r.best_us for r in results}
    out: Marginals = {}
    for kind, impl, n, k in t:
        if k == 0:
            hi, lo = t.get((kind, impl, n, K_HI)), t[(kind, impl, n, 0)]
            m = None if hi is None or lo is None else (hi - lo) / (K_HI * n)
            out.setdefault(kind, {}).setdefault(n, {})[impl] = m
    return out


def _step_start(results: list[_Result]) -> dict[int, dict[str, float | None]]:
    """Per N: µs per step at k = 0 without arguments for aioreplica and the floor, and their
    ratio."""
    t = {(r.impl, r.n): r.best_us for r in results if r.args == "none" and r.k == 0}
    out: dict[int, dict[str, float | None]] = {}
    for _, n in t:
        aio, floor = t.get(("aioreplica", n)), t.get(("floor", n))
        out[n] = {"aioreplica": aio, "floor": floor, "aio/floor": _ratio(aio, floor)}
    return out


def _checks(
    results: list[_Result],
    marg: Marginals,
    start: dict[int, dict[str, float | None]],
    impls: list[str],
    kinds: list[str],
    ns: list[int],
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The checks, and the ratios reported without a bar (status INFO)."""

    def check(
        name: str, need: list[str], kind: str, need_n: list[int], ok: bool | None, detail: str
    ) -> dict[str, str]:
        left = [i for i in need if i not in impls] + [f"N={n}" for n in need_n if n not in ns]
        left += [] if kind in kinds else [f"args={kind}"]
        if left:
            return {"name": name, "status": "SKIP", "detail": f"not in this run: {left}"}
        if ok is None:
            why = sorted(
                {
                    f"{r.label}: {r.reason}"
                    for r in results
                    if r.status != "ok" and r.impl in need and r.n in need_n and r.args == kind
                }
            )
            detail += "; not measured: " + ("; ".join(why) or "no samples")
        return {"name": name, "status": "PASS" if ok else "FAIL", "detail": detail}

    def m(kind: str, impl: str, n: int) -> float | None:
        return marg.get(kind, {}).get(n, {}).get(impl)

    def aio_floor(kind: str) -> tuple[bool | None, str]:
        ra = {n: _ratio(m(kind, "aioreplica", n), m(kind, "floor", n)) for n in (8, 64, 1024)}
        ok = None if None in ra.values() else all(v is not None and v <= 2 for v in ra.values())
        return ok, "aioreplica/floor " + ", ".join(f"N={n}: {fmt(v)}" for n, v in ra.items())

    rb = _ratio(m("none", "threads", 8), m("none", "aioreplica", 8))
    big = next(
        (r for r in results if (r.impl, r.n, r.k, r.args) == ("aioreplica", 10_000, 10, "none")),
        None,
    )
    ok_c = None if big is None or big.status != "ok" else True
    detail_c = (
        "not run"
        if big is None
        else big.reason
        or (
            f"all replicas finished, 10 merges per step; {len(big.samples_ns)} samples of "
            f"{big.reps} step(s), best {fmt(big.best_us)} µs/step"
        )
    )
    rd = {n: start.get(n, {}).get("aio/floor") for n in (8, 64)}
    ok_d = None if None in rd.values() else all(v is not None and v <= 2 for v in rd.values())
    aio_floor_n = ["aioreplica", "floor"]
    checks = [
        check(
            "(a) aioreplica marginal within 2x of floor, N=8/64/1024",
            aio_floor_n,
            "none",
            [8, 64, 1024],
            *aio_floor("none"),
        ),
        check(
            "(a2) scalar args: aioreplica marginal within 2x of floor, N=8/64/1024",
            aio_floor_n,
            "scalar",
            [8, 64, 1024],
            *aio_floor("scalar"),
        ),
        check(
            "(b) aioreplica marginal >= 10x below threads, N=8",
            ["aioreplica", "threads"],
            "none",
            [8],
            None if rb is None else rb >= 10,
            f"threads/aioreplica N=8: {fmt(rb)}",
        ),
        check(
            "(c) 10,000 replicas x 10 merge_calls completed",
            ["aioreplica"],
            "none",
            [10_000],
            ok_c,
            detail_c,
        ),
        check(
            "(d) step start (k=0) within 2x of floor, N=8/64",
            aio_floor_n,
            "none",
            [8, 64],
            ok_d,
            "aioreplica/floor " + ", ".join(f"N={n}: {fmt(v)}" for n, v in rd.items()),
        ),
    ]
    infos = [
        {
            "name": f"{kind} args: aioreplica marginal over floor (not judged)",
            "status": "INFO",
            "detail": aio_floor(kind)[1],
        }
        for kind in ("array", "dict3")
        if kind in kinds and all(i in impls for i in aio_floor_n)
    ]
    return checks, infos


def _cell(r: _Result | None, w: int) -> str:
    """Table 1's cell: best µs per step, the status when not measured, "-" when not run."""
    if r is None:
        return "-".rjust(w)
    return fmt(r.best_us, w) if r.status == "ok" else r.status.rjust(w)


def _print_report(
    results: list[_Result], marg: Marginals, impls: list[str], labels: dict[str, str]
) -> None:
    w = max(len(s) for s in labels.values()) + 2
    heads = "".join(labels[i].rjust(w) for i in impls)
    print(f"\nTable 1: µs per step, best of the samples\n{'N':>6}{'args':>8}{'k':>4}{heads}")
    rows: dict[tuple[int, str, int], dict[str, _Result]] = {}
    for r in results:
        rows.setdefault((r.n, r.args, r.k), {})[r.impl] = r
    for (n, kind, k), row in rows.items():
        print(f"{n:>6}{kind:>8}{k:>4}{''.join(_cell(row.get(i), w) for i in impls)}")
    if any(r.args != "none" for r in results) and "threads" in impls:
        print("  threads: run without merge arguments only (-)")
    print(
        f"\nTable 2: marginal µs per merge round per replica, (t(k={K_HI}) - t(k=0)) / ({K_HI} * N)"
    )
    for kind, by_n in marg.items():
        cols = [i for i in impls if any(i in m for m in by_n.values())]
        extra = ["aio/floor"] + (["threads/aio"] if "threads" in cols else [])
        names = [labels[i] for i in cols] + extra
        print(f"args={kind}: {ARG_TEXT[kind]}\n{'N':>6}{''.join(s.rjust(w) for s in names)}")
        for n, m in by_n.items():
            ratios = [_ratio(m.get("aioreplica"), m.get("floor"))]
            if "threads" in cols:
                ratios.append(_ratio(m.get("threads"), m.get("aioreplica")))
            values = [m.get(i) for i in cols] + ratios
            print(f"{n:>6}{''.join(fmt(v, w) for v in values)}")
    for r in results:
        if r.status == "error" or (r.status == "skipped" and r.k == 0):
            where = f"N={r.n}" + (f" k={r.k}" if r.status == "error" else "")
            where += "" if r.args == "none" else f" args={r.args}"
            print(f"  {r.impl} {where}: {r.status}: {r.reason}")


def _print_step_start(
    start: dict[int, dict[str, float | None]], impls: list[str], labels: dict[str, str]
) -> None:
    if not start or "aioreplica" not in impls or "floor" not in impls:
        return
    w = max(len(labels[i]) for i in ("aioreplica", "floor")) + 2
    print(
        "\nTable 4: step start, µs per step at k=0 without arguments: run() of N replicas "
        "against N plain tasks"
        f"\n{'N':>6}{labels['aioreplica']:>{w}}{labels['floor']:>{w}}{'aio/floor':>{w}}"
    )
    for n, s in start.items():
        print(f"{n:>6}{''.join(fmt(s[key], w) for key in ('aioreplica', 'floor', 'aio/floor'))}")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "event loop for aioreplica (the floor stays on asyncio/uvloop)")
    p.add_argument("--only", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--n", default=",".join(map(str, N_VALUES)), help="replica counts")
    p.add_argument(
        "--args",
        default=",".join(ARG_KINDS),
        help=f"kinds of merge arguments, subset of {','.join(ARG_KINDS)}",
    )
    p.add_argument("--samples", type=int, help="samples per configuration (default 7, 3 quick)")
    p.add_argument("--json", type=Path, default=Path("bench-results/bench_scheduler.json"))
    args = p.parse_args(argv)
    impls = pick(p, "--only", args.only, IMPLS)
    kinds = pick(p, "--args", args.args, ARG_KINDS)
    ns = [int(s) for s in args.n.split(",")]
    samples = args.samples or (3 if args.quick else 7)
    target_ns = sample_target_ns(args.quick)

    loaded = load_aioreplica()
    api = loaded if "aioreplica" in impls else None
    if isinstance(api, str):
        print(
            f"WARNING: aioreplica cannot be benchmarked ({api}); its columns are not run. "
            "Use --only floor,threads to measure the baselines alone.",
            file=sys.stderr,
        )
    floor_kind = "uvloop" if args.loop == "uvloop" else "asyncio"
    aio = Driver(args.loop)
    floor = aio if floor_kind == args.loop else Driver(floor_kind)
    labels = {
        "aioreplica": f"aioreplica[{args.loop}]",
        "floor": f"floor[{floor_kind}]",
        "threads": "threads",
    }
    t0 = time.perf_counter()
    try:
        results = _measure(impls, kinds, ns, samples, target_ns, args.quick, api, aio, floor)
        many = _measure_steps(ns, samples, target_ns, api, aio) if "aioreplica" in impls else []
    finally:
        aio.close()
        floor.close()
    marg = _marginals(results)
    start = _step_start(results)
    checks, infos = _checks(results, marg, start, impls, kinds, ns)
    _print_report(results, marg, impls, labels)
    _print_steps(many)
    _print_step_start(start, impls, labels)
    print_checks(checks + infos)
    meta = run_meta() | {
        "loop": args.loop,
        "floor_loop": floor_kind,
        "quick": args.quick,
        "samples": samples,
        "target_sample_s": target_ns / 1e9,
        "wall_s": round(time.perf_counter() - t0, 1),
        "versions": dist_versions(),
        "aioreplica": aioreplica_meta(loaded),
    }

    def row(r: _Result) -> dict[str, Any]:
        return asdict(r) | {"best_us_per_step": r.best_us, "median_us_per_step": r.median_us}

    doc = {
        "meta": meta,
        "impls": impls,
        "n_values": ns,
        "k_values": list(K_VALUES),
        "arg_kinds": kinds,
        "arg_text": {kind: ARG_TEXT[kind] for kind in kinds},
        "arg_n_values": [n for n in ns if n in ARG_N],
        "arg_k_values": list(ARG_K),
        "results": [row(r) for r in results if r.args == "none"],
        "results_with_args": [row(r) for r in results if r.args != "none"],
        "marginal_us_per_round_per_replica": {str(n): m for n, m in marg.get("none", {}).items()},
        "marginal_by_args": {
            kind: {str(n): m for n, m in by_n.items()} for kind, by_n in marg.items()
        },
        "step_start": {str(n): s for n, s in start.items()},
        "steps_per_call": STEPS,
        "many_steps": [
            asdict(r) | {"best_us_per_step": None if r.best_us is None else r.best_us / STEPS}
            for r in many
        ],
        "checks": checks,
        "not_judged": infos,
    }
    write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
