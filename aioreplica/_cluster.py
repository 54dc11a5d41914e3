"""The workers of a multi-worker strategy, and the MPI collectives that run between them.

One process per worker, under ``mpiexec``. ``Workers`` holds this worker's place (its index,
how many workers there are) and two duplicates of the user's communicator, so the caller's own
traffic on it is never disturbed:

- **the collectives' communicator.** Every cross-worker collective is made of non-blocking
  MPI calls (the records' exchange, then ``Iallreduce``, ``Iallgatherv`` or ``Ibcast`` for
  data that is not small) that the event loop polls with ``Test`` and a zero sleep, so the
  loop keeps running other tasks; after a short busy phase the poll backs off (up to a few
  milliseconds between tests) so a worker waiting long for a late peer does not spin a core.
  MPI moves data only inside ``Test``, so the data of a collective of ``_ASIDE_BYTES`` or
  more is waited for on a thread of its own, which tests it (and the side channel) while the
  loop runs other tasks: its copies held the loop for tens of milliseconds at 64 MiB. MPI
  requires every worker to issue collectives in the same order. Two first-come queues
  (``_Turn``) keep it on each communicator: one for *calls*, the other for collectives. A
  call is what a user awaits (a ``run()``, a ``strategy.reduce``, a save, a variable's write
  outside a ``run()``): it holds the communicator from its first collective to its last
  (``Workers.call``), so two tasks' calls never interleave their collectives, and calls pair
  with the other workers' in the order they reached the strategy on each. Within a call or a
  ``run()``, its own collectives take turns one at a time (an operation of two messages holds
  the turn for both). Independent streams of collectives (a dataset pass agreeing whether any
  worker still has data) get their own duplicate (``Workers.duplicate``).
- **the records.** MPI checks neither that the workers make the same collective nor that
  their buffers match: two workers reducing other shapes get garbage, and a collective met by
  another kind of collective may complete on one worker and fail on the other. So every
  collective starts with each worker's 1 KiB *record*, gathered by all (sent straight to
  every other worker, or in MPI's ``Allgather`` past ``_DIRECT_WORKERS`` workers): a header
  (a checksum of what the collective is, with the dtype and shape it carries and where in a
  nested value, then that in words) and the data itself when it is small. Different headers
  raise ``WorkersDisagree`` on every worker alike, before any data moves, so the workers stay
  in step; small reductions and broadcasts are done from the gathered records, in that one
  message. A cross-replica call of several collectives (a ``strategy.reduce`` of a nested
  value, or along an axis) first exchanges records whose header describes the whole call
  (``agree``), so that workers passing other structures disagree at once, on every worker,
  instead of one worker's call ending while another's goes on into the next. A worker that
  refused the arguments of its ``run()`` or of a collective sends a record saying so in place
  of the collective it would have made next (``refuse_in_step``), so bad input raises on
  every worker in step and breaks nothing.
- **the side channel.** A failure is announced to every peer as a small message on its own
  communicator, where each worker keeps a receive posted; every wait tests it alongside its
  collective, so peers learn of the failure while they wait, and raise ``ReplicaSyncError``
  naming the failing worker. With a timeout in force, each worker also tells its peers which
  collective it has reached, on which communicator (one 32-byte send per peer; a dataset
  pass's duplicate counts its start as collective 0), so a worker that gives up waiting can
  name exactly the late workers; without a timeout nothing more is sent. A worker whose
  dataset pass ends before the workers agreed on its end (a ``break``, a cancellation) tells
  its peers where it left that pass's duplicate, so a peer waiting there for a collective it
  will never make raises instead of waiting for ever (the pass ends; nothing breaks). Those
  messages go on a duplicate of the user's communicator that all strategies over it share
  (``_Arrivals``).

MPI cannot cancel a collective: after any cross-worker failure (a peer's, a timeout, a
cancelled wait) the collectives' communicator may hold a request that will never complete, so
the cluster is *broken* and refuses every further call with ``RuntimeError``.

Communicators go back to MPI when their strategy is closed or dropped, except where messages
may still be on their way to them: MPI gives a freed communicator's context to the next
communicator made over the same workers, and a message still on its way to the freed one is
received by the new one as its own (a peer's failure notice, the record of a collective that
one worker made and another never did). So a broken cluster keeps every communicator it made,
as does one whose wait was left before its request completed (a dataset pass left early),
until the job ends. The arrival messages, which need no failure, go on a communicator that is
never freed, each naming its side channel: one for a strategy no longer there is dropped.

``mpi4py`` is imported on first use, never by ``import aioreplica``.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import functools
import itertools
import json
import math
import re
import sys
import threading
import time
import weakref
import zlib
from collections import deque
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, Final, NamedTuple, final

import anyio
import numpy as np

from ._errors import ClusterBroken, ReplicaSyncError, WorkersDisagree

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

__all__ = [
    "ClusterBroken",
    "Workers",
    "WorkersDisagree",
    "call_of",
    "collective_timeout",
    "current_step",
    "error_line",
    "import_mpi",
    "in_native_order",
    "raw_bytes",
    "reductions_called",
    "worker_list",
]

#: Tags of the side channel.
_NOTICE: Final = 1
_ARRIVAL: Final = 2
_LEFT: Final = 3
#: Room for one failure notice (JSON, UTF-8); longer messages are cut.
_NOTICE_BYTES: Final = 4096
#: How long a wait polls with zero sleeps before it backs off (seconds), plus the time its
#: bytes take at ``_SLOW_BYTES_PER_SECOND``: MPI moves data only inside ``Test``, so a pause
#: during a transfer stalls it; a peer a little late costs no added latency, and one late for
#: longer leaves the core to others.
_BUSY_SECONDS: Final = 0.005
#: How long a wait tests its request in a tight loop before it first yields to the event loop.
_SPIN_SECONDS: Final = 2e-5
_SLOW_BYTES_PER_SECOND: Final = 250e6
#: The first and the longest pause between two tests of a long wait (seconds).
_FIRST_PAUSE: Final = 5e-5
_MAX_PAUSE: Final = 0.005
#: How long an uncaught exception's traceback has to reach ``mpiexec`` before the job is
#: aborted (seconds).
_ABORT_GRACE_SECONDS: Final = 0.5
#: How long a wait still tests its request once a peer said its program ended (seconds).
_LEFT_GRACE_SECONDS: Final = 0.05
#: How long the exit waits for the large collectives' waits on threads to stop (seconds): one
#: may be posting a large collective, which copies its data (60-500 ms at 128 MiB).
_STOP_SECONDS: Final = 5.0
#: From how many bytes a collective's data is waited for on a thread (``Workers._wait_aside``).
#: Measured on two workers: handing a wait to a thread and its outcome back costs 0.25-0.45 ms
#: per collective (all_reduce of 1-4 MiB: 0.31-0.75 of raw MPI's throughput that way, against
#: 0.46-1.19 on the loop; of 16 MiB, 0.79-0.90 against 0.92-0.94), while the loop's longest
#: pause in a collective of 64 MiB per replica was 20-80 ms on the loop (a first all_gather's
#: post and page faults: 350-600 ms) and 4-8 ms with the thread.
_ASIDE_BYTES: Final = 32 << 20

#: The timeout of the collectives being made (seconds, or ``None``): set by the reduction
#: engine from its options around each call, read by every wait.
collective_timeout: ContextVar[float | None] = ContextVar(
    "aioreplica.collective_timeout", default=None
)

#: The name that the all-reduces being made go by in their waits (a timeout, a peer's
#: failure), where the user's call is not ``all_reduce`` (a ``reduce_scatter``): set by the
#: reduction engine around it. A disagreement still says ``all_reduce``, alike on every worker.
reductions_called: ContextVar[str] = ContextVar(
    "aioreplica.reductions_called", default="all_reduce"
)

#: The step (a ``run()``, or an agreement standing in for one) that the running task belongs
#: to: set in ``run()``, so its replicas and merges (tasks it starts) inherit it.
current_step: ContextVar[object | None] = ContextVar("aioreplica.current_step", default=None)

#: The call (``Workers.call``) the running task is making, if any: its own collectives, and
#: those of the tasks it starts, go ahead within it while it holds its cluster.
current_call: ContextVar[_Call | None] = ContextVar("aioreplica.current_call", default=None)

_REDUCE_OPS: Final = {"sum": "SUM", "max": "MAX", "min": "MIN", "prod": "PROD"}
_BOOL_OPS: Final = {"max": "LOR", "min": "LAND"}
#: The same ops on numpy, for reductions small enough to travel in their header's message.
_LOCAL_OPS: Final = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
#: Every collective's first message from each worker, its record: a header (a checksum of
#: what the collective is, then that in words), then room for small data.
_HEADER_BYTES: Final = 128
#: In a header's checksum word: the words go on past the header (``_header_in_full``).
_CONTINUED: Final = 1 << 32
#: In a record's checksum word: the collective belongs to a ``run()``'s step.
_IN_STEP: Final = 1 << 34
#: What a refusal's words say (``refuse_in_step``; a restore refusing its file).
_REFUSING: Final = re.compile(r" refusing (?:its arguments|the file): ")
_HEADER_WORDS: Final = _HEADER_BYTES // 8
_RECORD_BYTES: Final = 1024
_INLINE_BYTES: Final = _RECORD_BYTES - _HEADER_BYTES
#: How many ways of all-reducing (op, dtype, shape) a cluster keeps ready.
_PLANS: Final = 256
#: Where bytes that a broadcast's root puts in its record start (``Workers._put``): after the
#: header and the word that holds their size.
_PUT_AT: Final = _HEADER_BYTES + 8
#: How many arrays' descriptions (dtype and shape) a broadcast keeps written and read.
_DESCRIPTIONS: Final = 256
#: Up to how many workers the records go straight from each worker to every other
#: (``_RecordExchange``), and the tag of those messages on the collectives' communicator.
_DIRECT_WORKERS = 8
_RECORD_TAG: Final = 0
#: Each worker's message in the agreement to start: its count of local replicas, its pack size,
#: then why it could not make its strategy (UTF-8, cut to fit), if it could not.
_START_BYTES: Final = 512


@final
class _NoCall:
    """What a call holds in one process: nothing (one for all). Its start is a checkpoint: a
    call awaited in a cancelled scope raises before it begins, as trio's and anyio's own
    awaits do. (Across workers a call goes on until its first wait, where the cancellation
    counts as this worker failing, so the peers raise rather than wait for it.)"""

    __slots__ = ()

    async def __aenter__(self) -> None:
        await anyio.lowlevel.checkpoint_if_cancelled()

    async def __aexit__(self, *exc_info: object) -> None:
        return None


_NO_CALL: Final = _NoCall()


def call_of(workers: Workers | None, what: str) -> contextlib.AbstractAsyncContextManager[None]:
    """``workers.call(what)`` across workers; nothing in one process (``workers`` None),
    where entering it is a checkpoint."""
    return _NO_CALL if workers is None else workers.call(what)


def error_line(error: BaseException) -> str:
    """``error`` in one line for a peer: its type, and its message's first line (cut)."""
    try:
        message = str(error)
    except Exception:  # a __str__ that raises: the type still says something
        message = "(its message could not be shown)"
    text = message.splitlines()[0][:500] if message else ""
    line = f"{type(error).__name__}{': ' + text if text else ''}"
    return line if len(line) <= 600 else f"{line[:600]}..."  # a type's name may be long too


def _notice_bytes(notice: dict[str, Any]) -> bytes:
    """``notice`` as JSON within ``_NOTICE_BYTES``, its ``reason`` cut short (ending in
    ``...``) where it is too long, so that the peers can always read it."""
    reason: str = notice["reason"]
    cut = reason
    while True:
        data = json.dumps(notice, ensure_ascii=False).encode("utf-8", "replace")
        if len(data) <= _NOTICE_BYTES or not cut:
            return data[:_NOTICE_BYTES]
        cut = cut[: max(0, len(cut) - (len(data) - _NOTICE_BYTES) - 3)]  # a char is >= 1 byte
        notice = {**notice, "reason": cut + "..."}


#: The ops whose MPI version need not propagate a NaN (MPICH's ``MAX`` and ``MIN`` compare
#: with ``>``), with NumPy's, which do; made into MPI ops on first use (``_nan_keeping_op``).
_NAN_KEEPING: Final = {"max": np.maximum, "min": np.minimum}
_nan_keeping_ops: dict[str, Any] = {}


def _nan_keeping_op(mpi: Any, op: str) -> Any:
    """An MPI op for ``op`` on floating arrays that keeps a NaN, as NumPy's (and the reduction
    of data small enough for the records) does: a NaN on any worker is the result's NaN. Not
    commutative to MPI, which then combines the workers' arrays in one order everywhere, so
    every worker gets the same bits (the sign of a zero included)."""
    made = _nan_keeping_ops.get(op)
    if made is None:
        from mpi4py.util import dtlib

        ufunc = _NAN_KEEPING[op]

        def combine(incoming: Any, inout: Any, datatype: Any) -> None:
            dtype = dtlib.to_numpy_dtype(datatype)
            result = np.frombuffer(inout, dtype)
            ufunc(np.frombuffer(incoming, dtype), result, out=result)

        made = _nan_keeping_ops[op] = mpi.Op.Create(combine, commute=False)
    return made


