"""Timeline tracing: what the replicas did and when, as Chrome Trace Event JSON.

``strategy.trace(path)`` (or ``start_trace``/``stop_trace``) makes a ``Recorder`` the active
one of the process (``recorder``: one at a time). The places that do something worth seeing
record a *span* (a name, a start, an end, a few arguments) while it is active, and the recorder
writes them all, once tracing stops, as one file that Perfetto (ui.perfetto.dev) and
``chrome://tracing`` open.

What is recorded, and by whom:

- the scheduler, on the track of each replica: ``compute`` (replica code from the start of the
  step or a merge point to the next merge point or the end), ``merge wait`` (from the replica's
  arrival at a merge point until it resumes; ``round`` numbers the merge rounds of the trace
  from 1, ``merge`` is the ``merge_call`` number within its ``run()``), and ``merge_fn <name>``
  on the track of the replica that ran the merge function (the last to arrive), inside its
  ``merge wait``;
- the reduction engine: each collective by its name (``all_reduce``, ``all_gather``,
  ``broadcast``, ``reduce_scatter``, ``reduce``, ``gather``, ``reduce_to``, ``broadcast_to``;
  args ``op``, ``bytes`` (one replica's input), ``devices``), and ``barrier``;
- devices: ``device.run <fn>``; checkpoints: ``checkpoint save`` and ``checkpoint restore``;
  datasets: ``dataset prefetch`` (one element pulled, split and placed; ``ahead`` is the
  dataset's ``prefetch``, 0 when pulled on demand).

Tracks. Spans on one track nest (a child lies inside its parent's interval), which is what the
viewers draw. Each replica that ran in a traced run has a track, ``tid`` = its replica id in
sync (global: a worker's replicas keep their ids), named ``replica r``; ``pid`` is the worker
index (0 in one process). A span recorded by a task that is not a replica (the caller of
``run()`` saving a checkpoint, a dataset's prefetch task) goes on a track of its own kind,
``main`` or ``prefetch``, numbered from ``N`` (the number of replicas in sync) up in the order
they are first needed. Whenever a span could not nest where it would go (two tasks recording at
once on one kind of track, a task that a replica spawned recording beside the replica itself, a
``run()`` overlapping another ``run()`` of the same strategy) it goes on another track of that
kind instead, ``main (2)``, ``replica 1 (2)`` and so on, so that every track nests.

Costs. With no trace active each place that records pays one check of the module attribute
``recorder`` (the scheduler: one per ``run()`` and one per merge round, none per replica per
round, and a context variable set and reset per ``run()`` to mute its replicas). With a trace
active a span costs about a microsecond; nothing is written until the end.

A span that started before the trace or ends after it is left out: a trace holds what happened
within it. A run that started before the trace is not traced at all (its replicas are muted),
so its later spans do not land on other tracks.

Lifetime. A trace is the process's, but it ends with its strategy: closing the strategy
(``close()``, ``aclose()``) stops and writes it (``release``), and a strategy garbage-collected
while its trace is active takes the trace with it, unwritten, so that it never blocks another
strategy's trace. The recorder holds its strategy weakly for that.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import tempfile
import time
import weakref
from typing import TYPE_CHECKING, Any, Final, TypeVar, final

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from types import TracebackType

__all__ = [
    "Recorder",
    "ReplicaTrack",
    "callable_name",
    "detach",
    "mute",
    "recorder",
    "release",
    "start",
    "stop",
    "trace_path",
    "traced",
    "unmute",
]

T = TypeVar("T")

#: The active trace of this process, or None: what every place that records checks first.
recorder: Recorder | None = None

_now: Final = time.perf_counter_ns


@final
class _Lane:
    """One track: its ``tid``, its name, and the spans open on it, outermost first."""

    __slots__ = ("family", "held", "name", "stack", "tid")

    def __init__(self, tid: int, family: str, name: str) -> None:
        self.tid = tid
        self.family = family
        self.name = name
        self.stack: list[_Node] = []
        self.held = False  # by a replica of a run, for the whole run


@final
class _Node:
    """An open span."""

    __slots__ = ("args", "lane", "name", "parent", "recorder", "start")

    def __init__(
        self,
        recorder: Recorder,
        lane: _Lane,
        name: str,
        args: dict[str, Any] | None,
        parent: _Parent,
    ) -> None:
        self.recorder = recorder
        self.lane = lane
        self.name = name
        self.args = args
        self.parent = parent
        self.start = _now()


@final
class _Root:
    """Where a task's spans start: the track of a replica, or a kind of track (``lane`` None)."""

    __slots__ = ("family", "lane", "recorder")

    def __init__(self, recorder: Recorder | None, lane: _Lane | None, family: str) -> None:
        self.recorder = recorder
        self.lane = lane
        self.family = family


