"""The training step of ``examples/train_digits.py`` against the same math in plain NumPy.

Everything is timed in the same run, one epoch of the example's loop at a time (1,437 training
rows, global batch 64, ``drop_remainder=True``: 22 steps), for each event loop in ``--loop``
(default asyncio and uvloop; trio on request) and each number of host replicas in
``--replicas`` (default 4 and 8). The example's own functions are used (``load_data``,
``init_params``, ``train_step``, ``recorded_step``, ``loss_and_grads``), so the benchmark
follows the example when it changes. Rows:

run per step     the example's loop with ``--steps-per-call 1``: ``async for batch in
                 aiter(dataset)``, ``losses = await strategy.run(train_digits.train_step,
                 (batch, params, optimizer, 64))``, ``float(await strategy.reduce("sum",
                 losses))`` appended to a list. The dataset is ``strategy.distribute_dataset(
                 aioreplica.batched((x_train, y_train), 64, shuffle=True, seed=0),
                 drop_remainder=True)`` (prefetch 2, the default), the variables are made in
                 ``strategy.scope()`` from ``train_digits.init_params(0)``, the optimizer is
                 ``SGD(0.1, momentum=0.9)``; strategy ``MirroredStrategy(["cpu:0", ...])``.
run_steps K=16   the example's loop with ``--steps-per-call 16``: ``strategy.run_steps`` of
                 ``train_digits.recorded_step`` over ``aiter(dataset)``, 16 steps a call until
                 a call takes fewer (16 + 6 steps per epoch).
numpy            one process, no aioreplica: for each of the same global batches (the same
                 rows in the same order, drawn beforehand from ``aioreplica.batched`` with the
                 same seed, so that getting one is a list index; the first 4 epochs, cycled)
                 ``loss, grads = train_digits.loss_and_grads(np, params, x, y, 64)``, then
                 SGD with momentum as aioreplica's ``SGD`` computes it (``m = 0.9 * m - 0.1 *
                 g``, ``w = w + m``), then ``float(loss)`` appended to a list. BLAS keeps its
                 default threads (``meta.blas`` in the JSON says how many).
numpy 1 thread   the same under ``threadpoolctl``'s limit of one BLAS thread.

Each loop's measurements run in one ``anyio.run`` of their own (uvloop through anyio's
``use_uvloop``), the NumPy rows interleaved with the aioreplica rows, so ratios are same-run.
The sampling harness (``run_interleaved`` in ``_benchlib``) runs in a worker thread and calls
into the loop (``anyio.from_thread``), so every timed step, NumPy's too, runs on the loop's
thread. Each row is calibrated so that one sample lasts about 0.2 s (0.05 s with ``--quick``);
the samples (7, or 3 with ``--quick``) are then taken interleaved, A B C A B C ...; the garbage
collector stays on, as in a real program (``gc.collect()`` before each sample). Reported: µs per
step of the fastest sample, and its ratio to the ``numpy`` row of the same loop's run.

Same math: before timing, untimed, each aioreplica row trains a fresh copy (variables,
optimizer, dataset, on the strategy it is timed on) for 20 steps from ``init_params(0)`` and
compares with NumPy's 20 steps: every global batch (the replicas' slices put back together)
must equal NumPy's exactly, and the parameters, momentum slots and losses must agree to 1e-9
of each array's largest magnitude (the replicas sum partial gradients where NumPy sums the
whole batch, so rounding differs); the epoch must take as many steps as NumPy's. A mismatch
fails check (b) and the row is still timed; an error drops the row.

Breakdown (information only, not checked), at 4 replicas on the first loop of ``--loop``:
one step's parts timed separately, interleaved with each other: ``await anext(iterator)`` of
the dataset; ``strategy.run`` of an empty step function (the train step's arguments); of a step
whose replicas each ``await ctx.device.run(noop)``; of a step computing its loss and gradients
inline (no ``device.run``) without the optimizer; of one that only calls
``optimizer.apply_gradients`` with gradients computed beforehand (its own variables and
optimizer); ``float(await strategy.reduce("sum", losses))``; with the whole step (anext, run,
reduce) and NumPy's step and one replica's ``loss_and_grads`` (16 rows) for scale.

Checks, PASS / FAIL (SKIP when the run left out what a check needs): (a) the run-per-step
train_digits step at 4 replicas on asyncio within 5x the NumPy step; (b) every aioreplica row
matched NumPy after 20 steps. The other ratios (8 replicas, uvloop, trio, run_steps) are
reported, not judged. ``--json`` (default ``bench-results/bench_step.json``) gets the metadata,
every sample, the fastest and median times, the verification, the breakdown and the checks.
The exit status is 0 whatever the checks say.

    .venv/bin/python devices/bench_step.py --quick                # under a minute
    .venv/bin/python devices/bench_step.py                        # about a minute
    .venv/bin/python devices/bench_step.py --loop trio --replicas 4
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.to_thread
import numpy as np
from _benchlib import (
    REPO_ROOT,
    Case,
    dist_versions,
    fmt,
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
from threadpoolctl import threadpool_info, threadpool_limits  # with scikit-learn (examples)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
if str(REPO_ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "examples"))

import train_digits

import aioreplica
from aioreplica.optimizers import SGD

LOOPS = ("asyncio", "uvloop", "trio")
SEED = 0
BATCH = 64
LEARNING_RATE = 0.1
MOMENTUM = 0.9
STEPS_PER_CALL = 16
VERIFY_STEPS = 20
RTOL = 1e-9
NUMPY_EPOCHS = 4  # epochs of batches drawn for the NumPy rows, cycled
BREAKDOWN_REPLICAS = 4
VERIFY_TIMEOUT_S = 120.0
MAX_REPS = 1_000_000

PER_STEP, RUN_STEPS = "run per step", f"run_steps K={STEPS_PER_CALL}"
NUMPY, NUMPY_1T = "numpy", "numpy 1 thread"

Arrays = dict[str, np.ndarray[Any, Any]]
Batch = tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]


# --- rows -------------------------------------------------------------------------------------


@dataclass
class Row:
    """One timed row; a rep is ``steps_per_rep`` training steps."""

    loop: str
    replicas: int  # 0: NumPy, no replicas
    form: str
    steps_per_rep: int
    status: str = "ok"  # ok | error
    reason: str = ""
    reps: int = 0
    samples_ns: list[int] = field(default_factory=list)
    verification: dict[str, Any] = field(default_factory=dict)

    @property
    def tolerates_failure(self) -> bool:
        return self.form not in (NUMPY, NUMPY_1T)

    @property
    def label(self) -> str:
        return f"{self.loop} N={self.replicas} {self.form}"

    def _per_step_us(self) -> list[float]:
        if self.status != "ok":
            return []
        return [s / self.reps / self.steps_per_rep / 1e3 for s in self.samples_ns]

    @property
    def best_us(self) -> float | None:
        """µs per step in the fastest sample: noise on a shared machine only ever adds time."""
        return min(self._per_step_us(), default=None)

    @property
    def median_us(self) -> float | None:
        us = self._per_step_us()
        return statistics.median(us) if us else None

    def as_json(self) -> dict[str, Any]:
        return asdict(self) | {"best_us": self.best_us, "median_us": self.median_us}


# --- the example's training, and NumPy's ------------------------------------------------------


def numpy_epochs(
    x: np.ndarray[Any, Any], y: np.ndarray[Any, Any], epochs: int
) -> list[list[Batch]]:
    """The global batches ``distribute_dataset`` hands out, epoch by epoch (full batches only,
    as ``drop_remainder=True``)."""
    data = aioreplica.batched((x, y), BATCH, shuffle=True, seed=SEED)
    out = []
    for _ in range(epochs):
        batches: list[Batch] = [(bx, by) for bx, by in data]
        out.append([b for b in batches if len(b[1]) == BATCH])
    return out


class NumpyTraining:
    """One process, no aioreplica: the same step on whole global batches."""

    def __init__(self, epochs: list[list[Batch]]) -> None:
        self.params: Arrays = train_digits.init_params(SEED)
        self.momenta: Arrays = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.epochs, self.next_epoch = epochs, 0
        self.losses: list[float] = []

    def step(self, x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> None:
        loss, grads = train_digits.loss_and_grads(np, self.params, x, y, BATCH)
        for name, grad in grads.items():
            momentum = MOMENTUM * self.momenta[name] - LEARNING_RATE * grad
            self.momenta[name] = momentum
            self.params[name] = self.params[name] + momentum
        self.losses.append(float(loss))

    def epoch(self) -> None:
        for x, y in self.epochs[self.next_epoch % len(self.epochs)]:
            self.step(x, y)
        self.next_epoch += 1


class Training:
    """The example's state on one strategy: variables, optimizer, dataset, loss list."""

    def __init__(
        self,
        strategy: aioreplica.MirroredStrategy,
        x: np.ndarray[Any, Any],
        y: np.ndarray[Any, Any],
    ) -> None:
        self.strategy = strategy
        with strategy.scope():
            self.params = {
                name: aioreplica.Variable(value, name=name)
                for name, value in train_digits.init_params(SEED).items()
            }
        self.optimizer = SGD(LEARNING_RATE, momentum=MOMENTUM)
        batches = aioreplica.batched((x, y), BATCH, shuffle=True, seed=SEED)
        self.dataset = strategy.distribute_dataset(batches, drop_remainder=True)
        self.losses: list[float] = []
        self.iterator: aioreplica.DistributedIterator | None = None  # breakdown only

    async def step(self, batch: Any) -> None:
        """``run`` and ``reduce``, as the example's loop with ``steps_per_call == 1``."""
        losses = await self.strategy.run(
            train_digits.train_step, (batch, self.params, self.optimizer, BATCH)
        )
        self.losses.append(float(await self.strategy.reduce("sum", losses)))

    async def epoch_per_step(self) -> None:
        async for batch in aiter(self.dataset):
            await self.step(batch)

    def recorded(self) -> Callable[[Any], Awaitable[None]]:
        return functools.partial(
            train_digits.recorded_step,
            params=self.params,
            optimizer=self.optimizer,
            global_batch=BATCH,
            losses=self.losses,
        )

    async def epoch_run_steps(self) -> None:
        """The example's loop with ``steps_per_call == 16``: calls until one takes fewer."""
        iterator, step = aiter(self.dataset), self.recorded()
        while True:
            before = len(self.losses)
            await self.strategy.run_steps(step, iterator, STEPS_PER_CALL)
            if len(self.losses) - before < STEPS_PER_CALL:
                return

    async def next_batch(self) -> Any:
        """The next element, starting a new pass when one ends."""
        if self.iterator is not None:
            try:
                return await anext(self.iterator)
            except StopAsyncIteration:
                pass
        self.iterator = aiter(self.dataset)
        return await anext(self.iterator)

    def state(self) -> tuple[Arrays, Arrays]:
        params = {k: np.array(v.numpy()) for k, v in self.params.items()}
        momenta = {
            k: np.array(self.optimizer.get_slot(v, "momentum").numpy())
            for k, v in self.params.items()
        }
        return params, momenta


