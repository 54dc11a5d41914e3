"""The host reduction kernel and the pool its outputs come from.

Pure, synchronous NumPy: the host backend decides which thread runs what.

**Blocks.** A plain NumPy reduction of N arrays, ``np.add(a, b, out=o); np.add(o, c, out=o)
...``, streams the whole output through memory N - 1 times: once the arrays outgrow the caches
it reads and writes ``o`` again on every step, so memory traffic, not arithmetic, sets its speed.
``reduce_range`` walks the output in blocks of ``BLOCK_BYTES`` instead and finishes each block
before moving on: ``out[b] = in0[b] op in1[b]``, then ``out[b] op= in2[b]``, ... (ufuncs with
``out=``, no temporaries). While the block is being accumulated it stays in the core's L2 cache,
so each input is read from memory once and the output written once, the least traffic any
reduction can make. The block is half of one core's share of the L2 cache (read from Linux
sysfs; 256 KiB where that is unknown), kept between 64 KiB and 1 MiB: small enough that the
output block plus the input lines streaming past it fit in L2, large enough that the per-call
cost of a ufunc (about half a microsecond) and the restart of the hardware prefetchers at every
block stay negligible. Measured on a 2-core AMD EPYC (1 MiB L2, 4 x 64 MiB float32, one and
two threads): 64 KiB blocks ran 1.2-1.4x slower than 512 KiB, 256 KiB blocks 1.05-1.15x slower;
512 KiB and 1 MiB were within noise of each other.

**Ranges.** NumPy ufuncs release the GIL in their inner loop, so ranges of one reduction run
in parallel in different threads. ``split_ranges`` cuts the array at block boundaries, so two
threads never write the same cache line, and gives every range at least ``MIN_RANGE_BYTES`` of
output, so that handing a range to another thread (tens to a hundred microseconds) pays off.

**The pool.** A fresh 64 MiB output per call costs page faults on every first touch; reusing a
buffer made a host all_reduce 1.1x to 9x faster. ``BufferPool`` keeps a few output buffers per
(shape, dtype) and hands one out again once no caller still holds it.

**Huge pages.** A buffer of ``HUGE_BYTES`` or more gets a private mapping of its own, aligned
to 2 MiB and advised for transparent huge pages (Linux), rather than ``np.empty``'s memory:
where ``np.empty`` puts a large array depends on the allocator's history. Once MPI has freed
buffers of that size, the C allocator serves them from its heap, and there the array ran on
small pages: a cross-worker reduction of 16 MiB into it took 7.7 ms where one into a huge-page
buffer took 5.8 ms (two workers on one 2-core virtual machine, where every TLB miss costs a
nested page walk). The same reductions in one process, whose arrays ``np.empty`` maps afresh,
ran alike either way. The array starts ``_START_OFFSET`` bytes (a page and a cache line) into
the first huge page, not at it: a cross-worker reduction of 64 MiB into an array starting on a
2 MiB boundary took 48-52 ms, one into the same mapping 4160 bytes in 39.7-41 ms, like
``np.empty``'s (whose arrays start 16 bytes into a page); 4 and 16 MiB ran alike at either
start, faster than into ``np.empty``'s.

**The reuse rule.** Every pooled buffer has an *owner*, the object that the ``.base`` of every
array over its memory leads to: the array ``np.empty`` made, or a huge buffer's mapping. NumPy
points a view's ``.base`` past the arrays that do not own their memory, towards the array that
does, and stops before the first object that is not an array (the mapping): every chain of
``.base`` from an array over the buffer ends at the owner, and each link holds the next.
``take`` hands out a new array over the memory each time (a view of the owner, or an array over
the mapping), never the owner itself and never an array it handed out before: a dropped result
dies like any other array, its weak references with it, and never comes back as a later step's
result. A buffer is *free* when nothing but the pool refers to its owner:
``sys.getrefcount(owner)`` equals the count measured, through the same code path, on an array
that only the pool's own entry holds (calibrated at import, so it does not depend on the
interpreter's temporary references). Any other reference keeps it *busy*, and everything a
caller can reach from a result refers to the owner: the result itself in any variable, list,
``PerReplica`` or frame; every array derived from it without a copy (slices, ``reshape``,
``.T``, ``.view()``, ``np.asarray``, ``memoryview``, ``np.frombuffer``); and the owner, reached
through ``.base``, with whatever is made from it (``np.frombuffer(result.base)`` over a huge
result's mapping). Not covered: raw addresses (``.ctypes.data``, ``__array_interface__``) held
without an object that refers to the owner, and objects kept alive only by a reference cycle,
which hold the buffer until the cycle collector frees them (the pool then allocates a new buffer
meanwhile; it never overwrites), and weak references to the owner (``weakref.ref(result.base)``):
the pool keeps the owner alive, so such a reference outlives the result and sees the memory of a
later one. The pool itself creates no cycles: it holds owners, and owners hold nothing.

A result is read-only; its owner is not (the cross-worker stage makes a result writeable again
to reduce into it in place before anyone else sees it, which NumPy allows only over writeable
memory): writing through ``result.base`` writes every replica's result.

**Threads.** The host backend, and so its pool, is one per process: every thread that runs an
event loop of its own (a threaded server calling ``anyio.run`` per request) takes from it. A
lock makes each ``take`` whole: no other thread looks at a buffer between the moment one finds
it free and the moment the array it hands out refers to the owner, which makes it busy. The
counters and the byte total change under the same lock. It is re-entrant, for a ``take`` that
runs inside another on one thread (see ``BufferPool.__init__``). Uncontended it costs some
0.1-0.3 µs of a ``take`` and ``publish`` that take about 3 µs on a 2-core virtual machine.
Per-thread pools would need no lock, but would keep ``max_bytes`` per thread and reuse nothing
across threads. ``publish`` touches only the array it is given. Other threads may hold and drop
references at any time (a worker reducing into a buffer keeps it busy until it returns): once
only the pool refers to an owner, no other thread can reach it to take a new reference.

The rule relies on CPython's reference counting with the global interpreter lock.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeAlias, final

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy.typing as npt

__all__ = [
    "BLOCK_BYTES",
    "HUGE_BYTES",
    "MIN_RANGE_BYTES",
    "BufferPool",
    "PoolStatistics",
    "empty_buffer",
    "reduce_range",
    "reduce_small",
    "split_ranges",
]

_KIB: Final = 1 << 10
_MIB: Final = 1 << 20


def _l2_share_bytes(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """One hardware thread's share of the L2 cache, from Linux sysfs; ``None`` if unknown."""
    try:
        for index in sorted(cache_dir.glob("index*")):
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            if level != "2" or kind not in ("Unified", "Data"):
                continue
            text = (index / "size").read_text().strip().upper()
            scale = {"K": _KIB, "M": _MIB}.get(text[-1:], 1)
            size = int(text.rstrip("KM")) * scale
            sharing = 0
            for part in (index / "shared_cpu_list").read_text().strip().split(","):
                lo, _, hi = part.partition("-")
                sharing += int(hi or lo) - int(lo) + 1
            return size // max(sharing, 1)
    except (OSError, ValueError):
        return None
    return None


