"""The device protocol and the array-backend protocol.

A **device** is where a replica's arrays live and its work runs. The scheduler calls
``enter()`` before every step of a replica's coroutine and ``leave()`` after it (invariant 1),
so a device whose "current device" state is thread-local (CuPy's current device and stream)
follows its replica across every await. Host devices have nothing to enter: they say
so with ``has_context = False`` and the scheduler then skips both calls on its hot path. A
device may also have ``resume()`` and ``suspend()``, which the scheduler then calls in their
place: an ``enter`` and a ``leave`` that also carry what the replica's own code made current
from one step to the next (``CudaDevice``: a ``with other_stream:`` block around an await).

An **array backend** (one per kind of device: NumPy for ``cpu``, CuPy for ``gpu``) carries out
collectives over arrays that ``aioreplica._collectives`` has already validated: one input per
replica, every input the same shape and dtype and on its replica's device. Reduction ops arrive
as the plain strings ``"sum"``, ``"mean"``, ``"max"``, ``"min"``, ``"prod"`` (the values of
``ReduceOp``, which lives above the backends).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import ModuleType

    import numpy as np

__all__ = ["ArrayBackend", "Device"]

T = TypeVar("T")


@runtime_checkable
class Device(Protocol):
    """One device a replica runs on.

    Attributes:
        name: the canonical name, such as ``"cpu:0"`` or ``"gpu:1"``.
        kind: ``"cpu"`` or ``"gpu"``.
        index: the device's number within its kind.
        has_context: whether ``enter``/``leave`` do anything; ``False`` lets the scheduler
            skip them.
        xp: the array module of this device (``numpy`` or ``cupy``).
        backend: the array backend that runs collectives over devices of this kind.
    """

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def index(self) -> int: ...

    @property
    def has_context(self) -> bool: ...

    @property
    def xp(self) -> ModuleType: ...

    @property
    def backend(self) -> ArrayBackend: ...

    async def compute(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)``, work on ``nbytes`` of this device's arrays, where it belongs.

        The device's one inline-or-worker rule: a host device runs small work inline on the
        loop thread (cheaper than a thread handoff) and the rest in its worker thread (``run``),
        so the event loop never blocks on big work; a GPU device always uses ``run``, with
        its device and stream current.
        """

    def enter(self) -> None:
        """Make this device current on the calling thread (before a replica step)."""

    def leave(self) -> None:
        """Undo ``enter`` (after a replica step, before the event loop runs anything else)."""

    def asarray(self, value: Any) -> Any:
        """Return ``value`` as an array on this device (no copy if it already is one)."""

    async def synchronize(self) -> None:
        """Wait, without blocking the event loop, until work queued on this device is done."""

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` with this device active, without blocking the loop.

        Host devices run it in the device's own worker thread, in submission order (a FIFO
        "stream"); GPU devices run it inline with the device and its stream current.
        """


class ArrayBackend(Protocol):
    """Collectives over the arrays of one kind of device.

    Every method takes one input per replica (already checked: same shape and dtype, each an
    array of this backend on its replica's device) and returns one result per replica, each on
    that replica's device. Host results may be one shared, read-only array repeated.
    """

    @property
    def name(self) -> str:
        """``"numpy"`` or ``"cupy"``."""

    def prepare(self, devices: Sequence[Device]) -> None:
        """Set up, once, what collectives over ``devices`` need (called when a strategy is
        built, off the hot path: NCCL communicators, for instance)."""

    def reduce_to_first(self, op: str, inputs: Sequence[Any], devices: Sequence[Device]) -> Any:
        """Sum (``"sum"``) or average (``"mean"``) the inputs into one new array on the first
        device, synchronously, ordered after the work that made each input."""

    async def all_reduce(
        self, op: str, inputs: Sequence[Any], devices: Sequence[Device]
    ) -> list[Any]:
        """Reduce elementwise across replicas; every replica gets the reduced array."""

    async def all_reduce_packed(
        self, op: str, leaves: Sequence[Sequence[Any]], devices: Sequence[Device]
    ) -> list[Any]:
        """Reduce several small leaves as one: ``leaves[k]`` holds leaf ``k``'s input per
        replica. Every replica gets one flat array holding the reduced leaves end to end, in
        order, each flattened."""

    async def all_gather(
        self, inputs: Sequence[Any], axis: int, devices: Sequence[Device]
    ) -> list[Any]:
        """Concatenate the inputs along ``axis``; every replica gets the whole."""

    async def broadcast(self, value: Any, devices: Sequence[Device]) -> list[Any]:
        """Give every replica ``value`` (which lives on any device of this backend)."""

    async def to_host(self, value: Any, device: Device) -> np.ndarray[Any, Any]:
        """A new, writeable, C-contiguous NumPy copy of ``value`` (on ``device``), holding what
        the device's work made it, copied without blocking the event loop."""