@dataclass
class Reference:
    """NumPy's first ``VERIFY_STEPS`` steps from ``init_params``: what aioreplica must match."""

    batches: list[Batch]
    params: Arrays
    momenta: Arrays
    losses: list[float]
    steps_per_epoch: int


def reference(epochs: list[list[Batch]]) -> Reference:
    numpy = NumpyTraining(epochs)
    batches = epochs[0][:VERIFY_STEPS]
    for x, y in batches:
        numpy.step(x, y)
    return Reference(batches, numpy.params, numpy.momenta, numpy.losses, len(epochs[0]))


def _rel_error(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> float:
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    diff = float(np.max(np.abs(np.asarray(got) - want))) if want.size else 0.0
    return diff / scale if scale > 0 else diff


async def verify(training: Training, form: str, ref: Reference) -> dict[str, Any]:
    """Train ``training`` (fresh) for ``VERIFY_STEPS`` steps in ``form`` and compare with NumPy;
    then finish the epoch and count its steps."""
    strategy, batches_equal = training.strategy, True
    state: tuple[Arrays, Arrays] | None = None
    if form == PER_STEP:
        iterator, steps = aiter(training.dataset), 0
        async for batch in iterator:
            if steps < VERIFY_STEPS:
                x, y = (np.concatenate(strategy.experimental_local_results(b)) for b in batch)
                want_x, want_y = ref.batches[steps]
                batches_equal &= np.array_equal(x, want_x) and np.array_equal(y, want_y)
            await training.step(batch)
            steps += 1
            if steps == VERIFY_STEPS:
                state = training.state()
    else:
        iterator, step = aiter(training.dataset), training.recorded()
        for wanted in (STEPS_PER_CALL, VERIFY_STEPS - STEPS_PER_CALL):
            await strategy.run_steps(step, iterator, wanted)
        state = training.state()
        while True:  # the rest of the epoch, as the example's loop takes it
            before = len(training.losses)
            await strategy.run_steps(step, iterator, STEPS_PER_CALL)
            if len(training.losses) - before < STEPS_PER_CALL:
                break
        steps = len(training.losses)
    if steps != ref.steps_per_epoch or state is None:
        raise RuntimeError(f"an epoch took {steps} steps, NumPy's {ref.steps_per_epoch}")
    params, momenta = state
    errors = {
        "params": max(_rel_error(params[k], ref.params[k]) for k in ref.params),
        "momenta": max(_rel_error(momenta[k], ref.momenta[k]) for k in ref.momenta),
        "losses": _rel_error(np.array(training.losses[:VERIFY_STEPS]), np.array(ref.losses)),
    }
    ok = batches_equal and all(e <= RTOL for e in errors.values())
    return {"ok": ok, "batches_equal": batches_equal, "max_rel_error": errors}


# --- one loop's measurements ------------------------------------------------------------------


def _from_loop(step: Callable[[], Awaitable[object]], reps: int) -> int:
    """``reps`` calls of ``step``, timed on the loop's thread (called from the harness's)."""
    return anyio.from_thread.run(timed_async, step, reps)


def numpy_case(row: Row, epochs: list[list[Batch]]) -> Case[Row]:
    numpy = NumpyTraining(epochs)

    def run(reps: int) -> int:
        numpy.losses.clear()
        return timed_sync(numpy.epoch, reps)

    def sample(reps: int) -> int:
        if row.form == NUMPY:
            return anyio.from_thread.run_sync(run, reps)
        with threadpool_limits(limits=1, user_api="blas"):
            return anyio.from_thread.run_sync(run, reps)

    return Case(row, sample, lambda: None)


def training_case(
    row: Row,
    strategy: aioreplica.MirroredStrategy,
    data: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]],
    ref: Reference,
) -> Case[Row]:
    training = Training(strategy, *data)
    epoch = training.epoch_per_step if row.form == PER_STEP else training.epoch_run_steps

    def sample(reps: int) -> int:
        training.losses.clear()
        return _from_loop(epoch, reps)

    def check() -> None:
        fresh = Training(strategy, *data)
        row.verification = anyio.from_thread.run(
            lambda: within(VERIFY_TIMEOUT_S, verify(fresh, row.form, ref))
        )

    return Case(row, sample, check)


