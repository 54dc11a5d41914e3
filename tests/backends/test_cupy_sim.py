"""The CuPy stand-in itself (``tests/cupy_sim``): each test shows one behaviour that the race
detector or the modelled CuPy API has, and would fail if the stand-in lost it.

Every test gets a fresh simulated machine with two GPUs (``cp``). A test that expects a race
catches the ``RaceError`` and then takes the race out of the machine's record (``races``), so
the fixtures that fail a test on an unreported race stay quiet.
"""

from __future__ import annotations

import contextlib
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from simulated_gpus import (
    races,
    simulated_cupy,
)

#: How long a test waits for a stream callback that must come (seconds).
CALLBACK_WAIT = 5.0


def line_of(tag: str) -> int:
    """The number of the line of this file that ends with the comment ``# <tag>``: the line of
    an operation that a race message must name."""
    lines = Path(__file__).read_text(encoding="utf-8").splitlines()
    (number,) = [n for n, text in enumerate(lines, 1) if text.endswith(f"  # {tag}")]
    return number


def at(line: int, function: str) -> str:
    """A pattern for how a race message names a source line of this file (after the path of
    the checkout, which the message leaves out)."""
    return rf"\(\S*tests/backends/test_cupy_sim\.py:{line} {function}\)"


def race_raised(cp: Any, excinfo: pytest.ExceptionInfo[Any]) -> str:
    """The message of the race ``excinfo`` caught, after checking it is the only race the
    machine recorded; the record is cleared."""
    message = str(excinfo.value)
    assert races(cp) == [message]
    return message


# -- the detector ---------------------------------------------------------------------------


class TestRaces:
    def test_write_then_read_on_another_stream_names_both_sides(self, cp: Any) -> None:
        """A read on B of what A wrote, with no edge: both streams, both operations and both
        source lines are in the message."""
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(4.0)  # the write of write-read
        with b, pytest.raises(cp._sim.RaceError) as excinfo:
            x + 1  # the read of write-read
        message = race_raised(cp, excinfo)
        name = "test_write_then_read_on_another_stream_names_both_sides"
        write_line, read_line = (
            line_of("the write of write-read"),
            line_of("the read of write-read"),
        )
        assert re.fullmatch(
            rf"data race on device memory: read by __add__ {at(read_line, name)} on stream 2 "
            rf"\(blocking\) of GPU 0 is not ordered after the write by arange "
            rf"{at(write_line, name)} on stream 1 \(blocking\) of GPU 0",
            message,
        )

    def test_an_event_orders_the_read_after_the_write(self, cp: Any) -> None:
        """``B.wait_event(A.record())`` between the write and the read: no race."""
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(4.0)
        b.wait_event(a.record())
        with b:
            y = x + 1
        np.testing.assert_array_equal(y.get(), [1.0, 2.0, 3.0, 4.0])

    def test_a_host_sync_orders_later_launches_after_the_write(self, cp: Any) -> None:
        """``A.synchronize()`` before launching on B: the host knows A's work is done."""
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(4.0)
        a.synchronize()
        with b:
            x + 1

    def test_a_write_after_an_unordered_read_races(self, cp: Any) -> None:
        """A read on B, then a write on A that B's read is not ordered before."""
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(4.0)
        b.wait_event(a.record())
        with b:
            x.sum()  # the read of read-write
        with a, pytest.raises(cp._sim.RaceError) as excinfo:
            x += 1  # the write of read-write
        message = race_raised(cp, excinfo)
        name = "test_a_write_after_an_unordered_read_races"
        write_line, read_line = (
            line_of("the write of read-write"),
            line_of("the read of read-write"),
        )
        assert re.fullmatch(
            rf"data race on device memory: write by __iadd__ {at(write_line, name)} on stream 1 "
            rf"\(blocking\) of GPU 0 is not ordered after the read by ndarray\.sum "
            rf"{at(read_line, name)} on stream 2 \(blocking\) of GPU 0",
            message,
        )

    def test_a_write_after_a_read_ordered_back_does_not_race(self, cp: Any) -> None:
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(4.0)
        b.wait_event(a.record())
        with b:
            x.sum()
        a.wait_event(b.record())
        with a:
            x += 1

    def test_two_unordered_writes_race(self, cp: Any) -> None:
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(4.0)
        with b, pytest.raises(cp._sim.RaceError) as excinfo:
            cp.add(0.0, 0.0, out=x)  # writes x, reads nothing
        message = race_raised(cp, excinfo)
        assert re.match(
            r"data race on device memory: write by add \(\S*tests/backends/test_cupy_sim\.py:",
            message,
        )
        assert "on stream 2 (blocking) of GPU 0 is not ordered after the write by arange" in (
            message
        )

    @pytest.mark.parametrize(
        "write",
        [
            pytest.param(lambda cp, x: x.fill(7.0), id="fill"),
            pytest.param(lambda cp, x: x.__setitem__(slice(None), 7.0), id="setitem"),
            pytest.param(lambda cp, x: cp.copyto(x, 7.0), id="copyto"),
        ],
    )
    def test_writes_in_place_are_writes(self, cp: Any, write: Any) -> None:
        """``fill``, ``x[...] = v`` and ``copyto`` write their target without reading it: an
        unordered one is a write-write race, and a later unordered read of it races too."""
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(4.0)
        with b, pytest.raises(cp._sim.RaceError, match=r"^data race on device memory: write by "):
            write(cp, x)
        races(cp)
        a.synchronize()
        with b:
            write(cp, x)
        with a, pytest.raises(cp._sim.RaceError, match=r"^data race on device memory: read by "):
            x * 1
        races(cp)

    def test_work_on_one_stream_is_in_program_order(self, cp: Any) -> None:
        a = cp.cuda.Stream(non_blocking=True)
        with a:
            x = cp.arange(4.0)
            x += 1
            x.sum()
            x.fill(2)


