"""The scheduler: the only code that pauses and resumes replicas.

The protocol, in plain words
----------------------------
``Scheduler.run`` starts one task per replica. Each task runs a *driver*, a generator that
steps the replica's coroutine by hand (``send``/``throw``). Before every step it enters the
replica's device and after it leaves it; whatever the coroutine awaits (an asyncio future, a
trio trap) it passes up to the event loop unchanged, and it passes the loop's answer back down.
So a replica's device follows it across every await, whatever the other replicas do in between
(invariant 1), and replica code needs no cooperation for it.

Replica code has exactly one way into the scheduler: ``ReplicaContext.merge_call`` yields a
merge request (``aioreplica._merge``). The driver sees the request instead of passing it to
the loop and *arrives* at the current round:

- the request is filed under the replica's id and the replica parks at the round's gate;
- the last replica to arrive checks that every replica passed the same merge function
  (``agreed``), regroups the arguments of all replicas by replica id, runs ``merge_fn`` once in
  cross-replica context, stores the result and opens the gate (invariant 2);
- each replica resumes with ``select_replica(its id, result)``.

The fast path
-------------
An arrival that is not the last, in a run where nothing unusual has happened (``fast_path``: no
``sync_timeout``, no failure, nobody finished early) and without a timeout of its own, does
three things: file its request, append itself to the round, and ``yield from`` the gate's park.
Everything else (timeouts, failing runs, early finishers) takes ``_Run.arrive``, the slow path.
On asyncio with ``interleave="ordered"`` the gate is one shared future, so parking costs no
allocation and one ``set_result`` wakes the whole round in arrival order.

Every replica must make the same sequence of merge calls (invariant 3). A replica that finishes
while others wait, a replica that arrives where a finished one can never join it, a merge
function that differs, or (with ``sync_timeout`` or a collective's timeout) a round that does
not fill in time, becomes a ``ReplicaSyncError``: the run fails, every replica is cancelled,
nothing hangs. A timeout bounds the wait for the others to *arrive*, never the merge
function's own work; its deadline belongs to the round, and one parked replica at a time
watches it (one that leaves hands the watch to another).

A replica cancelled while parked (its own ``anyio.fail_after``, say) leaves the round while it
is filling. Once every replica has arrived, the round holds its part: a cancellation during the
merge function waits for it (in a shield, for the parked replicas and for the last arrival
running an async merge function alike), and one after the round is done does not undo it.
The replica takes its part, and the cancellation fires at its next checkpoint (its next
``merge_call`` is one), as trio does for an operation that completed. The run's own
cancellation (a failing run's, the caller's) still stops an async merge function: it cancels
the shield's scope (``_Run.stop_merge``). On asyncio every parked replica of an ordered round
wakes when one of them is cancelled (they share one future): only the one whose task's
cancellation requests went up while it was parked leaves; the others park again.

Failures (invariant 5): the first failure, a replica's own exception, an exception from
``merge_fn`` or a ``ReplicaSyncError``, is what ``run()`` raises, unwrapped, with a note saying
where it came from and notes summarising any later failures; a later ``KeyboardInterrupt`` or
``SystemExit`` (any exception that is no ``Exception``) outranks it, as in a task group.
Replicas are spawned by the loop adapter (``aioreplica._loops``), so no task outlives ``run()``
and cancelling the caller cancels every replica.

Order: with ``interleave="ordered"`` replicas start in id order; at every merge point the replica
that completes the round carries on first and the others resume in the order they arrived: the
same order on every run of the same program (on trio, which deliberately runs tasks woken
together in a random order, it is trio's). Strict id order would cost the completing replica an
extra trip through the event loop per round, about an eighth of the round at 8 replicas. With
``"random"`` both orders are a seeded shuffle: one order per seed, the same on every loop (trio
wakes such replicas one at a time).

What it measures, and what it watches
-------------------------------------
Two clock reads (``time.perf_counter``) per merge round, none per replica: the first arrival
notes when the round started waiting (``run.first_at``), ``complete`` when its last replica
arrived. Their difference is the round's *wait*: how long it waited for its last replica. Each
replica that was not the last is charged it (exact for the first to arrive, at most a little
more than their own wait for those in between), and who was last is counted; that is what
``strategy.statistics()`` reports. (A read at every arrival, for every replica's own wait, cost
7-11 % of a merge round at 8 to 64 replicas, measured.)

``slow_merge_warning``: one daemon thread per process (``_Watchdog``, "aioreplica watchdog"),
alive while a strategy that sets it exists, looks at the current round of every run in progress
four times per ``slow_merge_warning`` and logs one warning (logger ``"aioreplica"``) for a round
whose first arrival has waited longer, naming the replicas that have not arrived. It only reads
what the arrivals write anyway, so the merge path pays nothing for it. (A timer per run costs
more than a whole merge round of two replicas: 6-11 µs for an anyio cancel scope with a
deadline, measured against 9 µs per round; a loop-native timer would need code outside the
loop adapters asking which loop it is on.)

Tracing (``aioreplica._trace``): a run that starts while its strategy is being traced wraps each
replica's coroutine in ``_traced``, which records ``compute`` and ``merge wait`` on the
replica's track, and ``complete`` records ``merge_fn``. A run that starts untraced pays one
check of ``_trace.recorder`` per run and one of ``run.tracer`` per round, and muting its
replicas (``_trace.mute``: one context variable set and reset per run, none per replica), so
that a trace starting while it goes on gets none of its spans.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import math
import operator
import os
import threading
import time
import types
import weakref
from collections.abc import Callable, Coroutine, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import anyio

from . import _loops, _trace
from ._cluster import error_line
from ._context import (
    COLLECTIVE_VALUES,
    MERGE_CALLS,
    ContextState,
    ReplicaContext,
    context_state,
    merge_trap,
)
from ._errors import (
    AioreplicaInternalError,
    ReplicaSyncError,
    add_note,
    made_by_yield,
    replica_list,
    yielding_step,
)
from ._merge import ARGS, FN, KWARGS, MERGE, TIMEOUT, MergeRequest, VariableCreations
from ._tree import find_mismatch, format_path
from ._values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    agreed,
    misfit,
    regroup,
    select_replica,
    select_replicas,
    shown_misfit,
    structure_mismatch,
)

if TYPE_CHECKING:
    import random

    from ._collectives import ReductionEngine

__all__ = ["Scheduler", "SchedulerStatistics", "logger"]

_Step = Generator[Any, Any, Any]

#: The clock of the statistics and the watchdog (read twice per merge round).
_clock: Final = time.perf_counter

#: The package's logger. Its ``NullHandler`` keeps it quiet (no "last resort" output to
#: stderr) until the program configures logging.
logger: Final = logging.getLogger("aioreplica")
logger.addHandler(logging.NullHandler())

#: Guards making a run's record of the variables its replicas make (``_Replica``).
_CREATIONS_LOCK: Final = threading.Lock()


def _describe_fn(fn: Callable[..., Any] | None) -> str:
    """A merge function's name and where it is defined, for messages."""
    inner: Any = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    name = getattr(inner, "__qualname__", type(inner).__qualname__)
    code = getattr(getattr(inner, "__func__", inner), "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{name}{where}"


def _call_of(fn: Callable[..., Any] | None) -> str:
    """The call a merge function of the library's own stands for (``MERGE_CALLS``: a
    collective, a write; or, for a method of an object with ``merge_call_words()``, what that
    says, such as run_steps pulling the element of a step), or ``""`` for any other."""
    function: Any = getattr(fn, "__func__", fn)  # (a method: its function)
    try:
        call = MERGE_CALLS.get(function, "")
    except TypeError:  # an unhashable callable: the user's own
        return ""
    words = getattr(getattr(fn, "__self__", None), "merge_call_words", None)
    return str(words()) if call and callable(words) else call


def _call_words(fn: Callable[..., Any] | None) -> str:
    """How a replica called merge function ``fn``, for messages: ``ctx.all_reduce()`` for a
    replica context's collective, else ``merge_call()``."""
    call = _call_of(fn)
    return f"ctx.{call}()" if call.isidentifier() else "merge_call()"


def _merge_point(number: int, fn: Callable[..., Any] | None, replica: _Replica | None) -> str:
    """Merge point ``number`` of merge function ``fn`` in words, for messages: the call it
    stands for (``all_reduce (merge_call #1)``) or the merge function and where it is defined,
    then where the replica code of ``replica`` awaits it, where that is known."""
    call = _call_of(fn)
    if call:
        point = f"{call} (merge_call #{number})"
    else:
        point = f"merge_call #{number} ({_describe_fn(fn)})"
    where = _await_site(replica.coro) if replica is not None else ""
    return f"{point} at {where}" if where else point


#: How many collectives a replica keeps before it drops those already started (``called``).
_KEPT_COLLECTIVES: Final = 64
_CREATED: Final = inspect.CORO_CREATED


def _collective_name(collective: Coroutine[Any, Any, Any]) -> str:
    """The name of the ``ReplicaContext`` method that made ``collective`` (``all_reduce``; the
    coroutine is its private ``_all_reduce``)."""
    name: str = getattr(collective, "__name__", "collective")
    return name.lstrip("_")


#: The package's own files: the place replica code awaits is the innermost frame outside them.
_PACKAGE: Final = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _await_site(coro: Any) -> str:
    """``file:line`` of the innermost frame outside the package in the chain of awaits of a
    suspended coroutine (a replica's), or ``""`` where there is none."""
    where = ""
    awaited = coro
    for _ in range(100):  # an await chain deeper than this is no program's
        if awaited is None:
            break
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is not None and not frame.f_code.co_filename.startswith(_PACKAGE):
            where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return where


class _RunFailed(BaseException):
    """Ends a replica that no cancellation can reach (it is inside an anyio shield) at a merge
    point of a run that has failed: that round can never complete. The run raises its own
    failure; this one is not reported."""

    def __init__(self) -> None:
        super().__init__(
            "this run has failed, so this merge_call can never complete (the replica is inside "
            "an anyio shield, which keeps the run's cancellation out)"
        )


class _Round:
    """One merge round: who has arrived with which request, and once done, the result."""

    __slots__ = (
        "abandoned",
        "arrived",
        "deadline",
        "done",
        "gate",
        "number",
        "parts",
        "requests",
        "result",
        "timeout",
        "waiter",
        "watcher",
    )

    def __init__(self, number: int, size: int, gate: _loops.Gate) -> None:
        self.number = number
        self.arrived: list[_Replica] = []
        self.requests: list[MergeRequest | None] = [None] * size  # by replica id
        self.done = False
        self.abandoned = False  # its merge_fn was cancelled with the run: it is never done
        self.result: Any = None
        # Each replica's part of the result, when it is a distributed value or a structure of
        # tuples, lists and dicts (``select_replicas``): each replica takes its own by index.
        self.parts: Sequence[Any] | None = None
        self.gate = gate
        # The gate's one waiter for all, if it has one: the fast path parks on it directly. If
        # the gate later replaces it (a sibling's cancellation cancelled it, or ``gate.wake``
        # set it), a replica parking on the old one is woken at once and parks on the new one.
        self.waiter = gate.waiter
        # With a timeout (``sync_timeout`` or a collective's): by when the round must fill
        # (anyio's clock), set by its first timed arrival; the seconds, for the message; and
        # the parked replica timing it. One that leaves hands the watch to another.
        self.deadline: float | None = None
        self.timeout = 0.0
        self.watcher: _Replica | None = None


class _Replica:
    """One replica of one ``run()``: its context and its driver."""

    __slots__ = (
        "cancel_requests",
        "collectives",
        "context",
        "coro",
        "device",
        "id",
        "in_own_coroutine",
        "pending",
        "run",
        "track",
    )

    def __init__(self, run: _Run, replica_id: int) -> None:
        self.run = run
        self.id = replica_id  # its index in this run (and this worker)
        self.device = run.engine.devices[replica_id]
        self.context: ReplicaContext | None = ReplicaContext(
            run.strategy, run.engine, replica_id, self
        )
        # True only while the driver is inside this replica's coroutine.
        self.in_own_coroutine = False
        self.pending: MergeRequest | None = None  # made by merge_call, not yet received
        # The coroutines of the collectives it called (``called``), checked when it ends.
        self.collectives: list[Coroutine[Any, Any, Any]] = []
        self.track: _trace.ReplicaTrack | None = None  # its track, in a traced run
        self.coro: Any = None  # the coroutine it steps, once it has one (for messages)
        # Counts the cancellations requested of its task (``Loop.cancel_requests``), looked up
        # on first use (``requests_now``).
        self.cancel_requests: Callable[[], int] | None = None

    @property
    def sync_id(self) -> int:
        """Its id in sync, by which messages name it (across workers, not from 0)."""
        return self.run.first_replica + self.id

    def called(self, collective: Coroutine[Any, Any, Any]) -> None:
        """Keep ``collective``, the coroutine of a collective this replica called, until it
        ends (``_unawaited``). A long ``run_steps`` calls many: those already started are
        dropped now and then, so the list stays short."""
        collectives = self.collectives
        collectives.append(collective)
        if len(collectives) > _KEPT_COLLECTIVES:
            collectives[:] = [c for c in collectives if inspect.getcoroutinestate(c) == _CREATED]

    def _unawaited(self, result: Any) -> RuntimeError | None:
        """The error of this replica ending with a collective it called and never awaited
        (none started: it took no part in its collective, and the other replicas may wait for
        it), or ``None``; ``result`` is what it returned."""
        unstarted = [
            c
            for c in self.collectives
            if c is not result and inspect.getcoroutinestate(c) == _CREATED
        ]
        self.collectives = []
        if not unstarted:
            return None
        for collective in unstarted:
            collective.close()  # never started: closed, so Python does not warn about it later
        call = _collective_name(unstarted[0])
        return RuntimeError(
            f"replica {self.sync_id} called ctx.{call}() but never awaited it, so it took no "
            f"part in that {call}; write `await ctx.{call}(...)`"
        )

    def requests_now(self) -> int:
        """The cancellations requested of its task so far, read as it parks to tell its own
        cancellation from a sibling's; called in its task. The counter is looked up once, and
        only once a cancellation may have reached it: finding the task costs more than a
        replica's share of a merge round."""
        count = self.cancel_requests
        if count is None:
            count = self.cancel_requests = self.run.loop.cancel_requests()
        return count()

    def variable_creations(self) -> VariableCreations:
        run = self.run
        with _CREATIONS_LOCK:  # replicas may make variables in their devices' threads
            if run.creations is None:
                run.creations = VariableCreations(run.size)
            return run.creations

    def misuse_message(self, merge_fn: Callable[..., Any] | None = None) -> str:
        """Why a ``merge_call`` (of ``merge_fn``, where the caller says) with this replica's
        context cannot go ahead."""
        called = _call_words(merge_fn)
        if self.in_own_coroutine and self.pending is not None:
            previous = _call_words(self.pending[FN])
            return (
                f"replica {self.sync_id} called {called} again before awaiting its previous "
                f"{previous}; await each merge_call() and collective where you call it"
            )
        if self.run.finished_run:
            return (
                f"{called} was called on replica {self.sync_id}'s context after its run() "
                "returned; a ReplicaContext is valid only inside its own replica"
            )
        state = context_state.get()
        if state.replica is not self.context:
            if state.merging:
                call = _call_of(merge_fn)
                if call.isidentifier():  # all_reduce, barrier...: the context's collectives
                    return (
                        f"ctx.{call}() was called inside merge_fn (cross-replica context) with "
                        f"the context of replica {self.sync_id}; a replica context's "
                        "collectives are merge calls, and merge functions cannot nest: in "
                        "merge_fn, pass its arguments (every replica's values) to the "
                        "cross-replica forms, `await strategy.reduce(...)`, "
                        "`strategy.gather(...)`, `strategy.extended.reduce_to(...)` or "
                        "`batch_reduce_to(...)` (a barrier is not needed there: every replica "
                        "has arrived)"
                    )
                return (
                    "merge_call() was called inside merge_fn (cross-replica context) with the "
                    f"context of replica {self.sync_id}; merge functions cannot nest: call what "
                    "you need directly in merge_fn"
                )
            return (
                f"{called} was called with replica {self.sync_id}'s context outside that "
                "replica; call get_replica_context() inside the replica instead"
            )
        awaited = called[:-2] if called.startswith("ctx.") else "ctx.merge_call"
        return (
            f"{called} must be awaited by replica {self.sync_id}'s own coroutine, not by a "
            "task it spawned (a task group child, asyncio.shield, or asyncio.wait_for, which runs "
            "its argument in a new task on Python 3.11); to bound the wait use "
            f"`with anyio.fail_after(seconds): await {awaited}(...)` instead"
        )

    # -- the driver --------------------------------------------------------------------------

    async def main(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        """The replica's task: run the driver, report how the replica ended."""
        context_state.set(ContextState(replica=self.context))
        if self.track is not None:  # (an untraced run's replicas are muted: ``Scheduler.run``)
            self.track.enter()
        try:
            result = await self._drive(fn, args, kwargs)
        except BaseException as exc:
            if self.collectives:  # not awaited because it failed: closed without a warning
                self._unawaited(None)
            run = self.run
            if isinstance(exc, _RunFailed):
                return  # the run's own failure is what run() raises
            if isinstance(exc, run.cancelled_class):
                if run.tasks.is_cancellation(exc):
                    raise
                exc = run.own_cancellation(exc, f"replica {self.sync_id}")
            stop = _python_stop(exc)
            if stop is not None:  # out of async code: Python's message says nothing of where
                exc = _escaped_stop(stop, f"replica {self.sync_id}'s step function")
            run.replica_failed(self, exc)
            return
        if self.pending is not None:
            self.run.replica_failed(self, self._never_awaited(self.pending[FN], result))
            return
        if type(result) is types.CoroutineType:  # ``return ctx.all_reduce(...)``, say
            result.close()  # never started: closed, so Python does not warn about it later
            returned = (
                f"ReplicaContext.{_collective_name(result)}"
                if result in self.collectives
                else result.__qualname__
            )
            self.collectives = []
            self.run.replica_failed(
                self,
                RuntimeError(
                    f"replica {self.sync_id}'s step function returned the coroutine "
                    f"{returned}() without awaiting it; write `return await ...`"
                ),
            )
            return
        if self.collectives:
            unawaited = self._unawaited(result)
            if unawaited is not None:
                self.run.replica_failed(self, unawaited)
                return
        if made_by_yield(fn, result):  # a ``yield`` in the step function
            step = f"replica {self.sync_id}'s step function"
            self.run.replica_failed(self, yielding_step(step, result))
            return
        self.run.replica_finished(self, result)

    def _never_awaited(self, merge_fn: Callable[..., Any], result: Any) -> RuntimeError:
        """The error of this replica finishing (with ``result``) with the request of
        ``merge_fn`` made and never awaited: the call made nothing happen, and the other
        replicas may wait for it."""
        if type(result) is types.GeneratorType and result.gi_code is merge_trap.__code__:
            result.close()  # ``return ctx.merge_call(...)``: the request's own trap, returned
            return RuntimeError(
                f"replica {self.sync_id}'s step function returned the coroutine "
                "ReplicaContext.merge_call() without awaiting it; write `return await ...`"
            )
        return RuntimeError(
            f"replica {self.sync_id} called merge_call({_describe_fn(merge_fn)}) but never "
            "awaited it; write `await ctx.merge_call(...)`"
        )

    @types.coroutine
    def _drive(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> _Step:
        device = self.device
        # A device with a context of its own (a GPU's stream) is made current around every
        # step of the replica; ``resume``/``suspend``, where a device has them, also carry what
        # the replica itself made current from one step to the next.
        enter = getattr(device, "resume", device.enter) if device.has_context else None
        leave = getattr(device, "suspend", device.leave) if device.has_context else None
        track = self.track
        started = track.now() if track is not None else 0  # compute starts

        self.in_own_coroutine = True
        if enter is not None:
            enter()
        try:
            awaitable = fn(*args, **kwargs)
        except BaseException as exc:
            if track is not None:
                track.record("compute", started, {"replica": self.sync_id})
            if isinstance(exc, StopIteration):  # out of this generator: a bare RuntimeError
                raise _escaped_stop(exc, f"replica {self.sync_id}'s step function") from exc
            raise
        finally:
            if leave is not None:
                leave()
            self.in_own_coroutine = False
        if type(awaitable) is types.CoroutineType or (
            # a plain function returning an unawaited merge_call(): awaited here, as a
            # returned coroutine is
            type(awaitable) is types.GeneratorType and inspect.isawaitable(awaitable)
        ):
            coro: Any = awaitable
        elif inspect.isawaitable(awaitable):
            coro = awaitable.__await__()
        else:
            if track is not None:
                track.record("compute", started, {"replica": self.sync_id})
            return awaitable  # a plain function: no merge points
        self.coro = coro  # (not the tracing wrapper below: its awaits are not a chain)
        if track is not None:
            coro = _traced(coro, self, track, started)

        send = coro.send
        run = self.run
        size = run.size
        replica_id = self.id
        clock = _clock
        marker, timeout_at = MERGE, TIMEOUT  # locals: cheaper than globals on the fast path
        value: Any = None
        error: BaseException | None = None
        # A cancellation that reached the replica once its part of a round was committed:
        # requested again at its next step, raised there if that is a merge_call
        # (``Loop.defer_cancellation``).
        owed: Callable[[], Iterable[Any]] | None = None
        # Whether a cancellation may have reached its task (an exception came in, or one was
        # owed): from then on the fast path counts the task's cancellation requests as it
        # parks, to tell its own cancellation from a sibling's (``Gate.interrupted``). Until
        # then there were none: the count costs nothing.
        touched = False
        asked = 0  # the count as it last parked, once touched
        while True:
            self.in_own_coroutine = True
            if enter is not None:
                enter()
            try:
                yielded = send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            finally:
                if leave is not None:
                    leave()
                self.in_own_coroutine = False
                # What went in (an exception thrown in, or trio's outcome holding one) may come
                # out as an exception whose traceback holds this frame: the frame must not hold
                # it, or the cycle keeps the replica's frames alive until a cycle collection.
                error = None
                value = None
            if owed is not None:
                touched = True
                checkpoint = owed()
                owed = None
                if type(yielded) is tuple and yielded and yielded[0] is marker:
                    try:
                        yield from checkpoint  # merge_call is a checkpoint, as trio's awaits
                    except GeneratorExit:
                        coro.close()
                        raise
                    except BaseException as exc:
                        self.pending = None  # it never arrives
                        error = exc
                        continue
            try:
                if type(yielded) is tuple and yielded and yielded[0] is marker:
                    # The fast path of every merge round: file the request, park at the gate.
                    self.pending = None
                    rnd = run.round
                    rnd.requests[replica_id] = yielded
                    arrived = rnd.arrived
                    if not arrived:  # the first: the round starts waiting (before it shows)
                        run.first_at = clock()
                    arrived.append(self)
                    timeout = yielded[timeout_at]  # inf: none, whatever sync_timeout says
                    if not run.fast_path or (timeout is not None and timeout != _NO_TIMEOUT):
                        owed = yield from run.arrive(self, rnd, yielded)
                    elif len(arrived) == size:
                        waiting = run.complete(rnd, self)
                        if waiting is not None:
                            owed = yield from run.last_waits(rnd, waiting)
                    else:
                        if touched:
                            asked = self.requests_now()
                        try:
                            waiter = rnd.waiter
                            yield from (waiter if waiter is not None else rnd.gate.park(replica_id))
                        except BaseException as exc:
                            touched = True
                            owed = yield from run.park_interrupted(self, rnd, exc, asked)
                        if not rnd.done:  # woken by a failing run, or to take over a watch
                            owed = yield from run.woken(self, rnd)
                    parts = rnd.parts
                    if parts is not None:
                        value = parts[replica_id]
                    else:
                        result = rnd.result
                        value = result if result is None else select_replica(replica_id, result)
                else:
                    value = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:
                touched = True
                error = exc


@types.coroutine
def _traced(coro: Any, replica: _Replica, track: _trace.ReplicaTrack, started: int) -> _Step:
    """``coro`` (a replica's coroutine, computing since ``started``) as it is, recording its
    ``compute`` and ``merge wait`` spans: the driver steps this instead, in traced runs only."""
    run = replica.run
    computing = {"replica": replica.sync_id}  # the args of every compute span of this replica
    marker = MERGE
    waiting = False
    waits: dict[str, int] = {}
    value: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            finally:
                value = error = None  # as in ``_Replica._drive``: no cycle through this frame
            if type(yielded) is tuple and yielded and yielded[0] is marker:
                number = run.round.number
                waits = {
                    "round": run.trace_round(number),
                    "merge": number,
                    "replica": replica.sync_id,
                }
                started = track.record("compute", started, computing)
                waiting = True
            try:
                value = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:
                error = exc
            if waiting:
                started = track.record("merge wait", started, waits)
                waiting = False
    finally:
        track.record(
            "merge wait" if waiting else "compute", started, waits if waiting else computing
        )


class _Run:
    """The state of one ``run()`` call: its replicas, the current round, how it is ending."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        sync_timeout: float | None,
        rng: random.Random | None,
        merged: list[Callable[..., Any]] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.serial = next(_run_serials)  # runs started later have higher ones
        self.strategy = scheduler.strategy
        self.engine = scheduler.engine
        self.merge_state = ContextState(strategy=self.strategy, engine=self.engine, merging=True)
        self.size = len(self.engine.devices)
        self.first_replica = self.engine.first_replica  # replica 0's id in sync
        self.replicas = [_Replica(self, i) for i in range(self.size)]
        self.sync_timeout = sync_timeout
        self.rng = rng
        self.merged = merged  # each round's merge function, for those who asked (``run``)
        self.loop = _loops.current()
        self.new_gate = self.loop.gate_factory(ordered=rng is None)
        self.round = self._new_round(1)
        self.results: list[Any] = [None] * self.size
        self.finished: dict[int, int] = {}  # replica id -> merge calls it made
        # (exception, where it came from, the replica it was raised in or None), first first
        self.failures: list[tuple[BaseException, str, int | None]] = []
        # Those of the failures that stand for a cancellation from outside this run
        # (``own_cancellation``): a cancellation of run()'s caller outranks them.
        self.own_cancellations: list[BaseException] = []
        # Nothing unusual has happened: an arrival that is not the last may just park.
        self.fast_path = sync_timeout is None
        self.finished_run = False
        self.creations: VariableCreations | None = None  # made on a replica's first Variable()
        self.cancelled_class = self.loop.cancelled_class
        self.tasks: _loops.ReplicaTasks = _NOT_STARTED
        # The replicas are being cancelled (the run failed, or its caller was cancelled), and
        # the shield around the async merge function running now, if any (``stop_merge``).
        self.stopping = False
        self.merge_scope: anyio.CancelScope | None = None
        # When the first replica arrived at the current (or last) merge point, and when the
        # last one did (``complete``).
        self.first_at = 0.0
        self.last_at = 0.0
        self.warned: _Round | None = None  # the round the watchdog warned about last
        recorder = _trace.recorder
        self.tracer = recorder if recorder is not None and recorder.owner is self.strategy else None
        self.trace_rounds: dict[int, int] = {}  # merge number -> round number in the trace
        if self.tracer is not None:
            for replica in self.replicas:
                replica.track = self.tracer.replica_track(replica.sync_id)

    def trace_round(self, number: int) -> int:
        """The trace's number of this run's merge round ``number`` (traced runs only)."""
        traced = self.trace_rounds.get(number)
        if traced is None:
            assert self.tracer is not None
            traced = self.trace_rounds[number] = self.tracer.next_round()
        return traced

    # -- ending ------------------------------------------------------------------------------

    def fail(self, exc: BaseException, note: str, replica: int | None = None) -> None:
        """Record a failure and cancel every replica (the first failure is what run() raises)."""
        self.failures.append((exc, note, replica))
        self.fast_path = False
        self.tasks.cancel()
        # A replica parked inside an anyio shield is not reached by the cancellation: wake the
        # round, whose replicas then leave it (``rnd.done`` stays false).
        rnd = self.round
        if rnd.arrived and not rnd.done:
            rnd.gate.open(None)

    def own_cancellation(self, exc: BaseException, who: str) -> RuntimeError:
        """A cancellation that user code raised of its own, not this run's: a failure."""
        error = RuntimeError(
            f"{who} raised {type(exc).__name__} although its run() was not cancelled; a "
            "cancellation escaping replica code (a cancelled inner task, an expired "
            "asyncio.timeout, an explicit raise) is a failure: catch it where it starts, or "
            "cancel the caller of run() to stop every replica"
        )
        error.__cause__ = exc
        self.own_cancellations.append(error)
        return error

    def replica_failed(self, replica: _Replica, exc: BaseException) -> None:
        self.fail(
            exc,
            f"raised in replica {replica.sync_id} of {self.engine.num_replicas} "
            f"(device {replica.device.name})",
            replica.sync_id,
        )

    def scheduler_crashed(self, exc: BaseException) -> None:
        self.fail(exc, "raised by the scheduler")

    def stop_merge(self) -> None:
        """The replicas are being cancelled (the run failed, or its caller was cancelled): an
        async merge function, which a shield keeps from its replica's own cancellation, stops
        too (``_complete_awaiting``)."""
        self.stopping = True
        if self.merge_scope is not None:
            self.merge_scope.cancel()

    @property
    def merges_completed(self) -> int:
        """Merge rounds completed; every replica took part in each (a round needs them all)."""
        return self.round.number - 1

    def replica_finished(self, replica: _Replica, result: Any) -> None:
        self.results[replica.id] = result
        merges = self.merges_completed
        self.finished[replica.id] = merges
        self.fast_path = False
        rnd = self.round
        waiting = [r.sync_id for r in rnd.arrived]
        if waiting and not self.failures:
            number = rnd.number
            first = rnd.arrived[0]
            request = rnd.requests[first.id]
            point = _merge_point(number, request[FN] if request is not None else None, first)
            self.fail(
                ReplicaSyncError(
                    f"replica {replica.sync_id} finished after {merges} merge_call()s while "
                    f"{replica_list(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in "
                    f"{point}; every replica must reach the same merge_calls, so "
                    "move merge_call out of replica-dependent branches",
                    merge_number=number,
                    replicas=[replica.sync_id],
                    waiting=waiting,
                ),
                f"detected when replica {replica.sync_id} finished",
            )

    def _early_finishers_error(self, replica: _Replica) -> ReplicaSyncError:
        number = self.round.number
        done = sorted(self.finished)
        merges = self.finished[done[0]]
        done = [self.first_replica + i for i in done]
        request = self.round.requests[replica.id]
        point = _merge_point(number, request[FN] if request is not None else None, replica)
        return ReplicaSyncError(
            f"replica {replica.sync_id} reached {point}, but {replica_list(done)} "
            f"already finished after {merges} merge_call()s and can never join it; every "
            "replica must reach the same merge_calls, so move merge_call out of "
            "replica-dependent branches",
            merge_number=number,
            replicas=done,
            waiting=[r.sync_id for r in self.round.arrived],
        )

    # -- the merge rendezvous ----------------------------------------------------------------

    def _new_round(self, number: int) -> _Round:
        return _Round(number, self.size, self.new_gate())

    def arrive(self, replica: _Replica, rnd: _Round, request: MergeRequest) -> _Step:
        """The slow path of an arrival (already filed in ``rnd``): last, with a timeout, or in
        a run that is going wrong. Returns once the round is done, with the cancellation owed
        to the replica, if any (see ``park_interrupted``)."""
        timeout = request[TIMEOUT] if request[TIMEOUT] is not None else self.sync_timeout
        if timeout is not None and timeout != _NO_TIMEOUT and rnd.deadline is None:
            rnd.timeout = timeout
            rnd.deadline = anyio.current_time() + timeout
        if self.finished and not self.failures:
            self.fail(self._early_finishers_error(replica), "detected at a merge point")
        if len(rnd.arrived) == self.size and not self.failures:
            waiting = self.complete(rnd, replica)
            if waiting is not None:
                return (yield from self.last_waits(rnd, waiting))
            return None
        if self.failures:
            yield from self.loop.park_cancelled(_RunFailed)
        return (yield from self._wait(replica, rnd))

    def woken(self, replica: _Replica, rnd: _Round) -> _Step:
        """A parked replica woke and its round is not done: the run failed (and a shield keeps
        its cancellation out), or it was woken to take over the round's watch (``_leave``)."""
        if self.failures:
            raise _RunFailed
        rnd.waiter = rnd.gate.waiter  # the fast path's, if the gate replaced it
        return (yield from self._wait(replica, rnd))

    def _wait(self, replica: _Replica, rnd: _Round) -> _Step:
        """Park ``replica`` in ``rnd`` until the round is done; the first to park while the
        round has a deadline and nobody watches it watches it. Returns the cancellation owed
        to the replica, if any."""
        while True:
            owed = None
            asked = replica.requests_now()
            try:
                if rnd.deadline is not None and rnd.watcher is None:
                    yield from self._park_watching(rnd, replica)
                else:
                    yield from rnd.gate.park(replica.id)
            except BaseException as exc:
                owed = yield from self.park_interrupted(replica, rnd, exc, asked)
            if rnd.done:
                return owed
            if self.failures:  # woken by a failing run: shielded from its cancellation
                raise _RunFailed
            # Woken to take over the watch, or by another replica's cancellation: park again.

    def park_interrupted(
        self, replica: _Replica, rnd: _Round, exc: BaseException, asked: int
    ) -> _Step:
        """A parked replica was woken by an exception (``asked``: the cancellations requested
        of it as it parked). If it was meant for another replica (``gate.interrupted``
        returns), the caller parks it again. A cancellation that comes
        once the round is done does not undo the replica's part, which was committed with the
        others': the replica takes it, and the cancellation is kept for its next checkpoint
        (returned, where the loop needs it requested again). Otherwise the replica leaves the
        round with the exception."""
        try:
            yield from rnd.gate.interrupted(exc, asked)
        except BaseException as error:
            del exc  # raised on: its traceback holds this frame, which must not hold it
            if self._committed(rnd, error):
                return self.loop.defer_cancellation(error)
            if (
                len(rnd.arrived) == self.size
                and not self.failures
                and isinstance(error, self.cancelled_class)
            ):
                return (yield from self._wait_merge(replica, rnd, error))
            if not rnd.done:
                self._leave(replica, rnd)
            raise
        return None

    def _wait_merge(self, replica: _Replica, rnd: _Round, exc: BaseException) -> _Step:
        """The cancellation ``exc`` reached a parked replica while ``rnd`` runs its merge
        function, with the replica's part: it waits for the outcome out of the cancellation's
        reach (an anyio shield), then takes its part as ``park_interrupted`` does, unless the
        run failed or the merge was cancelled with it."""
        with anyio.CancelScope(shield=True):  # noqa: ASYNC100 - parks inside
            while not (rnd.done or rnd.abandoned or self.failures):
                # On asyncio a Task.cancel() (an asyncio.timeout's) passes a shield: ignored.
                with contextlib.suppress(self.cancelled_class):
                    yield from rnd.gate.park(replica.id)
        if self._committed(rnd, exc):
            return self.loop.defer_cancellation(exc)
        try:
            raise exc
        finally:  # its traceback holds this frame, which must not hold it
            del exc

    def _committed(self, rnd: _Round, exc: BaseException) -> bool:
        """Whether ``exc`` is a cancellation that came too late for ``rnd``: done, in a run
        that is not failing (a failing run raises its failure, whatever the round did)."""
        return rnd.done and not self.failures and isinstance(exc, self.cancelled_class)

    def last_waits(self, rnd: _Round, waiting: _Step) -> _Step:
        """The last arrival waits on what ``complete`` left it (an async ``merge_fn``, its turn
        in a seeded order); returns the cancellation owed to it, as ``park_interrupted``."""
        try:
            return (yield from waiting)
        except BaseException as exc:
            if self._committed(rnd, exc):
                return self.loop.defer_cancellation(exc)
            raise

    def _leave(self, replica: _Replica, rnd: _Round) -> None:
        """``replica`` leaves ``rnd`` (cancelled or timed out) before it is done. If the round
        has a deadline and nobody watches it now, a replica still parked there is woken to
        watch it. Once no replica is left, the deadline stays: the next arrival watches it (at
        once past it, the round fails), so leaving and coming back never restarts it."""
        rnd.arrived.remove(replica)
        rnd.requests[replica.id] = None
        if rnd.deadline is not None and rnd.watcher is None and rnd.arrived:
            rnd.gate.wake(rnd.arrived[0].id)

    def _park_watching(self, rnd: _Round, replica: _Replica) -> _Step:
        """Park ``replica`` until ``rnd``'s deadline; if the others have not all arrived by
        then, the run fails (a round that filled is never timed out)."""
        deadline = rnd.deadline
        assert deadline is not None  # only a round with a deadline is watched
        rnd.watcher = replica
        try:
            with anyio.CancelScope(deadline=deadline) as scope:  # noqa: ASYNC100 - parks inside
                yield from rnd.gate.park(replica.id)
        finally:
            rnd.watcher = None
        if rnd.done or not scope.cancelled_caught or self.failures:
            return
        if len(rnd.arrived) == self.size:  # the round is running its merge_fn: no deadline
            rnd.deadline = None
            return
        arrived = [r.sync_id for r in rnd.arrived]
        late = sorted(set(range(self.first_replica, self.first_replica + self.size)) - set(arrived))
        request = rnd.requests[replica.id]
        assert request is not None  # it is parked in the round
        self.fail(
            ReplicaSyncError(
                f"{replica_list(arrived)} waited {rnd.timeout:g} s in "
                f"{_merge_point(rnd.number, request[FN], replica)} for {replica_list(late)}, "
                "which did not arrive; a replica is stuck or skips this merge_call (raise the "
                "timeout if it is just slow)",
                merge_number=rnd.number,
                replicas=late,
                waiting=arrived,
            ),
            "detected by a merge timeout",
        )
        yield from self.loop.park_cancelled(_RunFailed)
        raise AioreplicaInternalError("a replica parked after a failed run was not cancelled")

    def complete(self, rnd: _Round, last: _Replica) -> _Step | None:
        """The last arrival runs ``merge_fn`` once and wakes everyone in order.

        ``"ordered"``: ``last`` carries on at once, the others resume in arrival order (the
        gate wakes them in the order they parked); ``"random"``: in a seeded shuffle, ``last``
        taking its turn among them. Returns what ``last`` must still wait on (an async
        ``merge_fn``, its turn in a seeded order, or a failed run's cancellation), or ``None``
        when the round is over: a synchronous merge function costs no generator.
        """
        self.last_at = _clock()  # every replica has arrived
        try:
            merge_fn, args, kwargs = self._merge_arguments(rnd)
        except (ValueError, TypeError, ReplicaSyncError) as exc:
            self.fail(exc, f"detected in merge_call #{rnd.number}")
            return self._park_failed()
        if self.merged is not None:
            self.merged.append(merge_fn)
        track = last.track
        started = track.now() if track is not None else 0  # a traced run: merge_fn starts
        token = context_state.set(self.merge_state)
        try:
            result = merge_fn(self.strategy, *args, **kwargs)
        except BaseException as exc:
            if track is not None:
                self._record_merge(track, merge_fn, started, rnd)
            self._merge_failed(exc, merge_fn, rnd)
            return self._park_failed()
        finally:
            context_state.reset(token)
        if type(result) not in _PLAIN_RESULTS and inspect.isawaitable(result):
            return self._complete_awaiting(rnd, last, merge_fn, result, started)
        if made_by_yield(merge_fn, result):  # a ``yield`` in merge_fn
            error = yielding_step(f"merge_fn {_describe_fn(merge_fn)}", result, "a merge_fn")
            self._merge_failed(error, merge_fn, rnd)
            return self._park_failed()
        if track is not None:
            self._record_merge(track, merge_fn, started, rnd)
        return self._finish_round(rnd, last, result)

    @staticmethod
    def _record_merge(
        track: _trace.ReplicaTrack, merge_fn: Callable[..., Any], started: int, rnd: _Round
    ) -> None:
        name = f"merge_fn {_trace.callable_name(merge_fn)}"
        track.record(name, started, {"merge": rnd.number})

    def _complete_awaiting(
        self,
        rnd: _Round,
        last: _Replica,
        merge_fn: Callable[..., Any],
        awaitable: Any,
        started: int,
    ) -> _Step:
        """``complete`` for a merge function that returned an awaitable: awaited here, still
        in cross-replica context (``started``: when it started, in a traced run).

        The round holds every replica's part, so the merge function runs in a shield: a
        cancellation of the replica running it (its own scope's) waits for it, as for the
        parked ones (``_wait_merge``), and fires at the replica's next checkpoint (returned, as
        ``last_waits`` does). The run's cancellation (``stop_merge``) cancels the shield's scope:
        the merge function stops, and the round is abandoned. (A bare asyncio
        ``Task.cancel()``, an ``asyncio.timeout``'s, passes anyio's shields: it stops the merge
        function as the replica's own cancellation, a failure.)
        """
        token = context_state.set(self.merge_state)
        failed = False
        scope: anyio.CancelScope | None = None
        try:
            if self.loop.in_cancel_scope():
                with anyio.CancelScope(shield=True) as scope:  # noqa: ASYNC100 - awaits inside
                    self.merge_scope = scope
                    if self.stopping:
                        scope.cancel()
                    result = yield from awaitable.__await__()
            else:  # no scope of its own to keep out (entering a shield costs several µs)
                result = yield from awaitable.__await__()
        except BaseException as exc:
            self._merge_failed(exc, merge_fn, rnd)  # raises the run's own cancellation
            failed = True
        finally:
            self.merge_scope = None
            context_state.reset(token)
            if last.track is not None:
                self._record_merge(last.track, merge_fn, started, rnd)
        if scope is not None and scope.cancelled_caught:  # the run's (``stop_merge``) stopped it
            self._abandon(rnd)
            failed = True
        if failed:
            yield from self._park_failed()
        finished = self._finish_round(rnd, last, result)
        if finished is not None:
            yield from finished
        # A cancellation of the replica that the shield kept out is owed.
        return None if scope is None else self.loop.defer_cancellation(None)

    def _abandon(self, rnd: _Round) -> None:
        """The run's cancellation stopped ``rnd``'s merge function: the round will never be
        done. The replicas that wait for its outcome out of the cancellation's reach
        (``_wait_merge``) wake, to be cancelled too."""
        rnd.abandoned = True
        rnd.gate.open(None)

    def _merge_failed(self, exc: BaseException, merge_fn: Callable[..., Any], rnd: _Round) -> None:
        """Fail the run with what ``merge_fn`` raised (the run's own cancellation goes on)."""
        if isinstance(exc, self.cancelled_class):
            if self.tasks.is_cancellation(exc):
                self._abandon(rnd)
                try:
                    raise exc
                finally:  # its traceback holds this frame, which must not hold it
                    del exc
            exc = self.own_cancellation(exc, f"merge_fn {_describe_fn(merge_fn)}")
        if isinstance(exc, ReplicaSyncError) and exc.merge_number is None:
            exc.merge_number = rnd.number
        stop = exc if isinstance(exc, StopIteration) else _python_stop(exc)
        if stop is not None:  # out of run(), a coroutine: a bare RuntimeError
            exc = _escaped_stop(stop, f"merge_fn {_describe_fn(merge_fn)}")
        call = _call_of(merge_fn)  # the library's own merge function: the call it stands for
        by = (
            f"{call} (merge_call #{rnd.number})"
            if call
            else f"merge_fn {_describe_fn(merge_fn)} in merge_call #{rnd.number}"
        )
        self.fail(exc, f"raised by {by}, in cross-replica context")

    def _park_failed(self) -> _Step:
        yield from self.loop.park_cancelled(_RunFailed)
        raise AioreplicaInternalError("a replica parked after a failed run was not cancelled")

    def _finish_round(self, rnd: _Round, last: _Replica, result: Any) -> _Step | None:
        """Publish the round's result, open the next round, wake the replicas."""
        rnd.result = result
        if isinstance(result, DistributedValues):
            if len(result.values) == self.size:
                rnd.parts = result.values
        elif type(result) in _SPLIT_RESULTS:
            rnd.parts = select_replicas(result, self.size)
        if rnd.parts is None and result is not None:
            found = misfit(result, self.size)
            if found is not None:  # no replica could take its own part
                merge_fn = rnd.requests[0][FN]  # type: ignore[index]  # all filed
                self.fail(
                    ValueError(
                        f"merge_fn {_describe_fn(merge_fn)} returned {shown_misfit(found)}, but "
                        f"merge_call has {self.size} replicas here; return one value per "
                        "replica, or a plain value that every replica gets"
                    ),
                    f"detected in merge_call #{rnd.number}, in cross-replica context",
                )
                return self._park_failed()
        rnd.done = True
        self.round = self._new_round(rnd.number + 1)
        self.fast_path = self.sync_timeout is None and not self.failures and not self.finished
        scheduler = self.scheduler
        scheduler.merge_rounds_completed += 1
        # The statistics: who was last, and how long the round waited for it.
        waited = self.last_at - self.first_at
        late = last.id
        scheduler.last_counts[late] += 1
        scheduler.waited_total += waited
        scheduler.waited_for[late] += waited
        if waited > scheduler.longest_for[late]:
            scheduler.longest_for[late] = waited
        if self.rng is None:
            rnd.gate.open(None)  # in the order they parked: arrival order
            return None
        order = [r.id for r in rnd.arrived]
        self.rng.shuffle(order)
        return rnd.gate.hand_over(order, last.id)

    def _merge_arguments(self, rnd: _Round) -> tuple[Callable[..., Any], Any, dict[str, Any]]:
        """Check the round (callable, one merge function everywhere); regroup its arguments."""
        requests: list[MergeRequest] = rnd.requests  # type: ignore[assignment]  # all filed
        merge_fn = requests[0][FN]
        if not callable(merge_fn):
            raise TypeError(
                f"merge_fn must be callable, got {type(merge_fn).__name__} {merge_fn!r} "
                f"(replica {self.first_replica})"
            )
        fns = list(map(_request_fn, requests))
        if fns.count(merge_fn) != self.size:
            try:
                agreed(PerReplica(fns), "the merge function", first_replica=self.first_replica)
            except ReplicaSyncError as exc:
                exc.merge_number = rnd.number
                calls = [_call_of(fn) for fn in fns]
                # One call of objects made per replica (an optimizer each): the error says so.
                one_call = bool(calls[0]) and calls.count(calls[0]) == len(calls)
                if any(calls) and not one_call:  # a collective or a write, which merges
                    made = "; ".join(
                        f"replica {self.first_replica + i}: "
                        f"{call or f'merge_call({_describe_fn(fn)})'}"
                        for i, (fn, call) in enumerate(zip(fns, calls, strict=True))
                    )
                    exc.add_note(
                        f"the replicas made different calls here ({made}): every replica must "
                        "make the same collectives, variable writes, optimizer steps and "
                        "merge_calls, in the same order; keep them out of branches that "
                        "depend on the replica"
                    )
                elif not one_call:
                    exc.add_note(
                        "move the branch inside merge_fn, or pass the same function (a partial "
                        "with equal arguments) from every replica"
                    )
                raise
        # merge_call checked the types: args are tuples, kwargs mappings or None.
        all_args = list(map(_request_args, requests))
        first = self.first_replica
        try:
            args = regroup(all_args, first_replica=first) if any(all_args) else ()
        except (TypeError, ValueError):
            mismatch = _collective_mismatch(merge_fn, all_args, first) or _arguments_mismatch(
                "args", all_args, merge_fn, rnd.number, first
            )
            if mismatch is None:
                raise
            raise mismatch from None
        all_kwargs = list(map(_request_kwargs, requests))
        if not any(all_kwargs):
            return merge_fn, args, {}
        keywords = [dict(kw or {}) for kw in all_kwargs]
        try:
            kwargs = regroup(keywords, first_replica=first)
        except (TypeError, ValueError):
            mismatch = _arguments_mismatch("kwargs", keywords, merge_fn, rnd.number, first)
            if mismatch is None:
                raise
            raise mismatch from None
        return merge_fn, args, kwargs


def _arguments_mismatch(
    what: str,
    per_replica: list[Any],
    merge_fn: Callable[..., Any],
    number: int,
    first_replica: int,
) -> Exception | None:
    """The error for merge_call ``what`` (``"args"`` or ``"kwargs"``, one per replica) whose
    structure differs between replicas, naming the round and the place in them; ``None`` where
    they match (the regrouping failed for another reason)."""
    first = per_replica[0]
    for offset, other in enumerate(per_replica[1:], 1):
        replica = first_replica + offset
        found = find_mismatch(
            first, other, first=f"replica {first_replica}", second=f"replica {replica}"
        )
        if found is not None:
            kind, path, message = found
            return kind(
                f"merge_call #{number} ({_describe_fn(merge_fn)}): replica {replica} passed "
                f"{what} that differ from replica {first_replica}'s at {what}{format_path(path)}: "
                f"{message}; every replica must pass merge_call {what} of the same structure "
                "(the values may differ)"
            )
    return None


def _collective_mismatch(
    merge_fn: Callable[..., Any], all_args: list[Any], first_replica: int
) -> Exception | None:
    """For a built-in collective (``COLLECTIVE_VALUES``), the error for replicas' values of
    different structures, with the place in the value from its root (not in the merge
    arguments, which the replica never saw); else ``None``."""
    known = COLLECTIVE_VALUES.get(merge_fn)
    if known is None:
        return None
    name, index = known
    values = [args[index] for args in all_args]
    for offset, other in enumerate(values[1:], 1):
        error = structure_mismatch(
            values[0], other, first_replica, first_replica + offset, what=name, verb="pass"
        )
        if error is not None:
            return error
    return None


#: The merge results split for every replica at once (``select_replicas``).
_SPLIT_RESULTS: Final = frozenset({tuple, list, dict})

#: What merge functions commonly return, none of it awaitable: the check is then one lookup.
_PLAIN_RESULTS: Final = frozenset(
    {type(None), PerReplica, Mirrored, tuple, list, dict, int, float, bool, str}
)

# C-level getters for the per-round loops over replicas (no comprehension frame).
_request_fn = operator.itemgetter(FN)
_request_args = operator.itemgetter(ARGS)
_request_kwargs = operator.itemgetter(KWARGS)


def _escaped_stop(exc: StopIteration, who: str) -> RuntimeError:
    """The error for a ``StopIteration`` out of user code (``who``), which Python would turn
    into a RuntimeError that says nothing of where it came from (PEP 479); chained to it."""
    error = RuntimeError(
        f"{who} raised StopIteration, which cannot pass out of a coroutine; catch it where it "
        "is raised (next() on an exhausted iterator, say), or raise another exception"
    )
    error.__cause__ = exc
    return error


#: What Python says when a StopIteration leaves a coroutine or generator frame (PEP 479).
_PEP479_MESSAGES: Final = frozenset(
    {
        "coroutine raised StopIteration",
        "generator raised StopIteration",
        "async generator raised StopIteration",
    }
)


def _python_stop(exc: BaseException) -> StopIteration | None:
    """The StopIteration that Python turned into ``exc`` at a coroutine's edge, if it did."""
    cause = exc.__cause__
    if (
        type(exc) is RuntimeError
        and isinstance(cause, StopIteration)
        and exc.args
        and exc.args[0] in _PEP479_MESSAGES
    ):
        return cause
    return None


def _later_failures(
    first: BaseException, later: list[tuple[BaseException, str, int | None]]
) -> list[str]:
    """One note per distinct later failure; the same error from several replicas (on trio
    replicas often fail alike before the cancellation reaches them) is one note naming them."""
    notes: list[str | tuple[type[BaseException], str]] = []  # a note, or a key of `alike`
    alike: dict[tuple[type[BaseException], str], list[int]] = {}
    for exc, note, replica in later:
        if exc is first:
            continue
        if replica is None:
            notes.append(f"also {note}: {error_line(exc)}")
            continue
        key = (type(exc), error_line(exc))
        if key not in alike:
            alike[key] = []
            notes.append(key)
        alike[key].append(replica)
    return [
        note if isinstance(note, str) else f"also raised in {replica_list(alike[note])}: {note[1]}"
        for note in notes
    ]


#: A collective's timeout that turns the run's off (``CommunicationOptions(timeout_seconds=0)``).
_NO_TIMEOUT: Final = math.inf

#: Every run's number, in the order they start (``_Run.serial``).
_run_serials = itertools.count()

#: The attribute in which ``run()`` keeps, on the exception it raises, the notes it added,
#: with each run's serial number.
_RUN_NOTES: Final = "_aioreplica_run_notes"


def _set_run_notes(exc: BaseException, notes: list[str], serial: int) -> None:
    """Add the ``notes`` of run number ``serial`` to ``exc``, taking off those that runs
    started before it added: an exception object raised again (a module-level one) carries
    the notes of the run raising it, not of every earlier one. Those of runs started after it
    stay: a ``run()`` in its ``merge_fn``, which raised ``exc`` on, says where (so do those of
    another run raising the same object at the same time, which cannot be told from one)."""
    kept: list[tuple[int, tuple[str, ...]]] = []
    present = getattr(exc, "__notes__", None)
    for added, old in getattr(exc, _RUN_NOTES, ()):
        if added > serial:
            kept.append((added, old))
        elif type(present) is list:
            for line in old:
                with contextlib.suppress(ValueError):  # the program took it off itself
                    present.remove(line)
    for note in notes:
        add_note(exc, note)
    with contextlib.suppress(AttributeError, TypeError):  # a class that refuses attributes
        setattr(exc, _RUN_NOTES, (*kept, (serial, tuple(notes))))


class _NotStarted:
    """The tasks of a run before it starts its replicas and after they all ended."""

    def cancel(self) -> None:
        raise AioreplicaInternalError("a run was cancelled before or after its replicas ran")

    def is_cancellation(self, exc: BaseException) -> bool:
        raise AioreplicaInternalError("a cancellation reached a replica outside its run")

    async def wait(self) -> None:
        raise AioreplicaInternalError("a run waited for replicas it never started")


_NOT_STARTED: Final = _NotStarted()


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    """A snapshot of a strategy's scheduler (``strategy.statistics()``).

    A merge round *waits* from the arrival of its first replica until its last replica
    arrives (the merge function's own work is not counted). Each replica that was not the last
    of a round is charged that wait: exactly its own wait if it arrived first, a little more
    than its own if it arrived in between (measuring each replica's arrival would cost a clock
    read per replica per round; this costs two per round). The last replica is charged 0.

    Attributes:
        runs_active: ``run()`` calls in progress.
        replicas_waiting: replicas parked at a merge point, over all active runs.
        merge_rounds_completed: merge rounds completed since the strategy was made.
        steps: ``run()`` calls completed (returned a result) since the strategy was made; a
            ``run_steps`` call counts once.
        wait_total: per replica (indexed by replica id in sync, ``num_replicas_in_sync``
            entries), the seconds it was charged over the completed merge rounds: how long it
            stood ready while others were late.
        wait_max: per replica, the longest wait it was charged in one round, in seconds.
        slowest_replica: the replica (by its id in sync) that arrived last in the most merge
            rounds (the lowest id on a tie); ``None`` before any merge round has completed.

    With several workers each worker measures its own replicas' merge rounds: the entries of
    other workers' replicas are 0.0, and ``slowest_replica`` is one of this worker's. A wait
    for another worker happens inside a collective's merge function, after every local replica
    has arrived, so it is in none of these numbers (nor does it log a slow merge warning);
    the collective's timeout (``sync_timeout``, ``CommunicationOptions(timeout_seconds=...)``)
    bounds it.
    """

    runs_active: int
    replicas_waiting: int
    merge_rounds_completed: int
    steps: int = 0
    wait_total: tuple[float, ...] = ()
    wait_max: tuple[float, ...] = ()
    slowest_replica: int | None = None


class Scheduler:
    """Runs the replicas of one strategy; one per strategy, any number of concurrent runs.

    ``slow_merge_warning``: seconds after which a merge point still waiting for replicas logs
    a warning (see ``_Watchdog``), or ``None``.
    """

    def __init__(
        self,
        strategy: Any,
        engine: ReductionEngine,
        *,
        sync_timeout: float | None,
        rng: random.Random | None,
        slow_merge_warning: float | None = None,
    ) -> None:
        self.strategy = strategy
        self.engine = engine
        self._sync_timeout = sync_timeout
        self._rng = rng
        self._active: set[_Run] = set()
        self.merge_rounds_completed = 0
        self.steps = 0
        size = len(engine.devices)
        self.size = size
        # Per completed merge round: who arrived last, and how long the round waited for it
        # (``_Run._finish_round``); summed (and maximised) by who was last.
        self.last_counts = [0] * size
        self.waited_total = 0.0
        self.waited_for = [0.0] * size
        self.longest_for = [0.0] * size
        self.slow_merge_warning = slow_merge_warning
        if slow_merge_warning is not None:
            _WATCHDOG.watch(self)

    def statistics(self) -> SchedulerStatistics:
        total = self.waited_total
        longest = self.longest_for
        # Each replica waited in the rounds where another was last: the longest of those is
        # the longest of all unless it was itself last there, then the second longest.
        order = sorted(range(self.size), key=longest.__getitem__, reverse=True)
        first = order[0]
        second = longest[order[1]] if self.size > 1 else 0.0
        counts = self.last_counts
        most = max(counts)
        # Indexed by replica id in sync: the entries of other workers' replicas stay 0.0.
        base = self.engine.first_replica
        wait_total = [0.0] * self.engine.num_replicas
        wait_max = [0.0] * self.engine.num_replicas
        for i in range(self.size):
            wait_total[base + i] = max(0.0, total - self.waited_for[i])
            wait_max[base + i] = second if i == first else longest[first]
        return SchedulerStatistics(
            runs_active=len(self._active),
            replicas_waiting=sum(len(run.round.arrived) for run in self._active),
            merge_rounds_completed=self.merge_rounds_completed,
            steps=self.steps,
            wait_total=tuple(wait_total),
            wait_max=tuple(wait_max),
            slowest_replica=base + counts.index(most) if most else None,
        )

    def stop_watching(self) -> None:
        """No more slow merge warnings for this scheduler (its strategy was closed)."""
        _WATCHDOG.unwatch(self)

    def resume_watching(self) -> None:
        """Slow merge warnings again, if the strategy asked for them (it was reopened)."""
        if self.slow_merge_warning is not None:
            _WATCHDOG.watch(self)

    def check_slow_merges(self, now: float) -> None:
        """Log a warning for each run whose current round has waited ``slow_merge_warning``
        seconds or more since its first arrival (once per round).

        Called by the watchdog thread: it only reads what the loop's thread writes (a copy
        of each list it looks at), and ``run.warned``, which only it writes.
        """
        threshold = self.slow_merge_warning
        if threshold is None:
            return
        for run in list(self._active):
            rnd = run.round
            arrived = list(rnd.arrived)
            if not arrived or rnd.done or run.warned is rnd or len(arrived) == run.size:
                continue
            first = arrived[0]
            waited = now - run.first_at
            if waited < threshold:
                continue
            run.warned = rnd
            present = sorted(r.sync_id for r in arrived)
            late = sorted(
                set(range(run.first_replica, run.first_replica + run.size)) - set(present)
            )
            request = rnd.requests[first.id]
            # (Not where the replica awaits it: its coroutine runs on the loop's thread.)
            point = _merge_point(rnd.number, request[FN] if request is not None else None, None)
            logger.warning(
                "%s of a run() on %r has waited %.1f s for %s, which %s not "
                "arrived (%s waiting); a replica is stuck or much slower than the others "
                "(slow_merge_warning=%g s: logged once per merge point)",
                point,
                self.strategy,
                waited,
                replica_list(late),
                "has" if len(late) == 1 else "have",
                replica_list(present),
                threshold,
                extra={
                    "merge_number": rnd.number,
                    "late_replicas": late,
                    "waiting_replicas": present,
                    "waited": waited,
                },
            )

    async def run(
        self,
        fn: Callable[..., Any],
        per_replica_args: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]],
        merged: list[Callable[..., Any]] | None = None,
    ) -> list[Any]:
        """Run ``fn`` once per replica; return the results by replica id.

        ``merged``: a list to which each merge round appends its merge function, in order (a
        multi-worker strategy compares them between workers at the end of its ``run()``).

        Raises:
            BaseException: the first failure, unwrapped, with notes, unless a later one is no
                ``Exception`` (a ``KeyboardInterrupt``): that one (see the module docstring).
        """
        run = _Run(self, sync_timeout=self._sync_timeout, rng=self._rng, merged=merged)
        order = list(run.replicas)
        if self._rng is not None:
            self._rng.shuffle(order)
        self._active.add(run)
        # The replicas of a run that is not traced (a trace may start while it goes on, or
        # another strategy's be recorded) inherit a context that records none of their spans.
        muted = _trace.mute() if run.tracer is None else None
        try:
            # An await in a cancelled scope raises, before any replica starts, on every loop.
            if run.loop.cancelled():
                await anyio.lowlevel.checkpoint_if_cancelled()
            tasks = run.loop.replica_tasks(
                [functools.partial(r.main, fn, *per_replica_args[r.id]) for r in order],
                run.scheduler_crashed,
                run.stop_merge,
                in_order=self._rng is not None,
            )
            run.tasks = tasks
            try:
                await tasks.wait()
            except run.cancelled_class:
                # The caller was cancelled, and every replica has ended. A replica's failure
                # meanwhile (its cleanup raised, say) is raised instead, as a task group does:
                # the cancellation is not lost (trio's scope stays cancelled; on asyncio the
                # exception goes through the expiring timeout or scope that cancelled). But a
                # replica cancelled from outside just before (every task cancelled at once, as
                # asyncio.run's shutdown does) failed only by that: the caller's cancellation
                # is raised.
                own = run.own_cancellations
                if not run.failures or all(exc in own for exc, _, _ in run.failures):
                    raise
        finally:
            if muted is not None:
                _trace.unmute(muted)
            run.finished_run = True
            self._active.discard(run)
            if run.tracer is not None:
                for replica in run.replicas:
                    if replica.track is not None:
                        replica.track.release()
            # Break the run <-> replica <-> context cycles now, so results (pooled host buffers
            # among them) are freed by reference counting, not at the next cycle collection.
            for replica in run.replicas:
                replica.context = None
                replica.coro = None
            run.replicas = []
            run.tasks = _NOT_STARTED  # the tasks' contexts hold the replicas
            # The failures' tracebacks hold the replicas' frames (and this one), which hold the
            # run: a run that kept them would make a cycle, keeping every replica's frame and
            # its arrays alive after the caller dropped the exception, until a cycle collection.
            failures, run.failures = run.failures, []
            run.own_cancellations = []
        if failures:
            # The first failure, unless a later one is a KeyboardInterrupt or SystemExit (any
            # exception that is no Exception): that is raised, as a task group does.
            index = next(
                (i for i, (exc, _, _) in enumerate(failures) if not isinstance(exc, Exception)),
                0,
            )
            first, note, _ = failures[index]
            later = _later_failures(first, failures[:index] + failures[index + 1 :])
            _set_run_notes(first, [note, *later], run.serial)
            try:
                raise first
            finally:  # this frame is in the exception's traceback: it must not hold it
                del first, failures
        self.steps += 1
        results, run.results = run.results, []
        return results


class _Watchdog:
    """The thread that logs slow merge points: one per process, shared by every scheduler
    with a ``slow_merge_warning``.

    It starts with the first such scheduler and ends once none is left (they are held weakly:
    a strategy that is dropped, or closed, stops being watched). Every quarter of the smallest
    ``slow_merge_warning`` it asks each scheduler to look at its runs
    (``Scheduler.check_slow_merges``), so a warning comes between 1 and 1.25 times the
    threshold after the round's first arrival.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._schedulers: weakref.WeakSet[Scheduler] = weakref.WeakSet()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._period = math.inf  # seconds between looks, as of the last look
        self._passed = threading.Condition()
        self.passes = 0  # looks taken since the process started

    def wait_passes(self, count: int, timeout: float) -> bool:
        """Wait until the thread has taken ``count`` more looks; whether it did in time."""
        with self._passed:
            target = self.passes + count
            return self._passed.wait_for(lambda: self.passes >= target, timeout)

    def watch(self, scheduler: Scheduler) -> None:
        seconds = scheduler.slow_merge_warning
        assert seconds is not None
        with self._lock:
            self._schedulers.add(scheduler)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._main, name="aioreplica watchdog", daemon=True
                )
                self._thread.start()
            elif seconds / 4 < self._period:
                self._wake.set()  # look more often from now on

    def unwatch(self, scheduler: Scheduler) -> None:
        with self._lock:
            self._schedulers.discard(scheduler)
            if not self._schedulers:
                self._wake.set()  # nothing left to watch: the thread ends now

    @property
    def thread(self) -> threading.Thread | None:
        """The thread, while it runs."""
        return self._thread

    def _main(self) -> None:
        while True:
            period = self._check()
            if period is None:
                return
            with self._passed:
                self.passes += 1
                self._passed.notify_all()
            self._wake.wait(period)

    def _check(self) -> float | None:
        """Look at every watched scheduler once; the seconds until the next look, or None
        (and the thread ends) when there is none left.

        It holds one scheduler at a time, only while looking at it: a strategy its program
        has dropped is collected at once, not kept alive by this thread.
        """
        with self._lock:
            watched = [weakref.ref(scheduler) for scheduler in self._schedulers]
            if not watched:
                self._thread = None
                return None
            self._wake.clear()
        now = _clock()
        period = math.inf
        for ref in watched:
            scheduler = ref()
            if scheduler is None:
                continue
            period = min(period, (scheduler.slow_merge_warning or math.inf) / 4)
            try:
                scheduler.check_slow_merges(now)
            except Exception as exc:  # a run changed under the look: look again next time
                problem = f"{type(exc).__name__}: {exc}"  # no traceback: it holds the frames
                logger.debug("the slow merge check failed (%s)", problem)
            scheduler = None
        self._period = period
        return period if period != math.inf else 0.0


_WATCHDOG: Final = _Watchdog()
