"""Cross-worker all_reduce under MPI against raw mpi4py on the same buffers, and what the
cross-worker stage adds to a step.

Run under ``mpiexec``, one process per worker (2 on this machine; never more ranks than
cores), every socket on loopback::

    UCX_NET_DEVICES=lo .venv/bin/mpiexec -iface lo -n 2 \\
        .venv/bin/python devices/bench_multiworker.py --quick        # about 10 s
    UCX_NET_DEVICES=lo .venv/bin/mpiexec -iface lo -n 2 \\
        .venv/bin/python devices/bench_multiworker.py                # under 2 minutes

Every worker holds L local replicas (L = 1: ``["cpu:0"]``, L = 2: ``["cpu:0", "cpu:1"]``), one
float32 array per local replica of 8 B, 1, 4, 16 and 64 MiB (``--quick``: 8 B, 1 and 16 MiB;
``--sizes 8B,16`` chooses), different on every worker and replica. One run times, interleaved:

aioreplica    ``await strategy.run(step, args=(PerReplica(arrays),))`` on a
              ``MultiWorkerMirroredStrategy(devices)``, ``step`` awaiting
              ``get_replica_context().all_reduce(ReduceOp.SUM, x)``: the local sum and the
              cross-worker sum of a real step. The strategy is made once per L, outside the
              timing; the calls are timed inside one event loop (``--loop``).
raw           mpi4py alone on the same arrays, blocking: for L = 1 a separate-buffer
              ``comm.Allreduce(send, recv)`` into a preallocated ``recv`` (``IN_PLACE`` would
              need a copy of the caller's array first); for L = 2 the local sum
              ``np.add(a0, a1, out=buf)`` into a preallocated ``buf``, then
              ``comm.Allreduce(MPI.IN_PLACE, buf)``. Its own duplicate of ``COMM_WORLD``.
raw-poll      the same MPI work non-blocking, as any event-loop program must drive it:
              ``Iallreduce`` instead of ``Allreduce``, then ``request.Test()`` between
              ``anyio.lowlevel.checkpoint()``s until done (the same event loop as aioreplica).
              Not a bar: it tells the cost of driving MPI from an event loop (MPICH's
              non-blocking algorithms included) apart from what aioreplica adds to it.
mirrored      (8 B only) the same step on a single-process ``MirroredStrategy(devices)`` with
              the same local devices, on every worker at once: what the step costs without the
              cross-worker stage.
lockstep      (8 B only; not a bar) the ``mirrored`` step plus two raw exchanges between the
              workers, where a multi-worker step has them: one in the step, after its local
              all_reduce, and one after ``run()``. Each is a 1 KiB record from every worker
              to every other (persistent sends and receives, as aioreplica's collectives
              begin), tested in a 20 µs spin between event-loop checkpoints. No library
              code: what agreeing twice per step costs on this machine (the workers wait for
              the slower one at each), apart from what aioreplica adds to it.

Before timing, every row's result is checked on every worker and local replica against a float64
sum over all workers and replicas, and each row runs a few untimed calls (the first collective
of a run is slow). Each sample: ``gc.collect()``, a barrier, then ``time.perf_counter_ns``
around ``reps`` calls; a sample's time is the slowest worker's (the time until every worker is
done). ``reps`` is calibrated, the same on every worker, so that a sample lasts about 0.2 s
(0.05 s with ``--quick``); 7 samples per row (3 with ``--quick``), and three times as many at
8 bytes, whose rows are cheap and read by their fastest sample: on a noisy machine more samples
bring it closer to the step's quiet cost. The samples are taken in rounds that alternate the
order of the rows (A B C, C B A, ...), because absolute times drift on a shared machine while
ratios taken moments apart hold.

Table 1: per L and size, the per-replica bytes reduced per second (MB/s, 1 MB = 10^6 B) of raw
and aioreplica from their median samples, and ``ratio``, aioreplica's throughput over raw's:
the median of per-round ratios. The bar: ratio >= 0.8 at 16 and 64 MiB. Beside it, raw-poll's
throughput and aioreplica's over it (``aio/poll``). Table 2: µs per step of the 8-byte step on
the multi-worker strategy and on the single-process one, and what the cross-worker stage adds:
the fastest sample of each subtracted (noise only ever adds time), judged against the bar of
20 µs, with the median of per-round differences beside it, and the same for ``lockstep``.

Rank 0 prints the tables and writes JSON (``--json``, default
``bench-results/bench_multiworker.json``: metadata, every raw sample, the tables, the checks).
The exit status is 0 whatever the checks say; 1 when a row failed to run (its error is in the
table and the JSON); 2 when not launched with at least 2 workers or mpi4py is missing. If
aioreplica (or its ``MultiWorkerMirroredStrategy``) cannot be imported, the script says why and
still measures the raw rows. An unexpected exception on any rank aborts the whole job
(``MPI.COMM_WORLD.Abort``) rather than leaving the other rank waiting in a collective, and
``--deadline`` (seconds, default 240) ends every rank by itself, tracebacks dumped, if the run
hangs.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
from _benchlib import (
    REPO_ROOT,
    Driver,
    bench_parser,
    dist_version,
    dist_versions,
    fmt,
    print_checks,
    run_meta,
    sample_target_ns,
    timed_async,
    timed_sync,
    within,
    write_json,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from mpi4py import MPI

MIB = 1 << 20
SIZES = (8, MIB, 4 * MIB, 16 * MIB, 64 * MIB)
QUICK_SIZES = (8, MIB, 16 * MIB)
LOCAL_REPLICAS = (1, 2)
#: Sizes (bytes per replica) where aioreplica must reach ``RATIO_BAR`` of raw's throughput.
BAR_SIZES = (16 * MIB, 64 * MIB)
RATIO_BAR = 0.8
#: The most an 8-byte step may cost on the multi-worker strategy over the single-process one.
ADDED_BAR_US = 20.0
STEP_BYTES = 8
#: How many times the usual number of samples the rows at ``STEP_BYTES`` take.
STEP_SAMPLES_FACTOR = 3
WARMUP_CALLS = 3
MAX_REPS = 1_000_000
VERIFY_TIMEOUT_S = 60.0
IMPLS = ("raw", "raw-poll", "aioreplica", "mirrored", "lockstep")
#: The rows of the 8-byte step only.
STEP_IMPLS = ("mirrored", "lockstep")
BASELINES = ("raw", "raw-poll")
RAW_NAMES = {1: "Allreduce(send, recv)", 2: "np.add + Allreduce(IN_PLACE)"}
#: The ``lockstep`` row's records, and how long it spins before giving way to the loop.
RECORD_BYTES = 1024
SPIN_S = 2e-5


def size_label(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes} B"


# --- collective agreement -------------------------------------------------------------------


class CaseError(Exception):
    """A row failed on at least one worker; raised on every worker, with every worker's reason."""