_Parent = _Node | _Root | None

#: The innermost open span of the running task (or where its spans start; None: ``main``).
_current: contextvars.ContextVar[_Parent] = contextvars.ContextVar(
    "aioreplica.trace_parent", default=None
)

#: Spans of a task under this are not recorded (a replica of a strategy not being traced).
_MUTED: Final = _Root(None, None, "")


@final
class _Span:
    """``with recorder.span(...)``: a span around a block of synchronous code."""

    __slots__ = ("_args", "_name", "_node", "_recorder", "_token")

    def __init__(self, recorder: Recorder, name: str, args: dict[str, Any] | None) -> None:
        self._recorder = recorder
        self._name = name
        self._args = args
        self._node: _Node | None = None
        self._token: contextvars.Token[_Parent] | None = None

    def __enter__(self) -> None:
        opened = self._recorder.open(self._name, self._args)
        if opened is not None:
            self._node, self._token = opened

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._node is not None and self._token is not None:
            self._recorder.close(self._node, self._token)


@final
class Recorder:
    """The spans of one trace, and the tracks they go on, until ``write`` puts them in a file.

    Args:
        path: the file to write.
        owner: the strategy being traced (compared by identity by the scheduler), held
            weakly: if it is collected, the trace ends, unwritten.
        replicas: the number of replicas in sync (the first ``tid`` of the other tracks).
        worker: the worker index (the ``pid`` of every track).
        version: aioreplica's version, for the file's ``otherData``.
    """

    def __init__(self, path: str, owner: Any, replicas: int, worker: int, version: str) -> None:
        self.path = path
        self.owner_name = repr(owner)  # for messages, also once the owner is gone
        self._owner = weakref.ref(owner, _owner_collected)
        self.replicas = replicas
        self.worker = worker
        self.version = version
        self._events: list[tuple[str, int, int, int, dict[str, Any] | None]] = []
        self._families: dict[str, list[_Lane]] = {}
        self._names: dict[int, str] = {}
        self._next_tid = replicas
        self._rounds = 0
        self._released: dict[int, list[ReplicaTrack]] = {}  # by replica: tracks to reuse
        self.stopped = False
        self.started = _now()

    @property
    def owner(self) -> Any:
        """The strategy being traced, or None once it was garbage-collected."""
        return self._owner()

    # -- tracks --------------------------------------------------------------------------

    def _add_lane(self, lane: _Lane) -> _Lane:
        self._families.setdefault(lane.family, []).append(lane)
        self._names[lane.tid] = lane.name
        return lane

    def _free_lane(self, family: str) -> _Lane:
        """A track of ``family`` with nothing open on it (and not held), or a new one."""
        lanes = self._families.get(family, ())
        for lane in lanes:
            if not lane.stack and not lane.held:
                return lane
        tid = self._next_tid
        self._next_tid += 1
        name = family if not lanes else f"{family} ({len(lanes) + 1})"
        return self._add_lane(_Lane(tid, family, name))

    def _lane_under(self, parent: _Parent) -> _Lane:
        """The track a span opened under ``parent`` goes on: the parent's own if the span
        nests there (the parent is the innermost span open on it), else a free one of its
        family."""
        if type(parent) is _Node and parent.recorder is self:
            lane = parent.lane
            if lane.stack and lane.stack[-1] is parent:
                return lane
            return self._free_lane(lane.family)
        if type(parent) is _Root:
            root_lane = parent.lane
            if root_lane is None:
                return self._free_lane(parent.family)
            if parent.recorder is self:
                if not root_lane.stack:
                    return root_lane
                return self._free_lane(root_lane.family)
        return self._free_lane("main")

    def _move_above(self, lane: _Lane, keep: int) -> None:
        """Move the spans open on ``lane`` above its first ``keep`` to a free track of its
        family, where they nest among themselves (spans of tasks that outlive their parent,
        or that another task opened on top of the one a replica's span goes under)."""
        moved = lane.stack[keep:]
        del lane.stack[keep:]
        other = self._free_lane(lane.family)
        for node in moved:
            node.lane = other
        other.stack.extend(moved)

    # -- spans ---------------------------------------------------------------------------

    def open(
        self, name: str, args: dict[str, Any] | None = None
    ) -> tuple[_Node, contextvars.Token[_Parent]] | None:
        """Open a span in the running task; ``close`` it with what this returns (None: the
        task's spans are not recorded)."""
        parent = _current.get()
        if parent is _MUTED or self.stopped:
            return None
        # The usual case first: a replica's own span, with nothing open on its track.
        lane = parent.lane if type(parent) is _Root and parent.recorder is self else None
        if lane is None or lane.stack:
            lane = self._lane_under(parent)
        node = _Node(self, lane, name, args, parent)
        lane.stack.append(node)
        return node, _current.set(node)

    def close(self, node: _Node, token: contextvars.Token[_Parent]) -> None:
        """Close a span opened by ``open`` in this same task, and record it."""
        end = _now()
        try:
            _current.reset(token)
        except ValueError:  # closed in another context than it was opened in
            _current.set(node.parent)
        lane = node.lane
        stack = lane.stack
        if stack and stack[-1] is node:
            stack.pop()
        elif node in stack:  # spans opened inside this one are still open
            self._move_above(lane, stack.index(node) + 1)
            stack.pop()
        if not self.stopped:
            self._events.append((node.name, lane.tid, node.start, end, node.args))

    def span(self, name: str, args: dict[str, Any] | None = None) -> _Span:
        """A context manager recording a span around synchronous code in the running task."""
        return _Span(self, name, args)

    async def timed(
        self, awaitable: Awaitable[T], name: str, args: dict[str, Any] | None = None
    ) -> T:
        """Await ``awaitable`` as a span of the running task; return its result."""
        opened = self.open(name, args)
        if opened is None:
            return await awaitable
        node, token = opened
        try:
            return await awaitable
        finally:
            self.close(node, token)

    def add(
        self, name: str, tid: int, start: int, end: int, args: dict[str, Any] | None = None
    ) -> None:
        """Record a finished span (times from ``time.perf_counter_ns``) on track ``tid``."""
        if start >= self.started and not self.stopped:
            self._events.append((name, tid, start, end, args))

    def next_round(self) -> int:
        """The number of a merge round new to this trace (1, 2, ...)."""
        self._rounds += 1
        return self._rounds

    def replica_track(self, replica: int) -> ReplicaTrack:
        """The track of replica ``replica`` for one run (the replica's own unless another run
        of the strategy holds it): held until ``ReplicaTrack.release``."""
        released = self._released.get(replica)
        if released:  # the usual case: the track of the run before
            track = released.pop()
            track._lane.held = True
            return track
        family = f"replica {replica}"
        if family in self._families:
            lane = self._free_lane(family)
        else:  # its first run: its own track, ``tid`` = its id (another worker's are not made)
            lane = self._add_lane(_Lane(replica, family, family))
        lane.held = True
        return ReplicaTrack(self, lane, replica)

    # -- the file ------------------------------------------------------------------------

    def document(self) -> dict[str, Any]:
        """The trace as Chrome Trace Event JSON (a dict ready for ``json.dump``)."""
        pid = self.worker
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"worker {pid}"}}
        ]
        events.extend(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
            for tid, name in sorted(self._names.items())
        )
        started = self.started
        # Parents before their children: by start, the longer first.
        for name, tid, start, end, args in sorted(
            self._events, key=lambda event: (event[2], -event[3])
        ):
            event: dict[str, Any] = {
                "ph": "X",
                "name": name,
                "pid": pid,
                "tid": tid,
                "ts": round((start - started) / 1000, 3),
                "dur": round((end - start) / 1000, 3),
            }
            event["args"] = args if args is not None else {}
            events.append(event)
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"aioreplica": self.version, "replicas": self.replicas, "worker": pid},
        }

    def write(self) -> str:
        """Write the trace to ``path`` atomically (a temporary file renamed over it); return
        the path. Readers see the old file or the whole new one, never a part.

        Raises:
            OSError: the file could not be written (its folder is gone, the disk is full): the
                message names ``path`` and says that the trace was not written.
        """
        data = json.dumps(self.document(), separators=(",", ":")).encode()
        directory = os.path.dirname(os.path.abspath(self.path))
        temporary = None
        try:
            descriptor, temporary = tempfile.mkstemp(
                prefix=f".{os.path.basename(self.path)}.", suffix=".tmp", dir=directory
            )
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path)
        except BaseException as exc:
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
            if isinstance(exc, OSError):
                raise type(exc)(
                    f"the trace was not written to {self.path!r}: {exc.strerror or exc}; it is "
                    "lost (check that its folder still exists and the disk has room)"
                ) from exc
            raise
        return self.path


