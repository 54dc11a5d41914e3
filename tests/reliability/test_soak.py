"""A long training run stays flat: memory, tasks and threads do not grow with the steps.

A tiny linear model trains on two replicas, each step one ``strategy.run`` with a merge (the
loss, all-reduced), an optimizer step (a second merge round) and a metric (a sync-on-read
variable). Every tenth of the run is a window; at each window's end the test collects garbage
and samples the process: resident memory, live tasks, live threads and, over the last
``TRACED_WINDOWS`` windows, the memory that tracemalloc saw allocated since it started and
still alive. The first ``WARMUP_WINDOWS`` windows are warm-up (pools, caches and lazily started
threads fill there). After them:

- **tasks and threads**: none alive that was not alive when warm-up ended. Exact: nothing in
  the loop starts background work, so there is no noise to allow for.
- **traced memory**: at most ``TRACED_BYTES_PER_STEP`` more per step over at least one of the
  measured windows (those after the first traced one). tracemalloc makes a step about four times
  slower, so it runs over the last ``TRACED_WINDOWS`` windows only. Started in a running
  process, it first sees the allocators' caches turn over (blocks freed before it started are
  reused, new ones it tracks take their place: about 13 KB, nearly all in the first thousand
  steps), so the first traced window only settles. Then what remains is noise: a cache of at
  most about 90 blocks of 57 bytes (5 KB) that fills and empties as NumPy arrays are made
  read-only, measured from -2 to +4 KB between two window ends, and now and then a one-time
  step of 13-21 KB in one window (a table of the interpreter or the loop growing once). A leak
  grows in every window alike, so the window that grew least is the one compared: 4 KB over a
  window of the default run; the smallest leak there is, one pointer kept per step (a list that
  only ever grows), is 8 bytes per step: 8 KB in each window.
- **resident memory**: at most ``RSS_SLACK`` more at any window's end than when warm-up ended.
  Measured growth is nil (the allocator reuses the same pages). The slack allows for the
  allocator's arenas and page granularity and still catches a leak of 130 bytes per step in
  the default run (of 13 in the slow one) of memory that tracemalloc does not see, such as a C
  library's own allocations.

The default suite runs ``STEPS`` steps (under 10 s per loop on two cores); the ``slow`` soak
(``pytest -m slow``) ten times more.
"""

from __future__ import annotations

import gc
import itertools
import os
import resource
import threading
import tracemalloc
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import pytest
from harness import live_tasks

from aioreplica import MirroredStrategy, PerReplica, Variable
from aioreplica.optimizers import SGD
from aioreplica.testing import host_devices, replica_context

pytestmark = pytest.mark.anyio

STEPS: Final = 10_000
SLOW_STEPS: Final = 100_000
WINDOWS: Final = 10
WARMUP_WINDOWS: Final = 2
TRACED_WINDOWS: Final = 3
TRACED_BYTES_PER_STEP: Final = 4.0
RSS_SLACK: Final = 1 << 20


@dataclass(frozen=True)
class Sample:
    """The process at the end of one window."""

    step: int
    rss: int
    traced: int | None  # bytes allocated since tracing started and still alive
    tasks: set[Any]
    threads: set[threading.Thread]


def resident_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except FileNotFoundError:  # not Linux: the peak, which still never falls
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class TinyModel:
    """A linear regression on two replicas: the loss all-reduced, an SGD step, a row count."""

    def __init__(self) -> None:
        self.strategy = MirroredStrategy(host_devices(2))
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 8))
        y = x @ np.arange(8.0)
        self.batch = (PerReplica([x[:32], x[32:]]), PerReplica([y[:32], y[32:]]))
        with self.strategy.scope():
            self.w = Variable(np.zeros(8), name="w")
            self.rows = Variable(0, name="rows", synchronization="on_read", aggregation="sum")
        self.optimizer = SGD(0.05)

    async def step(self, x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> Any:
        error = x @ self.w.value() - y
        loss = await replica_context().all_reduce("mean", np.mean(error * error))
        await self.optimizer.apply_gradients([(x.T @ error / 64, self.w)])
        await self.rows.assign_add(len(x))
        return loss

    async def train(self, steps: int) -> None:
        for _ in range(steps):
            await self.strategy.run(self.step, self.batch)


async def soak(steps: int) -> list[Sample]:
    """Train ``steps`` steps; a sample at the end of each window."""
    model = TinyModel()
    window = steps // WINDOWS
    trace_from = WINDOWS - TRACED_WINDOWS
    samples = []
    started_tracing = False
    try:
        for number in range(WINDOWS):
            if number == trace_from and not tracemalloc.is_tracing():
                tracemalloc.start()
                started_tracing = True
            await model.train(window)
            gc.collect()
            traced = tracemalloc.get_traced_memory()[0] if number >= trace_from else None
            samples.append(
                Sample(
                    (number + 1) * window,
                    resident_bytes(),
                    traced,
                    live_tasks(),
                    set(threading.enumerate()),
                )
            )
    finally:
        if started_tracing:
            tracemalloc.stop()
    assert model.optimizer.iterations == steps
    assert int(model.rows) == 64 * steps
    return samples


def assert_flat(samples: list[Sample]) -> None:
    """Nothing grows after warm-up (see the module docstring for the tolerances)."""
    baseline = samples[WARMUP_WINDOWS - 1]
    for sample in samples[WARMUP_WINDOWS:]:
        new_tasks = sample.tasks - baseline.tasks
        new_threads = sample.threads - baseline.threads
        assert not new_tasks, f"tasks alive at step {sample.step} not there after warm-up"
        assert not new_threads, f"threads started by step {sample.step}: {new_threads}"
        grown = sample.rss - baseline.rss
        assert grown <= RSS_SLACK, f"resident memory grew {grown} bytes by step {sample.step}"
    measured = samples[WINDOWS - TRACED_WINDOWS :]  # from the end of the settling window
    growth = []
    for before, after in itertools.pairwise(measured):
        assert before.traced is not None
        assert after.traced is not None
        growth.append((after.traced - before.traced, after.step - before.step))
    grown, steps = min(growth, key=lambda g: g[0] / g[1])
    assert grown <= TRACED_BYTES_PER_STEP * steps, (
        f"{grown} bytes more allocated and alive after {steps} more steps, in the window that "
        f"grew least (each window: {[g for g, _ in growth]})"
    )


@pytest.mark.timeout(120)
async def test_training_stays_flat() -> None:
    assert_flat(await soak(STEPS))


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_long_training_stays_flat() -> None:
    assert_flat(await soak(SLOW_STEPS))