def import_mpi() -> Any:
    """``mpi4py.MPI``, imported now, or an ``ImportError`` that says what to install.

    Raises:
        ImportError: mpi4py (or the MPI library it needs) is not installed.
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            f"MultiWorkerMirroredStrategy needs mpi4py and an MPI library, which cannot be "
            f"imported ({exc}); install them with `pip install 'aioreplica[mpi]'` and launch "
            "one process per worker with that environment's `mpiexec -n N python ...`"
        ) from exc
    return MPI


@final
class _Turn:
    """A first-come queue for one communicator's collectives, on one event loop.

    Uncontended, ``acquire`` takes the turn without suspending; a contended one waits for an
    event in the order of arrival.
    """

    __slots__ = ("_waiters", "busy")

    def __init__(self) -> None:
        #: Whether the turn is taken (read it; ``take_now``, ``acquire`` and ``release``
        #: change it).
        self.busy = False
        self._waiters: deque[anyio.Event] = deque()

    def take_now(self) -> bool:
        """Take the turn if it is free (no suspension); whether it was taken."""
        if self.busy:
            return False
        self.busy = True
        return True

    async def acquire(self) -> None:
        if not self.busy:
            self.busy = True
            return
        event = anyio.Event()
        self._waiters.append(event)
        try:
            await event.wait()
        except BaseException:
            if event.is_set():  # handed the turn while being cancelled: pass it on
                self.release()
            else:
                self._waiters.remove(event)
            raise

    def release(self) -> None:
        if self._waiters:
            self._waiters.popleft().set()  # the turn goes to the next waiter as it is
        else:
            self.busy = False


@final
class _Call:
    """``Workers.call``: the communicator held for one call of this task."""

    __slots__ = ("_reset", "holding", "what", "workers")

    def __init__(self, workers: Workers, what: str) -> None:
        self.workers = workers
        self.what = what
        self._reset: Token[_Call | None] | None = None
        #: Whether the call holds its cluster now: a task started in the call that outlives
        #: it (in a task group outside) takes turns again once the call has ended.
        self.holding = False

    @property
    def in_progress(self) -> bool:
        """Whether this call has begun and not ended (a task it started may outlive it)."""
        return self._reset is not None

    async def __aenter__(self) -> None:
        workers = self.workers
        if workers.in_step or workers.in_call:
            return  # within the run() or the call in progress: its collectives go ahead
        if not workers.broken:  # else no more collectives: each says so, naming this call,
            # and what is this worker's own goes on
            await workers._enter_call(self.what)  # cancelled while waiting: made no collective
            self.holding = True
        self._reset = current_call.set(self)

    async def __aexit__(self, *exc_info: object) -> None:
        if self._reset is not None:
            current_call.reset(self._reset)
            self._reset = None
            if not self.holding:
                return
            self.holding = False
            self.workers.let_go()
            stopped = exc_info[1]
            if isinstance(stopped, BaseException) and not isinstance(stopped, Exception):
                # Cancelled (or interrupted) once under way: this worker fails, as a cancelled
                # run() does; the others are, or will be, in collectives MPI cannot take back.
                # (An exception is the call's own, raised in step.)
                self.workers.announce(f"its {self.what} was stopped by {type(stopped).__name__}")


@final
class Workers:
    """This worker's place among the workers, and the collectives between them.

    Construction is collective: every worker makes its ``Workers`` (through its strategy) at
    the same point of its program, and they agree on the number of local replicas and on the
    pack size of their collectives.

    Args:
        communicator: an mpi4py intracommunicator (default ``COMM_WORLD``); the cluster works
            on duplicates of it.
        local_replicas: how many replicas this worker runs.
        pack_bytes: the most bytes its collectives pack together (the strategy's
            ``CommunicationOptions.bytes_per_pack``, its default in place of 0): workers that
            pack differently make different collectives from the same values.
        timeout: the strategy's ``sync_timeout``: how long a refusal of ``communicator`` may
            wait for the others where it has to guess their communicator (``refuse``).

    Raises:
        ImportError: mpi4py is not installed.
        TypeError: ``communicator`` is not an mpi4py intracommunicator, or is
            ``MPI.COMM_NULL`` (``refuse`` says what the other workers learn).
        ValueError: the workers run different numbers of local replicas or pack differently,
            or another worker could not make its strategy (on every worker).
    """

    # This worker's record (every collective's first message) in three views, the header it
    # holds, every worker's record once gathered, the persistent request that exchanges them,
    # and the ways of all-reducing made so far (``_records``).
    _record: np.ndarray[Any, Any]
    _record_bytes: memoryview
    _record_words: np.ndarray[Any, Any]
    _data_sent: bytes | None
    _word_sent: int
    _gathered: np.ndarray[Any, Any]
    _gathered_words: np.ndarray[Any, Any]
    _checksums: np.ndarray[Any, Any]
    _exchange_request: _RecordExchange
    _plans: dict[tuple[str, np.dtype[Any], tuple[int, ...], str], _Plan]

    # Slots: every collective reads a dozen of these, and an instance dictionary past 30 keys
    # (CPython's limit for keys that instances share) made each collective 0.2 µs slower.
    __slots__ = (
        "__weakref__",
        "_calls",
        "_checksums",
        "_comm",
        "_data_sent",
        "_exchange_request",
        "_gathered",
        "_gathered_words",
        "_idup",
        "_idup_what",
        "_in_step",
        "_left",
        "_persistent",
        "_plans",
        "_primary",
        "_record",
        "_record_bytes",
        "_record_words",
        "_release",
        "_sequence",
        "_side",
        "_single",
        "_stream",
        "_stream_name",
        "_told_left",
        "_turn",
        "_word_sent",
        "default_timeout",
        "mpi",
        "num_workers",
        "pending",
        "refused",
        "refusing",
        "step",
        "variables_made",
        "worker_index",
        "workers_here",
    )

    def __init__(
        self,
        communicator: Any,
        local_replicas: int,
        pack_bytes: int = 0,
        timeout: float | None = None,
    ) -> None:
        mpi = import_mpi()
        self.mpi = mpi
        _free_retired()
        try:
            communicator = _intracomm(mpi, communicator)
        except TypeError as exc:
            Workers.refuse(communicator, exc, timeout)
            raise
        # First, on the caller's communicator, every worker's count of local replicas and pack
        # size (or why it could not make its strategy: ``refuse``), so that no worker waits
        # for another that gave up, and nothing is made unless every worker can.
        started = _agree_to_start(communicator, local_replicas, pack_bytes)
        differ = _starts_differ(started)
        if differ:
            raise ValueError(differ)
        self._comm = communicator.Dup()
        self.worker_index: int = self._comm.Get_rank()
        self.num_workers: int = self._comm.Get_size()
        self._calls = _Turn()  # one call at a time (``call``)
        self._turn = _Turn()  # one collective at a time, within the call or the run()
        self._single = False  # the collective in progress holds ``_calls`` for itself alone
        self._in_step = False  # the collective in progress belongs to a run()'s step
        # A duplicate's ``Idup`` until it completes, and the wait's name (``duplicate``).
        self._idup: Any = None
        self._idup_what = ""
        self._persistent: list[Any] = []  # the records' requests, freed with the communicator
        #: Requests whose waits were left before they completed, each with what holds its
        #: buffers (``_move``'s ``post``): mpi4py's non-blocking collectives do not hold them,
        #: and MPI may yet write into them.
        self._left: list[tuple[Any, object]] = []
        self._records()
        side = communicator.Dup()
        arrivals = _Arrivals.of(mpi, communicator)
        self._side = _SideChannel(mpi, side, arrivals, self.num_workers, self.worker_index)
        self._release = self._finalizer()
        # The strategy's own communicator (not a dataset pass's duplicate): it tells peers what
        # its collectives reached, and an interrupted wait on it is this worker's failure.
        self._primary = True
        self._sequence = 0  # collectives started on this communicator
        self._stream = 0  # which of the side channel's communicators this is (0: the first)
        self._stream_name = "the strategy's collectives"  # what it is for (``duplicate``)
        self._told_left = False  # it told the peers it left this stream (``tell_left``)
        self._side.members[0] = self
        #: The timeout of a wait when the call sets none (the strategy's ``sync_timeout``).
        self.default_timeout: float | None = None
        #: Variables made since the last sync, which start from the chief's values.
        self.pending: list[Any] = []
        #: How many variables were made on this communicator: the next one's number, the
        #: same on every worker (they make their variables in the same order), which the
        #: workers compare wherever a collective is for a variable.
        self.variables_made = 0
        #: The step in progress on this communicator (``current_step``'s value in its tasks),
        #: or None: meanwhile only its own tasks make collectives here.
        self.step: object | None = None
        #: The error this worker last refused in step with the others (``refuse_in_step``).
        self.refused: BaseException | None = None
        #: Errors raised in this ``run()`` by a replica's check of a collective's arguments,
        #: with the collective's name: refused in step if the ``run()`` fails with one.
        self.refusing: list[tuple[str, BaseException]] = []
        here = self._side.comm.Split_type(mpi.COMM_TYPE_SHARED)
        #: How many workers run on this machine (they share its cores).
        self.workers_here: int = here.Get_size()
        here.Free()

    @staticmethod
    def refuse(communicator: Any, error: BaseException, timeout: float | None = None) -> None:
        """Take part in the workers' construction as a worker that could not make its
        strategy (``error``), so that every other worker raises too instead of waiting for it.
        Nothing to do without mpi4py or when ``error`` came from that agreement itself.

        A worker given ``MPI.COMM_NULL`` (a rank left out of the communicator, or a freed
        one) is in no group of workers: it takes part in nothing, and the workers of the
        communicator, which it is not one of, go on without it. Given something that is no
        communicator, it guesses that the others wait on ``COMM_WORLD``, which they may not
        (they may be on a communicator of their own): that wait ends after ``timeout``
        seconds if given (the strategy's ``sync_timeout``), and ``error`` then gets a note
        saying that the others were not told. MPI cannot cancel a collective, so the refusal
        stays posted on ``COMM_WORLD`` until the job ends: the next collective the other
        workers make there meets it (a strategy made there raises ``ValueError`` naming this
        worker), so end the job rather than go on.

        Example:
            >>> MPI = import_mpi()
            >>> Workers.refuse(MPI.COMM_NULL, TypeError("not in it"))  # nothing to agree
        """
        if isinstance(error, (ImportError, _Refused)):
            return
        mpi = import_mpi()
        if _is_null(mpi, communicator):
            return
        try:
            communicator = _intracomm(mpi, communicator)
        except TypeError:
            communicator = mpi.COMM_WORLD  # the likeliest communicator of the others
        else:
            timeout = None  # the others' communicator, where they all wait
        try:
            _agree_to_start(communicator, -1, 0, error_line(error), timeout)
        except _Refused:
            pass
        except TimeoutError:
            error.add_note(
                f"The other workers were not told: none joined this worker's refusal on "
                f"MPI.COMM_WORLD within sync_timeout ({timeout:g} s), so they are likely on "
                "another communicator; the refusal stays posted on MPI.COMM_WORLD, where it "
                "would meet their next collective: end the job"
            )

    # -- facts ----------------------------------------------------------------------------

    @property
    def is_chief(self) -> bool:
        """Whether this is worker 0, which writes checkpoints and numbers them."""
        return self.worker_index == 0

    @property
    def failure(self) -> str | None:
        """Why the workers fell out of step, or ``None``."""
        return self._side.failure

    @property
    def broken(self) -> bool:
        """Whether a cross-worker failure has ended this cluster's collectives."""
        return self._side.failure_box[0] is not None

    def __repr__(self) -> str:
        return f"<Workers: worker {self.worker_index} of {self.num_workers}>"

    # -- failures -------------------------------------------------------------------------

    def check(self, what: str) -> None:
        """Refuse ``what`` once the workers have fallen out of step.

        Raises:
            ClusterBroken: the cluster is broken.
        """
        deferred = self._side.deferred
        if deferred is not None:  # a peer's failure after the last collective this one made
            self._side.deferred = None
            raise deferred
        if self.failure is not None:
            refused = self._call_named(what)
            raise ClusterBroken(
                f"{refused} was refused: the workers fell out of step ({self.failure}); MPI cannot "
                "cancel a collective, so this MultiWorkerMirroredStrategy makes no more "
                "cross-worker calls: end the job (or handle the failure and start a new one)"
            )

    def _call_named(self, what: str) -> str:
        """``what`` as the user knows it: the call in progress it is part of (a
        ``strategy.reduce``, not its ``all_reduce``), else ``what`` itself."""
        return self._call_in_progress() or what

    def _call_in_progress(self) -> str | None:
        """The name of this task's call in progress on this cluster, if any."""
        call = current_call.get()
        if call is not None and call.workers is self and call.in_progress:
            return call.what
        return None

    def announce(
        self, reason: str, replicas: tuple[int, ...] = (), late: tuple[int, ...] = ()
    ) -> None:
        """Tell every peer that this worker failed (``reason``), or gave up waiting for the
        ``late`` workers; the cluster is broken.

        Peers waiting in a collective, or reaching one later, raise ``ReplicaSyncError``
        naming this worker (the late workers, when it gave up on them). Announcing twice
        sends once.
        """
        side = self._side
        if side.failure is not None:
            return
        side.failure = f"worker {self.worker_index} {'gave up' if late else 'failed'}: {reason}"
        notice = {
            "worker": self.worker_index,
            "reason": reason,
            "replicas": list(replicas),
            "late": list(late),
            # Where this worker stopped, on each of its communicators: the last collective it
            # began, and whether it is still inside it (it will not finish it).
            "at": [[n, w._sequence, w._turn.busy] for n, w in list(side.members.items())],
        }
        side.send_all(_notice_bytes(notice), _NOTICE)

    def _peer_failure(self, what: str) -> ReplicaSyncError | None:
        """The failure a peer announced, as the error to raise here in ``what``, or ``None``
        (a test).

        The notice comes once, but every wait on this side channel's communicators gets it (a
        dataset pass's agreement and a step's collective wait side by side): the one that
        takes it must not leave the others waiting for a collective that the failed peer
        will never make.
        """
        side = self._side
        if side.notice_request is not None:
            with side.testing:
                request = side.notice_request
                if request is not None:
                    if not request.Test():
                        return None
                    side.notice_came = True
                    side.notice_request = None
        return self._noticed(what) if side.notice_came else None

    def _raised(self, failure: ReplicaSyncError) -> ReplicaSyncError:
        """``failure``, raised here: on the strategy's own communicator, the last a peer's
        notice needs to reach (no later call raises it again)."""
        if self._primary:
            self._side.deferred = None
        return failure

    def _noticed(self, what: str) -> ReplicaSyncError:
        """The failure in the peer's notice (``_SideChannel.notice``), as the error to raise
        here in ``what``."""
        side = self._side
        raw = bytes(side.notice).rstrip(b"\0")
        try:
            notice = json.loads(raw.decode(errors="replace"))
            worker, reason = int(notice["worker"]), str(notice["reason"])
            replicas = tuple(int(r) for r in notice.get("replicas", ()))
            late = tuple(int(w) for w in notice.get("late", ()))
            left = bool(notice.get("left", False))
            side.peer_at = {int(n): (int(q), bool(inside)) for n, q, inside in notice.get("at", ())}
        except (ValueError, KeyError, TypeError, AttributeError):
            worker, reason, replicas, late, left = -1, raw.decode(errors="replace"), (), (), False
        if left:
            side.peer_left = True
            if side.failure is None:
                side.failure = f"worker {worker} ended its program"
            return ReplicaSyncError(
                f"worker {worker} ended its program while worker {self.worker_index} waits in "
                f"{what}, so {what} cannot complete: a collective made on some workers only (a "
                "strategy.reduce or a save on the chief alone, say) waits for the others "
                "forever; make every collective on every worker. This "
                "MultiWorkerMirroredStrategy makes no more cross-worker calls",
                merge_number=None,
                workers=(worker,),
            )
        if late:  # it gave up waiting: the late workers are at fault, maybe this one
            if side.failure is None:
                side.failure = f"worker {worker} gave up: {reason}"
            me = self.worker_index
            this = f" (this worker, worker {me}, among them)" if me in late else ""
            return ReplicaSyncError(
                f"worker {worker} gave up waiting for {worker_list(list(late))}{this}: "
                f"{reason}; every worker's call stops, and this MultiWorkerMirroredStrategy "
                "makes no more cross-worker calls (MPI cannot cancel a collective): a worker "
                "is stuck or skips this collective (raise sync_timeout or timeout_seconds if it "
                "is just slow)",
                merge_number=None,
                workers=late,
            )
        if side.failure is None:
            side.failure = f"worker {worker} failed: {reason}"
        return ReplicaSyncError(
            f"worker {worker} failed: {reason}; every worker's run() stops, and this "
            "MultiWorkerMirroredStrategy makes no more cross-worker calls (MPI cannot cancel a "
            "collective): end the job, or fix the failing worker's code",
            merge_number=None,
            replicas=replicas,
            workers=(worker,),
        )

    # -- waiting --------------------------------------------------------------------------

    async def _wait(self, request: Any, what: str, nbytes: int = 0, post: object = None) -> None:
        """Poll ``request`` until it completes, testing the side channel alongside. ``post``
        (``_move``'s) holds the request's buffers, kept with it if the wait is left early.

        Raises:
            ReplicaSyncError: a peer failed, or the timeout in force passed (naming the late
                workers); the cluster is then broken.
        """
        test = request.Test
        if _spin(test):
            return
        timeout = self._timeout()
        started = time.monotonic()
        busy = _BUSY_SECONDS + nbytes / _SLOW_BYTES_PER_SECOND
        polls = 0
        pause = 0.0
        try:
            while True:
                if pause:
                    await anyio.sleep(pause)
                    if test():
                        return
                else:
                    await anyio.lowlevel.checkpoint()
                    if _spin(test):
                        return
                polls += 1
                if polls & 15 == 0 or pause:  # now and then: the side channel, the clock
                    if _untold:  # a pass dropped here: a peer may be waiting in it
                        _tell_untold()
                    if not self._primary and await self._peer_left_stream(what, test):
                        return
                    failure = self._peer_failure(what)
                    if failure is not None:
                        # A peer whose program ended, or that failed once past this
                        # collective, made it: it completes (the notice came first).
                        if (self._side.peer_left or self._peer_went_past()) and (
                            await _finishes_soon(test)
                        ):
                            self._defer(failure)
                            return
                        raise self._raised(failure)
                    pause = self._next_pause(what, started, timeout, busy, pause)
        except BaseException as exc:  # a peer's failure, a timeout, or cancelled meanwhile
            self._left.append((request, post))
            self._wait_left(what, exc)
            raise

    async def _move(self, post: Callable[[], Any], what: str, nbytes: int) -> None:
        """Make a collective's data move: post it (``post()`` returns its MPI request), on
        this thread, and ``_wait`` for it; or, from ``_ASIDE_BYTES``, both on a thread
        (``_wait_aside``) where MPI allows it (``_SideChannel.threaded``). The caller holds
        the turn, so no other collective is posted on this communicator meanwhile.

        Raises:
            ReplicaSyncError: as ``_wait``.
        """
        if nbytes >= _ASIDE_BYTES and self._side.threaded:
            await self._wait_aside(post, what, nbytes)
        else:
            await self._wait(post(), what, nbytes, post)

    async def _wait_aside(self, post: Callable[[], Any], what: str, nbytes: int) -> None:
        """``_wait`` for the data of a large collective (``nbytes``), posted (``post()``) and
        tested on a thread of its own (``_tested_aside``) while the loop runs other tasks:
        MPICH copies a worker's own part of the data when the collective is posted (and
        faults in the output's pages: 60-500 ms at 128 MiB) and moves the rest inside
        ``Test``. The wait keeps ``_wait``'s promises: a peer's failure or the timeout ends
        it, and a cancelled wait is this worker's failure, told to the peers at once; the
        thread sees that between two tests and stops.

        Raises:
            ReplicaSyncError: a peer failed, or the timeout in force passed (naming the late
                workers); the cluster is then broken.
        """
        timeout = self._timeout()
        # From now: the time the wait spends queued for a thread counts too.
        deadline = None if timeout is None else time.monotonic() + timeout
        busy = _BUSY_SECONDS + nbytes / _SLOW_BYTES_PER_SECOND
        stop = threading.Event()
        side = self._side
        try:
            # A thread of anyio's: starting one of our own for each wait (and waiting for it to
            # start) made a 16 MiB all_reduce of two replicas 30 % slower. Its tokens are the
            # side channel's own: a program whose threads hold all of anyio's default ones
            # (one waiting for this very call, say) cannot keep the wait from starting.
            completed, failure = await anyio.to_thread.run_sync(
                self._tested_aside,
                post,
                what,
                deadline,
                busy,
                stop,
                abandon_on_cancel=True,
                limiter=side.limiter,
            )
        except BaseException as exc:  # cancelled meanwhile, or MPI raised on the thread
            stop.set()
            self._wait_left(what, exc)
            raise
        self._settle(completed, failure, what, timeout)

    def _wait_left(self, what: str, exc: BaseException) -> None:
        """A wait in ``what`` ended by ``exc`` before its request completed. On the strategy's
        own communicator this worker failed, and its peers are told (unless ``exc`` is a
        peer's failure, or the timeout, which ``_timed_out`` announced); a dataset pass's
        duplicate is abandoned with the request, and nothing else is affected."""
        if not self._primary:
            self.tell_left(inside=True)
        elif not isinstance(exc, ReplicaSyncError):
            self._announce_interrupted(what, exc, waiting=True)

    def _announce_interrupted(self, what: str, exc: BaseException, *, waiting: bool) -> None:
        """Tell the peers this worker failed: ``exc`` interrupted ``what`` (its wait in it, if
        ``waiting``). Within a call, the peers' error names the call made, as when the call
        is stopped between its waits (a ``Checkpoint.save``, and its ``broadcast``)."""
        interrupted = f"was interrupted by {type(exc).__name__}"
        call = self._call_in_progress()
        if call is None:
            self.announce(f"its {'wait in ' if waiting else ''}{what} {interrupted}")
        elif call == what:  # (the call's own agreement)
            self.announce(f"its {call} {interrupted}")
        else:
            self.announce(f"its {call} {interrupted} in {what}")

    def _settle(
        self,
        completed: bool,
        failure: ReplicaSyncError | None,
        what: str,
        timeout: float | None,
    ) -> None:
        """End a wait of ``_tested_here`` by its outcome: whether the request ``completed``,
        and the ``failure`` a peer announced meanwhile, if any (neither: ``timeout`` passed).

        Raises:
            ReplicaSyncError: the peer's failure, unless the request completed (the peer made
                this collective first, as in ``_wait``: raised by the next call), or the
                timeout, naming the late workers.
        """
        if failure is not None:
            if completed:
                self._defer(failure)
                return
            raise self._raised(failure)
        if not completed:
            assert timeout is not None
            raise self._timed_out(what, timeout)

    def _tested_aside(
        self,
        post: Callable[[], Any],
        what: str,
        deadline: float | None,
        busy: float,
        stop: threading.Event,
    ) -> tuple[bool, ReplicaSyncError | None]:
        """The thread of ``_wait_aside``: ``_tested_here``, while in the side channel's
        ``waits``, which the exit stops (``_withdraw_at_exit``). A peer's notice is taken in
        here too (``_peer_failure`` records it on the side channel, under
        ``_SideChannel.testing``); what this worker tells its peers, and a failure to raise
        later, are done on the loop."""
        waiting = (stop, threading.Event())
        self._side.waits.add(waiting)
        try:
            return self._tested_here(post, what, deadline, busy, stop)
        finally:
            self._side.waits.discard(waiting)
            waiting[1].set()

    def _tested_here(
        self,
        post: Callable[[], Any],
        what: str,
        deadline: float | None,
        busy: float,
        stop: threading.Event,
        held: object = None,
    ) -> tuple[bool, ReplicaSyncError | None]:
        """Post the request (``post()``), then test it and the side channel, backing off after
        ``busy`` seconds, until it completes, a peer's failure comes, ``deadline``
        (``time.monotonic()``) passes or ``stop`` is set; whether it completed, and the peer's
        failure, if one came (neither: the timeout passed, or the waiter gave up), for
        ``_settle``. A request left incomplete goes to ``_left``, once nothing tests it any
        more, with ``post`` and ``held``, which hold its buffers. The wait of a synchronous
        caller (``_wait_here``) and of a thread (``_tested_aside``)."""
        request = None
        try:
            request = post()
            test = request.Test
            started = time.monotonic()
            pause = 0.0
            completed, failure = True, None
            while not _spin(test):
                if stop.is_set():  # the wait was given up on the loop
                    completed = False
                    break
                failure = self._peer_failure(what)
                if failure is not None:
                    completed = (self._side.peer_left or self._peer_went_past()) and _finishes(test)
                    break
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    completed = False
                    break
                pause = _backed_off(now - started, busy, pause)
                if pause:
                    stop.wait(pause)
        except BaseException:  # an MPI error: raised on the loop
            if request is not None:
                self._left.append((request, (post, held)))
            raise
        if not completed:
            self._left.append((request, (post, held)))
        return completed, failure

    def _wait_here(self, request: Any, what: str, held: object = None) -> None:
        """``_wait`` on this thread, for a synchronous caller (``blocking``, which tells the
        peers when an exception interrupts it): the side channel, the timeout and the back-off
        are the same; ``held`` holds the request's buffers, kept with it if the wait is left.

        Raises:
            ReplicaSyncError: a peer failed, or the timeout in force passed.
        """
        timeout = self._timeout()
        deadline = None if timeout is None else time.monotonic() + timeout
        never = threading.Event()  # nobody gives up a synchronous wait from elsewhere
        outcome = self._tested_here(lambda: request, what, deadline, _BUSY_SECONDS, never, held)
        self._settle(*outcome, what, timeout)

    def _next_pause(
        self, what: str, started: float, timeout: float | None, busy: float, pause: float
    ) -> float:
        """The pause before a long wait's next test: none while busy (``busy`` seconds),
        then doubling up to ``_MAX_PAUSE``.

        Raises:
            ReplicaSyncError: the wait has lasted past ``timeout``.
        """
        waited = time.monotonic() - started
        if timeout is not None and waited > timeout:
            raise self._timed_out(what, timeout)
        return _backed_off(waited, busy, pause)

    def _timed_out(self, what: str, timeout: float) -> ReplicaSyncError:
        reached = self._side.read_arrivals(self._stream)
        late = [
            w
            for w in range(self.num_workers)
            if w != self.worker_index and reached[w] < self._sequence
        ]
        named = worker_list(late) if late else "a worker"
        reason = (
            f"it waited {timeout:g} s in {what} (cross-worker collective #{self._sequence}) "
            f"for {named}, which did not arrive"
        )
        self.announce(reason, late=tuple(late))
        return ReplicaSyncError(
            f"worker {self.worker_index} waited {timeout:g} s in {what} for {named}, which did "
            "not arrive; a worker is stuck or skips this collective (raise sync_timeout or "
            "timeout_seconds if it is just slow). This MultiWorkerMirroredStrategy makes no "
            "more cross-worker calls",
            merge_number=None,
            workers=late,
        )

    def _arrive(self) -> None:
        """Count this collective; with a timeout in force, tell the peers it was reached."""
        self._sequence += 1
        if self.default_timeout is not None or collective_timeout.get() not in (None, math.inf):
            self._tell_arrival()  # (``_timeout()``, read in place: every collective comes here)

    def _tell_arrival(self) -> None:
        self._side.arrivals.read()  # keeps the peers' messages from piling up
        self._tell(_ARRIVAL)

    def _tell(self, tag: int, inside: bool = False) -> None:
        """Tell the peers, on the ``_Arrivals`` communicator, where this worker is in this
        cluster's stream of collectives: ``tag`` says what happened there."""
        side = self._side
        message = np.array([side.identity, self._stream, self._sequence, inside], np.int64)
        side.send_all(message, tag, side.arrivals.comm)

    def tell_left(self, inside: bool = False) -> None:
        """Tell the peers, once, that this worker left this duplicate's stream of collectives
        before the workers agreed on its end (a dataset pass ended early on this worker: a
        ``break``, a cancellation), and where: the last collective it began, and whether it
        left that one's wait (``inside``) before it completed. A peer waiting in one it will
        not make then raises (``_peer_left_stream``) instead of waiting for ever."""
        if self._told_left:
            return
        self._told_left = True
        self._tell(_LEFT, inside)

    def tell_left_if_dropped(self, owner: object, ended: list[bool]) -> weakref.finalize[..., Any]:
        """Have ``tell_left`` called once ``owner`` (a dataset pass) is collected unless
        ``ended[0]`` (the workers agreed on its end) by then: at the next wait or collective
        point on the loop's thread, never in the finalizer (any thread, any moment). For a
        pass that nothing closes (a ``break`` out of it with no prefetching)."""
        return weakref.finalize(owner, _tell_when_dropped, self, ended)

    async def _peer_left_stream(self, what: str, test: Callable[[], bool]) -> bool:
        """In a wait on a duplicate (``test``: its request's), whether the collective completed
        after all; ``False`` while no peer has left this stream, or one left after it made
        its part of this collective.

        Raises:
            ReplicaSyncError: a peer left this stream before it made its part of the
                collective waited for (or left its wait and it did not complete soon after),
                naming the peer; the stream ends here, and nothing else is affected.
        """
        side = self._side
        side.arrivals.read()
        left = side.left.get(self._stream)
        if not left:
            return False
        stopped = [
            (worker, sequence, inside)
            for worker, (sequence, inside) in left.items()
            if sequence < self._sequence or (sequence == self._sequence and inside)
        ]
        if not stopped:
            return False  # they made their part of this one: it completes
        if all(sequence == self._sequence for _, sequence, _ in stopped) and (
            await _finishes_soon(test)
        ):
            return True  # their part was on its way when they left
        workers = [worker for worker, _, _ in stopped]
        named = worker_list(workers)
        raise ReplicaSyncError(
            f"{named} left {self._stream_name} (its iteration ended early there: a break, a "
            f"close before the end, a cancellation or an error) while worker "
            f"{self.worker_index} waits in {what}, which {named} will not make: every worker "
            "must take as many elements from a distributed dataset as the others, or stop at "
            "the same point. This pass ends here; the strategy goes on working",
            merge_number=None,
            workers=tuple(workers),
        )

    # -- calls --------------------------------------------------------------------------

    def call(self, what: str) -> _Call:
        """Hold this communicator for a call of this task (``what``), from its first
        collective to its last: ``async with workers.call("Checkpoint.save"): ...``.

        Another task's call waits until this one has ended, so the collectives of two calls
        never interleave, and calls pair with the other workers' in the order they reached
        it. A collective made outside any call or ``run()`` is a call of its own. Within a
        ``run()``'s step, or within this task's call already, nothing more is held.

        Raises:
            RuntimeError: another task's ``run()`` is in progress on this worker.
            ClusterBroken: the cluster is broken, or broke while the call waited its turn.
        """
        return _Call(self, what)

    async def _enter_call(self, what: str) -> None:
        """Take the turn of calls for ``what``, after any call in progress (``call``)."""
        self.check(what)
        self._check_in_step(what)
        await self._calls.acquire()  # (at once when no call is in progress)
        if self._side.failure is not None:  # it broke meanwhile
            self._calls.release()
            self.check(what)

    @property
    def in_call(self) -> bool:
        """Whether the calling task belongs to a call that holds this cluster now."""
        call = current_call.get()
        return call is not None and call.holding and call.workers is self

    @property
    def calling(self) -> bool:
        """Whether a call is in progress (``call``), or waits for its turn."""
        return self._calls.busy

    async def hold(self) -> bool:
        """Take the turn of calls for a step (a ``run()``, or an agreement standing in for
        one, which refuses other tasks' calls meanwhile), once a call of another task in
        progress has ended; whether it was taken (not when this task's own call holds it: a
        ``run()`` in a manager's ``init_fn``, say). ``let_go()`` gives it back."""
        if self.in_call:
            return False
        await self._calls.acquire()
        return True

    def let_go(self) -> None:
        """Give back the turn of calls (``hold``, ``call``): the next call waiting takes it."""
        self._calls.release()

    async def _begin(self, what: str) -> None:
        """Take this communicator's turn for one collective (of one or more messages), and
        count it; the caller gives it back with ``_end()`` when it is done. Outside the step
        in progress and any call of this task, the collective is a call of its own.

        No side-channel test here, before the collective is posted: MPI progress made then
        takes a peer's early data in as unexpected messages (measured: a 64 MiB reduction ran
        1.4x slower). A failure announced meanwhile is found by the wait.
        """
        if self._told_left:
            raise RuntimeError(
                f"{what} was refused: worker {self.worker_index} left {self._stream_name} (a "
                "wait in it ended early: cancelled, or another worker left it), whose "
                "collectives cannot go on across workers (MPI cannot cancel the one it left): "
                "start a new pass with aiter(), on every worker"
            )
        single = False
        if (current_step.get() is not self.step or self.step is None) and not self.in_call:
            await self._enter_call(what)
            single = True
        try:
            if self._side.failure is not None or not self._turn.take_now():
                self.check(what)
                await self._turn.acquire()
                if self._side.failure is not None:
                    self._turn.release()
                    self.check(what)
            if self._idup is not None:
                try:
                    await self._await_idup()
                except BaseException:
                    self._turn.release()
                    raise
        except BaseException:
            if single:
                self._calls.release()
            raise
        self._single = single
        self._in_step = self.in_step
        self._arrive()

    def _begin_now(self) -> bool:
        """``_begin`` without suspending, for the common case: a collective of the step in
        progress, from its own tasks, with the turn free, nothing broken and the communicator
        made. Whether it began; else the caller awaits ``_begin``, which sorts out the rest.
        (Every collective of a step comes here first: one coroutine less per collective.)"""
        step, turn = self.step, self._turn
        if (
            step is None
            or turn.busy
            or current_step.get() is not step
            or self._idup is not None
            or self._side.failure_box[0] is not None
        ):
            return False
        turn.busy = True
        self._in_step = True
        self._arrive()
        return True

    def _end(self) -> None:
        """Give back what ``_begin`` took."""
        self._turn.release()
        if self._single:
            self._single = False
            self._calls.release()

    @property
    def in_step(self) -> bool:
        """Whether the calling task belongs to the step in progress (a ``run()``'s replicas,
        its ``merge_fn``s and the tasks they start)."""
        return self.step is not None and current_step.get() is self.step

    def _check_in_step(self, what: str) -> None:
        """Refuse a collective from outside the step in progress (``step``), if any, unless
        it belongs to the call that the step waits for (``hold``).

        Raises:
            RuntimeError: another task's ``run()`` is in progress on this worker.
        """
        if self.step is not None and current_step.get() is not self.step and not self.in_call:
            raise RuntimeError(
                f"{what} was called on worker {self.worker_index} from another task while a "
                "run() is in progress there; every worker must make its collectives in the "
                "same order, which a collective beside a run() would not keep (it could pair "
                "with one of the run()'s on another worker): await the run() first"
            )

    def _timeout(self) -> float | None:
        """The timeout in force for a wait: the call's, else the strategy's ``sync_timeout``."""
        return collective_timeout.get() or self.default_timeout

    # -- collectives ----------------------------------------------------------------------

    async def allreduce(
        self, op: str, send: Any, out: np.ndarray[Any, Any], layout: str = ""
    ) -> None:
        """Reduce over workers into ``out`` (C-contiguous); ``send`` is an array, a list of
        this worker's parts (its replicas' arrays, combined here first, on the loop's thread:
        for small data), or ``None`` for in place.

        ``op``: ``"sum"``, ``"max"``, ``"min"`` or ``"prod"`` (``max``/``min`` of bools are any
        and all). ``layout`` says what ``out`` holds when its shape alone does not (the leaves
        packed in it, or where it is in the value reduced). Data that fits in the record
        comes with it and is reduced on every worker from the gathered records, in worker
        order, so the results are the same everywhere; larger data follows in an
        ``Iallreduce``.

        Raises:
            WorkersDisagree: the workers passed different ops, dtypes, shapes or layouts, or
                made another collective (on every worker alike; nothing was reduced).
        """
        what = reductions_called.get()
        plan = self._plans.get((op, out.dtype, out.shape, layout))
        if plan is None:
            plan = self._plan(op, out, layout)
        if not self._begin_now():
            await self._begin(what)
        try:
            if isinstance(send, list):  # straight into the record, or into ``out``
                try:
                    _combine(plan.ufunc, send, plan.slot if plan.parts else out)
                except Exception as error:  # (an overflow where NumPy's errstate or warnings
                    # filter raise): the others meet a refusal in place of this record, in step
                    with contextlib.suppress(RuntimeError):  # (a peer's failure meanwhile:
                        # the next call says so, as ``ReductionEngine.refuse`` has it)
                        await self._refuse_begun(self._call_named(what), error)
                    raise
                send = None
            elif plan.parts:
                plan.slot[...] = out if send is None else send
            # ``_exchange``, written out here and in ``barrier`` (the two collectives of an
            # 8-byte step): a coroutine less each.
            header = self._called(plan.header)
            # (a disagreement says "all_reduce" on every worker alike, whatever each called)
            if not self._exchanged("all_reduce", header):
                await self._wait(self._exchange_request, what)
                self._check_agreed("all_reduce", header)
            if plan.parts:
                _combine(plan.ufunc, plan.parts, out)
                return
            if out.dtype.isnative:
                source = self.mpi.IN_PLACE if send is None else send
                post = functools.partial(
                    self._comm.Iallreduce, source, out, self._op(op, out.dtype)
                )
                await self._move(post, what, out.nbytes)
            else:  # MPI reduces numbers in this machine's byte order: a copy in it
                work = in_native_order(out if send is None else send)
                post = functools.partial(
                    self._comm.Iallreduce, self.mpi.IN_PLACE, work, self._op(op, work.dtype)
                )
                await self._move(post, what, out.nbytes)
                out[...] = work
        finally:
            self._end()

    async def allgather_rows(
        self, local: np.ndarray[Any, Any], where: str = "", what: str = "all_gather"
    ) -> np.ndarray[Any, Any]:
        """Concatenate the workers' arrays along axis 0, in worker order (uneven rows).
        ``where``: where the array is in the value gathered, which the workers compare;
        ``what``: the name its waits and errors give it.

        Raises:
            WorkersDisagree: the workers' arrays differ in dtype or in their other dimensions,
                or a worker made another collective.
        """
        return (await self._allgather(local, where, what))[0]

    async def allgather_bytes(self, data: bytes, what: str = "all_gather") -> list[bytes]:
        """Every worker's ``data``, in worker order (of any lengths); ``what`` names the wait.

        Raises:
            WorkersDisagree: a worker made another collective.
        """
        gathered, rows = await self._allgather(np.frombuffer(data, np.uint8), "", what)
        ends = itertools.accumulate(rows)
        return [gathered[end - size : end].tobytes() for size, end in zip(rows, ends, strict=True)]

    async def _allgather(
        self, local: np.ndarray[Any, Any], where: str, what: str
    ) -> tuple[np.ndarray[Any, Any], list[int]]:
        """``allgather_rows``, and how many rows each worker gave."""
        dtype = local.dtype
        local = in_native_order(local)  # what MPI moves; the result is in ``dtype`` again
        header = _header_of(
            f"all_gather of {local.dtype} rows of {local.shape[1:]}" + _named(where)
        )
        await self._begin(what)
        try:
            self._record_words[_HEADER_WORDS] = local.shape[0]
            await self._exchange(what, self._called(header))
            rows: list[int] = self._gathered_words[:, _HEADER_WORDS].tolist()
            row_bytes = math.prod(local.shape[1:]) * local.itemsize
            out = np.empty((sum(rows), *local.shape[1:]), local.dtype)
            counts = [r * row_bytes for r in rows]
            displacements = [sum(counts[:w]) for w in range(self.num_workers)]
            recv = [raw_bytes(out), (counts, displacements), self.mpi.BYTE]
            post = functools.partial(
                self._comm.Iallgatherv, [raw_bytes(local), self.mpi.BYTE], recv
            )
            await self._move(post, what, out.nbytes)
        finally:
            self._end()
        return out.astype(dtype, copy=False), rows

    async def broadcast(
        self, value: np.ndarray[Any, Any] | None, root: int, where: str = "", matching: bool = True
    ) -> np.ndarray[Any, Any]:
        """Worker ``root``'s ``value`` on every worker (a new array; the root's is copied).
        ``where``: as for ``allgather_rows``. With ``matching``, every worker's ``value`` must
        have the root's shape and dtype (the workers compare them: a variable's first value, a
        write); without, the others' values are ignored (they may pass ``None``), and the root's
        shape and dtype travel with its record.

        Raises:
            WorkersDisagree: with ``matching``, a worker's ``value`` differs from the root's in
                shape or dtype; a worker made another collective.
        """
        if not matching:
            return await self._broadcast_any(value, root, where)
        assert value is not None
        dtype = value.dtype
        value = in_native_order(value)  # what MPI moves; the result is in ``dtype`` again
        header = _header_of(
            f"broadcast from worker {root} of {value.dtype} {value.shape}" + _named(where)
        )
        small = value.nbytes <= _INLINE_BYTES
        await self._begin("broadcast")
        try:
            if small and self.worker_index == root:
                self._record[_HEADER_BYTES : _HEADER_BYTES + value.nbytes] = raw_bytes(value)
            await self._exchange("broadcast", header)
            if small:  # it came with the root's record
                data = self._gathered[root, _HEADER_BYTES : _HEADER_BYTES + value.nbytes]
                view: np.ndarray[Any, Any] = data.view(value.dtype).reshape(value.shape)
                return view.astype(dtype)  # a copy, in the caller's byte order
            out = np.empty_like(value)
            source = value if self.worker_index == root else None

            def post() -> Any:  # the root's copy too: on the thread where the data moves
                if source is not None:
                    np.copyto(out, source)
                return self._comm.Ibcast([raw_bytes(out), self.mpi.BYTE], root)

            await self._move(post, "broadcast", out.nbytes)
        finally:
            self._end()
        return out.astype(dtype, copy=False)

    async def _broadcast_any(
        self, value: np.ndarray[Any, Any] | None, root: int, where: str
    ) -> np.ndarray[Any, Any]:
        """``broadcast`` without ``matching``. The root puts its array's description (dtype
        and shape: ``_described``) in its record as ``broadcast_bytes`` does, and the data
        after it if it fits; what does not fit follows by ``Ibcast``."""
        header = _header_of(f"broadcast from worker {root} of any array" + _named(where))
        sending = self.worker_index == root
        mine: bytes | None = None  # the description, on the root
        if sending:
            assert value is not None
            dtype, mine = value.dtype, _described(value.dtype, value.shape)
            data = in_native_order(value)  # what MPI moves; the result is in ``dtype`` again
        await self._begin("broadcast")
        try:
            if mine is not None:
                self._put(mine)
                at = _data_at(_PUT_AT + len(mine))
                if at + data.nbytes <= _RECORD_BYTES:
                    self._record[at : at + data.nbytes] = raw_bytes(data)
            await self._exchange("broadcast", header)
            said = await self._taken(mine, root)
            at = _data_at(_PUT_AT + len(said))
            if not sending:
                dtype, shape = _description(said)
                data = np.empty(shape, _native_order(dtype))
            if at + data.nbytes > _RECORD_BYTES:  # the data follows
                post = functools.partial(self._comm.Ibcast, [raw_bytes(data), self.mpi.BYTE], root)
                await self._move(post, "broadcast", data.nbytes)
            elif not sending:
                raw_bytes(data)[:] = self._gathered[root, at : at + data.nbytes]
        finally:
            self._end()
        if sending:  # a copy of the root's, in its byte order
            return np.array(data, dtype=dtype, copy=True)
        return data.astype(dtype, copy=False)

    async def broadcast_bytes(self, data: bytes, root: int, what: str = "broadcast") -> bytes:
        """Worker ``root``'s ``data`` on every worker (the others pass anything); ``what``
        names the wait (what the others wait for: the chief's write of a checkpoint, say).

        Raises:
            WorkersDisagree: a worker made another collective.
        """
        header = _header_of(f"broadcast of bytes from worker {root}")
        sending = self.worker_index == root
        await self._begin(what)
        try:
            if sending:
                self._put(data)
            await self._exchange(what, header)
            return await self._taken(data if sending else None, root, what)
        finally:
            self._end()

    def _put(self, data: bytes) -> None:
        """Put ``data`` in this worker's record for a broadcast from it, its size first: all of
        it, or only the size when it does not fit (``_taken`` then sends it by ``Ibcast``)."""
        self._record_words[_HEADER_WORDS] = len(data)
        if _PUT_AT + len(data) <= _RECORD_BYTES:
            self._record_bytes[_PUT_AT : _PUT_AT + len(data)] = data

    async def _taken(self, data: bytes | None, root: int, what: str = "broadcast") -> bytes:
        """Once the records are exchanged, the bytes that worker ``root`` put in its record
        (``_put``; ``data``: the same, on the root itself), from its record or by ``Ibcast``
        when they did not fit; the caller holds the turn."""
        size = int(self._gathered_words[root, _HEADER_WORDS])
        if _PUT_AT + size <= _RECORD_BYTES:  # they came with the root's record
            if data is not None:
                return data
            return self._gathered[root, _PUT_AT : _PUT_AT + size].tobytes()
        buffer = bytearray(size) if data is None else bytearray(data)
        await self._move(functools.partial(self._comm.Ibcast, buffer, root), what, size)
        return bytes(buffer)

    async def refuse_in_step(self, what: str, error: BaseException) -> None:
        """Meet the other workers' next collective with a record saying that this worker's
        ``what`` refused its arguments (``error``), instead of the collectives it would have
        made: they raise ``WorkersDisagree`` naming this worker and its error, and every worker
        has made one collective, so they stay in step. The caller then raises ``error``, which
        is the cluster's ``refused`` from then on: no failure of this worker, since every
        worker raises in step (when every worker refused alike, each raises its own error).

        Nothing is sent for an error that refuses no arguments (one that is not a
        ``TypeError``, ``ValueError`` or ``RuntimeError``: a closed strategy's ``run()``, a
        ``ReplicaSyncError``), for a ``WorkersDisagree`` (raised on every worker in step
        already), or once the cluster is broken.

        Raises:
            ReplicaSyncError: a peer failed, or the timeout in force passed.
            ClusterBroken: the cluster broke while this worker waited for its turn.
        """
        if isinstance(error, (TypeError, ValueError, RuntimeError)):
            await self._refuse(what, error)

    async def refuse_own_part(self, what: str, error: BaseException) -> None:
        """``refuse_in_step`` for any ``error`` raised by this worker's own part of ``what``
        before its collective (its replicas' sum, where an overflow raises under NumPy's
        ``errstate``), named as the call in progress, if any: the others raise
        ``WorkersDisagree`` naming this worker at once, rather than wait for a collective it
        will not make.

        Raises:
            ReplicaSyncError: as ``refuse_in_step``.
            ClusterBroken: as ``refuse_in_step``.
        """
        await self._refuse(self._call_named(what), error)

    async def _refuse(self, what: str, error: BaseException) -> None:
        if self.broken or error is self.refused or isinstance(error, WorkersDisagree):
            return  # (refused in step already: where this worker's own part raised it)
        await self._begin(what)
        try:
            await self._refuse_begun(what, error)
        finally:
            self._end()

    async def _refuse_begun(self, what: str, error: BaseException) -> None:
        """``refuse_in_step`` within the collective ``what`` begun (the turn taken), for any
        ``error`` this worker met before its record went out."""
        header = _header_in_full(f"{what} refusing its arguments: {error_line(error)}")
        with contextlib.suppress(WorkersDisagree):  # the others raise it; this worker its own
            await self._exchange(what, header)
        self.refused = error

    async def barrier(self, what: str, detail: str = "") -> None:
        """Wait until every worker has reached this point (``what``: its name, the same on
        every worker; ``detail``: more that the workers compare, shown after it).

        Raises:
            WorkersDisagree: a worker made another collective, or gave another ``detail``.
        """
        header = _header_in_full(what + detail)
        if not self._begin_now():
            await self._begin(what)
        try:
            if not self._exchanged(what, header):  # ``_exchange``, written out (``allreduce``)
                await self._wait(self._exchange_request, what)
                self._check_agreed(what, header)
        finally:
            self._end()

    async def agree(self, what: str, description: str) -> None:
        """Check that every worker makes the same call ``what`` (one of several collectives:
        a ``strategy.reduce`` of a nested value, say) on the same kind of value, before any of
        its collectives moves data: one exchange of the records, whose header is a checksum of
        ``description`` (what the whole call is, named first: its op, axis, structure, and each
        leaf's dtype and shape), its start shown in the error. Once they agree, every worker
        makes the same collectives after it, so a call cannot end on one worker and go on on
        another.

        Raises:
            WorkersDisagree: a worker described another call, or made another collective (on
                every worker alike; nothing was moved).
        """
        header = self._called(_header_in_full(description))
        await self._begin(what)
        try:
            await self._exchange(what, header)
        finally:
            self._end()

    def blocking(self, what: str, fn: Callable[[Any, Callable[[Any, object], None]], Any]) -> Any:
        """Run ``fn(communicator, wait)`` in turn, now, on this thread: it makes the same
        non-blocking MPI calls on every worker and ``wait(request, held)``s for each request,
        which tests the side channel and keeps the timeout as the async collectives do
        (``held``: what holds the request's buffers, kept with it if the wait is left).

        For synchronous reads that must be collective (a sync-on-read variable's global value,
        a new variable's first read). ``what`` names the read, with the dtype and shape it
        moves: the workers compare it first. An exception that interrupts it (Ctrl-C, a signal
        handler's) counts as this worker failing, as a cancelled async wait does.

        Raises:
            RuntimeError: another collective is in progress on this worker, or another task's
                call or ``run()`` (await it first).
            ClusterBroken: the cluster is broken.
            ReplicaSyncError: a peer failed, or the timeout in force passed.
            WorkersDisagree: the workers made another read, or another collective.
        """
        self.check(what)
        self._check_in_step(what)
        if self._turn.busy or (self._calls.busy and not self.in_step and not self.in_call):
            raise RuntimeError(
                f"{what} needs a collective, but another cross-worker call or collective is in "
                "progress on this worker; read it once that has finished (await it first)"
            )
        failure = self._peer_failure(what)
        if failure is not None:
            raise self._raised(failure)
        try:
            if self._idup is not None:
                self._wait_here(self._idup, self._idup_what)
                self._idup_done()
            self._in_step = self.in_step
            self._arrive()
            header = _header_in_full(what)
            if not self._exchanged(what, header):
                self._wait_here(self._exchange_request, what)
                self._check_agreed(what, header)
            return fn(self._comm, lambda request, held: self._wait_here(request, what, held))
        except (WorkersDisagree, ReplicaSyncError):
            raise  # every worker raises it alike, or a peer's failure: nothing to tell
        except BaseException as exc:  # interrupted (Ctrl-C, a signal handler's exception), or
            # MPI failed: as a cancelled ``_wait``, this worker fails (MPI cannot cancel a
            # request), and its peers are told.
            if self._primary:
                self._announce_interrupted(what, exc, waiting=False)
            raise

    async def read(self, what: str, post: Callable[[Any], Any], nbytes: int) -> None:
        """``blocking``'s twin for async code, for a read whose data moves in one request: the
        workers compare ``what``, then ``post(communicator)`` makes the non-blocking MPI call
        (of ``nbytes``), awaited as every collective's data is: the side channel tested, the
        timeout kept, a cancelled wait this worker's failure, told to the peers.

        Raises:
            RuntimeError: another task's ``run()`` is in progress on this worker.
            ClusterBroken: the cluster is broken.
            ReplicaSyncError: a peer failed, or the timeout in force passed.
            WorkersDisagree: the workers made another read, or another collective.
        """
        await self._begin(what)
        try:
            await self._exchange(what, _header_in_full(what))
            await self._move(functools.partial(post, self._comm), what, nbytes)
        finally:
            self._end()

    def duplicate(self, name: str) -> Workers:
        """A cluster of the same workers on a new duplicate communicator, for an independent
        stream of collectives (``name``: what it is for, such as ``"a dataset pass"``).

        Its collectives are ordered among themselves only. It shares this cluster's failure
        state (and side channel); a wait on it that is cancelled abandons it without failing
        the workers. ``close()`` it after.

        Collective, without blocking: the duplicate is made by a non-blocking ``Idup``, which
        its first collective waits for as it waits for any, testing the side channel and
        keeping the timeout. So a worker that never starts the stream (a loop over a dataset
        on the chief only, say) leaves the others waiting in that first collective, where a
        failure or ``sync_timeout`` ends the wait, not in MPI.
        """
        _free_retired()
        self._side.arrivals.read()  # what earlier passes' peers said of them, read at last
        twin = object.__new__(Workers)
        for slot in Workers.__slots__[1:]:  # all but ``__weakref__``
            setattr(twin, slot, getattr(self, slot))
        # From the side channel's communicator, which carries no collectives that could be
        # under way (another task's) when this one is called.
        twin._comm, twin._idup = self._side.comm.Idup()
        twin._idup_what = f"the start of {name}"
        twin._calls = _Turn()
        twin._turn = _Turn()
        twin._single = False
        twin._in_step = False
        twin._persistent = []
        twin._left = []
        twin._release = twin._finalizer()
        twin._primary = False
        twin.step = None  # its collectives are ordered among themselves, beside any step
        twin._sequence = 0
        self._side.streams += 1
        self._side.limiter.total_tokens = self._side.streams + 1
        twin._stream = self._side.streams  # the same on every worker: made in the same order
        twin._stream_name = name
        twin._told_left = False
        self._side.members[twin._stream] = twin
        if self._timeout() is not None:
            twin._tell_arrival()  # collective 0: its start, which its first collective awaits
        return twin

    async def _await_idup(self) -> None:
        """Wait until this duplicate's communicator exists on every worker (``duplicate``).

        Raises:
            ReplicaSyncError: a peer failed, or the timeout in force passed.
        """
        await self._wait(self._idup, self._idup_what)
        self._idup_done()

    def _idup_done(self) -> None:
        self._idup = None
        self._records()

    @property
    def is_open(self) -> bool:
        """Whether this cluster's communicator is still in use (not ``close``d)."""
        return self._release.alive

    def close(self) -> None:
        """Give this cluster's collectives' communicator back (not the shared side channel).

        Otherwise that happens once the object is collected: a strategy dropped, with its
        variables and datasets, gives its communicators back to MPI (which has a few thousand).
        Either way they are freed at the next collective point (a new strategy or dataset
        pass) or at exit, on the event loop's thread: never from a finalizer, which may run
        on any thread at any moment.
        """
        self._release()
        if not self._primary:
            self._side.reached.pop(self._stream, None)
            self._side.left.pop(self._stream, None)

    # -- helpers --------------------------------------------------------------------------

    def _finalizer(self) -> weakref.finalize[..., Workers]:
        """What gives this cluster's communicator back once the cluster is closed or gone
        (``_free``), unless messages may still be on their way to it."""
        return weakref.finalize(
            self,
            _retire,
            self.mpi,
            self._comm,
            persistent=self._persistent,
            made=self._idup,
            left=self._left,
            failure=self._side.failure_box,
        )

    def _records(self) -> None:
        """This worker's record, the room for every worker's, and their exchange (each
        communicator has its own: a dataset pass's collectives run alongside the step's).
        Made at the same point on every worker: the persistent request's making is ordered
        as a collective is."""
        self._gathered = np.zeros((self.num_workers, _RECORD_BYTES), np.uint8)
        self._gathered_words = self._gathered.view("<i8")
        self._checksums = self._gathered_words[:, 0]
        self._record = self._gathered[self.worker_index]  # sent from where it is gathered
        self._record_bytes = self._record.data
        self._record_words = self._record.view("<i8")
        self._data_sent = None
        self._word_sent = 0
        self._plans = {}
        # The records' exchange, made once (persistent requests: the buffers never change,
        # and starting them costs a fraction of posting new ones), freed with the communicator.
        self._exchange_request = _RecordExchange(self.mpi, self._comm, self._gathered)
        self._persistent.extend(self._exchange_request.requests)

    def _called(self, header: _Header) -> _Header:
        """``header`` as a call's reduction or gather sends it (``strategy.reduce``, ...): named
        after the call, so that a call made on some workers only (a reduce on the chief alone)
        meets another worker's reduction in a ``run()`` as a disagreement naming the call,
        not as a match that would combine the two. (Not a variable's first sync, nor other
        broadcasts, which every worker may make inside a call or out of one alike.)"""
        call = current_call.get()
        if call is None or not call.holding or call.workers is not self:
            return header
        words = f"{call.what}: {header.words}"
        return _header_in_full(words) if len(header.data) > _HEADER_BYTES else _header_of(words)

    async def _exchange(self, what: str, header: _Header) -> None:
        """Send this worker's record (``header``, then what the caller wrote after it) and
        gather every worker's; the caller holds the turn.

        Raises:
            WorkersDisagree: the workers' headers differ (found alike on every worker).
        """
        if not self._exchanged(what, header):
            await self._wait(self._exchange_request, what)
            self._check_agreed(what, header)

    def _exchanged(self, what: str, header: _Header) -> bool:
        """Start the records' exchange, this worker's with ``header``; whether it completed at
        once (every peer's record was in), the headers then checked. Else the caller waits
        for ``_exchange_request`` and checks them (``_check_agreed``).

        Raises:
            WorkersDisagree: as ``_exchange``.
        """
        # The checksum's word says too whether the collective belongs to a run()'s step:
        # workers that differ there are out of step (``_disagree``).
        in_step = self._in_step  # (``_begin``'s)
        if in_step:
            word, data = header.checksum | _IN_STEP, header.in_step
        else:
            word, data = header.checksum, header.data
        if data is not self._data_sent:  # (the record keeps a header until another comes)
            self._record_bytes[: len(data)] = data
            self._data_sent = data
            self._word_sent = word
        if not self._exchange_request.started():
            return False
        if self._checksums.tolist().count(word) != self.num_workers:
            raise self._disagree(what)  # (``_check_agreed``, written out)
        if not in_step or self.default_timeout is not None or collective_timeout.get() is not None:
            self._check_nobody_gave_up(what)
        return True

    def _check_agreed(self, what: str, header: _Header) -> None:
        """Once the records' exchange has completed, check that every worker sent ``header``.

        Raises:
            WorkersDisagree: as ``_exchange``.
            ReplicaSyncError: under a timeout, a peer gave up on this worker meanwhile.
        """
        if self._checksums.tolist().count(self._word_sent) != self.num_workers:
            raise self._disagree(what)
        if (
            not self._in_step
            or self.default_timeout is not None
            or collective_timeout.get() is not None
        ):
            self._check_nobody_gave_up(what)

    def _disagree(self, what: str) -> WorkersDisagree:
        """The error of a collective whose workers' records differ. Where some workers made it
        in a ``run()``'s step and others outside any (a call made on some workers only, or a
        ``run()`` on some), the workers no longer pair their collectives: every worker sees
        the same records, so each marks the cluster broken alike, and later calls are refused
        instead of pairing one worker's step with another's next one."""
        words = self._checksums.tolist()
        in_runs = [w for w, word in enumerate(words) if word & _IN_STEP]
        if not in_runs or len(in_runs) == len(words):
            return _disagreement(what, self._gathered)
        others = [w for w in range(len(words)) if w not in in_runs]
        apart = f"{worker_list(in_runs)} made it in a run(), {worker_list(others)} outside one"
        if self._side.failure is None:
            self._side.failure = f"the workers fell out of step in {what} ({apart})"
        return _disagreement(what, self._gathered, apart)

    def _check_nobody_gave_up(self, what: str) -> None:
        """Under a timeout, once this worker's record met every peer's: raise the failure a
        peer announced meanwhile. A peer that timed out waiting for this worker had already
        sent its record (MPI cannot take it back), so the exchange completes here; this
        worker must raise too rather than go on alone (and, say, write what the others did
        not). A peer whose program ended after this collective is no failure of it.

        Raises:
            ReplicaSyncError: the failure a peer announced.
        """
        failure = self._peer_failure(what)
        if failure is None:
            return
        if self._side.peer_left or self._peer_went_past():
            self._defer(failure)
        else:
            raise self._raised(failure)

    def _peer_went_past(self) -> bool:
        """Whether the peer whose failure notice came had made the collective in progress
        here before it failed (it began a later one, or left this one complete): its data
        for it was sent, so it completes here, and this worker raises at its next call
        instead (``_defer``). Else the peer stopped before it, or inside it, and it cannot
        complete."""
        at = self._side.peer_at.get(self._stream)
        if at is None:
            return False
        sequence, inside = at
        return sequence > self._sequence or (sequence == self._sequence and not inside)

    def _defer(self, failure: ReplicaSyncError) -> None:
        """Keep a peer's ``failure`` for this worker's next cross-worker call (``check``
        raises it, then ``ClusterBroken``), or for none if its program ended: the collective
        in progress completed on every worker, so it succeeds here as it did there."""
        if not self._side.peer_left:
            self._side.deferred = failure

    def _plan(self, op: str, out: np.ndarray[Any, Any], layout: str) -> _Plan:
        """How this worker all-reduces ``out``: its header, and for data small enough to
        travel with it, its place in this worker's record and every worker's part of the
        gathered records (views of ``out``'s dtype, in this machine's byte order, and
        shape)."""
        if out.dtype.kind == "b" and op not in _BOOL_OPS:
            raise ValueError(f"all_reduce: {op} is not defined on bool arrays across workers")
        if len(self._plans) >= _PLANS:
            self._plans.clear()
        header = _header_of(f"all_reduce ({op}) of {out.dtype.name} {out.shape}" + _named(layout))
        if out.nbytes > _INLINE_BYTES:
            plan = _Plan(header, _LOCAL_OPS[op], self._record[:0], [])
        else:  # in the records, in this machine's byte order whatever ``out``'s
            end = _HEADER_BYTES + out.nbytes
            native = _native_order(out.dtype)
            slot = self._record[_HEADER_BYTES:end].view(native).reshape(out.shape)
            rows = self._gathered[:, _HEADER_BYTES:end]
            parts = [row.view(native).reshape(out.shape) for row in rows]
            plan = _Plan(header, _LOCAL_OPS[op], slot, parts)
        self._plans[op, out.dtype, out.shape, layout] = plan
        return plan

    def _op(self, op: str, dtype: np.dtype[Any]) -> Any:
        if dtype.kind == "f" and op in _NAN_KEEPING:  # MPI's own may drop a NaN
            return _nan_keeping_op(self.mpi, op)
        name = _BOOL_OPS[op] if dtype.kind == "b" else _REDUCE_OPS[op]
        return getattr(self.mpi, name)

    @contextlib.contextmanager
    def timeout(self, seconds: float | None) -> Iterator[None]:
        """Bound the waits of the collectives made in the block (``None``: as they are)."""
        if seconds is None:
            yield
            return
        token = collective_timeout.set(seconds)
        try:
            yield
        finally:
            collective_timeout.reset(token)


@final
class _SideChannel:
    """What a cluster and its duplicates share: the failure state and the side channel."""

    def __init__(self, mpi: Any, comm: Any, arrivals: _Arrivals, workers: int, me: int) -> None:
        self.mpi = mpi
        self.comm = comm
        self.me = me
        self.arrivals = arrivals
        #: The same on every worker, and another on every other side channel of
        #: ``arrivals``: its arrival messages carry it.
        self.identity = arrivals.join(self)
        #: Why the workers fell out of step (``failure``), in a list the finalizers share.
        self.failure_box: list[str | None] = [None]
        self.peer_left = False  # a peer's program ended (the failure, unless one came first)
        #: The communicators made over this side channel, by number (``Workers._stream``).
        self.members: weakref.WeakValueDictionary[int, Workers] = weakref.WeakValueDictionary()
        #: Where the peer whose failure notice came stopped: per communicator, the last
        #: collective it began and whether it was still inside it.
        self.peer_at: dict[int, tuple[int, bool]] = {}
        #: A peer's failure after a collective that completed here, raised by the next call.
        self.deferred: ReplicaSyncError | None = None
        self.notice = bytearray(_NOTICE_BYTES)
        #: Whether MPI lets any thread call it at any time (``MPI_THREAD_MULTIPLE``): only
        #: then is a large collective's data waited for on a thread (``Workers._move``);
        #: otherwise every wait stays on the thread that runs the loop.
        self.threaded: bool = mpi.Query_thread() >= mpi.THREAD_MULTIPLE
        #: The tokens of the threads that wait for large collectives, one per communicator
        #: made over this side channel (each has one collective under way at most).
        self.limiter = anyio.CapacityLimiter(1)
        #: The large collectives' waits now on a thread: each one's stop and the event it
        #: sets once it has returned, which the exit sets and waits for.
        self.waits: set[tuple[threading.Event, threading.Event]] = set()
        #: Held to test the notice receive: a large collective's wait tests it on a thread of
        #: its own (``Workers._wait_aside``), and MPI forbids two threads to complete one
        #: request at once.
        self.testing = threading.Lock()
        #: Whether a peer's notice came (into ``notice``): every wait then raises its failure.
        self.notice_came = False
        # The posted notice receive (``None`` once a notice came), in a list the finalizer
        # shares: it is withdrawn before the communicator is freed.
        self._receive: list[Any] = [comm.Irecv(self.notice, mpi.ANY_SOURCE, _NOTICE)]
        self.sends: list[Any] = []  # sends not yet known to be complete
        self.workers = workers
        #: Per communicator (0: the strategy's, then its duplicates in the order they were
        #: made), the last collective each peer said it reached: -1 before the peer said
        #: anything of a duplicate, 0 when it started it.
        self.reached: dict[int, list[int]] = {0: [0] * workers}
        #: Per duplicate, the peers that left it early (``Workers.tell_left``): the last
        #: collective each began there, and whether it left that one's wait.
        self.left: dict[int, dict[int, tuple[int, bool]]] = {}
        self.streams = 0  # duplicates made
        #: Frees the communicator once nothing uses this side channel (a strategy, its
        #: variables and its dataset passes all gone), or at exit, before MPI finalizes.
        self.close = weakref.finalize(
            self,
            _retire,
            mpi,
            comm,
            receive=self._receive,
            failure=self.failure_box,
            testing=self.testing,
        )
        _open_channels.add(self)
        _withdraw_at_exit()

    @property
    def failure(self) -> str | None:
        """Why the workers fell out of step, or ``None``."""
        return self.failure_box[0]

    @failure.setter
    def failure(self, why: str) -> None:
        self.failure_box[0] = why

    @property
    def notice_request(self) -> Any:
        """The posted notice receive, or ``None`` once a notice came."""
        return self._receive[0]

    @notice_request.setter
    def notice_request(self, request: Any) -> None:
        self._receive[0] = request

    def send_all(self, data: Any, tag: int, comm: Any = None) -> None:
        """Send ``data`` to every peer on ``comm`` (default: the side channel's)."""
        comm = self.comm if comm is None else comm
        for peer in range(self.workers):
            if peer != self.me:
                self.sends.append(comm.Isend(data, peer, tag))
        if len(self.sends) > 64:
            self.sends = [request for request in self.sends if not request.Test()]

    def leave(self, deadline: float) -> None:
        """At exit: tell every peer that this worker's program ended (unless the workers fell
        out of step already), so one still waiting in a collective raises instead of hanging;
        then see the notices out, until ``deadline`` at most (``time.monotonic()``): MPI must
        not finalize under them."""
        if self.failure is None and self.notice_request is not None:
            notice = {"worker": self.me, "reason": "its program ended", "left": True}
            self.send_all(json.dumps(notice).encode(), _NOTICE)
        while self.sends and time.monotonic() < deadline:
            self.sends = [request for request in self.sends if not request.Test()]

    def read_arrivals(self, stream: int) -> list[int]:
        """Take in every arrival message the peers have sent; the latest collective each
        reached on communicator ``stream``."""
        self.arrivals.read()
        return self.reached.get(stream, [-1] * self.workers)

    def arrived(self, source: int, stream: int, sequence: int) -> None:
        """Peer ``source`` said it reached collective ``sequence`` on ``stream``."""
        reached = self.reached.setdefault(stream, [-1] * self.workers)
        reached[source] = max(reached[source], sequence)

    def stream_left(self, source: int, stream: int, sequence: int, inside: bool) -> None:
        """Peer ``source`` left duplicate ``stream`` early, after beginning its collective
        ``sequence`` (``inside``: and leaving that one's wait). Kept for a duplicate this
        worker still uses, or has yet to make (the peer may leave a pass before a slower
        worker starts it; duplicates are numbered alike on every worker)."""
        member = self.members.get(stream)
        if (member is not None and member.is_open) or stream > self.streams:
            self.left.setdefault(stream, {})[source] = (sequence, inside)


@final
class _Arrivals:
    """Where the side channels made over one communicator tell their peers which collective
    they reached (``Workers._tell_arrival``): a duplicate of it, made with the first strategy
    over it and never freed.

    These messages go out without any failure, so some are still on their way when a strategy
    is dropped; on a communicator that was freed, MPI would hand them to the next one given its
    context (another strategy's, or one of the program's own, as happened to mpi4py's
    ``allreduce``, whose receive failed on a message of another size). Each says whose it is
    (its side channel's ``identity``): one for a channel no longer there is dropped.
    """

    __slots__ = ("_box", "_status", "channels", "comm", "joined", "mpi")

    def __init__(self, mpi: Any, comm: Any) -> None:
        self.mpi = mpi
        self.comm = comm
        #: The live side channels over this communicator, by identity.
        self.channels: weakref.WeakValueDictionary[int, _SideChannel] = (
            weakref.WeakValueDictionary()
        )
        self.joined = 0  # side channels made over it
        self._status = mpi.Status()
        self._box = np.zeros(4, np.int64)  # identity, stream, sequence, left inside it

    @staticmethod
    def of(mpi: Any, communicator: Any) -> _Arrivals:
        """Those of ``communicator``, made now if it has none (collective: every worker
        makes its first strategy over ``communicator`` at the same point)."""
        keyval = _arrivals_keyval(mpi)
        arrivals: _Arrivals | None = communicator.Get_attr(keyval)
        if arrivals is None:
            arrivals = _Arrivals(mpi, communicator.Dup())
            communicator.Set_attr(keyval, arrivals)
        return arrivals

    def join(self, channel: _SideChannel) -> int:
        """Route ``channel``'s arrival messages to it; its identity. Every worker makes its
        strategies over this communicator in the same order, so the identity is the same on
        each: how many channels joined before."""
        identity = self.joined
        self.joined += 1
        self.channels[identity] = channel
        return identity

    def read(self) -> None:
        """Take in every message that has come (arrivals, and passes left early), each to its
        side channel."""
        status, box = self._status, self._box
        while self.comm.Iprobe(self.mpi.ANY_SOURCE, self.mpi.ANY_TAG, status):
            source, tag = status.Get_source(), status.Get_tag()
            self.comm.Recv(box, source, tag)
            identity, stream, sequence, inside = box.tolist()
            channel = self.channels.get(identity)
            if channel is None:
                continue
            if tag == _LEFT:
                channel.stream_left(source, stream, sequence, bool(inside))
            else:
                channel.arrived(source, stream, sequence)


@functools.cache
def _arrivals_keyval(mpi: Any) -> int:
    """The attribute under which a communicator keeps its ``_Arrivals``."""
    keyval: int = mpi.Comm.Create_keyval()
    return keyval


@final
class _RecordExchange:
    """Every worker's record gathered into every worker's rows of ``gathered`` (this worker's
    row is its record), as one request: ``started()``, then tested like an MPI request, so the
    waits take it as they take MPI's.

    Up to ``_DIRECT_WORKERS`` workers, each record goes straight to every other worker: a
    persistent send to each and a persistent receive from each, all in flight at once. For
    the worker that arrives last, whose peers' records are there already, that completes
    sooner than MPI's persistent ``Allgather`` (measured, two workers, inside a step: 2.6-3.3
    µs against 3.8-4.6). Beyond, the ``Allgather`` (in place), whose rounds send fewer
    messages.
    """

    __slots__ = ("_incomplete", "requests")

    def __init__(self, mpi: Any, comm: Any, gathered: np.ndarray[Any, Any]) -> None:
        me, workers = comm.Get_rank(), len(gathered)
        if workers > _DIRECT_WORKERS:
            self.requests: list[Any] = [comm.Allgather_init(mpi.IN_PLACE, gathered)]
        else:
            peers = [w for w in range(workers) if w != me]
            receives = [comm.Recv_init(gathered[w], w, _RECORD_TAG) for w in peers]
            sends = [comm.Send_init(gathered[me], w, _RECORD_TAG) for w in peers]
            self.requests = receives + sends
        #: How many of ``requests``, from the first, are not yet seen complete.
        self._incomplete = 0

    def started(self) -> bool:
        """Start the exchange; whether it completed at once (else ``Test`` it until it has)."""
        for request in self.requests:
            request.Start()
        self._incomplete = len(self.requests)
        return self.Test()

    def Test(self) -> bool:
        """Whether every record has come and this worker's has gone."""
        requests, left = self.requests, self._incomplete
        while left:  # from the last: the sends, which complete at once
            if not requests[left - 1].Test():
                self._incomplete = left
                return False
            left -= 1
        self._incomplete = 0
        return True


def _spin(test: Callable[[], bool]) -> bool:
    """``test()`` again and again for up to ``_SPIN_SECONDS``, without leaving the thread:
    MPI moves data only inside ``Test``, and a trip through the event loop between two tests
    costs several microseconds (a peer just behind, or a transfer under way, finishes sooner).
    Whether the request completed."""
    if test():
        return True
    until = time.perf_counter() + _SPIN_SECONDS
    while time.perf_counter() < until:
        if test():
            return True
    return False


def _backed_off(waited: float, busy: float, pause: float) -> float:
    """The pause before a long wait's next test, ``waited`` seconds in, after ``pause``: none
    while busy (``busy`` seconds), then doubling from ``_FIRST_PAUSE`` up to ``_MAX_PAUSE``."""
    if waited > busy:
        return min(_MAX_PAUSE, max(pause * 2, _FIRST_PAUSE))
    return pause


def _finishes(test: Callable[[], bool]) -> bool:
    """Whether a request completes within ``_LEFT_GRACE_SECONDS`` (a peer that ended its
    program made this collective before it left: its data may come after its notice)."""
    until = time.monotonic() + _LEFT_GRACE_SECONDS
    while time.monotonic() < until:
        if test():
            return True
    return False


async def _finishes_soon(test: Callable[[], bool]) -> bool:
    """``_finishes``, giving way to the event loop between tests."""
    until = time.monotonic() + _LEFT_GRACE_SECONDS
    while time.monotonic() < until:
        if test():
            return True
        await anyio.lowlevel.checkpoint()
    return False


#: Communicators given back and not yet freed: ``_free`` with its arguments, appended by
#: finalizers (any thread: ``list.append`` is atomic), called by ``_free_retired``.
_retired: list[Callable[[], None]] = []


def _retire(mpi: Any, comm: Any, **state: Any) -> None:
    _retired.append(functools.partial(_free, mpi, comm, **state))


def _free_retired() -> None:
    """Free the communicators given back since the last call (at a collective point: a new
    strategy, a new dataset pass, the exit), and drop the unanswered agreements to start that
    the other workers have met since (a request that completed goes back to MPI once tested);
    tell the peers of the passes dropped early meanwhile."""
    _tell_untold()
    while _retired:
        _retired.pop()()
    _unanswered[:] = [kept for kept in _unanswered if not kept[0].Test()]


#: The duplicates of dataset passes dropped before the workers agreed on their end, whose
#: peers are still to be told (``Workers.tell_left_if_dropped``), appended by finalizers.
_untold: list[Workers] = []


def _tell_when_dropped(workers: Workers, ended: list[bool]) -> None:
    if not ended[0]:
        _untold.append(workers)


def _tell_untold() -> None:
    while _untold:
        _untold.pop().tell_left()


def _free(
    mpi: Any,
    comm: Any,
    *,
    receive: list[Any] | None = None,
    persistent: Sequence[Any] = (),
    made: Any = None,
    left: Sequence[Any] = (),
    failure: Sequence[str | None] = (None,),
    testing: contextlib.AbstractContextManager[Any] | None = None,
) -> None:
    """Give ``comm`` back to MPI, withdrawing its posted ``receive`` and freeing its
    ``persistent`` requests first (those not under way), nothing after MPI finalized.

    ``comm`` is kept (never freed) where messages may still be on their way to it, which MPI
    would hand to the next communicator given its context: once its workers fell out of step
    (``failure``, the side channel's) or while a request it ``left`` (a wait left early: each
    with what holds its buffers) or a persistent one is still under way. A communicator whose
    making (``made``, its ``Idup``) has not completed, because a worker never made it, is
    kept too: it cannot be freed before it exists. ``testing`` is held while the receive is
    withdrawn: a wait on a thread may test it.
    """
    if mpi.Is_finalized():
        return
    with contextlib.suppress(Exception):
        if made is not None and not made.Test():  # MPI writes the new handle into ``comm``
            _kept.append((comm, (made, *persistent), left))
            return
        with contextlib.nullcontext() if testing is None else testing:
            if receive and receive[0] is not None:
                request, receive[0] = receive[0], None
                request.Cancel()
                request.Wait()
        settled = failure[0] is None and all(request.Test() for request, _ in left)
        for request in persistent:
            if request.Test():  # inactive
                request.Free()
            else:
                settled = False
        if settled:
            comm.Free()
        else:  # requests that may still complete hold their buffers: kept with them, for good
            _kept.append((comm, persistent, left))


#: What ``_free`` keeps: a communicator still being made, or whose requests may still
#: complete, with those requests (each holds its buffer): collected, mpi4py would give their
#: memory back, and MPI would later write into it (the new communicator's handle, a record).
_kept: list[tuple[Any, Sequence[Any], Sequence[Any]]] = []


#: The side channels not yet freed, to withdraw at exit.
_open_channels: weakref.WeakSet[_SideChannel] = weakref.WeakSet()


@functools.cache
def _withdraw_at_exit() -> None:
    """Once, after mpi4py registered its own exit handler (which finalizes MPI): free every
    open side channel at exit first (exit handlers run last registered, first), so no posted
    receive is left when MPI finalizes."""

    def withdraw() -> None:
        channels = list(_open_channels)
        # First the large collectives' waits still on a thread (one that was cancelled, on
        # trio, whose threads do not hold the exit): MPI must not finalize under them.
        waits = [waiting for channel in channels for waiting in list(channel.waits)]
        for stop, _ in waits:
            stop.set()
        deadline = time.monotonic() + _STOP_SECONDS
        for _, done in waits:
            done.wait(max(0.0, deadline - time.monotonic()))
        deadline = time.monotonic() + 1.0  # for every channel's notices together
        _untold.clear()  # passes dropped early: the notice that the program ended says more
        for channel in channels:
            with contextlib.suppress(Exception):
                channel.leave(deadline)
        for channel in channels:
            channel.close()
        _free_retired()

    atexit.register(withdraw)


class _Header(NamedTuple):
    """What a collective is, as every worker sends it first."""

    checksum: int  # of the words: what the workers compare
    # ``_HEADER_BYTES``: the checksum, then the words (cut to fit); or, for a collective
    # that carries no data (``_header_in_full``), the whole record.
    data: bytes
    words: str
    #: ``data`` as a collective of a ``run()``'s step sends it: ``_IN_STEP`` in its word.
    in_step: bytes


def _header(checksum: int, data: bytes, words: str) -> _Header:
    """The header of ``data`` (its record's start, ``checksum`` in its first word)."""
    stepped = (checksum | _IN_STEP).to_bytes(8, "little") + data[8:]
    return _Header(checksum, data, words, stepped)


@functools.lru_cache(maxsize=1024)
def _header_of(words: str) -> _Header:
    """The header of the collective that ``words`` describe (its kind, and the dtype and shape
    of what it carries)."""
    text = words.encode()
    checksum = zlib.crc32(text)
    header = checksum.to_bytes(8, "little") + text[: _HEADER_BYTES - 8]
    return _header(checksum, header.ljust(_HEADER_BYTES, b"\0"), words)


@functools.lru_cache(maxsize=256)
def _header_in_full(words: str) -> _Header:
    """``_header_of(words)`` for a collective that carries no data in the record (an
    agreement, a refusal): words too long for the header go on into the record's data, so
    that a disagreement shows them whole (a refusal's error, a long description), marked by
    ``_CONTINUED`` in the checksum's word."""
    text = words.encode()
    if len(text) <= _HEADER_BYTES - 8:
        return _header_of(words)
    checksum = zlib.crc32(text) | _CONTINUED
    record = checksum.to_bytes(8, "little") + text[: _RECORD_BYTES - 8]
    return _header(checksum, record.ljust(_RECORD_BYTES, b"\0"), words)


def _words_of(record: np.ndarray[Any, Any]) -> str:
    """What a gathered record's header says (in full, with ``_CONTINUED``)."""
    end = _RECORD_BYTES if int(record[:8].view("<i8")[0]) & _CONTINUED else _HEADER_BYTES
    return bytes(record[8:end]).rstrip(b"\0").decode(errors="replace")


class _Plan(NamedTuple):
    header: _Header
    ufunc: np.ufunc  # the op, for data that comes with the records
    slot: np.ndarray[Any, Any]  # where this worker's data goes in its record
    parts: list[np.ndarray[Any, Any]]  # empty: the data goes in an ``Iallreduce`` of its own


def _named(detail: str) -> str:
    """``detail`` (what the shape alone does not say) as the end of a header's words."""
    return f" ({detail})" if detail else ""


def _combine(ufunc: np.ufunc, parts: list[np.ndarray[Any, Any]], out: np.ndarray[Any, Any]) -> None:
    """``out`` = the parts combined by ``ufunc`` in their order (workers', or a worker's
    replicas': the same everywhere, and as the host backend reduces)."""
    if len(parts) == 1:
        np.copyto(out, parts[0])
        return
    ufunc(parts[0], parts[1], out=out)
    if len(parts) > 2:  # (two, the common case, make no slice of the rest)
        for part in parts[2:]:
            ufunc(out, part, out=out)


def _disagreement(what: str, gathered: np.ndarray[Any, Any], apart: str = "") -> WorkersDisagree:
    """The error of a collective whose workers' headers differ, from the gathered records;
    ``apart`` says how the workers fell out of step, if they did."""
    said = [_words_of(record) for record in gathered]
    shown = "; ".join(f"worker {w}: {words}" for w, words in enumerate(said))
    if apart:
        return WorkersDisagree(
            f"{what}: the workers made different collectives ({shown}): {apart}, so they no "
            "longer pair their collectives (a call made on some workers only, or a run() on "
            "some, say); this MultiWorkerMirroredStrategy makes no more cross-worker calls: "
            "make every call on every worker, in the same order, and start the job again",
            said=said,
        )
    refusing = [w for w, words in enumerate(said) if _REFUSING.search(words)]
    if refusing:
        return WorkersDisagree(
            f"{what}: {worker_list(refusing)} refused what it was given ({shown}); nothing "
            "was done on any worker, and the workers are still in step: correct what was "
            "refused",
            said=said,
            workers=refusing,
        )
    # A pack's words name its leaves (``_named`` of the layout "leaves ..."): the same values
    # packed otherwise (another ``options=`` of the call) differ in shape alone.
    packed = any(_PACKED in words for words in said)
    return WorkersDisagree(
        f"{what}: the workers passed different values or made different collectives "
        f"({shown}); every worker must make the same collectives in the same order, with the "
        "same structure, shapes, dtypes and ops" + (_PACKING if packed else ""),
        said=said,
    )


#: In a collective's words: it reduces several leaves packed together.
_PACKED: Final = " (leaves "
#: The end of a disagreement where some worker packed leaves (``_disagreement``).
_PACKING: Final = (
    ", and pack them alike: if every worker passed the same values here, they packed them "
    "differently, so the CommunicationOptions.bytes_per_pack of this call's options= differ "
    "between the workers; pass the same options on every worker"
)


class _Refused(ValueError):
    """Another worker could not make its strategy (raised on every worker that could)."""


def _is_null(mpi: Any, communicator: Any) -> bool:
    """Whether ``communicator`` is ``MPI.COMM_NULL``: what a rank that ``Split`` left out
    (``MPI.UNDEFINED``) gets, and what a communicator becomes once freed."""
    return isinstance(communicator, mpi.Comm) and communicator == mpi.COMM_NULL


def _intracomm(mpi: Any, communicator: Any) -> Any:
    """``communicator`` (default ``COMM_WORLD``), checked.

    Raises:
        TypeError: it is not an mpi4py intracommunicator, or it is ``MPI.COMM_NULL``.
    """
    if communicator is None:
        return mpi.COMM_WORLD
    if _is_null(mpi, communicator):
        raise TypeError(
            "communicator is MPI.COMM_NULL: this rank is not in it (a rank that Split() left "
            "out with MPI.UNDEFINED gets MPI.COMM_NULL), or it was freed; make the "
            "MultiWorkerMirroredStrategy only on the ranks in the communicator, before it is "
            "freed"
        )
    if not isinstance(communicator, mpi.Intracomm):
        raise TypeError(
            "communicator must be an mpi4py intracommunicator such as MPI.COMM_WORLD, got "
            f"{type(communicator).__name__} {communicator!r}"
        )
    return communicator


#: Agreements to start that no worker joined in time (``Workers.refuse``): MPI cannot cancel
#: a collective, so each request, with its buffers, is kept until the job ends.
_unanswered: list[tuple[Any, np.ndarray[Any, Any], np.ndarray[Any, Any]]] = []


def _agree_to_start(
    communicator: Any,
    local_replicas: int,
    pack_bytes: int,
    refusal: str = "",
    timeout: float | None = None,
) -> list[tuple[int, int]]:
    """Every worker's count of local replicas and pack size (``-1`` and ``refusal``, why, from
    a worker that could not make its strategy), gathered on the caller's communicator.

    Construction is collective, so this waits for every worker, however late (or ``timeout``
    seconds, for a refusal that guessed the communicator): a non-blocking ``Iallgather``
    tested on this thread, as a collective's wait does (busy at first, then with pauses that
    double up to ``_MAX_PAUSE``), rather than MPI's blocking gather, which spins a core all
    along (a peer still loading its data would share it) and ignores Ctrl-C.

    Raises:
        _Refused: a worker could not make its strategy (``Workers.refuse``).
        TimeoutError: some worker had not joined after ``timeout`` seconds.
    """
    mine = np.zeros(_START_BYTES, np.uint8)
    mine[:16].view("<i8")[:] = (local_replicas, pack_bytes)
    why = refusal.encode()[: _START_BYTES - 16]
    mine[16 : 16 + len(why)] = np.frombuffer(why, np.uint8)
    every = np.zeros((communicator.Get_size(), _START_BYTES), np.uint8)
    request = communicator.Iallgather(mine, every)
    started = time.monotonic()
    pause = 0.0
    try:
        while not _spin(request.Test):
            waited = time.monotonic() - started
            if timeout is not None and waited > timeout:
                raise TimeoutError(f"no agreement to start within {timeout:g} s")
            pause = _backed_off(waited, _BUSY_SECONDS, pause)
            if pause:
                time.sleep(pause)
    except BaseException:  # (Ctrl-C too) the request may still complete, into these buffers
        _unanswered.append((request, mine, every))
        raise
    starts = [(int(row[:8].view("<i8")[0]), int(row[8:16].view("<i8")[0])) for row in every]
    failed = [
        (w, bytes(row[16:]).rstrip(b"\0").decode(errors="replace"))
        for w, ((count, _), row) in enumerate(zip(starts, every, strict=True))
        if count < 0
    ]
    if failed:
        shown = "; ".join(f"worker {w}: {why}" for w, why in failed)
        raise _Refused(
            f"{worker_list([w for w, _ in failed])} could not make its "
            f"MultiWorkerMirroredStrategy ({shown}), so no worker makes one: every worker "
            "makes it at the same point of its program, with arguments valid on each"
        )
    return starts


def _starts_differ(starts: list[tuple[int, int]]) -> str:
    """What differs between the workers' starts (each one's count of local replicas and pack
    size, from ``_agree_to_start``), in words for a ``ValueError`` (the same on every worker);
    ``""`` when nothing does."""
    counts = [count for count, _ in starts]
    packs = [pack for _, pack in starts]
    differ = []
    if len(set(counts)) > 1:
        shown = ", ".join(f"worker {w} has {n}" for w, n in enumerate(counts))
        differ.append(
            f"every worker must run the same number of local replicas, but {shown}; give each "
            "worker's MultiWorkerMirroredStrategy as many devices"
        )
    if len(set(packs)) > 1:
        shown = "; ".join(f"worker {w}: {n} bytes" for w, n in enumerate(packs))
        differ.append(
            "every worker must pack small tensors into collectives alike, but the workers' "
            f"CommunicationOptions.bytes_per_pack differ ({shown}; a bytes_per_pack of 0 "
            "counts as its default): workers that pack the same values differently make "
            "different collectives, which refuse to pair up; pass the same "
            "communication_options to each worker's MultiWorkerMirroredStrategy"
        )
    return "; and ".join(differ)


def worker_list(workers: list[int]) -> str:
    """``workers`` in words: "worker 1", "workers 0, 2 and 3"."""
    if len(workers) == 1:
        return f"worker {workers[0]}"
    return "workers " + ", ".join(map(str, workers[:-1])) + f" and {workers[-1]}"


def _native_order(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """``dtype`` in this machine's byte order, the one MPI's types stand for (a NumPy array
    may hold numbers in either)."""
    return dtype.newbyteorder("=")


def in_native_order(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``array``, C-contiguous, in this machine's byte order: itself when it is so already."""
    return np.asarray(array, dtype=_native_order(array.dtype), order="C")


@functools.lru_cache(maxsize=_DESCRIPTIONS)
def _described(dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
    """``dtype`` and ``shape`` as bytes that ``_description`` reads back: a Python literal,
    which evaluating runs nothing. (Both cached: a broadcast in every step asks again.)"""
    return repr((np.lib.format.dtype_to_descr(dtype), shape)).encode()


@functools.lru_cache(maxsize=_DESCRIPTIONS)
def _description(said: bytes) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """The dtype and shape that ``_described`` wrote."""
    descr, shape = ast.literal_eval(said.decode())
    return np.lib.format.descr_to_dtype(descr), tuple(shape)


def _data_at(offset: int) -> int:
    """``offset`` rounded up to a multiple of 8: where a record's data starts after ``offset``
    bytes of other things."""
    return -(-offset // 8) * 8


def raw_bytes(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The bytes of a C-contiguous ``array``, as a flat ``uint8`` view: what MPI moves for the
    collectives that only move data, which so take any dtype (dates, fixed-width strings,
    records) but Python objects."""
    return array.reshape(-1).view(np.uint8)


def install_abort_on_uncaught(comm: Any) -> None:
    """Make an uncaught exception end the whole MPI job (non-zero), not hang it.

    The exception is printed as usual, then, half a second later (for ``mpiexec`` to forward
    it), ``Abort(1)`` stops every process; otherwise the failed process would wait in
    ``MPI_Finalize`` and its peers in a collective. Installed once per process, chained to the
    hook in place.
    """
    previous = sys.excepthook
    if getattr(previous, "_aioreplica_abort", False):
        return

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        previous(kind, value, traceback)
        if not issubclass(kind, SystemExit):
            sys.stdout.flush()
            sys.stderr.flush()
            # mpiexec forwards each process's output on its own time, and the abort ends the
            # job at once: without a moment between them the traceback just printed was, now
            # and then, lost (there is nothing to wait on for it).
            time.sleep(_ABORT_GRACE_SECONDS)
            comm.Abort(1)

    hook._aioreplica_abort = True  # type: ignore[attr-defined]
    sys.excepthook = hook