@final
class ReplicaTrack:
    """The scheduler's handle on one replica's track in one traced run.

    ``enter`` (in the replica's task) makes the track where the replica's spans go. The
    scheduler's own spans (``compute``, ``merge wait``, ``merge_fn``) follow one another (a
    ``merge_fn`` inside a ``merge wait``) and never overlap a span of the replica's own task,
    which opens and closes inside one of them: so they are not put on the track's stack, only
    recorded when they end (``record``). A span of another task still open then (a task the
    replica started) moves to a track of its own, so that this one nests.
    """

    __slots__ = ("_lane", "_root", "recorder", "replica", "tid")

    def __init__(self, recorder: Recorder, lane: _Lane, replica: int) -> None:
        self.recorder = recorder
        self.replica = replica
        self.tid = lane.tid
        self._lane = lane
        self._root = _Root(recorder, lane, lane.family)

    def enter(self) -> None:
        """In the replica's task: its spans go on this track from now on."""
        _current.set(self._root)

    def record(self, name: str, start: int, args: dict[str, Any] | None = None) -> int:
        """Record the scheduler's span ``name`` from ``start`` until now; return now (from
        ``now()``, as ``start`` is)."""
        end = _now()
        recorder = self.recorder
        if self._lane.stack:  # spans of other tasks, still open: they move
            recorder._move_above(self._lane, 0)
        if not recorder.stopped:
            recorder._events.append((name, self.tid, start, end, args))
        return end

    now: Final = staticmethod(_now)

    def release(self) -> None:
        """The run is over: the track is free for another run."""
        self._lane.stack.clear()
        self._lane.held = False
        self.recorder._released.setdefault(self.replica, []).append(self)