async def _noop_step(batch: Any, params: Any, optimizer: Any, global_batch: int) -> None:
    return None


def _noop() -> None:
    return None


async def _device_noop_step(batch: Any, params: Any, optimizer: Any, global_batch: int) -> None:
    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    await ctx.device.run(_noop)


async def _inline_grads_step(
    batch: Any, params: dict[str, aioreplica.Variable], optimizer: Any, global_batch: int
) -> Any:
    ctx = aioreplica.get_replica_context()
    assert ctx is not None
    x, y = batch
    values = {name: variable.value() for name, variable in params.items()}
    loss, _ = train_digits.loss_and_grads(ctx.device.xp, values, x, y, global_batch)
    return loss


async def _apply_step(
    grads: Arrays, params: dict[str, aioreplica.Variable], optimizer: SGD
) -> None:
    await optimizer.apply_gradients([(grads[name], params[name]) for name in params])


BREAKDOWN = (
    "whole step: anext, run, reduce",
    "dataset: await anext(iterator)",
    "run(): empty step function",
    "run(): each replica awaits device.run(noop)",
    "run(): loss_and_grads inline, no optimizer",
    "run(): apply_gradients only, gradients given",
    'float(await strategy.reduce("sum", losses))',
    "numpy: the whole step (64 rows)",
    "numpy: loss_and_grads of one replica's rows",
)


