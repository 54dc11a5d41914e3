"""Tests for one BufferPool used by several threads at once.

The host backend, and so its pool, is one per process: every thread that runs an event loop of
its own (a threaded server calling ``anyio.run`` per request) takes its outputs from it. Each
test stops one thread's ``take`` right after it has found a pooled buffer free, and lets
another thread's ``take`` run meanwhile, where two threads would otherwise both find it free.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

from aioreplica import MirroredStrategy
from aioreplica._backends import _hostreduce
from aioreplica._backends._hostreduce import BufferPool
from aioreplica.testing import replica_context

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy.typing as npt

#: How long the stopped ``take`` waits for the other thread's ``take`` to look at the same
#: buffer. The pool lets the other one in only after the first has handed its buffer out, so
#: this is what each test costs when it passes; a pool that let it in does so at once.
STALL_S = 1.0


class StalledCheck:
    """Stands in for the pool's test of whether a buffer is free: the first check on the
    current thread calls ``let_other_go`` and waits until a check on ``other`` has happened
    too (at most ``STALL_S``). Records which thread checked, in order."""

    def __init__(self, other: threading.Thread, let_other_go: Callable[[], object]) -> None:
        self.stalled, self.other = threading.current_thread(), other
        self.let_other_go = let_other_go
        self.checks: list[str] = []
        self._checked = threading.Event()
        self._refs = _hostreduce._refs

    def __call__(self, bucket: list[Any], i: int) -> int:
        count = self._refs(bucket, i)
        thread = threading.current_thread()
        if thread is self.other:
            self.checks.append("other")
            self._checked.set()
        elif thread is self.stalled and not self.checks:
            self.checks.append("stalled")
            self.let_other_go()
            self._checked.wait(STALL_S)
        return count


class TestTake:
    def test_a_buffer_found_free_goes_to_one_thread(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """While one thread's take holds a pooled buffer it found free but has not handed out
        yet, another thread's take does not get that buffer: each gets memory of its own, and
        the pool counts one reuse and two new buffers, and keeps both."""
        pool = BufferPool(min_bytes=0)
        pool.take((64,), np.float32)  # one pooled buffer, free again at once
        got: dict[str, npt.NDArray[Any]] = {}

        def take(name: str) -> None:
            got[name] = pool.take((64,), np.float32)

        other = threading.Thread(target=take, args=("other",))
        check = StalledCheck(other, other.start)
        monkeypatch.setattr(_hostreduce, "_refs", check)
        take("stalled")
        other.join(STALL_S * 10)
        assert check.checks == ["stalled", "other"]
        assert not np.shares_memory(got["stalled"], got["other"])
        stats = pool.statistics()
        assert (stats.taken, stats.reused, stats.allocated) == (3, 1, 2)
        assert (stats.pooled_buffers, stats.pooled_bytes) == (2, 2 * 64 * 4)


class TestOnOneThread:
    def test_a_take_inside_a_take_neither_waits_nor_shares(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A take that runs inside another on the same thread (a finalizer or a signal
        handler that reduces, which Python may run between any two bytecodes) returns at
        once, with memory of its own that the pool does not keep: the outer take still gets
        the free buffer it found."""
        pool = BufferPool(min_bytes=0)
        pool.take((64,), np.float32)  # one pooled buffer, free again at once
        refs = _hostreduce._refs
        inner: list[npt.NDArray[Any]] = []

        def check(bucket: list[Any], i: int) -> int:
            count = refs(bucket, i)
            if not inner:  # the outer take has looked at the free buffer: re-enter now
                inner.append(pool.take((64,), np.float32))
            return count

        monkeypatch.setattr(_hostreduce, "_refs", check)
        outer = pool.take((64,), np.float32)
        assert not np.shares_memory(outer, inner[0])
        stats = pool.statistics()
        assert (stats.taken, stats.reused, stats.allocated, stats.pooled_buffers) == (3, 1, 2, 1)

    def test_an_interrupt_while_making_room_loses_no_buffer(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A KeyboardInterrupt while a take makes room for a new buffer leaves the pool as it
        was: every buffer it held is still there, counted, and reused once free."""
        pool = BufferPool(min_bytes=0, max_bytes=2 * 256)
        held = pool.take((64,), np.float32)  # 256 bytes, kept in the pool, held here
        pool.take((32,), np.float64)  # 256 bytes of another key, free: room can be made
        refs = _hostreduce._refs

        def interrupted(bucket: list[Any], i: int) -> int:
            if sys._getframe(1).f_code.co_name == "_make_room":
                raise KeyboardInterrupt  # while room is made, after the key's own scan
            return refs(bucket, i)

        monkeypatch.setattr(_hostreduce, "_refs", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pool.take((64,), np.float32)  # the held one is busy: a new one needs room
        monkeypatch.setattr(_hostreduce, "_refs", refs)
        stats = pool.statistics()
        assert (stats.pooled_buffers, stats.pooled_bytes) == (2, 512)
        del held
        pool.take((64,), np.float32)
        pool.take((32,), np.float64)
        assert pool.statistics().reused == 2


class TestEventLoopsInThreads:
    # Sizes no other test uses, so that the one pooled buffer of their key is the test's.
    @pytest.mark.parametrize(
        ("stalled_loop", "other_loop", "size"),
        [("asyncio", "trio", 20_011), ("trio", "asyncio", 20_021)],
    )
    def test_each_loop_gets_its_own_result(
        self, monkeypatch: pytest.MonkeyPatch, stalled_loop: str, other_loop: str, size: int
    ) -> None:
        """Two threads, each with its own event loop and strategy, reduce at the same moment
        through the process's one host pool: each gets its own sum, in memory of its own."""
        first = MirroredStrategy(["cpu:0", "cpu:1"])
        second = MirroredStrategy(["cpu:2", "cpu:3"])
        go = threading.Event()
        got: dict[str, npt.NDArray[Any]] = {}

        async def step(value: float) -> Any:
            return await replica_context().all_reduce("sum", np.full(size, value))

        async def reduce(strategy: MirroredStrategy, value: float, loop: str) -> None:
            got[loop] = await strategy.run(step, args=(value,))

        async def reduce_when_told() -> None:
            await anyio.to_thread.run_sync(go.wait, STALL_S * 10)
            await reduce(second, 20.0, other_loop)

        other = threading.Thread(
            target=anyio.run, args=(reduce_when_told,), kwargs={"backend": other_loop}
        )
        anyio.run(reduce, first, 0.0, stalled_loop, backend=stalled_loop)  # pools one buffer
        del got[stalled_loop]  # which is free again
        other.start()
        check = StalledCheck(other, go.set)
        monkeypatch.setattr(_hostreduce, "_refs", check)
        try:
            anyio.run(reduce, first, 1.0, stalled_loop, backend=stalled_loop)
        finally:
            go.set()
            other.join(STALL_S * 10)
            first.close()
            second.close()
        assert check.checks == ["stalled", "other"]
        assert not np.shares_memory(got[stalled_loop], got[other_loop])
        sums = {loop: np.unique(result).tolist() for loop, result in got.items()}
        assert sums == {stalled_loop: [2.0], other_loop: [40.0]}
