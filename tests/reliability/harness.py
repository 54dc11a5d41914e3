"""What the reliability tests stand on: a small training world, thread gates, leak detectors.

A *world* is what one fault-matrix cell plays in: a strategy of three host replicas, a 8 MiB
mirrored variable (so every write of it awaits a device worker thread), a small one, an SGD
optimizer, and a checkpoint manager that has saved once. ``World.play`` runs a scenario as the
caller of ``strategy.run`` would, inside a cancel scope that the caller-cancelled cells cancel,
and records how it ended (``Outcome``), bounded by ``PLAY_DEADLINE``: a hang becomes a failure.

Leak detectors:

- ``live_tasks``: every task of the running loop (asyncio: ``asyncio.all_tasks()``; trio: the
  whole task tree from the root task, system tasks included). Snapshots hold the task objects,
  so a finished task's id can never be mistaken for a new one.
- ``busy_threads``: threads running code of aioreplica or of the tests, other than a thread's
  own idle loop (a device worker waiting for its next job is idle; one inside a job is busy).
- ``unexpected_threads``: threads started since a snapshot that are neither device workers
  (process-wide, ``aioreplica cpu:N``) nor idle pooled threads of anyio or trio.

``test_fault_matrix.py`` proves each detector on a deliberate leak.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.lowlevel
import numpy as np

import aioreplica
from aioreplica import Checkpoint, CheckpointManager, MirroredStrategy, Variable
from aioreplica._backends import HostDevice, _numpy
from aioreplica.optimizers import SGD
from aioreplica.testing import host_devices, replica_id

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine

    import pytest
    from anyio.abc import TaskGroup

REPLICAS: Final = 3
#: The inline threshold these tests run under (``lower_inline_bytes``): 1 MiB instead of
#: ``_numpy.INLINE_BYTES``, so that the big variable can stay small enough to be quick.
INLINE: Final = 1 << 20
#: float64 elements of the big variable: 2 MiB, past ``INLINE``, so its writes, its optimizer
#: steps and its reductions await a device worker thread.
BIG: Final = 1 << 18
#: Seconds a play may take before it counts as a hang (a cell takes well under 0.5 s).
PLAY_DEADLINE: Final = 3.0
#: A gate opens by itself after this long, so that no thread stays blocked after a hang.
GATE_LIMIT: Final = PLAY_DEADLINE + 1.0
#: Seconds that tasks and threads get to finish after a play, and ``until`` to see its condition.
SETTLE: Final = 2.0
_POLL: Final = 0.001

_PACKAGE: Final = str(Path(aioreplica.__file__).parent)
_TESTS: Final = str(Path(__file__).parents[1])
#: How the package names its device workers (``aioreplica/_backends/_numpy.py``): one per
#: host device, process-wide, started on first use; and its slow merge watchdog
#: (``aioreplica/_scheduler.py``), process-wide too, alive while a strategy with
#: ``slow_merge_warning`` is. Each waits in the function it was started with when idle.
_DEVICE_WORKER = re.compile(r"aioreplica cpu:\d+|aioreplica watchdog")
#: Idle pooled threads of the async libraries (anyio's asyncio worker threads, trio's cache).
_POOLED = re.compile(r"AnyIO worker thread|Trio thread \d+")


async def until(predicate: Callable[[], bool], what: str, seconds: float = SETTLE) -> None:
    """Wait until ``predicate()`` holds; ``AssertionError`` naming ``what`` if it never does."""
    with anyio.move_on_after(seconds):
        # Polled: what is awaited (thread counters, scheduler statistics) has no event to wait on.
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(_POLL)
        return
    raise AssertionError(f"never happened within {seconds:g} s: {what}")


# -- gates --------------------------------------------------------------------------------


class GateNeverOpened(RuntimeError):
    """A thread waited at a gate for ``GATE_LIMIT`` seconds: the test never opened it."""


class ThreadGate:
    """Holds the threads that reach it until it opens; the loop sees how many are inside.

    It stands for thread-side work that takes as long as a test needs: a device job, a blocking
    dataset loader, a disk write.
    """

    def __init__(self) -> None:
        self._opened = threading.Event()
        self._lock = threading.Lock()
        self.inside = 0  # threads held now

    def hold(self) -> None:
        """Called in a thread: wait here until the gate opens (at most ``GATE_LIMIT``)."""
        with self._lock:
            self.inside += 1
        try:
            if not self._opened.wait(GATE_LIMIT):
                raise GateNeverOpened(f"a thread waited {GATE_LIMIT:g} s at a gate never opened")
        finally:
            with self._lock:
                self.inside -= 1

    def open(self) -> None:
        self._opened.set()


# -- leak detectors -----------------------------------------------------------------------


def live_tasks() -> set[Any]:
    """Every task alive on the running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _trio_tasks()
    return set(asyncio.all_tasks())