async def breakdown_cases(
    loop: str,
    strategy: aioreplica.MirroredStrategy,
    data: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]],
    epochs: list[list[Batch]],
) -> tuple[list[Case[Row]], list[Training]]:
    """The breakdown's rows, and the trainings whose iterators are to be closed after."""
    whole, parts, applied = (Training(strategy, *data) for _ in range(3))
    batch = await parts.next_batch()
    args = (batch, parts.params, parts.optimizer, BATCH)
    losses = await strategy.run(train_digits.train_step, args)
    values = {k: v.numpy() for k, v in parts.params.items()}
    per_replica = [
        train_digits.loss_and_grads(np, values, x, y, BATCH)[1]
        for x, y in zip(*(strategy.experimental_local_results(b) for b in batch), strict=True)
    ]
    grads = aioreplica.PerReplica(per_replica)
    replica_x, replica_y = (strategy.experimental_local_results(b)[0] for b in batch)
    numpy = NumpyTraining(epochs)
    numpy_batch = epochs[0][0]

    async def whole_step() -> None:
        await whole.step(await whole.next_batch())

    async def reduce() -> None:
        float(await strategy.reduce("sum", losses))

    steps: list[Callable[[], Awaitable[object]]] = [
        whole_step,
        parts.next_batch,
        lambda: strategy.run(_noop_step, args),
        lambda: strategy.run(_device_noop_step, args),
        lambda: strategy.run(_inline_grads_step, args),
        lambda: strategy.run(_apply_step, (grads, applied.params, applied.optimizer)),
        reduce,
    ]
    cases = []
    for name, step in zip(BREAKDOWN, steps, strict=False):
        cases.append(
            Case(
                Row(loop, BREAKDOWN_REPLICAS, name, 1),
                functools.partial(_from_loop, step),
                lambda: None,
            )
        )

    def numpy_step() -> None:
        numpy.step(*numpy_batch)
        numpy.losses.clear()

    def numpy_grads() -> None:
        train_digits.loss_and_grads(np, values, replica_x, replica_y, BATCH)

    for name, fn in zip(BREAKDOWN[len(steps) :], (numpy_step, numpy_grads), strict=True):
        cases.append(
            Case(
                Row(loop, BREAKDOWN_REPLICAS, name, 1),
                functools.partial(
                    lambda f, reps: anyio.from_thread.run_sync(timed_sync, f, reps), fn
                ),
                lambda: None,
            )
        )
    return cases, [whole, parts]


