"""GPU replicas across workers: ``MultiWorkerMirroredStrategy`` on CuPy, compared with NumPy.

Run under ``mpiexec`` (any number of workers; each takes GPU ``rank % gpus``), on a machine with
CUDA and CuPy, or against the CPU stand-in of CuPy in ``tests/cupy_sim``::

    mpiexec -n 2 python devices/check_gpu_multiworker.py
    PYTHONPATH=.:tests/cupy_sim mpiexec -n 2 python devices/check_gpu_multiworker.py  # stand-in

Every cross-worker step stages through the host (device, host, MPI, host, device). For one and
for two local replicas per worker (the second on the same GPU, with its own stream, as in
``check_gpu.py``), on each event loop available, it checks against NumPy over every worker's
data (inputs come out of ``check_gpu.py``'s slow chain on the replica's stream, so a copy not
ordered after it reads unfinished data):

1. collectives: ``ctx.all_reduce`` (sum, mean, max, min of float32; sum of int32; a nested
   structure with a transposed leaf), ``ctx.all_gather`` with uneven rows, ``ctx.broadcast``
   from the last global replica, ``ctx.reduce_scatter``, ``ctx.barrier``, and
   ``strategy.reduce`` (sum, and axis-0 mean); every result on its replica's GPU;
2. variables: a mirrored one made from a different value on each worker starts from the
   chief's; replica-context ``assign_add`` of per-replica values (sum aggregation); a
   sync-on-read sum read in cross-replica context is the global sum; copies bitwise identical
   on every worker;
3. an optimizer: two steps of ``SGD`` with momentum on per-replica gradients (one a
   transpose), weights and slots against NumPy, bitwise identical on every worker;
4. a checkpoint in a directory every worker sees, saved with no host synchronization on the
   loop's thread: it holds sync-on-read variables (sum, mean, only the first replica)
   aggregated over every worker's replicas; change, restore, and the values are back;
5. invariants 1 and 4 as ``check_gpu.py`` watches them (own device and stream at every await;
   no host synchronization on the loop thread inside a step), and, on the stand-in, no data
   race.

Each worker prints its own lines, prefixed ``[worker r]``; worker 0 then prints the summary of
all. Exit status: 0 when no check failed on any worker, 1 when one did, 2 when there is no CuPy,
no CUDA device or no mpi4py.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_gpu as base  # (the folder of this script, put on the path above)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

SHAPE = (5, 7)
VAR_SHAPE = (3, 4)
OPT_SHAPE = (6, 5)
STEPS = 2


class Workers:
    """This worker's place in the job, and what every worker's checks found."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def same_everywhere(self, value: Any) -> str:
        """'' when ``value`` (an array) is bitwise identical on every worker, else which
        workers differ from worker 0."""
        array = np.ascontiguousarray(np.asarray(value))
        mine = (array.dtype.str, array.shape, array.tobytes())
        everyone = self.comm.allgather(mine)
        differ = [w for w, theirs in enumerate(everyone) if theirs != everyone[0]]
        return f"workers {differ} differ from worker 0" if differ else ""

    def copies_differ(self, name: str, variable: Any) -> list[str]:
        """``variable``'s copies that are not bitwise identical on every worker, described."""
        return [
            f"{name} copy {j}: {differ}"
            for j, copy in enumerate(variable.values)
            if (differ := self.same_everywhere(base.cp.asnumpy(copy)))
        ]


def global_data(name: str, dtype: str, shape: tuple[int, ...], n: int) -> list[Any]:
    """Every global replica's ``replica_data(name, shape, dtype)``, on the host."""
    return [base.host_data(g, name, dtype, shape) for g in range(n)]


