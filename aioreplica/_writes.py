"""The write engine: how every copy of many variables changes at once, or none does.

Copies are never written in place. An update computes the new array of every copy first
(``compute_copies``, awaiting device work where there is any) and only then swaps all the
references in one synchronous step, ``commit``, with no ``await`` in it. A failure or a
cancellation before that step leaves every copy as it was; after it, every copy is new. The
same holds for the many variables one optimizer step or one checkpoint restore updates
together.

Because stored arrays are never mutated, host copies are read-only (``writeable=False``) and
host replicas share one array (invariant 6); a read is a reference, and a snapshot of every
variable (a checkpoint save) is a list of references taken at once.

Writes never overlap (invariant 8). Computing the new copies may await (device work), so two
writers of one variable could both read the old copies and the later commit would drop the
earlier update. Each writable object therefore has a ``Turn``: a first-in, first-out lock that
a write holds from its read to its commit, so concurrent writes apply one after another in the
order their callers reached them. A write of many objects at once (an optimizer step, a
restore) takes their turns in one global order, that of the turns' creation (``taking_turns``),
so two such writes can never wait for each other in a cycle. An uncontended turn costs a
lock (writers may run on several threads, each with its own event loop) and no await.

Variables, optimizers and checkpoints use this module; it knows variables only as objects that
store one copy per device and have a turn (``Stored``).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Final, Protocol, final

import anyio.to_thread
import numpy as np

from . import _loops, _tree
from ._backends import array_module, host_array, is_cupy_array

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from ._backends import Device

__all__ = [
    "ADD",
    "ASSIGN",
    "SUB",
    "Stored",
    "Turn",
    "active",
    "commit",
    "compute_copies",
    "compute_update",
    "frozen",
    "share_writer",
    "taking_turns",
    "to_host",
    "writer",
]

# Which operation a write performs on each copy.
ASSIGN: Final = "assign"
ADD: Final = "assign_add"
SUB: Final = "assign_sub"


class Stored(Protocol):
    """What the write engine knows of a variable: one copy per device, and its turn."""

    _copies: tuple[Any, ...]
    _devices: tuple[Device, ...]
    _turn: Turn


_creation = itertools.count()


@final
class Turn:
    """A first-in, first-out lock held by one write of an object from its read to its commit.

    Held with ``async with turn:``. Not tied to a task, an event loop or an async library:
    an uncontended ``acquire`` takes the turn without awaiting, and ``release`` hands it
    straight to the longest waiter, so a later caller can never overtake one that is already
    waiting. ``order`` (the creation order) is the global order in which ``taking_turns``
    takes several.

    Writers on different threads, each running its own event loop (a threaded server calling
    ``anyio.run`` per request), take turns too: the queue is guarded by a lock, and the turn
    is handed to a waiter through its own loop's thread-safe wake-up (``_loops.ThreadResult``),
    since a waiter parked on one loop cannot be woken by another loop's primitives.

    Example:
        >>> turn = Turn()
        >>> async def write():
        ...     async with taking_turns(lambda: [turn]):
        ...         return turn.held
        >>> anyio.run(write)
        True
    """

    __slots__ = ("_free", "_lock", "_waiting", "order")

    def __init__(self) -> None:
        self.order = next(_creation)
        #: Locked while the turn is held, by whichever writer (a lock may be released by
        #: another thread than the one that took it): an uncontended turn is one atomic
        #: ``acquire(blocking=False)``, however many threads write.
        self._free = threading.Lock()
        self._lock = threading.Lock()  # guards the queue, and a release against an enqueue
        self._waiting: deque[_loops.ThreadResult] | None = None  # made at the first contention

    @property
    def held(self) -> bool:
        """Whether a writer holds the turn."""
        return self._free.locked()

    def try_acquire(self) -> bool:
        """Take this turn if it is free, without awaiting; whether it was taken. (A turn
        released with writers waiting goes to the first of them: it is never free then.)"""
        return self._free.acquire(False)

    async def acquire(self) -> None:
        """Wait for this turn (FIFO); a cancelled waiter leaves the queue, or passes the turn on
        if it had just been handed to it."""
        if self._free.acquire(False):
            return
        with self._lock:
            if self._free.acquire(False):  # released meanwhile, with nobody waiting
                return
            if self._waiting is None:
                self._waiting = deque()
            handed = _loops.current().thread_result()
            self._waiting.append(handed)
        try:
            await handed
        except BaseException:
            with self._lock:
                queued = handed in self._waiting
                if queued:
                    self._waiting.remove(handed)
            if not queued:  # ``release`` had taken it off the queue: the turn is its own
                self.release()
            raise

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        """Hand the turn to the longest waiter, or free it."""
        with self._lock:  # an acquire that found it held enqueues under this lock, or retries
            if not self._waiting:
                self._free.release()
                return
            handed = self._waiting.popleft()  # still held: it now belongs to that waiter
        handed.set(None, None)


@final
class taking_turns:  # an async context manager named as the function it replaces
    """Hold every turn that ``needed()`` names (duplicates allowed), taken in creation order.

    ``needed`` is asked again once they are held: while this write waited, another may have
    given its objects new parts (an optimizer step makes slots), whose turns it then takes
    too, letting go and taking the larger set in order, so that the order is never broken.
    Used as ``async with taking_turns(needed):``.
    """

    __slots__ = ("_needed", "_taken")

    def __init__(self, needed: Callable[[], Iterable[Turn]]) -> None:
        self._needed = needed
        self._taken: list[Turn] = []

    async def __aenter__(self) -> None:
        needed = self._needed
        turns = set(needed())
        while True:
            taken = await _take(turns)
            more = set(needed())
            if more <= turns:
                break
            _release(taken)
            turns |= more
        self._taken = taken

    async def __aexit__(self, *exc_info: object) -> None:
        _release(self._taken)


async def _take(turns: set[Turn]) -> list[Turn]:
    ordered = sorted(turns, key=_order)
    taken: list[Turn] = []
    try:
        for turn in ordered:
            if not turn.try_acquire():  # an uncontended turn is taken without awaiting
                await turn.acquire()
            taken.append(turn)
    except BaseException:
        _release(taken)
        raise
    return taken


def _release(taken: list[Turn]) -> None:
    for turn in reversed(taken):
        turn.release()


def _order(turn: Turn) -> int:
    return turn.order


def commit(updates: Iterable[tuple[Stored, Sequence[Any]]]) -> None:
    """Swap in the new copies of every variable at once: the all-or-nothing step.

    Synchronous, with nothing in it that can fail for a well-formed update, so a cancellation
    or error can only come before it (every copy old) or after it (every copy new).
    """
    for variable, copies in updates:
        variable._copies = tuple(copies)


async def compute_copies(
    devices: Sequence[Device],
    fn: Callable[..., Any],
    per_copy: Sequence[Sequence[Any]],
) -> tuple[Any, ...]:
    """``fn(*inputs_i)`` for each copy ``i``, with device ``i`` current; results frozen.

    ``per_copy`` holds one sequence per argument, each with one entry per copy. Copies whose
    inputs are the very same objects (host replicas share arrays) are computed once. Where
    it runs is the device's rule (``device.compute``): small host work inline, the rest through
    ``device.run``, so the loop never blocks (invariant 4).
    """
    if all(len(set(map(id, argument))) == 1 for argument in per_copy):
        # Every copy has the very same inputs (host replicas share arrays): one job.
        shared = await _compute(devices[0], fn, [argument[0] for argument in per_copy])
        return (shared,) * len(devices)
    results: list[Any] = []
    done: dict[tuple[int, ...], Any] = {}
    for i, device in enumerate(devices):
        inputs = [argument[i] for argument in per_copy]
        if all(isinstance(x, np.ndarray) for x in inputs):
            key = tuple(map(id, inputs))
        else:
            key = tuple(id(leaf) for leaf in _tree.flatten(inputs)[0])
        if key not in done:
            done[key] = await _compute(device, fn, inputs)
        results.append(done[key])
    return tuple(results)


async def _compute(device: Device, fn: Callable[..., Any], inputs: list[Any]) -> Any:
    """``fn(*inputs)`` where the device's rule puts work that reads that many bytes; the new
    array, or each of a tuple of them (an optimizer step's), made read-only."""
    nbytes = sum([getattr(x, "nbytes", 0) for x in inputs])
    result = await device.compute(nbytes, fn, *inputs)
    return tuple(map(frozen, result)) if isinstance(result, tuple) else frozen(result)


async def compute_update(
    variable: Stored, fn: Callable[..., Any], *per_copy: Sequence[Any]
) -> tuple[Any, ...]:
    """``compute_copies`` over ``variable``'s devices, with its copies as the first input."""
    return await compute_copies(variable._devices, fn, [variable._copies, *per_copy])


async def to_host(array: Any, device: Device) -> np.ndarray[Any, Any]:
    """``array`` as a NumPy array; a GPU array is copied in a worker thread, where the copy
    waits for the work that made it, which the event loop's thread must not (invariant 4).

    For a checkpoint's values and other reads outside the collectives: into ordinary memory,
    which the program gets back, where the backend's page-locked staging (``to_host`` of the
    ``ArrayBackend``, for the collectives' transient copies) would keep a whole model pinned.
    """
    if not is_cupy_array(array):
        return np.asarray(array)
    return await anyio.to_thread.run_sync(host_array, array, device)


def writer(op: str) -> Callable[[Any, Any], Any]:
    return {ASSIGN: _assign, ADD: _add, SUB: _sub}[op]


def _assign(old: Any, value: Any) -> Any:
    out = _empty_like(old)
    out[...] = value
    return out


def _add(old: Any, value: Any) -> Any:
    out = _empty_like(old)
    array_module(old).add(old, value, out=out, casting="same_kind")
    return out


def _sub(old: Any, value: Any) -> Any:
    out = _empty_like(old)
    array_module(old).subtract(old, value, out=out, casting="same_kind")
    return out


def _empty_like(array: Any) -> Any:
    return array_module(array).empty(array.shape, array.dtype)


def share_writer(dtype: np.dtype[Any], total: int) -> Callable[[Any, Any, bool], Any]:
    """A write function for ``compute_copies`` that sets a copy to its share of a sum of
    ``total`` copies: ``fn(old, value, first)``, where ``first`` says whether the copy is
    global copy 0 (an integer division's remainder goes there). It computes the share where
    ``compute_copies`` runs the write, with the copy's device current, so a large one never
    holds the event loop."""

    def write(old: Any, value: Any, first: bool) -> Any:
        out = _empty_like(old)
        if dtype.kind in "iu":
            quotient, remainder = divmod(value, total)
            out[...] = quotient + remainder if first else quotient
        else:
            out[...] = value / total
        return out

    return write


class active:
    """``with active(device):`` makes a device current (with its stream) for synchronous work
    outside a replica's step; a host device has nothing to make current."""

    __slots__ = ("_device",)

    def __init__(self, device: Device) -> None:
        self._device = device

    def __enter__(self) -> None:
        if self._device.has_context:
            self._device.enter()

    def __exit__(self, *exc: object) -> None:
        if self._device.has_context:
            self._device.leave()


def frozen(array: Any) -> Any:
    """Mark a host array read-only (stored arrays are never written in place)."""
    if isinstance(array, np.ndarray):
        array.flags.writeable = False
    return array