async def measure_loop(
    loop: str, replicas: list[int], samples: int, target_ns: int, breakdown: bool
) -> tuple[list[Row], list[Row]]:
    """Every row of one loop, in one ``anyio.run``; then the breakdown, if asked."""
    x, y, _, _ = train_digits.load_data(SEED)
    epochs = numpy_epochs(x, y, NUMPY_EPOCHS)
    ref = reference(epochs)
    rows = [Row(loop, 0, form, len(epochs[0])) for form in (NUMPY, NUMPY_1T)]
    cases = [numpy_case(row, epochs) for row in rows]
    strategies = {}
    for n in replicas:
        strategies[n] = strategy = aioreplica.MirroredStrategy([f"cpu:{i}" for i in range(n)])
        for form in (PER_STEP, RUN_STEPS):
            row = Row(loop, n, form, len(epochs[0]))
            rows.append(row)
            cases.append(training_case(row, strategy, (x, y), ref))
    run = functools.partial(run_interleaved, max_reps=MAX_REPS, gc_off=False)
    await anyio.to_thread.run_sync(run, cases, samples, target_ns)
    parts: list[Row] = []
    if breakdown:
        strategy = strategies.get(BREAKDOWN_REPLICAS) or aioreplica.MirroredStrategy(
            [f"cpu:{i}" for i in range(BREAKDOWN_REPLICAS)]
        )
        more, trainings = await breakdown_cases(loop, strategy, (x, y), epochs)
        parts = [c.result for c in more]
        await anyio.to_thread.run_sync(run, more, samples, target_ns)
        for training in trainings:
            if training.iterator is not None:
                await training.iterator.aclose()
    return rows, parts