class TestLegacyDefaultStream:
    def test_orders_blocking_streams_both_ways(self, cp: Any) -> None:
        """The default stream waits for a blocking stream's work, and the blocking stream's
        later work waits for the default stream's."""
        a = cp.cuda.Stream()
        with a:
            x = cp.arange(4.0)
        y = x * 2  # on the default stream
        with a:
            y += 1
        np.testing.assert_array_equal(y.get(), [1.0, 3.0, 5.0, 7.0])

    @pytest.mark.parametrize("first", ["non-blocking", "default"])
    def test_does_not_order_a_non_blocking_stream(self, cp: Any, first: str) -> None:
        a = cp.cuda.Stream(non_blocking=True)
        with a if first == "non-blocking" else cp.cuda.Stream.null:
            x = cp.arange(4.0)
        with (
            cp.cuda.Stream.null if first == "non-blocking" else a,
            pytest.raises(cp._sim.RaceError) as excinfo,
        ):
            x * 2
        message = race_raised(cp, excinfo)
        names = ["the default stream of GPU 0", "stream 1 (non-blocking) of GPU 0"]
        if first == "default":
            names.reverse()
        reader, writer = map(re.escape, names)
        assert re.search(f"by __mul__ .* on {reader} is not ordered .* on {writer}$", message)

    def test_the_default_stream_of_one_gpu_does_not_order_another_gpus_stream(
        self, cp: Any
    ) -> None:
        """A blocking stream of GPU 1 writes; GPU 0's default stream reads: a race. GPU 1's
        own default stream would have been ordered."""
        with cp.cuda.Device(1):
            s1 = cp.cuda.Stream()
            with s1:
                x = cp.arange(4.0)
            x * 2  # GPU 1's default stream: ordered
        with (
            pytest.warns(cp._util.PerformanceWarning),
            pytest.raises(cp._sim.RaceError) as excinfo,
        ):
            x * 3
        message = race_raised(cp, excinfo)
        assert re.search(
            r"read by __mul__ .* on the default stream of GPU 0 is not ordered after the write "
            r"by arange .* on stream 1 \(blocking\) of GPU 1$",
            message,
        )


