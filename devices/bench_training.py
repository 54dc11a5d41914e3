"""Training: the cost of an optimizer step, of checkpoints, and data-parallel throughput.

Part A, the optimizer step. ``await opt.apply_gradients(...)`` (SGD with momentum) from N host
replicas, each with its own gradients for the parameters of a model, against the same work
written by hand in the same run: one ``merge_call`` whose merge function sums the replicas'
gradients with NumPy and computes the new parameters and momenta. Two models: the MLP of
``examples/train_digits.py`` (4 arrays, 4,810 float64 values) and a large one (4 arrays of
4 MiB float64). Reported: µs per step, the fastest of several passes.

Part B, checkpoints. ``Checkpoint.save`` and ``restore`` of a model of 4 variables (64 MiB in
all) against ``numpy.savez`` followed by ``fsync`` (the same bytes, without the atomic rename)
and ``numpy.load`` of every array, in the same run.

Part C, throughput. The MLP of ``examples/train_digits.py`` widened to 1,024 hidden units,
trained on a global batch of 2,048 rows: steps per second with 1 and 2 host replicas (each
replica computes in its device's worker thread), against the same step in plain NumPy on the
whole batch.

Replicas are compared with plain NumPy limited to one BLAS thread (``threadpoolctl``), since
each replica is meant to use its own core; plain NumPy with every BLAS thread is shown too.

Checks: (1) checkpoint save within 2x numpy.savez + fsync; (2) 2 host replicas reach at least
1.3x the steps per second of plain NumPy on one BLAS thread (2 cores: the ideal is 2x); (3) on
the small model at 4 replicas, apply_gradients within 1.5x of the hand-written merge (the price
of checks, turns, packing and all-or-nothing commits; it shrinks as arrays grow). Part A's two
rows are timed in alternating passes, so that both see the same machine.

    python devices/bench_training.py --quick      # under a minute
    python devices/bench_training.py --json bench-results/bench_training.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
from _benchlib import REPO_ROOT, fmt, print_checks, run_meta, write_json
from threadpoolctl import threadpool_limits  # installed with scikit-learn (the examples extra)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
if str(REPO_ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "examples"))

import train_digits

import aioreplica
from aioreplica.optimizers import SGD


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    replicas: int
    ours_s: float
    hand_s: float

    @property
    def ratio(self) -> float:
        return self.ours_s / self.hand_s


LEARNING_RATE = 0.1
MOMENTUM = 0.9
Params = dict[str, np.ndarray[Any, Any]]


def small_model() -> Params:
    params: Params = train_digits.init_params(0)
    return params


def large_model() -> Params:
    rng = np.random.default_rng(0)
    return {f"p{i}": rng.random(1 << 19) for i in range(4)}  # 4 x 4 MiB float64


def gradients(params: Params, replicas: int) -> aioreplica.PerReplica[Params] | Params:
    rng = np.random.default_rng(1)
    per: list[Params] = [
        {k: np.asarray(rng.random(v.shape)) for k, v in params.items()} for _ in range(replicas)
    ]
    return aioreplica.PerReplica(per) if replicas > 1 else per[0]


async def best_of(passes: int, steps: int, step: Callable[[], Awaitable[object]]) -> float:
    """The fastest pass's seconds per step (after one warm-up step)."""
    await step()
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for _ in range(steps):
            await step()
        best = min(best, (time.perf_counter() - start) / steps)
    return best


# -- part A -------------------------------------------------------------------------------


def optimizer_step(params: Params, replicas: int) -> Callable[[], Awaitable[object]]:
    strategy = aioreplica.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        variables = {k: aioreplica.Variable(v, name=k) for k, v in params.items()}
    optimizer = SGD(LEARNING_RATE, momentum=MOMENTUM)
    grads = gradients(params, replicas)

    async def replica(g: Params) -> None:
        await optimizer.apply_gradients([(g[k], variables[k]) for k in variables])

    return lambda: strategy.run(replica, (grads,))


def hand_merge_step(params: Params, replicas: int) -> Callable[[], Awaitable[object]]:
    strategy = aioreplica.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    state = {"params": dict(params), "momenta": {k: np.zeros_like(v) for k, v in params.items()}}
    grads = gradients(params, replicas)

    def apply(strategy: aioreplica.MirroredStrategy, g: Any) -> None:
        new_params, new_momenta = {}, {}
        for k, value in state["params"].items():
            total = functools.reduce(np.add, strategy.experimental_local_results(g[k]))
            momentum = MOMENTUM * state["momenta"][k] - LEARNING_RATE * total
            new_momenta[k] = momentum
            new_params[k] = value + momentum
        state["params"], state["momenta"] = new_params, new_momenta

    async def replica(g: Params) -> None:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        await ctx.merge_call(apply, args=(g,))

    return lambda: strategy.run(replica, (grads,))