def _trio_tasks() -> set[Any]:
    import trio

    root = trio.lowlevel.current_root_task()
    assert root is not None, "trio is running: it has a root task"
    tasks: set[Any] = set()
    pending = [root]
    while pending:
        task = pending.pop()
        tasks.add(task)
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return tasks


def describe_task(task: Any) -> str:
    coro = task.get_coro() if isinstance(task, asyncio.Task) else task.coro
    return (
        f"{getattr(task, 'name', None) or task.get_name()} ({getattr(coro, '__qualname__', coro)})"
    )


def busy_threads() -> dict[threading.Thread, list[str]]:
    """Threads (other than this one) in code of aioreplica or the tests beyond their own idle
    loop, with the functions they are in: work still going on."""
    frames = sys._current_frames()
    busy: dict[threading.Thread, list[str]] = {}
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.ident is None:
            continue
        idle_loop = _job_loop(thread)
        ours = []
        frame = frames.get(thread.ident)
        while frame is not None:
            code = frame.f_code
            if code.co_filename.startswith((_PACKAGE, _TESTS)) and code is not idle_loop:
                ours.append(code.co_qualname)
            frame = frame.f_back
        if ours:
            busy[thread] = ours
    return busy


def _job_loop(thread: threading.Thread) -> Any:
    """A device worker's job loop (the function it was started with), where it waits for its
    next job; ``None`` for other threads, whose own function is their work."""
    if not _DEVICE_WORKER.fullmatch(thread.name):
        return None
    target = getattr(thread, "_target", None)
    return getattr(getattr(target, "__func__", target), "__code__", None)


def unexpected_threads(before: set[threading.Thread]) -> list[str]:
    """Threads started since ``before`` that are neither device workers nor pooled threads."""
    return sorted(
        thread.name
        for thread in set(threading.enumerate()) - before
        if not _DEVICE_WORKER.fullmatch(thread.name) and not _POOLED.fullmatch(thread.name)
    )


@dataclass(frozen=True)
class Snapshot:
    """The tasks and threads alive before a play, and the threads already at work then (left
    by something else, such as an earlier test's abandoned loader: not this play's doing)."""

    tasks: set[Any]
    threads: set[threading.Thread]
    busy: set[threading.Thread]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(live_tasks(), set(threading.enumerate()), set(busy_threads()))

    def new_tasks(self) -> list[str]:
        return sorted(describe_task(task) for task in live_tasks() - self.tasks)

    def newly_busy(self) -> dict[str, list[str]]:
        return {t.name: where for t, where in busy_threads().items() if t not in self.busy}

    async def assert_no_task_left(self, seconds: float = SETTLE) -> None:
        """No task started since the snapshot is alive ``seconds`` from now (or sooner)."""
        with contextlib.suppress(AssertionError):
            await until(lambda: not self.new_tasks(), "no task left", seconds)
        leaked = self.new_tasks()
        assert not leaked, f"tasks left {seconds:g} s after the play: {leaked}"

    async def assert_no_thread_left(self) -> None:
        """Every thread idle (nothing of ours still running) and no unexpected new thread."""

        def settled() -> bool:
            return not self.newly_busy() and not unexpected_threads(self.threads)

        with contextlib.suppress(AssertionError):
            await until(settled, "every thread idle")
        assert not self.newly_busy(), f"threads still at work: {self.newly_busy()}"
        assert not unexpected_threads(self.threads), (
            f"threads left behind: {unexpected_threads(self.threads)}"
        )


# -- device faults ------------------------------------------------------------------------


class DeviceFaults:
    """Makes a host device's worker raise instead of running the next job queued on it, as an
    out-of-memory error would.

    Every job a host device runs (its own work through ``run``, and its part of a host
    collective) is queued through ``HostDevice._queue``, so that is where a fault is armed.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._armed: dict[HostDevice, BaseException] = {}
        queue = HostDevice._queue

        def faulty_queue(
            device: HostDevice, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Any
        ) -> Any:
            error = self._armed.pop(device, None)
            if error is not None:
                fn, args, kwargs = functools.partial(raise_, error), (), {}
            return queue(device, fn, args, kwargs)

        monkeypatch.setattr(HostDevice, "_queue", faulty_queue)

    def fail_next_job(self, device: HostDevice, error: BaseException) -> None:
        self._armed[device] = error


def raise_(error: BaseException, *args: Any) -> Any:
    """Raise ``error`` (a merge function, device job or loader that fails)."""
    raise error


# -- the world ----------------------------------------------------------------------------

#: What each variable holds in every element, and the optimizer's step count, after nothing,
#: one write (every replica adds ``replica_id() + 1``: the mean over three replicas is 2) or one
#: optimizer step (gradients of ones, summed over three replicas, learning rate 0.5).
STATES: Final = {
    "untouched": {"big": 0.0, "small": 0.0, "iterations": 0},
    "written": {"big": 2.0, "small": 0.0, "iterations": 0},
    "stepped": {"big": -1.5, "small": -1.5, "iterations": 1},
}


def lower_inline_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run host work that reads ``INLINE`` bytes or more on the device workers."""
    assert INLINE < _numpy.INLINE_BYTES
    monkeypatch.setattr(_numpy, "INLINE_BYTES", INLINE)