def run_loop(
    loop: str, replicas: list[int], samples: int, target_ns: int, breakdown: bool
) -> tuple[list[Row], list[Row]]:
    backend = "trio" if loop == "trio" else "asyncio"
    options = {} if loop == "trio" else {"use_uvloop": loop == "uvloop"}
    return anyio.run(
        measure_loop,
        loop,
        replicas,
        samples,
        target_ns,
        breakdown,
        backend=backend,
        backend_options=options,
    )


# --- report -----------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b if b > 0 else math.inf


def numpy_us(rows: list[Row], loop: str) -> float | None:
    """The faster of the NumPy rows of ``loop``'s run (default BLAS threads, or one): the
    baseline every ratio divides by."""
    times = [
        r.best_us
        for r in rows
        if r.loop == loop and r.form in (NUMPY, NUMPY_1T) and r.best_us is not None
    ]
    return min(times) if times else None


def print_table(rows: list[Row], samples: int) -> None:
    print(
        f"\nTable 1: µs per training step (fastest of {samples} samples), global batch "
        f"{BATCH}, and the ratio to the faster numpy row of the same loop's run"
    )
    print(f"{'loop':>8}{'N':>4}  {'form':<16}{'µs/step':>10}{'x numpy':>9}{'median':>10}")
    for r in rows:
        n = str(r.replicas) if r.replicas else "-"
        cells = (
            f"{fmt(r.best_us, 10)}{fmt(_ratio(r.best_us, numpy_us(rows, r.loop)), 9)}"
            f"{fmt(r.median_us, 10)}"
            if r.status == "ok"
            else f"{r.status:>10}"
        )
        bad = "" if r.verification.get("ok", True) else "  (does not match NumPy)"
        print(f"{r.loop:>8}{n:>4}  {r.form:<16}{cells}{bad}")
    for r in rows:
        if r.status != "ok":
            print(f"  {r.label}: {r.status}: {r.reason}")


def print_breakdown(parts: list[Row]) -> None:
    if not parts:
        return
    print(
        f"\nBreakdown (information only): one step's parts timed apart, "
        f"{BREAKDOWN_REPLICAS} replicas on {parts[0].loop}, µs (fastest sample)"
    )
    w = max(len(r.form) for r in parts) + 2
    for r in parts:
        cell = fmt(r.best_us, 10) if r.status == "ok" else f"{r.status:>10}"
        print(f"  {r.form:<{w}}{cell}")