class TestPool:
    def test_a_block_read_elsewhere_is_reused_on_its_stream_without_the_back_edge(
        self, cp: Any
    ) -> None:
        """Allocated on A, read on B, dropped, allocated again on A with the same size: the
        same block, and the write on A is not ordered after B's read."""
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(64.0)
        b.wait_event(a.record())
        with b:
            x * 2
        del x
        with a, pytest.raises(cp._sim.RaceError) as excinfo:
            cp.zeros(64)
        message = race_raised(cp, excinfo)
        assert re.search(
            r"write by zeros .* on stream 1 .* not ordered after the read by __mul__ .* on "
            r"stream 2 \(blocking\) of GPU 0$",
            message,
        )

    def test_the_back_edge_makes_the_reuse_safe(self, cp: Any) -> None:
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(64.0)
        b.wait_event(a.record())
        with b:
            x * 2
        a.wait_event(b.record())
        freed = x.data.ptr
        del x
        with a:
            z = cp.zeros(64)
        assert z.data.ptr == freed

    @pytest.mark.parametrize("where", ["another size", "another stream"])
    def test_a_block_is_reused_only_for_its_size_and_stream(self, cp: Any, where: str) -> None:
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(64.0)
        b.wait_event(a.record())
        with b:
            x * 2
        freed = x.data.ptr
        del x
        with a if where == "another size" else b:
            z = cp.zeros(128 if where == "another size" else 64)
        assert z.data.ptr != freed

    def test_sizes_round_up_to_512_bytes(self, cp: Any) -> None:
        """Two sizes in one 512-byte unit share blocks, as CuPy's pool rounds them."""
        with cp.cuda.Stream():
            x = cp.zeros(3)
            freed = x.data.ptr
            del x
            assert cp.zeros(60).data.ptr == freed


class TestArraysAndDevices:
    def test_views_launch_no_kernel(self, cp: Any) -> None:
        """Slices, ``.T`` and a reshape of a contiguous array touch no memory: no race on an
        unordered stream, and no device check from another GPU."""
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(6.0).reshape(2, 3)
        with b:
            views = [x[1], x[:, 1:], x.T, x.reshape(3, 2), x.reshape(-1)]
        with cp.cuda.Device(1):
            views += [x[0], x.T]
        assert [v.data.ptr - x.data.ptr for v in views] == [24, 8, 0, 0, 0, 0, 0]
        assert {v.device.id for v in views} == {0}

    def test_a_kernel_on_an_array_of_another_gpu_warns_and_runs_on_the_current_one(
        self, cp: Any
    ) -> None:
        with cp.cuda.Device(1):
            x = cp.arange(4.0)
            done = cp.cuda.Stream.null.record()
        cp.cuda.Stream.null.wait_event(done)
        with pytest.warns(
            cp._util.PerformanceWarning,
            match=r"^The device where the array resides \(1\) is different from the current "
            r"device \(0\)\. Peer access has been activated automatically\.$",
        ):
            y = x + 1
        assert y.device.id == 0
        np.testing.assert_array_equal(y.get(), [1.0, 2.0, 3.0, 4.0])

    def test_the_kernel_runs_on_the_current_gpus_stream(self, cp: Any) -> None:
        """Without the event the read on GPU 0's default stream is not ordered after GPU 1's
        write: the kernel ran on GPU 0, not on the array's GPU."""
        with cp.cuda.Device(1):
            x = cp.arange(4.0)
        with (
            pytest.warns(cp._util.PerformanceWarning),
            pytest.raises(cp._sim.RaceError) as excinfo,
        ):
            x + 1
        assert "read by __add__" in race_raised(cp, excinfo)

    def test_copy_of_an_array_of_another_gpu_lands_on_the_current_gpu(self, cp: Any) -> None:
        with cp.cuda.Device(1):
            x = cp.arange(6.0).reshape(2, 3)
            cp.cuda.Device(1).synchronize()
        y = x.copy()
        assert y.device.id == 0
        np.testing.assert_array_equal(y.get(), np.arange(6.0).reshape(2, 3))

    def test_copy_of_a_non_contiguous_array_of_another_gpu_is_not_ordered(self, cp: Any) -> None:
        """``ndarray.copy()`` makes the array contiguous on its own GPU's current stream, then
        copies on the current GPU's, and CuPy orders nothing between the two."""
        with cp.cuda.Device(1):
            x = cp.arange(6.0).reshape(2, 3)
            cp.cuda.Device(1).synchronize()
        with pytest.raises(cp._sim.RaceError) as excinfo:
            x[:, ::2].copy()
        assert re.search(
            r"read by copy between devices .* on the default stream of GPU 0 is not ordered "
            r"after the write by astype .* on the default stream of GPU 1$",
            race_raised(cp, excinfo),
        )

    def test_cupy_copy_of_a_non_contiguous_array_of_another_gpu_is_not_implemented(
        self, cp: Any
    ) -> None:
        """``cupy.copy`` keeps order 'K', so nothing makes the array contiguous first."""
        with cp.cuda.Device(1):
            x = cp.arange(6.0).reshape(2, 3)
        with pytest.raises(
            NotImplementedError, match=r"^CuPy cannot copy non-contiguous array between devices\.$"
        ):
            cp.copy(x[:, ::2])