@dataclass(frozen=True)
class Model:
    """The variables, the optimizer and the checkpoint of one world (or of its twin)."""

    big: Variable
    small: Variable
    optimizer: SGD
    checkpoint: Checkpoint

    @classmethod
    def build(cls, strategy: MirroredStrategy) -> Model:
        with strategy.scope():
            big = Variable(np.zeros(BIG), name="big", aggregation="mean")
            small = Variable(np.zeros(4), name="small", aggregation="mean")
        optimizer = SGD(0.5)
        model = {"big": big, "small": small}
        checkpoint = Checkpoint(model=model, optimizer=optimizer, step=0)
        return cls(big, small, optimizer, checkpoint)


@dataclass(frozen=True)
class Outcome:
    """How a play ended: what it raised, whether the caller's cancellation ended it, whether it
    hung (ran into ``PLAY_DEADLINE``), and how long it took."""

    error: BaseException | None
    cancelled: bool
    hung: bool
    seconds: float


@dataclass
class World:
    """Everything one cell plays with (see the module docstring)."""

    strategy: MirroredStrategy
    model: Model
    manager: CheckpointManager
    faults: DeviceFaults
    monkeypatch: pytest.MonkeyPatch
    #: Never set: what a stuck replica, loader or merge function waits for.
    never: anyio.Event = field(default_factory=anyio.Event)
    events: list[str] = field(default_factory=list)
    gates: list[ThreadGate] = field(default_factory=list)
    #: The exception a cell injected, to check that run() raises that very object.
    injected: BaseException | None = None
    #: Holds thread-side work that the play must not wait for (a blocked loader, device jobs).
    abandoned_gate: ThreadGate | None = None
    _caller: anyio.CancelScope | None = None
    _helpers: TaskGroup | None = None

    @classmethod
    async def create(
        cls, directory: Path, monkeypatch: pytest.MonkeyPatch, *, sync_timeout: float | None
    ) -> World:
        lower_inline_bytes(monkeypatch)
        strategy = MirroredStrategy(host_devices(REPLICAS), sync_timeout=sync_timeout)
        model = Model.build(strategy)
        manager = CheckpointManager(model.checkpoint, directory, max_to_keep=1)
        await manager.save()
        return cls(strategy, model, manager, DeviceFaults(monkeypatch), monkeypatch)

    @property
    def big(self) -> Variable:
        return self.model.big

    @property
    def small(self) -> Variable:
        return self.model.small

    @property
    def optimizer(self) -> SGD:
        return self.model.optimizer

    def device(self, replica: int) -> HostDevice:
        device = self.strategy.extended.replica_devices[replica]
        assert isinstance(device, HostDevice)
        return device

    # -- playing --------------------------------------------------------------------------

    async def play(
        self, scenario: Callable[[World], Awaitable[None]], *, deadline: float = PLAY_DEADLINE
    ) -> Outcome:
        """Run ``scenario`` as a caller would, bounded by ``deadline``; how did it end?

        Helper tasks (``start_helper``) run beside it, outside the caller's cancel scope, and
        are cancelled when it ends.
        """
        started = time.monotonic()
        error: BaseException | None = None
        caller = anyio.CancelScope()
        with anyio.move_on_after(deadline) as bound:
            try:
                async with anyio.create_task_group() as helpers:
                    self._helpers = helpers
                    try:
                        with caller:
                            self._caller = caller
                            await scenario(self)
                    except BaseException as exc:  # the outcome under test, whatever it is
                        error = exc
                    helpers.cancel_scope.cancel()
            except BaseException as exc:  # a helper failed (a condition it waited for, say)
                if error is None:
                    error = exc
        return Outcome(
            error=error,
            cancelled=caller.cancelled_caught,
            hung=bound.cancel_called,
            seconds=time.monotonic() - started,
        )

    def start_helper(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        assert self._helpers is not None, "helpers start only while a scenario plays"
        self._helpers.start_soon(fn, *args)

    def cancel_caller(self) -> None:
        """Cancel the caller's scope around the scenario (a caller's timeout, a Ctrl-C)."""
        assert self._caller is not None
        self._caller.cancel()

    @property
    def caller_cancelled(self) -> bool:
        return self._caller is not None and self._caller.cancel_called

    def cancel_when(
        self, predicate: Callable[[], bool], what: str, then: Callable[[], None] | None = None
    ) -> None:
        """Cancel the caller as soon as ``predicate()`` holds (then call ``then``)."""

        async def cancel() -> None:
            await until(predicate, what)
            self.cancel_caller()
            if then is not None:
                then()

        self.start_helper(cancel)

    # -- faults and slow work -------------------------------------------------------------

    def inject(self, error: BaseException) -> BaseException:
        """Remember ``error`` as the cell's injected exception and return it."""
        self.injected = error
        return error

    def gate(self) -> ThreadGate:
        gate = ThreadGate()
        self.gates.append(gate)
        return gate

    def open_gates(self) -> None:
        for gate in self.gates:
            gate.open()

    async def occupy_worker(self, replica: int) -> ThreadGate:
        """Hold ``replica``'s device worker in a job at a gate; jobs queued after it wait
        (a device's jobs run one at a time, in order). Returns once the worker is held."""
        gate = self.gate()
        self.start_helper(self.device(replica).run, gate.hold)
        await until(lambda: gate.inside == 1, f"replica {replica}'s device worker is held")
        return gate

    def open_after(self, gate: ThreadGate, seconds: float) -> None:
        """Open ``gate`` after ``seconds``: work that takes that long."""

        async def open_later() -> None:
            await anyio.sleep(seconds)
            gate.open()

        self.start_helper(open_later)

    def fail_next_job(self, replica: int, error: BaseException) -> None:
        """The next job queued on ``replica``'s device worker raises ``self.inject(error)``."""
        self.faults.fail_next_job(self.device(replica), self.inject(error))

    def patch_fsync(self, instead: Callable[[], None]) -> None:
        """Run ``instead()`` in the writing thread before the next ``os.fsync`` (the moment a
        checkpoint's data is written but not yet durable)."""
        fsync = os.fsync
        pending = [instead]

        def patched(fd: int) -> None:
            if pending:
                pending.pop()()
            fsync(fd)

        self.monkeypatch.setattr(os, "fsync", patched)

    # -- what replicas do -----------------------------------------------------------------

    def waiting(self) -> int:
        """Replicas parked at a merge point now (all of them: a merge function is running)."""
        return self.strategy.statistics().replicas_waiting

    async def write(self) -> None:
        """One write of the big variable from every replica: one merge round, every copy +2."""
        await self.big.assign_add(replica_id() + 1.0)

    async def step(self) -> None:
        """One optimizer step from every replica: one merge round, every element -1.5."""
        await self.optimizer.apply_gradients(
            [(np.ones(self.small.shape), self.small), (np.ones(BIG), self.big)]
        )


# -- after a play -------------------------------------------------------------------------


def assert_variables(world: World, state: str) -> None:
    """Every copy of every variable equal, holding the value of ``state`` (``STATES``)."""
    expected = STATES[state]
    for variable in (world.big, world.small):
        copies = [np.asarray(copy) for copy in variable.values]
        for replica, copy in enumerate(copies[1:], start=1):
            assert np.array_equal(copy, copies[0]), (
                f"copy {replica} of {variable.name!r} differs from copy 0: a write was torn"
            )
        held = np.unique(copies[0]).tolist()
        assert held == [expected[variable.name]], (
            f"{variable.name!r} holds {held[:4]}, not {expected[variable.name]} ({state})"
        )
    assert world.optimizer.iterations == expected["iterations"]


async def assert_checkpoints(world: World, newest: int) -> None:
    """The manager's directory holds exactly its checkpoints, the newest numbered ``newest``,
    and that one restores: into a twin model, changed first, so that every value it ends with
    came from the file (every checkpoint here is saved before any write)."""
    manager = world.manager
    on_disk = sorted(os.listdir(manager.directory))
    assert on_disk == sorted(os.path.basename(path) for path in manager.checkpoints), (
        f"the checkpoint directory holds {on_disk}, the manager keeps {manager.checkpoints}"
    )
    assert manager.latest == os.path.join(manager.directory, f"ckpt-{newest}.npz")
    twin = Model.build(MirroredStrategy(host_devices(REPLICAS)))
    await twin.big.assign(1.0)
    twin.optimizer.iterations = 5
    twin.checkpoint.step = 5
    await twin.checkpoint.restore(manager.latest)
    for variable in (twin.big, twin.small):
        assert not np.asarray(variable.values[0]).any(), f"{variable.name!r} was not restored"
    assert (twin.optimizer.iterations, twin.checkpoint.step) == (0, 0)