def checks_of(rows: list[Row], loops: list[str], replicas: list[int]) -> list[dict[str, str]]:
    name_a = "(a) train_digits step, run per step, 4 replicas on asyncio, within 5x NumPy"
    if "asyncio" not in loops or 4 not in replicas:
        check_a = {"name": name_a, "status": "SKIP", "detail": "not in this run"}
    else:
        row = next(r for r in rows if (r.loop, r.replicas, r.form) == ("asyncio", 4, PER_STEP))
        base = numpy_us(rows, "asyncio")
        ratio = _ratio(row.best_us, base)
        detail = f"{fmt(ratio)}x ({fmt(row.best_us)} µs a step, NumPy {fmt(base)} µs)"
        check_a = {
            "name": name_a,
            "status": "PASS" if ratio is not None and ratio <= 5 else "FAIL",
            "detail": detail if ratio is not None else f"not measured: {row.reason}",
        }
    trained = [r for r in rows if r.replicas]
    unverified = [f"{r.label}: {r.reason}" for r in trained if not r.verification]
    mismatched = [
        f"{r.label}: batches equal {r.verification['batches_equal']}, "
        + ", ".join(f"{k} {v:.2g}" for k, v in r.verification["max_rel_error"].items())
        for r in trained
        if r.verification and not r.verification["ok"]
    ]
    worst = max(
        (max(r.verification["max_rel_error"].values()) for r in trained if r.verification),
        default=None,
    )
    ok_b = not unverified and not mismatched
    detail_b = (
        f"{len(trained)} rows, largest relative difference {fmt(worst)}"
        if ok_b
        else "; ".join(mismatched + [f"not verified: {u}" for u in unverified])
    )
    check_b = {
        "name": f"(b) aioreplica matches NumPy after {VERIFY_STEPS} steps (relative {RTOL:g})",
        "status": "PASS" if ok_b else "FAIL",
        "detail": detail_b,
    }
    return [check_a, check_b]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="0.05 s samples, 3 per row")
    p.add_argument("--loop", default="asyncio,uvloop", help=f"subset of {','.join(LOOPS)}")
    p.add_argument("--replicas", default="4,8", help="host replica counts")
    p.add_argument("--samples", type=int, help="samples per row (default 7, 3 with --quick)")
    p.add_argument("--json", type=Path, default=Path("bench-results/bench_step.json"))
    args = p.parse_args(argv)
    loops = pick(p, "--loop", args.loop, LOOPS)
    try:
        replicas = sorted({int(s) for s in args.replicas.split(",") if s.strip()})
    except ValueError:
        p.error(f"--replicas {args.replicas!r}: a comma-separated list of ints")
    if not replicas or min(replicas) < 1:
        p.error("--replicas: at least one count, each >= 1")
    samples = args.samples or (3 if args.quick else 7)
    target_ns = sample_target_ns(args.quick)
    started = time.perf_counter()

    rows: list[Row] = []
    parts: list[Row] = []
    for i, loop in enumerate(loops):
        got, more = run_loop(loop, replicas, samples, target_ns, breakdown=i == 0)
        rows += got
        parts += more
        line = "  ".join(f"N={r.replicas} {r.form} {fmt(r.best_us)}" for r in got)
        print(f"{loop}: {line} (µs/step)", file=sys.stderr, flush=True)

    print_table(rows, samples)
    print_breakdown(parts)
    checks = checks_of(rows, loops, replicas)
    print_checks(checks)
    write_json(
        args.json,
        {
            "meta": run_meta()
            | {
                "loops": loops,
                "replicas": replicas,
                "quick": args.quick,
                "samples": samples,
                "sample_target_s": target_ns / 1e9,
                "global_batch": BATCH,
                "steps_per_call": STEPS_PER_CALL,
                "versions": dist_versions(),
                "aioreplica": aioreplica.__version__,
                "blas": threadpool_info(),
                "wall_s": round(time.perf_counter() - started, 1),
            },
            "rows": [
                r.as_json() | {"ratio": _ratio(r.best_us, numpy_us(rows, r.loop))} for r in rows
            ],
            "breakdown": [r.as_json() for r in parts],
            "checks": checks,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