async def step(strategy: Any, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    return await base.run_step(strategy, fn, *args)


# -- 1. collectives ---------------------------------------------------------------------------


async def collectives_step() -> dict[str, Any]:
    import aioreplica

    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    g, n = ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync
    base.here("collectives")
    x = base.replica_data("x", SHAPE)
    out: dict[str, Any] = {}
    for op in ("sum", "mean", "max", "min"):
        out[op] = await base.checked(f"all_reduce {op}", ctx.all_reduce(op, x))
    out["int32 sum"] = await base.checked(
        "all_reduce int32", ctx.all_reduce("sum", base.replica_data("i", SHAPE, "int32"))
    )
    nested = await base.checked(
        "all_reduce nested", ctx.all_reduce("sum", {"x": x, "parts": [x.T, x[:, ::2]]})
    )
    out["nested x"], out["nested x.T"], out["nested x[:, ::2]"] = (
        nested["x"],
        nested["parts"][0],
        nested["parts"][1],
    )
    out["all_gather"] = await base.checked(
        "all_gather", ctx.all_gather(base.replica_data("rows", (g % 3 + 1, 4)), axis=0)
    )
    out["broadcast"] = await base.checked("broadcast", ctx.broadcast(x, source_replica=n - 1))
    out["reduce_scatter"] = await base.checked(
        "reduce_scatter", ctx.reduce_scatter("sum", base.replica_data("scatter", (2 * n, 3)))
    )
    await base.checked("barrier", ctx.barrier())
    out["input"] = x
    return out


async def check_collectives(run: base.LayoutRun, workers: Workers) -> None:
    strategy = run.strategy
    n = strategy.num_replicas_in_sync
    local = run.n
    result = await step(strategy, collectives_step)
    xs = global_data("x", "float32", SHAPE, n)
    ints = global_data("i", "int32", SHAPE, n)
    total = base.numpy_reduce("sum", xs)
    rows = [base.host_data(g, "rows", "float32", (g % 3 + 1, 4)) for g in range(n)]
    scatter = base.numpy_reduce("sum", global_data("scatter", "float32", (2 * n, 3), n))
    expected = {
        **{op: base.numpy_reduce(op, xs) for op in ("sum", "mean", "max", "min")},
        "int32 sum": base.numpy_reduce("sum", ints),
        "nested x": total,
        "nested x.T": np.ascontiguousarray(total.T),
        "nested x[:, ::2]": np.ascontiguousarray(total[:, ::2]),
        "all_gather": np.concatenate(rows),
        "broadcast": xs[n - 1],
    }
    problems = []
    import aioreplica

    for j in range(local):
        g = workers.rank * local + j
        mine = aioreplica.select_replica(j, result)
        problems += base.misplaced(mine, g, run.replica_gpus[j])
        want = {**expected, "reduce_scatter": np.array_split(scatter, n)[g], "input": xs[g]}
        for name, value in want.items():
            ok, detail = base.same(mine[name], value, n)
            if not ok:
                problems.append(f"replica {g} {name}: {detail}")
    run.check("collectives across workers match NumPy", not problems, "; ".join(problems[:8]))

    per_replica = result["input"]
    problems = []
    for label, got, reference in (
        ("sum", await strategy.reduce("sum", per_replica, axis=None), total),
        (
            "axis-0 mean",
            await strategy.reduce("mean", per_replica, axis=0),
            np.concatenate(xs).mean(axis=0, dtype=np.float64).astype(np.float32),
        ),
    ):
        ok, detail = base.same(got, reference, n)
        if not ok:
            problems.append(f"{label}: {detail}")
    run.check("strategy.reduce across workers", not problems, "; ".join(problems))


# -- 2. variables -----------------------------------------------------------------------------


async def check_variables(run: base.LayoutRun, workers: Workers) -> None:
    import aioreplica

    strategy = run.strategy
    n = strategy.num_replicas_in_sync
    start = base.host_data(0, "variable start", "float32", VAR_SHAPE)
    with strategy.scope():
        # Each worker passes its own value; every worker must start from the chief's.
        mirrored = aioreplica.Variable(start + np.float32(workers.rank), aggregation="sum")
        on_read = aioreplica.Variable(
            np.zeros(VAR_SHAPE, np.float32), synchronization="on_read", aggregation="sum"
        )

    async def write() -> None:
        base.here("variables")
        await base.checked(
            "mirrored assign_add", mirrored.assign_add(base.replica_data("add", VAR_SHAPE))
        )
        await base.checked("on-read assign", on_read.assign(base.replica_data("own", VAR_SHAPE)))

    await step(strategy, write)
    want = (start + base.numpy_reduce("sum", global_data("add", "float32", VAR_SHAPE, n))).astype(
        np.float32
    )
    problems = base.check_variable_copies(run, "mirrored", mirrored, want)
    problems += workers.copies_differ("mirrored", mirrored)
    ok, detail = base.same(
        on_read.numpy(), base.numpy_reduce("sum", global_data("own", "float32", VAR_SHAPE, n)), n
    )
    if not ok:
        problems.append(f"sync-on-read sum read: {detail}")
    run.check(
        "variables start from the chief; writes and sync-on-read reads are global",
        not problems,
        "; ".join(problems[:8]),
    )


# -- 3. an optimizer --------------------------------------------------------------------------


async def check_optimizer(run: base.LayoutRun, workers: Workers) -> None:
    import aioreplica

    strategy = run.strategy
    n = strategy.num_replicas_in_sync
    m, k = OPT_SHAPE
    rate, momentum = 0.1, 0.9
    start = base.host_data(0, "optimizer w", "float32", (m, k))
    with strategy.scope():
        weight = aioreplica.Variable(start, name="w")
    sgd = aioreplica.optimizers.SGD(rate, momentum=momentum)

    async def train(index: int) -> None:
        gradient = base.replica_data(f"gradient {index}", (k, m))
        await base.checked("apply_gradients", sgd.apply_gradients([(gradient.T, weight)]))

    for index in range(STEPS):
        await step(strategy, train, index)
    grads = [
        sum(g.T.astype(np.float64) for g in global_data(f"gradient {i}", "float32", (k, m), n))
        for i in range(STEPS)
    ]
    want_w, want_m = base.sgd_reference(start, grads, rate, momentum)
    slot = sgd.get_slot(weight, "momentum")
    problems = base.check_variable_copies(run, "w", weight, want_w)
    problems += base.check_variable_copies(run, "momentum", slot, want_m)
    problems += workers.copies_differ("w", weight) + workers.copies_differ("momentum", slot)
    if sgd.iterations != STEPS:
        problems.append(f"iterations {sgd.iterations}, expected {STEPS}")
    run.check(
        "SGD (momentum) across workers matches NumPy, copies identical",
        not problems,
        "; ".join(problems[:8]),
    )


# -- 4. a checkpoint --------------------------------------------------------------------------


async def check_checkpoint(run: base.LayoutRun, workers: Workers) -> None:
    import aioreplica

    strategy = run.strategy
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        weight = aioreplica.Variable(base.host_data(0, "checkpoint w", "float32", (4, 3)))
        on_read = {
            aggregation: aioreplica.Variable(
                np.zeros(5, np.float32), synchronization="on_read", aggregation=aggregation
            )
            for aggregation in ("sum", "mean", "only_first_replica")
        }
    sgd = aioreplica.optimizers.SGD(0.1, momentum=0.5)

    async def train(index: int) -> None:
        gradient = base.replica_data(f"checkpoint gradient {index}", (3, 4))
        await base.checked("apply_gradients", sgd.apply_gradients([(gradient.T, weight)]))
        for aggregation, variable in on_read.items():
            own = base.replica_data(f"checkpoint {aggregation} {index}", (5,))
            await base.checked("on-read assign", variable.assign(own))

    await step(strategy, train, 0)
    saved = weight.numpy()
    checkpoint = aioreplica.Checkpoint(weight=weight, optimizer=sgd, **on_read)
    directory = workers.comm.bcast(tempfile.mkdtemp() if workers.rank == 0 else None)
    problems = []
    try:
        with base.host_sync_forbidden():  # the save reads the variables off the loop's thread
            path = await checkpoint.save(Path(directory) / "checkpoint.npz")
        with np.load(path) as file:  # the chief wrote it; every worker reads it
            in_file = [file[k] for k in file.files if k != "manifest.json"]
        # The sync-on-read variables saved their values over every worker's replicas.
        rows = global_data("checkpoint sum 0", "float32", (5,), n)
        means = global_data("checkpoint mean 0", "float32", (5,), n)
        firsts = global_data("checkpoint only_first_replica 0", "float32", (5,), n)
        for name, expected in (
            ("sum", base.numpy_reduce("sum", rows)),
            ("mean", base.numpy_reduce("mean", means)),
            ("only_first_replica", firsts[0]),
        ):
            rtol, atol = base.tolerance(np.float32, n)
            if not any(
                a.shape == expected.shape and np.allclose(a, expected, rtol=rtol, atol=atol)
                for a in in_file
            ):
                problems.append(f"the file holds no {name} over every worker's replicas")
        await step(strategy, train, 1)
        if np.array_equal(weight.numpy(), saved):
            problems.append("the weight did not change between save and restore")
        await checkpoint.restore(path)
    finally:
        workers.comm.barrier()
        if workers.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
    problems += base.check_variable_copies(run, "w", weight, saved)
    if sgd.iterations != 1:
        problems.append(f"iterations {sgd.iterations} after restore, expected 1")
    run.check("checkpoint save, change, restore across workers", not problems, "; ".join(problems))


# -- layouts ----------------------------------------------------------------------------------


async def check_layout(report: base.Report, label: str, devices: list[Any], gpu: int) -> None:
    import aioreplica

    workers = Workers()
    strategy = aioreplica.MultiWorkerMirroredStrategy(devices, sync_timeout=60.0)
    run = base.LayoutRun(report, label, strategy, [gpu] * len(devices))
    base.WATCH.reset()
    parts: list[tuple[str, Callable[[base.LayoutRun, Workers], Awaitable[None]]]] = [
        ("collectives", check_collectives),
        ("variables", check_variables),
        ("optimizer", check_optimizer),
        ("checkpoint", check_checkpoint),
    ]
    for name, part in parts:
        try:
            await part(run, workers)
        except Exception:
            run.check(f"{name} ran to the end", False, traceback.format_exc())
            if getattr(strategy, "broken", None):
                break  # the cluster is broken: every later call would raise
    run.check(
        "invariant 1: own device and stream at every await",
        not base.WATCH.wrong_context,
        "; ".join(base.WATCH.wrong_context[:5]),
    )
    run.check(
        "invariant 4: no host synchronization on the loop thread in a step",
        not base.WATCH.host_syncs and not base.WATCH.sync_errors,
        ", ".join(sorted(set(base.WATCH.host_syncs)) + base.WATCH.sync_errors[:5]),
    )
    print(
        f"INFO [{label}] longest event-loop pause during steps: "
        f"{base.WATCH.longest_pause * 1e3:.1f} ms",
        flush=True,
    )
    sim = getattr(base.cp, "_sim", None)
    if sim is not None:
        races = list(sim.world().races)
        sim.world().races.clear()
        run.check("no data race recorded by the stand-in", not races, "\n".join(races[:5]))


async def check_layout_within(
    report: base.Report, label: str, devices: list[Any], gpu: int, limit: float
) -> None:
    try:
        with anyio.fail_after(limit):
            await check_layout(report, label, devices, gpu)
    except TimeoutError:
        report.check(f"[{label}] finished within {limit:g} s", False, "timed out")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--loop", choices=("asyncio", "trio", "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="16 x 16 matrices in the chains")
    parser.add_argument("--layout-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    # One write per line, so the workers' lines do not interleave mid-line on a shared stdout.
    sys.stdout.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
    try:
        import cupy
        from mpi4py import MPI  # noqa: F401
    except ImportError as exc:
        print(f"SKIP: {exc}; this check needs CuPy and mpi4py")
        return 2
    base.cp = cupy
    try:
        base.cupyx = importlib.import_module("cupyx")
    except ImportError:
        base.cupyx = None
    from aioreplica._backends._cupy import cuda_device, visible_device_count

    workers = Workers()
    gpus = visible_device_count()
    if gpus == 0:
        print("SKIP: CuPy sees no CUDA device; this check needs a CUDA machine")
        return 2
    simulated = hasattr(cupy, "_sim")
    base.slow_size = base.QUICK_SLOW_SIZE if args.quick or simulated else base.SLOW_SIZE
    gpu = workers.rank % gpus
    if workers.rank == 0:
        print(
            f"{workers.size} workers, CuPy {cupy.__version__}, {gpus} GPU(s) each"
            + (" (the CPU stand-in of CuPy)" if simulated else ""),
            flush=True,
        )
    base.install_host_sync_watch()
    loops = ["asyncio", "trio"] if args.loop == "all" else [args.loop]
    if "trio" in loops and importlib.util.find_spec("trio") is None:
        loops.remove("trio")
        if workers.rank == 0:
            print("trio is not installed: asyncio only", flush=True)
    report = base.Report()
    started = time.perf_counter()
    for loop in loops:
        for local in (1, 2):
            devices: list[Any] = [cuda_device(gpu)]
            devices += [base.ExtraReplicaDevice(gpu, k) for k in range(1, local)]
            label = f"worker {workers.rank}, {local} replica(s) on gpu:{gpu}, {loop}"
            try:
                anyio.run(
                    check_layout_within,
                    report,
                    label,
                    devices,
                    gpu,
                    args.layout_timeout,
                    backend=loop,
                )
            except Exception:
                report.check(f"[{label}] ran to the end", False, traceback.format_exc())
    elapsed = time.perf_counter() - started
    everyone = workers.comm.gather((report.passed, report.failed, report.skipped))
    if workers.rank != 0:
        return 1 if report.failed else 0
    assert everyone is not None
    passed = sum(p for p, _, _ in everyone)
    failed = [name for _, f, _ in everyone for name in f]
    skipped = sum(len(s) for _, _, s in everyone)
    print(
        f"\nall workers: {passed} passed, {len(failed)} failed, {skipped} skipped in "
        f"{elapsed:.1f} s" + "".join(f"\n  FAILED {name}" for name in failed),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