class TestGet:
    def test_the_default_stream_means_the_arrays_gpus(self, cp: Any) -> None:
        """``get()`` with GPU 0 current of an array GPU 1's default stream wrote: read on GPU
        1's default stream, so ordered."""
        with cp.cuda.Device(1):
            x = cp.arange(4.0)
        np.testing.assert_array_equal(x.get(), [0.0, 1.0, 2.0, 3.0])

    def test_it_reads_on_the_current_stream(self, cp: Any) -> None:
        with cp.cuda.Device(1):
            x = cp.arange(4.0)
            s = cp.cuda.Stream(non_blocking=True)
            with s, pytest.raises(cp._sim.RaceError) as excinfo:
                x.get()
        message = race_raised(cp, excinfo)
        assert re.search(
            r"read by device-to-host copy \(get\) .* on stream 1 \(non-blocking\) of GPU 1 is "
            r"not ordered after the write by arange .* on the default stream of GPU 1$",
            message,
        )

    def test_it_waits_for_the_copy_on_the_host(self, cp: Any) -> None:
        """After ``get()`` on A, work launched on B is ordered after A's work."""
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(4.0)
            x.get()
        with b:
            x.fill(0)

    def test_allow_synchronize_false_catches_get_and_device_synchronize(self, cp: Any) -> None:
        """As CuPy's syncdetect: ``get()`` (and what calls it) and ``Device.synchronize()``
        raise, a stream's ``synchronize()`` does not; entering the block warns."""
        import cupyx

        a = cp.cuda.Stream()
        with a:
            x = cp.arange(4.0)
        with contextlib.ExitStack() as disallowed:
            with pytest.warns(UserWarning, match=r"^cupyx\.allow_synchronize will be removed"):
                disallowed.enter_context(cupyx.allow_synchronize(False))
            with pytest.raises(
                cupyx.DeviceSynchronized,
                match=r"^Device synchronization was detected while disallowed\.",
            ):
                x.get()
            with pytest.raises(cupyx.DeviceSynchronized):
                float(x[0])
            with pytest.raises(cupyx.DeviceSynchronized):
                cp.cuda.Device(0).synchronize()
            a.synchronize()
            cp.cuda.Stream.null.synchronize()
            assert cp.zeros(0).get().shape == (0,)  # no copy, no sync
        np.testing.assert_array_equal(x.get(), [0.0, 1.0, 2.0, 3.0])