class Group:
    """The control communicator: barriers, agreement on failures and on sample times."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def agreed(self, action: Callable[[], int]) -> list[int]:
        """Run ``action`` on every worker; every worker's result, or ``CaseError`` on all of
        them when it raised on any."""
        try:
            outcome: tuple[bool, int, str] = (True, action(), "")
        except Exception as exc:
            outcome = (False, 0, f"{type(exc).__name__}: {exc}")
        every = self.comm.allgather(outcome)
        failed = [f"worker {w}: {msg}" for w, (ok, _, msg) in enumerate(every) if not ok]
        if failed:
            raise CaseError("; ".join(failed))
        return [value for _, value, _ in every]

    def sample(self, fn: Callable[[int], int], reps: int) -> int:
        """ns for ``reps`` calls, started together after a barrier: the slowest worker's."""
        gc.collect()
        self.comm.Barrier()
        return max(self.agreed(lambda: fn(reps)))


# --- rows and cases -------------------------------------------------------------------------


@dataclass
class Row:
    impl: str  # raw | raw-poll | aioreplica | mirrored | lockstep
    local_replicas: int
    nbytes: int
    status: str = "ok"  # ok | skipped | error
    reason: str = ""
    reps: int = 0
    samples_ns: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.impl} x{self.local_replicas} {size_label(self.nbytes)}"

    @property
    def per_call_ns(self) -> list[float]:
        return [s / self.reps for s in self.samples_ns] if self.status == "ok" else []

    def median_s(self) -> float | None:
        t = self.per_call_ns
        return statistics.median(t) / 1e9 if t else None

    def best_s(self) -> float | None:
        t = self.per_call_ns
        return min(t) / 1e9 if t else None


