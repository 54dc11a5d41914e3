"""Scheduler overhead of aioreplica against an asyncio floor and a thread-per-replica baseline.

A step runs a step function on N replicas; each replica makes k ``merge_call``s whose merge
function does nothing. For N in 2, 8, 64, 1024, 10000 and k in 0, 1, 10 one run times:

aioreplica  ``await strategy.run(step, args=(k,))``, the strategy
            (``MirroredStrategy(["cpu:0", ...])``) created once per N, outside the timing.
floor       The leanest asyncio equivalent: N tasks from ``loop.create_task`` awaited with one
            ``asyncio.gather``; a merge round is an arrival counter plus one shared future (the
            last task to arrive calls the merge function, resolves the future and replaces it;
            the others await it). No locks, no anyio. Under ``--loop uvloop`` it runs on
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
            Not run for N = 10000, nor for N >= 1024 under ``--quick``.

For each (N, k) every implementation runs one untimed step with a counting merge function (all
N replicas must finish, the merge function must run exactly k times), is calibrated so that one
sample (``time.perf_counter_ns``) lasts about 0.2 s (0.05 s with ``--quick``), then the samples
are taken interleaved (A B C A B C ..., over the three implementations and the three k of one
N): on a shared, noisy machine absolute times drift but ratios measured close together hold.
Each time is the fastest of the samples (noise only ever adds time, and a marginal cost is a
difference of two times, so it needs both at their least noisy); the JSON keeps every sample and
the medians too. ``gc.collect()`` runs before each sample and the GC is off during it.

Run from the repository root (aioreplica is imported from this checkout)::

    .venv/bin/python devices/bench_scheduler.py --quick          # under a minute
    .venv/bin/python devices/bench_scheduler.py                  # a few minutes
    .venv/bin/python devices/bench_scheduler.py --loop trio      # or uvloop
    .venv/bin/python devices/bench_scheduler.py --only floor,threads

Many steps per call (aioreplica only, N in 8 and 64 where measured, k in 0 and 1): the same
``STEPS`` steps, each handed its replica's slice of one element (a ``PerReplica`` of scalars),
run as ``for x in elements: await strategy.run(step, args=(x,))`` ("run per step") and as one
``await strategy.run_steps(step, iterator, STEPS)`` over an async iterator of the same elements,
which starts the replicas once and hands out each element at a merge round; interleaved like
the rest. A checkout without ``run_steps`` reports it as skipped.

Output. Table 1: µs per step (best of the samples), one row per (N, k). Table 2: per N, the
marginal cost of one merge round for one replica, ``(t(k=10) - t(k=0)) / (10 * N)`` µs, then
``aio/floor`` (1.0 = no overhead over the floor) and ``threads/aio`` (how many times cheaper
than threads). Table 3: µs per step of "run per step" and "run_steps", and their ratio.
Checks, PASS / FAIL (SKIP when ``--only`` / ``--n`` left out what one needs): (a) aioreplica
marginal within 2x of the floor for N = 8, 64, 1024; (b) aioreplica marginal at least 10x below
threads for N = 8; (c) 10,000 replicas x 10 merge_calls completed. Metadata, raw samples and
checks go to ``--json`` (default ``bench-results/bench_scheduler.json``). The exit status is 0
whatever the checks say; non-zero means the script itself crashed.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

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
VERIFY_TIMEOUT_S = 120.0
MAX_REPS = 10_000_000


def _noop(strategy: object, *args: object) -> None:
    return None


class _Count:
    """Counting merge function and finish counter for the untimed verification step."""

    def __init__(self, impl: str, n: int, k: int) -> None:
        self.impl, self.n, self.k, self.merges, self.finished = impl, n, k, 0, 0

    def merge(self, strategy: object, *args: object) -> None:
        self.merges += 1

    def check(self) -> None:
        if (self.merges, self.finished) != (self.k, self.n):
            raise RuntimeError(
                f"{self.impl} N={self.n} k={self.k}: merge function ran "
                f"{self.merges} times, {self.finished}/{self.n} replicas finished"
            )


# --- asyncio floor -------------------------------------------------------------------------


class _Barrier:
    __slots__ = ("arrived", "future", "loop", "merge_fn", "n")

    def __init__(self, n: int, merge_fn: Callable[[object], object]) -> None:
        self.loop = asyncio.get_running_loop()
        self.n, self.merge_fn, self.arrived = n, merge_fn, 0
        self.future: asyncio.Future[None] = self.loop.create_future()


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
    status: str = "ok"  # ok | skipped | error
    reason: str = ""
    reps: int = 0
    samples_ns: list[int] = field(default_factory=list)

    @property
    def tolerates_failure(self) -> bool:
        return self.impl not in ("floor", "threads")

    @property
    def label(self) -> str:
        return f"{self.impl} N={self.n} k={self.k}"

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
    n, k, count = res.n, res.k, _Count(res.impl, res.n, res.k)
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

    def aio_sample(reps: int) -> int:
        return aio.run(lambda: timed_async(lambda: strat.run(step, args=(k,)), reps))

    def aio_verify() -> None:
        aio.run(lambda: within(VERIFY_TIMEOUT_S, strat.run(counting_step, args=(k,))))
        count.check()

    return Case(res, aio_sample, aio_verify)


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
        rows = [[_Result(impl, n, k) for impl in impls] for k in K_VALUES]
        cases: list[Case[_Result]] = []
        for res in (r for row in rows for r in row):
            results.append(res)
            if reason := _skip_reason(res.impl, n, quick, api):
                res.status, res.reason = "skipped", reason
            elif res.impl == "aioreplica" and strategy_error:
                res.status, res.reason = "error", strategy_error
            else:
                cases.append(_make_case(res, api, strategy, aio, floor))
        # interleaved over implementations and k: A B C A B C ...
        run_interleaved(cases, samples, target_ns, max_reps=MAX_REPS, gc_off=True)
        for k, row in zip(K_VALUES, rows, strict=True):
            line = "  ".join(f"{r.impl} {fmt(r.best_us)}" for r in row)
            print(f"N={n:>5} k={k:>2}  {line}  (µs/step)", file=sys.stderr, flush=True)
    return results


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b if b > 0 else math.inf


def _marginals(results: list[_Result], ns: list[int]) -> dict[int, dict[str, float | None]]:
    """(t(k=10) - t(k=0)) / (10 * N) in µs, per N and implementation."""
    t = {(r.impl, r.n, r.k): r.best_us for r in results}
    out: dict[int, dict[str, float | None]] = {n: {} for n in ns}
    for impl, n, _ in t:
        hi, lo = t[(impl, n, K_HI)], t[(impl, n, 0)]
        out[n][impl] = None if hi is None or lo is None else (hi - lo) / (K_HI * n)
    return out


def _checks(
    results: list[_Result],
    marg: dict[int, dict[str, float | None]],
    impls: list[str],
    ns: list[int],
) -> list[dict[str, str]]:
    def check(
        name: str, need: list[str], need_n: list[int], ok: bool | None, detail: str
    ) -> dict[str, str]:
        left = [i for i in need if i not in impls] + [f"N={n}" for n in need_n if n not in ns]
        if left:
            return {"name": name, "status": "SKIP", "detail": f"not in this run: {left}"}
        if ok is None:
            why = sorted(
                {
                    f"{r.impl} N={r.n} k={r.k}: {r.reason}"
                    for r in results
                    if r.status != "ok" and r.impl in need and r.n in need_n
                }
            )
            detail += "; not measured: " + ("; ".join(why) or "no samples")
        return {"name": name, "status": "PASS" if ok else "FAIL", "detail": detail}

    def m(impl: str, n: int) -> float | None:
        return marg.get(n, {}).get(impl)

    ra = {n: _ratio(m("aioreplica", n), m("floor", n)) for n in (8, 64, 1024)}
    ok_a = None if None in ra.values() else all(v is not None and v <= 2 for v in ra.values())
    rb = _ratio(m("threads", 8), m("aioreplica", 8))
    big = next((r for r in results if (r.impl, r.n, r.k) == ("aioreplica", 10_000, 10)), None)
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
    return [
        check(
            "(a) aioreplica marginal within 2x of floor, N=8/64/1024",
            ["aioreplica", "floor"],
            [8, 64, 1024],
            ok_a,
            "aioreplica/floor " + ", ".join(f"N={n}: {fmt(v)}" for n, v in ra.items()),
        ),
        check(
            "(b) aioreplica marginal >= 10x below threads, N=8",
            ["aioreplica", "threads"],
            [8],
            None if rb is None else rb >= 10,
            f"threads/aioreplica N=8: {fmt(rb)}",
        ),
        check(
            "(c) 10,000 replicas x 10 merge_calls completed",
            ["aioreplica"],
            [10_000],
            ok_c,
            detail_c,
        ),
    ]


def _print_report(
    results: list[_Result],
    marg: dict[int, dict[str, float | None]],
    impls: list[str],
    labels: dict[str, str],
    checks: list[dict[str, str]],
) -> None:
    w = max(len(s) for s in labels.values()) + 2
    heads = "".join(labels[i].rjust(w) for i in impls)
    print(f"\nTable 1: µs per step, best of the samples\n{'N':>6}{'k':>4}{heads}")
    for i in range(0, len(results), len(impls)):
        row = results[i : i + len(impls)]
        cells = (fmt(r.best_us, w) if r.status == "ok" else r.status.rjust(w) for r in row)
        print(f"{row[0].n:>6}{row[0].k:>4}{''.join(cells)}")
    print(
        f"\nTable 2: marginal µs per merge round per replica, (t(k={K_HI}) - t(k=0)) / "
        f"({K_HI} * N)\n{'N':>6}{heads}{'aio/floor':>{w}}{'threads/aio':>{w}}"
    )
    for n, m in marg.items():
        r1 = _ratio(m.get("aioreplica"), m.get("floor"))
        r2 = _ratio(m.get("threads"), m.get("aioreplica"))
        print(f"{n:>6}{''.join(fmt(m[i], w) for i in impls)}{fmt(r1, w)}{fmt(r2, w)}")
    for r in results:
        if r.status == "error" or (r.status == "skipped" and r.k == 0):
            where = f"N={r.n}" + (f" k={r.k}" if r.status == "error" else "")
            print(f"  {r.impl} {where}: {r.status}: {r.reason}")
    print_checks(checks)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, "event loop for aioreplica (the floor stays on asyncio/uvloop)")
    p.add_argument("--only", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--n", default=",".join(map(str, N_VALUES)), help="replica counts")
    p.add_argument("--samples", type=int, help="samples per configuration (default 7, 3 quick)")
    p.add_argument("--json", type=Path, default=Path("bench-results/bench_scheduler.json"))
    args = p.parse_args(argv)
    impls = pick(p, "--only", args.only, IMPLS)
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
        results = _measure(impls, ns, samples, target_ns, args.quick, api, aio, floor)
        many = _measure_steps(ns, samples, target_ns, api, aio) if "aioreplica" in impls else []
    finally:
        aio.close()
        floor.close()
    marg = _marginals(results, ns)
    checks = _checks(results, marg, impls, ns)
    _print_report(results, marg, impls, labels, checks)
    _print_steps(many)
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
    doc = {
        "meta": meta,
        "impls": impls,
        "n_values": ns,
        "k_values": list(K_VALUES),
        "results": [
            asdict(r) | {"best_us_per_step": r.best_us, "median_us_per_step": r.median_us}
            for r in results
        ],
        "marginal_us_per_round_per_replica": {str(n): m for n, m in marg.items()},
        "steps_per_call": STEPS,
        "many_steps": [
            asdict(r) | {"best_us_per_step": None if r.best_us is None else r.best_us / STEPS}
            for r in many
        ],
        "checks": checks,
    }
    write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