class TestCopyToHostAsync:
    """``MemoryPointer.copy_to_host_async`` into ``cupyx.empty_pinned`` memory, as CUDA copies
    into page-locked memory: queued on a stream, no host synchronization."""

    @pytest.mark.parametrize("learn", ["synchronize", "done", "callback"])
    def test_the_bytes_land_once_the_host_learns_the_copy_is_done(
        self, cp: Any, learn: str
    ) -> None:
        """Until then they read ``0xFF`` (NaN here), as a read too early may on a GPU."""
        import cupyx

        s = cp.cuda.Stream()
        with s:
            x = cp.arange(4.0)
        out = cupyx.empty_pinned((4,), np.float64)
        x.data.copy_to_host_async(out.ctypes.data, out.nbytes, s)
        assert np.isnan(out).all()
        if learn == "synchronize":
            s.synchronize()
        elif learn == "done":
            assert s.record().done
        else:
            called = threading.Event()
            s.add_callback(lambda stream, status, arg: arg.set(), called)
            assert called.wait(CALLBACK_WAIT)
        np.testing.assert_array_equal(out, [0.0, 1.0, 2.0, 3.0])

    def test_it_declares_no_synchronization(self, cp: Any) -> None:
        """``cupyx.allow_synchronize(False)`` lets it through (it does not block the host)."""
        import cupyx

        s = cp.cuda.Stream()
        with s:
            x = cp.arange(3, dtype=cp.int32)
        out = cupyx.empty_pinned((3,), np.int32)
        with contextlib.ExitStack() as disallowed:
            with pytest.warns(UserWarning, match=r"^cupyx\.allow_synchronize will be removed"):
                disallowed.enter_context(cupyx.allow_synchronize(False))
            x.data.copy_to_host_async(out.ctypes.data, out.nbytes, s)
        s.synchronize()
        np.testing.assert_array_equal(out, [0, 1, 2])

    def test_into_ordinary_memory_the_host_waits_for_it(self, cp: Any) -> None:
        """CUDA copies into pageable memory synchronously: the bytes are there when the call
        returns, and the host has waited for the stream (work launched on another stream
        afterwards is ordered after the copy's stream)."""
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(3.0)
        out = np.zeros(3)
        x.data.copy_to_host_async(out.ctypes.data, out.nbytes, a)
        np.testing.assert_array_equal(out, [0.0, 1.0, 2.0])
        with b:
            x.fill(0)  # no race: the host waited for a

    def test_a_copy_into_memory_dropped_before_it_lands_is_recorded(self, cp: Any) -> None:
        """The page-locked buffer went back (to CuPy's pool, which may hand it out again)
        while the copy still ran: recorded, not written into freed memory."""
        import cupyx

        s = cp.cuda.Stream()
        with s:
            x = cp.arange(4.0)
        out = cupyx.empty_pinned((4,), np.float64)
        address = out.ctypes.data
        x.data.copy_to_host_async(address, out.nbytes, s)
        del out
        s.synchronize()
        assert races(cp) == [
            f"a device-to-host copy into page-locked memory at {address:#x} finished after "
            "the memory was dropped"
        ]

    def test_a_copy_on_a_stream_not_ordered_after_the_write_races(self, cp: Any) -> None:
        a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        with a:
            x = cp.arange(4.0)
        out = np.empty(4)
        with pytest.raises(cp._sim.RaceError) as excinfo:
            x.data.copy_to_host_async(out.ctypes.data, out.nbytes, b)
        assert re.search(
            r"read by device-to-host copy \(copy_to_host_async\) .* is not ordered after the "
            r"write by arange",
            race_raised(cp, excinfo),
        )