def detach(kind: str) -> None:
    """In a task that serves no replica (a dataset's prefetch task): record its spans on
    tracks of ``kind`` (``"prefetch"``), not under the task that started it."""
    _current.set(_Root(None, None, kind))


def mute() -> contextvars.Token[_Parent]:
    """In the task starting the replicas of a run that is not traced: the replicas (which
    inherit its context) record none of their spans, even once a trace starts while they run.
    Give what it returns to ``unmute`` once they have ended."""
    return _current.set(_MUTED)


def unmute(token: contextvars.Token[_Parent]) -> None:
    """Undo ``mute`` (in the same task)."""
    _current.reset(token)


async def traced(awaitable: Awaitable[T], name: str, args: dict[str, Any] | None = None) -> T:
    """Await ``awaitable``, as a span ``name`` if a trace is active; return its result."""
    active = recorder
    if active is None:
        return await awaitable
    return await active.timed(awaitable, name, args)


def callable_name(fn: Callable[..., Any]) -> str:
    """A function's name for a span: its qualified name from the innermost function it is
    defined in (a ``functools.partial``: of the function it wraps).

    Example:
        >>> import functools
        >>> def outer():
        ...     def step(x):
        ...         return x
        ...     return step
        >>> callable_name(functools.partial(outer(), 1)), callable_name(np.add)
        ('step', 'add')
    """
    inner: Any = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    name = getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None)
    if not isinstance(name, str):
        return type(inner).__name__
    return name.rpartition("<locals>.")[2] if "<locals>" in name else name


