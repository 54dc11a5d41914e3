"""Distributed input: prefetch hiding a slow loader, and the cost of splitting batches.

Part A, prefetch. A synchronous loader that sleeps 5 ms per batch (as a slow disk or decoder
would; ``distribute_dataset`` pulls it in a worker thread) feeds a step that awaits 5 ms. With
``prefetch=2`` the loader runs while the step does, so a step should cost about 5 ms; with
``prefetch=0`` it costs about 10 ms. Reported: the steady-state time per step (the first steps
are left out), the fastest of several passes.

Part B, overhead. For 8 host replicas and in-memory arrays (``x`` of 64 float32 features and
``y`` labels), the time per global batch of ``distribute_dataset(batched((x, y), B))`` against
plain slicing of the same arrays into the same 8 views per leaf, in the same run.

Checks: (1) prefetch=2 steady state within 1.2 x 5 ms; (2) prefetch=0 near 10 ms (reported,
PASS when above 1.6 x 5 ms: it shows the test would catch a prefetcher that does nothing).

    python devices/bench_input.py --quick      # under a minute
    python devices/bench_input.py --json bench-results/bench_input.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
from _benchlib import REPO_ROOT, fmt, print_checks, run_meta, write_json

if TYPE_CHECKING:
    from collections.abc import Iterator

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import aioreplica

SLEEP_S = 0.005
REPLICAS = 8


def slow_loader(batches: int, rows: int) -> Iterator[np.ndarray[Any, Any]]:
    data = np.ones((rows, 16), dtype=np.float32)
    for _ in range(batches):
        time.sleep(SLEEP_S)  # a slow disk or decoder: blocking, pulled in a worker thread
        yield data


async def _step(x: Any) -> None:
    await anyio.sleep(SLEEP_S)


async def prefetch_pass(prefetch: int, steps: int, warmup: int) -> float:
    """Seconds per step after ``warmup`` steps, for one pass over the slow loader."""
    strategy = aioreplica.MirroredStrategy(["cpu:0", "cpu:1"])
    dist = strategy.distribute_dataset(slow_loader(steps + warmup, 64), prefetch=prefetch)
    count = 0
    start = 0.0
    async for batch in dist:
        if count == warmup:
            start = time.perf_counter()
        await strategy.run(_step, args=(batch,))
        count += 1
    return (time.perf_counter() - start) / steps


async def overhead(rows: int, batch: int, reps: int) -> dict[str, float]:
    """µs per global batch: distribute_dataset (prefetch 0 and 2) and plain slicing."""
    strategy = aioreplica.MirroredStrategy([f"cpu:{i}" for i in range(REPLICAS)])
    x = np.random.default_rng(0).random((rows, 64), dtype=np.float32)
    y = np.arange(rows)
    batches = -(-rows // batch)
    times: dict[str, list[float]] = {
        "aioreplica prefetch=0": [],
        "aioreplica prefetch=2": [],
        "plain slicing": [],
    }
    for _ in range(reps):
        for prefetch in (0, 2):
            t0 = time.perf_counter()
            async for _element in strategy.distribute_dataset(
                aioreplica.batched((x, y), batch), prefetch=prefetch
            ):
                pass
            times[f"aioreplica prefetch={prefetch}"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for start in range(0, rows, batch):
            stop = min(start + batch, rows)
            bx, by = x[start:stop], y[start:stop]
            bounds = np.linspace(0, stop - start, REPLICAS + 1).astype(int)
            _ = [(bx[a:b], by[a:b]) for a, b in itertools.pairwise(bounds)]
        times["plain slicing"].append(time.perf_counter() - t0)
    return {name: min(ts) / batches * 1e6 for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer steps and passes")
    parser.add_argument("--json", type=Path, default=REPO_ROOT / "bench-results/bench_input.json")
    args = parser.parse_args(argv)
    steps, warmup, passes = (40, 5, 2) if args.quick else (150, 10, 3)
    started = time.perf_counter()

    per_step = {}
    for prefetch in (2, 0):
        per_step[prefetch] = min(
            anyio.run(prefetch_pass, prefetch, steps, warmup) for _ in range(passes)
        )
    costs = anyio.run(overhead, 20_000 if args.quick else 100_000, 256, 3 if args.quick else 5)

    print(f"\nTable 1: loader sleeping {SLEEP_S * 1e3:g} ms per batch, step awaiting the same")
    print(f"{'prefetch':>9}{'ms per step':>13}{'x sleep':>9}")
    for prefetch, seconds in per_step.items():
        print(f"{prefetch:>9}{fmt(seconds * 1e3, 13)}{fmt(seconds / SLEEP_S, 9)}")
    print(f"\nTable 2: µs per global batch of 256 rows, {REPLICAS} host replicas")
    for name, us in costs.items():
        print(f"  {name:<24}{fmt(us, 10)}")

    ratio_on, ratio_off = per_step[2] / SLEEP_S, per_step[0] / SLEEP_S
    checks = [
        {
            "name": "(1) prefetch=2 steady state within 1.2 x the 5 ms step",
            "status": "PASS" if ratio_on <= 1.2 else "FAIL",
            "detail": f"{per_step[2] * 1e3:.2f} ms per step: {ratio_on:.2f}x",
        },
        {
            "name": "(2) prefetch=0 pays loader and step one after the other (about 10 ms)",
            "status": "PASS" if ratio_off >= 1.6 else "FAIL",
            "detail": f"{per_step[0] * 1e3:.2f} ms per step: {ratio_off:.2f}x",
        },
    ]
    print_checks(checks)
    write_json(
        args.json,
        {
            "meta": run_meta()
            | {"quick": args.quick, "wall_s": round(time.perf_counter() - started, 1)},
            "ms_per_step": {str(k): v * 1e3 for k, v in per_step.items()},
            "us_per_batch": costs,
            "checks": checks,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