async def interleaved(
    passes: int,
    steps: int,
    ours: Callable[[], Awaitable[object]],
    hand: Callable[[], Awaitable[object]],
) -> tuple[float, float]:
    """The fastest pass's seconds per step of each, their passes alternating (ours, hand, ours,
    ...) so that both see the same machine; one warm-up step each first."""
    await ours()
    await hand()
    best = [float("inf"), float("inf")]
    for _ in range(passes):
        for i, step in enumerate((ours, hand)):
            start = time.perf_counter()
            for _ in range(steps):
                await step()
            best[i] = min(best[i], (time.perf_counter() - start) / steps)
    return best[0], best[1]


# -- part B -------------------------------------------------------------------------------


async def checkpoint_times(directory: str, passes: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    arrays = {f"w{i}": rng.random(1 << 21) for i in range(4)}  # 4 x 16 MiB float64
    strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        variables = {k: aioreplica.Variable(v, name=k) for k, v in arrays.items()}
    checkpoint = aioreplica.Checkpoint(model=variables)
    ours = os.path.join(directory, "ours.npz")
    theirs = os.path.join(directory, "numpy.npz")

    def numpy_save() -> None:
        with open(theirs, "wb") as file:
            np.savez(file, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds
            file.flush()
            os.fsync(file.fileno())

    def numpy_load() -> None:
        with np.load(theirs) as npz:
            for name in npz.files:
                npz[name]

    times: dict[str, list[float]] = {k: [] for k in ("save", "numpy save", "restore", "load")}
    for _ in range(passes):
        for name, action in (
            ("save", lambda: checkpoint.save(ours)),
            ("numpy save", lambda: anyio.to_thread.run_sync(numpy_save)),
            ("restore", lambda: checkpoint.restore(ours)),
            ("load", lambda: anyio.to_thread.run_sync(numpy_load)),
        ):
            start = time.perf_counter()
            await action()
            times[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in times.items()}


# -- part C -------------------------------------------------------------------------------


def wide_model(hidden: int) -> Params:
    rng = np.random.default_rng(0)
    return {
        "w1": rng.normal(0, 1 / 8, (64, hidden)),
        "b1": np.zeros(hidden),
        "w2": rng.normal(0, hidden**-0.5, (hidden, 10)),
        "b2": np.zeros(10),
    }


async def throughput(replicas: int, hidden: int, batch: int, passes: int, steps: int) -> float:
    """Steps per second of data-parallel training on host replicas."""
    rng = np.random.default_rng(2)
    x, y = rng.random((batch, 64)), rng.integers(0, 10, batch)
    strategy = aioreplica.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        params = {k: aioreplica.Variable(v, name=k) for k, v in wide_model(hidden).items()}
    optimizer = SGD(0.01, momentum=MOMENTUM)
    batch_of: Any = (x, y)
    if replicas > 1:
        batch_of = (
            aioreplica.PerReplica(np.array_split(x, replicas)),
            aioreplica.PerReplica(np.array_split(y, replicas)),
        )

    def step() -> Awaitable[object]:
        return strategy.run(train_digits.train_step, (batch_of, params, optimizer, batch))

    return 1.0 / await best_of(passes, steps, step)


async def numpy_throughput(hidden: int, batch: int, passes: int, steps: int) -> float:
    rng = np.random.default_rng(2)
    x, y = rng.random((batch, 64)), rng.integers(0, 10, batch)
    params = wide_model(hidden)
    momenta = {k: np.zeros_like(v) for k, v in params.items()}

    async def step() -> None:  # updated in place, as the optimizer updates its copies
        _, grads = train_digits.loss_and_grads(np, params, x, y, batch)
        for k in params:
            momenta[k] *= MOMENTUM
            momenta[k] -= 0.01 * grads[k]
            params[k] += momenta[k]

    return 1.0 / await best_of(passes, steps, step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer steps and passes")
    parser.add_argument(
        "--json", type=Path, default=REPO_ROOT / "bench-results/bench_training.json"
    )
    args = parser.parse_args(argv)
    passes = 3 if args.quick else 7
    started = time.perf_counter()

    table_a: list[Row] = []
    for model_name, model, steps in (("small", small_model(), 200), ("large", large_model(), 10)):
        for replicas in (1, 4, 8):
            ours, hand = anyio.run(
                interleaved,
                passes,
                steps // 4 if args.quick else steps,
                optimizer_step(model, replicas),
                hand_merge_step(model, replicas),
            )
            table_a.append(Row(model_name, replicas, ours, hand))
    with tempfile.TemporaryDirectory(dir=REPO_ROOT) as directory:
        ckpt = anyio.run(checkpoint_times, directory, 2 if args.quick else 5)
    hidden, batch = 1024, 2048
    steps_c = 5 if args.quick else 20
    rates = {
        "plain NumPy, BLAS threads": anyio.run(numpy_throughput, hidden, batch, passes, steps_c)
    }
    # Replicas replace BLAS threads: compare them with one BLAS thread each, so that the table
    # shows the replicas' own parallelism.
    with threadpool_limits(limits=1, user_api="blas"):
        rates["plain NumPy, 1 BLAS thread"] = anyio.run(
            numpy_throughput, hidden, batch, passes, steps_c
        )
        for replicas in (1, 2):
            rates[f"{replicas} replica{'s' * (replicas > 1)}, 1 BLAS thread"] = anyio.run(
                throughput, replicas, hidden, batch, passes, steps_c
            )

    print(f"\nTable A: one SGD-with-momentum step, µs (fastest of {passes} passes)")
    print(f"{'model':>6}{'N':>4}{'apply_gradients':>17}{'hand merge':>12}{'ratio':>8}")
    for row in table_a:
        print(
            f"{row.model:>6}{row.replicas:>4}{fmt(row.ours_s * 1e6, 17)}"
            f"{fmt(row.hand_s * 1e6, 12)}{fmt(row.ratio, 8)}"
        )
    print("\nTable B: checkpoint of 4 variables, 64 MiB, 2 replicas, ms")
    print(f"{'':>9}{'aioreplica':>12}{'numpy':>9}{'ratio':>8}")
    for action, baseline in (("save", "numpy save"), ("restore", "load")):
        print(
            f"{action:>9}{fmt(ckpt[action] * 1e3, 12)}{fmt(ckpt[baseline] * 1e3, 9)}"
            f"{fmt(ckpt[action] / ckpt[baseline], 8)}"
        )
    print(f"\nTable C: steps per second, hidden {hidden}, global batch {batch}")
    single = rates["plain NumPy, 1 BLAS thread"]
    print(f"{'':>30}{'steps/s':>9}{'x 1 thread':>12}")
    for name, rate in rates.items():
        print(f"{name:>30}{fmt(rate, 9)}{fmt(rate / single, 12)}")

    def ratio_of(model: str, replicas: int) -> float:
        return next(r.ratio for r in table_a if r.model == model and r.replicas == replicas)

    save_ratio = ckpt["save"] / ckpt["numpy save"]
    speedup = rates["2 replicas, 1 BLAS thread"] / single
    checks = [
        {
            "name": "(1) checkpoint save within 2x numpy.savez + fsync",
            "status": "PASS" if save_ratio <= 2.0 else "FAIL",
            "detail": f"{save_ratio:.2f}x",
        },
        {
            "name": "(2) 2 host replicas reach 1.3x plain NumPy's steps per second (1 BLAS thread)",
            "status": "PASS" if speedup >= 1.3 else "FAIL",
            "detail": f"{speedup:.2f}x (cores: {os.cpu_count()})",
        },
        {
            "name": "(3) apply_gradients on the small model, 4 replicas, within 1.5x of the "
            "same update as one hand-written merge_call",
            "status": "PASS" if ratio_of("small", 4) <= 1.5 else "FAIL",
            "detail": f"{ratio_of('small', 4):.2f}x (large model {ratio_of('large', 4):.2f}x)",
        },
    ]
    print_checks(checks)
    write_json(
        args.json,
        {
            "meta": run_meta()
            | {"quick": args.quick, "wall_s": round(time.perf_counter() - started, 1)},
            "optimizer_step": [dataclasses.asdict(row) | {"ratio": row.ratio} for row in table_a],
            "checkpoint_s": ckpt,
            "steps_per_second": rates,
            "checks": checks,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