class TestStreamStacks:
    def test_with_a_stream_of_another_device_raises(self, cp: Any) -> None:
        with cp.cuda.Device(1):
            s = cp.cuda.Stream()
        with pytest.raises(
            RuntimeError,
            match=r"^The device that the stream is created on \(1\) does not match with the "
            r"current device \(0\)$",
        ):
            s.__enter__()
        with pytest.raises(RuntimeError, match=r"does not match"):
            s.use()
        assert cp.cuda.get_current_stream() is cp.cuda.Stream.null

    def test_use_is_forgotten_by_the_next_with_exit(self, cp: Any) -> None:
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        a.use()
        assert cp.cuda.get_current_stream() is a
        with b:
            assert cp.cuda.get_current_stream() is b
        assert cp.cuda.get_current_stream() is cp.cuda.Stream.null

    def test_nested_with_blocks_restore_in_order(self, cp: Any) -> None:
        a, b, c = cp.cuda.Stream(), cp.cuda.Stream(), cp.cuda.Stream()
        seen = []
        with a:
            with b:
                with c:
                    seen.append(cp.cuda.get_current_stream())
                seen.append(cp.cuda.get_current_stream())
            seen.append(cp.cuda.get_current_stream())
        seen.append(cp.cuda.get_current_stream())
        assert seen == [c, b, a, cp.cuda.Stream.null]

    def test_each_device_has_its_own_current_stream(self, cp: Any) -> None:
        a = cp.cuda.Stream()
        with cp.cuda.Device(1):
            b = cp.cuda.Stream()
        with a:
            with cp.cuda.Device(1), b:
                assert cp.cuda.get_current_stream() is b
                assert cp.cuda.get_current_stream(0) is a
            assert cp.cuda.get_current_stream() is a
            assert cp.cuda.get_current_stream(1) is cp.cuda.Stream.null


class TestEvents:
    def test_recording_on_a_stream_of_another_gpu_raises(self, cp: Any) -> None:
        with cp.cuda.Device(1):
            s1 = cp.cuda.Stream()
        event = cp.cuda.Event()  # made on GPU 0
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError) as excinfo:
            event.record(s1)
        assert excinfo.value.status == 400
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError):
            s1.record()  # a new event on the current device, GPU 0

    def test_a_stream_may_wait_on_an_event_of_another_gpu(self, cp: Any) -> None:
        with cp.cuda.Device(1):
            x = cp.arange(4.0)
            done = cp.cuda.Stream.null.record()
        cp.cuda.Stream.null.wait_event(done)
        with pytest.warns(cp._util.PerformanceWarning):
            x + 1


class TestCallbacks:
    def test_a_callback_gets_stream_status_and_arg_on_another_thread_after_earlier_work(
        self, cp: Any
    ) -> None:
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(4.0)
        called = threading.Event()
        got: list[Any] = []

        def callback(stream: Any, status: int, arg: Any) -> None:
            got.append((stream, status, arg, threading.current_thread()))
            called.set()

        arg = object()
        a.add_callback(callback, arg)
        assert called.wait(CALLBACK_WAIT)
        ((stream, status, passed, thread),) = got
        assert (stream, status, passed) == (a, 0, arg)
        assert thread is not threading.current_thread()
        with b:
            x.fill(0)  # the host learnt A's work was done: ordered

    def test_dropped_callbacks_are_never_called(self, cp: Any) -> None:
        """A callback queued while callbacks are dropped never runs, though one queued after
        it (on the same driver thread, in order) does."""
        a = cp.cuda.Stream()
        world = cp._sim.world()
        calls: list[str] = []
        later = threading.Event()
        world.drop_callbacks = True
        a.add_callback(lambda stream, status, arg: calls.append(arg), "dropped")
        world.drop_callbacks = False

        def kept(stream: Any, status: int, arg: str) -> None:
            calls.append(arg)
            later.set()

        a.add_callback(kept, "kept")
        assert later.wait(CALLBACK_WAIT)
        assert calls == ["kept"]

    def test_a_dropped_callback_tells_the_host_nothing(self, cp: Any) -> None:
        a, b = cp.cuda.Stream(), cp.cuda.Stream()
        with a:
            x = cp.arange(4.0)
        cp._sim.world().drop_callbacks = True
        a.add_callback(lambda stream, status, arg: None, None)
        with b, pytest.raises(cp._sim.RaceError) as excinfo:
            x.fill(0)
        assert "by fill" in race_raised(cp, excinfo)

    def test_a_failed_device_reports_its_status(self, cp: Any) -> None:
        a = cp.cuda.Stream()
        with a:
            cp.arange(4.0)
        world = cp._sim.world()
        world.fail_status = 700
        called = threading.Event()
        statuses: list[int] = []

        def callback(stream: Any, status: int, arg: Any) -> None:
            statuses.append(status)
            called.set()

        a.add_callback(callback, None)
        assert called.wait(CALLBACK_WAIT)
        assert statuses == [700]
        assert not a.done
        assert not a.record().done
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="cudaErrorIllegalAddress"):
            a.synchronize()
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError) as excinfo:
            cp.cuda.Device(0).synchronize()
        assert excinfo.value.status == 700

    def test_busy_queries_answer_not_yet_that_many_times(self, cp: Any) -> None:
        a = cp.cuda.Stream()
        with a:
            cp.arange(4.0)
        event = a.record()
        cp._sim.world().busy_queries = 3
        assert [a.done, event.done, a.done, a.done, event.done] == [
            False,
            False,
            False,
            True,
            True,
        ]