def _block_bytes(l2_share: int | None) -> int:
    """Half the L2 share as a power of two in [64 KiB, 1 MiB]; 256 KiB when unknown."""
    if l2_share is None or l2_share <= 0:
        return 256 * _KIB
    half = 1 << ((l2_share // 2).bit_length() - 1) if l2_share >= 2 else 1
    return min(max(half, 64 * _KIB), _MIB)


#: Bytes of output reduced per block: half of one core's L2 share, in [64 KiB, 1 MiB].
BLOCK_BYTES: Final = _block_bytes(_l2_share_bytes())

#: The least output, in bytes, that ``split_ranges`` gives one range (whole blocks).
MIN_RANGE_BYTES: Final = _MIB

_UFUNCS: Final[dict[str, np.ufunc]] = {
    "sum": np.add,
    "mean": np.add,
    "max": np.maximum,
    "min": np.minimum,
    "prod": np.multiply,
}


def _block_elements(itemsize: int) -> int:
    return max(1, BLOCK_BYTES // itemsize)


# -- the kernel ----------------------------------------------------------------------------


def _flat(array: npt.NDArray[Any], what: str) -> npt.NDArray[Any]:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{what} must be a numpy.ndarray, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous; pass np.ascontiguousarray({what})")
    return array.reshape(-1)


def reduce_range(
    op: str,
    inputs: Sequence[npt.NDArray[Any]],
    out: npt.NDArray[Any],
    start: int,
    stop: int,
) -> None:
    """Reduce elements ``[start, stop)`` of the flattened inputs into the same range of ``out``.

    Works block by block (``BLOCK_BYTES`` of output each): ``out[b] = in0[b] op in1[b]``, then
    ``out[b] op= in2[b]``, ... with ufuncs writing into ``out`` (no temporaries), so each input
    is read once and each output block stays in cache until it is done. ``"mean"`` divides each
    block by N right after summing it. One input is copied. The result has the inputs' dtype:
    integer arithmetic wraps around as NumPy's does, and booleans combine as NumPy's ufuncs
    combine them (``sum``/``max`` are *or*, ``prod``/``min`` are *and*).

    NumPy releases the GIL in the ufunc loops, so several threads can reduce disjoint ranges
    of one output at once (see ``split_ranges``). Elements outside ``[start, stop)`` are not
    touched.

    Args:
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.
        inputs: N >= 1 C-contiguous arrays of one shape and one numeric dtype (bool, integer,
            floating or complex); ``"mean"`` needs floating or complex.
        out: a writeable C-contiguous array of that shape and dtype, sharing no memory with the
            inputs.
        start: first element (of the flattened arrays) to reduce.
        stop: one past the last; ``0 <= start <= stop <= out.size``.

    Raises:
        ValueError: ``op`` is unknown, ``inputs`` is empty, shapes differ, an array is not
            C-contiguous, ``out`` is read-only or overlaps an input, or the range is out of
            bounds.
        TypeError: an array is not a NumPy array, dtypes differ, the dtype is not numeric, or
            ``"mean"`` is asked of a bool or integer dtype.

    Example:
        >>> a, b = np.arange(6.0), np.ones(6)
        >>> out = np.zeros(6)
        >>> reduce_range("sum", [a, b], out, 0, 4)
        >>> out.tolist()
        [1.0, 2.0, 3.0, 4.0, 0.0, 0.0]
    """
    ufunc = _UFUNCS.get(op)
    if ufunc is None:
        raise ValueError(f"unknown reduction {op!r}; expected one of {sorted(_UFUNCS)}")
    if len(inputs) == 0:
        raise ValueError("reduce_range needs at least one input")
    dtype, shape = out.dtype, out.shape
    flat_out = _flat(out, "out")
    if not out.flags.writeable:
        raise ValueError("out is read-only; take a writeable buffer from BufferPool.take")
    if dtype.kind not in "biufc":
        raise TypeError(f"cannot reduce dtype {dtype}: expected bool, integer, float or complex")
    if op == "mean" and dtype.kind not in "fc":
        raise TypeError(f"'mean' needs a floating or complex dtype, got {dtype}")
    flats = []
    for i, x in enumerate(inputs):
        if not isinstance(x, np.ndarray) or not x.flags.c_contiguous:
            _flat(x, f"inputs[{i}]")  # raises the matching error
        if x.dtype != dtype:
            raise TypeError(f"inputs[{i}] has dtype {x.dtype}, out has {dtype}")
        if x.shape != shape:
            raise ValueError(f"inputs[{i}] has shape {x.shape}, out has {shape}")
        if np.may_share_memory(x, out):
            raise ValueError(f"out shares memory with inputs[{i}]; reduce into a separate buffer")
        flats.append(x.reshape(-1))
    size = flat_out.size
    if not 0 <= start <= stop <= size:
        raise ValueError(f"range [{start}, {stop}) is not within [0, {size}]")
    if start == stop:
        return
    if len(flats) == 1:
        np.copyto(flat_out[start:stop], flats[0][start:stop])
        return
    step = _block_elements(dtype.itemsize)
    first, second, rest = flats[0], flats[1], flats[2:]
    count = len(flats) if op == "mean" else 0
    for lo in range(start, stop, step):
        hi = min(lo + step, stop)
        block = flat_out[lo:hi]
        ufunc(first[lo:hi], second[lo:hi], out=block)
        for x in rest:
            ufunc(block, x[lo:hi], out=block)
        if count:
            np.divide(block, count, out=block)


def reduce_small(op: str, inputs: Sequence[npt.NDArray[Any]], out: npt.NDArray[Any]) -> None:
    """``reduce_range`` over the whole of a small output, without its checks.

    For the backend's own calls, whose arrays the engine has checked already (one shape, one
    numeric dtype, ``out`` fresh from the pool, so sharing no memory with them; any layout, as
    the ufuncs take it): below ``INLINE_BYTES`` the checks would cost more than the arithmetic.
    The same ufuncs in the same order as ``reduce_range`` give the same bits.

    Example:
        >>> out = np.empty(3)
        >>> reduce_small("max", [np.array([1.0, 5.0, 2.0]), np.array([4.0, 0.0, 3.0])], out)
        >>> out.tolist()
        [4.0, 5.0, 3.0]
    """
    if len(inputs) == 1:
        np.copyto(out, inputs[0])
        return
    ufunc = _UFUNCS[op]
    ufunc(inputs[0], inputs[1], out=out)
    for x in inputs[2:]:
        ufunc(out, x, out=out)
    if op == "mean":
        np.divide(out, len(inputs), out=out)


def split_ranges(size: int, itemsize: int, parts: int) -> list[tuple[int, int]]:
    """Split ``size`` elements into at most ``parts`` contiguous ranges for ``reduce_range``.

    Every range but the last starts and ends on a block boundary (``BLOCK_BYTES // itemsize``
    elements), so threads reducing neighbouring ranges never write the same cache line. When
    there are several, every range holds at least ``MIN_RANGE_BYTES`` of output: a small array
    gets fewer ranges, down to one. The blocks are shared out as evenly as whole blocks allow.

    Args:
        size: number of elements (``out.size``), >= 0.
        itemsize: bytes per element (``out.itemsize``), >= 1.
        parts: the most ranges wanted (usually the number of threads), >= 1.

    Returns:
        ``[(start, stop), ...]`` in order, covering ``[0, size)`` exactly, each non-empty;
        an empty list when ``size`` is 0.

    Raises:
        ValueError: ``size`` < 0, ``itemsize`` < 1 or ``parts`` < 1.

    Example:
        >>> split_ranges(1 << 20, 4, 2)  # 4 MiB of float32
        [(0, 524288), (524288, 1048576)]
        >>> split_ranges(1000, 4, 2)
        [(0, 1000)]
        >>> split_ranges(0, 4, 2)
        []
    """
    if size < 0 or itemsize < 1 or parts < 1:
        raise ValueError(
            f"split_ranges needs size >= 0, itemsize >= 1, parts >= 1; "
            f"got size={size}, itemsize={itemsize}, parts={parts}"
        )
    if size == 0:
        return []
    block = _block_elements(itemsize)
    blocks = -(-size // block)
    min_blocks = -(-MIN_RANGE_BYTES // (block * itemsize))
    count = max(1, min(parts, (size // block) // min_blocks))
    per, extra = divmod(blocks, count)
    ranges = []
    start_block = 0
    for i in range(count):
        # The last ranges take the spare blocks: the very last one may end in a partial
        # block, and an extra whole block keeps it at MIN_RANGE_BYTES or more.
        stop_block = start_block + per + (i >= count - extra)
        ranges.append((start_block * block, min(stop_block * block, size)))
        start_block = stop_block
    return ranges


# -- the pool ------------------------------------------------------------------------------

#: Buffers from this size up are mapped on their own, for huge pages.
HUGE_BYTES: Final = 4 << 20
_HUGE_PAGE: Final = 2 << 20
#: Where such a buffer starts in its mapping, past the first 2 MiB boundary (see above).
_START_OFFSET: Final = 4096 + 64
_HUGE_PAGES: Final = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


#: What ``BufferPool.take`` takes as a 1-d shape.
_INTEGERS: Final = (int, np.integer)

#: A buffer's memory: its owner (the array ``np.empty`` made, or a mapping of its own) and
#: where the buffer starts in it, in bytes (0 in an array).
_Memory: TypeAlias = "tuple[npt.NDArray[Any] | mmap.mmap, int]"
_Key: TypeAlias = "tuple[tuple[int, ...], np.dtype[Any]]"


def _memory(shape: tuple[int, ...], dtype: np.dtype[Any]) -> _Memory:
    """Memory for a new buffer: ``np.empty``'s array, or from ``HUGE_BYTES`` up (on Linux) a
    private anonymous mapping (see ``empty_buffer``)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_BYTES or not _HUGE_PAGES:
        return np.empty(shape, dtype), 0
    try:
        mapping = mmap.mmap(
            -1, nbytes + _HUGE_PAGE + _START_OFFSET, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
    except OSError:  # out of address space or mappings: NumPy's own (or its MemoryError)
        return np.empty(shape, dtype), 0
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    start = -np.frombuffer(mapping, np.uint8, count=1).ctypes.data % _HUGE_PAGE + _START_OFFSET
    return mapping, start


def _array(memory: _Memory, shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """A new writeable array over ``memory``, whose ``.base`` is the owner."""
    owner, start = memory
    if isinstance(owner, np.ndarray):
        return owner.view()
    return np.ndarray(shape, dtype, buffer=owner, offset=start)


def empty_buffer(shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """``np.empty(shape, dtype)``; from ``HUGE_BYTES`` up (on Linux), in a private anonymous
    mapping of its own, aligned to 2 MiB and advised for transparent huge pages, so that the
    kernel can back it with them whatever the C allocator did before; the array starts
    ``_START_OFFSET`` bytes past the mapping's first 2 MiB boundary.

    Such an array's ``.base`` is the mapping; its views' ``.base`` is the array (NumPy stops
    at the first object that is not an array), so the mapping is what every chain of
    ``.base`` ends at, the owner in the pool's reuse rule.

    Raises:
        MemoryError: as ``np.empty``, when no mapping could be made either.

    Example:
        >>> empty_buffer((2, 3), np.dtype("float32")).shape
        (2, 3)
    """
    memory = _memory(shape, dtype)
    if isinstance(memory[0], np.ndarray):
        return memory[0]
    return _array(memory, shape, dtype)


def _refs(bucket: list[_Memory], i: int) -> int:
    """Reference count of the owner of ``bucket[i]`` as seen from here (the reuse test and
    its baseline)."""
    return sys.getrefcount(bucket[i][0])


#: What ``_refs`` reports for an owner that only its entry in a bucket holds.
_FREE_REFS: Final = _refs([(np.empty(0), 0)], 0)


@final
@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A snapshot of a ``BufferPool``'s counters.

    Attributes:
        taken: calls to ``take``.
        reused: of those, how many returned a pooled buffer that was free.
        allocated: how many allocated a new buffer (pooled or not).
        pooled_buffers: buffers the pool holds now, busy or free.
        pooled_bytes: their total size.
    """

    taken: int
    reused: int
    allocated: int
    pooled_buffers: int
    pooled_bytes: int


@final
class BufferPool:
    """Output buffers reused instead of reallocated, once no caller holds them.

    ``take`` returns a new array over a pooled buffer of the wanted shape and dtype that
    nothing but the pool refers to (see the module docstring for the exact rule); otherwise
    over a new buffer, which the pool keeps for next time while its bounds allow. ``publish``
    marks a result read-only before it is handed to every replica. Several threads may use one
    pool at once, and hold and drop its arrays freely.

    Args:
        per_key: the most buffers kept per (shape, dtype); 2 lets one result stay held while
            the next one is computed.
        max_bytes: the most bytes kept in all. To make room, free buffers of the least recently
            used keys are dropped; if that is not enough, the new buffer is simply not kept.
        min_bytes: buffers smaller than this are never kept (``np.empty`` of a small array
            reuses memory the allocator already has, so pooling it saves nothing).

    Raises:
        ValueError: a bound is negative, or ``per_key`` < 1.

    Example:
        >>> pool = BufferPool(min_bytes=0)
        >>> out = pool.take((4,), np.float32)
        >>> out[:] = 1
        >>> result = pool.publish(out)
        >>> result.flags.writeable
        False
        >>> np.shares_memory(pool.take((4,), np.float32), result)  # still held: a new buffer
        False
        >>> del out, result
        >>> again = pool.take((4,), np.float32)  # the first one, free again, in a new array
        >>> again.flags.writeable, pool.statistics().reused
        (True, 1)
    """

    __slots__ = (
        "_allocated",
        "_buckets",
        "_inside",
        "_lock",
        "_max_bytes",
        "_min_bytes",
        "_per_key",
        "_pooled",
        "_reused",
        "_taken",
    )

    def __init__(
        self, *, per_key: int = 2, max_bytes: int = 512 * _MIB, min_bytes: int = 64 * _KIB
    ) -> None:
        if per_key < 1 or max_bytes < 0 or min_bytes < 0:
            raise ValueError(
                f"BufferPool needs per_key >= 1 and non-negative byte bounds; got "
                f"per_key={per_key}, max_bytes={max_bytes}, min_bytes={min_bytes}"
            )
        self._per_key = per_key
        self._max_bytes = max_bytes
        self._min_bytes = min_bytes
        # Guards everything below: the buckets, the byte total and the counters. Re-entrant,
        # with ``_inside`` set while a ``take`` looks at or changes the buckets: Python may run
        # a finalizer or a signal handler between any two bytecodes, and one that reduces (a
        # ``__del__`` reading a sync-on-read variable, say) calls ``take`` inside ``take`` on
        # the same thread, which must neither wait for itself nor see a buffer the outer call
        # is about to hand out: it gets a new buffer, which the pool does not keep.
        self._lock = threading.RLock()
        self._inside = False
        # Least recently used key first: dicts keep insertion order, and a used key is
        # re-inserted at the end.
        self._buckets: dict[_Key, list[_Memory]] = {}
        self._pooled = 0
        self._taken = self._reused = self._allocated = 0

    def take(self, shape: int | Sequence[int], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        """Return a new writeable, C-contiguous, uninitialised array of ``shape`` and ``dtype``.

        Its memory is a pooled buffer that nothing else refers to any more, if there is one;
        otherwise a new buffer, kept in the pool for later calls while ``per_key`` and
        ``max_bytes`` allow. A buffer that a caller, or anything made from what it was handed,
        still holds is never handed out again. Safe to call from several threads at once.

        Args:
            shape: the array shape (an int for 1-d).
            dtype: anything ``np.dtype`` accepts.

        Returns:
            The array; its contents are arbitrary.

        Raises:
            ValueError: a dimension is negative.
            TypeError: ``dtype`` is not a dtype.

        Example:
            >>> pool = BufferPool()
            >>> pool.take((2, 3), "float64").shape
            (2, 3)
        """
        # Every step's small outputs come here, and the pool keeps none of them: each check
        # is the cheapest that does it (a generic one costs more than the array).
        key_shape = (int(shape),) if isinstance(shape, _INTEGERS) else tuple(map(int, shape))
        if key_shape and min(key_shape) < 0:
            raise ValueError(f"negative dimensions are not allowed, got shape {key_shape}")
        dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        nbytes = math.prod(key_shape) * dt.itemsize
        if nbytes < self._min_bytes or nbytes > self._max_bytes:
            buffer = np.empty(key_shape, dt) if nbytes < HUGE_BYTES else empty_buffer(key_shape, dt)
            with self._lock:
                self._taken += 1
                self._allocated += 1
            return buffer
        key = (key_shape, dt)
        with self._lock:
            if not self._inside:  # else re-entered on this thread: a new buffer, kept out
                self._inside = True
                try:
                    bucket = self._buckets.pop(key, None)
                    if bucket is not None:
                        self._buckets[key] = bucket  # now the most recently used key
                        for i in range(len(bucket)):
                            if _refs(bucket, i) <= _FREE_REFS:
                                # The array refers to the owner before the lock is let go:
                                # from here on the buffer is busy to every other thread.
                                buffer = _array(bucket[i], key_shape, dt)
                                self._taken += 1
                                self._reused += 1
                                return buffer
                finally:
                    self._inside = False
        # A new buffer, made without the lock (a mapping takes system calls), and referred
        # to by its array before the pool can offer it to anyone else.
        memory = _memory(key_shape, dt)
        buffer = _array(memory, key_shape, dt)
        with self._lock:
            self._taken += 1
            self._allocated += 1
            if not self._inside:
                self._inside = True
                # In the pool before room is made, so that an exception meanwhile (a
                # KeyboardInterrupt) loses none of its buffers.
                bucket = self._buckets.pop(key, None) or []
                self._buckets[key] = bucket  # now the most recently used key
                try:
                    if len(bucket) < self._per_key and self._make_room(nbytes, key):
                        bucket.append(memory)
                        self._pooled += nbytes
                finally:
                    if not bucket:
                        self._buckets.pop(key, None)
                    self._inside = False
        return buffer

    def publish(self, buffer: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Mark ``buffer`` read-only and return it, ready to be shared by every replica.

        Views made from it afterwards are read-only too. Its memory goes back to the pool
        once nothing refers to it or to anything made from it; ``take`` then hands it out
        in a new array.

        Args:
            buffer: an array from ``take`` (any array works).

        Returns:
            ``buffer`` itself.

        Raises:
            TypeError: ``buffer`` is not a NumPy array.

        Example:
            >>> pool = BufferPool()
            >>> pool.publish(pool.take(3, "int64")).flags.writeable
            False
        """
        if not isinstance(buffer, np.ndarray):
            raise TypeError(f"publish takes a numpy.ndarray, got {type(buffer).__name__}")
        buffer.setflags(write=False)
        return buffer

    def clear(self) -> None:
        """Forget every pooled buffer; those still held by callers stay valid.

        Not from a finalizer or a signal handler (the library never calls it): one that runs
        inside a ``take`` on the same thread leaves the byte total counting the buffer that
        ``take`` was adding, until the next ``clear``.

        Example:
            >>> pool = BufferPool()
            >>> pool.clear()
            >>> pool.statistics().pooled_bytes
            0
        """
        with self._lock:
            self._buckets.clear()
            self._pooled = 0

    def statistics(self) -> PoolStatistics:
        """Return the pool's counters.

        Example:
            >>> BufferPool().statistics().taken
            0
        """
        with self._lock:
            return PoolStatistics(
                taken=self._taken,
                reused=self._reused,
                allocated=self._allocated,
                pooled_buffers=sum(len(b) for b in self._buckets.values()),
                pooled_bytes=self._pooled,
            )

    def _make_room(self, nbytes: int, keep: _Key) -> bool:
        """Drop free buffers, least recently used key first, until ``nbytes`` more fit.

        The bucket of ``keep`` (the key being served, whose buffers are all busy) is left alone.
        Called with the lock held.
        """
        if self._pooled + nbytes <= self._max_bytes:
            return True
        for key in list(self._buckets):
            if key == keep:
                continue
            bucket = self._buckets[key]
            size = math.prod(key[0]) * key[1].itemsize
            i = 0
            while i < len(bucket):
                if _refs(bucket, i) <= _FREE_REFS:
                    del bucket[i]
                    self._pooled -= size
                    if self._pooled + nbytes <= self._max_bytes:
                        if not bucket:
                            del self._buckets[key]
                        return True
                else:
                    i += 1
            if not bucket:
                del self._buckets[key]
        return False