def trace_path(path: str, worker: int) -> str:
    """The file of worker ``worker``: ``path`` itself for worker 0, else the index added
    before the extension (``run.json`` -> ``run.worker1.json``).

    Raises:
        FileNotFoundError: ``path`` is empty.
        IsADirectoryError: ``path`` ends with a path separator, so it names a folder.

    Example:
        >>> trace_path("run.json", 0), trace_path("out/run.json", 2)
        ('run.json', 'out/run.worker2.json')
        >>> trace_path("out/", 0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        IsADirectoryError: the trace path 'out/' ends with a separator, so it names a folder; ...
    """
    _check_names_file(path)
    if worker == 0:
        return path
    stem, extension = os.path.splitext(path)
    return f"{stem}.worker{worker}{extension}"


def start(path: str, owner: Any, replicas: int, worker: int, version: str) -> Recorder:
    """Make a recorder the active trace of this process.

    Raises:
        RuntimeError: a trace is active already.
        FileNotFoundError: ``path`` is empty.
        IsADirectoryError: ``path`` ends with a path separator, so it names a folder.
        OSError: ``path``'s folder does not take a new file (read-only, no permission): refused
            now, rather than the trace being lost when it stops.
    """
    global recorder
    if recorder is not None:
        raise RuntimeError(
            f"a trace is already being recorded (by {recorder.owner_name}, to {recorder.path}); "
            "one trace at a time: stop it first (stop_trace(), or leave its "
            "`async with strategy.trace(...)` block)"
        )
    _check_names_file(path)
    _check_writable(path)
    recorder = Recorder(path, owner, replicas, worker, version)
    return recorder


def _check_names_file(path: str) -> None:
    """Refuse a path that names no file: the empty one, or one ending with a separator.

    Raises:
        FileNotFoundError: ``path`` is empty.
        IsADirectoryError: ``path`` ends with a separator.
    """
    if not path:
        raise FileNotFoundError("the trace path is empty; name a JSON file, such as 'run.json'")
    if path.endswith((os.sep, os.altsep or os.sep)):
        raise IsADirectoryError(
            f"the trace path {path!r} ends with a separator, so it names a folder; name a file "
            f"({os.path.join(path, 'run.json')}, say)"
        )


def _check_writable(path: str) -> None:
    """Create and remove a temporary file where ``Recorder.write`` will create its own.

    Raises:
        OSError: it cannot be created; the message names ``path`` and what to do.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        descriptor, temporary = tempfile.mkstemp(
            prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory
        )
    except OSError as exc:
        raise type(exc)(
            f"cannot write the trace file {path!r} here: {exc.strerror or exc}; name a file "
            "in a folder this process can write"
        ) from exc
    os.close(descriptor)
    with contextlib.suppress(OSError):
        os.unlink(temporary)


def stop(owner: Any) -> Recorder:
    """End the active trace of ``owner``: nothing more is recorded; return it (to write).

    Raises:
        RuntimeError: no trace is active, or another strategy's is.
    """
    global recorder
    active = recorder
    if active is None:
        raise RuntimeError(
            f"no trace is being recorded by {owner!r}; start one with "
            "strategy.start_trace(path) or `async with strategy.trace(path):`"
        )
    if active.owner is not owner:
        raise RuntimeError(
            f"the trace being recorded is {active.owner_name}'s (to {active.path}), not "
            f"{owner!r}'s; stop it through the strategy that started it"
        )
    active.stopped = True
    recorder = None
    return active


def release(owner: Any) -> Recorder | None:
    """End the active trace if it is ``owner``'s (``owner`` is being closed): return it, to
    write; else None (another strategy's trace goes on)."""
    active = recorder
    if active is None or active.owner is not owner:
        return None
    return stop(owner)


def _owner_collected(reference: weakref.ref[Any]) -> None:
    """The owner of a recorder was garbage-collected (any thread, any moment): its trace, if
    still active, ends unwritten, so that another strategy can start one."""
    global recorder
    active = recorder
    if active is not None and active._owner is reference:
        active.stopped = True
        recorder = None