# -- NCCL -----------------------------------------------------------------------------------


def _on(cp: Any, gpu: int, values: Any) -> Any:
    with cp.cuda.Device(gpu):
        return cp.asarray(np.asarray(values, dtype=np.float64))


class TestNccl:
    def test_init_all_gives_one_communicator_per_gpu(self, cp: Any) -> None:
        from cupy.cuda import nccl

        comms = nccl.NcclCommunicator.initAll([0, 1])
        assert [(c.rank_id(), c.device_id(), c.size()) for c in comms] == [(0, 0, 2), (1, 1, 2)]

    def test_init_all_takes_a_list_or_a_count_not_a_tuple(self, cp: Any) -> None:
        from cupy.cuda import nccl

        assert len(nccl.NcclCommunicator.initAll(2)) == 2
        with pytest.raises(ValueError, match="should be an int or a list of int"):
            nccl.NcclCommunicator.initAll((0, 1))

    def test_collectives_in_a_group_give_numpys_answer(self, cp: Any) -> None:
        from cupy.cuda import nccl

        comms = nccl.NcclCommunicator.initAll([0, 1])
        hosts = [np.arange(5.0), np.arange(5.0) * 10]
        sends = [_on(cp, gpu, hosts[gpu]) for gpu in (0, 1)]
        sums = [_on(cp, gpu, np.zeros(5)) for gpu in (0, 1)]
        copies = [_on(cp, gpu, np.zeros(5)) for gpu in (0, 1)]
        nccl.groupStart()
        for rank in (0, 1):
            comms[rank].allReduce(
                sends[rank].data.ptr, sums[rank].data.ptr, 5, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 0
            )
            comms[rank].broadcast(
                sends[rank].data.ptr, copies[rank].data.ptr, 5, nccl.NCCL_FLOAT64, 1, 0
            )
        nccl.groupEnd()
        for rank in (0, 1):
            np.testing.assert_array_equal(sums[rank].get(), hosts[0] + hosts[1])
            np.testing.assert_array_equal(copies[rank].get(), hosts[1])

    def test_a_count_past_the_end_of_a_buffer_names_the_allocation(self, cp: Any) -> None:
        from cupy.cuda import nccl

        comms = nccl.NcclCommunicator.initAll([0, 1])
        bufs = [_on(cp, gpu, np.zeros(64)) for gpu in (0, 1)]
        nccl.groupStart()
        for rank in (0, 1):
            ptr = bufs[rank].data.ptr
            comms[rank].allReduce(ptr, ptr, 65, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 0)
        with pytest.raises(cp._sim.SimulationError) as excinfo:
            nccl.groupEnd()
        assert str(excinfo.value).startswith(
            f"NCCL allReduce rank 0: 520 bytes from {bufs[0].data.ptr:#x} run past the end of "
            f"the 512-byte allocation at {bufs[0].data.ptr:#x} ("
        )

    def test_a_call_outside_a_group_with_two_ranks_would_hang(self, cp: Any) -> None:
        from cupy.cuda import nccl

        comms = nccl.NcclCommunicator.initAll([0, 1])
        buf = _on(cp, 0, np.zeros(4))
        with pytest.raises(cp._sim.SimulationError, match=r"^NCCL would hang: a allReduce call"):
            comms[0].allReduce(buf.data.ptr, buf.data.ptr, 4, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 0)

    def test_a_group_with_an_unmatched_call_raises_at_its_end(self, cp: Any) -> None:
        from cupy.cuda import nccl

        comms = nccl.NcclCommunicator.initAll([0, 1])
        bufs = [_on(cp, gpu, np.zeros(4)) for gpu in (0, 1)]
        nccl.groupStart()
        for rank in (0, 1):
            ptr = bufs[rank].data.ptr
            comms[rank].allReduce(ptr, ptr, 4, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 0)
        comms[1].broadcast(bufs[1].data.ptr, bufs[1].data.ptr, 4, nccl.NCCL_FLOAT64, 0, 0)
        with pytest.raises(cp._sim.SimulationError, match=r"^NCCL would hang: ranks \[1\] made"):
            nccl.groupEnd()
        np.testing.assert_array_equal(bufs[0].get(), np.zeros(4))  # the matched pair ran

    def test_a_buffer_on_the_wrong_gpu_raises(self, cp: Any) -> None:
        from cupy.cuda import nccl

        comms = nccl.NcclCommunicator.initAll([0, 1])
        bufs = [_on(cp, 1, np.zeros(4)), _on(cp, 1, np.zeros(4))]
        nccl.groupStart()
        for rank in (0, 1):
            ptr = bufs[rank].data.ptr
            comms[rank].allReduce(ptr, ptr, 4, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 0)
        with pytest.raises(
            cp._sim.SimulationError,
            match=rf"^NCCL allReduce rank 0: buffer {bufs[0].data.ptr:#x} is on GPU 1, the "
            r"communicator's GPU is 0$",
        ):
            nccl.groupEnd()

    @pytest.mark.parametrize("collective", [True, False])
    def test_a_collective_orders_its_ranks_streams(self, cp: Any, collective: bool) -> None:
        """Rank 0's stream wrote ``x`` before the collective; rank 1's stream reads it after
        it: ordered by the collective, a race without it."""
        from cupy.cuda import nccl

        comms = nccl.NcclCommunicator.initAll([0, 1])
        s0 = cp.cuda.Stream(non_blocking=True)
        with cp.cuda.Device(1):
            s1 = cp.cuda.Stream(non_blocking=True)
        with s0:
            x = cp.arange(4.0)
        bufs = [_on(cp, gpu, np.zeros(4)) for gpu in (0, 1)]
        for stream, buf in zip((s0, s1), bufs, strict=True):
            with cp.cuda.Device(buf.device.id):
                stream.wait_event(cp.cuda.Stream.null.record())
        if collective:
            nccl.groupStart()
            for rank, stream in enumerate((s0, s1)):
                ptr = bufs[rank].data.ptr
                comms[rank].allReduce(ptr, ptr, 4, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, stream.ptr)
            nccl.groupEnd()
        with cp.cuda.Device(1), s1:
            if collective:
                with pytest.warns(cp._util.PerformanceWarning):
                    x + 1
            else:
                with (
                    pytest.warns(cp._util.PerformanceWarning),
                    pytest.raises(cp._sim.RaceError) as excinfo,
                ):
                    x + 1
        if not collective:
            assert "on stream 2 (non-blocking) of GPU 1 is not ordered" in race_raised(cp, excinfo)


def test_without_nccl_importing_it_warns_and_it_is_not_available() -> None:
    with simulated_cupy(2, nccl=False):
        with pytest.warns(UserWarning, match=r"(?i)nccl library could not be loaded"):
            from cupy.cuda import nccl
        assert nccl.available is False
        assert not hasattr(nccl, "NcclCommunicator")  # CuPy's stub has only ``available``