@dataclass
class Case:
    row: Row
    sample: Callable[[int], int]  # reps -> elapsed ns on this worker
    verify: Callable[[], None]


def calibrate(group: Group, case: Case, target_ns: int) -> int:
    """Calls per sample for a sample to last about ``target_ns`` (the same on every worker:
    each decision is taken on the agreed, slowest time)."""
    reps = 1
    while True:
        elapsed = max(group.sample(case.sample, reps), 1)
        if elapsed >= target_ns // 5 or reps >= MAX_REPS:
            return max(1, round(reps * target_ns / elapsed))
        reps = max(reps * 2, min(reps * 100, -(-reps * target_ns // (2 * elapsed))))


def attempt(group: Group, case: Case, action: Callable[[], object]) -> bool:
    """Run one collective step of a case. When it fails on any worker, an aioreplica row
    records every worker's reason and is left out from then on (on every worker alike); a raw
    row that fails ends the run."""
    try:
        action()
    except CaseError as exc:
        if case.row.impl in BASELINES:
            raise
        case.row.status, case.row.reason = "error", str(exc)
        case.row.samples_ns.clear()
        if group.rank == 0:
            print(f"  {case.row.label} failed: {exc}", file=sys.stderr)
        return False
    return True


def measure(group: Group, cases: list[Case], samples: int, target_ns: int) -> None:
    """Verify, warm up and calibrate every case, then take the samples in rounds of
    alternating order (A B C, C B A, ...)."""

    def prepare(case: Case) -> None:
        def verify_and_warm() -> int:
            case.verify()
            case.sample(WARMUP_CALLS)
            return 0

        group.agreed(verify_and_warm)
        case.row.reps = calibrate(group, case, target_ns)

    live = [c for c in cases if attempt(group, c, functools.partial(prepare, c))]
    for i in range(samples):
        for c in list(live) if i % 2 == 0 else list(reversed(live)):

            def take(c: Case = c) -> None:
                c.row.samples_ns.append(group.sample(c.sample, c.row.reps))

            if not attempt(group, c, take):
                live.remove(c)


# --- the configurations ---------------------------------------------------------------------


@dataclass
class Aio:
    """What the script uses of aioreplica, or why it cannot."""

    module: Any = None
    why_not: str = ""


def load_aioreplica() -> Aio:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        import aioreplica
    except Exception as exc:
        return Aio(why_not=f"import aioreplica: {type(exc).__name__}: {exc}")
    if not hasattr(aioreplica, "MultiWorkerMirroredStrategy"):
        return Aio(why_not="aioreplica has no MultiWorkerMirroredStrategy")
    return Aio(aioreplica)


def config_cases(
    group: Group,
    raw_comm: MPI.Intracomm,
    mpi: Any,
    local: int,
    nbytes: int,
    strategies: dict[str, Any],
    aio: Aio,
    driver: Driver,
    rows: dict[str, Row],
    exchange: Callable[[], Awaitable[None]],
) -> list[Case]:
    """The cases of one (L, size): raw, aioreplica, and at 8 B the single-process step, alone
    and in lockstep (``exchange``: one raw record exchange between the workers)."""
    n = nbytes // 4
    rng = np.random.default_rng([group.rank, local, nbytes])
    arrays = [rng.random(n, dtype=np.float32) for _ in range(local)]
    expected = np.sum([a.astype(np.float64) for a in arrays], axis=0)
    group.comm.Allreduce(mpi.IN_PLACE, expected, op=mpi.SUM)

    def check(got: Any, what: str) -> None:
        if not (isinstance(got, np.ndarray) and got.shape == (n,) and got.dtype == np.float32):
            raise RuntimeError(f"{what}: got {type(got).__name__} {getattr(got, 'shape', '')}")
        if not np.allclose(got, expected, rtol=1e-5, atol=1e-6):
            raise RuntimeError(f"{what}: result differs from the float64 sum over all workers")

    cases = []
    send, out = arrays[0], np.empty(n, np.float32)

    def local_sum() -> None:
        np.add(arrays[0], arrays[1], out=out)
        for a in arrays[2:]:
            np.add(out, a, out=out)

    def raw() -> None:
        if local == 1:
            raw_comm.Allreduce(send, out, op=mpi.SUM)
        else:
            local_sum()
            raw_comm.Allreduce(mpi.IN_PLACE, out, op=mpi.SUM)

    async def raw_poll() -> None:
        if local == 1:
            request = raw_comm.Iallreduce(send, out, op=mpi.SUM)
        else:
            local_sum()
            request = raw_comm.Iallreduce(mpi.IN_PLACE, out, op=mpi.SUM)
        while not request.Test():
            await anyio.lowlevel.checkpoint()

    def raw_verify() -> None:
        raw()
        check(out, "raw")

    def poll_verify() -> None:
        out.fill(0)
        driver.run(lambda: within(VERIFY_TIMEOUT_S, raw_poll()))
        check(out, "raw-poll")

    cases.append(Case(rows["raw"], lambda reps: timed_sync(raw, reps), raw_verify))
    cases.append(
        Case(
            rows["raw-poll"],
            lambda reps: driver.run(lambda: timed_async(raw_poll, reps)),
            poll_verify,
        )
    )

    if aio.module is not None:
        mod = aio.module
        per_replica = mod.PerReplica(arrays)
        get_ctx, op = mod.get_replica_context, mod.ReduceOp.SUM

        async def step(x: Any) -> Any:
            return await get_ctx().all_reduce(op, x)

        async def step_in_lockstep(x: Any) -> Any:
            result = await get_ctx().all_reduce(op, x)
            if get_ctx().replica_id_in_sync_group == 0:
                await exchange()
            return result

        def one_step(impl: str, s: Any) -> Callable[[], Awaitable[Any]]:
            """One call of the row's step: ``s.run``, or in lockstep the one-process ``run()``
            with an exchange in the step and one after it."""
            if impl != "lockstep":
                return lambda: s.run(step, args=(per_replica,))

            async def in_lockstep() -> Any:
                result = await s.run(step_in_lockstep, args=(per_replica,))
                await exchange()
                return result

            return in_lockstep

        for impl in ("aioreplica", "mirrored", "lockstep"):
            strategy = strategies.get("mirrored" if impl == "lockstep" else impl)
            if impl not in rows or strategy is None:
                continue
            call = one_step(impl, strategy)

            def sample(reps: int, call: Callable[[], Awaitable[Any]] = call) -> int:
                return driver.run(lambda: timed_async(call, reps))

            def verify(
                call: Callable[[], Awaitable[Any]] = call, s: Any = strategy, impl: str = impl
            ) -> None:
                out = driver.run(lambda: within(VERIFY_TIMEOUT_S, call()))
                # run() regroups: one value when every replica returned the same object.
                results = s.experimental_local_results(out)
                if len(results) not in (1, local):
                    raise RuntimeError(f"{impl}: {len(results)} local results, not {local}")
                for j, got in enumerate(results):
                    if impl != "aioreplica":
                        # One process: the sum of this worker's replicas only.
                        local_sum = np.sum(arrays, axis=0, dtype=np.float32)
                        if not np.allclose(got, local_sum, rtol=1e-5, atol=1e-6):
                            raise RuntimeError(f"{impl} replica {j}: wrong local sum")
                    else:
                        check(got, f"aioreplica, local replica {j}")

            cases.append(Case(rows[impl], sample, verify))
    return cases


# --- report ---------------------------------------------------------------------------------


def ratio_of(base: Row, row: Row) -> float | None:
    """``row``'s throughput over ``base``'s: the median of per-round ratios."""
    per_round = [b / r for b, r in zip(base.per_call_ns, row.per_call_ns, strict=False) if r]
    return statistics.median(per_round) if per_round else None


def ratio_rows(rows: Sequence[Row], sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Table 1's rows: throughput of raw and aioreplica, their ratio, the bar."""
    by = {(r.impl, r.local_replicas, r.nbytes): r for r in rows}
    table = []
    for local in LOCAL_REPLICAS:
        for nbytes in sizes:
            raw, aio = by[("raw", local, nbytes)], by[("aioreplica", local, nbytes)]
            poll = by[("raw-poll", local, nbytes)]
            raw_t, aio_t, poll_t = raw.median_s(), aio.median_s(), poll.median_s()
            ratio, ratio_poll = ratio_of(raw, aio), ratio_of(poll, aio)
            bar = RATIO_BAR if nbytes in BAR_SIZES else None
            status = (
                "info"
                if bar is None
                else "n/a"
                if ratio is None
                else "PASS"
                if ratio >= bar
                else "FAIL"
            )
            table.append(
                {
                    "local_replicas": local,
                    "bytes": nbytes,
                    "raw": RAW_NAMES[local],
                    "raw_ms": raw_t * 1e3 if raw_t else None,
                    "aioreplica_ms": aio_t * 1e3 if aio_t else None,
                    "raw_mb_s": nbytes / raw_t / 1e6 if raw_t else None,
                    "aioreplica_mb_s": nbytes / aio_t / 1e6 if aio_t else None,
                    "ratio": ratio,
                    "raw_poll_ms": poll_t * 1e3 if poll_t else None,
                    "raw_poll_mb_s": nbytes / poll_t / 1e6 if poll_t else None,
                    "ratio_vs_poll": ratio_poll,
                    "bar": bar,
                    "status": status,
                    "aioreplica_status": aio.status,
                    "aioreplica_reason": aio.reason,
                }
            )
    return table


def added_rows(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Table 2's rows: the 8-byte step on both strategies, and the difference."""
    by = {(r.impl, r.local_replicas, r.nbytes): r for r in rows}
    table = []
    for local in LOCAL_REPLICAS:
        absent = Row("aioreplica", local, STEP_BYTES, "skipped", f"{STEP_BYTES} B not run")
        mw = by.get(("aioreplica", local, STEP_BYTES), absent)
        one = by.get(("mirrored", local, STEP_BYTES), absent)
        lockstep = by.get(("lockstep", local, STEP_BYTES), absent)
        mw_best, one_best, lockstep_best = mw.best_s(), one.best_s(), lockstep.best_s()
        diffs = [(a - b) / 1e3 for a, b in zip(mw.per_call_ns, one.per_call_ns, strict=False)]
        added = (mw_best - one_best) * 1e6 if mw_best and one_best else None
        lockstep_diffs = [
            (a - b) / 1e3 for a, b in zip(lockstep.per_call_ns, one.per_call_ns, strict=False)
        ]
        table.append(
            {
                "local_replicas": local,
                "multiworker_us_best": mw_best * 1e6 if mw_best else None,
                "mirrored_us_best": one_best * 1e6 if one_best else None,
                "added_us": added,
                "added_us_median_of_rounds": statistics.median(diffs) if diffs else None,
                "lockstep_us_best": lockstep_best * 1e6 if lockstep_best else None,
                "lockstep_added_us": (
                    (lockstep_best - one_best) * 1e6 if lockstep_best and one_best else None
                ),
                "lockstep_added_us_median_of_rounds": (
                    statistics.median(lockstep_diffs) if lockstep_diffs else None
                ),
                "bar_us": ADDED_BAR_US,
                "status": "n/a" if added is None else "PASS" if added <= ADDED_BAR_US else "FAIL",
                "reasons": [r for r in (mw.reason, one.reason) if r],
            }
        )
    return table


def us(ms: float | None) -> float | None:
    return None if ms is None else ms * 1e3


def print_tables(
    t1: list[dict[str, Any]], t2: list[dict[str, Any]], workers: int, loop: str
) -> None:
    print(
        f"\nTable 1: all_reduce SUM of float32 across {workers} workers, x L local replicas "
        f"(aioreplica on {loop}); MB/s = bytes per replica / time, median samples"
    )
    print(
        f"{'L':>2} {'size':>7} {'raw':<29}{'raw µs':>9}{'aio µs':>9}{'raw MB/s':>10}"
        f"{'aio MB/s':>10}{'ratio':>7}{'bar':>6}  {'status':<6}{'poll MB/s':>10}{'aio/poll':>9}"
    )
    for r in t1:
        bar = f">={r['bar']:g}" if r["bar"] else "-"
        note = "" if r["aioreplica_status"] == "ok" else f" (aioreplica {r['aioreplica_status']})"
        print(
            f"{r['local_replicas']:>2} {size_label(r['bytes']):>7} {r['raw']:<29}"
            f"{fmt(us(r['raw_ms']), 9)}{fmt(us(r['aioreplica_ms']), 9)}"
            f"{fmt(r['raw_mb_s'], 10)}{fmt(r['aioreplica_mb_s'], 10)}{fmt(r['ratio'], 7)}"
            f"{bar:>6}  {r['status']:<6}{fmt(r['raw_poll_mb_s'], 10)}{fmt(r['ratio_vs_poll'], 9)}"
            f"{note}"
        )
    print(
        f"\nTable 2: µs per run() of a step doing one {STEP_BYTES}-byte all_reduce, fastest "
        f"sample: {workers} workers vs one process with the same local replicas; lockstep: "
        "the one-process step with two raw exchanges between the workers, added likewise"
    )
    print(
        f"{'L':>2}{'multi-worker':>14}{'one process':>13}{'added':>8}"
        f"{'median/round':>14}{'bar':>7}  {'status':<6}{'lockstep':>10}{'added':>8}"
        f"{'median/round':>14}"
    )
    for r in t2:
        print(
            f"{r['local_replicas']:>2}{fmt(r['multiworker_us_best'], 14)}"
            f"{fmt(r['mirrored_us_best'], 13)}{fmt(r['added_us'], 8)}"
            f"{fmt(r['added_us_median_of_rounds'], 14)}{'<=' + format(r['bar_us'], 'g'):>7}"
            f"  {r['status']:<6}{fmt(r['lockstep_us_best'], 10)}{fmt(r['lockstep_added_us'], 8)}"
            f"{fmt(r['lockstep_added_us_median_of_rounds'], 14)}"
        )


def checks_of(t1: list[dict[str, Any]], t2: list[dict[str, Any]]) -> list[dict[str, str]]:
    checks = []
    for local in LOCAL_REPLICAS:
        for nbytes in BAR_SIZES:
            name = (
                f"(1) x{local}, {size_label(nbytes)}: aioreplica >= {RATIO_BAR}x the throughput "
                f"of {RAW_NAMES[local]}"
            )
            found = [r for r in t1 if r["local_replicas"] == local and r["bytes"] == nbytes]
            if not found:
                checks.append({"name": name, "status": "SKIP", "detail": "size not run"})
                continue
            r = found[0]
            status = {"PASS": "PASS", "FAIL": "FAIL"}.get(r["status"], "SKIP")
            detail = (
                f"ratio {r['ratio']:.2f} ({fmt(r['aioreplica_mb_s'])} vs {fmt(r['raw_mb_s'])} MB/s)"
                if r["ratio"] is not None
                else f"aioreplica {r['aioreplica_status']}: {r['aioreplica_reason']}"
            )
            checks.append({"name": name, "status": status, "detail": detail})
    for r in t2:
        local = r["local_replicas"]
        name = (
            f"(2) x{local}, {STEP_BYTES} B step: the multi-worker strategy adds <= "
            f"{ADDED_BAR_US:g} µs over MirroredStrategy({[f'cpu:{i}' for i in range(local)]})"
        )
        if r["added_us"] is None:
            checks.append(
                {"name": name, "status": "SKIP", "detail": "; ".join(dict.fromkeys(r["reasons"]))}
            )
        else:
            checks.append(
                {
                    "name": name,
                    "status": r["status"],
                    "detail": (
                        f"+{r['added_us']:.1f} µs ({r['multiworker_us_best']:.1f} vs "
                        f"{r['mirrored_us_best']:.1f} µs; median of rounds "
                        f"+{r['added_us_median_of_rounds']:.1f})"
                    ),
                }
            )
    return checks


# --- main -----------------------------------------------------------------------------------


def run(argv: list[str] | None, mpi: Any) -> int:
    parser = bench_parser(__doc__, "event loop aioreplica runs on")
    parser.add_argument(
        "--json",
        type=Path,
        default=REPO_ROOT / "bench-results" / "bench_multiworker.json",
        help="where rank 0 writes the results",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=240.0,
        help="seconds after which every rank dumps its traceback and exits (a hang)",
    )
    parser.add_argument(
        "--sizes",
        help="comma-separated sizes per replica: 8B, or MiB (default 8B,1,4,16,64; "
        "--quick: 8B,1,16); the 8-byte step of Table 2 needs 8B",
    )
    args = parser.parse_args(argv)
    sizes: tuple[int, ...] = QUICK_SIZES if args.quick else SIZES
    if args.sizes:
        try:
            sizes = tuple(
                STEP_BYTES if s.strip().upper() == "8B" else int(s) * MIB
                for s in args.sizes.split(",")
            )
        except ValueError:
            parser.error(f"--sizes {args.sizes!r}: write sizes such as 8B,1,16")
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    started = time.perf_counter()
    world = mpi.COMM_WORLD
    group = Group(world.Dup())
    raw_comm = world.Dup()
    records = np.zeros((group.size, RECORD_BYTES), np.uint8)
    me = raw_comm.Get_rank()
    peers = [w for w in range(group.size) if w != me]
    record_exchange = [raw_comm.Recv_init(records[w], w, 0) for w in peers] + [
        raw_comm.Send_init(records[me], w, 0) for w in peers
    ]

    async def exchange() -> None:
        """One record from every worker to every other (``lockstep``), each request tested in
        a spin of ``SPIN_S``, then again after each event-loop checkpoint."""
        for request in record_exchange:
            request.Start()
        for request in record_exchange:
            while True:
                until = time.perf_counter() + SPIN_S
                while not request.Test():
                    if time.perf_counter() > until:
                        break
                else:
                    break
                await anyio.lowlevel.checkpoint()

    if group.size < 2:
        if group.rank == 0:
            print(
                "bench_multiworker.py needs at least 2 workers: launch it with "
                "`UCX_NET_DEVICES=lo .venv/bin/mpiexec -iface lo -n 2 .venv/bin/python "
                "devices/bench_multiworker.py`",
                file=sys.stderr,
            )
        return 2
    samples = 3 if args.quick else 7
    target_ns = sample_target_ns(args.quick)
    aio = load_aioreplica()
    reasons = group.comm.allgather(aio.why_not)
    if any(reasons):  # every worker must agree to use it
        aio = Aio(why_not=next(r for r in reasons if r))
    if group.rank == 0 and aio.why_not:
        print(f"aioreplica not measured: {aio.why_not}", file=sys.stderr)
    driver = Driver(args.loop)
    rows: list[Row] = []
    try:
        for local in LOCAL_REPLICAS:
            devices = [f"cpu:{i}" for i in range(local)]
            strategies: dict[str, Any] = {}
            why_not = aio.why_not
            if aio.module is not None:
                try:  # collective: every worker constructs, in the same order
                    strategies["aioreplica"] = aio.module.MultiWorkerMirroredStrategy(devices)
                    strategies["mirrored"] = aio.module.MirroredStrategy(devices)
                except Exception as exc:
                    why_not = f"creating the strategies for {devices}: {type(exc).__name__}: {exc}"
                    strategies.clear()
            created = group.comm.allgather(why_not)
            if any(created) and not why_not:
                why_not = next(r for r in created if r)
                strategies.clear()
            for nbytes in sizes:
                cfg = {
                    impl: Row(impl, local, nbytes)
                    for impl in IMPLS
                    if impl not in STEP_IMPLS or nbytes == STEP_BYTES
                }
                for row in cfg.values():
                    if row.impl not in BASELINES and not strategies:
                        row.status, row.reason = "skipped", why_not
                rows.extend(cfg.values())
                live = {k: v for k, v in cfg.items() if v.status == "ok"}
                cases = config_cases(
                    group, raw_comm, mpi, local, nbytes, strategies, aio, driver, live, exchange
                )
                factor = STEP_SAMPLES_FACTOR if nbytes == STEP_BYTES else 1
                measure(group, cases, samples * factor, target_ns)
                del cases
                gc.collect()
            for s in strategies.values():
                s.close()
    finally:
        driver.close()

    t1, t2 = ratio_rows(rows, sizes), added_rows(rows)
    checks = checks_of(t1, t2)
    errors = [r for r in rows if r.status == "error"]
    if group.rank == 0:
        print_tables(t1, t2, group.size, args.loop)
        print_checks(checks)
        meta = run_meta() | {
            "quick": args.quick,
            "loop": args.loop,
            "workers": group.size,
            "local_replicas": list(LOCAL_REPLICAS),
            "sizes_bytes": list(sizes),
            "samples": samples,
            "step_samples": samples * STEP_SAMPLES_FACTOR,
            "sample_target_ns": target_ns,
            "mpi_library": mpi.Get_library_version().strip().splitlines()[0],
            "mpi4py": dist_version("mpi4py"),
            "mpich": dist_version("mpich"),
            "versions": dist_versions(),
            "aioreplica": (
                str(getattr(aio.module, "__version__", None) or dist_version("aioreplica"))
                if aio.module is not None
                else f"not measured: {aio.why_not}"
            ),
            "timing": "max over workers of perf_counter_ns around reps calls, after a barrier",
            "wall_s": round(time.perf_counter() - started, 1),
        }
        write_json(
            args.json,
            {
                "meta": meta,
                "rows": [asdict(r) for r in rows],
                "throughput": t1,
                "added_8b": t2,
                "checks": checks,
            },
        )
    group.comm.Barrier()
    for request in record_exchange:
        request.Free()
    raw_comm.Free()
    group.comm.Free()
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        print(f"bench_multiworker.py needs mpi4py (pip install 'aioreplica[mpi]'): {exc}")
        return 2
    try:
        return run(argv, MPI)
    except SystemExit:
        raise
    except BaseException:
        # One rank's crash must not leave the others waiting in a collective.
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
